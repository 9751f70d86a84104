"""The table `validate` and `test` print at their end, in Lightning's layout: one row per metric,
one column per dataloader, wrapped into several tables when the loaders do not fit the terminal.

    print_results([{"val_loss": 0.25}], "validate")        # Trainer.validate, rank 0, verbose
    print_results(results, "test", use_rich=False)          # plain text, for consoles without rich

Metric names lose their `/dataloader_idx_N` suffix (the column says which loader); a dict of
metrics nests as `outer:inner`. Nothing is printed when nothing was logged.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["print_results"]


def _paths(metrics: dict, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Each leaf of a (nested) metrics dict, as the tuple of keys that reaches it."""
    for key, value in metrics.items():
        if isinstance(value, dict):
            yield from _paths(value, (*prefix, key))
        else:
            yield (*prefix, key)


def _cell(metrics: dict, path: tuple[str, ...]) -> str:
    """The value at `path` as the table shows it (a one-element tensor as its number), " " when
    that loader did not log it."""
    value: Any = metrics
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return " "
        value = value[key]
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    return str(value)


def print_results(results: list[dict], stage: str, use_rich: bool = True) -> None:
    """Prints `results` (one dict of metrics per dataloader) as the table(s) for `stage`
    ("validate", "test", ...): through rich's console when `use_rich`, else as plain lines."""
    per_loader = [{k.split("/dataloader_idx_")[0]: v for k, v in r.items()} for r in results]
    paths = sorted({p for r in per_loader for p in _paths(r)}, key=":".join)
    if not paths:
        return
    names = [":".join(p) for p in paths]
    headers = [f"DataLoader {i}" for i in range(len(per_loader))]
    rows = [[_cell(r, p) for r in per_loader] for p in paths]
    width_of_terminal = shutil.get_terminal_size(fallback=(120, 30)).columns or 120
    # every column as wide as the longest name or header (25 at least), at most half the terminal
    width = int(min(max(*map(len, names), *map(len, headers), 25), width_of_terminal / 2))
    per_table = int((width_of_terminal - width) / width)  # one column is the metric's name
    title = f"{stage} metric".capitalize()
    for start in range(0, len(headers), per_table):
        cols = [title, *headers[start : start + per_table]]
        cells = [row[start : start + per_table] for row in rows]
        if use_rich:
            _rich_table(cols, names, cells, width)
        else:
            _plain_table(cols, names, cells, width, width_of_terminal)


def _rich_table(cols: list[str], names: list[str], cells: list[list[str]], width: int) -> None:
    from rich import get_console
    from rich.table import Column, Table

    columns = [
        Column(c, justify="center", style="cyan" if i == 0 else "magenta", width=width)
        for i, c in enumerate(cols)
    ]
    table = Table(*columns)
    for name, row in zip(names, cells, strict=True):
        table.add_row(name, *row)
    get_console().print(table)


def _plain_table(
    cols: list[str], names: list[str], cells: list[list[str]], width: int, terminal: int
) -> None:
    """The same table as lines of centred cells between rules; a metric name longer than half the
    terminal continues on the next line."""
    cell = f"{{:^{width}}}" * len(cols)
    try:  # a console whose encoding lacks the box-drawing rule gets dashes
        "─".encode(sys.stdout.encoding or "utf-8")
        rule = "─" * terminal
    except UnicodeEncodeError:
        rule = "-" * terminal
    half = int(terminal / 2)
    lines = [rule, cell.format(*cols).rstrip(), rule]
    for name, row in zip(names, cells, strict=True):
        while len(name) > half:  # the part that fits, with the values; the rest below
            lines.append(cell.format(name[:half], *row).rstrip())
            name, row = name[half:], [" "] * len(row)
        lines.append(cell.format(name, *row).rstrip())
    lines.append(rule)
    print(os.linesep.join(lines))
