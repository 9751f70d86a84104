"""No hangs: uneven batch counts are a clear error before the first step; a stuck rank ends the job
after the collective timeout the user set (Trainer(timeout=)), not torch's 30 minutes, with a
message naming it (heartbeat.py).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_no_hangs.py
"""

from __future__ import annotations

import sys

import pytest

import lightspeed as ls
from helpers import run_workload


def test_uneven_batch_counts_are_an_error_naming_ranks(tmp_path):
    run = run_workload(
        tmp_path, devices=2, strategy="ddp", max_epochs=2, uneven=True, check=False, timeout=120
    )
    assert run.returncode != 0 and run.seconds < 60
    assert "different number of batches per rank (rank 0: 6, rank 1: 7)" in run.stderr, run.stderr[
        -3000:
    ]


def test_stuck_rank_is_named_after_the_timeout(tmp_path):
    # Rank 1 sleeps in training_step at step 3; rank 0 waits in the loss's all_reduce until the 5 s
    # timeout and
    # names rank 1 from the heartbeats (tests/workload.py:74 is the sleep).
    run = run_workload(
        tmp_path,
        devices=2,
        strategy="ddp",
        max_steps=8,
        timeout=120,
        check=False,
        **{"collective_timeout": 5, "stall_at": {"step": 3, "rank": 1, "seconds": 100}},
    )
    assert run.returncode != 0 and run.seconds < 60, (run.seconds, run.stderr[-3000:])
    assert (
        "rank 1 stopped answering at step 3 (last seen in training_step (workload.py:" in run.stderr
    ), run.stderr[-3000:]
    assert "rank 0 answered up to step 3 and waited in all_reduce (metrics.py:" in run.stderr, (
        run.stderr[-3000:]
    )


@pytest.mark.slow
def test_stuck_rank_0_is_named_by_rank_1_under_torchrun(tmp_path):
    # No lightspeed parent: the rank that catches the timeout says who stopped answering.
    run = run_workload(
        tmp_path,
        devices=2,
        strategy="ddp",
        max_steps=8,
        timeout=120,
        check=False,
        launcher="torchrun",
        **{"collective_timeout": 5, "stall_at": {"step": 3, "rank": 0, "seconds": 100}},
    )
    assert run.returncode != 0 and run.seconds < 60, (run.seconds, run.stderr[-3000:])
    assert (
        "[lightspeed] rank 1: " in run.stderr and "rank 0 stopped answering at step 3" in run.stderr
    ), run.stderr[-3000:]


@pytest.mark.slow
def test_every_rank_stuck_is_ended_by_the_launcher(tmp_path):
    # Both ranks sleep outside any collective, so no collective times out: the launcher sees no rank
    # move.
    run = run_workload(
        tmp_path,
        devices=2,
        strategy="ddp",
        max_steps=8,
        timeout=120,
        check=False,
        **{"collective_timeout": 4, "stall_at": {"step": 3, "seconds": 100}},
    )
    assert run.returncode == 1 and run.seconds < 60, (run.seconds, run.stderr[-3000:])
    assert (
        "no rank has moved for 6 s" in run.stderr
        and "rank 0 stopped answering at step 3" in run.stderr
    )
    assert "rank 1 stopped answering at step 3" in run.stderr, run.stderr[-3000:]


def test_heartbeat_locates_a_thread_and_names_who_is_behind():
    import threading
    import time

    from lightspeed.runtime.heartbeat import Beat, describe, locate

    ready, release = threading.Event(), threading.Event()

    def training_step():
        ready.set()
        release.wait()

    t = threading.Thread(target=training_step)
    t.start()
    ready.wait()
    phase, where, waiting = locate(sys._current_frames()[t.ident])
    release.set()
    t.join()
    assert (phase, waiting) == ("training_step", False) and where.startswith("threading.py:"), (
        phase,
        where,
    )

    now = time.time()

    def beat(r, step, phase, waiting, since=now - 30, seen=now):
        return Beat(r, step, phase, "x.py:1", waiting, since, seen)

    assert describe([beat(0, 4, "all_reduce", True), beat(1, 3, "training_step", False)], now) == (
        "rank 1 stopped answering at step 3 (last seen in training_step (x.py:1) 30 s ago); "
        "rank 0 answered up to step 4 and waited in all_reduce (x.py:1)."
    )
    # A frozen process (no heartbeat for 20 s) is named even when it was waiting.
    assert describe(
        [beat(0, 3, "all_reduce", True), beat(1, 3, "all_reduce", True, seen=now - 20)], now
    ).startswith(
        "rank 1 stopped answering at step 3 (last seen in all_reduce (x.py:1) 30 s ago; no "
        "heartbeat for 20 s)"
    )
    # Every rank waiting at the same step: they wait for each other.
    assert describe(
        [beat(0, 3, "all_reduce", True), beat(1, 3, "broadcast", True)], now
    ).startswith("no rank is behind")
    assert describe([beat(0, None, "all_reduce", True), None], now).startswith(
        "rank 1 never sent a heartbeat"
    )


@pytest.mark.parametrize("value", [0, -1, "10", True])
def test_bad_timeout(value):
    with pytest.raises(ls.ConfigError, match=f"timeout={value!r} is not valid"):
        ls.Trainer(timeout=value)


def test_killed_rank_is_named(tmp_path):
    # (Rank 0 killed: the job's own process ends with -9, and each spawned rank prints "rank 0 (pid
    # N) is gone"
    # before it stops; the harness kills the process group at once, so that line is not asserted
    # here.)
    run = run_workload(
        tmp_path,
        devices=2,
        strategy="ddp",
        max_steps=30,
        check=False,
        timeout=120,
        sigterm_at={"step": 3, "rank": 1, "signal": "SIGKILL"},
    )
    assert run.returncode != 0 and run.seconds < 60
    assert "rank 1 " in run.stderr and "killed by SIGKILL" in run.stderr, run.stderr[-3000:]
