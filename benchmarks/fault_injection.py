"""Fault injection: faults put into 2-rank CPU runs of tests/workload.py, and what happens counted,
as a rich table.

    PYTHONPATH=src .venv/bin/python benchmarks/fault_injection.py [--trials 20] [--strategy ddp] \\
        [--only kill9,preempt:10]

Faults (each repeated --trials times, the victim rank alternating):
  kill9     SIGKILL one rank at step 5: the job must exit non-zero within seconds, naming the dead
            rank
  midsave   SIGKILL the whole job 0-30 ms after a save began (not the first), saving every 2
            steps: `last` must be complete (full checksum check) and `fit(ckpt_path="last")` must
            resume or say why
  preempt   SIGTERM one rank at step 4: exit 143, a checkpoint, and a resume whose per-step losses
            equal an uninterrupted run's (relative 1e-6)
  nan       NaN loss on one rank at step 3: every rank stops with a message naming step and rank;
            `last` holds finite weights
  bitflip   one bit flipped in the last checkpoint's largest file: `verify(full=True)` must name it
  hang      one rank sleeps in training_step at step 5 with Trainer(timeout=--hang-timeout): the
            job must exit non-zero, the output naming that rank and step ("rank 1 stopped
            answering at step 5")
A run that does not end within --timeout seconds counts as a hang.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import WORKLOAD, run_workload  # noqa: E402  (the tests' one launcher)
from lightspeed.checkpoint.checkpointer import verify  # noqa: E402
from lightspeed.errors import ConfigError  # noqa: E402


def _run(tmp: Path, timeout: float, **opts):
    try:
        return run_workload(tmp, devices=2, check=False, timeout=timeout, **opts), False
    except AssertionError as e:  # helpers.launch: a hang, every process killed
        if "hung" in str(e):
            print(
                f"--- a hang ({opts}):\n{str(e)[-3000:]}", file=sys.stderr
            )  # what the ranks said last
            return None, True
        raise


def kill9(tmp: Path, trial: int, a) -> dict:
    victim = trial % 2
    run, hung = _run(
        tmp,
        a.timeout,
        strategy=a.strategy,
        max_steps=40,
        batch_size=4,
        sigterm_at={"step": 5, "rank": victim, "signal": "SIGKILL"},
    )
    if hung:
        return {"hang": True}
    # Rank 0 is the job's own process: its -9 is the job's status. Another rank must be named in the
    # output.
    named = (
        run.returncode == -9
        if victim == 0
        else f"rank {victim} " in run.stderr and "SIGKILL" in run.stderr
    )
    return {"ok": run.returncode != 0 and named, "seconds": run.seconds, "named": named}


def midsave(tmp: Path, trial: int, a) -> dict:
    opts = {
        "strategy": a.strategy,
        "devices": 2,
        "max_steps": 400,
        "ckpt_every": 2,
        "batch_size": 4,
        "root": str(tmp),
        "out": str(tmp / "killed.json"),
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(WORKLOAD), json.dumps(opts)],
        cwd=tmp,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    # Wait for a save in flight (its `.tmp-` directory) after the first one completed, then kill at
    # a random
    # moment inside the save's first 30 ms: most trials then kill a save mid-write, the case under
    # test.
    deadline, ckpts = time.time() + 120, tmp / "checkpoints"
    while (
        time.time() < deadline
        and proc.poll() is None
        and not ((ckpts / "last.ckpt").exists() and _saving(ckpts))
    ):
        time.sleep(0.002)
    time.sleep(random.uniform(0.0, 0.03))
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    ckpts = tmp / "checkpoints"
    mid = _saving(ckpts) if ckpts.exists() else False
    try:
        if (ckpts / "last.ckpt").exists():
            verify(ckpts / "last.ckpt", full=True)
        intact = True
    except ConfigError:
        intact = False
    run, hung = _run(
        tmp, a.timeout, strategy=a.strategy, max_steps=2, batch_size=4, resume="last", ckpt_every=2
    )
    if hung:
        return {"hang": True}
    said_why = run.returncode == 0 or "ConfigError" in run.stderr
    return {
        "ok": intact and said_why,
        "mid_save": mid,
        "corrupt_load": run.returncode == 0 and not intact,
    }


def preempt(tmp: Path, trial: int, a) -> dict:
    ref_dir = tmp / "ref"
    ref_dir.mkdir()
    ref, hung = _run(ref_dir, a.timeout, strategy=a.strategy, max_steps=8, shuffle=True)
    first, hung2 = _run(
        tmp,
        a.timeout,
        strategy=a.strategy,
        max_steps=8,
        shuffle=True,
        sigterm_at={"step": 4, "rank": trial % 2},
    )
    if hung or hung2:
        return {"hang": True}
    rest, hung = _run(tmp, a.timeout, strategy=a.strategy, max_steps=8, shuffle=True, resume="last")
    if hung:
        return {"hang": True}
    results = [json.loads(p.read_text()) for p in tmp.glob("result-*.json")]
    pre = next((r for r in results if r.get("exit") == 143), None)
    post = next((r for r in results if "exit" not in r and r.get("global_step") == 8), None)
    ref_losses = json.loads(next(ref_dir.glob("result-*.json")).read_text())["losses"]
    same = bool(pre and post) and all(
        abs(x - y) <= 1e-6 * abs(y) for x, y in zip(pre["losses"] + post["losses"], ref_losses)
    )
    return {
        "ok": first.returncode == 143 and rest.returncode == 0 and same,
        "seconds": first.seconds,
    }


def nan(tmp: Path, trial: int, a) -> dict:
    run, hung = _run(
        tmp,
        a.timeout,
        strategy=a.strategy,
        max_steps=8,
        ckpt_every=2,
        nan_at={"step": 3, "rank": trial % 2},
    )
    if hung:
        return {"hang": True}
    said = (
        "NonFiniteError" in run.stderr
        and f"rank(s) [{trial % 2}]" in run.stderr
        and "step 3" in run.stderr
    )
    return {"ok": run.returncode != 0 and said, "seconds": run.seconds}


def _saving(ckpts: Path) -> bool:
    """A save in flight: a directory's `.tmp-<name>`, a file's `.parts-<name>` or `.tmp-<name>`."""
    return any(p.name.startswith((".tmp-", ".parts-")) for p in ckpts.iterdir())


def bitflip(tmp: Path, trial: int, a) -> dict:
    run, hung = _run(tmp, a.timeout, strategy=a.strategy, max_steps=2, ckpt_every=2)
    if hung:
        return {"hang": True}
    last = (tmp / "checkpoints" / "last.ckpt").resolve()
    files = [last] if last.is_file() else [p for p in last.rglob("*") if p.is_file()]
    victim = max((p for p in files if p.name != "meta.json"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[random.randrange(len(data))] ^= 1 << random.randrange(8)
    victim.write_bytes(bytes(data))
    try:
        verify(last, full=True)
        named = False
    except ConfigError as e:
        named = victim.name in str(e)
    return {"ok": named, "corrupt_load": not named}


def hang(tmp: Path, trial: int, a) -> dict:
    victim = trial % 2
    run, hung = _run(
        tmp,
        a.timeout,
        strategy=a.strategy,
        max_steps=40,
        batch_size=4,
        collective_timeout=a.hang_timeout,
        stall_at={"step": 5, "rank": victim, "seconds": 3600},
    )
    if hung:
        return {"hang": True}
    named = f"rank {victim} stopped answering at step 5" in run.stderr
    return {"ok": run.returncode != 0 and named, "seconds": run.seconds}


FAULTS = {
    "kill9": kill9,
    "midsave": midsave,
    "preempt": preempt,
    "nan": nan,
    "bitflip": bitflip,
    "hang": hang,
}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--trials", type=int, default=5, help="trials per fault (default 5)")
    p.add_argument("--strategy", default="ddp", help="strategy of every run (default ddp)")
    p.add_argument(
        "--only",
        default=",".join(FAULTS),
        help=(
            "comma-separated faults, each optionally with its own trial count, e.g. "
            "kill9:20,preempt:10 "
            f"(default all: {','.join(FAULTS)})"
        ),
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=180,
        help="seconds before a run counts as a hang (default 180)",
    )
    p.add_argument(
        "--hang-timeout",
        type=float,
        default=10,
        help="Trainer(timeout=) of the hang fault's runs, in seconds (default 10)",
    )
    a = p.parse_args()
    table = Table(title=f"fault injection: {a.strategy}, 2 CPU ranks")
    for col in (
        "fault",
        "trials",
        "as intended",
        "hangs",
        "silent corrupt loads",
        "median s",
        "notes",
    ):
        table.add_column(col)
    for item in a.only.split(","):
        name, _, count = item.partition(":")  # "preempt:10": this fault's own trial count
        outcomes = []
        for trial in range(int(count or a.trials)):
            with tempfile.TemporaryDirectory() as d:
                outcomes.append(FAULTS[name](Path(d), trial, a))
        secs = sorted(o["seconds"] for o in outcomes if "seconds" in o)
        notes = {
            "midsave": f"{sum(o.get('mid_save', False) for o in outcomes)} killed mid-save",
            "hang": f"Trainer(timeout={a.hang_timeout:g})",
        }.get(name, "")
        table.add_row(
            name,
            str(len(outcomes)),
            str(sum(bool(o.get("ok")) for o in outcomes)),
            str(sum(bool(o.get("hang")) for o in outcomes)),
            str(sum(bool(o.get("corrupt_load")) for o in outcomes)),
            f"{secs[len(secs) // 2]:.1f}" if secs else "-",
            notes,
        )
    Console().print(table)


if __name__ == "__main__":
    main()
