"""Issue 40's one-GPU figure: the tensor-parallel code path on a mesh of one (tp=1) against the same
FSDP run without it, in one invocation.

    python benchmarks/planner_tp1.py                 # one H200, HF Llama 0.40B, bf16-mixed
    python benchmarks/planner_tp1.py --cpu --steps 4 # tiny Llama on the CPU (plumbing)

`FSDP(tp=1)` skips the TP code entirely (`strategies/fsdp.py`: the mesh, the plan and
`parallelize_module` run only for tp > 1), so its step is FSDP's by construction; it is measured
anyway. To measure the TP code path itself, this benchmark alone forces it at tp=1 (`ForcedTP`, an
int 1 that compares as above 1): the 2-D ("dp", "tp") mesh of 1×1, the model's Hugging Face tp_plan
applied with `parallelize_module` (every projection a DTensor, its hooks redistributing on a mesh of
one), then FSDP over the "dp" dimension. Each run is its own process (the runs alternate: fsdp,
forced, fsdp(tp=1), forced, fsdp), STEPS steps at micro-batch 8 and sequence 1024; tokens/s is the
micro-batch's tokens over the median step (the clock between consecutive batch ends). The ratio is
each variant's median over plain FSDP's median (both FSDP runs pooled).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "src"))

from planner_families import build, run_child  # noqa: E402

import lightspeed as ls  # noqa: E402
from lightspeed.strategies.fsdp import FSDP  # noqa: E402


class ForcedTP(int):
    """tp=1 that takes the tp > 1 branches: the TP code path on a mesh of one (benchmark only)."""

    def __gt__(self, other: object) -> bool:
        return True if other == 1 else int(self) > other  # type: ignore[operator]

    def __reduce__(self):
        return (ForcedTP, (int(self),))


class Llama(ls.LightningModule):
    def __init__(self, tiny: bool, seq: int, batch_size: int):
        super().__init__()
        self.model = build("llama", tiny)
        self.seq, self.batch_size = seq, batch_size

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-5)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        vocab = self.model.config.vocab_size
        data = torch.randint(0, vocab, (self.batch_size * 64, self.seq), generator=g)
        return DataLoader(data, batch_size=self.batch_size)


class Clock(ls.Callback):
    def __init__(self):
        self.ends: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.device.type == "cuda":
            torch.cuda.synchronize(trainer.device)
        self.ends.append(time.perf_counter())


def child(spec: dict, cpu: bool) -> None:
    ls.seed_everything(0)
    tp = {"fsdp": None, "fsdp(tp=1)": 1, "forced": ForcedTP(1)}[spec["variant"]]
    strategy = "fsdp" if tp is None else FSDP(tp=tp)
    model = Llama(cpu, spec["seq"], spec["micro_batch"])
    clock = Clock()
    trainer = ls.Trainer(
        accelerator="cpu" if cpu else "gpu",
        devices=1,
        precision="bf16-mixed",
        strategy=strategy,
        max_steps=spec["steps"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[clock],
    )
    trainer.fit(model)
    steps = [b - a for a, b in zip(clock.ends, clock.ends[1:])]
    # 2-D DTensors ("dp", "tp"): the TP plan ran before FSDP sharded over "dp"
    dtensors = sum(
        getattr(p, "device_mesh", None) is not None and p.device_mesh.ndim == 2
        for p in model.parameters()
    )
    row = {
        "family": spec["variant"],
        "variant": spec["variant"],
        "strategy": trainer.strategy.name,
        "steps": steps,
        "median": statistics.median(steps),
        "tokens_per_s": spec["micro_batch"] * spec["seq"] / statistics.median(steps),
        "dtensor_params": dtensors,
        "peak": torch.cuda.max_memory_allocated() if not cpu else 0,
    }
    print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--limit", type=float, default=150, help="seconds per run")
    p.add_argument("--out", help="folder for planner_tp1.json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(json.loads(args.child), args.cpu)
    seq, mb = (16, 2) if args.cpu else (1024, 8)
    order = ["fsdp", "forced", "fsdp(tp=1)", "forced", "fsdp"]
    rows = []
    for variant in order:
        spec = {"variant": variant, "seq": seq, "micro_batch": mb, "steps": args.steps}
        cmd = [sys.executable, __file__, "--child", json.dumps(spec)] + (["--cpu"] * args.cpu)
        row = run_child(cmd, variant, args.limit)
        rows.append(row)
        if "error" in row:
            print(f"{variant:12s} failed: {row['error']}", flush=True)
            continue
        print(
            f"{variant:12s} {row['strategy']:10s} median step {row['median'] * 1e3:8.2f} ms "
            f"{row['tokens_per_s']:10,.0f} tok/s  2-D (TP) parameters {row['dtensor_params']:4d}  "
            f"peak {row['peak'] / 2**30:6.2f} GiB",
            flush=True,
        )
    ok = [r for r in rows if "error" not in r]
    by: dict[str, list[float]] = {}
    for r in ok:
        by.setdefault(r["variant"], []).extend(r["steps"])
    lines = []
    if "fsdp" in by:
        base = statistics.median(by["fsdp"])
        for variant in ("fsdp(tp=1)", "forced"):
            if variant in by:
                ratio = base / statistics.median(by[variant])
                what = "TP code path forced, 1x1 mesh" if variant == "forced" else "no TP code"
                lines.append(f"{variant} ({what}) / fsdp, tokens/s: {ratio:.3f}")
    print("\n".join(lines), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "planner_tp1.json").write_text(json.dumps(rows, indent=1))
        Path(args.out, "planner_tp1.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
