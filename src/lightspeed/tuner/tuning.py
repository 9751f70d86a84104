"""Lightning's `Tuner`: an LR range test and a batch size search on a Trainer, before its fit.

    from lightspeed.tuner import Tuner

    tuner = Tuner(trainer)
    finder = tuner.lr_find(model)          # model.lr (or learning_rate) is set to the suggestion
    tuner.scale_batch_size(model)          # model.batch_size (one device)
    trainer.fit(model)                     # starts at step 0 from the same weights

Both run short fits on the Trainer itself (tuner/trial.py) and leave the weights, the optimizer
state, the step and the epoch as they found them.
"""

from __future__ import annotations

from typing import Any, Literal

from lightspeed.errors import ConfigError
from lightspeed.tuner.batch_size_scaling import METHODS, scale_batch_size
from lightspeed.tuner.lr_finder import _LRFinder, lr_find

__all__ = ["Tuner"]


class Tuner:
    """Tunes a model's LR and batch size with `trainer` (Lightning's `Tuner(trainer)`)."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def scale_batch_size(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: Literal["fit", "validate", "test", "predict"] = "fit",
        mode: str = "power",
        steps_per_trial: int = 3,
        init_val: int = 2,
        max_trials: int = 25,
        batch_arg_name: str = "batch_size",
        margin: float = 0.05,
        max_val: int = 8192,
    ) -> int | None:
        """The largest batch size that runs without running out of memory, written to
        `batch_arg_name` on the model, its hparams or the DataModule (batch_size_scaling.py).

        Args:
            model: the Module to tune; its (or the DataModule's) `*_dataloader()` must read the
                attribute. train_dataloaders / val_dataloaders (method "fit") or dataloaders
                (otherwise): Lightning's; loaders themselves cannot be rebuilt (ConfigError).
            method: the entry point the trials run: "fit", "validate", "test" or "predict".
            mode: "power" (double until out of memory) or "binsearch" (then bisect).
            steps_per_trial: optimizer steps (or evaluation batches) per trial.
            init_val: the first size tried. max_trials: at most this many trials (Lightning's
                count). margin: taken off the size "binsearch" found. max_val: the largest size
                tried.
        Returns:
            The size found; None under fast_dev_run.
        Raises:
            ValueError: a bad method or mode, several devices, or a BatchSizeFinder callback
                already on the Trainer. ConfigError: see `check_batch_size_finder`.
        """
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        t = self._trainer
        if t.world_size > 1 or t.strategy.name != "single":
            raise ValueError(
                "Tuning the batch size is currently not supported with distributed strategies."
            )
        # The finder callbacks import this package's search functions: imported here, at call time.
        from lightspeed.callbacks.batch_size_finder import BatchSizeFinder

        if any(isinstance(cb, BatchSizeFinder) for cb in t.callbacks):
            raise ValueError(
                "Trainer is already configured with a `BatchSizeFinder` callback. "
                "Please remove it if you want to use the Tuner."
            )
        return scale_batch_size(
            t,
            model,
            method,
            train_dataloaders,
            val_dataloaders,
            dataloaders,
            datamodule,
            mode,
            steps_per_trial,
            init_val,
            max_trials,
            batch_arg_name,
            margin,
            max_val,
        )

    def lr_find(
        self,
        model: Any,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        method: Literal["fit", "validate", "test", "predict"] = "fit",
        min_lr: float = 1e-8,
        max_lr: float = 1,
        num_training: int = 100,
        mode: str = "exponential",
        early_stop_threshold: float | None = 4.0,
        update_attr: bool = True,
        attr_name: str = "",
    ) -> _LRFinder | None:
        """An LR range test (lr_finder.py): `num_training` steps from `min_lr` to `max_lr`,
        stopped when the smoothed loss passes `early_stop_threshold` times its best. Collective on
        several ranks; every rank gets the same result.

        Args:
            model: the Module to tune. train_dataloaders / val_dataloaders / datamodule: as fit's.
            mode: "exponential" or "linear" LR growth. update_attr: write the suggestion to
                `attr_name` (default `lr` or `learning_rate`, on the model or its hparams) and into
                the set-up optimizer.
        Returns:
            The `_LRFinder` (`results`, `suggestion()`, `plot()`); None under fast_dev_run.
        Raises:
            ConfigError: method other than "fit", `dataloaders` given, or several optimizers.
            ValueError: a bad mode, or a LearningRateFinder callback already on the Trainer.
            AttributeError: update_attr and no LR attribute.
        """
        if method != "fit":
            raise ConfigError("method='fit' is the only valid configuration to run lr finder.")
        _check_tuner_configuration(train_dataloaders, val_dataloaders, dataloaders, method)
        from lightspeed.callbacks.lr_finder import LearningRateFinder

        if any(isinstance(cb, LearningRateFinder) for cb in self._trainer.callbacks):
            raise ValueError(
                "Trainer is already configured with a `LearningRateFinder` callback. "
                "Please remove it if you want to use the Tuner."
            )
        if mode not in LearningRateFinder.SUPPORTED_MODES:
            raise ValueError(f"`mode` should be either of {LearningRateFinder.SUPPORTED_MODES}")
        if hasattr(train_dataloaders, "train_dataloader") and datamodule is None:
            datamodule, train_dataloaders = train_dataloaders, None  # a DataModule in that place
        return lr_find(
            self._trainer,
            model,
            train_dataloaders,
            val_dataloaders,
            datamodule,
            min_lr=min_lr,
            max_lr=max_lr,
            num_training=num_training,
            mode=mode,
            early_stop_threshold=early_stop_threshold,
            update_attr=update_attr,
            attr_name=attr_name,
        )


def _check_tuner_configuration(
    train_dataloaders: Any, val_dataloaders: Any, dataloaders: Any, method: str
) -> None:
    """Lightning's checks of which loaders go with which method (ValueError, ConfigError)."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} is invalid. Should be one of {METHODS}.")
    if method == "fit" and dataloaders is not None:
        raise ConfigError(
            f"In tuner with method={method!r}, `dataloaders` argument should be None,"
            " please consider setting `train_dataloaders` and `val_dataloaders` "
            "instead."
        )
    if method != "fit" and (train_dataloaders is not None or val_dataloaders is not None):
        raise ConfigError(
            f"In tuner with `method`={method!r}, `train_dataloaders` and "
            "`val_dataloaders` arguments should be None, please consider setting "
            "`dataloaders` instead."
        )
