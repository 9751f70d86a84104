"""ModelSummary: the table of the model's layers at the start of fit (rank 0).

    Trainer(callbacks=[ModelSummary(max_depth=2)])

The Trainer adds one (max_depth=1) when `enable_model_summary=True`, the default, and no summary
callback was given (RichModelSummary with a RichProgressBar). Given as a callback it prints also
with `enable_model_summary=False`, as in Lightning. The table is
`lightspeed.utilities.model_summary.summarize(module, max_depth)`; override the static `summarize`
to show it another way.
"""

from __future__ import annotations

from typing import Any

from lightspeed.callbacks.callback import Callback
from lightspeed.errors import ConfigError
from lightspeed.utilities.model_summary import summarize as summarize_model
from lightspeed.utilities.model_summary.model_summary import format_table, summary_totals


class ModelSummary(Callback):
    """Prints the summary down to `max_depth` (1: the top-level children, -1: all, 0: none) at fit
    start; `summarize_kwargs` go to `summarize`."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
            raise ConfigError(
                f"max_depth={max_depth!r} is not valid: use -1 (every level), 0 (no summary) or a "
                "depth ≥ 1."
            )
        self._max_depth = max_depth
        self._summarize_kwargs = summarize_kwargs

    @property
    def max_depth(self) -> int:
        return self._max_depth

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not self._max_depth:
            return
        # Every rank builds it: the example forward of a sharded model is collective.
        summary = self._summary(trainer, pl_module)
        if trainer.is_global_zero:
            self.summarize(
                summary._get_summary_data(),
                summary.total_parameters,
                summary.trainable_parameters,
                summary.model_size,
                summary.total_training_modes,
                total_flops=summary.total_flops,
                **self._summarize_kwargs,
            )

    def _summary(self, trainer: Any, pl_module: Any) -> Any:
        return summarize_model(pl_module, max_depth=self._max_depth)

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
        """Prints the table (Lightning's plain text) and its totals."""
        totals = summary_totals(
            total_parameters, trainable_parameters, model_size, total_training_modes, total_flops
        )
        print(format_table(summary_data, totals), flush=True)
