"""`strategy="auto"`'s tokens/s against plans tried by hand, in the same run: does the planner's
speed model (strategy × offload × activation checkpointing × micro-batch) find the fastest?

    python benchmarks/planner_speed.py                       # llama and gpt2 under their caps
    python benchmarks/planner_speed.py --only llama --limit 120

Each family of benchmarks/planner_families.py runs under the same cap (one H200, bf16-mixed),
with 128 samples so that the micro-batch may grow: first `strategy="auto", micro_batch="auto"`
(nothing else about memory), then each hand-written plan of HAND at a fixed micro-batch. Every run
is its own process and takes STEPS steps; tokens/s is the micro-batch's tokens over the median
step (the clock between consecutive batch ends). The table ends with auto's tokens/s over the best
hand-written plan's that trained.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from planner_families import GPU, run_child  # noqa: E402

# What a user would try by hand under these caps (nothing on the device fits: the optimizer state
# goes to the host): the plain offloaded plan at the families' micro-batch, and activation
# checkpointing, which leaves room for larger micro-batches over which the host's step spreads.
HAND = [
    ("deepspeed_stage_2_offload", 8),
    ("deepspeed_stage_2_offload+ac", 24),
    ("deepspeed_stage_2_offload+ac", 40),
]
STEPS, SAMPLES = 6, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="llama,gpt2")
    p.add_argument("--limit", type=float, default=90, help="seconds per run")
    p.add_argument("--out", help="folder for planner_speed.json")
    args = p.parse_args()
    script = str(ROOT / "planner_families.py")
    rows, lines = [], []
    for family in args.only.split(","):
        base = {**GPU[family], "family": family, "samples": SAMPLES, "steps": STEPS}
        runs = [("auto", {**base})]
        runs += [
            (f"{name} @{mb}", {**base, "strategy": name, "batch_size": mb, "micro_batch": None})
            for name, mb in HAND
        ]
        best, auto = 0.0, None
        for label, spec in runs:
            row = run_child(
                [sys.executable, script, "--child", json.dumps(spec)], family, args.limit
            )
            row["label"] = label
            rows.append(row)
            if "error" in row or not row.get("trained") or not row.get("s_per_step"):
                line = f"{family:6s} {label:36s} failed: {row.get('error', 'not trained')}"
            else:
                tps = row["micro_batch"] * row["tokens_per_sample"] / row["s_per_step"]
                row["tokens_per_s"] = tps
                if label == "auto":
                    auto = tps
                else:
                    best = max(best, tps)
                line = (
                    f"{family:6s} {label:36s} {row['strategy']:30s} mb {row['micro_batch']:3d} "
                    f"{row['s_per_step']:6.3f} s/step {tps:9,.0f} tok/s  peak "
                    f"{row['measured'] / 2**30:5.2f} GiB (forecast {row['forecast'] / 2**30:5.2f})"
                )
            print(line, flush=True)
            lines.append(line)
        if auto and best:
            line = f"{family:6s} auto / best by hand: {auto / best:.2f}"
            print(line, flush=True)
            lines.append(line)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "planner_speed.json").write_text(json.dumps(rows, indent=1))
        Path(args.out, "planner_speed.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
