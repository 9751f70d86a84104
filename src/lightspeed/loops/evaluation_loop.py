"""`_EvaluationLoop`, at Lightning's path: here only its results table (`_print_results`), which
report/results.py draws; the evaluation loop itself is lightspeed/loop.py's `evaluation_epoch`."""

from __future__ import annotations

import importlib.util

from lightspeed.loops.loop import _Loop
from lightspeed.report.results import print_results

__all__ = ["_EvaluationLoop"]

# rich draws the table when it is installed (a plain-text table otherwise); read at each call
_RICH_AVAILABLE = importlib.util.find_spec("rich") is not None


class _EvaluationLoop(_Loop):
    """Lightning's evaluation loop class; what lightspeed gives of it is the results table."""

    @staticmethod
    def _print_results(results: list[dict], stage: str) -> None:
        """Prints one dict of metrics per dataloader as `stage`'s table (nothing when empty)."""
        print_results(results, stage, use_rich=_RICH_AVAILABLE)
