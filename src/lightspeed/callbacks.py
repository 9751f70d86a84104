"""Callbacks: hooks into the loop with state that travels in checkpoints.

A callback sees the Trainer through `specs.TrainerView` (step, epoch, rank, metrics, log_metrics,
save_checkpoint), not its internals. Decisions that every rank must share (save or not, the checkpoint's name,
stop or not) are taken on rank 0 and broadcast: metric values may differ between ranks.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from pathlib import Path
from typing import Any, Literal

import torch

from .checkpoint import unused_name
from .config import parse_duration
from .distributed import AgreedMax, broadcast_from_rank0
from .errors import ConfigError
from .specs import TrainerView as Trainer

Module = torch.nn.Module


class Callback:
    """Override any hook. Callbacks with state override `state_dict`/`load_state_dict` (saved in checkpoints)."""

    @property
    def state_key(self) -> str:
        return type(self).__name__

    def setup(self, trainer: Trainer, module: Module, stage: str) -> None: ...
    def on_fit_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_fit_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_batch_start(self, trainer: Trainer, module: Module, batch: Any, batch_idx: int) -> None: ...
    def on_before_backward(self, trainer: Trainer, module: Module, loss: torch.Tensor) -> None: ...
    def on_after_backward(self, trainer: Trainer, module: Module) -> None: ...
    def on_before_optimizer_step(self, trainer: Trainer, module: Module, optimizer: Any) -> None: ...
    def on_before_zero_grad(self, trainer: Trainer, module: Module, optimizer: Any) -> None: ...
    def on_validation_batch_start(self, trainer: Trainer, module: Module, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None: ...
    def on_test_batch_start(self, trainer: Trainer, module: Module, batch: Any, batch_idx: int,
                            dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int,
                          dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_start(self, trainer: Trainer, module: Module, batch: Any, batch_idx: int,
                               dataloader_idx: int = 0) -> None: ...
    def on_predict_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int,
                             dataloader_idx: int = 0) -> None: ...
    def on_train_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None: ...
    def on_validation_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_test_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_test_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_predict_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_predict_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_sanity_check_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_sanity_check_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_test_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_test_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_predict_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_predict_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_save_checkpoint(self, trainer: Trainer, module: Module, checkpoint: dict) -> None: ...
    def on_load_checkpoint(self, trainer: Trainer, module: Module, checkpoint: dict) -> None: ...
    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None: ...
    def teardown(self, trainer: Trainer, module: Module, stage: str) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...


def _check_mode(mode: str) -> None:
    if mode not in ("min", "max"):
        raise ConfigError(f"mode={mode!r} is not valid: use 'min' or 'max'.")


def _improved(current: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    if best is None or math.isnan(best):
        return not math.isnan(current)
    return current < best - min_delta if mode == "min" else current > best + min_delta


def format_checkpoint_name(template: str, values: dict[str, Any], insert_names: bool = True) -> str:
    """Lightning's checkpoint file names: "{epoch}-{val/loss:.2f}" -> "epoch=3-val_loss=0.12" (with
    `insert_names`; "/" in a metric name becomes "_"). A name the run never logged is a ConfigError."""
    def field(match: re.Match) -> str:
        name, spec = match.group(1), match.group(2) or ""
        if name not in values:
            raise ConfigError(f"ModelCheckpoint(filename={template!r}) names {name!r}, which was not logged: "
                              f"logged metrics are {sorted(set(values) - {'epoch', 'step'})}.")
        text = format(values[name], spec[1:])
        return f"{name.replace('/', '_')}={text}" if insert_names else text

    return re.sub(r"\{([^{}:]+)(:[^{}]*)?\}", field, template)


class ModelCheckpoint(Callback):
    """Saves checkpoints (collectively: every rank takes part) and keeps the best `save_top_k` by `monitor`.

    Args:
        dirpath: where checkpoints go (default `<default_root_dir>/checkpoints`).
        monitor: a logged metric; None keeps the most recent `save_top_k` instead.
        mode: "min" or "max". save_top_k: -1 keeps all, 0 none (only `last`).
        save_last: also keep the newest checkpoint when it is not among the top k. Whatever is kept, `last`
            (a symlink moved only after a save completes) points at the newest one.
        every_n_train_steps / every_n_epochs / train_time_interval: when to save (default: every epoch end);
            `train_time_interval` ("DD:HH:MM:SS", a timedelta or its keywords) goes by rank 0's clock, checked
            after each step (under NCCL one step late, so the host never waits for the GPU).
        save_on_train_epoch_end: False saves after each validation during fit (mid-epoch ones too) instead of at
            the training epoch's end; None and True save at the epoch's end, after its validation.
        verbose: says on rank 0 what each save kept. enable_version_counter: False lets a new run overwrite a
            checkpoint of the same name an earlier run left in `dirpath` (default: the new one gets `-v1`).
        save_weights_only: accepted; every checkpoint holds weights and optimizer state so that it resumes
            exactly (`lightspeed.consolidate` writes the weights alone).
    The arguments are Lightning's, in its order.
    """

    def __init__(self, dirpath: str | Path | None = None, filename: str | None = None, monitor: str | None = None,
                 verbose: bool = False, save_last: bool | None = None, save_top_k: int = 1,
                 save_weights_only: bool = False, mode: Literal["min", "max"] = "min",
                 auto_insert_metric_name: bool = True, every_n_train_steps: int | None = None,
                 train_time_interval: Any = None, every_n_epochs: int | None = None,
                 save_on_train_epoch_end: bool | None = None, enable_version_counter: bool = True):
        _check_mode(mode)
        if save_top_k < -1:
            raise ConfigError(f"save_top_k={save_top_k!r} is not valid: use -1 (all), 0 or a positive count.")
        for name, n in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
            if n is not None and n < 0:
                raise ConfigError(f"{name}={n!r} is not valid: use None or a count ≥ 0.")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename or "{epoch}-{step}"
        self.auto_insert_metric_name = auto_insert_metric_name
        self.monitor, self.mode, self.save_top_k, self.save_last = monitor, mode, save_top_k, save_last
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = parse_duration("train_time_interval", train_time_interval)
        self.every_n_epochs = every_n_epochs if every_n_epochs is not None else (
            0 if self.every_n_train_steps or self.train_time_interval else 1)
        self.verbose, self.save_weights_only, self.save_on_train_epoch_end = verbose, save_weights_only, \
            save_on_train_epoch_end
        self.enable_version_counter = enable_version_counter
        self._agreed, self._time_mark = AgreedMax(), 0.0
        self.best_k: dict[str, float] = {}  # path -> score
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1
        self._last_only: str | None = None  # the newest save when kept only as `last`, not among the top k
        self._earlier_runs: set[str] = set()  # names an earlier run left in dirpath: never overwritten

    @property
    def state_key(self) -> str:
        return f"ModelCheckpoint{{monitor={self.monitor},mode={self.mode}}}"

    def setup(self, trainer, module, stage) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"
        if stage == "fit":
            self._earlier_runs = {p.name for p in self.dirpath.iterdir()} if self.dirpath.is_dir() else set()

    def on_train_start(self, trainer, module) -> None:
        self._agreed.reset()
        self._time_mark = time.monotonic()
        if self.save_weights_only and trainer.is_global_zero:
            trainer.print0("ModelCheckpoint(save_weights_only=True): lightspeed checkpoints keep the optimizer "
                           "state too, so that they resume exactly; lightspeed.consolidate writes the weights alone.")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0 and trainer.global_step != self._last_saved_step:
            self._save(trainer)
        if self.train_time_interval is not None:  # rank 0's clock decides for every rank
            due = trainer.is_global_zero and time.monotonic() - self._time_mark >= \
                self.train_time_interval.total_seconds()
            if self._agreed(int(due)) and trainer.global_step != self._last_saved_step:
                self._time_mark = time.monotonic()
                self._save(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.save_on_train_epoch_end is not False:
            self._every_n_epochs(trainer)

    def on_validation_end(self, trainer, module) -> None:
        if self.save_on_train_epoch_end is False and trainer.fitting and not trainer.sanity_checking:
            self._every_n_epochs(trainer)

    def _every_n_epochs(self, trainer: Trainer) -> None:
        n = self.every_n_epochs
        if n and (trainer.current_epoch + 1) % n == 0 and trainer.global_step != self._last_saved_step:
            self._save(trainer)

    def _decide(self, trainer: Trainer) -> tuple:
        """(error message or None, keep among the top k, path, score), from this rank's metrics."""
        metrics = trainer.callback_metrics
        score = None
        if self.monitor is not None:
            if self.monitor not in metrics:
                return (f"ModelCheckpoint(monitor={self.monitor!r}) was not logged: logged metrics are "
                        f"{sorted(metrics)}.", False, None, None)
            score = float(metrics[self.monitor])
        values = {"epoch": trainer.current_epoch, "step": trainer.global_step, **{k: float(v) for k, v in metrics.items()}}
        try:
            name = format_checkpoint_name(self.filename, values, self.auto_insert_metric_name)
        except ConfigError as e:
            return str(e), False, None, None
        path = self.dirpath / name
        if name in self._earlier_runs and self.enable_version_counter:  # a fresh run: keep the earlier one
            path = unused_name(path)
        keep = self.save_top_k != 0 and (self.monitor is None or self.save_top_k == -1 or
                                         len(self.best_k) < self.save_top_k or
                                         _improved(score, self._worst(), self.mode))
        return None, keep, path, score

    def _save(self, trainer: Trainer) -> None:
        # Rank 0 decides for every rank: metrics differ between ranks (a val_loss logged without sync_dist), but
        # saving is collective and every rank must write into the same directory.
        error, keep, path, score = broadcast_from_rank0(self._decide(trainer) if trainer.is_global_zero else None)
        if error:
            raise ConfigError(error)
        self._last_saved_step = trainer.global_step
        if not keep and not self.save_last:
            return
        trainer.save_checkpoint(path)  # also moves `last` here, once the save is complete
        self.last_model_path = str(path)
        if keep:
            self.best_k[str(path)] = score if score is not None else float(trainer.global_step)
            self._prune(trainer, current=str(path))
        self._drop_previous_last_only(trainer, None if keep else str(path))
        if self.verbose:
            what = ""
            if self.monitor is not None:
                what = f"{self.monitor!r} reached {score:.6g} (best {self.best_model_score:.6g}), " if keep else \
                    f"{self.monitor!r} was not in the top {self.save_top_k}, "
            trainer.print0(f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: {what}saved {path}")

    def _drop_previous_last_only(self, trainer, last_only: str | None) -> None:
        # A directory kept only as `last` goes once `last` points elsewhere, whether at a new best or a newer
        # last-only one.
        prev = self._last_only
        if trainer.is_global_zero and prev and prev not in self.best_k and prev != last_only:
            shutil.rmtree(prev, ignore_errors=True)
        self._last_only = last_only

    def _worst(self) -> float | None:
        if not self.best_k:
            return None
        return (max if self.mode == "min" else min)(self.best_k.values())

    def _prune(self, trainer: Trainer, current: str) -> None:
        if self.monitor is None:
            # Without a monitor, "best" means most recent: scores are global steps, keep the highest.
            order = sorted(self.best_k, key=self.best_k.get, reverse=True)
        else:
            order = sorted(self.best_k, key=self.best_k.get, reverse=(self.mode == "max"))
        if self.save_top_k > 0:
            for stale in order[self.save_top_k:]:
                del self.best_k[stale]
                if trainer.is_global_zero and stale != current:
                    shutil.rmtree(stale, ignore_errors=True)
            order = order[: self.save_top_k]
        self.best_model_path = order[0]
        self.best_model_score = self.best_k[order[0]] if self.monitor is not None else None

    def state_dict(self) -> dict:
        return {"best_k": self.best_k, "best_model_path": self.best_model_path,
                "best_model_score": self.best_model_score, "last_model_path": self.last_model_path,
                "dirpath": str(self.dirpath), "last_saved_step": self._last_saved_step}

    def load_state_dict(self, state: dict) -> None:
        self.best_k = dict(state.get("best_k", {}))
        self.best_model_path = state.get("best_model_path", "")
        self.best_model_score = state.get("best_model_score")
        self.last_model_path = state.get("last_model_path", "")
        self._earlier_runs = set()  # a resumed run continues its own line of checkpoints
        # Without it, a resumed run's epoch-end trigger would save again the step the checkpoint was taken at.
        self._last_saved_step = state.get("last_saved_step", -1)


class EarlyStopping(Callback):
    """Stops fit when `monitor` has not improved by more than `min_delta` for `patience` checks; at once when it
    is NaN/Inf (`check_finite`), reaches `stopping_threshold` or passes `divergence_threshold` the wrong way.

    Lightning's arguments, in its order. Checked after each validation during fit, or at the training epoch's end
    (`check_on_train_epoch_end=True`; None: there only when fit validates nothing). `strict=False` lets a metric
    that was never logged pass (said once) instead of raising. `verbose` says each improvement. Rank 0's value
    decides for every rank. `log_rank_zero_only` is accepted: only rank 0 prints anyway."""

    def __init__(self, monitor: str, min_delta: float = 0.0, patience: int = 3, verbose: bool = False,
                 mode: Literal["min", "max"] = "min", strict: bool = True, check_finite: bool = True,
                 stopping_threshold: float | None = None, divergence_threshold: float | None = None,
                 check_on_train_epoch_end: bool | None = None, log_rank_zero_only: bool = False):
        _check_mode(mode)
        if patience < 0:
            raise ConfigError(f"patience={patience!r} is not valid: use a count ≥ 0.")
        self.monitor, self.patience, self.mode, self.min_delta = monitor, patience, mode, abs(min_delta)
        self.verbose, self.strict, self.check_finite = verbose, strict, check_finite
        self.stopping_threshold, self.divergence_threshold = stopping_threshold, divergence_threshold
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.best: float | None = None
        self.wait = 0
        self.stopped_epoch = -1
        self._at_epoch_end = bool(check_on_train_epoch_end)
        self._said_missing = False

    def on_fit_start(self, trainer, module) -> None:
        if self.check_on_train_epoch_end is None:  # Lightning's rule: the epoch's end when nothing is validated
            self._at_epoch_end = not any(n for n in trainer.num_val_batches)

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor},mode={self.mode}}}"

    def on_validation_end(self, trainer, module) -> None:
        if not self._at_epoch_end and trainer.fitting:  # not for a standalone trainer.validate()
            self._check(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        if self._at_epoch_end:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        # Rank 0's value decides for every rank (as Lightning reduces the decision): ranks that stopped at
        # different epochs would leave the others waiting in a collective.
        metrics = trainer.callback_metrics
        value = float(metrics[self.monitor]) if self.monitor in metrics else None
        current = broadcast_from_rank0(value if trainer.is_global_zero else None)
        if current is None:
            missing = f"EarlyStopping(monitor={self.monitor!r}) was not logged: logged metrics are {sorted(metrics)}"
            if self.strict:
                raise ConfigError(missing + ".")
            if not self._said_missing:
                self._said_missing = True
                trainer.print0(missing + "; strict=False, so it is not checked.")
            return
        reason = self._stop_reason(current)
        if reason is not None:
            self.stopped_epoch = trainer.current_epoch
            trainer.should_stop = True
            trainer.print0(f"EarlyStopping: {reason}; stopping.")
        elif self.verbose and self.wait == 0:
            trainer.print0(f"EarlyStopping: {self.monitor} improved to {current:.6g}.")

    def _stop_reason(self, current: float) -> str | None:
        """Why to stop now (Lightning's order of checks), or None; counts a check without improvement."""
        beats = (lambda a, b: a < b) if self.mode == "min" else (lambda a, b: a > b)
        if self.check_finite and not math.isfinite(current):
            return f"{self.monitor} = {current} is not finite (best {self.best})"
        if self.stopping_threshold is not None and beats(current, self.stopping_threshold):
            return f"{self.monitor} = {current:.6g} reached stopping_threshold={self.stopping_threshold}"
        if self.divergence_threshold is not None and beats(self.divergence_threshold, current):
            return f"{self.monitor} = {current:.6g} passed divergence_threshold={self.divergence_threshold}"
        if _improved(current, self.best, self.mode, self.min_delta):
            self.best, self.wait = current, 0
            return None
        self.wait += 1
        if self.wait >= self.patience:
            return f"{self.monitor} did not improve for {self.wait} checks (best {self.best:.6g})"
        return None

    def state_dict(self) -> dict:
        return {"best": self.best, "wait": self.wait, "stopped_epoch": self.stopped_epoch}

    def load_state_dict(self, state: dict) -> None:
        self.best, self.wait, self.stopped_epoch = state["best"], state["wait"], state["stopped_epoch"]


class ModelSummary(Callback):
    """Lightning's ModelSummary: the summary printed at fit start lists modules down to `max_depth` (1: the
    top-level children, -1: all, 0: no summary). Given as a callback, it prints even with
    `enable_model_summary=False`, as in Lightning."""

    def __init__(self, max_depth: int = 1, **summarize_kwargs: Any):
        if not isinstance(max_depth, int) or max_depth < -1:
            raise ConfigError(f"max_depth={max_depth!r} is not valid: use -1 (every level), 0 (no summary) or a "
                              "depth ≥ 1.")
        self.max_depth = max_depth


class RichModelSummary(ModelSummary):
    """Lightning's rich-table summary: lightspeed's summary is a rich table already."""


class RichProgressBar(Callback):
    """Lightning's progress-bar callbacks: lightspeed draws its one rich bar (epoch, step, loss, prog_bar metrics,
    it/s, ETA) whichever is given; `refresh_rate=0` turns it off. The bar redraws by time, not every
    `refresh_rate` batches; the other arguments are accepted for the port."""

    is_progress_bar = True

    def __init__(self, refresh_rate: int = 1, leave: bool = False, theme: Any = None, console_kwargs: Any = None):
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ConfigError(f"refresh_rate={refresh_rate!r} is not valid: expected an integer ≥ 0 (0: no bar).")
        self.refresh_rate, self.leave = refresh_rate, leave


class TQDMProgressBar(RichProgressBar):
    """Lightning's default bar, ported as RichProgressBar (lightspeed draws with rich)."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False):
        super().__init__(refresh_rate, leave)


class Timer(Callback):
    """Stops fit once training has run for `duration` (Lightning's Timer; `Trainer(max_time=...)` adds one).

    `duration`: "DD:HH:MM:SS", a timedelta or a dict of its keywords; None only measures. Checked after every
    optimizer step (`interval="step"`) or training epoch ("epoch"). Rank 0's clock decides for every rank: after
    a step through `distributed.AgreedMax` (under NCCL one step later, so the host never waits for the GPU),
    after an epoch through a broadcast. Stopping waits for `min_epochs` / `min_steps`, as any requested stop.
    The time trained so far travels in checkpoints, so a resumed run counts the time before it.
    `time_elapsed()`, `time_remaining()`, `start_time()` and `end_time()` take the stage "train" (the default)."""

    def __init__(self, duration: Any = None, interval: Literal["step", "epoch"] = "step", verbose: bool = True):
        self.duration = parse_duration("duration", duration)
        if interval not in ("step", "epoch"):
            raise ConfigError(f"interval={interval!r} is not valid: use 'step' or 'epoch'.")
        self.interval, self.verbose = interval, verbose
        self._start: float | None = None
        self._end: float | None = None
        self._offset = 0.0  # seconds trained before this run (from a checkpoint)
        self._agreed = AgreedMax()
        self._said = False

    @staticmethod
    def _stage(stage: str) -> None:
        if stage != "train":
            raise ConfigError(f"stage={stage!r} is not valid: lightspeed's Timer measures the stage 'train'.")

    def start_time(self, stage: str = "train") -> float | None:
        """`time.monotonic()` when training started in this run, or None before."""
        self._stage(stage)
        return self._start

    def end_time(self, stage: str = "train") -> float | None:
        """`time.monotonic()` when training ended in this run, or None while it runs."""
        self._stage(stage)
        return self._end

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds of training, those before a resume included."""
        self._stage(stage)
        if self._start is None:
            return self._offset
        return self._offset + (self._end if self._end is not None else time.monotonic()) - self._start

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of `duration` (None without one)."""
        return None if self.duration is None else self.duration.total_seconds() - self.time_elapsed(stage)

    def on_train_start(self, trainer, module) -> None:
        self._start, self._end, self._said = time.monotonic(), None, False
        self._agreed.reset()

    def on_train_end(self, trainer, module) -> None:
        self._end = time.monotonic()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.interval == "step" and self.duration is not None:
            self._stop_if(trainer, self._agreed(int(trainer.is_global_zero and self.time_remaining() <= 0)))

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.interval == "epoch" and self.duration is not None:
            self._stop_if(trainer, broadcast_from_rank0(trainer.is_global_zero and self.time_remaining() <= 0))

    def _stop_if(self, trainer, expired: Any) -> None:
        if not expired:
            return
        trainer.should_stop = True
        if self.verbose and not self._said:
            self._said = True
            trainer.print0(f"Timer: the time limit {self.duration} was reached at step {trainer.global_step} "
                           f"({self.time_elapsed():.0f} s trained); stopping.")

    def state_dict(self) -> dict:
        return {"time_elapsed": {"train": self.time_elapsed()}}

    def load_state_dict(self, state: dict) -> None:
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))


class LearningRateMonitor(Callback):
    """Logs each param group's learning rate (`lr-<Optimizer>[/pg<i>]`) every step or epoch."""

    def __init__(self, logging_interval: Literal["step", "epoch"] | None = None, log_momentum: bool = False,
                 log_weight_decay: bool = False):
        if logging_interval not in (None, "step", "epoch"):
            raise ConfigError(f"logging_interval={logging_interval!r} is not valid: use None, 'step' or 'epoch'.")
        self.logging_interval, self.log_momentum, self.log_weight_decay = logging_interval, log_momentum, \
            log_weight_decay
        self._last_step = -1
        self.lrs: dict[str, list[float]] = {}  # every value logged, by key (Lightning's attribute)

    def _values(self, trainer: Trainer) -> dict[str, float]:
        out: dict[str, float] = {}
        names = {id(c.scheduler.optimizer): c.name for c in trainer.strategy.schedulers if c.name}
        for i, opt in enumerate(trainer.strategy.optimizers):
            inner = opt
            while hasattr(inner, "optimizer"):  # DeepSpeed's wrappers: the key names the user's optimizer class
                inner = inner.optimizer
            base = names.get(id(inner)) or names.get(id(opt)) or (
                f"lr-{type(inner).__name__}" + (f"-{i}" if len(trainer.strategy.optimizers) > 1 else ""))
            groups = opt.param_groups
            for j, group in enumerate(groups):
                key = base if len(groups) == 1 else f"{base}/pg{j + 1}"
                lr = group["lr"]
                out[key] = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
                self.lrs.setdefault(key, []).append(out[key])
                if self.log_momentum and "betas" in group:
                    out[key.replace("lr-", "momentum-", 1)] = float(group["betas"][0])
                elif self.log_momentum and "momentum" in group:
                    out[key.replace("lr-", "momentum-", 1)] = float(group["momentum"])
                if self.log_weight_decay and "weight_decay" in group:  # Lightning's key: <lr key>-weight_decay
                    out[f"{key}-weight_decay"] = float(group["weight_decay"])
        return out

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.logging_interval == "epoch" or trainer.global_step == self._last_step:
            return
        self._last_step = trainer.global_step
        if self.logging_interval is None and not trainer.is_log_step():
            return
        trainer.log_metrics(self._values(trainer))

    def on_train_epoch_start(self, trainer, module) -> None:
        if self.logging_interval in (None, "epoch"):
            trainer.log_metrics(self._values(trainer))
