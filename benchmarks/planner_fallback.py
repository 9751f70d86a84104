"""What a fallback costs `strategy="auto"` (issue 38): a plan that runs out of memory at setup is
released and the next one set up. Two CPU ranks (gloo), measured on this machine.

    PYTHONPATH=src .venv/bin/python benchmarks/planner_fallback.py [--vocab 65536 --width 512]

The model is an embedding table and eight Linear blocks, trained with `torch.optim.Adagrad` (its
state is allocated when it is built, at setup). Under a `memory_budget` of 7.5 bytes per parameter
ddp cannot fit (8 bytes: fp32 weights and Adagrad's sum) and fsdp can. The forecast is told that
ddp holds nothing, so the plan chooses ddp first, as issue 38's forecast chose a plan that then
failed: the run falls back. The same budget with the forecast left as it is chooses the plan the
fallback ends on, directly.

Printed: the failed setup's seconds, the release's (both from the fallback's own line), their
ratio, and each run's wall time from start to the end of fit, with the difference: what the
fallback cost beyond the run it ended as.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(out: str, honest: bool, vocab: int, width: int) -> None:
    """One run, rank 0's result to `out` (the Trainer starts the second rank)."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import lightspeed as ls
    import lightspeed.plan.forecast as plan

    real = plan.forecast_candidate

    def optimistic(c, *args, **kwargs):
        f = real(c, *args, **kwargs)
        if c.name != "ddp":
            return f
        return replace(f, params=0, grads=0, optim=0, activations=0, buffers=0, save_buffers=0)

    if not honest:
        plan.forecast_candidate = optimistic

    class Table(ls.LightningModule):
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(vocab, width)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(8))

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            h = self.table(ids)
            for block in self.blocks:
                h = torch.tanh(block(h))
            return h.pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.Adagrad(self.parameters(), lr=0.1)

        def train_dataloader(self):
            ids = torch.randint(0, vocab, (32, 16), generator=torch.Generator().manual_seed(0))
            return DataLoader(TensorDataset(ids), batch_size=4)

    ls.seed_everything(0)
    model = Table()
    numel = sum(p.numel() for p in model.parameters())
    trainer = ls.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="auto",
        memory_budget=7.5 * numel,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)
    if trainer.is_global_zero:
        Path(out).write_text(json.dumps({"strategy": trainer.strategy.name, "numel": numel}))


def run(tmp: Path, honest: bool, args: argparse.Namespace) -> dict:
    out = tmp / ("direct.json" if honest else "fallback.json")
    cmd = [sys.executable, __file__, "--run", str(out), "--vocab", str(args.vocab)]
    cmd += ["--width", str(args.width)] + (["--honest"] if honest else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    began = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - began
    if done.returncode != 0:
        sys.exit(f"the {'direct' if honest else 'fallback'} run failed:\n{done.stderr[-3000:]}")
    return {**json.loads(out.read_text()), "wall": wall, "stdout": done.stdout}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--honest", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        return train(args.run, args.honest, args.vocab, args.width)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"planner_fallback.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    fell, direct = run(tmp, False, args), run(tmp, True, args)
    line = re.search(
        r"strategy='auto': (\S+) failed at setup after ([\d.]+) s .*released in ([\d.]+) s",
        fell["stdout"],
    )
    if line is None or "failed at setup" in direct["stdout"]:
        sys.exit(f"expected one fallback and one direct run:\n{fell['stdout'][-2000:]}")
    failed, setup, release = line[1], float(line[2]), float(line[3])
    print(f"model: {fell['numel'] / 1e6:.1f}M parameters, 2 CPU ranks (gloo), Adagrad")
    print(f"auto chose {failed} (forecast told it fits); it fell back to {fell['strategy']}")
    print(f"  failed setup of {failed}:  {setup:7.2f} s")
    print(f"  its release:             {release:7.2f} s   release / failed setup = {release / setup:.2f}")
    print(f"  run with the fallback:   {fell['wall']:7.2f} s   ({fell['strategy']})")
    print(f"  run chosen directly:     {direct['wall']:7.2f} s   ({direct['strategy']})")
    print(f"  the fallback's cost:     {fell['wall'] - direct['wall']:7.2f} s")


if __name__ == "__main__":
    main()
