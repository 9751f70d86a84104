"""Preemption: SIGTERM reaching one rank of a 2-rank DDP job ends it with a checkpoint and status
143, and `fit(ckpt_path="last")` continues with the per-step losses of an uninterrupted run (equal
to 1e-6 relative).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_preemption.py
"""

from __future__ import annotations

import json
import os
import warnings

import pytest

from helpers import assert_close_losses, run_jobs, run_workload
from lightspeed.checkpoint.checkpointer import resolve
from lightspeed.errors import ConfigError


def test_sigterm_saves_exits_143_and_resumes_exactly(tmp_path):
    run = run_workload(
        tmp_path,
        devices=2,
        strategy="ddp",
        max_steps=10,
        shuffle=True,
        sigterm_at={"step": 4, "rank": 1},
        check=False,
    )
    assert run.returncode == 143, (run.returncode, run.stderr[-3000:])
    assert "received SIGTERM" in run.stdout and "preempted-step=5" in run.stdout, run.stdout[-2000:]
    assert os.readlink(tmp_path / "checkpoints" / "last.ckpt") == "preempted-step=5.ckpt"
    # The resume, then an uninterrupted run for reference, in one launched job (run_jobs).
    run = dict(devices=2, strategy="ddp", max_steps=10, shuffle=True)
    jobs = {"resumed": dict(root=str(tmp_path), resume="last", **run), "ref": run}
    after = run_jobs(tmp_path, jobs)
    resumed, ref = after["resumed"], after["ref"]
    assert resumed["global_step"] == 10 and len(resumed["losses"]) == 5
    preempted = json.loads((tmp_path / "result-0.json").read_text())  # the first run's
    assert preempted.get("exit") == 143
    assert len(preempted["losses"]) == 5
    assert_close_losses(
        preempted["losses"] + resumed["losses"], ref["losses"], 1e-6, "preempted + resumed"
    )


def test_last_with_nothing_saved_starts_fresh(tmp_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve("last", tmp_path / "checkpoints") is None
    assert "nothing saved" in str(caught[0].message)
    with pytest.raises(ConfigError, match="does not exist"):
        resolve(tmp_path / "nowhere", tmp_path)


def test_last_dangling_after_a_kill_between_renames(tmp_path):
    # A directory checkpoint (the sharded strategies') saved again under its name, killed between
    # its two renames.
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / ".tmp-epoch=1.ckpt").mkdir()
    (ckpts / ".tmp-epoch=1.ckpt" / "meta.json").write_text(
        '{"format": "lightspeed-checkpoint", "files": {}}'
    )
    os.symlink("epoch=1.ckpt", ckpts / "last.ckpt")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert resolve("last", ckpts).name == ".tmp-epoch=1.ckpt"
    (ckpts / ".tmp-epoch=1.ckpt" / "meta.json").unlink()
    with pytest.raises(ConfigError, match="points to 'epoch=1.ckpt', which does not exist"):
        resolve("last", ckpts)
    # A folder written before lightspeed named it `last.ckpt` still resumes from its `last`.
    (ckpts / "last.ckpt").unlink()
    (ckpts / ".tmp-epoch=1.ckpt" / "meta.json").write_text(
        '{"format": "lightspeed-checkpoint", "files": {}}'
    )
    os.symlink("epoch=1.ckpt", ckpts / "last")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert resolve("last", ckpts).name == ".tmp-epoch=1.ckpt"


@pytest.mark.gpu
def test_sigterm_on_gpu_ranks_stops_both_one_step_later(tmp_path):
    """Under NCCL the check reads the previous step's reduction (no host wait): both ranks stop one
    step later."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    run = run_workload(
        tmp_path,
        devices=2,
        accelerator="gpu",
        strategy="ddp",
        max_steps=10,
        sigterm_at={"step": 4, "rank": 1},
        check=False,
    )
    assert run.returncode == 143, (run.returncode, run.stderr[-3000:])
    assert "received SIGTERM" in run.stdout and "preempted-step=6" in run.stdout, run.stdout[-2000:]
