"""Faults are named at the defaults: a rank that stops answering while the others wait in a
collective is named within a minute under the default 600 s collective timeout (heartbeat.STALL_S),
and a rank 0 killed with SIGKILL is named by the ranks it spawned, every time.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_named_ranks.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import WORKLOAD, run_workload
from lightspeed.runtime.heartbeat import STALL_S


def test_stuck_rank_is_named_within_a_minute_at_the_default_timeout(tmp_path):
    # Rank 1 sleeps 45 s in training_step at step 3; rank 0 waits in the loss's all_reduce. At the
    # default 600 s timeout, rank 0 names rank 1 after STALL_S, keeps waiting, and says when the
    # wait ended; the run then finishes.
    run = run_workload(
        tmp_path,
        devices=2,
        strategy="ddp",
        max_steps=5,
        timeout=180,
        check=False,
        stall_at={"step": 3, "rank": 1, "seconds": STALL_S + 15},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    named = re.search(r"\[lightspeed\] rank 0 has waited (\d+) s in all_reduce: ", run.stderr)
    assert named and STALL_S <= int(named.group(1)) <= 60, run.stderr[-3000:]
    line = run.stderr[named.start() :].splitlines()[0]
    assert ": rank 1 stopped answering at step 3 (last seen in training_step (" in line
    assert "workload.py:" in line and "Still waiting" in line and "600 s collective timeout" in line
    assert line.count("[lightspeed]") == 1 and run.stderr.count("has waited") == 1
    assert re.search(r"rank 0: the wait in all_reduce ended after \d+ s\.", run.stderr)


def _kill_rank0(tmp_path: Path, trial: int) -> tuple[int, str, float]:
    """A 2-rank ddp run whose rank 0 (the process that spawned rank 1) SIGKILLs itself at step 5.
    Returns its status, the output of every rank, and the seconds until the last rank ended."""
    opts = dict(
        strategy="ddp",
        devices=2,
        max_steps=40,
        batch_size=4,
        root=str(tmp_path),
        out=str(tmp_path / f"result-{trial}.json"),
        sigterm_at={"step": 5, "rank": 0, "signal": "SIGKILL"},
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LIGHTSPEED_SPAWNED"):
        env.pop(key, None)
    with open(tmp_path / f"err-{trial}", "w+") as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, str(WORKLOAD), json.dumps(opts)],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        proc.wait(timeout=180)
        # Rank 1 is left to end by itself (the run's process group is its own): it must.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("rank 1 outlived its killed rank 0 by 30 s")
        seconds = time.monotonic() - start
        err.seek(0)
        return proc.returncode, err.read(), seconds


@pytest.mark.parametrize("trial", range(4))
def test_killed_rank_0_is_named_every_time(tmp_path, trial):
    code, stderr, _ = _kill_rank0(tmp_path, trial)
    assert code == -signal.SIGKILL, stderr[-3000:]
    named = re.search(
        r"\[lightspeed\] rank 0 \(pid \d+\) is gone \(killed, or it ended without its ranks\); "
        r"rank 1 stops too\.",
        stderr,
    )
    assert named, stderr[-3000:]
