"""Command line: `lightspeed demo` trains the demo GPT; `lightspeed convert` turns a checkpoint into safetensors.

    lightspeed demo [--strategy deepspeed_stage_2] [--devices 2] [--precision 32-true] [--max-steps 300] [--size small]
    lightspeed convert CHECKPOINT OUT.safetensors
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import warnings
from pathlib import Path

import torch

from .callbacks import Callback

DEFAULT_STRATEGY = "deepspeed_stage_2"


class Throughput(Callback):
    """Times optimizer steps after the first (warm-up) and remembers the first and last loss."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.first_loss = self.last_loss = self.tokens_per_s = float("nan")
        self._t0: float | None = None
        self._steps = 0
        self._recent: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        loss = float((outputs if isinstance(outputs, torch.Tensor) else outputs["loss"]).detach())
        if self._t0 is None:
            self.first_loss, self._t0 = loss, time.perf_counter()
            return
        self._steps += 1
        self._recent = (self._recent + [loss])[-20:]
        self.last_loss = sum(self._recent) / len(self._recent)  # one batch's loss is noisy: the last 20 steps
        self.tokens_per_s = self._steps * self.tokens_per_step / (time.perf_counter() - self._t0)


def _peak_memory(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB (GPU)"
    return f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB (rank 0 RSS)"


def _quiet_backends(accelerator: str) -> None:
    """The demo's output should be the progress bar and the summary: name DeepSpeed's accelerator so it does not
    announce its guess, and drop torch's deprecation notices about calls DeepSpeed makes. Ranks re-run this
    command, so the settings reach them too."""
    if accelerator == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def demo(args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table
    from torch.utils.data import DataLoader

    from . import Trainer, seed_everything
    from .conversion import consolidate
    from .examples.gpt import SIZES, ByteWindows, GPTModule, stdlib_corpus

    _quiet_backends(args.accelerator)
    cfg = SIZES[args.size]
    seed_everything(0)
    data = ByteWindows(stdlib_corpus(), cfg.block_size)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True)
    module = GPTModule(cfg, lr=args.lr, warmup_steps=10)
    meter = Throughput(args.batch_size * cfg.block_size * args.devices)
    root = Path(args.root)
    trainer = Trainer(strategy=args.strategy, devices=args.devices, precision=args.precision,
                      max_steps=args.max_steps, default_root_dir=str(root), callbacks=[meter],
                      log_every_n_steps=10, seed=0, accelerator=args.accelerator, gradient_clip_val=1.0)
    trainer.fit(module, loader)
    last = trainer.checkpoint_dir / "last"
    trainer.save_checkpoint(trainer.checkpoint_dir / f"final-step={trainer.global_step}")
    if not trainer.is_global_zero:
        return
    weights = consolidate(last, root / "demo-gpt.safetensors")
    from safetensors.torch import load_file

    plain = GPTModule(cfg)  # a fresh, plain copy of the user's Module: no trainer, no strategy
    plain.configure_model()
    plain.load_state_dict(load_file(str(weights)), strict=True)
    torch.manual_seed(1)
    prompt = torch.tensor([list(b"def ")], dtype=torch.long)
    sample = bytes(plain.model.eval().generate(prompt, 160)[0].tolist()).decode("utf-8", errors="replace")

    table = Table(title="lightspeed demo")
    table.add_column("")
    table.add_column("value", justify="right")
    rows = [
        ("strategy", trainer.strategy.name), ("devices", f"{args.devices} × {trainer.device.type}"),
        ("precision", args.precision), ("parameters", f"{plain.model.num_params() / 1e6:.2f} M"),
        ("optimizer steps", str(trainer.global_step)), ("tokens/s", f"{meter.tokens_per_s:,.0f}"),
        ("peak memory", _peak_memory(trainer.device)), ("first loss", f"{meter.first_loss:.3f}"),
        ("last loss (mean of last 20 steps)", f"{meter.last_loss:.3f}"), ("checkpoint", str(last.resolve())),
        ("consolidated weights", str(weights)),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console = Console()
    console.print(table)
    console.print("[bold]sample[/bold] (plain GPT loaded from the consolidated safetensors):")
    console.print(sample, markup=False, highlight=False)


def convert(args: argparse.Namespace) -> None:
    from .conversion import consolidate

    out = consolidate(args.checkpoint, args.out)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lightspeed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="train the demo byte-level GPT on the Python standard library's source")
    d.add_argument("--strategy", default=DEFAULT_STRATEGY)
    d.add_argument("--devices", type=int, default=2)
    d.add_argument("--accelerator", default="cpu")
    d.add_argument("--precision", default="32-true")
    d.add_argument("--max-steps", type=int, default=300)
    d.add_argument("--size", default="small", choices=["tiny", "small", "medium", "1.3b"])
    d.add_argument("--batch-size", type=int, default=8, help="per device")
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--root", default="lightspeed_demo")
    c = sub.add_parser("convert", help="consolidate a checkpoint into one safetensors file")
    c.add_argument("checkpoint")
    c.add_argument("out")
    args = parser.parse_args(argv)
    {"demo": demo, "convert": convert}[args.command](args)


if __name__ == "__main__":
    main(sys.argv[1:])
