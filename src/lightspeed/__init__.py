"""lightspeed: Lightning-style training on one device, DDP, DeepSpeed ZeRO 1/2/3, ZeRO-1 or FSDP2 with one flag."""

from .callbacks import (Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint, ModelSummary, RichModelSummary,
                        RichProgressBar, Timer, TQDMProgressBar)
from .datamodule import LightningDataModule
from .errors import ConfigError
from .guard import NonFiniteError
from .launch import DistInfo
from .loggers import CSVLogger, MLFlowLogger, MLflowLogger, TensorBoardLogger, WandbLogger
from .module import LightningModule, Module
from .rng import seed_everything
from .run_metrics import RunMetrics
from .strategies import DDP, SingleDevice, Strategy, ZeRO1, build_strategy
from .trainer import Trainer

__version__ = "0.1.0"


def __getattr__(name: str):
    # Backends with heavy imports load on first use: `lightspeed.DeepSpeed`, `lightspeed.FSDP`, `lightspeed.ZeRO1`.
    if name == "DeepSpeed":
        from .strategies.deepspeed import DeepSpeed

        return DeepSpeed
    if name == "FSDP":
        from .strategies.fsdp import FSDP

        return FSDP
    if name in ("consolidate", "full_state_dict"):
        import importlib

        return getattr(importlib.import_module("lightspeed.conversion"), name)
    raise AttributeError(f"module 'lightspeed' has no attribute {name!r}")


__all__ = [
    "Trainer", "Module", "LightningModule", "LightningDataModule", "Callback", "ModelCheckpoint", "EarlyStopping", "LearningRateMonitor", "Timer", "ModelSummary", "RichModelSummary", "RichProgressBar", "TQDMProgressBar",
    "CSVLogger", "TensorBoardLogger", "MLflowLogger", "MLFlowLogger", "WandbLogger", "RunMetrics", "ConfigError", "NonFiniteError", "DistInfo", "Strategy", "SingleDevice", "DDP", "DeepSpeed",
    "FSDP", "ZeRO1", "build_strategy", "seed_everything", "consolidate",
]
