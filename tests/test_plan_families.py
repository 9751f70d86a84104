"""The forecast's transient peaks, the choice between plans of equal speed, and the fallback when a
chosen plan runs out of memory at setup (issue 38). CPU tests; the six-family check on a GPU is
benchmarks/planner_families.py (docs/planning.md has its table), its smallest form a `gpu` test.

    .venv/bin/python -m pytest -q -n 1 tests/test_plan_families.py
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from helpers import ROOT, launch
from lightspeed.plan.candidates import Candidate, build_candidates
from lightspeed.plan.choice import MARGIN, auto_choice, choose, speed_order
from lightspeed.plan.fallback import restore, set_up_or_fall_back, snapshot
from lightspeed.plan.forecast import Forecast, forecast, forecast_candidate
from lightspeed.plan.micro_batch import planned_strategy
from lightspeed.plan.probe import inspect_model

HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
GIB = 2**30


def row(name: str, device: float, host: float = 0.0) -> Forecast:
    """A forecast of `device` GiB (all of it weights) for the named candidate."""
    by_name = {c.name: c for c in build_candidates(1) + build_candidates(2)}
    return Forecast(by_name[name], int(device * GIB), 0, 0, 0, 0, 0, int(host * GIB))


class Blocks(torch.nn.Module):
    """A decoder-like stack: an embedding, repeated blocks, a head; built in `__init__`."""

    def __init__(self, d: int = 32, layers: int = 3, vocab: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(layers))
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(h)


def test_ties_go_to_headroom():
    # Issue 38: stage 1 and stage 2 offload have one speed; stage 2 leaves more memory free.
    one, two = row("deepspeed_stage_1_offload", 13.11), row("deepspeed_stage_2_offload", 11.83)
    choice = choose([one, two], device_bytes=16 * GIB, host_bytes=500 * GIB, show=False)
    assert choice.name == "deepspeed_stage_2_offload"
    assert [f.candidate.name for f in choice.fallbacks] == ["deepspeed_stage_1_offload"]


def test_a_plan_short_of_the_margin_ranks_below_one_of_equal_speed_only():
    limit = 10 * GIB
    tight = row("deepspeed_stage_1", (1 - MARGIN / 2) * 10)  # fits the headroom, not the margin
    roomy = row("deepspeed_stage_2", (1 - MARGIN * 2) * 10)
    assert tight.candidate.speed == roomy.candidate.speed
    names = [f.candidate.name for f in speed_order([tight, roomy], limit)]
    assert names == ["deepspeed_stage_2", "deepspeed_stage_1"]
    # Speed still comes first: a faster plan short of the margin stays ahead of a slower one.
    fast = row("single", (1 - MARGIN / 2) * 10)
    assert speed_order([roomy, fast], limit)[0] is fast
    # Without the memory, the old order (speed, then the smaller total).
    assert speed_order([tight, roomy])[0] is roomy


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_transient_terms_are_in_the_forecast():
    model = Blocks(d=64, layers=4, vocab=512)
    numel = sum(p.numel() for p in model.parameters())
    facts = inspect_model(_as_module(model), torch.randint(0, 512, (2, 8)), "bf16-mixed")
    rows = {f.candidate.name: f for f in forecast(_as_module(model), 1, "bf16-mixed", facts=facts)}
    # ZeRO-1/2 flatten the bf16 weights into one buffer while the weights exist: 2 × 2 bytes. The
    # copy yields (DeepSpeed makes it on the host where the cap leaves no room: room.py), so it
    # is shown but does not set the peak; ZeRO-3's does.
    for name in ("deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_2_offload"):
        f = rows[name]
        assert f.setup_buffers == 2 * numel and f.setup_yields
        assert f.params + f.setup_buffers == 4 * numel
        lean = replace(f, activations=0, buffers=0, grads=0, optim=0, master=0, step_buffers=0)
        assert lean.device_total == f.params  # not params + the flatten copy
    assert not rows["deepspeed_stage_3"].setup_yields
    # ZeRO-3's partitions are copied into a flat buffer and a block is gathered.
    assert rows["deepspeed_stage_3"].setup_buffers >= 2 * numel
    # The host side: the CPU copy the model was built in, the probe's copy and its gradients.
    assert facts.built_bytes == 4 * numel and facts.probe_bytes == 8 * numel
    assert rows["single"].host_setup >= 12 * numel
    # Offload: pinned buffers are rounded up to a power of two, pageable ones are not.
    c = Candidate("deepspeed_stage_2", offload_optimizer=True)
    pinned = forecast_candidate(c, facts, 1, "bf16-mixed", 1, pinned=True).host
    pageable = forecast_candidate(c, facts, 1, "bf16-mixed", 1, pinned=False).host
    assert pageable == (4 + 4 + 2 + 8) * numel  # master, fp32 grads, bf16 staging, Adam states
    assert pinned > pageable
    assert rows["deepspeed_stage_2_offload"].host_peak >= pinned


def test_a_consolidating_save_is_a_moment_of_its_own():
    facts = inspect_model(_as_module(Blocks()), None, "32-true")
    f = forecast_candidate(Candidate("ddp_sharded"), facts, 2, "32-true", 1)
    whole = forecast_candidate(Candidate("ddp"), facts, 2, "32-true", 1)
    # ZeRO-1 gathers the other rank's optimizer state on rank 0 to save: the whole state then.
    assert f.optim + f.save_buffers == pytest.approx(whole.optim, rel=0.01)
    assert f.device_total >= f.model_states + f.save_buffers


def _as_module(net: torch.nn.Module):
    import lightspeed as ls

    class Wrapped(ls.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return self.net(batch).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    return Wrapped()


class Attempt:
    """A stand-in strategy for the fallback function's contract: `fork()`, `teardown()`,
    `measure()`; its setup moves the module's weights (as a real setup does)."""

    def __init__(self, name: str, log: list):
        self.name, self.log, self.is_set_up = name, log, False

    def fork(self):
        self.log.append(f"fork {self.name}")
        return self

    def teardown(self):
        self.log.append(f"teardown {self.name}")

    def measure(self):
        return {"params": 0}


def test_fallback_restores_the_module_and_tries_the_next_plan_after_a_real_oom():
    module = _as_module(Blocks())
    before = {k: v.clone() for k, v in module.state_dict().items()}
    first_weight = module.net.embed.weight
    log: list = []

    def set_up(s):
        for p in module.parameters():  # what DeepSpeed does: weights cast, in new tensors
            p.data = p.data.to(torch.bfloat16)
        if s.name == "first":
            torch.empty(2**62, dtype=torch.uint8)  # a real allocation the host cannot make
        s.is_set_up = True

    got, first = set_up_or_fall_back(
        Attempt("first", log),
        module,
        set_up,
        ("second",),
        lambda n: Attempt(n, log),
        None,
        log.append,
    )
    assert got.name == "second" and got.is_set_up
    assert first is not None and first.name == "second" and first.names == ()
    assert log[:2] == ["fork first", "teardown first"]
    assert any(re.search(r"first failed at setup after [\d.]+ s \(out of memory", x) for x in log)
    assert "trying second" in next(line for line in log if "failed" in line)
    # The second attempt started from the module as it was: fp32 weights, the same values.
    assert module.net.embed.weight is not first_weight
    for k, v in module.state_dict().items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, before[k].to(torch.bfloat16))


def test_a_user_chosen_strategy_keeps_its_error_and_names_a_plan(capsys):
    module = _as_module(Blocks())
    lines: list = []

    def set_up(s):
        torch.empty(2**62, dtype=torch.uint8)

    with pytest.raises(RuntimeError, match="can.t allocate memory"):  # the error, unchanged
        set_up_or_fall_back(
            Attempt("ddp", lines),
            module,
            set_up,
            None,
            lambda n: None,
            None,
            lines.append,
            lambda: "lightspeed plan: fsdp would fit",
        )
    assert lines == ["lightspeed plan: fsdp would fit"]


def test_snapshot_shares_tensors_and_restore_undoes_a_wrapper():
    module = _as_module(Blocks())
    kept = snapshot(module)
    assert kept.net.embed.weight.data_ptr() == module.net.embed.weight.data_ptr()
    assert kept.net.embed.weight is not module.net.embed.weight
    module.net.blocks[0] = torch.nn.Identity()  # an attempt's change in place
    module.register_forward_hook(lambda *a: None)
    restore(module, kept)
    assert isinstance(module.net.blocks[0], torch.nn.Linear) and not module._forward_hooks


def test_auto_falls_back_on_2_ranks_when_the_chosen_plan_runs_out_of_memory(tmp_path):
    fell_back = _fallback_run(tmp_path, "fell_back.json")
    # the line says how long the failed attempt took and its release: the fallback's own cost
    line = re.search(r"ddp failed at setup after ([\d.]+) s \(out of memory.*released in ([\d.]+) s",
                     fell_back["stdout"])  # fmt: skip
    assert line, fell_back["stdout"]
    assert fell_back["strategy"] != "ddp" and len(fell_back["losses"]) == 3
    # The same budget with the forecast left honest chooses that plan first: the fallback started
    # from the weights and random state that run starts from, so the losses are the same.
    direct = _fallback_run(tmp_path, "direct.json", "honest")
    assert "failed at setup" not in direct["stdout"]
    assert direct["strategy"] == fell_back["strategy"]
    assert direct["losses"] == fell_back["losses"]


def test_auto_falls_back_on_2_ranks_when_the_chosen_plan_runs_out_of_memory_in_a_step(tmp_path):
    fell_back = _fallback_run(tmp_path, "steps_fell_back.json", "steps")
    out = fell_back["stdout"]
    assert re.search(r"ddp ran out of memory in step 1 \(out of memory:.*released in [\d.]+ s", out)
    assert "failed at setup" not in out
    assert fell_back["strategy"] != "ddp" and len(fell_back["losses"]) == 3
    # ddp stepped the module's own tensors before the verdict: the next plan still starts from the
    # weights (and random state) a run that chose it first starts from, so the losses are the same.
    direct = _fallback_run(tmp_path, "steps_direct.json", "honest", "steps")
    assert "out of memory" not in direct["stdout"]
    assert direct["strategy"] == fell_back["strategy"]
    assert direct["losses"] == fell_back["losses"]


def _fallback_run(tmp_path, name: str, *flags: str) -> dict:
    out = tmp_path / name
    done = launch(["tests/fallback_script.py", str(out), *flags], cwd=ROOT, nproc=2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(out.read_text()), "stdout": done.stdout}


@pytest.mark.gpu
def test_six_families_train_under_a_cap_on_a_gpu(tmp_path):
    """The benchmark's smallest form: two families under their caps, each trained by `auto`."""
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/planner_families.py",
            "--only",
            "gpt2,vit",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    rows = json.loads((tmp_path / "planner_families.json").read_text())
    for r in rows:
        assert "error" not in r and r["trained"], r
        assert r["plain"] > 0.9 * r["cap"]  # plain training does not fit the cap
        assert r["forecast"] == pytest.approx(r["measured"], rel=0.15)


class MLPBlocks(torch.nn.Module):
    """An embedding, then blocks that keep 4× wider activations inside (what checkpointing drops)."""

    def __init__(self, d: int = 64, layers: int = 4, vocab: int = 256):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
            )
            for _ in range(layers)
        )

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + block(h)
        return h


def test_auto_ranks_plans_with_their_micro_batch_by_forecast_tokens_per_second(capsys):
    module = _as_module(MLPBlocks())
    ids = torch.randint(0, 256, (1, 64))
    facts = inspect_model(module, ids, "32-true")
    ddp = forecast_candidate(Candidate("ddp"), facts, 2, "32-true", 1)
    # room for ddp's states and a few samples' activations
    budget = (ddp.model_states + ddp.buffers + 6 * ddp.activations) / 0.9
    choice = auto_choice(
        module, 2, "32-true", 1, "cpu", budget, facts=facts, show=True, max_micro_batch=4096
    )
    rows = {f.candidate.name: f for f in choice.ordered}
    # each plan at the largest micro-batch it fits; checkpointing fits more samples
    assert rows["fsdp+ac"].micro_batch > rows["fsdp"].micro_batch > 1
    for f in choice.ordered:
        limit = budget * 0.9
        if f.device_total <= limit:
            bigger = forecast_candidate(f.candidate, facts, 2, "32-true", f.micro_batch + 1)
            assert bigger.device_total > limit or f.micro_batch == 4096
    # fastest first: tokens/s never rises down the table (equal within its 1% steps)
    speeds = [f.tokens_per_s for f in choice.ordered]
    assert all(b <= a * 1.011 for a, b in zip(speeds, speeds[1:]))
    assert choice.forecast is choice.ordered[0] or choice.ordered[0].device_total > budget * 0.9
    printed = capsys.readouterr().out
    assert "tok/s" in printed and " mb " in printed
    # a "+ac" plan is a strategy object that checkpoints the repeated blocks
    fsdp_ac = planned_strategy("fsdp+ac", 2, module)
    assert fsdp_ac.name == "fsdp" and fsdp_ac.activation_checkpointing == [torch.nn.Sequential]


def test_a_gpu_first_trial_keeps_the_margin_free_a_cpu_one_the_headroom():
    from lightspeed.plan.choice import first_micro_batch
    from lightspeed.plan.micro_batch_fit import largest_micro_batch

    module = _as_module(MLPBlocks())
    facts = inspect_model(module, torch.randint(0, 256, (1, 64)), "32-true")
    c = Candidate("fsdp")
    one = forecast_candidate(c, facts, 2, "32-true", 1)
    budget = 3 * one.device_total
    gpu = first_micro_batch(c, facts, 2, "32-true", budget, "cuda")
    cpu = first_micro_batch(c, facts, 2, "32-true", budget, "cpu")
    assert cpu == largest_micro_batch(c, facts, 2, "32-true", budget, 0.1) > gpu > 1
    assert forecast_candidate(c, facts, 2, "32-true", gpu).device_total <= budget * (1 - MARGIN)
    assert forecast_candidate(c, facts, 2, "32-true", gpu + 1).device_total > budget * (1 - MARGIN)
    # a budget the margin leaves no micro-batch in: the headroom's answer
    tight = one.device_total / 0.85
    assert first_micro_batch(c, facts, 2, "32-true", tight, "cuda") >= 1


def test_a_plan_on_four_devices_lists_fsdp_with_tensor_parallelism_divided_by_tp():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )
    llama = transformers.LlamaForCausalLM(cfg)

    class Causal(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = llama

        def forward(self, ids):
            return self.model(input_ids=ids).logits

    module = _as_module(Causal())
    facts = inspect_model(module, torch.randint(0, 256, (1, 32)), "32-true")
    # the model's own tp_plan splits every projection, the embedding and the head; norms stay whole
    norms = sum(p.numel() for n, p in llama.named_parameters() if "norm" in n)
    assert facts.tp_numel == facts.numel - norms
    budget = 4 * 2**20
    choice = auto_choice(module, 4, "32-true", 4, "cpu", budget, facts=facts, show=False)
    rows = {f.candidate.name: f for f in choice.ordered}
    assert {"fsdp_tp2", "fsdp_tp4"} <= rows.keys()
    fsdp, tp2 = rows["fsdp"], rows["fsdp_tp2"]
    # parameters: the split ones / 2 on each TP rank, the rest whole, then sharded over 2 dp ranks
    local = math.ceil((norms + math.ceil(facts.tp_numel / 2)) / 2)
    assert tp2.params == local * 4 and tp2.grads == local * 4
    # activations: what the blocks save divided by tp (the rest whole)
    line = facts.activations
    inside = line.inside_base + 4 * line.inside_per_sample
    assert tp2.activations == round(fsdp.activations - inside / 2) < fsdp.activations
    assert rows["fsdp_tp4"].activations < tp2.activations
    fsdp_tp = planned_strategy("fsdp_tp2", 4, module)
    assert fsdp_tp.name == "fsdp_tp2" and fsdp_tp.tp == 2


# A micro-batch trial under DeepSpeed whose setup or backward raises torch's out-of-memory error.
# DeepSpeed runs for real (one CPU rank); a torch dispatch mode raises the error at the first
# allocation of the flat bf16 buffer ZeRO's setup builds ("setup"), or at the third matrix product
# of the backward ("backward"), as the caching allocator would, and keeps a weak reference to every
# tensor made meanwhile. In its own process: DeepSpeed's global state stays out of the test's.
TRIAL_SCRIPT = """
import functools, gc, json, sys, weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

import lightspeed as ls
import lightspeed.loop
from lightspeed.plan import micro_batch as mb
from lightspeed.runtime.launch import read_dist_info


class Blocks(ls.LightningModule):
    def __init__(self, batch_size=4):
        super().__init__()
        self.batch_size = batch_size
        self.embed = torch.nn.Embedding(64, 64)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(6))
        self.head = torch.nn.Linear(64, 64)

    def training_step(self, batch, batch_idx):
        h = self.embed(batch)
        for b in self.blocks:
            h = torch.relu(b(h))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), batch.flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        return DataLoader(torch.randint(0, 64, (64, 16)), batch_size=self.batch_size)


class OutOfMemoryAt(TorchDispatchMode):
    def __init__(self, where, flat_bytes):
        super().__init__()
        self.where, self.flat_bytes, self.products, self.raised = where, flat_bytes, 0, False
        self.made = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.made.append(weakref.ref(out))
            if not self.raised and self.where == "setup":
                self.raised = out.untyped_storage().nbytes() >= self.flat_bytes
            in_backward = torch._C._current_graph_task_id() != -1
            if not self.raised and self.where == "backward" and in_backward:
                self.products += func is torch.ops.aten.mm.default
                self.raised = self.products == 3
            if self.raised and self.where != "done":
                self.where = "done"
                raise torch.OutOfMemoryError(f"{func}: no memory left (injected)")
        return out


def engines():
    kinds = ("DeepSpeedEngine", "DeepSpeedZeroOptimizer")
    return sum(type(o).__name__ in kinds for o in gc.get_objects())


trainer = ls.Trainer(strategy="deepspeed_stage_2", devices=1, accelerator="cpu",
                     micro_batch="auto", precision="bf16-mixed", max_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
module = Blocks()
plan = mb.plan_micro_batch(module, None, trainer.strategy, 1, trainer.config.plan)
trainer.strategy.connect(trainer.config.run_spec(True), read_dist_info(), torch.device("cpu"))
step = functools.partial(lightspeed.loop.trial_step, trainer._run)
flat = sum(p.numel() for p in module.parameters()) * 2  # ZeRO's flat bf16 copy
out = {}
for where in ("setup", "backward"):
    mode = OutOfMemoryAt(where, 0.9 * flat)
    with mode:
        ran, freed, note = mb.try_steps(plan, trainer.strategy, module, 4, step)
    alive = [r() for r in mode.made]
    alive = [t for t in alive if t is not None and t.untyped_storage().nbytes() > 0]
    out[where] = dict(ran=ran, freed=freed, note=note, made=len(mode.made), alive=len(alive),
                      alive_bytes=sum(t.untyped_storage().nbytes() for t in alive),
                      engines=engines())
    del alive, mode
ran, freed, note = mb.try_steps(plan, trainer.strategy, module, 4, step)
out["next"] = dict(ran=ran, freed=freed, engines=engines())
print("RESULT " + json.dumps(out), flush=True)
"""


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_a_deepspeed_trial_that_runs_out_of_memory_leaves_no_tensor_alive(tmp_path):
    """Issue 38: a failed DeepSpeed trial on one H200 left 3.5 GiB allocated and every smaller
    trial failed after it. A backward that raises left its graph alive, held from C++ (DeepSpeed's
    hooks on the loss), and through the trial's saved-tensor hook the engine, its optimizer and the
    activations: the trial's saved tensors are now boxed and let go (fallback.SavedBoxes)."""
    (tmp_path / "trial_oom.py").write_text(TRIAL_SCRIPT)
    run = launch([str(tmp_path / "trial_oom.py")], tmp_path, nproc=1)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    out = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))[7:])
    for where in ("setup", "backward"):
        r = out[where]
        assert not r["ran"] and r["freed"] and "out of memory" in r["note"], r
        assert r["made"] > 50, r  # DeepSpeed built (and the step ran) before the error
        # not one tensor made during the trial is alive: the flat buffers, the fp32 partition,
        # the activations, ZeRO's bucket; and no engine or ZeRO optimizer object
        assert r["alive"] == 0 and r["alive_bytes"] == 0 and r["engines"] == 0, (where, r)
    assert out["next"] == {"ran": True, "freed": True, "engines": 0}


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers is not installed"
)
def test_a_checkpointed_plan_trains_a_hugging_face_encoder_decoder():
    """`auto`'s `+ac` plans checkpoint every repeated block class; HF T5's decoder filled its key-value
    cache in the forward and found it filled in the recomputation (torch's CheckpointError: 56
    tensors saved, then 52). Checkpointing, applied at setup, turns the cache off in every HF config
    of the module (so a model built in `configure_model`, and a strategy written by hand with
    `activation_checkpointing=`, get it too); the checkpointed step's loss and gradients then equal
    the plain step's."""
    import transformers as hf

    from lightspeed.strategies.common import apply_activation_checkpointing

    def t5():
        torch.manual_seed(0)
        cfg = hf.T5Config(
            d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2, num_heads=4,
            vocab_size=64, decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0,
        )  # fmt: skip
        return _as_module(hf.T5ForConditionalGeneration(cfg))

    src, tgt = torch.randint(0, 64, (2, 12)), torch.randint(0, 64, (2, 6))
    plain, checkpointed = t5(), t5()
    strategy = planned_strategy("fsdp+ac", 1, checkpointed)
    apply_activation_checkpointing(checkpointed, strategy.activation_checkpointing)
    assert not any(
        getattr(getattr(m, "config", None), "use_cache", False) for m in checkpointed.modules()
    )
    losses = []
    for m in (plain, checkpointed):
        loss = m.net(input_ids=src, labels=tgt).loss
        loss.backward()
        losses.append(loss.detach())
    assert torch.allclose(losses[0], losses[1], rtol=1e-6)
    grads = [[p.grad for p in m.parameters()] for m in (plain, checkpointed)]
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(*grads))


def test_a_checkpointed_plan_finds_the_blocks_of_a_model_built_in_configure_model():
    """A module that builds its layers in `configure_model` (Lightning's pattern for large models;
    the demo GPT) has no blocks when the plan is made: the `+ac` plan finds their classes on a meta
    copy. It found none before, and the 4.14B GPT of docs/planning.md ran the plan chosen as
    `deepspeed_stage_2_offload+ac` at micro-batch 34 without checkpointing, at micro-batch 3."""
    from lightspeed.demos.gpt import GPTConfig, GPTModule
    from lightspeed.strategies.common import apply_activation_checkpointing

    module = GPTModule(GPTConfig(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=32))
    assert module.model is None
    strategy = planned_strategy("deepspeed_stage_2+ac", 1, module)
    assert [c.__name__ for c in strategy.activation_checkpointing] == ["Block"]
    assert module.model is None  # the user's module is not built by planning
    module.configure_model()
    apply_activation_checkpointing(module, strategy.activation_checkpointing)
    wrapped = [n for n, _ in module.named_modules() if n.endswith("_checkpoint_wrapped_module")]
    assert wrapped == [f"model.blocks.{i}._checkpoint_wrapped_module" for i in range(2)]


def test_deepspeeds_room_check_sees_the_cap():
    """Under a per-process cap, DeepSpeed's flatten check is answered with what the cap leaves (the
    device's free bytes otherwise), so a ZeRO-1/2 setup never flattens past the cap."""
    from lightspeed.strategies.deepspeed.room import room_left, room_under_cap

    gib = 2**30
    assert room_left(16 * gib, 9 * gib, 130 * gib) == 7 * gib  # the cap binds
    assert room_left(16 * gib, 9 * gib, 3 * gib) == 3 * gib  # the device binds
    assert room_left(16 * gib, 17 * gib, 130 * gib) == 0  # never negative
    with room_under_cap(torch.device("cpu")):  # CPU ranks: nothing is touched
        pass
