"""ModelSummary: the table of the model's layers at the start of fit."""

from __future__ import annotations

from typing import Any

from lightspeed.callbacks.callback import Callback
from lightspeed.errors import ConfigError


class ModelSummary(Callback):
    """Lightning's ModelSummary: the summary printed at fit start lists modules down to `max_depth`
    (1: the top-level children, -1: all, 0: no summary). Given as a callback, it prints even with
    `enable_model_summary=False`, as in Lightning."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any):
        if not isinstance(max_depth, int) or max_depth < -1:
            raise ConfigError(
                f"max_depth={max_depth!r} is not valid: use -1 (every level), 0 (no summary) or a "
                "depth ≥ 1."
            )
        self.max_depth = max_depth
