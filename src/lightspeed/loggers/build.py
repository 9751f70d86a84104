"""Building the Trainer's loggers from its `logger` argument, and agreeing their log directories
across ranks."""

from __future__ import annotations

from typing import Any

from lightspeed.loggers.csv_logs import CSVLogger
from lightspeed.loggers.tensorboard import TensorBoardLogger
from lightspeed.runtime.distributed import broadcast_from_rank0


def agree_log_dirs(loggers: list) -> None:
    """Collective, once at launch: each rank's loggers take rank 0's version and folder. Every rank
    builds its own loggers, and a rank that starts after rank 0 has made `version_N` would otherwise
    count `version_N+1`; `trainer.log_dir` must name the same folder on every rank. Only rank 0's
    loggers write."""
    found = [(getattr(lg, "version", None), getattr(lg, "log_dir", None)) for lg in loggers]
    agreed = broadcast_from_rank0(found)
    if len(agreed) != len(found):
        return  # different loggers per rank: the user's choice, left as it is
    for lg, values in zip(loggers, agreed):
        for name, value in zip(("version", "log_dir"), values):
            # plain attributes and settable properties only (CSV's log_dir, W&B's folder derive)
            attr = getattr(type(lg), name, None)
            settable = isinstance(attr, property) and attr.fset is not None
            if value is not None and (name in vars(lg) or settable):
                setattr(lg, name, value)


class RunRecord(CSVLogger):
    """The default logger's companion: the `metrics.csv` (same folder and version as the
    TensorBoardLogger) that the run report reads. It receives every logged value, but
    `trainer.loggers` leaves it out, so the user's code sees Lightning's default, one
    TensorBoardLogger (Lightning code that calls `logger.experiment.add_image` on each logger
    would otherwise reach a CSV writer)."""


def build_loggers(logger: Any, root: str) -> list:
    """The loggers of `Trainer(logger=...)`: True gives a TensorBoardLogger and its RunRecord (same
    version) under `root`, False/None none, a logger or a list of them themselves."""
    if logger is True:  # Lightning's default logger, so `self.logger.experiment` is a writer
        tb_logger = TensorBoardLogger(root)
        return [tb_logger, RunRecord(root, version=tb_logger.version)]
    if not logger:
        return []
    return list(logger) if isinstance(logger, (list, tuple)) else [logger]
