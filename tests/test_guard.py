"""The non-finite guard: a NaN loss on any rank is seen by every rank at the same step.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_guard.py

Faults come from tests/workload.py's `nan_at` (that rank's loss is NaN at a global step). "stop"
raises before the optimizer step and names step, epoch, batch and rank; "skip" skips that step on
every rank and counts it; the weights stay finite either way, and every checkpoint with them.
"""

from __future__ import annotations

import math

import pytest
import torch

from helpers import run_jobs, run_workload
from lightspeed.runtime.guard import NonFiniteError, NonFiniteGuard


def test_guard_unit_stop_names_step_epoch_batch_rank():
    guard = NonFiniteGuard("stop")
    guard.begin(step=7, epoch=2, batch_indices=[14, 15])
    guard.observe(torch.tensor(1.0), 0)
    guard.observe(torch.tensor(float("inf")), 1)
    with pytest.raises(
        NonFiniteError,
        match=r"step 7, epoch 2, batch_idx 15: the loss was NaN/Inf on rank\(s\) \[0\]",
    ):
        guard.should_step(torch.tensor(3.0))


def test_guard_unit_norm_and_skip_count():
    guard, said = NonFiniteGuard("skip", print0=lambda *a: None), []  # noqa: F841
    guard.begin(0, 0, [0])
    guard.observe(torch.tensor(1.0), 0)
    assert guard.should_step(torch.tensor(2.0)) is True
    assert guard.should_step(torch.tensor(float("nan"))) is False
    assert guard.log_values() == {"skipped_steps": 1.0}
    warn = NonFiniteGuard("warn", print0=lambda *a: said.append(a))
    warn.begin(0, 0, [0])
    assert warn.should_step(float("inf")) is True and "gradient norm" in said[0][0]


def test_guard_unit_device_verdict_is_read_a_step_later_and_names_its_step():
    """`step_flag` returns the flag the fused optimizer skips on and does not read it on the host;
    the verdict is read at the next decision (or `settle`, before a checkpoint / at a log step) and
    names the flagged step."""
    stop = NonFiniteGuard("stop")
    stop.begin(step=4, epoch=1, batch_indices=[8, 9])
    stop.observe(torch.tensor(1.0), 0)
    stop.observe(torch.tensor(2.0), 1)
    assert (
        float(stop.step_flag(torch.tensor(float("nan")))) == 1.0
    )  # queued with the step: no raise yet
    stop.begin(step=5, epoch=1, batch_indices=[10, 11])
    stop.observe(torch.tensor(1.0), 0)
    with pytest.raises(
        NonFiniteError, match=r"step 4, epoch 1, batch_idx 9: the gradient norm was NaN/Inf"
    ):
        stop.step_flag(torch.tensor(1.0))
    stop.settle()  # read once: nothing is left to raise
    skip = NonFiniteGuard("skip", print0=lambda *a: None)
    for step, norm in enumerate([1.0, float("inf"), 2.0]):
        skip.begin(step, 0, [step])
        skip.observe(torch.tensor(1.0), 0)
        flag = skip.step_flag(torch.tensor(norm))
        assert float(flag) == (1.0 if step == 1 else 0.0)
        assert skip.skipped_steps == (
            1 if step == 2 else 0
        )  # step 1's verdict is read at step 2's decision
    assert skip.log_values() == {"skipped_steps": 1.0}
    skip.settle()
    assert skip.skipped_steps == 1


@pytest.mark.parametrize(
    "strategy",
    ["ddp", "ddp+fused", pytest.param("fsdp", marks=pytest.mark.slow), "deepspeed_stage_2"],
)
def test_nan_on_one_rank_stops_every_rank(tmp_path, strategy):
    """ "+fused": torch's fused AdamW, which the guard stops on the device (the step is queued,
    skipped, then the verdict raises): the same message, the same finite checkpoints."""
    strategy, fused = strategy.removesuffix("+fused"), strategy.endswith("+fused")
    run = run_workload(
        tmp_path,
        devices=2,
        strategy=strategy,
        max_steps=8,
        nan_at={"step": 5, "rank": 1},
        ckpt_every=2,
        check=False,
        fused=fused,
    )
    assert run.returncode != 0
    text = run.stdout + run.stderr
    assert (
        "NonFiniteError" in text
        and "step 5, epoch 0, batch_idx 5" in text
        and "rank(s) [1]" in text
    ), text[-3000:]
    # The checkpoints written before the fault hold finite weights; none was written after it.
    ckpts = sorted(
        p.name for p in (tmp_path / "checkpoints").iterdir() if not p.name.startswith(".")
    )
    assert "last.ckpt" in ckpts and not any("step=6" in c or "step=8" in c for c in ckpts), ckpts
    if strategy == "ddp":
        last = tmp_path / "checkpoints" / "last.ckpt"
        weights = torch.load(last, weights_only=True)["state_dict"]
        assert all(bool(torch.isfinite(t).all()) for t in weights.values())


# A NaN loss on rank 0 at step 3, skipped: test_skip_skips_on_every_rank's run is the host gate's
# run of test_fused_adamw_skips_on_the_device_like_the_host_gate.
SKIP = dict(devices=2, max_steps=7, nan_at={"step": 3, "rank": 0}, on_nonfinite="skip")


@pytest.fixture(scope="module")
def skipping(tmp_path_factory) -> dict[str, dict]:
    """The skipping runs of the default cells below (host gate and fused AdamW, under ddp and fsdp)
    and the plain 6-step DDP run, one after another in one launched job (helpers.run_jobs)."""
    jobs = {"ddp-plain": dict(strategy="ddp", devices=2, max_steps=6)}
    for strategy in ("ddp", "fsdp"):
        jobs[f"{strategy}-host"] = dict(strategy=strategy, **SKIP)
        jobs[f"{strategy}-fused"] = dict(strategy=strategy, fused=True, **SKIP)
    return run_jobs(tmp_path_factory.mktemp("skipping"), jobs)


@pytest.mark.parametrize(
    "strategy", ["ddp", pytest.param("deepspeed_stage_2", marks=pytest.mark.slow)]
)
def test_skip_skips_on_every_rank(skipping, shared_run, strategy):
    if strategy == "ddp":
        res, ref = skipping["ddp-host"], skipping["ddp-plain"]
    else:
        res, ref = (
            shared_run(strategy=strategy, **SKIP),
            shared_run(devices=2, strategy=strategy, max_steps=6),
        )
    assert res["global_step"] == 7 and res["skipped_steps"] == 1 and res["finite_weights"]
    losses = res["losses"]
    assert math.isnan(losses[3]) and all(math.isfinite(v) for i, v in enumerate(losses) if i != 3)
    # Before the fault the run is an unguarded run's twin (the guard changes nothing on finite
    # steps).
    assert losses[:3] == ref["losses"][:3]


def test_stop_single_device_with_clipping(tmp_path):
    run = run_workload(
        tmp_path,
        launcher="python",
        nproc=1,
        devices=1,
        max_steps=6,
        clip=1.0,
        nan_at={"step": 2},
        check=False,
    )
    assert run.returncode != 0 and "step 2, epoch 0, batch_idx 2" in run.stderr, run.stderr[-2000:]


def test_stop_at_the_last_step_with_fused_adamw_still_raises(tmp_path):
    """The fused optimizer's verdict is read a step later; for the last step that is the end of the
    epoch, so a NaN there still stops the run (one device, in the test process, no checkpoint
    callback)."""
    with pytest.raises(NonFiniteError, match=r"step 5, epoch 0, batch_idx 5"):
        run_workload(
            tmp_path, launcher="in-process", devices=1, max_steps=6, fused=True, nan_at={"step": 5}
        )


@pytest.mark.gpu
def test_guard_unit_on_cuda_reads_the_flags_published_behind_the_forward():
    """On CUDA `observe` queues the flags' copy to pinned memory; the verdict and the message are
    the CPU path's."""
    guard = NonFiniteGuard("stop")
    guard.begin(step=7, epoch=2, batch_indices=[14, 15])
    guard.observe(torch.tensor(1.0, device="cuda"), 0)
    guard.observe(torch.tensor(float("inf"), device="cuda"), 1)
    with pytest.raises(
        NonFiniteError,
        match=r"step 7, epoch 2, batch_idx 15: the loss was NaN/Inf on rank\(s\) \[0\]",
    ):
        guard.should_step(None)  # DeepSpeed's path: only the published flags
    skip = NonFiniteGuard("skip", print0=lambda *a: None)
    skip.begin(0, 0, [0])
    skip.observe(torch.tensor(1.0, device="cuda"), 0)
    assert skip.should_step(torch.tensor(2.0, device="cuda")) is True
    assert (
        skip.should_step(torch.tensor(float("nan"), device="cuda")) is False
        and skip.skipped_steps == 1
    )


@pytest.mark.gpu
def test_nan_on_one_gpu_rank_stops_both_and_skip_under_deepspeed(tmp_path):
    """NCCL: the flags reduced in `observe` name the rank and the step (DDP, with a norm); DeepSpeed
    on one GPU (no norm before its step) skips the step and keeps the weights finite."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run = run_workload(
        tmp_path,
        devices=2,
        accelerator="gpu",
        strategy="ddp",
        max_steps=8,
        nan_at={"step": 5, "rank": 1},
        check=False,
    )
    text = run.stdout + run.stderr
    assert run.returncode != 0 and "NonFiniteError" in text, text[-3000:]
    assert "step 5, epoch 0, batch_idx 5" in text and "rank(s) [1]" in text, text[-3000:]
    res = run_workload(
        tmp_path,
        launcher="python",
        nproc=1,
        devices=1,
        accelerator="gpu",
        strategy="deepspeed_stage_2",
        max_steps=6,
        nan_at={"step": 3},
        on_nonfinite="skip",
    )
    assert res["global_step"] == 6 and res["skipped_steps"] == 1 and res["finite_weights"]


@pytest.mark.gpu
def test_one_gpu_reads_the_verdict_a_step_later(tmp_path):
    """One CUDA device, torch's fused AdamW (the default there): the verdict rides on `found_inf`
    and is read a step later, and still skips exactly the NaN step ("skip") or stops naming it,
    before the next checkpoint ("stop", checkpoints every step)."""
    opts = dict(
        launcher="python", nproc=1, devices=1, accelerator="gpu", max_steps=6, nan_at={"step": 3}
    )
    (tmp_path / "skip").mkdir()
    (tmp_path / "stop").mkdir()
    res = run_workload(tmp_path / "skip", on_nonfinite="skip", **opts)
    assert res["global_step"] == 6 and res["skipped_steps"] == 1 and res["finite_weights"]
    run = run_workload(tmp_path / "stop", ckpt_every=1, check=False, **opts)
    assert run.returncode != 0 and "step 3, epoch 0, batch_idx 3" in run.stdout + run.stderr, (
        run.stderr[-3000:]
    )
    ckpts = sorted(p.name for p in (tmp_path / "stop" / "checkpoints").iterdir())
    assert not any(f"step={s}" in c for c in ckpts for s in (4, 5, 6)), ckpts


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_fused_adamw_skips_on_the_device_like_the_host_gate(skipping, strategy):
    """torch's fused AdamW gets the verdict as its `found_inf` flag (no host read before the step):
    the skipped step leaves weights and optimizer state as the host gate does, so the runs agree at
    every step (2 ranks)."""
    device, host = skipping[f"{strategy}-fused"], skipping[f"{strategy}-host"]
    assert device["global_step"] == 7 and device["skipped_steps"] == 1 and device["finite_weights"]
    assert math.isnan(device["losses"][3])
    finite = [(a, b) for a, b in zip(device["losses"], host["losses"]) if math.isfinite(b)]
    assert len(finite) == 6 and all(abs(a - b) <= 1e-5 * abs(b) for a, b in finite), (device, host)
