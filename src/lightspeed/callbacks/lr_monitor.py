"""LearningRateMonitor: each optimizer's learning rate (and momentum, weight decay) to the loggers,
under Lightning's names.

    Trainer(callbacks=[LearningRateMonitor(logging_interval="step")])

Names: `lr-<Optimizer class>` (the scheduler's `name` when given); a second optimizer of the same
class adds `-1`, a third `-2`; several param groups add `/<group name>` (`/pg1`, `/pg2`, ... when
unnamed). Momentum is logged as `<name>-momentum` (Adam's first beta), weight decay as
`<name>-weight_decay`. With `logging_interval=None` each scheduler is logged at its own interval
(the optimizers without one at every log step and epoch start); "step" or "epoch" logs every
optimizer then. The values also go to `trainer.callback_metrics`, so EarlyStopping can watch them.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Literal

import torch

from lightspeed.callbacks.callback import Callback
from lightspeed.errors import ConfigError
from lightspeed.utilities.rank_zero import rank_zero_warn


def _user_optimizer(optimizer: Any) -> Any:
    """The user's optimizer behind DeepSpeed's wrappers (the key names the user's class)."""
    while hasattr(optimizer, "optimizer") and hasattr(optimizer.optimizer, "param_groups"):
        optimizer = optimizer.optimizer
    return optimizer


class LearningRateMonitor(Callback):
    """Logs each param group's learning rate every log step or epoch (see the module docstring)."""

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
        self.logging_interval = logging_interval
        self.log_momentum, self.log_weight_decay = log_momentum, log_weight_decay
        self.lrs: dict[str, list[float]] = {}  # every value logged, by name
        self.last_momentum_values: dict[str, float | None] = {}
        self.last_weight_decay_values: dict[str, float | None] = {}
        self._last_step = -1

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if not trainer.loggers:
            raise ConfigError(
                "Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger."
            )
        if self.log_momentum and not all(
            "momentum" in opt.defaults or "betas" in opt.defaults
            for opt in map(_user_optimizer, trainer.optimizers)
        ):
            rank_zero_warn(
                "You have set log_momentum=True, but some optimizers do not have momentum. This "
                "will log a value 0 for the momentum.",
                category=RuntimeWarning,
            )
        names = [n for _, group_names in self._named(trainer) for n in group_names]
        self.lrs = {name: [] for name in names}
        self.last_momentum_values = {f"{name}-momentum": None for name in names}
        self.last_weight_decay_values = {f"{name}-weight_decay": None for name in names}

    def _named(self, trainer: Any) -> list[tuple[Any, list[str]]]:
        """(optimizer, the names of its param groups), the scheduled optimizers first, in the
        order of their schedulers, then the others. Raises ConfigError for two param groups of
        one optimizer with the same `name`."""
        named: list[tuple[Any, list[str]]] = []
        seen: Counter = Counter()
        configs = list(trainer.lr_scheduler_configs)
        scheduled = [(_user_optimizer(c.scheduler.optimizer), c.name) for c in configs]
        held = {id(opt) for opt, _ in scheduled}
        rest = [
            (opt, None) for opt in map(_user_optimizer, trainer.optimizers) if id(opt) not in held
        ]
        for optimizer, given in scheduled + rest:
            name = given or f"lr-{type(optimizer).__name__}"
            if not given:
                seen[type(optimizer)] += 1
                name += f"-{seen[type(optimizer)] - 1}" if seen[type(optimizer)] > 1 else ""
            groups = optimizer.param_groups
            labels = [g.get("name") for g in groups]
            duplicates = sorted({x for x in labels if x is not None and labels.count(x) > 1})
            if duplicates:
                raise ConfigError(
                    "A single `Optimizer` cannot have multiple parameter groups with identical "
                    f"`name` values. {name} has duplicated parameter group names {duplicates}"
                )
            if len(groups) > 1:
                names = [f"{name}/{label or f'pg{i + 1}'}" for i, label in enumerate(labels)]
            else:
                names = [f"{name}/{labels[0]}" if labels[0] else name]
            named.append((optimizer, names))
        return named

    def _stats(self, trainer: Any, interval: str) -> dict[str, float]:
        """The values to log now: the schedulers of `interval` ("any": all) and every optimizer
        without a scheduler."""
        intervals = {
            id(_user_optimizer(c.scheduler.optimizer)): c.interval
            for c in trainer.lr_scheduler_configs
        }
        out: dict[str, float] = {}
        named = self._named(trainer)
        for name in (n for _, names in named for n in names):
            if name not in self.lrs:  # a group added to a one-group optimizer: "x" becomes "x/pg1"
                old = name.replace("/pg1", "")
                self.lrs[name] = self.lrs.pop(old) if old != name and old in self.lrs else []
        for optimizer, names in named:
            own = intervals.get(id(optimizer))
            if own is not None and interval not in (own, "any"):
                continue
            betas = "betas" in optimizer.defaults
            for group, name in zip(optimizer.param_groups, names):
                lr = group["lr"]
                out[name] = float(lr.item() if isinstance(lr, torch.Tensor) else lr)
                self.lrs[name].append(out[name])
                if self.log_momentum:
                    momentum = group["betas"][0] if betas else group.get("momentum", 0)
                    out[f"{name}-momentum"] = self.last_momentum_values[f"{name}-momentum"] = float(
                        momentum
                    )
                if self.log_weight_decay:
                    decay = float(group.get("weight_decay", 0))
                    out[f"{name}-weight_decay"] = decay
                    self.last_weight_decay_values[f"{name}-weight_decay"] = decay
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in out.items()})
        return out

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        # Before the step, as Lightning: the rate the coming step uses, on the steps that log.
        step = trainer.global_step
        if self.logging_interval == "epoch" or step == self._last_step:
            return
        if (step + 1) % trainer.log_every_n_steps:
            return
        self._last_step = step
        stats = self._stats(trainer, "step" if self.logging_interval is None else "any")
        if stats:
            trainer.log_metrics(stats)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.logging_interval == "step":
            return
        stats = self._stats(trainer, "epoch" if self.logging_interval is None else "any")
        if stats:
            trainer.log_metrics(stats)
