"""Lightning's `trainer.state` and its enums, at Lightning's path (`lightspeed.trainer.states`).

`RunningStage` holds the loop's stage (the values of specs.Stage) and `TrainerFn` the entry point
running (the values of run.Fn), under Lightning's member names (`TrainerFn.FITTING`,
`RunningStage.TRAINING`); all of them compare equal to their strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["RunningStage", "TrainerFn", "TrainerState", "TrainerStatus"]


class TrainerFn(StrEnum):
    """The entry point running."""

    FITTING = "fit"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"


class RunningStage(StrEnum):
    """The loop's stage."""

    TRAINING = "train"
    SANITY_CHECKING = "sanity_check"
    VALIDATING = "validate"
    TESTING = "test"
    PREDICTING = "predict"

    @property
    def evaluating(self) -> bool:
        return self in (RunningStage.VALIDATING, RunningStage.SANITY_CHECKING, RunningStage.TESTING)

    @property
    def dataloader_prefix(self) -> str | None:
        return {"sanity_check": "val", "validate": "val", "train": None}.get(self.value, self.value)


class TrainerStatus(StrEnum):
    """Where the last entry point is: "initializing", "running", "finished" or "interrupted" (an
    exception ended it)."""

    INITIALIZING = "initializing"
    RUNNING = "running"
    FINISHED = "finished"
    INTERRUPTED = "interrupted"


@dataclass(frozen=True)
class TrainerState:
    """Lightning's `trainer.state`: `fn` (None before any entry point), `stage` (None outside a
    loop) and `status`; each compares equal to its string ("fit", "train", "finished", ...)."""

    fn: TrainerFn | None
    stage: RunningStage | None
    status: TrainerStatus

    @property
    def finished(self) -> bool:
        """Whether the last entry point ran to its end (Lightning's `trainer.state.finished`)."""
        return self.status == "finished"
