"""The names a Lightning Trainer answers to, read-only, over what lightspeed's Trainer holds.

    trainer.lightning_module, trainer.model, trainer.log_dir, trainer.node_rank, trainer.state.fn
    trainer.train_dataloader, trainer.val_dataloaders, trainer.num_training_batches,
    trainer.num_val_batches trainer.checkpoint_callbacks, trainer.early_stopping_callback,
    trainer.is_last_batch, trainer.ckpt_path

`Trainer` takes them in from `LightningNames`: properties only, no state and no hooks, so trainer.py
stays the loop. Each reads what the loop records (`_module`, `_loaders`, `_status`, ...) and none
runs a collective, so reading one on a single rank (inside `rank_zero_only` code) cannot leave the
others waiting. Where Lightning agrees on a value with a collective inside the property (`log_dir`),
lightspeed agreed on it once, at launch (`loggers.agree_log_dirs`).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightspeed.callbacks import EarlyStopping, ModelCheckpoint
from lightspeed.data.loaders import estimated_stepping_batches, num_batches


@dataclass(frozen=True)
class TrainerState:
    """Lightning's `trainer.state`, as strings: `fn` ("fit", "validate", "test", "predict" or None
    before any), `stage` ("train", "sanity_check", "validate", "test", "predict") and `status`
    ("initializing", "running", "finished", "interrupted": an exception ended the run)."""

    fn: str | None
    stage: str | None
    status: str

    @property
    def finished(self) -> bool:
        """Whether the last entry point ran to its end (Lightning's `trainer.state.finished`)."""
        return self.status == "finished"


def _one_or_list(loaders: Any) -> Any:
    """As Lightning returns evaluation loaders: the loader itself when there is one, else the list
    (None: none)."""
    if not loaders:
        return None
    return loaders[0] if isinstance(loaders, list) and len(loaders) == 1 else loaders


class LightningNames:
    """Read-only properties in Lightning's names (module docstring). The Trainer sets what they
    read."""

    is_last_batch = False  # True while the epoch's last training batch runs (set by the loop)
    skips_rest = (
        False  # on_train_batch_start returned -1 in this epoch: the loop ends it (hooks.py)
    )
    _module: Any = None
    _loaders: dict[str, Any] = {}
    _status, _fn, _ckpt_path = "initializing", None, None

    # ------------------------------------------------------------------ where this process is
    local_rank = property(lambda self: self.dist.local_rank if self.dist else 0)
    node_rank = property(lambda self: self.dist.node_rank if self.dist else self._env.node_rank)

    # ------------------------------------------------------------------ what runs now
    training, validating, testing, predicting = (
        property(lambda self, s=s: self.stage == s)
        for s in ("train", "validate", "test", "predict")
    )

    @property
    def state(self) -> TrainerState:
        stage = "sanity_check" if self.sanity_checking else self.stage if self._fn else None
        return TrainerState(self._fn, stage, self._status)

    interrupted = property(
        lambda self: self._status == "interrupted"
    )  # an exception ended the last run
    received_sigterm = property(lambda self: self._preemption.received == signal.SIGTERM)
    ckpt_path = property(
        lambda self: self._ckpt_path
    )  # the checkpoint the last run loaded, as rank 0 resolved it

    # ------------------------------------------------------------------ the model
    lightning_module = property(
        lambda self: self._module
    )  # the user's Module, as set up by the last run

    @property
    def model(self) -> Any:
        """What the strategy runs: the DDP wrapper, the DeepSpeed engine, else the Module (FSDP2
        shards in place)."""
        wrapped = vars(self.strategy).get("wrapped") or vars(self.strategy).get("engine")
        return wrapped if wrapped is not None else self._module

    optimizers = property(lambda self: self.strategy.optimizers)
    lr_scheduler_configs = property(
        lambda self: self.strategy.schedulers
    )  # specs.SchedulerConfig each

    # ------------------------------------------------------------------ the data, and how many
    # batches of it
    train_dataloader = property(
        lambda self: getattr(  # with its DistributedSampler; several: their dict / list
            self._loaders.get("train"), "iterables", self._loaders.get("train")
        )
    )
    val_dataloaders = property(lambda self: _one_or_list(self._loaders.get("validate")))
    test_dataloaders = property(lambda self: _one_or_list(self._loaders.get("test")))
    predict_dataloaders = property(lambda self: _one_or_list(self._loaders.get("predict")))

    @property
    def num_training_batches(self) -> int | float:
        """This rank's training batches per epoch after `limit_train_batches` (inf before fit or
        without a length)."""
        train = self._loaders.get("train")
        return float("inf") if train is None else num_batches(train, self.cfg.limit_train_batches)

    def _counts(self, stage: str, limit: Any) -> list[int | float]:
        return [num_batches(loader, limit) for loader in self._loaders.get(stage) or []]

    num_val_batches = property(
        lambda self: self._counts("validate", self.cfg.limit_val_batches)
    )  # one per loader
    num_test_batches = property(lambda self: self._counts("test", self.cfg.limit_test_batches))
    num_predict_batches = property(
        lambda self: self._counts("predict", self.cfg.limit_predict_batches)
    )

    @property
    def num_sanity_val_batches(self) -> list[int | float]:
        steps = self.cfg.num_sanity_val_steps
        return [n if steps == -1 else min(n, steps) for n in self.num_val_batches]

    estimated_stepping_batches = property(
        lambda self: estimated_stepping_batches(self._loaders.get("train"), self.cfg)
    )

    # ------------------------------------------------------------------ callbacks, metrics, loggers
    logged_metrics = property(
        lambda self: self.metrics.logged
    )  # the last values sent to the loggers
    progress_bar_metrics = property(lambda self: self.metrics.prog_bar_values())
    checkpoint_callbacks = property(
        lambda self: [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]
    )
    checkpoint_callback = property(lambda self: next(iter(self.checkpoint_callbacks), None))
    early_stopping_callbacks = property(
        lambda self: [c for c in self.callbacks if isinstance(c, EarlyStopping)]
    )
    early_stopping_callback = property(lambda self: next(iter(self.early_stopping_callbacks), None))
    logger = property(lambda self: self.loggers[0] if self.loggers else None)
    progress_bar_callback = property(
        lambda self: next(  # the RichProgressBar / TQDMProgressBar given, or None
            (cb for cb in self.callbacks if getattr(cb, "is_progress_bar", False)), None
        )
    )

    @property
    def checkpoint_dir(self) -> Path:
        ckpt = self.checkpoint_callback
        return (
            Path(ckpt.dirpath)
            if ckpt and ckpt.dirpath
            else Path(self.default_root_dir) / "checkpoints"
        )

    @property
    def log_dir(self) -> str:
        """The first logger's folder (its `log_dir`, else its `save_dir`), else `default_root_dir`:
        the same on every rank (agreed at launch), as Lightning's, without its broadcast on each
        read."""
        if not self.loggers:
            return str(self.default_root_dir)
        first = self.loggers[0]
        folder = getattr(first, "log_dir", None) or getattr(first, "save_dir", None)
        return str(folder) if folder is not None else str(self.default_root_dir)
