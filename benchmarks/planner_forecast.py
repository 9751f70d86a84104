"""The memory plan's forecast against the measured peak on one GPU, for the 1.28B GPT (bf16-mixed,
fused AdamW).

    python benchmarks/planner_forecast.py [--micro-batch 8] [--only single,fsdp,...] \\
        [--json out.json]

The parent process forecasts (`lightspeed.plan.forecast.forecast`, activations probed on CPU); each
configuration then trains 3 steps in its own process and reports `torch.cuda.max_memory_allocated`.
Prints forecast, measured and their ratio per configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import lightspeed as ls  # noqa: E402
from lightspeed.demos.gpt import SIZES, Block, GPTModule, RandomTokens  # noqa: E402
from lightspeed.plan.candidates import Candidate  # noqa: E402
from lightspeed.plan.forecast import forecast  # noqa: E402

CONFIGS = {  # name -> (forecast candidate, strategy for the Trainer)
    "single": (Candidate("single"), lambda: "single"),
    "fsdp": (Candidate("fsdp"), lambda: ls.FSDP()),
    "fsdp_grad_op": (Candidate("fsdp_grad_op"), lambda: ls.FSDP(reshard_after_forward=False)),
    "fsdp+ac": (
        Candidate("fsdp", activation_checkpointing=True),
        lambda: ls.FSDP(activation_checkpointing=[Block]),
    ),
    "deepspeed_stage_2": (Candidate("deepspeed_stage_2"), lambda: ls.DeepSpeed(stage=2)),
    "deepspeed_stage_3": (Candidate("deepspeed_stage_3"), lambda: ls.DeepSpeed(stage=3)),
    "deepspeed_stage_2+ac": (
        Candidate("deepspeed_stage_2", activation_checkpointing=True),
        lambda: ls.DeepSpeed(stage=2, activation_checkpointing=[Block]),
    ),
    "deepspeed_stage_2_offload": (
        Candidate("deepspeed_stage_2", offload_optimizer=True),
        lambda: ls.DeepSpeed(stage=2, offload_optimizer="cpu"),
    ),
}


class FusedAdamGPT(GPTModule):
    def configure_optimizers(
        self,
    ):  # fused: no foreach temporaries at the step, as a speed-minded user writes it
        return torch.optim.AdamW(
            self.parameters(),
            lr=1e-4,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            fused=torch.cuda.is_available(),
        )


def run(name: str, cfg, micro_batch: int) -> dict:
    torch.manual_seed(0)
    trainer = ls.Trainer(
        strategy=CONFIGS[name][1](),
        devices=1,
        accelerator="gpu",
        precision="bf16-mixed",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    data = RandomTokens(cfg.vocab_size, cfg.block_size, micro_batch * 3)
    trainer.fit(FusedAdamGPT(cfg), torch.utils.data.DataLoader(data, batch_size=micro_batch))
    return {"name": name, "peak": torch.cuda.max_memory_allocated()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--only", default=",".join(CONFIGS))
    p.add_argument("--json")
    args = p.parse_args()
    cfg = replace(SIZES["1.3b"], n_layer=args.layers)
    if args.run:
        print("RESULT " + json.dumps(run(args.run, cfg, args.micro_batch)), flush=True)
        return
    names = args.only.split(",")
    sample = RandomTokens(cfg.vocab_size, cfg.block_size, 2)
    batch = torch.utils.data.default_collate([sample[0], sample[1]])
    rows = {
        f.candidate: f
        for f in forecast(
            FusedAdamGPT(cfg),
            1,
            "bf16-mixed",
            args.micro_batch,
            batch=batch,
            candidates=[CONFIGS[n][0] for n in names],
        )
    }
    out = []
    for name in names:
        f = rows[CONFIGS[name][0]]
        cmd = [
            sys.executable,
            __file__,
            "--run",
            name,
            "--micro-batch",
            str(args.micro_batch),
            "--layers",
            str(args.layers),
        ]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}
        )
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        peak = json.loads(line[7:])["peak"] if line else None
        row = {
            "name": name,
            "forecast": f.device_total,
            "measured": peak,
            "terms": {
                t: getattr(f, t)
                for t in ("params", "grads", "optim", "master", "activations", "buffers")
            },
        }
        out.append(row)
        ratio = (
            f"{f.device_total / peak:.3f}"
            if peak
            else (proc.stderr.strip().splitlines() or ["?"])[-1][-200:]
        )
        print(
            f"{name:28s} forecast {f.device_total / 2**30:7.2f} GiB  measured "
            f"{(peak or 0) / 2**30:7.2f} GiB  forecast/measured {ratio}  {row['terms']}",
            flush=True,
        )
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
