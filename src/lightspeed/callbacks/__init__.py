"""Callbacks: hooks into the loop with state that travels in checkpoints, one file each (Lightning's
paths)."""

from lightspeed.callbacks.batch_size_finder import BatchSizeFinder
from lightspeed.callbacks.callback import Callback
from lightspeed.callbacks.device_stats_monitor import DeviceStatsMonitor
from lightspeed.callbacks.early_stopping import EarlyStopping
from lightspeed.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
from lightspeed.callbacks.gradient_accumulation_scheduler import GradientAccumulationScheduler
from lightspeed.callbacks.lambda_function import LambdaCallback
from lightspeed.callbacks.lr_finder import LearningRateFinder
from lightspeed.callbacks.lr_monitor import LearningRateMonitor
from lightspeed.callbacks.model_checkpoint import ModelCheckpoint
from lightspeed.callbacks.model_summary import ModelSummary
from lightspeed.callbacks.on_exception_checkpoint import OnExceptionCheckpoint
from lightspeed.callbacks.prediction_writer import BasePredictionWriter
from lightspeed.callbacks.progress import ProgressBar, RichProgressBar, TQDMProgressBar
from lightspeed.callbacks.rich_model_summary import RichModelSummary
from lightspeed.callbacks.timer import Timer

__all__ = [
    "DeviceStatsMonitor",
    "LambdaCallback",
    "BatchSizeFinder",
    "LearningRateFinder",
    "BackboneFinetuning",
    "BaseFinetuning",
    "BasePredictionWriter",
    "Callback",
    "EarlyStopping",
    "GradientAccumulationScheduler",
    "LearningRateMonitor",
    "ModelCheckpoint",
    "ModelSummary",
    "OnExceptionCheckpoint",
    "ProgressBar",
    "RichModelSummary",
    "RichProgressBar",
    "TQDMProgressBar",
    "Timer",
]
