"""The memory plan against measured bytes, the choice it makes, the micro-batch finder, the chart
and the CLI.

The accuracy test: the forecast's model-state terms (params, grads, optim, master) for the tiny GPT
on 2 ranks match what `lightspeed.runtime.memory.measure` reports on the busiest rank after a real
fit, within 5%, for every strategy. The 2-rank runs happen once per module (fixture `measured`), in
one launched job (helpers.run_jobs: the ranks start once): the strategy `auto` picks under a budget,
then every strategy in fp32 and the half-precision layouts, each a fit of 3 steps (the optimizer
states exist after the first).
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from torch.utils.data import DataLoader

import lightspeed as ls
from helpers import run_jobs
from lightspeed.demos.gpt import SIZES, ByteWindows, stdlib_corpus
from lightspeed.plan.candidates import build_candidates
from lightspeed.plan.chart import write_chart
from lightspeed.plan.choice import auto_strategy, choose
from lightspeed.plan.cli import plan_cli
from lightspeed.plan.forecast import forecast
from lightspeed.plan.micro_batch_fit import confirm_micro_batch, find_micro_batch
from lightspeed.plan.probe import inspect_model, saved_activation_bytes
from lightspeed.runtime.memory import CATEGORIES, measure

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
TORCH = ["ddp", "ddp_sharded", "fsdp", "fsdp_grad_op"]
DEEPSPEED = ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"] if HAS_DEEPSPEED else []
MICRO_BATCH = 8  # tests/workload.py's batch_size
# (strategy, precision) runs: every strategy in fp32, and the half-precision layouts (DeepSpeed's
# bf16 weights
# and gradient partitions beside fp32 master weights; bf16-true's bf16 states) once each.
RUNS = (
    [(name, "32-true") for name in TORCH + DEEPSPEED]
    + [("ddp_sharded", "bf16-true")]
    + ([("deepspeed_stage_3", "bf16-mixed")] if HAS_DEEPSPEED else [])
)


def gpt():
    from workload import Workload

    return Workload({})  # the module the workload trains: tiny GPT, bias-free, AdamW in two groups


def sample_batch(n: int = MICRO_BATCH):
    data = ByteWindows(stdlib_corpus(60_000), SIZES["tiny"].block_size)
    return next(iter(DataLoader(data, batch_size=n)))


@pytest.fixture(scope="module")
def facts():
    return inspect_model(gpt(), sample_batch(), "32-true")


def _budget_ruling_out_ddp(facts) -> float:
    """Device bytes between DDP's forecast and the smallest sharded one (after the 10% headroom)."""
    rows = {f.candidate.name: f for f in forecast(gpt(), 2, micro_batch=1, facts=facts)}
    sharded = min(rows[n].device_total for n in TORCH[1:] + DEEPSPEED)
    assert sharded < rows["ddp"].device_total
    return (sharded + rows["ddp"].device_total) / 2 / 0.9


@pytest.fixture(scope="module")
def measured(tmp_path_factory, facts):
    """Per strategy, rank 0's result of a 2-rank fit with memory=True (busiest rank's bytes in
    'bytes')."""
    picked, _ = auto_strategy(
        gpt(),
        2,
        "32-true",
        1,
        "cpu",
        memory_budget=_budget_ruling_out_ddp(facts),
        batch=sample_batch(),
        show=False,
    )
    jobs = {
        # The same budget through the Trainer: strategy="auto" plans before the ranks start (the
        # first job), then trains.
        "auto": dict(
            strategy="auto",
            devices=2,
            max_steps=3,
            batch_size=1,  # the micro-batch planned for
            memory_budget=_budget_ruling_out_ddp(facts),
        ),
        **{
            f"{name}-{precision}": dict(
                strategy=name, devices=2, max_steps=3, memory=True, precision=precision
            )
            for name, precision in RUNS
        },
    }
    runs = run_jobs(tmp_path_factory.mktemp("measured"), jobs)
    out = {"auto_pick": picked, "auto_run": runs["auto"]}
    for name, precision in RUNS:
        result = runs[f"{name}-{precision}"]
        result["bytes"] = {c: max(rank[c] for rank in result["memory"]) for c in CATEGORIES}
        out[name, precision] = result
    return out


@pytest.mark.parametrize("name,precision", RUNS)
def test_model_states_match_measured_within_5_percent(measured, facts, name, precision):
    got = measured[name, precision]["bytes"]
    rows = forecast(gpt(), 2, precision, micro_batch=MICRO_BATCH, facts=facts)
    [want] = [f for f in rows if f.candidate.name == name]
    for term in CATEGORIES:
        expected = getattr(want, term)
        assert expected == pytest.approx(got[term], rel=0.05, abs=0), (
            f"{name} {term}: forecast {expected}, measured {got[term]}"
        )


def test_single_device_matches_measured(facts):
    """single runs in this process: one fit step, one more forward/backward, then measure (as the
    workload)."""
    ls.seed_everything(0)
    module = gpt()
    trainer = ls.Trainer(
        strategy="single",
        devices=1,
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir="/tmp",
    )
    loader = DataLoader(
        ByteWindows(stdlib_corpus(60_000), SIZES["tiny"].block_size), batch_size=MICRO_BATCH
    )
    trainer.fit(module, loader)
    trainer.strategy.backward(trainer.strategy.forward(module._loss, next(iter(loader))))
    got = measure(trainer.strategy)
    [want] = forecast(
        gpt(), 1, micro_batch=MICRO_BATCH, facts=facts, candidates=build_candidates(1)[:1]
    )
    for term in CATEGORIES:
        assert getattr(want, term) == pytest.approx(got[term], rel=0.05, abs=0), term


def test_auto_picks_ddp_with_room_and_a_sharded_strategy_that_trains_under_a_budget(measured):
    name, table = auto_strategy(
        gpt(), 2, "32-true", 1, "cpu", memory_budget=2**30, batch=sample_batch(), show=False
    )
    assert name == "ddp" and table.row_count > 1
    picked = measured["auto_pick"]
    assert picked in TORCH[1:] + DEEPSPEED, picked  # sharded: DDP was ruled out by the budget
    run = measured["auto_run"]  # Trainer(strategy="auto", memory_budget=...) on 2 ranks, 3 steps
    assert run["strategy"] == picked and run["global_step"] == 3
    assert all(math.isfinite(x) for x in run["losses"]) and run["losses"][-1] < run["losses"][0]


def test_activation_probe_is_measured_and_scales(facts):
    act = facts.activations
    assert act.is_probed and act.per_sample > 0
    # Checkpointing keeps block inputs only: less per sample than keeping everything.
    assert 0 < act.ac_per_sample < act.per_sample
    # The line fitted at micro-batch 1 and 2 predicts micro-batch 8, measured directly.
    assert act.at(MICRO_BATCH) == pytest.approx(
        saved_activation_bytes(gpt(), sample_batch()), rel=0.02
    )


def test_activation_probe_under_autocast_leaves_weight_copies_out():
    """Autocast's bf16 copies of the weights are saved for backward too; they are the weight cache
    (a buffer), not activations: the probe's line then starts near 0 instead of at 2 bytes per
    parameter."""
    facts = inspect_model(gpt(), sample_batch(), "bf16-mixed")
    assert (
        facts.activations.base < 0.2 * 2 * facts.numel
    )  # with the copies it would exceed 2 bytes per parameter
    direct = saved_activation_bytes(gpt(), sample_batch(), "bf16-mixed")
    assert facts.activations.at(MICRO_BATCH) == pytest.approx(direct, rel=0.02)


def test_nothing_fits_names_the_smallest_requirement_and_the_memory(facts):
    rows = forecast(gpt(), 2, micro_batch=1, facts=facts)
    smallest = min(f.device_total for f in rows)
    with pytest.raises(
        ls.ConfigError, match=r"smallest requirement is .* per device .* are available"
    ):
        choose(rows, device_bytes=smallest / 2, host_bytes=2**30, show=False)


def test_choice_is_the_fastest_that_fits_and_the_table_marks_it(facts, capsys):
    rows = forecast(gpt(), 2, micro_batch=1, facts=facts)
    choice = choose(rows, device_bytes=2**30, host_bytes=2**30)
    assert choice.name == "ddp"
    printed = capsys.readouterr().out
    assert "◀" in printed and "chosen: ddp" in printed
    # The speed order the issue asks for: no sharding > ZeRO-2 / grad-op > ZeRO-3 / FSDP > offload.
    order = [f.candidate.name for f in choice.ordered]
    for faster, slower in [
        ("ddp", "deepspeed_stage_2"),
        ("fsdp_grad_op", "fsdp"),
        ("deepspeed_stage_2", "fsdp"),
        ("deepspeed_stage_3", "deepspeed_stage_2_offload"),
        ("fsdp", "fsdp_offload"),
    ]:
        if faster in order and slower in order:
            assert order.index(faster) < order.index(slower), (faster, slower)


def test_micro_batch_finder_is_the_largest_that_fits(facts):
    rows = {f.candidate.name: f for f in forecast(gpt(), 2, micro_batch=1, facts=facts)}
    ddp = rows["ddp"]
    fixed = (
        ddp.params + ddp.optim + ddp.master + ddp.buffers
    )  # gradients are freed before the next forward
    budget = (fixed + facts.activations.base + 20.5 * facts.activations.per_sample) / 0.9
    found = find_micro_batch(gpt(), sample_batch(), 2, "ddp", budget)
    assert found.size == 20 and "forecast only" in found.note
    with pytest.raises(ls.ConfigError, match="not even 1 fits"):
        find_micro_batch(gpt(), sample_batch(), 2, "ddp", fixed / 2)


def test_confirming_halves_after_out_of_memory_until_a_step_runs():
    """The recovery loop on its own (no GPU here): a step that runs out of memory above 5
    samples."""
    tried = []

    def step(n):
        tried.append(n)
        if n > 5:
            raise torch.cuda.OutOfMemoryError(f"{n} samples do not fit")

    assert confirm_micro_batch(step, 32) == 4 and tried == [32, 16, 8, 4]
    with pytest.raises(torch.cuda.OutOfMemoryError):
        confirm_micro_batch(lambda n: step(n + 10), 2)


def test_chart_is_a_png_with_one_bar_per_candidate(facts, tmp_path):
    from PIL import Image

    rows = forecast(gpt(), 2, micro_batch=4, facts=facts)
    path = write_chart(rows, tmp_path / "plan", device_limit=1e6)
    with Image.open(path) as img:
        assert img.format == "PNG" and img.width > 400 and img.height > 300


def test_cli_prints_the_plan_and_writes_the_chart(tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(
        "import dataclasses, torch\n"
        "from lightspeed.demos.gpt import SIZES, GPTModule\n"
        "def Model():\n    return GPTModule(dataclasses.replace(SIZES['tiny'], bias=False))\n"
        "def sample():\n    return torch.zeros(2, 32, dtype=torch.long), torch.zeros(2, 32, "
        "dtype=torch.long)\n"
        "if __name__ == '__main__':\n    raise SystemExit('the training part must not run')\n"
    )
    out = tmp_path / "out"
    code = plan_cli(
        [
            f"{script}:Model",
            "--batch",
            "sample",
            "--devices",
            "2",
            "--micro-batch",
            "4",
            "--device-memory",
            "1GiB",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert code == 0 and "chosen: ddp" in printed and (out / "memory_plan.png").is_file()
    assert (
        plan_cli(
            [f"{script}:Model", "--devices", "2", "--device-memory", "10KiB", "--out", str(out)]
        )
        == 2
    )
    assert "fits under no strategy" in capsys.readouterr().out
    assert plan_cli([f"{script}:Missing", "--out", str(out)]) == 2
    assert "'Missing' is not defined" in capsys.readouterr().out


def test_bad_input_is_a_config_error():
    with pytest.raises(ls.ConfigError, match="devices=0"):
        forecast(gpt(), 0)
    with pytest.raises(ls.ConfigError, match="precision='fp8'"):
        forecast(gpt(), 2, precision="fp8")
    with pytest.raises(ls.ConfigError, match="strategy='zero9'"):
        find_micro_batch(gpt(), sample_batch(), 2, "zero9", 2**30)


def test_mixed_precision_terms_follow_each_backend_dtypes(facts):
    """bf16-mixed: torch strategies keep fp32 weights and grads (plus autocast's bf16 weight cache
    as a buffer); DeepSpeed keeps bf16 weights and gradient partitions beside its fp32 master
    partition."""
    full = {f.candidate.name: f for f in forecast(gpt(), 2, "32-true", 1, facts=facts)}
    mixed = {f.candidate.name: f for f in forecast(gpt(), 2, "bf16-mixed", 1, facts=facts)}
    assert (
        mixed["ddp"].params == full["ddp"].params
        and mixed["ddp"].buffers == full["ddp"].params // 2
    )
    if HAS_DEEPSPEED:
        assert mixed["deepspeed_stage_2"].params == full["deepspeed_stage_2"].params // 2
        assert mixed["deepspeed_stage_2"].master == full["deepspeed_stage_2"].master


def test_accumulation_keeps_gradients_beside_activations(facts):
    once = {f.candidate.name: f for f in forecast(gpt(), 2, micro_batch=4, facts=facts)}
    accumulating = {
        f.candidate.name: f for f in forecast(gpt(), 2, micro_batch=4, facts=facts, accumulate=4)
    }
    f = once["ddp"]
    assert f.device_total == f.params + f.optim + f.buffers + max(f.grads, f.activations)
    assert (
        accumulating["ddp"].device_total == f.params + f.optim + f.buffers + f.grads + f.activations
    )


# --------------------------------------------------------------------------------------------------
# micro_batch="auto"

MICRO_BATCH_SCRIPT = """
import dataclasses, json, sys, torch
from torch.utils.data import DataLoader
import lightspeed as ls
from lightspeed.demos.gpt import SIZES, GPTModule, ByteWindows, stdlib_corpus

class Model(GPTModule):
    def __init__(self, batch_size=2):
        super().__init__(dataclasses.replace(SIZES["tiny"], bias=False))
        self.batch_size = batch_size
    def train_dataloader(self):
        return DataLoader(ByteWindows(stdlib_corpus(60_000), 32), batch_size=self.batch_size)

if __name__ == "__main__":
    model = Model()
    trainer = ls.Trainer(strategy="auto", devices=2, accelerator="cpu", micro_batch="auto",
                         memory_budget=float(sys.argv[1]), max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, seed=0)
    trainer.fit(model)
    batch = next(iter(model.train_dataloader()))
    # One write per line: rank 1's output is relayed through rank 0's stdout, so print's separate writes of
    # "RANK", " ", the JSON and the newline could interleave with the other rank's line.
    sys.stdout.write("RANK " + json.dumps({"rank": trainer.global_rank, "batch_size": model.batch_size,
                                          "rows": len(batch[0]), "strategy": trainer.strategy.name,
                                          "step": trainer.global_step}) + "\\n")
    sys.stdout.flush()
"""


def test_micro_batch_auto_on_2_ranks_takes_the_forecasts_largest(tmp_path):
    """strategy="auto", micro_batch="auto" under an 8 MB budget: DDP fits at the starting
    micro-batch 2, and every rank trains at the forecast's largest micro-batch for DDP, which a real
    step confirmed."""
    from helpers import launch
    from lightspeed.plan.micro_batch import candidate_of
    from lightspeed.plan.micro_batch_fit import largest_micro_batch
    from lightspeed.strategies import build_strategy

    budget = 8e6
    script = tmp_path / "train.py"
    script.write_text(MICRO_BATCH_SCRIPT)
    run = launch([str(script), str(budget)], tmp_path, "python", 2, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    ranks = [json.loads(line[5:]) for line in run.stdout.splitlines() if line.startswith("RANK ")]
    import runpy

    scope = runpy.run_path(str(script), run_name="__plan__")
    facts = inspect_model(
        scope["Model"](), scope["Model"]().train_dataloader().__iter__().__next__()
    )
    want = largest_micro_batch(
        candidate_of(build_strategy("ddp", 2), 2), facts, 2, "32-true", budget
    )
    assert want > 8 and len(ranks) == 2, run.stdout[-3000:]
    for r in ranks:
        assert r == {
            "rank": r["rank"],
            "batch_size": want,
            "rows": want,
            "strategy": "ddp",
            "step": 2,
        }
    assert "micro_batch='auto'" in run.stdout and f"micro_batch: {want} under ddp" in run.stdout


class Quadratic(ls.Module):
    """Saved activations grow with the square of the micro-batch (an n×n product): the probe's line,
    fitted at micro-batch 1 and 2, underestimates large micro-batches, so the real step is what
    stops it."""

    def __init__(self, batch_size: int = 4):
        super().__init__()
        self.batch_size = batch_size

    def configure_model(self):
        self.net = torch.nn.Linear(64, 64)

    def train_dataloader(self):
        return DataLoader(
            torch.utils.data.TensorDataset(torch.randn(2048, 64)), batch_size=self.batch_size
        )

    def training_step(self, batch, batch_idx):
        h = self.net(batch[0])
        return (h @ h.T).tanh().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_micro_batch_auto_recovers_from_out_of_memory_and_frees_each_trial():
    """On CPU the budget is enforced on real allocations: the forecast's size goes past it, the
    trial is freed (its model copy collected) and the search bisects down to the largest size that
    ran; fit then trains there."""
    import functools

    import lightspeed.loop
    from lightspeed.plan.micro_batch import confirm, plan_micro_batch
    from lightspeed.runtime.launch import read_dist_info

    budget = 3e5
    trainer = ls.Trainer(
        strategy="single",
        devices=1,
        accelerator="cpu",
        micro_batch="auto",
        memory_budget=budget,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    module = Quadratic()
    plan = plan_micro_batch(module, None, trainer.strategy, 1, trainer.config.plan)
    trainer.strategy.connect(trainer.config.run_spec(True), read_dist_info(), torch.device("cpu"))
    trial_step = functools.partial(lightspeed.loop.trial_step, trainer._run)  # the loop's window
    assert confirm(plan, trainer.strategy, module, trial_step) == module.batch_size
    runs = [t for t in plan.trials if t.confirmed is not None]
    first = runs[-1]  # rows in size order: the forecast's own size is the largest tried
    assert first.size == plan.size and first.confirmed is False and "out of memory" in first.note
    size = module.batch_size
    assert size == max(t.size for t in runs if t.confirmed) and 1 < size < plan.size
    assert {t.size: t for t in plan.trials}[size + 1].confirmed is False  # bisected to the edge
    assert all(t.freed for t in runs) and len(runs) <= trainer.config.plan.micro_batch_trials
    # The quadratic term is real: directly measured, size fits the budget and the forecast's size
    # does not.
    states = plan.forecast(1).forecast_bytes - plan.facts.activations.at(1)
    assert states + saved_activation_bytes(Quadratic(), [torch.randn(plan.size, 64)]) > budget
    # Inside fit, "power" mode: halving from the forecast's size until a step runs (Lightning's mode
    # name).
    trainer = ls.Trainer(
        strategy="single",
        devices=1,
        accelerator="cpu",
        micro_batch="power",
        memory_budget=budget,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    model = Quadratic()
    trainer.fit(model)
    halved = next(plan.size >> k for k in range(12) if plan.size >> k <= size)
    assert model.batch_size == halved and trainer.global_step == 2


def test_micro_batch_bad_input_is_a_config_error_before_any_rank_starts():
    for bad in (0, "big"):
        with pytest.raises(ls.ConfigError, match=rf"micro_batch={bad!r} is not valid: use 'auto'"):
            ls.Trainer(micro_batch=bad)

    class NoBatchSize(Quadratic):
        def __init__(self):
            ls.Module.__init__(self)

        def train_dataloader(self):
            return DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 64)), batch_size=4)

    trainer = ls.Trainer(
        devices=2, accelerator="cpu", micro_batch="auto", logger=False, enable_progress_bar=False
    )
    with pytest.raises(
        ls.ConfigError, match=r"micro_batch='auto' needs a batch size .*self.batch_size"
    ):
        trainer.fit(NoBatchSize())
    with pytest.raises(ls.ConfigError, match=r"micro_batch='auto' rebuilds the training loader"):
        trainer.fit(Quadratic(), Quadratic().train_dataloader())
    assert trainer.dist is None  # refused before any rank started


class ManualNoBatchIdx(ls.Module):
    """Manual optimization with `training_step(self, batch)`, as Lightning allows (examples/gan.py's
    shape)."""

    automatic_optimization = False

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g)), batch_size=8
        )

    def training_step(self, batch):
        opt = self.optimizers()
        loss = self.net(batch[0]).pow(2).mean()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        self.log("loss", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class AutomaticNoBatchIdx(ManualNoBatchIdx):
    automatic_optimization = True

    def training_step(self, batch):
        return self.net(batch[0]).pow(2).mean()


def _planning_trainer(accelerator="cpu", **kw):
    # memory_budget makes strategy="auto" plan on CPU too (on CUDA it always does): the probe runs
    # before any rank
    return ls.Trainer(
        strategy="auto",
        devices=1,
        accelerator=accelerator,
        memory_budget=2**30,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **kw,
    )


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_planning_calls_a_training_step_without_batch_idx_as_the_loop_does(accelerator):
    """The planner's probe and trial steps pass `batch_idx` only where `training_step` takes it, as
    the loop does: a step written `training_step(self, batch)` failed in the probe (TypeError)
    before training started."""
    module = AutomaticNoBatchIdx()
    before = module.net.weight.detach().clone()
    trainer = _planning_trainer(accelerator)
    trainer.fit(
        module, module.train_dataloader()
    )  # loaders passed to fit: strategy="auto" plans from them
    assert trainer.global_step == 3 and not torch.equal(before, module.net.weight.detach().cpu())


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_planning_a_manual_optimization_module_leaves_its_step_unprobed(capsys, accelerator):
    """Under manual optimization training_step runs its own backward and optimizer steps, which a
    probe on a copy cannot: the planner says so, chooses from the model states, and the fit trains
    (found by running examples/gan.py on a GPU with the default strategy="auto")."""
    module = ManualNoBatchIdx()
    before = module.net.weight.detach().clone()
    trainer = _planning_trainer(accelerator)
    trainer.fit(module, module.train_dataloader())
    assert (
        "uses manual optimization, so the planner does not run its training_step"
        in capsys.readouterr().out
    )
    assert trainer.global_step == 3 and not torch.equal(before, module.net.weight.detach().cpu())


def test_micro_batch_auto_under_manual_optimization_is_refused_before_any_rank_starts():
    trainer = _planning_trainer(micro_batch="auto")
    with pytest.raises(
        ls.ConfigError,
        match=r"micro_batch='auto' needs automatic optimization: .*"
        r"ManualNoBatchIdx sets automatic_optimization=False",
    ):
        trainer.fit(ManualNoBatchIdx())  # micro_batch="auto" rebuilds the module's own loader
    assert trainer.dist is None


class ReadsItsTrainer(AutomaticNoBatchIdx):
    """Lightning habits that reach the Trainer from the step: a OneCycleLR sized by
    `self.trainer.max_steps`, the learning rate logged from `self.optimizers()` and
    `self.lr_schedulers()`."""

    def __init__(self):
        super().__init__()
        self.batch_size = 8  # what micro_batch="auto" rewrites

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        return DataLoader(
            torch.utils.data.TensorDataset(torch.randn(32, 8, generator=g)),
            batch_size=self.batch_size,
        )

    def training_step(self, batch):
        self.log("lr", self.optimizers().param_groups[0]["lr"])
        self.log("sched_lr", self.lr_schedulers().get_last_lr()[0])
        self.log("progress", self.global_step / self.trainer.max_steps)
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.1, total_steps=self.trainer.max_steps
        )
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("micro_batch", [None, "auto"])
def test_planning_runs_a_step_that_reaches_its_trainer(micro_batch, accelerator):
    """The probe's copy (and each micro-batch trial's) sees a stand-in Trainer with the copy's own
    optimizers and schedulers and the real Trainer's arguments: `self.optimizers()` in the step
    failed there ("'ProbeTrainer' object has no attribute 'strategy'") before training started, on
    every GPU run with strategy="auto"."""
    module = ReadsItsTrainer()
    trainer = _planning_trainer(
        accelerator, micro_batch=micro_batch
    )  # on a GPU the trials are CUDA steps
    trainer.fit(module, None if micro_batch else module.train_dataloader())
    assert trainer.global_step == 3
    assert float(trainer.callback_metrics["lr"]) == pytest.approx(
        float(trainer.callback_metrics["sched_lr"])
    )
    assert float(trainer.callback_metrics["progress"]) == pytest.approx(2 / 3)
