"""What the agreement on a stream's end costs (data/epoch_windows.py), on 2 ranks: per optimizer
step in training, per batch in evaluation.

    .venv/bin/python benchmarks/epoch_end_vote.py [--calls 2000] [--steps 60] [--repeats 3]
        [--evaluation-only] [--size tiny|small]

A training loader without an exact length (an IterableDataset) makes the ranks agree before each
optimizer step on how many micro-batches all of them have: one `distributed.host_min_max`, an
all_reduce of two integers on the host (gloo; beside NCCL, a gloo group of its own).

1. The call alone: the median of `--calls` calls on 2 ranks, beside a barrier (the cheapest
   collective there is) and, on CUDA, beside what a device reduction read back by the host costs
   while a step's kernels are queued (the wait the host group avoids).
2. In training: `Trainer.fit` of the small GPT under DDP on 2 ranks, the same batches once from a
   map-style dataset (counts known: no vote) and once from an IterableDataset (a vote per step),
   alternating `--repeats` times; the median time per step and the ratio stream / map-style.
3. In evaluation: `Trainer.validate` of the same model under DDP on 2 ranks, `--steps` batches of
   16 per rank, from a map-style dataset (no vote), from an IterableDataset (a vote per window of
   `EVAL_WINDOW` batches, EvalBatches) and from the same with a window of one batch (a vote per
   batch: every batch waits for the slower rank), alternating; the mean time per batch and the
   ratio.

CPU (gloo) when CUDA has fewer than 2 GPUs, else 2 GPUs (NCCL).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader, IterableDataset

import lightspeed as ls
from lightspeed.data import epoch_windows
from lightspeed.demos.gpt import SIZES, GPTModule, RandomTokens
from lightspeed.runtime.distributed import host_min_max

ON_GPU = torch.cuda.device_count() >= 2
WARMUP = 5


# ------------------------------------------------------------------ 1. the call alone
def _calls(rank: int, port: int, calls: int, out: str) -> None:
    backend = "nccl" if ON_GPU else "gloo"
    if ON_GPU:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    host_min_max(rank)  # makes the gloo group beside NCCL, once

    def timed(fn) -> float:
        for _ in range(20):
            fn()
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    found = {"host_min_max": timed(lambda: host_min_max(rank)), "barrier": timed(dist.barrier)}
    if ON_GPU:  # a device reduction read back while a step's kernels are queued
        a = torch.randn(4096, 4096, device="cuda")
        flag = torch.zeros(2, dtype=torch.int64, device="cuda")

        def device_read() -> None:
            for _ in range(4):
                a @ a  # ~ a few ms of queued work, as a step leaves behind
            dist.all_reduce(flag)
            flag.tolist()

        def queued_only() -> None:
            for _ in range(4):
                a @ a
            torch.cuda.synchronize()

        found["device all_reduce + read, 4 matmuls queued"] = timed(device_read)
        found["the 4 matmuls alone"] = timed(queued_only)
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


def call_costs(calls: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "calls.json")
        port = 29500 + os.getpid() % 1000
        mp.spawn(_calls, args=(port, calls, out), nprocs=2)
        return json.loads(Path(out).read_text())


# ------------------------------------------------------------------ 2. in training
class Stream(IterableDataset):
    """The same samples as `data`, without a length."""

    def __init__(self, data):
        self.data = data

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


class StepTimer(ls.Callback):
    def __init__(self):
        self.stamps: list[float] = []

    def stamp(self) -> None:
        if ON_GPU:
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.stamp()

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, idx=0):
        self.stamp()


def fit_once(kind: str, steps: int, out: str, size: str = "small") -> None:
    """One fit on 2 ranks (the Trainer starts the second); rank 0 writes its step times."""
    cfg = SIZES[size]
    torch.manual_seed(0)
    # per rank: `steps` batches of 16; the map-style loader gets a DistributedSampler
    data = RandomTokens(cfg.vocab_size, cfg.block_size, 16 * (steps + WARMUP) * 2)
    if kind == "stream":
        data = RandomTokens(cfg.vocab_size, cfg.block_size, 16 * (steps + WARMUP))
    loader = DataLoader(data if kind == "map" else Stream(data), batch_size=16)
    timer = StepTimer()
    trainer = ls.Trainer(
        accelerator="gpu" if ON_GPU else "cpu",
        devices=2,
        strategy="ddp",
        max_epochs=1,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(GPTModule(cfg), loader)
    if trainer.is_global_zero:
        diffs = [b - a for a, b in zip(timer.stamps, timer.stamps[1:])][WARMUP - 1 :]
        Path(out).write_text(json.dumps(diffs))


def validate_once(kind: str, batches: int, out: str, size: str = "small") -> None:
    """One validate on 2 ranks; rank 0 writes its times per batch."""
    cfg = SIZES[size]
    torch.manual_seed(0)
    per_rank = 16 * (batches + WARMUP)
    data = RandomTokens(cfg.vocab_size, cfg.block_size, per_rank * (2 if kind == "map" else 1))
    loader = DataLoader(data if kind == "map" else Stream(data), batch_size=16)
    if kind == "stream1":
        epoch_windows.EVAL_WINDOW = 1  # on both ranks: each runs this function
    timer = StepTimer()
    trainer = ls.Trainer(
        accelerator="gpu" if ON_GPU else "cpu",
        devices=2,
        strategy="ddp",
        callbacks=[timer],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(GPTModule(cfg), loader, verbose=False)
    if trainer.is_global_zero:
        diffs = [b - a for a, b in zip(timer.stamps, timer.stamps[1:])][WARMUP - 1 :]
        Path(out).write_text(json.dumps(diffs))


def step_times(
    steps: int, repeats: int, entry: str, kinds: tuple, size: str
) -> dict[str, list[float]]:
    found: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for kind in found:
                out = os.path.join(tmp, f"{kind}.json")
                cmd = [sys.executable, __file__, entry, kind, "--out", out]
                cmd += ["--steps", str(steps), "--size", size]
                subprocess.run(cmd, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
                found[kind] += json.loads(Path(out).read_text())
    return found


def fit_tables(args: argparse.Namespace, where: str) -> None:
    """Parts 1 and 2: the call alone, and in training."""
    calls = call_costs(args.calls)
    table = Table(title=f"One call on 2 ranks ({where}), median of {args.calls}")
    for col in ("call", "µs", "ratio to barrier"):
        table.add_column(col, justify="right")
    for name, sec in calls.items():
        table.add_row(name, f"{sec * 1e6:.1f}", f"{sec / calls['barrier']:.2f}")
    Console().print(table)
    times = step_times(args.steps, args.repeats, "--fit", ("map", "stream"), args.size)
    mapped, streamed = (statistics.median(times[k]) for k in ("map", "stream"))
    table = Table(title=f"DDP fit of the {args.size} GPT, batch 16 per rank ({where})")
    for col in ("training loader", "median ms/step", "steps timed", "ratio to map-style"):
        table.add_column(col, justify="right")
    table.add_row(
        "map-style (counts known)", f"{mapped * 1e3:.2f}", str(len(times["map"])), "1.000"
    )
    table.add_row(
        "IterableDataset (a vote per step)",
        f"{streamed * 1e3:.2f}",
        str(len(times["stream"])),
        f"{streamed / mapped:.3f}",
    )
    Console().print(table)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--evaluation-only", action="store_true", help="part 3 alone")
    p.add_argument("--size", choices=("tiny", "small"), default="small", help="the GPT's size")
    p.add_argument("--fit", choices=("map", "stream"), help=argparse.SUPPRESS)
    p.add_argument("--validate", choices=("map", "stream", "stream1"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fit:
        fit_once(args.fit, args.steps, args.out, args.size)
        return
    if args.validate:
        validate_once(args.validate, args.steps, args.out, args.size)
        return
    where = "2 GPUs, NCCL" if ON_GPU else f"CPU, gloo ({os.cpu_count()} cores)"
    if not args.evaluation_only:
        fit_tables(args, where)
    kinds = ("map", "stream", "stream1")
    times = step_times(args.steps, args.repeats, "--validate", kinds, args.size)
    # the mean, not the median: a window's wait falls on one batch in EVAL_WINDOW
    medians = {kind: statistics.mean(found) for kind, found in times.items()}
    table = Table(title=f"DDP validate of the {args.size} GPT, batch 16 per rank ({where})")
    for col in ("validation loader", "mean ms/batch", "batches timed", "ratio to map-style"):
        table.add_column(col, justify="right")
    names = {
        "map": "map-style (counts known: no vote)",
        "stream": f"IterableDataset (a vote per {epoch_windows.EVAL_WINDOW} batches)",
        "stream1": "IterableDataset (a vote per batch)",
    }
    for kind, name in names.items():
        ratio = f"{medians[kind] / medians['map']:.3f}"
        table.add_row(name, f"{medians[kind] * 1e3:.2f}", str(len(times[kind])), ratio)
    Console().print(table)


if __name__ == "__main__":
    main()
