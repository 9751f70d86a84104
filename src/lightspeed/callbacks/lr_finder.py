"""LearningRateFinder: Lightning's learning-rate range test as a callback; it runs before fit (see
lightspeed.tuner)."""

from __future__ import annotations

from typing import Any

from lightspeed.callbacks.callback import Callback
from lightspeed.errors import ConfigError
from lightspeed.tuner.lr_finder import _LRFinder, lr_find


def _runs_at_fit_start(callback: Callback) -> bool:
    """False when a subclass overrides on_fit_start (Lightning's way to run it elsewhere)."""
    return type(callback).on_fit_start is Callback.on_fit_start


def _not_in_a_fit(trainer: Any, what: str) -> None:
    if trainer.fitting:
        raise ConfigError(
            f"{what} cannot run inside a fit in lightspeed (its loop cannot be "
            "rewound): run it before fit, as the callback does by itself, or with "
            "lightspeed.tuner.Tuner."
        )


class LearningRateFinder(Callback):
    """Runs an LR range test before the fit (module docstring); `optimal_lr` holds its `_LRFinder`.

    Args:
        min_lr, max_lr: the LRs of the first and the last step. num_training_steps: steps (LRs).
        mode: "exponential" (default) or "linear" growth.
        early_stop_threshold: stop when the smoothed loss passes this times its best (None: never).
        update_attr: write the suggestion to `attr_name` (default `lr` or `learning_rate`) and into
            the optimizer. attr_name: the LR attribute of the model or its hparams.
    Raises:
        ValueError: an unknown mode.
    """

    SUPPORTED_MODES = ("linear", "exponential")

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training_steps: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> None:
        mode = mode.lower()
        if mode not in self.SUPPORTED_MODES:
            raise ValueError(f"`mode` should be either of {self.SUPPORTED_MODES}")
        self._min_lr, self._max_lr, self._num_training_steps = min_lr, max_lr, num_training_steps
        self._mode, self._early_stop_threshold = mode, early_stop_threshold
        self._update_attr, self._attr_name = update_attr, attr_name
        self.optimal_lr: _LRFinder | None = None

    def lr_find(
        self,
        trainer: Any,
        pl_module: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
    ) -> None:
        """Runs the range test on `trainer` (collective) and keeps its result in `optimal_lr`."""
        _not_in_a_fit(trainer, "LearningRateFinder.lr_find")
        self.optimal_lr = lr_find(
            trainer,
            pl_module,
            train_dataloaders,
            val_dataloaders,
            datamodule,
            min_lr=self._min_lr,
            max_lr=self._max_lr,
            num_training=self._num_training_steps,
            mode=self._mode,
            early_stop_threshold=self._early_stop_threshold,
            update_attr=self._update_attr,
            attr_name=self._attr_name,
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
            self.lr_find(trainer, model, train_dataloaders, val_dataloaders, datamodule)
