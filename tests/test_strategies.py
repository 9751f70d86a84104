"""One conformance suite and one parity suite, the same test bodies for every strategy (2 CPU ranks,
gloo).

Each strategy trains the tiny GPT for 30 optimizer steps (2 micro-batches per step, gradient
clipping at 1.0, global batch 8) with validation, then validates, tests, predicts, saves and
consolidates; a second run resumes from its step-15 checkpoint. The single-device run is the
reference.

Tolerances (fp32, relative, per step):
  - torch-native strategies (ddp, ddp_sharded, fsdp, fsdp_grad_op): 1e-5. Only the order of the
  gradient
    reductions differs from one device.
  - DeepSpeed stages: 1e-5 as well; ZeRO flattens parameters into buckets and reduces them in its
  own order,
    which stays within fp32 rounding over 30 steps on this model.
  - Resume: 1e-6 (the same computation replayed from saved state).
  - Final weights (consolidated), relative Frobenius norm per tensor: 1e-4. Adam divides each update
  by the
    root of its second moment, so elements with small gradients turn last-bit reduction differences
    into visibly larger weight differences than the losses show; 1e-4 is what 30 Adam steps give
    here.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from helpers import assert_close_losses, run_workload

STEPS, ACCUM, RESUME_AT = 30, 2, 15
STRATEGIES = [
    "ddp",
    "ddp_sharded",
    "fsdp",
    "fsdp_grad_op",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "deepspeed_stage_2_offload",
]
# Cells that repeat an engine path a neighbour covers (ZeRO-1 ~ ZeRO-2's engine, SHARD_GRAD_OP ~
# FULL_SHARD, ddp_sharded ~ tests/test_zero1.py, ZeRO-2 offload ~ test_deepspeed.py's ZeRO-3
# offload): slow in all three matrices below, which share one run per strategy (`pytest -m slow`).
REPEATS = {"ddp_sharded", "fsdp_grad_op", "deepspeed_stage_1", "deepspeed_stage_2_offload"}


def cells(names: list[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in REPEATS else n for n in names]


PARITY_RTOL = {s: 1e-5 for s in STRATEGIES}
RESUME_RTOL = 1e-6
WEIGHT_RTOL = 1e-4


def conformance_run(strategy: str, root: str = "{root}") -> dict:
    """The options of a strategy's run (tests/workload.py); `root` is the run's folder ("{root}":
    the shared run's own)."""
    devices = 1 if strategy == "single" else 2
    return dict(
        strategy=strategy,
        devices=devices,
        batch_size=8 // (devices * ACCUM),
        accumulate=ACCUM,
        clip=1.0,
        max_steps=STEPS,
        val=True,
        validate=True,
        test=True,
        predict=True,
        limit_predict_batches=3,
        ckpt_every=RESUME_AT,
        save_to=f"{root}/final",
        consolidate=f"{root}/final.safetensors",
    )


def resume_run(strategy: str, ckpt: str) -> dict:
    """The options of the run that resumes a strategy's run from its step-15 checkpoint `ckpt`."""
    devices = 1 if strategy == "single" else 2
    return dict(
        strategy=strategy,
        devices=devices,
        batch_size=8 // (devices * ACCUM),
        accumulate=ACCUM,
        clip=1.0,
        max_steps=STEPS,
        resume=ckpt,
    )


CKPT = f"checkpoints/epoch=0-step={RESUME_AT}.ckpt"
# The 2-rank strategies of the default cells: their runs and resumes in one launched job
# (helpers.run_jobs: the ranks start once for eight fits), made once per session for this file and
# tests/test_verified_checkpoints.py (conftest's `shared_run`).
BUNDLED = [s for s in STRATEGIES if s not in REPEATS]
BUNDLE = {
    **{s: conformance_run(s, root=f"{{root}}/{s}") for s in BUNDLED},
    **{f"{s}-resumed": resume_run(s, f"{{root}}/{s}/{CKPT}") for s in BUNDLED},
}


def strategy_run(shared_run, strategy: str) -> dict:
    """A strategy's run, made once per session: the bundle's, or one of its own (single: in this
    process)."""
    if strategy in BUNDLED:
        return shared_run.jobs(BUNDLE)[strategy]
    launcher = "in-process" if strategy == "single" else "python"
    return shared_run(**conformance_run(strategy), launcher=launcher)


@pytest.fixture(scope="module")
def runs(shared_run):
    """Trains each strategy once per session, on first use; the tests below share the results."""
    return lambda strategy: strategy_run(shared_run, strategy)


@pytest.mark.parametrize("strategy", cells(STRATEGIES))
def test_conformance(runs, strategy):
    """fit, validate, test, predict, save and consolidate all work and report sensible results."""
    r = runs(strategy)
    assert r["global_step"] == STEPS
    assert len(r["losses"]) == STEPS * ACCUM
    assert r["losses"][-1] < r["losses"][0]
    assert 0 < r["validate"][0]["val_loss"] < r["losses"][0]
    assert 0 < r["test"][0]["test_loss"] < r["losses"][0]
    assert r["predict_batches"] == 3
    ckpt = r["root"] / CKPT
    if strategy in ("single", "ddp", "ddp_sharded"):  # Lightning's one file
        assert torch.load(ckpt, weights_only=True)["global_step"] == RESUME_AT
    else:  # a directory, as Lightning's sharded strategies write
        assert (ckpt / "meta.json").exists()
    last = r["root"] / "last.ckpt"  # follows the newest save
    assert last.resolve() == (r["root"] / "final").resolve()
    weights = load_file(str(r["root"] / "final.safetensors"))
    assert (
        "model.wte.weight" in weights and "model.lm_head.weight" in weights
    )  # tied weights under both names


@pytest.mark.parametrize("strategy", cells(STRATEGIES))
def test_parity_with_single_device(runs, strategy):
    """Per-step losses and the consolidated final weights match one device within the stated
    tolerance."""
    ref, r = runs("single"), runs(strategy)
    assert_close_losses(r["losses"], ref["losses"], PARITY_RTOL[strategy], f"{strategy} vs single")
    w_ref = load_file(str(ref["root"] / "final.safetensors"))
    w = load_file(str(r["root"] / "final.safetensors"))
    assert w.keys() == w_ref.keys()
    for k in w_ref:
        rel = ((w[k] - w_ref[k]).norm() / w_ref[k].norm()).item()
        assert rel <= WEIGHT_RTOL, f"{strategy}: weight {k} differs by {rel:.1e} (relative norm)"


@pytest.mark.parametrize("strategy", cells(["single", *STRATEGIES]))
def test_resume_continues_exactly(runs, shared_run, strategy, tmp_path):
    """Resuming from the step-15 checkpoint replays steps 16..30 with the same losses."""
    r = runs(strategy)
    if strategy in BUNDLED:
        resumed = shared_run.jobs(BUNDLE)[f"{strategy}-resumed"]
    else:
        launcher = "in-process" if strategy == "single" else "python"
        resumed = run_workload(
            tmp_path, **resume_run(strategy, str(r["root"] / CKPT)), launcher=launcher
        )
    assert resumed["global_step"] == STEPS
    assert_close_losses(
        resumed["losses"], r["losses"][RESUME_AT * ACCUM :], RESUME_RTOL, f"{strategy} resumed"
    )


@pytest.mark.parametrize("strategy", cells(["ddp", "ddp_sharded", "fsdp", "deepspeed_stage_2"]))
def test_one_process_runs_every_strategy(runs, strategy, tmp_path):
    """devices=1 works for strategies that need a process group (a group of one), with single-device
    losses. In this process (no interpreter to start), but DeepSpeed in its own."""
    r = run_workload(
        tmp_path,
        strategy=strategy,
        devices=1,
        batch_size=8 // ACCUM,
        accumulate=ACCUM,
        clip=1.0,
        max_steps=10,
        launcher="python" if strategy.startswith("deepspeed") else "in-process",
    )
    assert_close_losses(
        r["losses"],
        runs("single")["losses"][: 10 * ACCUM],
        PARITY_RTOL[strategy],
        f"{strategy} on one process vs single",
    )
