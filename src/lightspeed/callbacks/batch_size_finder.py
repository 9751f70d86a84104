"""BatchSizeFinder: the largest batch size that fits, found before fit (see lightspeed.tuner)."""

from __future__ import annotations

from typing import Any

from lightspeed.callbacks.callback import Callback
from lightspeed.callbacks.lr_finder import _not_in_a_fit, _runs_at_fit_start
from lightspeed.errors import ConfigError
from lightspeed.tuner.batch_size_scaling import check_batch_size_finder, scale_batch_size


class BatchSizeFinder(Callback):
    """Searches the largest batch size before the fit (module docstring; one device);
    `optimal_batch_size` holds it.

    Args: Lightning's: mode ("power" or "binsearch"), steps_per_trial, init_val, max_trials,
        batch_arg_name, margin (binsearch), max_val.
    Raises:
        ValueError: an unknown mode or a margin outside [0, 1).
    """

    SUPPORTED_MODES = ("power", "binsearch")

    def __init__(
        self,
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> None:
        mode = mode.lower()
        if mode not in self.SUPPORTED_MODES:
            raise ValueError(f"`mode` should be either of {self.SUPPORTED_MODES}")
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"`margin` should be between 0 and 1. Found margin={margin}")
        self.optimal_batch_size: int | None = init_val
        self._mode, self._steps_per_trial, self._init_val = mode, steps_per_trial, init_val
        self._max_trials, self._batch_arg_name = max_trials, batch_arg_name
        self._margin, self._max_val = margin, max_val

    def setup(self, trainer: Any, pl_module: Any, stage: str | None = None) -> None:
        if trainer.world_size > 1 or trainer.strategy.name != "single":
            raise ConfigError("The Batch size finder is not supported with distributed strategies.")

    def scale_batch_size(
        self,
        trainer: Any,
        pl_module: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
    ) -> None:
        """Runs the search on `trainer` for fit and keeps the size in `optimal_batch_size`."""
        _not_in_a_fit(trainer, "BatchSizeFinder.scale_batch_size")
        self.optimal_batch_size = scale_batch_size(
            trainer,
            pl_module,
            "fit",
            train_dataloaders,
            val_dataloaders,
            None,
            datamodule,
            self._mode,
            self._steps_per_trial,
            self._init_val,
            self._max_trials,
            self._batch_arg_name,
            self._margin,
            self._max_val,
        )

    def run_before_fit(
        self,
        trainer: Any,
        model: Any,
        train_dataloaders: Any,
        val_dataloaders: Any,
        datamodule: Any,
    ) -> None:
        """Called by `Trainer.fit` before it starts, with its arguments."""
        if _runs_at_fit_start(self):
            check_batch_size_finder(
                trainer, model, "fit", train_dataloaders, datamodule, self._batch_arg_name
            )
            self.scale_batch_size(trainer, model, train_dataloaders, val_dataloaders, datamodule)
