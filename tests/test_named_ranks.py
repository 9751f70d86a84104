"""Faults are named at the defaults: a rank that stops answering while the others wait in a
collective is named within a minute under the default 600 s collective timeout (heartbeat.STALL_S).
(A rank 0 killed with SIGKILL, named by the ranks it spawned: tests/test_killed_rank0.py.)

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_named_ranks.py
"""

from __future__ import annotations

import re

from helpers import run_workload
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
