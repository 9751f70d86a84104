"""Profilers (Lightning's): time the actions of a run. `SimpleProfiler` (wall clock per action),
`AdvancedProfiler` (cProfile), `PyTorchProfiler` (torch.profiler), `PassThroughProfiler`
(nothing), on the `Profiler` interface. `Trainer(profiler=...)` (`build_profiler`) times the run's
hooks and steps with one of them: `trainer.profiler`."""

from typing import Any

from lightspeed.errors import ConfigError
from lightspeed.profilers.advanced import AdvancedProfiler
from lightspeed.profilers.profiler import PassThroughProfiler, Profiler
from lightspeed.profilers.pytorch import PyTorchProfiler
from lightspeed.profilers.simple import SimpleProfiler

__all__ = [
    "build_profiler",
    "AdvancedProfiler",
    "PassThroughProfiler",
    "Profiler",
    "PyTorchProfiler",
    "SimpleProfiler",
]


def build_profiler(profiler: Any) -> Profiler:
    """`Trainer(profiler=...)` as an object: None profiles nothing (PassThroughProfiler),
    "simple" / "advanced" / "pytorch" / "passthrough" build that profiler with its defaults, a
    Profiler is used as given. Raises ConfigError for anything else."""
    if isinstance(profiler, Profiler):
        return profiler
    kinds = {
        "simple": SimpleProfiler,
        "advanced": AdvancedProfiler,
        "pytorch": PyTorchProfiler,
        "passthrough": PassThroughProfiler,
    }
    if profiler is None:
        return PassThroughProfiler()
    if isinstance(profiler, str) and profiler.lower() in kinds:
        return kinds[profiler.lower()]()
    raise ConfigError(
        f"profiler={profiler!r} is not valid: use one of {sorted(kinds)}, a Profiler instance "
        "(lightspeed.profilers) or None."
    )
