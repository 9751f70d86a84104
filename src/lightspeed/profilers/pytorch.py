"""PyTorchProfiler: torch.profiler around the profiled actions, each a `record_function` range."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightspeed.profilers.profiler import Profiler


class PyTorchProfiler(Profiler):
    """Starts `torch.profiler.profile(**profiler_kwargs)` at the first action and marks every
    action as a `record_function` range; the summary is the operators' table sorted by
    `sort_by_key`, limited to `row_limit` rows."""

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        group_by_input_shapes: bool = False,
        row_limit: int = 20,
        sort_by_key: str | None = None,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self._group_by_input_shapes = group_by_input_shapes
        self._row_limit, self._sort_by_key = row_limit, sort_by_key or "cpu_time_total"
        self._profiler_kwargs = profiler_kwargs
        self._profiler: Any = None
        self._ranges: dict[str, Any] = {}

    def start(self, action_name: str) -> None:
        if self._profiler is None:
            self._profiler = torch.profiler.profile(**self._profiler_kwargs)
            self._profiler.__enter__()
        rng = torch.profiler.record_function(action_name)
        rng.__enter__()
        self._ranges[action_name] = rng

    def stop(self, action_name: str) -> None:
        rng = self._ranges.pop(action_name, None)
        if rng is not None:
            rng.__exit__(None, None, None)

    def summary(self) -> str:
        if self._profiler is None:
            return ""
        self._profiler.__exit__(None, None, None)
        averages = self._profiler.key_averages(group_by_input_shape=self._group_by_input_shapes)
        self._profiler = None
        return averages.table(sort_by=self._sort_by_key, row_limit=self._row_limit)
