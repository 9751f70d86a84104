"""GPU checks, behind the `gpu` marker: skipped with a reason on machines without CUDA (see
conftest.py).

Run on a GPU machine with `pytest -m gpu tests/test_gpu.py`. The GPU benchmark
(benchmarks/speed_single_gpu.py) trains the same strategies at 1.3B parameters; these are the quick
correctness checks.
"""

from __future__ import annotations

import pytest

from helpers import assert_close_losses, run_workload

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3_offload", "fsdp"])
def test_strategy_matches_single_gpu_in_bf16(tmp_path, strategy):
    """One GPU: each strategy's bf16 losses track the single-device bf16 run (bf16 rounding:
    relative 2e-2)."""
    common = dict(devices=1, accelerator="gpu", precision="bf16-mixed", batch_size=8, max_steps=10)
    ref = run_workload(tmp_path, strategy="single", **common)
    got = run_workload(tmp_path, strategy=strategy, **common)
    assert_close_losses(got["losses"], ref["losses"], 2e-2, f"{strategy} vs single on GPU")
    assert got["losses"][-1] < got["losses"][0]


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_stage_2", "deepspeed_stage_3", "fsdp"])
def test_strategy_matches_single_gpu_in_fp16(tmp_path, strategy):
    """One GPU, `precision="16-mixed"` (Lightning's `precision=16`), which the CPU suite cannot run
    under DeepSpeed (no fp16 on its CPU accelerator): DeepSpeed's fp16 engine with its dynamic loss
    scale, FSDP's and DDP's GradScaler, against the single device's autocast and GradScaler (fp16
    rounding: relative 1e-2)."""
    common = dict(devices=1, accelerator="gpu", precision="16-mixed", batch_size=8, max_steps=10)
    ref = run_workload(tmp_path, strategy="single", **common)
    got = run_workload(tmp_path, strategy=strategy, **common)
    assert_close_losses(got["losses"], ref["losses"], 1e-2, f"{strategy} vs single on GPU in fp16")
    assert got["losses"][-1] < got["losses"][0]


def test_single_gpu_guard_skips_on_the_device_and_tracks_the_host_gate(tmp_path):
    """One GPU, bf16: the user's AdamW becomes fused, so the guard's verdict is the fused kernel's
    `found_inf` (its norm one pass after the backward). A NaN at step 3 under "skip": that step is
    skipped, the weights stay finite, and the run tracks the same run with the optimizer kept as
    written (host gate) within bf16's 2e-2."""
    import math

    common = dict(
        devices=1,
        accelerator="gpu",
        precision="bf16-mixed",
        batch_size=8,
        max_steps=8,
        nan_at={"step": 3},
        on_nonfinite="skip",
        launcher="in-process",
    )
    device = run_workload(tmp_path, **common)
    host = run_workload(tmp_path, optimizer_kernels="as_written", **common)
    assert (
        device["skipped_steps"] == 1
        and device["finite_weights"]
        and math.isnan(device["losses"][3])
    )
    finite = [(a, b) for a, b in zip(device["losses"], host["losses"]) if math.isfinite(b)]
    assert len(finite) == 7 and all(abs(a - b) <= 2e-2 * abs(b) for a, b in finite), (device, host)


@pytest.mark.parametrize("devices", [1, 2])
def test_compile_on_gpus_tracks_eager_in_bf16(tmp_path, devices):
    """compile=True on CUDA, bf16-mixed (one GPU in-process; ddp on two): the blocks and the step
    around the model run compiled (no fallback), the losses track the eager run within bf16's 2e-2,
    and so does `trainer.validate`'s
    loss through the compiled blocks without grad (where cuDNN attention leaves an output undefined:
    kernels.skip_alignment_asserts)."""
    common = dict(
        devices=devices,
        accelerator="gpu",
        precision="bf16-mixed",
        batch_size=8,
        max_steps=8,
        val=True,
        validate=True,
    )
    if devices == 1:
        common["launcher"] = "in-process"
    else:
        common["strategy"] = "ddp"
    eager = run_workload(tmp_path, **common)
    compiled = run_workload(tmp_path, compile=True, **common)
    assert compiled["step_fallback"] is None
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(compiled["losses"], eager["losses"])), (
        compiled,
        eager,
    )
    got, want = compiled["validate"][0]["val_loss"], eager["validate"][0]["val_loss"]
    assert abs(got - want) <= 2e-2 * abs(want), (got, want)


@pytest.mark.parametrize("devices", [1, 2])
def test_deepcompile_tracks_zero3_with_hooks_and_resumes(tmp_path, devices):
    """DeepSpeed(stage=3, deepcompile=True), bf16: 10 steps track ZeRO-3 with its hooks within
    bf16's 2e-2 (the compiled schedule changes at step 6, after DeepCompile's profiling steps), and
    a run resumed from the step-5 checkpoint continues with the uninterrupted run's losses (2e-2).
    The workload's `training_step` graph-breaks (`self.log`, `float(...)`), which DeepSpeed's own
    prefetch pass failed on (docs/benchmarks.md, eighth session)."""
    common = dict(
        devices=devices, accelerator="gpu", precision="bf16-mixed", batch_size=8, max_steps=10
    )
    hooks = run_workload(tmp_path, ds={"stage": 3}, root=str(tmp_path / "hooks"), **common)
    dc = {"stage": 3, "deepcompile": True}
    compiled = run_workload(tmp_path, ds=dc, ckpt_every=5, root=str(tmp_path / "dc"), **common)
    assert compiled["deepspeed"]["config"]["compile"]["deepcompile"] is True
    assert_close_losses(compiled["losses"], hooks["losses"], 2e-2, "deepcompile vs hooks")
    step5 = next((tmp_path / "dc" / "checkpoints").glob("*step=5*"))
    resumed = run_workload(
        tmp_path, ds=dc, resume=str(step5), root=str(tmp_path / "resumed"), **common
    )
    assert_close_losses(
        resumed["losses"], compiled["losses"][5:], 2e-2, "deepcompile resumed vs uninterrupted"
    )


@pytest.mark.parametrize("ac", [False, True])
def test_deepcompile_validates_through_the_compiled_engine(tmp_path, ac):
    """One GPU, bf16: `DeepSpeed(stage=3, deepcompile=True)` with validation batches in fit (the
    sanity check runs before the compile) and `trainer.validate` after it (through the compiled
    engine, eval mode, no grad), with and without activation checkpointing of the GPT blocks: 8
    steps and the validation loss track the hooks' run within bf16's 2e-2."""
    common = dict(
        devices=1,
        accelerator="gpu",
        precision="bf16-mixed",
        batch_size=8,
        max_steps=8,
        val=True,
        validate=True,
    )
    hooks = run_workload(
        tmp_path, ds={"stage": 3, "ac": ac}, root=str(tmp_path / "hooks"), **common
    )
    compiled = run_workload(
        tmp_path,
        ds={"stage": 3, "ac": ac, "deepcompile": True},
        root=str(tmp_path / "dc"),
        **common,
    )
    assert_close_losses(
        compiled["losses"], hooks["losses"], 2e-2, f"deepcompile vs hooks (ac={ac})"
    )
    got, want = compiled["validate"][0]["val_loss"], hooks["validate"][0]["val_loss"]
    assert abs(got - want) <= 2e-2 * abs(want), (got, want)
