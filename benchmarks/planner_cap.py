"""`strategy="auto"` and `micro_batch="auto"` on a GPT about 5× larger than plain training fits,
under a memory cap.

    python benchmarks/planner_cap.py          # one H200 capped at 16 GiB (memory fraction)
    python benchmarks/planner_cap.py --tiny   # 2 CPU ranks, a tiny GPT, memory_budget as the cap

How the model is sized, from the forecast: the largest depth whose plain single-device training
(Candidate "single": weights, gradients, AdamW states, autocast's weight cache; model states only,
from the meta device, at micro-batch 1) fits the cap less the planner's 10% headroom; then the depth
with `--factor` (5) times its parameters. (Measured on one H200 at seq 1024, plain training fitted
0.97B under 16 GiB: docs/benchmarks.md.) The run itself sets nothing about memory: it is
`Trainer(strategy="auto", micro_batch="auto")` with the accelerator, precision and a few steps. It
prints the plan chosen (the planner's table, the micro-batch search), then one table: parameters, ×
plain, strategy, micro-batch, peak GPU memory of the training steps, seconds per step and tokens/s.

The run happens in a child process with a hard time limit (`--limit`, default 280 s): on expiry its
process group is killed and this exits 124.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import lightspeed as ls  # noqa: E402
from lightspeed.demos.gpt import SIZES, GPTConfig, GPTModule, RandomTokens  # noqa: E402
from lightspeed.plan.candidates import Candidate  # noqa: E402
from lightspeed.plan.forecast import forecast  # noqa: E402

GIB = 2**30
GPU_MODEL = replace(
    SIZES["1.3b"], block_size=256
)  # seq 256: the CPU activation probe of a ~5B model stays short
TINY_MODEL = GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, n_embd=64, bias=False)


class CappedGPT(GPTModule):
    """The GPT with its micro-batch as `self.batch_size`, read by `train_dataloader` (what
    micro_batch="auto" writes before it rebuilds the loader)."""

    def __init__(self, cfg: GPTConfig, batch_size: int = 1):
        super().__init__(cfg, lr=1e-4)
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(
            RandomTokens(self.cfg.vocab_size, self.cfg.block_size, 512), batch_size=self.batch_size
        )


class Clock(ls.Callback):
    """Step times and the peak GPU memory of the training steps only (the micro-batch trials come
    before)."""

    def __init__(self):
        self.times: list[float] = []

    def on_train_start(self, trainer, module):
        if torch.cuda.is_available() and trainer.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(trainer.device)
        self.times.append(time.perf_counter())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        self.times.append(time.perf_counter())


def plain_layers(cfg: GPTConfig, cap: float, precision: str) -> int:
    """The most layers whose plain single-device model states (the forecast) fit `cap` less 10%."""
    layers = 1
    while _states(replace(cfg, n_layer=layers + 1), precision) <= 0.9 * cap:
        layers += 1
    return layers


def _states(cfg: GPTConfig, precision: str) -> int:
    [f] = forecast(CappedGPT(cfg), 1, precision, 1, candidates=[Candidate("single")])
    return f.device_total


def params(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        module = CappedGPT(cfg)
        module.configure_model()
    return sum(p.numel() for p in module.parameters())


def sized(cfg: GPTConfig, cap: float, precision: str, factor: float) -> tuple[GPTConfig, int, int]:
    """(the model config with `factor` × the plain maximum's parameters, that maximum's layers, its
    parameters)."""
    base = plain_layers(cfg, cap, precision)
    target = factor * params(replace(cfg, n_layer=base))
    layers = base
    while params(replace(cfg, n_layer=layers)) < target:
        layers += 1
    return replace(cfg, n_layer=layers), base, params(replace(cfg, n_layer=base))


def count(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def child(args: argparse.Namespace) -> None:
    cfg = GPTConfig(**json.loads(args.child))
    if args.tiny:
        flags = dict(
            accelerator="cpu", devices=2, memory_budget=args.cap_bytes, precision="32-true"
        )
    else:
        torch.cuda.set_per_process_memory_fraction(
            args.cap_bytes / torch.cuda.get_device_properties(0).total_memory
        )
        flags = dict(accelerator="gpu", devices=1, precision="bf16-mixed")
    clock = Clock()
    model = CappedGPT(cfg)
    trainer = ls.Trainer(
        strategy="auto",
        micro_batch="auto",
        max_steps=args.steps,
        callbacks=[clock],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
        **flags,
    )
    trainer.fit(model)
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])][1:] or [
        clock.times[-1] - clock.times[0]
    ]
    step_s = sorted(steps)[len(steps) // 2]
    peak = (
        torch.cuda.max_memory_allocated(trainer.device) if trainer.device.type == "cuda" else None
    )
    if trainer.is_global_zero:
        row = {
            "params": params(cfg),
            "layers": cfg.n_layer,
            "strategy": trainer.strategy.name,
            "micro_batch": model.batch_size,
            "peak_gib": peak and peak / GIB,
            "step_s": step_s,
            "tok_s": model.batch_size * cfg.block_size * trainer.world_size / step_s,
            "steps": trainer.global_step,
        }
        print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--tiny", action="store_true", help="2 CPU ranks, a tiny GPT, memory_budget as the cap"
    )
    p.add_argument("--cap", type=float, help="GiB per device (default 16; --tiny: MiB, default 4)")
    p.add_argument(
        "--factor",
        type=float,
        help="× the parameters plain training fits (default 5; --tiny: 1.6, as "
        "2 CPU ranks shard by 2 at most and CPU plans no offload)",
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--limit", type=float, default=280.0, help="seconds before the run is killed")
    p.add_argument("--out", default="planner_cap_out")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--cap-bytes", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    start = time.perf_counter()
    if args.tiny:
        base_cfg, cap, precision, factor = (
            TINY_MODEL,
            (args.cap or 4) * 2**20,
            "32-true",
            args.factor or 1.6,
        )
    else:
        base_cfg, cap, precision, factor = (
            GPU_MODEL,
            (args.cap or 16) * GIB,
            "bf16-mixed",
            args.factor or 5.0,
        )
    cfg, base, base_params = sized(base_cfg, cap, precision, factor)
    print(
        f"cap {cap / GIB:.3f} GiB; the forecast fits plain training up to {base} layers "
        f"({count(base_params)} "
        f"parameters, model states); running {cfg.n_layer} layers ({count(params(cfg))}, "
        f"{params(cfg) / base_params:.2f}×)",
        flush=True,
    )
    cmd = [
        sys.executable,
        __file__,
        "--child",
        json.dumps(cfg.__dict__),
        "--cap-bytes",
        str(cap),
        "--steps",
        str(args.steps),
        "--out",
        args.out,
    ] + (["--tiny"] if args.tiny else [])
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
    )
    lines = []
    try:
        deadline = start + args.limit
        for (
            line
        ) in proc.stdout:  # echoed as it comes; the limit is checked per line and by the wait below
            print(line, end="", flush=True)
            lines.append(line)
            if time.perf_counter() > deadline:
                raise subprocess.TimeoutExpired(cmd, args.limit)
        proc.wait(timeout=max(1.0, deadline - time.perf_counter()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        print(
            f"time limit: killed after {time.perf_counter() - start:.0f} s (--limit "
            f"{args.limit:.0f})",
            flush=True,
        )
        raise SystemExit(124)
    result = next((json.loads(x[7:]) for x in lines if x.startswith("RESULT ")), None)
    if proc.returncode or result is None:
        raise SystemExit(f"the run failed (exit {proc.returncode})")
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"strategy='auto', micro_batch='auto' under a {cap / GIB:.3g} GiB cap")
    for name in (
        "parameters",
        "× plain max",
        "strategy",
        "micro-batch",
        "peak GiB",
        "s/step",
        "tok/s",
        "wall s",
    ):
        table.add_column(name, justify="right")
    peak = f"{result['peak_gib']:.2f}" if result["peak_gib"] is not None else "(CPU)"
    table.add_row(
        count(result["params"]),
        f"{result['params'] / base_params:.2f}",
        result["strategy"],
        str(result["micro_batch"]),
        peak,
        f"{result['step_s']:.2f}",
        f"{result['tok_s']:,.0f}",
        f"{time.perf_counter() - start:.0f}",
    )
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
