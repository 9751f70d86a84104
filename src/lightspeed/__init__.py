"""lightspeed: Lightning-style training on one device, DDP, DeepSpeed ZeRO 1/2/3, ZeRO-1 or FSDP2
with one flag."""

from typing import TYPE_CHECKING

from lightspeed.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    RichModelSummary,
    RichProgressBar,
    Timer,
    TQDMProgressBar,
)
from lightspeed.callbacks.run_metrics import RunMetrics
from lightspeed.core.datamodule import LightningDataModule
from lightspeed.core.module import LightningModule, Module
from lightspeed.errors import ConfigError
from lightspeed.loggers import CSVLogger, MLFlowLogger, MLflowLogger, TensorBoardLogger, WandbLogger
from lightspeed.runtime.guard import NonFiniteError
from lightspeed.runtime.launch import DistInfo
from lightspeed.runtime.rng import seed_everything
from lightspeed.strategies import DDP, SingleDevice, Strategy, ZeRO1, build_strategy
from lightspeed.trainer import Trainer

if TYPE_CHECKING:  # loaded by __getattr__ at run time
    from lightspeed.strategies.conversion import consolidate
    from lightspeed.strategies.deepspeed.strategy import DeepSpeed
    from lightspeed.strategies.fsdp import FSDP

__version__ = "0.1.0"


def __getattr__(name: str):
    # Backends with heavy imports load on first use: `lightspeed.DeepSpeed`, `lightspeed.FSDP`,
    # `lightspeed.ZeRO1`.
    if name == "DeepSpeed":
        from lightspeed.strategies.deepspeed.strategy import DeepSpeed

        return DeepSpeed
    if name == "FSDP":
        from lightspeed.strategies.fsdp import FSDP

        return FSDP
    # jsonargparse loads with the CLI, not with the package.
    if name in ("cli_lightning_logo", "LightningCLI"):
        from lightspeed import cli

        return getattr(cli, name)
    if name in ("consolidate", "full_state_dict"):
        import importlib

        return getattr(importlib.import_module("lightspeed.strategies.conversion"), name)
    raise AttributeError(f"module 'lightspeed' has no attribute {name!r}")


__all__ = [
    "Trainer",
    "Module",
    "LightningModule",
    "LightningDataModule",
    "Callback",
    "ModelCheckpoint",
    "EarlyStopping",
    "LearningRateMonitor",
    "Timer",
    "ModelSummary",
    "RichModelSummary",
    "RichProgressBar",
    "TQDMProgressBar",
    "CSVLogger",
    "TensorBoardLogger",
    "MLflowLogger",
    "MLFlowLogger",
    "WandbLogger",
    "RunMetrics",
    "ConfigError",
    "NonFiniteError",
    "DistInfo",
    "Strategy",
    "SingleDevice",
    "DDP",
    "DeepSpeed",
    "FSDP",
    "ZeRO1",
    "build_strategy",
    "seed_everything",
    "consolidate",
]
