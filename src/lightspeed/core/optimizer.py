"""Parsing the return forms of `configure_optimizers` that Lightning users know."""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.errors import ConfigError
from lightspeed.specs import SchedulerConfig

_FORMS = (
    "an optimizer; a list of optimizers; ([optimizers], [schedulers]); "
    "{'optimizer': o, 'lr_scheduler': s or {'scheduler': s, 'interval': 'step'|'epoch', "
    "'frequency': n, "
    "'monitor': key}}; or a list of such dicts"
)


def _is_optimizer(x: Any) -> bool:
    # DeepSpeed's optimizers do not subclass torch's; anything with step/zero_grad/param_groups will
    # do.
    return isinstance(x, torch.optim.Optimizer) or all(
        hasattr(x, a) for a in ("step", "zero_grad", "param_groups")
    )


def _scheduler(entry: Any) -> SchedulerConfig:
    if isinstance(entry, dict):
        if "scheduler" not in entry:
            raise ConfigError(
                "configure_optimizers returned an lr_scheduler dict without 'scheduler': "
                f"{entry!r}."
            )
        cfg = SchedulerConfig(
            entry["scheduler"],
            entry.get("interval", "epoch"),
            entry.get("frequency", 1),
            entry.get("monitor"),
            entry.get("name"),
        )
    else:
        cfg = SchedulerConfig(entry)
    if cfg.interval not in ("step", "epoch"):
        raise ConfigError(
            f"lr_scheduler interval={cfg.interval!r} is not valid: use 'step' or 'epoch'."
        )
    if not isinstance(cfg.frequency, int) or cfg.frequency < 1:
        raise ConfigError(
            f"lr_scheduler frequency={cfg.frequency!r} is not valid: expected an integer ≥ 1."
        )
    if not hasattr(cfg.scheduler, "step"):
        raise ConfigError(
            f"lr_scheduler={cfg.scheduler!r} is not valid: expected a torch LR scheduler."
        )
    if (
        isinstance(cfg.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        and cfg.monitor is None
    ):
        raise ConfigError(
            "lr_scheduler ReduceLROnPlateau with monitor=None is not valid: it steps on a logged "
            "metric; return {'scheduler': ..., 'monitor': 'val_loss'} in configure_optimizers."
        )
    return cfg


def parse_optimizers(value: Any) -> tuple[list, list[SchedulerConfig]]:
    """Returns (optimizers, scheduler configs). Raises ConfigError listing the accepted forms."""
    if value is None:
        return [], []
    if _is_optimizer(value):
        return [value], []
    if isinstance(value, dict):
        if "optimizer" not in value:
            raise ConfigError(
                f"configure_optimizers returned a dict without 'optimizer'. Accepted: {_FORMS}."
            )
        scheds = (
            [_scheduler(value["lr_scheduler"])] if value.get("lr_scheduler") is not None else []
        )
        return parse_optimizers(value["optimizer"])[0], scheds
    if isinstance(value, (list, tuple)):
        if len(value) == 2 and all(isinstance(v, (list, tuple)) for v in value):
            opts, scheds = value
            if all(_is_optimizer(o) for o in opts):
                return list(opts), [_scheduler(s) for s in scheds]
        if value and all(_is_optimizer(o) for o in value):
            return list(value), []
        if value and all(isinstance(v, dict) for v in value):
            pairs = [parse_optimizers(v) for v in value]
            return [o for p in pairs for o in p[0]], [s for p in pairs for s in p[1]]
    raise ConfigError(
        f"configure_optimizers returned {type(value).__name__} {value!r:.200}, which is not a form "
        f"lightspeed accepts: {_FORMS}."
    )


def step_schedulers(
    schedulers: list, interval: str, count: int, metrics: dict, module: Any = None
) -> None:
    """Steps each scheduler whose `interval` ("step" or "epoch") matches and whose `frequency`
    divides `count` (the global step, or the number of epochs done); a `monitor` one on that
    metric's latest value. The Module's `lr_scheduler_step(scheduler, metric_or_None)` does the
    stepping when given (Lightning's hook, overridden for schedulers such as timm's). Raises
    ConfigError when the monitored metric was not logged."""
    step = (
        module.lr_scheduler_step
        if module is not None
        else (
            lambda scheduler, metric: scheduler.step() if metric is None else scheduler.step(metric)
        )
    )
    for cfg in schedulers:
        if cfg.interval != interval or count % cfg.frequency:
            continue
        if cfg.monitor is not None:
            if cfg.monitor not in metrics:
                raise ConfigError(
                    f"lr_scheduler monitor={cfg.monitor!r} was not logged: logged metrics are "
                    f"{sorted(metrics)}."
                )
            step(cfg.scheduler, float(metrics[cfg.monitor]))
        else:
            step(cfg.scheduler, None)
