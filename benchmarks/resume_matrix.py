"""Checkpoints that travel, every pair: save under one strategy and world size, resume under
another, as a table.

    PYTHONPATH=src .venv/bin/python benchmarks/resume_matrix.py [--sources ddp@2,fsdp@2] \\
        [--targets single@1,...]

Each source (strategy@ranks) trains the tiny GPT of tests/workload.py N steps with an LR warm-up and
a checkpoint at step K. Each target resumes that checkpoint:
  same world size:    to step N; the cell is the largest relative difference of the resumed
                      per-step losses from the source's uninterrupted run ("loss" column), which
                      should be ~0 (fp32);
  another world size: to step K, then saves; the cell is the largest absolute difference of the
                      weights and the optimizer state read back from that checkpoint from the saved
                      ones ("state"), which should be 0. The data order differs there (each rank's
                      share), so losses cannot be compared.
Every result is also appended, one JSON line per cell, to --out (default resume_matrix.jsonl).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import run_workload  # noqa: E402
from lightspeed.checkpoint.layouts import read_portable  # noqa: E402

STRATEGIES = [
    "ddp",
    "ddp_sharded",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "fsdp",
    "fsdp_grad_op",
]
SOURCES = ["single@1"] + [f"{s}@2" for s in STRATEGIES]
TARGETS = [f"{s}@2" for s in STRATEGIES] + [
    "single@1",
    "deepspeed_stage_2@1",
    "fsdp@1",
    "ddp_sharded@3",
    "deepspeed_stage_3@3",
    "fsdp@3",
]
K, N = 3, 6
OPTS = dict(warmup=10)


def parse(cell: str) -> tuple[str, int]:
    strategy, _, ranks = cell.partition("@")
    return strategy, int(ranks or 2)


def placement(strategy: str, ranks: int) -> dict:
    """run_workload's options for `ranks` ranks: one rank in this process (DeepSpeed in its own),
    two as the Trainer starts them, more as that many one-rank "nodes" of torchrun (the Trainer
    refuses more local ranks than CPU cores)."""
    if ranks == 1:
        return dict(
            devices=1, launcher="python" if strategy.startswith("deepspeed") else "in-process"
        )
    if ranks == 2:
        return dict(devices=2)
    return dict(devices=1, num_nodes=ranks, nproc=ranks, launcher="torchrun-nodes")


def state_difference(a: dict, b: dict) -> float:
    """The largest absolute difference between two checkpoints' weights and optimizer states (inf if
    keys differ)."""
    if (
        a["model"].keys() != b["model"].keys()
        or a["optim"]["state"].keys() != b["optim"]["state"].keys()
    ):
        return float("inf")
    diffs = [(a["model"][k].float() - b["model"][k].float()).abs().max().item() for k in a["model"]]
    for name, st in a["optim"]["state"].items():
        diffs += [
            (torch.as_tensor(v).float() - torch.as_tensor(b["optim"]["state"][name][key]).float())
            .abs()
            .max()
            .item()
            for key, v in st.items()
        ]
    return max(diffs)


def run_cell(
    work: Path, ckpt: Path, source: tuple[str, int], target: tuple[str, int], reference: list[float]
):
    strategy, ranks = target
    out = work / f"{source[0]}{source[1]}-{strategy}{ranks}"
    out.mkdir(parents=True)
    same = ranks == source[1]
    opts = dict(max_steps=N) if same else dict(max_steps=K, save_to=str(out / "again"))
    try:
        run = run_workload(
            out,
            strategy=strategy,
            resume=str(ckpt),
            check=False,
            **placement(strategy, ranks),
            **OPTS,
            **opts,
        )
    # noqa: BLE001 - an in-process run's failure is a cell, not the end of the table
    except Exception as e:
        return {"kind": "error", "value": None, "error": f"{type(e).__name__}: {e}"[:200]}
    if not isinstance(run, dict) and run.returncode != 0:
        return {
            "kind": "error",
            "value": None,
            "error": (run.stderr.strip().splitlines() or ["?"])[-1][:200],
        }
    if same:
        losses = json.loads(sorted(out.glob("result-*.json"))[-1].read_text())["losses"]
        rel = (
            max(abs(x - y) / abs(y) for x, y in zip(losses, reference[K:]))
            if len(losses) == N - K
            else None
        )
        return {"kind": "loss", "value": rel}
    return {
        "kind": "state",
        "value": state_difference(
            read_portable(ckpt, source[0]), read_portable(out / "again", strategy)
        ),
    }


def show(cell: dict | None) -> str:
    if cell is None:
        return ""
    if cell["kind"] == "error":
        return f"[red]error[/red] {cell['error'][:40]}"
    ok = cell["value"] is not None and cell["value"] <= (1e-5 if cell["kind"] == "loss" else 1e-6)
    value = "?" if cell["value"] is None else f"{cell['value']:.0e}"
    return f"{'[green]✓[/green]' if ok else '[red]✗[/red]'} {cell['kind']} {value}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sources", default=",".join(SOURCES))
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--out", default="resume_matrix.jsonl")
    parser.add_argument(
        "--show", action="store_true", help="only print the table of the cells in --out"
    )
    args = parser.parse_args()
    if not args.show:
        run(args.sources.split(","), args.targets.split(","), Path(args.out))
    cells = [json.loads(line) for line in Path(args.out).read_text().splitlines()]
    results = {(c["source"], c["target"]): c for c in cells}
    sources, targets = (list(dict.fromkeys(c[key] for c in cells)) for key in ("source", "target"))
    table = Table(
        title=(
            f"Resume matrix: rows saved (strategy@ranks) at step {K}, columns resumed; loss: "
            f"largest relative difference of the per-step losses to step {N}, state: of weights "
            "and optimizer state after the load"
        )
    )
    table.add_column("saved \\ resumed")
    for tgt in targets:
        table.add_column(tgt.replace("deepspeed_stage_", "ds").replace("@", " @"), justify="center")
    for src in sources:
        table.add_row(
            src.replace("deepspeed_stage_", "ds"), *(show(results.get((src, t))) for t in targets)
        )
    Console(width=400).print(table)


def run(sources: list[str], targets: list[str], out: Path) -> None:
    """Runs every (source, target) cell, appending each result to `out` as it comes."""
    work = Path(tempfile.mkdtemp(prefix="travel-"))
    try:
        for src in sources:
            strategy, ranks = parse(src)
            root = work / f"src-{strategy}{ranks}"
            root.mkdir()
            reference = run_workload(
                root,
                strategy=strategy,
                max_steps=N,
                ckpt_every=K,
                **placement(strategy, ranks),
                **OPTS,
            )["losses"]
            ckpt = (root / "checkpoints" / f"epoch=0-step={K}.ckpt").resolve()
            for tgt in targets:
                start = time.time()
                cell = run_cell(work, ckpt, (strategy, ranks), parse(tgt), reference)
                with open(out, "a") as f:
                    f.write(
                        json.dumps(
                            {
                                "source": src,
                                "target": tgt,
                                **cell,
                                "seconds": round(time.time() - start, 1),
                            }
                        )
                        + "\n"
                    )
                print(f"{src} -> {tgt}: {cell}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
