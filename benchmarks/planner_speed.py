"""`strategy="auto"`'s tokens/s against plans tried by hand, in the same run: does the planner's
speed model (strategy × offload × activation checkpointing × micro-batch) find the fastest?

    python benchmarks/planner_speed.py                       # llama and gpt2 under their caps
    python benchmarks/planner_speed.py --only llama --limit 120
    python benchmarks/planner_speed.py --cpu --only llama    # tiny configs, 2 CPU ranks (plumbing)

Each family of benchmarks/planner_families.py runs under the same cap (one H200, bf16-mixed),
with 128 samples so that the micro-batch may grow: first `strategy="auto", micro_batch="auto"`
(nothing else about memory), then by hand: the top plans of auto's own plan table (the chosen one
and the fallbacks after it that fit, each at the micro-batch its forecast gives it: `--top`), and
the family's best of HAND (the fastest plan tried by hand in an earlier run), each at a fixed
micro-batch. Every run is its own process and takes `--steps` steps; `--repeats` rounds of
auto and the hand plans run round robin, and the ratio is of the medians; tokens/s is the micro-batch's
tokens over the median step (the clock between consecutive batch ends, so the first step, with its
allocations, is left out). The table ends with auto's tokens/s over the best plan by hand that
trained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from planner_families import GPU, run_child  # noqa: E402

# What was tried by hand under these caps before (1×H200, 2026-12-03): for Llama, activation
# checkpointing at micro-batch 40 was the fastest (34,993 tok/s against 8,107 for the plain
# offloaded plan at 8); GPT-2's hand runs did not start then, so its entry is the same plan at the
# micro-batch its forecast gave (18) rounded up.
HAND = {
    "llama": [("deepspeed_stage_2_offload+ac", 40)],
    "gpt2": [("deepspeed_stage_2_offload+ac", 24)],
    "moe": [("deepspeed_stage_2_offload+ac", 24)],
}
STEPS, SAMPLES = 6, 128


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="llama,gpt2")
    p.add_argument("--limit", type=float, default=90, help="seconds per run")
    p.add_argument("--top", type=int, default=3, help="plans of auto's table run by hand")
    p.add_argument("--cpu", action="store_true", help="tiny configs on 2 CPU ranks (plumbing)")
    p.add_argument("--no-hand", action="store_true", help="only auto's table, not HAND's plans")
    p.add_argument("--steps", type=int, default=STEPS, help="steps per run")
    p.add_argument("--repeats", type=int, default=1, help="rounds of auto and the hand plans")
    p.add_argument("--out", help="folder for planner_speed.json")
    args = p.parse_args()
    script = str(ROOT / "planner_families.py")
    rows, lines = [], []

    def run(family: str, label: str, spec: dict) -> dict:
        cmd = [sys.executable, script, "--child", json.dumps(spec)] + (["--cpu"] * args.cpu)
        row = run_child(cmd, family, args.limit)
        row["label"] = label
        rows.append(row)
        if "error" in row or not row.get("trained") or not row.get("s_per_step"):
            line = f"{family:6s} {label:40s} failed: {row.get('error', 'not trained')}"
        else:
            row["tokens_per_s"] = row["micro_batch"] * row["tokens_per_sample"] / row["s_per_step"]
            line = (
                f"{family:6s} {label:40s} {row['strategy']:30s} mb {row['micro_batch']:3d} "
                f"{row['s_per_step']:6.3f} s/step {row['tokens_per_s']:9,.0f} tok/s  peak "
                f"{row['measured'] / 2**30:5.2f} GiB (forecast {row['forecast'] / 2**30:5.2f})"
            )
        print(line, flush=True)
        lines.append(line)
        if row.get("steps"):  # what the process ran with (planner_families.Timing)
            steps = " ".join(f"{t:.3f}" for t in row["steps"])
            print(f"{family:6s}   steps {steps}; gc {row['gc_s']:.3f} s; {row['process']}")
        return row

    for family in args.only.split(","):
        # enough samples for every step in one epoch at the largest micro-batch tried (64)
        samples = max(SAMPLES, 64 * (args.steps + 1))
        base = {**GPU[family], "family": family, "samples": samples, "steps": args.steps}
        if args.cpu:
            base.update(seq=16, samples=32)
        speeds: dict[str, list[float]] = {}
        hand: list[tuple[str, int]] = []
        for _ in range(args.repeats):  # auto, then each hand plan, round robin
            auto = run(family, "auto", {**base})
            speeds.setdefault("auto", []).append(auto.get("tokens_per_s") or 0.0)
            if not hand:  # auto's table: the plans that fit, in rank order, at their micro-batches
                plans = [(name, mb) for name, mb, _, _ in auto.get("plans", [])][: args.top]
                for name, mb, tps, dev in auto.get("plans", [])[: args.top]:
                    line = f"{family:6s}   plan table: {name:30s} mb {mb:3d} forecast {tps:9,.0f} tok/s"
                    print(line + f" {dev / 2**30:5.2f} GiB", flush=True)
                extra = [] if args.cpu or args.no_hand else HAND.get(family, [])
                hand = list(dict.fromkeys(plans + extra))
            for name, mb in hand:
                spec = {**base, "strategy": name, "batch_size": mb, "micro_batch": None}
                row = run(family, f"by hand: {name} @{mb}", spec)
                speeds.setdefault(row["label"], []).append(row.get("tokens_per_s") or 0.0)
        median = {k: statistics.median(v) for k, v in speeds.items()}
        for label, runs in speeds.items():
            line = f"{family:6s} {label:40s} median {median[label]:9,.0f} tok/s  runs " + " ".join(
                f"{t:,.0f}" for t in runs
            )
            print(line, flush=True)
            lines.append(line)
        best = max(
            (kv for kv in median.items() if kv[0] != "auto"), key=lambda kv: kv[1], default=None
        )
        if median.get("auto") and best and best[1]:
            line = f"{family:6s} auto / best by hand ({best[0]}), medians of {args.repeats}: " + (
                f"{median['auto'] / best[1]:.2f}"
            )
            print(line, flush=True)
            lines.append(line)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "planner_speed.json").write_text(json.dumps(rows, indent=1))
        Path(args.out, "planner_speed.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
