"""`trainer.fit_loop`: Lightning's fit loop as user code reads it, a read-only view of where fit
is (its limits and progress counters), over the run state the loop writes.

    trainer.fit_loop.max_epochs                         # the limits, as the Trainer resolves them
    trainer.fit_loop.epoch_progress.current.completed   # epochs done
    trainer.fit_loop.epoch_loop.batch_progress.current.completed  # batches done in this epoch

lightspeed's loop is loop.py's functions; nothing here drives it, and setting a limit here
(Lightning lets code write `fit_loop.max_epochs`) is an AttributeError: pass it to the Trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lightspeed.specs import LoopState

__all__ = ["FitLoopView", "Progress", "ProgressCounts"]


@dataclass(frozen=True)
class ProgressCounts:
    """How many units (epochs, batches) were ready, started, processed and completed."""

    ready: int
    started: int
    processed: int
    completed: int

    @classmethod
    def done(cls, completed: int, running: bool) -> ProgressCounts:
        """`completed` units, plus the one running (ready and started, not yet completed)."""
        started = completed + int(running)
        return cls(started, started, completed, completed)


@dataclass(frozen=True)
class Progress:
    """Lightning's progress tracker: `total` over the fit, `current` since its last restart (a
    resume); lightspeed counts both from the run's start position."""

    total: ProgressCounts
    current: ProgressCounts


class _EpochLoopView:
    def __init__(self, trainer: Any, position: Callable[[], tuple[LoopState, bool]]) -> None:
        self._trainer, self._position = trainer, position

    @property
    def batch_progress(self) -> Progress:
        """Batches of this epoch (this rank's; one started while its hooks and step run)."""
        state, in_batch = self._position()
        counts = ProgressCounts.done(state.batches_done, in_batch)
        return Progress(counts, counts)

    @property
    def batch_idx(self) -> int:
        """The batch running now (inside its hooks), else the last one done."""
        return self.batch_progress.current.started - 1

    global_step = property(lambda self: self._trainer.global_step)
    max_steps = property(lambda self: self._trainer.max_steps)
    min_steps = property(lambda self: self._trainer.min_steps)


class FitLoopView:
    """`trainer.fit_loop` (module docstring)."""

    def __init__(self, trainer: Any, position: Callable[[], tuple[LoopState, bool]]) -> None:
        """`trainer`: its Lightning names; `position`: the run's LoopState and whether a training
        batch is running, read at each access."""
        self._trainer = trainer
        self.epoch_loop = _EpochLoopView(trainer, position)

    max_epochs = property(lambda self: self._trainer.max_epochs)
    min_epochs = property(lambda self: self._trainer.min_epochs)
    max_steps = property(lambda self: self._trainer.max_steps)
    min_steps = property(lambda self: self._trainer.min_steps)

    @property
    def epoch_progress(self) -> Progress:
        """Epochs of this fit: completed ones, and the one training now."""
        counts = ProgressCounts.done(self._trainer.current_epoch, self._trainer.fitting)
        return Progress(counts, counts)

    @property
    def batch_idx(self) -> int:
        return self.epoch_loop.batch_idx
