"""Timer: stop after a duration, and the time spent in each stage.

Trainer(callbacks=[Timer(duration="00:12:00:00")])     # or Trainer(max_time="00:12:00:00")
"""

from __future__ import annotations

import re
import time
from datetime import timedelta
from typing import Any, Literal

from lightspeed.callbacks.callback import Callback
from lightspeed.config import parse_duration
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import AgreedMax, broadcast_from_rank0
from lightspeed.utilities.rank_zero import rank_zero_info

STAGES = ("train", "validate", "test", "predict")


def duration_seconds(duration: Any) -> float | None:
    """`duration` ("DD:HH:MM:SS", a timedelta ≥ 0 or a dict of its keywords) in seconds; None for
    no limit. ConfigError otherwise."""
    if duration is None:
        return None
    if isinstance(duration, timedelta):
        if duration.total_seconds() < 0:
            raise ConfigError(f"`Timer(duration={duration!r})` is not valid: it is negative.")
        return duration.total_seconds()
    if isinstance(duration, str) and not re.fullmatch(r"\s*\d+:\d\d:\d\d:\d\d\s*", duration):
        raise ConfigError(
            f"`Timer(duration={duration!r})` is not a valid duration. Expected a string in the "
            "format DD:HH:MM:SS."
        )
    return parse_duration("duration", duration).total_seconds()  # type: ignore[union-attr]


class Timer(Callback):
    """Stops fit once training has run for `duration` (Lightning's Timer; `Trainer(max_time=...)`
    adds one).

    `duration`: "DD:HH:MM:SS", a timedelta or a dict of its keywords; None only measures. Checked at
    fit start (a resumed run whose time is spent stops before any step), then after every optimizer
    step (`interval="step"`) or training epoch ("epoch"). Rank 0's clock decides for every rank
    (a broadcast). Stopping waits for `min_epochs` / `min_steps`, as any requested stop. The time
    trained so far travels in checkpoints, so a resumed run counts the time before it.
    `time_elapsed(stage)`, `time_remaining(stage)`, `start_time(stage)` and `end_time(stage)` take
    "train" (the default), "validate", "test" or "predict"."""

    def __init__(
        self,
        duration: Any = None,
        interval: Literal["step", "epoch"] = "step",
        verbose: bool = True,
    ):
        if interval not in ("step", "epoch"):
            raise ConfigError(
                f"interval={interval!r} is not valid: use 'step' or 'epoch' (Unsupported parameter "
                f"value `Timer(interval={interval})`. Possible choices are: step, epoch)"
            )
        self._duration = duration_seconds(duration)
        self._interval, self._verbose = interval, verbose
        self._start_time: dict[str, float | None] = dict.fromkeys(STAGES)
        self._end_time: dict[str, float | None] = dict.fromkeys(STAGES)
        self._offset = 0.0  # seconds trained before this run (from a checkpoint)
        self._agreed = AgreedMax()  # after a step, without a host wait under NCCL (one step late)

    @property
    def duration(self) -> timedelta | None:
        return None if self._duration is None else timedelta(seconds=self._duration)

    @staticmethod
    def _stage(stage: str) -> str:
        if stage not in STAGES:
            raise ConfigError(f"stage={stage!r} is not valid: use one of {', '.join(STAGES)}.")
        return stage

    def start_time(self, stage: str = "train") -> float | None:
        """`time.monotonic()` when `stage` started in this run, or None before."""
        return self._start_time[self._stage(stage)]

    def end_time(self, stage: str = "train") -> float | None:
        """`time.monotonic()` when `stage` ended in this run, or None while it runs."""
        return self._end_time[self._stage(stage)]

    def time_elapsed(self, stage: str = "train") -> float:
        """Seconds spent in `stage` (training: those before a resume included)."""
        start, end = self.start_time(stage), self.end_time(stage)
        offset = self._offset if stage == "train" else 0.0
        if start is None:
            return offset
        return offset + (end if end is not None else time.monotonic()) - start

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of `duration` (None without one)."""
        return None if self._duration is None else self._duration - self.time_elapsed(stage)

    def _started(self, stage: str) -> None:
        self._start_time[stage], self._end_time[stage] = time.monotonic(), None

    def _ended(self, stage: str) -> None:
        self._end_time[stage] = time.monotonic()

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self._started("train")
        self._agreed.reset()

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self._ended("train")

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        self._started("validate")

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self._ended("validate")

    def on_test_start(self, trainer: Any, module: Any) -> None:
        self._started("test")

    def on_test_end(self, trainer: Any, module: Any) -> None:
        self._ended("test")

    def on_predict_start(self, trainer: Any, module: Any) -> None:
        self._started("predict")

    def on_predict_end(self, trainer: Any, module: Any) -> None:
        self._ended("predict")

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        # after a resume's state is loaded: a run whose time is spent stops before its first step
        if self._duration is not None:
            self._check_time_remaining(trainer)

    def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
        if self._interval == "step" and self._duration is not None:
            spent = trainer.is_global_zero and self.time_elapsed() >= self._duration
            self._stop_if(trainer, self._agreed(int(spent)))

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        if self._interval == "epoch" and self._duration is not None:
            self._check_time_remaining(trainer)

    def _check_time_remaining(self, trainer: Any) -> None:
        spent = self.time_elapsed() >= (self._duration or 0)
        self._stop_if(trainer, broadcast_from_rank0(spent))  # rank 0's clock decides

    def _stop_if(self, trainer: Any, expired: Any) -> None:
        if not expired:
            return
        if self._verbose and not trainer.should_stop:
            elapsed = timedelta(seconds=int(self.time_elapsed()))
            rank_zero_info(
                f"Time limit reached. Elapsed time is {elapsed}. Signaling Trainer to stop."
            )
            trainer.print0(
                f"Timer: the time limit {self.duration} was reached at step {trainer.global_step} "
                f"({self.time_elapsed():.0f} s trained); stopping."
            )
        trainer.should_stop = True

    def state_dict(self) -> dict:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in STAGES}}

    def load_state_dict(self, state: dict) -> None:
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))
