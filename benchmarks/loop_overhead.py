"""Trainer overhead on CPU: a hand-written PyTorch loop vs `Trainer.fit` on the same GPT, data and
optimizer.

    .venv/bin/python benchmarks/loop_overhead.py [--size small] [--steps 60] [--repeats 3]

Both loops run in this process, alternating (loop, trainer, loop, trainer, ...) so machine drift
hits both alike. Each reports the median time per optimizer step after a warm-up; the table gives
the ratio trainer / loop. Target: ≤ 1.03 (≤3% overhead).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch.utils.data import DataLoader

import lightspeed as ls
from lightspeed.demos.gpt import SIZES, GPTModule, RandomTokens

WARMUP = 5


def make_data(cfg, batch_size: int, steps: int) -> DataLoader:
    return DataLoader(
        RandomTokens(cfg.vocab_size, cfg.block_size, batch_size * (steps + WARMUP)),
        batch_size=batch_size,
    )


def plain_loop(cfg, loader: DataLoader) -> list[float]:
    """What a user writes by hand: forward, loss, backward, clip, step, zero_grad."""
    torch.manual_seed(0)
    module = GPTModule(cfg)
    module.configure_model()
    opt = module.configure_optimizers()
    stamps = []
    for x, y in loader:  # timed like the Trainer: from the end of one step to the end of the next
        logits = module(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])][WARMUP - 1 :]


class StepTimer(ls.Callback):
    def __init__(self):
        self.stamps: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.stamps.append(time.perf_counter())


def trainer_loop(cfg, loader: DataLoader) -> list[float]:
    torch.manual_seed(0)
    timer = StepTimer()
    trainer = ls.Trainer(
        devices=1,
        accelerator="cpu",
        max_epochs=1,
        gradient_clip_val=1.0,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(GPTModule(cfg), loader)
    diffs = [b - a for a, b in zip(timer.stamps, timer.stamps[1:])]
    return diffs[WARMUP - 1 :]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="small", choices=sorted(SIZES))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    cfg = SIZES[args.size]
    loader = make_data(cfg, args.batch_size, args.steps)
    plain, lightspeed = [], []
    for _ in range(args.repeats):
        plain += plain_loop(cfg, loader)
        lightspeed += trainer_loop(cfg, loader)
    p_med, l_med = statistics.median(plain), statistics.median(lightspeed)
    table = Table(
        title=(
            f"Trainer overhead, GPT '{args.size}', batch {args.batch_size}, CPU "
            f"({torch.get_num_threads()} threads)"
        )
    )
    for col in ("loop", "median ms/step", "steps timed", "ratio to plain loop"):
        table.add_column(col, justify="right")
    table.add_row("plain PyTorch", f"{p_med * 1e3:.2f}", str(len(plain)), "1.000")
    table.add_row(
        "lightspeed Trainer", f"{l_med * 1e3:.2f}", str(len(lightspeed)), f"{l_med / p_med:.3f}"
    )
    Console().print(table)


if __name__ == "__main__":
    main()
