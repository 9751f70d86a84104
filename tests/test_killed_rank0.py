"""A rank 0 killed with SIGKILL is named, every time, by the rank it spawned (runtime/launch.py,
`watch_parent`): rank 0 started the job, so no launcher is left to say it.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_killed_rank0.py

Ten kills in a row, each a 2-rank ddp run whose rank 0 SIGKILLs itself at step 2, with rank 1 left
to end by itself; the test counts the runs whose rank 1 printed "[lightspeed] rank 0 (pid N) is
gone ..." and asserts 10 of 10 (the count is in the failure message). Before the launcher waited
for the parent's exit to show, 2 of 4 such kills printed only gloo's "Connection reset by peer".
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

from helpers import ROOT, WORKLOAD

NAMED = re.compile(
    r"\[lightspeed\] rank 0 \(pid \d+\) is gone \(killed, or it ended without its ranks\); "
    r"rank 1 stops too\."
)


def _kill_rank0(tmp_path: Path, trial: int) -> tuple[int | None, str, float, bool]:
    """One run whose rank 0 (the process that spawned rank 1) SIGKILLs itself at step 2. Returns
    rank 0's status, every rank's stderr, the seconds until the last rank ended, and whether rank 1
    ended by itself within 30 s of rank 0."""
    opts = dict(
        strategy="ddp",
        devices=2,
        max_steps=8,
        batch_size=4,
        root=str(tmp_path),
        out=str(tmp_path / f"result-{trial}.json"),
        sigterm_at={"step": 2, "rank": 0, "signal": "SIGKILL"},
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
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
        deadline, ended = time.monotonic() + 30, False
        while not ended and time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
                time.sleep(0.1)
            except ProcessLookupError:
                ended = True
        if not ended:
            os.killpg(proc.pid, signal.SIGKILL)
        seconds = time.monotonic() - start
        err.seek(0)
        return proc.returncode, err.read(), seconds, ended


# the suite kills 3 times; the figure (10 kills in a row) is the slow cell:
# `pytest -m slow tests/test_killed_rank0.py`
@pytest.mark.parametrize("trials", [3, pytest.param(10, marks=pytest.mark.slow)])
def test_killed_rank_0_is_named_every_time(tmp_path, trials):
    outcomes = []
    for trial in range(trials):
        code, stderr, seconds, ended = _kill_rank0(tmp_path, trial)
        assert code == -signal.SIGKILL, stderr[-3000:]
        outcomes.append((bool(NAMED.search(stderr)), ended, round(seconds, 1), stderr))
    named = sum(n for n, *_ in outcomes)
    missed = [err[-2000:] for n, e, _, err in outcomes if not (n and e)]
    assert named == trials and not missed, (
        f"rank 0 named in {named}/{trials} kills; rank 1 ended by itself in "
        f"{sum(e for _, e, *_ in outcomes)}/{trials}; seconds {[s for *_, s, _ in outcomes]}; "
        f"first miss:\n{missed[0] if missed else ''}"
    )
