"""One non-finite policy on every strategy: an Inf in one parameter's gradient while the loss stays
finite acts under DeepSpeed ZeRO-2 and ZeRO-3 as under DDP (and FSDP).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_nonfinite_deepspeed.py
    PYTHONPATH=src .venv/bin/python -m pytest -q -m "" tests/test_nonfinite_deepspeed.py  # all

The fault is tests/workload.py's `inf_grad_at`: at global step 2 a tensor hook on rank 1 puts one
Inf into the gradient of blocks[0].attn.proj.weight. DDP and FSDP see it in the global gradient
norm before the optimizer step; DeepSpeed computes that norm inside `engine.step()` and drops the
step on every rank, and the guard applies the policy to that norm (runtime/guard.py,
`after_engine_step`). Expected, for every strategy:

- "stop": every rank raises NonFiniteError naming step 2 and "the gradient norm was NaN/Inf on
  rank(s) [0, 1]"; no checkpoint after step 2.
- "skip": the step is skipped on every rank, `skipped_steps` is 1, the losses are DDP's under
  "skip", and the last checkpoint (step 4, after the fault) is finite.
- "warn": one message naming step 2, the run goes on. DDP and FSDP then apply the Inf update (the
  weights turn NaN: what an unguarded loop does); DeepSpeed cannot apply a non-finite gradient (its
  overflow check drops it), so its losses are those of "skip". The one difference, and the test
  pins it.

Default cells: ds2 × each policy, ds3 "stop", and the DDP "skip" run they compare with; the other
cells (ds3 skip/warn, DDP and FSDP stop/warn, FSDP skip) are marked slow.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import assert_close_losses, run_jobs, run_workload
from lightspeed.runtime.guard import NonFiniteError, NonFiniteGuard

FAULT = dict(devices=2, batch_size=2, max_steps=5, ckpt_every=2, inf_grad_at={"step": 2, "rank": 1})
SAID = (
    "Non-finite value at step 2, epoch 0, batch_idx 2: "
    "the gradient norm was NaN/Inf on rank(s) [0, 1]."
)
DS2, DS3 = "deepspeed_stage_2", "deepspeed_stage_3"
slow = pytest.mark.slow


def test_after_engine_step_applies_the_policy_to_the_engines_norm_once():
    """No ranks: the engine's norm (already the same on every rank) decides, with no collective;
    a window whose losses were flagged before the step is not counted twice."""
    said: list[str] = []
    stop = NonFiniteGuard("stop", rank=0, world_size=2)
    stop.begin(step=7, epoch=1, batch_indices=[14])
    stop.after_engine_step(1.5, stepped=True)  # finite: nothing
    with pytest.raises(
        NonFiniteError,
        match=r"step 7, epoch 1, batch_idx 14: the gradient norm "
        r"was NaN/Inf on rank\(s\) \[0, 1\]\. Training stopped and the engine "
        r"dropped this optimizer step itself",
    ):
        stop.after_engine_step(math.inf, stepped=False)
    skip = NonFiniteGuard("skip", rank=1, world_size=2, print0=said.append)
    skip.begin(3, 0, [3])
    skip.observe(torch.tensor(float("nan")), 0)
    assert skip.should_step(None) is False and skip.skipped_steps == 1  # the loss decided
    skip.after_engine_step(math.inf, stepped=False)  # the same window: already counted
    skip.begin(4, 0, [4])
    skip.after_engine_step(None, stepped=False)  # no norm (its computation off), step dropped
    assert skip.skipped_steps == 2 and len(said) == 2 and "step 4" in said[1]
    warn = NonFiniteGuard("warn", print0=said.append)
    warn.begin(5, 0, [5])
    warn.after_engine_step(math.nan, stepped=True)  # an engine that stepped on it: said plainly
    assert "the engine had already applied this optimizer step" in said[-1]


def _finite_checkpoint(root: Path, strategy: str, name: str = "last.ckpt") -> bool:
    path = (root / "checkpoints" / name).resolve()
    if strategy.startswith("deepspeed"):
        from lightspeed.strategies.deepspeed.shards import full_state_dict

        weights = full_state_dict(path)
    elif strategy == "ddp":  # Lightning's one .ckpt file
        weights = torch.load(path, weights_only=True)["state_dict"]
    else:
        return True  # FSDP's DCP shards: the run's own finite_weights check stands for them
    return bool(weights) and all(bool(torch.isfinite(t).all()) for t in weights.values())


def _checkpoints(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "checkpoints").iterdir() if not p.name.startswith("."))


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> dict[str, dict]:
    """The default cells' runs that end (DDP's and ZeRO-2's "skip", ZeRO-2's "warn"), one after
    another in one launched job (helpers.run_jobs): "<strategy>-<policy>" -> rank 0's result."""
    jobs = {
        f"{strategy}-{policy}": dict(strategy=strategy, on_nonfinite=policy, **FAULT)
        for strategy, policy in (("ddp", "skip"), (DS2, "skip"), (DS2, "warn"))
    }
    return run_jobs(tmp_path_factory.mktemp("finished"), jobs)


@pytest.fixture(scope="module")
def ddp_skip(finished):
    return finished["ddp-skip"]


@pytest.mark.parametrize(
    "strategy", [DS2, DS3, pytest.param("ddp", marks=slow), pytest.param("fsdp", marks=slow)]
)
def test_stop(tmp_path, strategy):
    run = run_workload(tmp_path, strategy=strategy, on_nonfinite="stop", check=False, **FAULT)
    text = run.stdout + run.stderr
    assert run.returncode != 0, text[-3000:]
    for rank in (0, 1):  # decided once: both ranks stop at the same step, with the same words
        assert f"[rank{rank}]: lightspeed.runtime.guard.NonFiniteError: {SAID}" in text, text[
            -3000:
        ]
    assert "OVERFLOW" not in text  # DeepSpeed's own line (no step, no rank) is the guard's now
    assert _checkpoints(tmp_path) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert _finite_checkpoint(tmp_path, strategy)


@pytest.mark.parametrize(
    "strategy", [DS2, pytest.param(DS3, marks=slow), pytest.param("fsdp", marks=slow)]
)
def test_skip(tmp_path, strategy, finished, ddp_skip):
    res = finished.get(f"{strategy}-skip")
    if res is None:  # a slow cell
        res = {**run_workload(tmp_path, strategy=strategy, on_nonfinite="skip", **FAULT)}
        res["root"] = tmp_path
    for out in (res, ddp_skip):
        assert out["global_step"] == 5 and out["skipped_steps"] == 1 and out["finite_weights"]
    assert_close_losses(res["losses"], ddp_skip["losses"], 1e-5, f"{strategy} vs ddp under skip")
    root = res["root"]
    assert "epoch=0-step=4.ckpt" in _checkpoints(root) and _finite_checkpoint(root, strategy)


@pytest.mark.parametrize(
    "strategy",
    [
        DS2,
        pytest.param(DS3, marks=slow),
        pytest.param("ddp", marks=slow),
        pytest.param("fsdp", marks=slow),
    ],
)
def test_warn(tmp_path, strategy, finished, ddp_skip):
    res = finished.get(f"{strategy}-warn")
    if res is None:  # a slow cell
        run = run_workload(tmp_path, strategy=strategy, on_nonfinite="warn", check=False, **FAULT)
        assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
        import json

        res = json.loads(next(tmp_path.glob("result-*.json")).read_text())
        res.update(root=tmp_path, stdout=run.stdout)
    assert res["global_step"] == 5 and res["skipped_steps"] == 0
    lines = [line for line in res["stdout"].splitlines() if SAID in line]
    if strategy.startswith("deepspeed"):  # the engine dropped it: the losses of "skip", finite
        assert lines == [
            f"{SAID} on_nonfinite='warn': the engine dropped this optimizer step "
            "itself (its overflow check), so the run goes on without it."
        ]
        assert_close_losses(res["losses"], ddp_skip["losses"], 1e-5, f"{strategy} warn vs skip")
        assert _finite_checkpoint(res["root"], strategy)
    else:  # the Inf update applied: NaN from step 3 on, each step said
        assert lines == [f"{SAID} on_nonfinite='warn': stepping anyway."]
        assert not res["finite_weights"] and all(math.isnan(v) for v in res["losses"][3:])
