"""Bytes each rank holds for parameters, gradients and optimizer state, per strategy, on 2 CPU ranks
(gloo).

    python benchmarks/memory_per_rank.py

Each strategy trains the tiny GPT one step, then runs one more forward/backward and measures with
`lightspeed.runtime.memory.measure` (gradients exist only between backward and step). Ratios are
against DDP in the same run. The ZeRO paper's expectation: ZeRO-1 halves optimizer state, ZeRO-2
also gradients, ZeRO-3 also parameters.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers import run_workload  # noqa: E402  (the one helper that starts ranks)

STRATEGIES = [
    "ddp",
    "ddp_sharded",
    "fsdp",
    "fsdp_grad_op",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
]
CATEGORIES = ("params", "grads", "optim", "master")


def measure_all(strategies: list[str], tmp: Path) -> dict[str, dict[str, int]]:
    """Returns, per strategy, the largest per-rank byte count of each category (the rank that limits
    memory)."""
    table = {}
    for name in strategies:
        result = run_workload(
            tmp / name, strategy=name, devices=2, max_steps=1, memory=True, timeout=600
        )
        table[name] = {c: max(rank[c] for rank in result["memory"]) for c in CATEGORIES}
    return table


def main() -> None:
    from rich.console import Console
    from rich.table import Table

    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for name in STRATEGIES:
            (tmp / name).mkdir()
        table = measure_all(STRATEGIES, tmp)
    base = table["ddp"]
    out = Table(title="Bytes per rank (max over 2 ranks), tiny GPT, fp32 AdamW; ratio vs DDP")
    out.add_column("strategy")
    for c in CATEGORIES:
        out.add_column(c, justify="right")
    for name, row in table.items():
        cells = [
            f"{row[c]:,} ({row[c] / base[c]:.2f}×)" if base[c] else f"{row[c]:,}"
            for c in CATEGORIES
        ]
        out.add_row(name, *cells)
    Console(width=120).print(out)


if __name__ == "__main__":
    main()
