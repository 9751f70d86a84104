"""GradientAccumulationScheduler: how many batches each optimizer step accumulates, by epoch.

    Trainer(callbacks=[GradientAccumulationScheduler({0: 8, 4: 4, 8: 1})])   # 8 until epoch 4, ...

It sets `trainer.accumulate_grad_batches` at each training epoch's start, which the loop reads
when it groups that epoch's batches into optimizer steps. DeepSpeed fixes the accumulation in its
engine, so there (as in Lightning) the schedule is refused; so is manual optimization, where the
user accumulates.
"""

from __future__ import annotations

from typing import Any

from lightspeed.callbacks.callback import Callback
from lightspeed.core.module import Module
from lightspeed.errors import ConfigError
from lightspeed.utilities.rank_zero import rank_zero_warn


class GradientAccumulationScheduler(Callback):
    """`scheduling`: {first epoch: accumulation factor}; before the first key the factor is 1.

    Raises ConfigError for an epoch that is not an int ≥ 0 or a factor that is not an int ≥ 1."""

    def __init__(self, scheduling: dict[int, int]) -> None:
        if not scheduling:
            raise TypeError("Empty dict cannot be interpreted correct")
        if any(not isinstance(k, int) or isinstance(k, bool) or k < 0 for k in scheduling):
            raise ConfigError(
                f"Epoch should be an int greater than or equal to 0. Got {list(scheduling)}."
            )
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in scheduling.values()):
            raise ConfigError(
                "Accumulation factor should be an int greater than 0. Got "
                f"{list(scheduling.values())}."
            )
        self.scheduling = dict(sorted(scheduling.items()))
        if 0 not in self.scheduling:
            self.scheduling = {0: 1, **self.scheduling}

    def going_to_accumulate_grad_batches(self) -> bool:
        return any(v > 1 for v in self.scheduling.values())

    def get_accumulate_grad_batches(self, epoch: int) -> int:
        """The factor for `epoch`: the value of the last key ≤ `epoch`."""
        return next(v for k, v in reversed(self.scheduling.items()) if k <= epoch)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not self.going_to_accumulate_grad_batches():
            return
        if getattr(trainer, "accumulate_grad_batches", 1) != 1:
            raise ValueError(
                "You have set `accumulate_grad_batches` and are using the "
                "`GradientAccumulationScheduler` callback. Either remove `accumulate_grad_batches` "
                "from the Trainer or remove the callback."
            )
        if not pl_module.automatic_optimization:
            raise RuntimeError(
                "Automatic gradient accumulation and the `GradientAccumulationScheduler` is not "
                "supported for manual optimization. Please remove the callback or switch to "
                "automatic optimization."
            )
        overridden = [
            name
            for name in ("optimizer_step", "optimizer_zero_grad")
            if getattr(type(pl_module), name, None) is not getattr(Module, name, None)
        ]
        if overridden:
            rank_zero_warn(
                f"The model overrides {', '.join(overridden)}: when accumulating gradients with "
                "the `GradientAccumulationScheduler`, the hooks will not be called on every batch."
            )
        if str(getattr(trainer.strategy, "name", "")).startswith("deepspeed"):
            raise RuntimeError(
                f"The `{type(trainer.strategy).__name__}` does not support "
                "`accumulate_grad_batches` changing between epochs: DeepSpeed fixes it in its "
                "engine. Pass one `accumulate_grad_batches` to the Trainer instead."
            )

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        trainer.accumulate_grad_batches = self.get_accumulate_grad_batches(trainer.current_epoch)
