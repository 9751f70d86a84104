"""The model summary printed at fit start (`Trainer(enable_model_summary=True)`, the default, rank 0
only): one row per top-level child with its type and its trainable and total parameter counts; with
a `ModelSummary(max_depth=n)` callback, also their children down to depth n (-1: all), named with
dots.

Counts are of the whole model, also when its parameters are sharded: ZeRO-3 leaves an empty local
tensor and the full count in `ds_numel`; FSDP2's parameters are DTensors, whose `numel()` is the
global one. A parameter shared by two children (a tied head) is counted once, under the first child
that holds it.
"""

from __future__ import annotations

import torch
from rich.table import Table

from lightspeed.utilities.model_summary.model_summary import class_name


def _numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def summarize(module: torch.nn.Module, max_depth: int = 1) -> list[tuple[str, str, int, int]]:
    """Rows `(name, type, trainable, total)`: one per top-level child, each followed by its
    descendants down to `max_depth` (-1: all; their names dotted), then one for parameters held
    directly by `module` (named "(own)") when there are any. Across the top-level rows each
    parameter is counted once; a deeper row counts what lies inside it."""
    seen: set[int] = set()
    rows = []

    def count(params, seen: set[int]) -> tuple[int, int]:
        trainable = total = 0
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += _numel(p)
            trainable += _numel(p) if p.requires_grad else 0
        return trainable, total

    for name, child in module.named_children():
        rows.append((name, class_name(child), *count(child.parameters(), seen)))
        for sub, inner in child.named_modules(prefix=name):
            depth = sub.count(".") + 1
            if sub != name and (max_depth == -1 or depth <= max_depth):
                rows.append((sub, class_name(inner), *count(inner.parameters(), set())))
    own = count(module.parameters(recurse=False), seen)
    if own[1]:
        rows.append(("(own)", class_name(module), *own))
    return rows


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def summary_table(module: torch.nn.Module, max_depth: int = 1) -> Table:
    """A rich table of `summarize(module, max_depth)` with a total row: what the Trainer prints at
    fit start."""
    rows = summarize(module, max_depth)
    table = Table(title=f"{class_name(module)} summary")
    for col, justify in (
        ("", "right"),
        ("name", "left"),
        ("type", "left"),
        ("trainable", "right"),
        ("total", "right"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i, (name, kind, trainable, total) in enumerate(rows):
        table.add_row(str(i), name, kind, _human(trainable), _human(total))
    top = [r for r in rows if "." not in r[0]]  # deeper rows are inside these
    trainable, total = sum(r[2] for r in top), sum(r[3] for r in top)
    table.add_section()
    table.add_row("", "total", "", _human(trainable), _human(total))
    table.caption = (
        f"{trainable:,} trainable, {total - trainable:,} frozen, {total:,} total parameters"
    )
    return table
