"""What the heartbeat costs a training step, measured inside one real run: blocks of steps with the
heartbeat thread off, on (once a second, as shipped) and on at 100 times that rate (to bound what
the thread could cost), interleaved, each block's steps timed.

    PYTHONPATH=src .venv/bin/python benchmarks/heartbeat_step_cost.py                 # 2 CPU ranks
    PYTHONPATH=src python3 benchmarks/heartbeat_step_cost.py --accelerator gpu --devices 1 \
        --size medium --batch-size 32                                                 # one GPU

The step time is the wall time between two `on_train_batch_end` calls on rank 0 (with CUDA, after a
synchronize, so that a delayed kernel launch counts). With several ranks the heartbeat of every rank
is switched at the same step (the ranks share the step count); with one device, which starts no
heartbeat by itself, the benchmark opens a store on 127.0.0.1 for it. Prints, per arm, the median
step time, its ratio to "off" in the same run, and the mean.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightspeed as ls
from lightspeed.demos.gpt import SIZES, ByteWindows, GPTModule, stdlib_corpus
from lightspeed.runtime import heartbeat

ARMS = (("off", None), ("on, 1/s", 1.0), ("on, 100/s", 0.01))


class Toggle(ls.Callback):
    """Switches the heartbeat between the arms every `block` steps and times each step."""

    def __init__(self, block: int, cuda: bool):
        self.block, self.cuda = block, cuda
        self.times: dict[str, list[float]] = {name: [] for name, _ in ARMS}
        self.last, self.arm, self.store = None, 0, None

    def on_train_start(self, trainer, module):
        if not heartbeat._heart.group:  # one process: no group, so no heartbeat of its own yet
            self.store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
            heartbeat._heart.group = (1, "127.0.0.1", self.store.port)
        self._switch(0)

    def _switch(self, arm: int) -> None:
        heartbeat.stop()
        self.arm = arm
        interval = ARMS[arm][1]
        if interval is not None:
            heartbeat.INTERVAL_S = interval
            world, host, port = heartbeat._heart.group
            heartbeat.start(dist.get_rank() if dist.is_initialized() else 0, world, host, port)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.cuda:
            torch.cuda.synchronize()
        now, name = time.perf_counter(), ARMS[self.arm][0]
        step = trainer.global_step
        if self.last is not None and step % self.block != 1:  # the first step of a block: warm-up
            self.times[name].append(now - self.last)
        self.last = now
        if step % self.block == 0:
            self._switch((self.arm + 1) % len(ARMS))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--block", type=int, default=20)
    args = parser.parse_args()
    ls.seed_everything(0)
    cfg = SIZES[args.size]
    data = ByteWindows(stdlib_corpus(2_000_000), cfg.block_size)
    toggle = Toggle(args.block, args.accelerator == "gpu")
    trainer = ls.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[toggle],
    )
    trainer.fit(GPTModule(cfg), DataLoader(data, batch_size=args.batch_size, shuffle=True))
    if not trainer.is_global_zero:
        return
    base = statistics.median(toggle.times["off"])
    print(
        f"{args.devices} x {args.accelerator}, GPT {args.size}, batch {args.batch_size}, "
        f"{args.steps} steps in blocks of {args.block}"
    )
    print(f"{'arm':<12}{'steps':>7}{'median ms':>11}{'vs off':>9}{'mean ms':>10}")
    for name, _ in ARMS:
        t = toggle.times[name]
        med = statistics.median(t)
        print(
            f"{name:<12}{len(t):>7}{med * 1e3:>11.3f}{med / base:>9.4f}"
            f"{statistics.fmean(t) * 1e3:>10.3f}"
        )


if __name__ == "__main__":
    main()
