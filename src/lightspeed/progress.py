"""Progress on rank 0: a rich bar on a terminal, plain periodic lines in CI logs; and rich result tables."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table



def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


class ProgressBar:
    """Shows epoch, step, loss and prog_bar metrics, it/s and ETA. The trainer adds it on rank 0.

    When stdout is not a terminal, rich cannot redraw a bar; then it prints one line per `refresh_lines`
    percent of the run instead, so CI logs stay short and readable.
    """

    def __init__(self, console: Console | None = None, line_every_s: float = 10.0):
        self.console = console or Console(file=sys.stdout)
        self.line_every_s = line_every_s
        self._progress: Progress | None = None
        self._task = None

    @property
    def is_terminal(self) -> bool:
        return self.console.is_terminal

    def start(self, total_steps: int | None, description: str) -> None:
        self._start = self._last_line = time.perf_counter()
        self._done, self._total, self._desc = 0, total_steps, description
        if self.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"), console=self.console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(description, total=total_steps, rate="", metrics="")

    def advance(self, description: str, metrics: dict[str, float] | None) -> None:
        """One more step done. `metrics` is None when they were not refreshed this step (saves a sync)."""
        self._done += 1
        now = time.perf_counter()
        rate = self._done / max(now - self._start, 1e-9)
        if self._progress is not None:
            fields: dict[str, Any] = {"rate": f"{rate:.2f} it/s", "description": description}
            if metrics is not None:
                fields["metrics"] = _fmt(metrics)
            self._progress.update(self._task, advance=1, **fields)
        elif metrics is not None and (now - self._last_line >= self.line_every_s or self._done == self._total):
            self._last_line = now
            total = f"/{self._total}" if self._total else ""
            eta = ""
            if self._total:
                eta = f" eta {max(self._total - self._done, 0) / rate:.0f}s"
            self.console.print(f"{description} step {self._done}{total} {rate:.2f} it/s{eta} {_fmt(metrics)}",
                               highlight=False)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def metrics_table(title: str, metrics: dict[str, float]) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in sorted(metrics.items()):
        table.add_row(k, f"{v:.6g}")
    return table


def print_table(table: Table, console: Console | None = None) -> None:
    (console or Console()).print(table)
