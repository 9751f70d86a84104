"""The Trainer (trainer.py: Lightning's keyword arguments at the door, the entry points, Lightning's
read-back names) and `trainer.state`'s types (states.py), at Lightning's paths."""

from lightspeed.trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus
from lightspeed.trainer.trainer import Trainer

__all__ = ["RunningStage", "Trainer", "TrainerFn", "TrainerState", "TrainerStatus"]
