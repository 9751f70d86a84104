"""EarlyStopping: stop when a monitored metric stops improving, agreed across ranks."""

from __future__ import annotations

import math
from typing import Literal

from lightspeed.callbacks.callback import Callback
from lightspeed.callbacks.monitor import _check_mode, _improved
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import broadcast_from_rank0
from lightspeed.specs import TrainerView as Trainer


class EarlyStopping(Callback):
    """Stops fit when `monitor` has not improved by more than `min_delta` for `patience` checks; at
    once when it is NaN/Inf (`check_finite`), reaches `stopping_threshold` or passes
    `divergence_threshold` the wrong way.

    Lightning's arguments, in its order. Checked after each validation during fit, or at the
    training epoch's end (`check_on_train_epoch_end=True`; None: there only when fit validates
    nothing). `strict=False` lets a metric that was never logged pass (said once) instead of
    raising. `verbose` says each improvement. Rank 0's value decides for every rank.
    `log_rank_zero_only` is accepted: only rank 0 prints anyway."""

    def __init__(
        self,
        monitor: str,
        min_delta: float = 0.0,
        patience: int = 3,
        verbose: bool = False,
        mode: Literal["min", "max"] = "min",
        strict: bool = True,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        check_on_train_epoch_end: bool | None = None,
        log_rank_zero_only: bool = False,
    ):
        _check_mode(mode)
        if patience < 0:
            raise ConfigError(f"patience={patience!r} is not valid: use a count ≥ 0.")
        self.monitor, self.patience, self.mode, self.min_delta = (
            monitor,
            patience,
            mode,
            abs(min_delta),
        )
        self.verbose, self.strict, self.check_finite = verbose, strict, check_finite
        self.stopping_threshold, self.divergence_threshold = (
            stopping_threshold,
            divergence_threshold,
        )
        self.check_on_train_epoch_end = check_on_train_epoch_end
        self.best: float | None = None
        self.wait = 0
        self.stopped_epoch = -1
        self._at_epoch_end = bool(check_on_train_epoch_end)
        self._said_missing = False

    def on_fit_start(self, trainer, module) -> None:
        if (
            self.check_on_train_epoch_end is None
        ):  # Lightning's rule: the epoch's end when nothing is validated
            self._at_epoch_end = not any(n for n in trainer.num_val_batches)

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{monitor={self.monitor},mode={self.mode}}}"

    def on_validation_end(self, trainer, module) -> None:
        # not for a standalone trainer.validate(), nor the sanity check's validation
        if not self._at_epoch_end and trainer.fitting and not trainer.sanity_checking:
            self._check(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        if self._at_epoch_end:
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        if trainer.fast_dev_run:  # a trial run of the code: it does not stop early
            return
        # Rank 0's value decides for every rank (as Lightning reduces the decision): ranks that
        # stopped at
        # different epochs would leave the others waiting in a collective.
        metrics = trainer.callback_metrics
        value = float(metrics[self.monitor]) if self.monitor in metrics else None
        current = broadcast_from_rank0(value if trainer.is_global_zero else None)
        if current is None:
            missing = (
                f"EarlyStopping(monitor={self.monitor!r}) was not logged: logged metrics are "
                f"{sorted(metrics)}"
            )
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
        """Why to stop now (Lightning's order of checks), or None; counts a check without
        improvement."""
        beats = (lambda a, b: a < b) if self.mode == "min" else (lambda a, b: a > b)
        if self.check_finite and not math.isfinite(current):
            return f"{self.monitor} = {current} is not finite (best {self.best})"
        if self.stopping_threshold is not None and beats(current, self.stopping_threshold):
            return (
                f"{self.monitor} = {current:.6g} reached "
                f"stopping_threshold={self.stopping_threshold}"
            )
        if self.divergence_threshold is not None and beats(self.divergence_threshold, current):
            return (
                f"{self.monitor} = {current:.6g} passed "
                f"divergence_threshold={self.divergence_threshold}"
            )
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
        self.best, self.wait, self.stopped_epoch = (
            state["best"],
            state["wait"],
            state["stopped_epoch"],
        )
