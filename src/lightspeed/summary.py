"""The model summary printed at fit start (`Trainer(enable_model_summary=True)`, the default, rank 0 only):
one row per top-level child with its type and its trainable and total parameter counts.

Counts are of the whole model, also when its parameters are sharded: ZeRO-3 leaves an empty local tensor and the
full count in `ds_numel`; FSDP2's parameters are DTensors, whose `numel()` is the global one. A parameter shared by
two children (a tied head) is counted once, under the first child that holds it.
"""

from __future__ import annotations

import torch
from rich.table import Table


def _numel(p: torch.nn.Parameter) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def summarize(module: torch.nn.Module) -> list[tuple[str, str, int, int]]:
    """Rows `(name, type, trainable, total)`: one per top-level child, then one for parameters held directly by
    `module` (named "(own)") when there are any. Each parameter is counted once."""
    seen: set[int] = set()
    rows = []

    def count(params) -> tuple[int, int]:
        trainable = total = 0
        for p in params:
            if id(p) in seen:
                continue
            seen.add(id(p))
            total += _numel(p)
            trainable += _numel(p) if p.requires_grad else 0
        return trainable, total

    for name, child in module.named_children():
        rows.append((name, class_name(child), *count(child.parameters())))
    own = count(module.parameters(recurse=False))
    if own[1]:
        rows.append(("(own)", class_name(module), *own))
    return rows


def class_name(module: torch.nn.Module) -> str:
    """The user's class name: FSDP2's `fully_shard` swaps a module's class for a subclass named FSDP<Name>."""
    cls = type(module)
    if len(cls.__bases__) == 2 and cls.__bases__[0].__name__ == "FSDPModule":
        return cls.__bases__[1].__name__
    return cls.__name__


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return str(n)


def summary_table(module: torch.nn.Module) -> Table:
    """A rich table of `summarize(module)` with a total row: what the Trainer prints at fit start."""
    rows = summarize(module)
    table = Table(title=f"{class_name(module)} summary")
    for col, justify in (("", "right"), ("name", "left"), ("type", "left"), ("trainable", "right"),
                         ("total", "right")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for i, (name, kind, trainable, total) in enumerate(rows):
        table.add_row(str(i), name, kind, _human(trainable), _human(total))
    trainable, total = sum(r[2] for r in rows), sum(r[3] for r in rows)
    table.add_section()
    table.add_row("", "total", "", _human(trainable), _human(total))
    table.caption = f"{trainable:,} trainable, {total - trainable:,} frozen, {total:,} total parameters"
    return table
