"""LearningRateMonitor: each optimizer's learning rate (and momentum, weight decay) to the
loggers."""

from __future__ import annotations

from typing import Literal

import torch

from lightspeed.callbacks.callback import Callback
from lightspeed.errors import ConfigError
from lightspeed.specs import TrainerView as Trainer


class LearningRateMonitor(Callback):
    """Logs each param group's learning rate (`lr-<Optimizer>[/pg<i>]`) every step or epoch."""

    def __init__(
        self,
        logging_interval: Literal["step", "epoch"] | None = None,
        log_momentum: bool = False,
        log_weight_decay: bool = False,
    ):
        if logging_interval not in (None, "step", "epoch"):
            raise ConfigError(
                f"logging_interval={logging_interval!r} is not valid: use None, 'step' or 'epoch'."
            )
        self.logging_interval, self.log_momentum, self.log_weight_decay = (
            logging_interval,
            log_momentum,
            log_weight_decay,
        )
        self._last_step = -1
        self.lrs: dict[str, list[float]] = {}  # every value logged, by key (Lightning's attribute)

    def _values(self, trainer: Trainer) -> dict[str, float]:
        out: dict[str, float] = {}
        names = {id(c.scheduler.optimizer): c.name for c in trainer.strategy.schedulers if c.name}
        for i, opt in enumerate(trainer.strategy.optimizers):
            inner = opt
            while hasattr(
                inner, "optimizer"
            ):  # DeepSpeed's wrappers: the key names the user's optimizer class
                inner = inner.optimizer
            base = (
                names.get(id(inner))
                or names.get(id(opt))
                or (
                    f"lr-{type(inner).__name__}"
                    + (f"-{i}" if len(trainer.strategy.optimizers) > 1 else "")
                )
            )
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
                if (
                    self.log_weight_decay and "weight_decay" in group
                ):  # Lightning's key: <lr key>-weight_decay
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
