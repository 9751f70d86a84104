"""Timer: stop after a duration, and the time spent in each stage."""

from __future__ import annotations

import time
from typing import Any, Literal

from lightspeed.callbacks.callback import Callback
from lightspeed.config import parse_duration
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import AgreedMax, broadcast_from_rank0


class Timer(Callback):
    """Stops fit once training has run for `duration` (Lightning's Timer; `Trainer(max_time=...)`
    adds one).

    `duration`: "DD:HH:MM:SS", a timedelta or a dict of its keywords; None only measures. Checked
    after every optimizer step (`interval="step"`) or training epoch ("epoch"). Rank 0's clock
    decides for every rank: after a step through `distributed.AgreedMax` (under NCCL one step later,
    so the host never waits for the GPU), after an epoch through a broadcast. Stopping waits for
    `min_epochs` / `min_steps`, as any requested stop. The time trained so far travels in
    checkpoints, so a resumed run counts the time before it. `time_elapsed()`, `time_remaining()`,
    `start_time()` and `end_time()` take the stage "train" (the default)."""

    def __init__(
        self,
        duration: Any = None,
        interval: Literal["step", "epoch"] = "step",
        verbose: bool = True,
    ):
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
            raise ConfigError(
                f"stage={stage!r} is not valid: lightspeed's Timer measures the stage 'train'."
            )

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
        return (
            self._offset + (self._end if self._end is not None else time.monotonic()) - self._start
        )

    def time_remaining(self, stage: str = "train") -> float | None:
        """Seconds left of `duration` (None without one)."""
        return (
            None
            if self.duration is None
            else self.duration.total_seconds() - self.time_elapsed(stage)
        )

    def on_train_start(self, trainer, module) -> None:
        self._start, self._end, self._said = time.monotonic(), None, False
        self._agreed.reset()

    def on_train_end(self, trainer, module) -> None:
        self._end = time.monotonic()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if self.interval == "step" and self.duration is not None:
            self._stop_if(
                trainer, self._agreed(int(trainer.is_global_zero and self.time_remaining() <= 0))
            )

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.interval == "epoch" and self.duration is not None:
            self._stop_if(
                trainer, broadcast_from_rank0(trainer.is_global_zero and self.time_remaining() <= 0)
            )

    def _stop_if(self, trainer, expired: Any) -> None:
        if not expired:
            return
        trainer.should_stop = True
        if self.verbose and not self._said:
            self._said = True
            trainer.print0(
                f"Timer: the time limit {self.duration} was reached at step {trainer.global_step} "
                f"({self.time_elapsed():.0f} s trained); stopping."
            )

    def state_dict(self) -> dict:
        return {"time_elapsed": {"train": self.time_elapsed()}}

    def load_state_dict(self, state: dict) -> None:
        self._offset = float(state.get("time_elapsed", {}).get("train", 0.0))
