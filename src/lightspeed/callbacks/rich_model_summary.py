"""RichModelSummary: ModelSummary's table drawn with rich (the Trainer's default summary next to a
RichProgressBar)."""

from __future__ import annotations

import importlib.util
from typing import Any

from lightspeed.callbacks.model_summary import ModelSummary
from lightspeed.callbacks.progress import RichProgressBar, TQDMProgressBar
from lightspeed.utilities.model_summary.model_summary import summary_totals

_RICH_AVAILABLE = importlib.util.find_spec("rich") is not None


class RichModelSummary(ModelSummary):
    """ModelSummary drawn as a rich table, its totals in a grid below; `header_style`,
    `title_style` and the other `summarize_kwargs` go to `rich.table.Table`."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if not _RICH_AVAILABLE:
            raise ModuleNotFoundError(
                "`RichModelSummary` requires `rich` to be installed. Install it by running "
                "`pip install -U rich`."
            )
        super().__init__(max_depth, **summarize_kwargs)

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int = 0,
        **summarize_kwargs: Any,
    ) -> None:
        import rich
        from rich.table import Table

        console = rich.get_console()
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for header, _ in summary_data:
            table.add_column(header, justify="right" if header == " " else "left", no_wrap=True)
        for row in zip(*(cells for _, cells in summary_data)):
            table.add_row(*row)
        console.print(table)
        grid = Table.grid(expand=True)
        grid.add_column()
        grid.add_column()
        totals = summary_totals(
            total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
        )
        for value, label in totals:
            grid.add_row(f"[bold]{value.strip() or value}[/]", label)
        console.print(grid)


def default_model_summary(callbacks: list) -> ModelSummary:
    """The summary the Trainer adds with `enable_model_summary=True` when none was given:
    RichModelSummary next to a RichProgressBar, else ModelSummary (as Lightning)."""
    rich_bar = any(
        isinstance(c, RichProgressBar) and not isinstance(c, TQDMProgressBar) for c in callbacks
    )
    return RichModelSummary() if rich_bar else ModelSummary()
