"""Loggers: CSV, TensorBoard, MLflow and W&B, one file each (Lightning's paths). Rank 0 writes."""

from lightspeed.loggers.csv_logs import CSVLogger
from lightspeed.loggers.logger import Logger
from lightspeed.loggers.mlflow import MLFlowLogger, MLflowLogger
from lightspeed.loggers.tensorboard import TensorBoardLogger
from lightspeed.loggers.wandb import WandbLogger

__all__ = [
    "CSVLogger",
    "Logger",
    "MLFlowLogger",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
]
