"""Progress on rank 0: a rich bar on a terminal, plain periodic lines in CI logs; and rich result
tables."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


def _fmt(metrics: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items())


class ProgressBar:
    """Shows epoch, step, loss and prog_bar metrics, it/s and ETA. The trainer adds it on rank 0.

    When stdout is not a terminal, rich cannot redraw a bar; then it prints a plain line every
    `line_every_s` seconds and a last one at `stop`, so CI logs stay short and readable.
    """

    refresh_s = 0.25  # how often the bar reads the metrics

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
        self._metrics: dict[str, float] = {}
        self._printed = 0  # steps done when the last plain line was printed
        self._read_at = 0.0  # when advance() last read the metrics
        if self.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[rate]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
                console=self.console,
                transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task(
                description, total=total_steps, rate="", metrics=""
            )

    def advance(
        self, description: str, metrics: Callable[[], dict[str, float]], force: bool = False
    ) -> None:
        """One more step done. `metrics()` is read (a host sync) at most every `refresh_s` seconds,
        or when `force` (a logging step): the values shown are always the latest step's when
        read."""
        self._done += 1
        now = time.perf_counter()
        read = force or now - self._read_at >= self.refresh_s
        self._read_at = now if read else self._read_at
        values = metrics() if read else None
        rate = self._done / max(now - self._start, 1e-9)
        if self._progress is not None:
            fields: dict[str, Any] = {"rate": f"{rate:.2f} it/s", "description": description}
            if values is not None:
                fields["metrics"] = _fmt(values)
            assert self._task is not None  # added with the bar
            self._progress.update(self._task, advance=1, **fields)
        else:
            self._desc, self._metrics = (
                description,
                values if values is not None else self._metrics,
            )
            if now - self._last_line >= self.line_every_s and self._done != self._total:
                self._print_line(now)  # the last line comes from stop(), with the final metrics

    def _print_line(self, now: float) -> None:
        self._last_line, self._printed = now, self._done
        rate = self._done / max(now - self._start, 1e-9)
        total = f"/{self._total}" if self._total else ""
        eta = f" eta {max(self._total - self._done, 0) / rate:.0f}s" if self._total else ""
        self.console.print(
            f"{self._desc} step {self._done}{total} {rate:.2f} it/s{eta} {_fmt(self._metrics)}",
            highlight=False,
        )

    def stop(self, metrics: dict[str, float] | None = None) -> None:
        """Ends the bar; without a terminal, prints a last line with the final `metrics` unless one
        was just printed (a run that stops early, e.g. by EarlyStopping, still ends its log with
        where it stopped)."""
        if self._progress is not None:
            if metrics is not None:
                assert self._task is not None  # added with the bar
                self._progress.update(self._task, metrics=_fmt(metrics))
            self._progress.stop()
            self._progress = None
        elif self._printed != self._done:
            self._metrics = metrics if metrics is not None else self._metrics
            self._print_line(time.perf_counter())


def metrics_table(title: str, metrics: dict[str, float]) -> Table:
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in sorted(metrics.items()):
        table.add_row(k, f"{v:.6g}")
    return table


def print_table(table: Table, console: Console | None = None) -> None:
    (console or Console()).print(table)


def start_progress(
    enabled: bool, callbacks: list, limits: Any, steps_per_epoch: int | float, position: Any
) -> ProgressBar | None:
    """The started bar for a fit of `steps_per_epoch` optimizer steps per epoch from `position` (a
    LoopState) within `limits` (config.Limits), when `enabled` (rank 0 with `enable_progress_bar`),
    else None: also when the progress-bar callback draws itself (TQDMProgressBar) or is off
    (refresh_rate=0, disabled)."""
    bars = [cb for cb in callbacks if getattr(cb, "is_progress_bar", False)]
    if not enabled or any(
        getattr(cb, "draws_itself", False) or cb.refresh_rate == 0 or not _enabled(cb)
        for cb in bars
    ):
        return None
    epochs = limits.epochs_limit
    total = steps_per_epoch * epochs if epochs < 2**31 else float("inf")  # 2**31: unbounded
    if limits.max_steps != -1:
        total = min(total, limits.max_steps)
    total = None if total == float("inf") else int(total) - position.global_step
    bar = ProgressBar()
    bar.start(total, f"epoch {position.epoch}")
    return bar


def _enabled(bar: Any) -> bool:
    return getattr(bar, "is_enabled", True)
