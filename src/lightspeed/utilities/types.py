"""Lightning's type aliases, for the annotations ported code carries
(`from lightning.pytorch.utilities.types import STEP_OUTPUT` becomes `from
lightspeed.utilities.types import ...`). They describe what lightspeed accepts; nothing checks them
at run time."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Union

import torch

from lightspeed.specs import SchedulerConfig

STEP_OUTPUT = Union[
    torch.Tensor, Mapping[str, Any], None
]  # what training_step / validation_step return
TRAIN_DATALOADERS = Any  # a DataLoader, or a collection of them
EVAL_DATALOADERS = Any  # a DataLoader, or a sequence of them
LRSchedulerTypeUnion = Union[
    torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
]
LRSchedulerConfigType = Mapping[
    str, Any
]  # {"scheduler": ..., "interval": "step", "frequency": 1, ...}
OptimizerLRScheduler = (
    Union[  # every form configure_optimizers may return (lightspeed.core.optimizer parses them)
        torch.optim.Optimizer,
        Sequence[torch.optim.Optimizer],
        tuple[
            Sequence[torch.optim.Optimizer],
            Sequence[Union[LRSchedulerTypeUnion, LRSchedulerConfigType]],
        ],
        Mapping[str, Any],
        Iterable[Mapping[str, Any]],
        None,
    ]
)

# The loop's record of one scheduler (specs.py), under Lightning's name:
# `trainer.lr_scheduler_configs` holds these.
LRSchedulerConfig = SchedulerConfig

__all__ = [
    "LRSchedulerConfig",
    "STEP_OUTPUT",
    "TRAIN_DATALOADERS",
    "EVAL_DATALOADERS",
    "LRSchedulerTypeUnion",
    "LRSchedulerConfigType",
    "OptimizerLRScheduler",
]
