"""AdvancedProfiler: a cProfile profile per action, reported with pstats."""

from __future__ import annotations

import cProfile
import io
import pstats
from pathlib import Path

from lightspeed.profilers.profiler import Profiler


class AdvancedProfiler(Profiler):
    """Runs cProfile inside each action; the summary lists each action's `line_count_restriction`
    most expensive functions by cumulative time."""

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        line_count_restriction: float = 1.0,
        dump_stats: bool = False,
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.profiled_actions: dict[str, cProfile.Profile] = {}
        self.line_count_restriction = line_count_restriction
        self.dump_stats = dump_stats

    def start(self, action_name: str) -> None:
        self.profiled_actions.setdefault(action_name, cProfile.Profile()).enable()

    def stop(self, action_name: str) -> None:
        profile = self.profiled_actions.get(action_name)
        if profile is None:
            raise ValueError(
                f"Attempting to stop recording an action ({action_name}) which was never started."
            )
        profile.disable()
        if self.dump_stats and self.dirpath is not None:
            Path(self.dirpath).mkdir(parents=True, exist_ok=True)
            profile.dump_stats(str(Path(self.dirpath) / f"{action_name}.prof"))

    def summary(self) -> str:
        reports = []
        for action, profile in self.profiled_actions.items():
            stream = io.StringIO()
            stats = pstats.Stats(profile, stream=stream).strip_dirs().sort_stats("cumulative")
            stats.print_stats(self.line_count_restriction)
            reports.append(f"Profile stats for: {action}\n{stream.getvalue()}")
        return "\n".join(reports)

    def teardown(self, stage: str | None) -> None:
        self.profiled_actions = {}
