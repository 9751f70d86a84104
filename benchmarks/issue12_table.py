"""Issue 12's figures from one invocation of the GPU suite, each ratio against its baseline from the same run.

    python benchmarks/issue12_table.py out/suite_*.json --scaling out/scaling.json

The suite files are gpu_suite.py's `--json` output (one GPU per process); the scaling file is multi_gpu.py's
(`--counts 2 --module user`), whose one-GPU ends are the suite's `<strategy>+user` setups of the same module and
micro-batch. A setup missing from the files (a run cut short) shows as "-".
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

# (setup, baseline, target ratio or None)
SINGLE = [
    ("plain_pytorch", None, None),
    ("single+user", "plain_pytorch", 0.99),
    ("single+user+compile", "single+user", 1.08),
    ("plain_deepspeed_zero2", None, None),
    ("deepspeed_stage_2+user", "plain_deepspeed_zero2", 0.99),
    ("plain_deepspeed_zero3", None, None),
    ("deepspeed_stage_3+user", "plain_deepspeed_zero3", 0.99),
    ("deepspeed_stage_3+user", "plain_deepspeed_zero3", 1.15),  # the moonshot, at peak memory ≤ 1.10× the loop's
]
# scaling strategy -> the suite's one-GPU setup of the same module
ONE_GPU = {"ddp": "ddp+user", "fsdp": "fsdp+user", "deepspeed_stage_2": "deepspeed_stage_2+user",
           "deepspeed_stage_3": "deepspeed_stage_3+user", "plain_deepspeed_zero3": "plain_deepspeed_zero3",
           "ddp+bf16": "ddp+user"}  # DDP(comm_hook="bf16"), not the default: against the default's one-GPU run
SCALING_TARGET = 0.95


def _fmt(sample: tuple[float, float, int] | None) -> str:
    return "-" if sample is None else f"{sample[0]:,.0f} ±{sample[1]:.1%} ({sample[2]})"


def _samples(values: list[float]) -> tuple[float, float, int] | None:
    """(median, spread (max - min) / median, count) of `values`, or None when empty."""
    if not values:
        return None
    mid = statistics.median(values)
    return mid, (max(values) - min(values)) / mid, len(values)


def _verdict(ratio: float | None, target: float | None) -> str:
    if ratio is None or target is None:
        return ""
    return "met" if ratio >= target else "NOT met"


def load_suite(paths: list[Path]) -> dict[str, dict]:
    """Setup name -> gpu_suite.py's summary of it, over every file given."""
    out = {}
    for path in paths:
        if path.exists():
            out.update({r["name"]: r for r in json.loads(path.read_text())})
    return out


def suite_sample(result: dict | None) -> tuple[float, float, int] | None:
    if not result or "tok_s" not in result:
        return None
    return result["tok_s"], result["spread"], result.get("samples", result.get("runs", 1))


def scaling_sample(results: dict, strategy: str, devices: int) -> tuple[float, float, int] | None:
    runs = [r for r in results.values() if r.get("strategy") == strategy and r.get("devices") == devices
            and "tok_s_per_gpu" in r]
    windows = [w for r in runs for w in r.get("window_tok_s", [])]
    return _samples(windows or [r["tok_s_per_gpu"] for r in runs])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("suite", nargs="+", type=Path)
    p.add_argument("--scaling", type=Path)
    p.add_argument("--devices", type=int, default=2)
    args = p.parse_args()
    suite = load_suite(args.suite)
    console = Console(width=150)

    table = Table(title="One GPU: tok/s (median ± spread (samples)), each against its baseline in this run")
    for col in ("setup", "tok/s", "against", "ratio", "target", "", "peak GiB"):
        table.add_column(col, justify="right")
    for name, base, target in SINGLE:
        mine, ref = suite_sample(suite.get(name)), suite_sample(suite.get(base)) if base else None
        ratio = mine[0] / ref[0] if mine and ref else None
        peak = suite.get(name, {}).get("peak_gib")
        if target == 1.15 and ratio:  # the moonshot also bounds memory: peak no more than 10% above the loop's
            ratio = ratio if peak and peak <= 1.10 * suite[base].get("peak_gib", 0) else None
        table.add_row(name, _fmt(mine) if mine else suite.get(name, {}).get("error", "-"), base or "",
                      f"{ratio:.3f}" if ratio else "", f"≥{target}" if target else "", _verdict(ratio, target),
                      f"{peak:.1f}" if peak else "")
    console.print(table)

    if not args.scaling or not args.scaling.exists():
        return
    scaling = json.loads(args.scaling.read_text())
    n = args.devices
    table = Table(title=f"Scaling 1 → {n} GPUs: tok/s per GPU (median ± spread (samples)); the one-GPU figure is "
                        "the suite's run of the same module")
    for col in ("strategy", "1 GPU", f"{n} GPUs", "efficiency", "target", "", f"× DS ZeRO-3 loop ({n} GPUs)"):
        table.add_column(col, justify="right")
    z3 = scaling_sample(scaling, "plain_deepspeed_zero3", n)
    for strategy, one_name in ONE_GPU.items():
        one, many = suite_sample(suite.get(one_name)), scaling_sample(scaling, strategy, n)
        eff = many[0] / one[0] if one and many else None
        vs = f"{many[0] / z3[0]:.3f}" if many and z3 and strategy.startswith("deepspeed_stage_3") else ""
        table.add_row(strategy, _fmt(one), _fmt(many), f"{eff:.2f}" if eff else "-",
                      "" if strategy.startswith("plain") else f"≥{SCALING_TARGET}",
                      "" if strategy.startswith("plain") else _verdict(eff, SCALING_TARGET), vs)
    console.print(table)


if __name__ == "__main__":
    main()
