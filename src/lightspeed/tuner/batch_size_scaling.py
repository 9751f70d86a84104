"""Lightning's batch size scaling: the largest batch size that runs without running out of memory.

    size = scale_batch_size(trainer, model, mode="power")   # also written to model.batch_size

Each trial is a short run on the user's Trainer (tuner/trial.py): `steps_per_trial` optimizer steps
of `fit` (or that many batches of validate / test / predict), with the loaders rebuilt from the
Module's or DataModule's `*_dataloader()` reading the batch size attribute. "power" doubles the size
after each trial that ran and halves it after one that ran out of memory (then stops once any
trial ran); "binsearch" doubles until a trial fails, then bisects between the last size that ran and
the first that did not, and takes `margin` off the result. Afterwards the weights, optimizer state,
step and epoch are as they were, and the attribute holds the size found.

One device only (as in Lightning): an out-of-memory error would leave the ranks of a group in
different places. lightspeed's own `Trainer(micro_batch="auto")` searches on any strategy and any
number of ranks, from a memory forecast (plan/micro_batch.py).
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from lightspeed.errors import ConfigError
from lightspeed.tuner.trial import (
    Probe,
    TrialRuns,
    find_holders,
    read_attr,
    refresh_optimizer,
    write_attr,
)
from lightspeed.utilities.rank_zero import rank_zero_warn

__all__ = ["scale_batch_size", "check_batch_size_finder", "is_oom_error"]
log = logging.getLogger(__name__)
METHODS = ("fit", "validate", "test", "predict")
_PREFIX = {"validate": "val", "test": "test", "predict": "predict"}


class _Steps(Probe):
    """A fit trial of `steps` optimizer steps over the whole training set, validation limited to
    `steps` batches (Lightning's trial)."""

    def __init__(self, steps: int):
        self.steps = steps

    def trial_flags(self, trainer: Any) -> dict:
        return {
            "max_steps": trainer.global_step + self.steps,
            "limit_train_batches": None,
            "limit_val_batches": self.steps,
        }


def is_oom_error(error: BaseException) -> bool:
    """Whether `error` means out of memory: torch's OutOfMemoryError or the messages of a CUDA,
    cuDNN or CPU allocator failure."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        m in text
        for m in (
            "CUDA out of memory",
            "CUDA error: out of memory",
            "CUDNN_STATUS_NOT_SUPPORTED",
            "DefaultCPUAllocator: can't allocate memory",
        )
    )


def check_batch_size_finder(
    trainer: Any, model: Any, method: str, given: Any, datamodule: Any, name: str
) -> None:
    """What Lightning refuses before any trial. Raises ConfigError for more than one device or a
    strategy other than single-device, loaders handed to the entry point (they cannot be rebuilt),
    several evaluation loaders, or no `name` attribute; warns when both `model.<name>` and
    `model.hparams.<name>` exist."""
    if trainer.world_size > 1 or trainer.strategy.name != "single":
        raise ConfigError("The Batch size finder is not supported with distributed strategies.")
    if given is not None:
        raise ConfigError(
            f"The Batch size finder cannot be used with dataloaders passed directly "
            f"to `.{method}()`. Please disable the feature or incorporate the "
            "dataloader into your LightningModule or LightningDataModule."
        )
    if method != "fit" and datamodule is None:  # a DataModule's may need its setup: seen later
        loaders = getattr(model, f"{_PREFIX[method]}_dataloader")()
        if isinstance(loaders, (list, tuple)) and len(loaders) > 1:
            raise ConfigError(
                f"The Batch size finder cannot be used with multiple {_PREFIX[method]} dataloaders."
            )
    if not find_holders(model, name, datamodule):
        raise ConfigError(
            f"Field {name} not found in `model`, `datamodule`, nor their `hparams` attributes."
        )
    if hasattr(model, name) and name in (getattr(model, "hparams", None) or {}):
        rank_zero_warn(
            f"Field `model.{name}` and `model.hparams.{name}` are mutually exclusive! "
            f"`model.{name}` will be used as the initial batch size for scaling. If this "
            "is not the intended behavior, please remove either one."
        )


class _Search:
    """Runs trials at the size the attribute holds, and moves it (Lightning's
    `_adjust_batch_size`)."""

    def __init__(
        self,
        trials: TrialRuns,
        model: Any,
        method: str,
        loaders: tuple,
        datamodule: Any,
        steps: int,
        name: str,
        max_val: int,
    ):
        self.trials, self.model, self.method, self.loaders = trials, model, method, loaders
        self.datamodule, self.steps, self.name, self.max_val = datamodule, steps, name, max_val
        self.length: int | None = None  # the dataset's, once a trial built the loader

    def run(self) -> bool:
        """One trial at the current size: True if it ran, False if it ran out of memory."""
        try:
            if self.method == "fit":
                train, val = self.loaders
                self.trials.fit(_Steps(self.steps), self.model, train, val, self.datamodule)
            else:
                self.trials.evaluate(
                    self.method,
                    self.model,
                    None,
                    self.datamodule,
                    **{f"limit_{_PREFIX[self.method]}_batches": self.steps},
                )
            ran = True
        except RuntimeError as e:  # torch.OutOfMemoryError is one
            if not is_oom_error(e):
                raise
            ran = False
        self.length = self._dataset_length()
        if not ran:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        return ran

    def _dataset_length(self) -> int | None:
        t = self.trials.trainer
        loader = (
            t.train_dataloader
            if self.method == "fit"
            else getattr(t, f"{_PREFIX[self.method]}_dataloaders")
        )
        if isinstance(loader, list):
            raise ConfigError(
                f"The Batch size finder cannot be used with multiple "
                f"{_PREFIX[self.method]} dataloaders."
            )
        try:
            return len(loader.dataset)
        except (AttributeError, TypeError):  # an iterable dataset
            return None

    def adjust(
        self, factor: float = 1.0, value: int | None = None, desc: str | None = None
    ) -> tuple[int, bool]:
        """Writes the next size (`value`, else the current one times `factor`, at most `max_val`);
        returns (it, whether it changed). The size stays when it already covers the dataset."""
        size = read_attr(self.model, self.name, self.datamodule)
        if self.length is not None and size >= self.length:
            log.info(
                f"The batch size {size} is greater or equal than the length of your dataset: "
                f"{self.length}."
            )
            return size, False
        new = value if value is not None else int(size * factor)
        if new > self.max_val:
            if desc:
                log.info(
                    f"Batch size {new} exceeds max_val limit {self.max_val}, capping at "
                    f"{self.max_val}"
                )
            new = self.max_val
        if desc:
            log.info(f"Batch size {size} {desc}, trying batch size {new}")
        write_attr(self.model, self.name, new, self.datamodule)
        return new, new != size


def _power(search: _Search, size: int, max_trials: int) -> int:
    """Doubles after each trial that ran; after one that did not, halves (and stops if any ran)."""
    any_ran = False
    for i in range(max_trials):
        if size >= search.max_val:
            log.info(f"Reached the maximum batch size limit of {search.max_val}. Stopping search.")
            break
        if search.run():
            if i + 1 >= max_trials:  # the last trial: keep the size that ran
                break
            size, changed = search.adjust(factor=2.0, desc="succeeded")
            if not changed:
                break
            any_ran = True
        else:
            size, _ = search.adjust(factor=0.5, desc="failed")
            if any_ran:
                break
    return size


def _binsearch(search: _Search, size: int, max_trials: int, margin: float) -> int:
    """Doubles until a trial fails, then bisects between the last size that ran and the first that
    did not; at most `max_trials` trials that ran. Then takes `margin` off the size found."""
    low, high, ran = 1, None, 0
    while size < search.max_val:
        if search.run():
            ran += 1
            if ran >= max_trials:
                break
            low = size
            if high is not None and high - low <= 1:
                break
            if high is not None:
                size, changed = search.adjust(value=(high + low) // 2, desc="succeeded")
            else:
                size, changed = search.adjust(factor=2.0, desc="succeeded")
            if not changed:
                break
        else:
            high = size
            size, _ = search.adjust(value=(high + low) // 2, desc="failed")
            if high - low <= 1:
                break
    else:
        log.info(f"Reached the maximum batch size limit of {search.max_val}. Stopping search.")
    reduced = max(1, int(size * (1 - margin)))
    if margin > 0 and reduced != size:
        log.info(f"Applying margin of {margin:.1%}, reducing batch size from {size} to {reduced}")
        size = reduced
        write_attr(search.model, search.name, size, search.datamodule)
    return size


def scale_batch_size(
    trainer: Any,
    model: Any,
    method: str = "fit",
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    dataloaders: Any = None,
    datamodule: Any = None,
    mode: str = "power",
    steps_per_trial: int = 3,
    init_val: int = 2,
    max_trials: int = 25,
    batch_arg_name: str = "batch_size",
    margin: float = 0.05,
    max_val: int = 8192,
) -> int | None:
    """Searches the largest batch size that runs (module docstring), writes it to the attribute
    `batch_arg_name` (model, its hparams, the DataModule or its hparams) and returns it; None under
    fast_dev_run (skipped, with a warning).

    Raises:
        ValueError: an unknown `mode` or `method`, or `margin` outside [0, 1).
        ConfigError: see `check_batch_size_finder`; an error other than out-of-memory in a trial.
    """
    if mode not in ("power", "binsearch"):
        raise ValueError("`mode` should be either of ('power', 'binsearch')")
    if method not in METHODS:
        raise ValueError(f"method {method!r} is invalid. Should be one of {METHODS}.")
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"`margin` should be between 0 and 1. Found margin={margin}")
    given = (
        (
            train_dataloaders
            if train_dataloaders is not None and not hasattr(train_dataloaders, "train_dataloader")
            else None
        )
        if method == "fit"
        else dataloaders
    )
    if method == "fit" and hasattr(train_dataloaders, "train_dataloader"):
        datamodule, train_dataloaders = train_dataloaders, None  # a DataModule in that place
    check_batch_size_finder(trainer, model, method, given, datamodule, batch_arg_name)
    if trainer.fast_dev_run:
        rank_zero_warn("Skipping batch size scaler since `fast_dev_run` is enabled.")
        return None
    trials = TrialRuns(trainer, ".scale_batch_size")
    search = _Search(
        trials,
        model,
        method,
        (train_dataloaders, val_dataloaders),
        datamodule,
        steps_per_trial,
        batch_arg_name,
        max_val,
    )
    try:
        size, _ = search.adjust(value=init_val)
        if mode == "power":
            size = _power(search, size, max_trials)
        else:
            size = _binsearch(search, size, max_trials, margin)
        if method == "fit":  # a trial of no step: the Trainer's loaders hold the size found
            trials.fit(_Steps(0), model, train_dataloaders, val_dataloaders, datamodule)
        trials.restore()
        if method == "fit":  # schedulers sized from estimated_stepping_batches: for this size
            refresh_optimizer(trainer, model)
    finally:
        trials.clean_up()
    log.info(f"Finished batch size finder, will continue with full run using batch size {size}")
    return size
