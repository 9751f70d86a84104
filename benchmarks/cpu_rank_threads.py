"""CPU ranks sharing one host: every rank with a thread per CPU (torch's default, and lightspeed's
until 2026-11-30) against lightspeed's share (the CPUs it may use divided by the local ranks, as
Lightning does).

    .venv/bin/python benchmarks/cpu_rank_threads.py [--strategies ddp,deepspeed_stage_2] \\
        [--widths 128,256] [--repeats 3]

Each run is scaling_multi_gpu.py's scaling run on 2 gloo ranks (`Trainer(devices=2,
accelerator="cpu")`, the user's GPT with torch AdamW) in its own process: "every rank all CPUs" sets
OMP_NUM_THREADS to the CPU count (a user's OMP_NUM_THREADS stands, so this is the old behaviour),
"lightspeed's share" leaves it unset. The two alternate (all, share, all, share, ...) so drift hits
both alike. The table gives median ms per step and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]


def step_ms(strategy: str, width: int, threads: str | None, args) -> float:
    """One run's median ms per step on 2 CPU ranks; `threads` None leaves OMP_NUM_THREADS unset."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT / "src")
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [
            sys.executable,
            str(ROOT / "benchmarks" / "scaling_multi_gpu.py"),
            "--cpu",
            "--tiny",
            "--d",
            str(width),
            "--layers",
            "4",
            "--devices",
            "2",
            "--counts",
            "2",
            "--sections",
            "scaling",
            "--module",
            "user",
            "--micro-batch",
            "8",
            "--repeats",
            "1",
            "--warmup",
            "2",
            "--steps",
            str(args.steps),
            "--strategies",
            strategy,
            "--json",
            str(out),
        ]
        subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        results = list(json.loads(out.read_text()).values()) if out.exists() else []
    if not results or "step_s" not in results[0]:
        raise SystemExit(f"{strategy} d={width} threads={threads}: no result ({results[:1]})")
    return results[0]["step_s"] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--strategies", default="ddp,deepspeed_stage_2", type=lambda v: v.split(","))
    p.add_argument(
        "--widths",
        default="128,256",
        type=lambda v: [int(w) for w in v.split(",")],
        help="the GPT's width (4 layers, sequence 32, vocabulary 256)",
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    table = Table(title=f"2 CPU ranks on {cpus} CPUs: ms per step (median of {args.repeats} runs)")
    for col in (
        "strategy",
        "width",
        f"every rank {cpus} threads",
        f"lightspeed's share ({max(1, cpus // 2)})",
        "speed-up",
    ):
        table.add_column(col, justify="right")
    for strategy in args.strategies:
        for width in args.widths:
            runs: dict[str, list[float]] = {"all": [], "share": []}
            for _ in range(args.repeats):
                runs["all"].append(step_ms(strategy, width, str(cpus), args))
                runs["share"].append(step_ms(strategy, width, None, args))
            every, share = statistics.median(runs["all"]), statistics.median(runs["share"])
            table.add_row(
                strategy, str(width), f"{every:.1f}", f"{share:.1f}", f"{every / share:.2f}×"
            )
            print(
                f"[cpu_rank_threads] {strategy} d={width}: {json.dumps(runs)}",
                file=sys.stderr,
                flush=True,
            )
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
