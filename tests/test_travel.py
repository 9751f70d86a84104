"""Checkpoints that travel: a checkpoint written by any strategy on any world size resumes under any
other.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_travel.py             # the
    representative cells PYTHONPATH=src .venv/bin/python -m pytest -q -m slow tests/test_travel.py
      # the other pairs PYTHONPATH=src .venv/bin/python benchmarks/resume_matrix.py
       # every pair, as a table

Same world size: the resumed per-step losses equal an uninterrupted run of the saving strategy
within RTOL (fp32, the tiny GPT with an LR warm-up, so the scheduler must travel too; every strategy
here gives that run's losses). Another world size: each rank's share of the data differs, so losses
cannot match; instead the run resumes with max_steps at the saved step and saves again, and the
weights and optimizer state read back from that checkpoint equal the saved ones (ATOL); a second
resume trains on with finite losses and the global step counting on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import assert_close_losses, run_jobs, run_workload
from lightspeed.checkpoint.layouts import check_model, read_portable
from lightspeed.errors import ConfigError

RTOL = 1e-5  # per-step losses after a resume on the same world size (fp32)
ATOL = 1e-6  # weights and optimizer state after a load on another world size
K, N = 3, 6  # save at step K; the uninterrupted reference runs N steps
OPTS = dict(warmup=10)  # LR warm-up: a scheduler whose state must travel


def saved(root: Path, strategy: str, devices: int = 2, **opts) -> tuple[Path, list[float]]:
    """Runs `strategy` N steps with a checkpoint at step K: returns (that checkpoint, the run's
    losses)."""
    root.mkdir(parents=True, exist_ok=True)
    run = run_workload(
        root, devices=devices, strategy=strategy, max_steps=N, ckpt_every=K, **{**OPTS, **opts}
    )
    return root / "checkpoints" / f"epoch=0-step={K}.ckpt", run["losses"]


def resume(root: Path, ckpt: Path, strategy: str, devices: int = 2, **opts) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    if devices == 1:  # in this process, but DeepSpeed in its own
        where = dict(
            devices=1, launcher="python" if strategy.startswith("deepspeed") else "in-process"
        )
    elif (
        devices == 3
    ):  # three one-rank "nodes": the Trainer refuses more local ranks than the 2 CPU cores
        where = dict(devices=1, num_nodes=3, nproc=3, launcher="torchrun-nodes")
    else:
        where = dict(devices=devices)
    return run_workload(root, strategy=strategy, resume=str(ckpt), **where, **{**OPTS, **opts})


def assert_losses_continue(
    tmp: Path, ckpt: Path, reference: list[float], strategy: str, **opts
) -> None:
    run = resume(tmp / f"to-{strategy}", ckpt, strategy, max_steps=N, **opts)
    assert run["global_step"] == N and run["strategy"] == strategy
    assert_close_losses(
        run["losses"], reference[K:], RTOL, f"{ckpt.parent.parent.name} -> {strategy}"
    )


def assert_state_travels(tmp: Path, ckpt: Path, source: str, strategy: str, devices: int) -> None:
    """Loaded under `strategy` on `devices` ranks and saved again, the checkpoint holds the saved
    weights and optimizer state; resumed again, training goes on."""
    out, on = tmp / f"to-{strategy}{devices}", tmp / f"on-{strategy}{devices}"
    again = dict(max_steps=K, save_to=str(out / "again"))
    if devices == 1 and strategy.startswith("deepspeed"):
        # DeepSpeed on one device runs in a process of its own: both resumes in one (run_jobs).
        one = dict(strategy=strategy, resume=str(ckpt), devices=1, **OPTS)
        jobs = {out.name: dict(one, **again), on.name: dict(one, max_steps=K + 2)}
        run = run_jobs(tmp, jobs, nproc=1)[on.name]
    else:
        resume(out, ckpt, strategy, devices, **again)
        run = resume(on, ckpt, strategy, devices, max_steps=K + 2)
    before, after = read_portable(ckpt, source), read_portable(out / "again", strategy)
    assert before["model"].keys() == after["model"].keys()
    for name, t in before["model"].items():
        torch.testing.assert_close(
            after["model"][name].float(), t.float(), atol=ATOL, rtol=0, msg=name
        )
    assert before["optim"]["state"].keys() == after["optim"]["state"].keys()
    for name, st in before["optim"]["state"].items():
        for key, value in st.items():
            torch.testing.assert_close(
                torch.as_tensor(after["optim"]["state"][name][key]).float(),
                torch.as_tensor(value).float(),
                atol=ATOL,
                rtol=0,
                msg=f"{name} {key}",
            )
    lrs = [[g["lr"] for g in p["optim"]["param_groups"]] for p in (before, after)]
    assert lrs[0] == pytest.approx(lrs[1])
    assert run["global_step"] == K + 2 and len(run["losses"]) == 2 and run["finite_weights"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """The 2-rank runs of the two tests below, one after another in one launched job
    (helpers.run_jobs: the ranks start once): DDP and ZeRO-2 each save at step K of N, then each
    checkpoint resumes under the other test's strategy. Returns (the folder, name -> result)."""
    tmp = tmp_path_factory.mktemp("travel")
    run = dict(devices=2, max_steps=N, **OPTS)
    ckpt = {s: str(tmp / s / "checkpoints" / f"epoch=0-step={K}.ckpt") for s in ("ddp", "ds2")}
    jobs = {
        "ddp": dict(strategy="ddp", ckpt_every=K, **run),
        "ds2": dict(strategy="deepspeed_stage_2", ckpt_every=K, **run),
        "to-deepspeed_stage_2": dict(strategy="deepspeed_stage_2", resume=ckpt["ddp"], **run),
        "to-fsdp": dict(strategy="fsdp", resume=ckpt["ds2"], **run),
    }
    return tmp, run_jobs(tmp, jobs)


def assert_resumed(runs: dict, source: str, strategy: str) -> None:
    run, reference = runs[f"to-{strategy}"], runs[source]["losses"]
    assert run["global_step"] == N and run["strategy"] == strategy
    assert_close_losses(run["losses"], reference[K:], RTOL, f"{source} -> {strategy}")


def test_ddp_checkpoint_resumes_under_deepspeed_and_on_one_rank(tmp_path, two_ranks):
    folder, runs = two_ranks
    ckpt = folder / "ddp" / "checkpoints" / f"epoch=0-step={K}.ckpt"
    assert_resumed(runs, "ddp", "deepspeed_stage_2")
    assert_state_travels(tmp_path, ckpt, "ddp", "single", devices=1)
    # Evaluation with ckpt_path travels too: FSDP validates the DDP checkpoint as one device does
    # natively.
    native = resume(tmp_path / "val-single", ckpt, "single", 1, fit=False)["validate"]
    travelled = resume(tmp_path / "val-fsdp", ckpt, "fsdp", 1, fit=False)["validate"]
    assert travelled[0] == pytest.approx(native[0], rel=1e-6) and native[0]


def test_deepspeed_checkpoint_resumes_under_fsdp_and_on_one_rank(tmp_path, two_ranks):
    folder, runs = two_ranks
    ckpt = folder / "ds2" / "checkpoints" / f"epoch=0-step={K}.ckpt"
    assert_resumed(runs, "ds2", "fsdp")
    # The case Lightning cannot resume (#19585): DeepSpeed saved on 2 ranks, resumed on 1.
    assert_state_travels(tmp_path, ckpt, "deepspeed_stage_2", "deepspeed_stage_2", devices=1)


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(tmp_path):
    from workload import Workload

    run_workload(tmp_path, launcher="in-process", max_steps=1, ckpt_every=1, strategy="ddp")
    ckpt = (tmp_path / "checkpoints" / "last.ckpt").resolve()
    portable = read_portable(ckpt, "ddp")
    portable["model"]["model.wpe.renamed"] = portable["model"].pop("model.wpe.weight")
    module = Workload({})
    module.configure_model()
    with pytest.raises(
        ConfigError,
        match=rf"checkpoint {ckpt} does not match .*parameter 'model\.wpe\.weight' "
        r"is absent in the checkpoint and of shape \[32, 32\] in the model",
    ):
        check_model(portable, module, ckpt)


SAME_WORLD = [
    ("deepspeed_stage_2", "ddp"),
    ("ddp", "fsdp"),
    ("fsdp", "ddp"),
    ("deepspeed_stage_3", "fsdp"),
    ("fsdp", "deepspeed_stage_3"),
    ("ddp_sharded", "deepspeed_stage_1"),
]


@pytest.mark.slow
@pytest.mark.parametrize("source,target", SAME_WORLD)
def test_same_world_size_pairs(tmp_path, source, target):
    ckpt, reference = saved(tmp_path / source, source)
    assert_losses_continue(tmp_path, ckpt, reference, target)


@pytest.mark.slow
@pytest.mark.parametrize(
    "source,target,devices",
    [("fsdp", "fsdp", 3), ("deepspeed_stage_3", "ddp", 3), ("deepspeed_stage_3", "ddp_sharded", 1)],
)
def test_other_world_size_pairs(tmp_path, source, target, devices):
    ckpt, _ = saved(tmp_path / source, source)
    assert_state_travels(tmp_path, ckpt, source, target, devices)


@pytest.mark.slow
@pytest.mark.parametrize(
    "source,target,manual",
    [("ddp", "fsdp", False), ("fsdp", "ddp", False), ("ddp", "deepspeed_stage_2", True)],
)
def test_sgd_momentum_of_two_optimizers_travels(tmp_path, source, target, manual):
    """Two SGDs with momentum; under DeepSpeed (manual optimization) one engine each."""
    ckpt, reference = saved(tmp_path / source, source, two_optimizers=True, manual=manual)
    assert_losses_continue(tmp_path, ckpt, reference, target, two_optimizers=True, manual=manual)
