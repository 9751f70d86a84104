"""SimpleProfiler: wall-clock time per action (mean, calls, total, share of the whole run)."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

from lightspeed.profilers.profiler import Profiler


class SimpleProfiler(Profiler):
    """Times each `start(action)` ... `stop(action)` span with `time.monotonic`. The summary is a
    table sorted by total time; with `extended` it also gives each action's share of the time
    since the profiler was made."""

    def __init__(
        self, dirpath: str | Path | None = None, filename: str | None = None, extended: bool = True
    ) -> None:
        super().__init__(dirpath=dirpath, filename=filename)
        self.current_actions: dict[str, float] = {}
        self.recorded_durations: dict[str, list[float]] = defaultdict(list)
        self.extended = extended
        self.start_time = time.monotonic()

    def start(self, action_name: str) -> None:
        if action_name in self.current_actions:
            raise ValueError(f"Attempted to start {action_name} which has already started.")
        self.current_actions[action_name] = time.monotonic()

    def stop(self, action_name: str) -> None:
        end = time.monotonic()
        if action_name not in self.current_actions:
            raise ValueError(
                f"Attempting to stop recording an action ({action_name}) which was never started."
            )
        self.recorded_durations[action_name].append(end - self.current_actions.pop(action_name))

    def summary(self) -> str:
        if not self.recorded_durations:
            return ""
        total = time.monotonic() - self.start_time
        rows = sorted(
            ((name, sum(d), len(d)) for name, d in self.recorded_durations.items()),
            key=lambda row: row[1],
            reverse=True,
        )
        width = max(len("Action"), *(len(name) for name, _, _ in rows))
        header = f"{'Action':<{width}} | Mean duration (s) | Num calls | Total time (s)"
        header += " | Percentage %" if self.extended else ""
        lines = ["Profiler Report", header, "-" * len(header)]
        for name, spent, calls in rows:
            line = f"{name:<{width}} | {spent / calls:<17.5g} | {calls:<9d} | {spent:<14.5g}"
            lines.append(line + (f" | {100 * spent / total:.3f}" if self.extended else ""))
        return "\n".join(lines)
