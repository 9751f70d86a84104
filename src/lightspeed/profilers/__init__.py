"""Profilers (Lightning's): time the actions of a run. `SimpleProfiler` (wall clock per action),
`AdvancedProfiler` (cProfile), `PyTorchProfiler` (torch.profiler), `PassThroughProfiler`
(nothing), on the `Profiler` interface."""

from lightspeed.profilers.advanced import AdvancedProfiler
from lightspeed.profilers.profiler import PassThroughProfiler, Profiler
from lightspeed.profilers.pytorch import PyTorchProfiler
from lightspeed.profilers.simple import SimpleProfiler

__all__ = [
    "AdvancedProfiler",
    "PassThroughProfiler",
    "Profiler",
    "PyTorchProfiler",
    "SimpleProfiler",
]
