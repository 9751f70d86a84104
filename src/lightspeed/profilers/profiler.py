"""The profiler interface: `start(action)` / `stop(action)` around each profiled action,
`describe()` at the end to print (and with `dirpath`, write) what `summary()` reports.

    profiler = SimpleProfiler()
    with profiler.profile("load batch"):
        batch = next(it)
    profiler.describe()
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class Profiler:
    """Subclass with `start`, `stop` and `summary`. Output goes to stdout, or with `dirpath` to
    `<dirpath>/<stage>-<filename>.txt` (one file per stage and rank, as Lightning names them)."""

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None) -> None:
        self.dirpath, self.filename = dirpath, filename
        self._stage: str | None = None
        self._local_rank: int | None = None

    def start(self, action_name: str) -> None:
        raise NotImplementedError

    def stop(self, action_name: str) -> None:
        raise NotImplementedError

    def summary(self) -> str:
        raise NotImplementedError

    @contextmanager
    def profile(self, action_name: str) -> Generator[str, None, None]:
        """Profiles the block as `action_name`, also when it raises."""
        try:
            self.start(action_name)
            yield action_name
        finally:
            self.stop(action_name)

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        """Called once per run stage (fit, validate, ...) before profiling; `log_dir` is where the
        summary goes when no `dirpath` was given."""
        self._stage, self._local_rank = stage, local_rank
        self.dirpath = self.dirpath or log_dir

    def teardown(self, stage: str | None) -> None: ...

    def describe(self) -> None:
        """Prints the summary, or writes it to the profiler's file when it has a `dirpath` and a
        `filename`."""
        text = self.summary()
        if not text:
            return
        if self.dirpath is not None and self.filename:
            path = Path(self.dirpath) / self._file_name()
            os.makedirs(path.parent, exist_ok=True)
            with open(path, "a") as f:
                f.write(text + "\n")
        else:
            print(text, flush=True)

    def _file_name(self) -> str:
        parts = [p for p in (self._stage, self.filename) if p]
        rank = f"-{self._local_rank}" if self._local_rank not in (None, 0) else ""
        return "-".join(parts) + rank + ".txt"

    def state_dict(self) -> dict[str, Any]:
        return {}


class PassThroughProfiler(Profiler):
    """Profiles nothing: `Trainer(profiler=None)`'s behaviour as an object."""

    def start(self, action_name: str) -> None: ...

    def stop(self, action_name: str) -> None: ...

    def summary(self) -> str:
        return ""
