"""The return forms of `configure_optimizers` that Lightning users know, parsed and checked with
Lightning's messages, and the stepping of the LR schedulers they declare.

    optimizers, schedulers = parse_optimizers(module.configure_optimizers())

Accepted: an optimizer; a list or tuple of them; `([optimizers], [schedulers])` (or one scheduler);
`{"optimizer": o, "lr_scheduler": s or {...}, "monitor": key}`; a list of such dicts. A scheduler
dict takes `scheduler`, `interval` ("step"/"epoch"), `frequency`, `monitor`, `strict`,
`reduce_on_plateau` and `name`. Under manual optimization the user steps the schedulers, so their
stepping options are ignored (with a warning) rather than checked.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import unbind_rebuilt
from lightspeed.specs import SchedulerConfig
from lightspeed.utilities.rank_zero import rank_zero_warn

_FORMS = (
    "Unknown configuration for model optimizers. Output from `model.configure_optimizers()` "
    "should be one of:\n * `Optimizer`\n * [`Optimizer`]\n * ([`Optimizer`], [`LRScheduler`])\n"
    ' * {"optimizer": `Optimizer`, (optional) "lr_scheduler": `LRScheduler`}\n'
    ' * A list of the previously described dict format, with an optional "frequency" key (int)'
)
_SCHEDULER_KEYS = {"scheduler", "name", "interval", "frequency", "monitor", "strict"}
_SCHEDULER_KEYS |= {"reduce_on_plateau"}


def _is_optimizer(x: Any) -> bool:
    # DeepSpeed's optimizers do not subclass torch's; anything with step/zero_grad/param_groups will
    # do.
    return isinstance(x, torch.optim.Optimizer) or all(
        hasattr(x, a) for a in ("step", "zero_grad", "param_groups")
    )


def _configure_optimizers(optim_conf: Any) -> tuple[list, list, str | None]:
    """(optimizers, schedulers as given, the dict form's `monitor`) of `configure_optimizers`'s
    return value. Raises ConfigError (Lightning's message) for any other form."""
    if _is_optimizer(optim_conf):
        return [optim_conf], [], None
    if isinstance(optim_conf, Mapping):
        _check_keys(optim_conf)
        if "optimizer" not in optim_conf:
            raise ConfigError(
                f"configure_optimizers returned a dict without 'optimizer' (keys "
                f"{sorted(map(str, optim_conf))}). {_FORMS}"
            )
        scheduler = optim_conf.get("lr_scheduler")
        return (
            [optim_conf["optimizer"]],
            [scheduler] if scheduler is not None else [],
            optim_conf.get("monitor"),
        )
    if isinstance(optim_conf, (list, tuple)):
        if len(optim_conf) == 2 and isinstance(optim_conf[0], (list, tuple)):
            optimizers, schedulers = optim_conf
            if all(_is_optimizer(o) for o in optimizers):
                schedulers = (
                    list(schedulers) if isinstance(schedulers, (list, tuple)) else [schedulers]
                )
                return list(optimizers), schedulers, None
        if optim_conf and all(_is_optimizer(o) for o in optim_conf):
            return list(optim_conf), [], None
        if optim_conf and all(isinstance(d, Mapping) for d in optim_conf):
            for d in optim_conf:
                _check_keys(d)
            schedulers = [
                dict(d["lr_scheduler"])
                if isinstance(d["lr_scheduler"], Mapping)
                else {"scheduler": d["lr_scheduler"]}
                for d in optim_conf
                if d.get("lr_scheduler") is not None
            ]
            monitors = [d.get("monitor") for d in optim_conf]
            for config, monitor in zip(schedulers, monitors):
                if monitor is not None:
                    config.setdefault("monitor", monitor)
            return [d["optimizer"] for d in optim_conf], schedulers, None
    raise ConfigError(
        f"configure_optimizers returned {type(optim_conf).__name__} {optim_conf!r:.200}, which is "
        "not a form lightspeed accepts: an optimizer; a list of optimizers; ([optimizers], "
        "[schedulers]); {'optimizer': o, 'lr_scheduler': s, 'monitor': key}; or a list of such "
        f"dicts. {_FORMS}"
    )


def _check_keys(optim_conf: Mapping) -> None:
    extra = set(optim_conf) - {"optimizer", "lr_scheduler", "monitor"}
    if extra:
        rank_zero_warn(
            f"Found unsupported keys in the optimizer configuration: {extra}",
            category=RuntimeWarning,
        )


def _configure_schedulers_automatic_opt(
    schedulers: list, monitor: str | None
) -> list[SchedulerConfig]:
    """Each scheduler (bare, or a dict of Lightning's keys) as a SchedulerConfig, checked: a
    ReduceLROnPlateau needs a `monitor` (the dict's, or the optimizer dict's beside it)."""
    configs = []
    for given in schedulers:
        if isinstance(given, Mapping):
            extra = set(given) - _SCHEDULER_KEYS
            if extra:
                rank_zero_warn(
                    f"Found unsupported keys in the lr scheduler dict: {extra}. HINT: remove "
                    "them from the output of `configure_optimizers`.",
                    category=RuntimeWarning,
                )
            if "scheduler" not in given:
                raise ConfigError(
                    f"configure_optimizers returned an lr_scheduler dict without 'scheduler': "
                    f'{dict(given)!r:.200}. The lr scheduler dict must have the key "scheduler" '
                    "with its item being an lr scheduler"
                )
            interval = given.get("interval", "epoch")
            if interval not in ("step", "epoch"):
                raise ConfigError(
                    f"lr_scheduler interval={interval!r} is not valid: use 'step' or 'epoch'. The "
                    f'"interval" key in lr scheduler dict must be "step" or "epoch" but is '
                    f'"{interval}"'
                )
            frequency = given.get("frequency", 1)
            if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
                raise ConfigError(
                    f"lr_scheduler frequency={frequency!r} is not valid: expected an integer ≥ 1."
                )
            config = {k: v for k, v in given.items() if k in _SCHEDULER_KEYS}
            config.setdefault("monitor", monitor)
            config.setdefault("reduce_on_plateau", _is_plateau(given["scheduler"]))
            if config["reduce_on_plateau"] and config["monitor"] is None:
                raise ConfigError(
                    "lr_scheduler ReduceLROnPlateau with monitor=None is not valid: it steps on a "
                    "logged metric. The lr scheduler dict must include a monitor when a "
                    '`ReduceLROnPlateau` scheduler is used. For example: {"optimizer": '
                    'optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "your_loss"}}'
                )
            if isinstance(given["scheduler"], torch.optim.lr_scheduler.OneCycleLR) and (
                interval == "epoch"
            ):
                rank_zero_warn(
                    "A `OneCycleLR` scheduler is using 'interval': 'epoch'. Are you sure you "
                    "didn't mean 'interval': 'step'?",
                    category=RuntimeWarning,
                )
            configs.append(SchedulerConfig(**config))
        else:
            if _is_plateau(given) and monitor is None:
                raise ConfigError(
                    "lr_scheduler ReduceLROnPlateau with monitor=None is not valid: it steps on a "
                    "logged metric. `configure_optimizers` must include a monitor when a "
                    '`ReduceLROnPlateau` scheduler is used. For example: {"optimizer": '
                    'optimizer, "lr_scheduler": scheduler, "monitor": "metric_to_track"}'
                )
            configs.append(
                SchedulerConfig(given, reduce_on_plateau=_is_plateau(given), monitor=monitor)
            )
    return configs


def _configure_schedulers_manual_opt(schedulers: list) -> list[SchedulerConfig]:
    """Under manual optimization the user steps each scheduler: only `scheduler`, `name`,
    `interval` and `frequency` are kept (stepping keys are ignored, with a warning)."""
    configs = []
    for given in schedulers:
        if isinstance(given, Mapping):
            ignored = [k for k in given if k in ("reduce_on_plateau", "monitor", "strict")]
            if ignored:
                rank_zero_warn(
                    f"The lr scheduler dict contains the key(s) {ignored}, but the keys will be "
                    "ignored. You need to call `lr_scheduler.step()` manually in manual "
                    "optimization.",
                    category=RuntimeWarning,
                )
            kept = {k: v for k, v in given.items() if k in ("scheduler", "name", "interval")}
            configs.append(SchedulerConfig(**kept, frequency=given.get("frequency", 1)))
        else:
            configs.append(SchedulerConfig(given))
    return configs


def _is_plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _validate_scheduler_api(configs: list[SchedulerConfig], model: Any = None) -> None:
    """Each scheduler has `state_dict`/`load_state_dict` (it travels in checkpoints); one that is
    not a torch scheduler needs the Module's `lr_scheduler_step` to step it."""
    for config in configs:
        scheduler = config.scheduler
        if not all(hasattr(scheduler, a) for a in ("state_dict", "load_state_dict")):
            raise TypeError(
                f"The provided lr scheduler `{type(scheduler).__name__}` is invalid. It should "
                "have `state_dict` and `load_state_dict` methods defined."
            )
        torch_scheduler = isinstance(
            scheduler,
            (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau),
        )
        own_step = model is not None and _overrides(model, "lr_scheduler_step")
        if not torch_scheduler and not own_step and not config.reduce_on_plateau:
            raise ConfigError(
                f"The provided lr scheduler `{type(scheduler).__name__}` doesn't follow "
                "PyTorch's LRScheduler API. You should override the "
                "`LightningModule.lr_scheduler_step` hook with your own logic if you are using a "
                "custom LR scheduler."
            )


def _overrides(model: Any, name: str) -> bool:
    """Whether a class of `model` below lightspeed's Module defines `name` (read by where it is
    defined: core/module.py imports this module)."""
    owner = next((c for c in type(model).__mro__ if name in vars(c)), None)
    return owner is not None and owner.__module__ != "lightspeed.core.module"


def _validate_optimizers_attached(optimizers: list, configs: list[SchedulerConfig]) -> None:
    held = {id(o) for o in optimizers}
    for config in configs:
        optimizer = getattr(config.scheduler, "optimizer", None)
        if optimizer is not None and id(optimizer) not in held:
            raise ConfigError(
                "Some schedulers are attached with an optimizer that wasn't returned from "
                "`configure_optimizers`."
            )


def parse_optimizers(
    value: Any, automatic: bool = True, model: Any = None
) -> tuple[list, list[SchedulerConfig]]:
    """(optimizers, scheduler configs) of `configure_optimizers`'s return value; ([], []) for
    None. `automatic`: the Module's `automatic_optimization` (manual: schedulers are the user's to
    step). Raises ConfigError with Lightning's messages."""
    if value is None:
        return [], []
    optimizers, schedulers, monitor = _configure_optimizers(value)
    if automatic:
        configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    else:
        configs = _configure_schedulers_manual_opt(schedulers)
    unbind_rebuilt(configs)  # objects returned again: not the previous fit's fused optimizers
    _validate_optimizers_attached(optimizers, configs)
    _validate_scheduler_api(configs, model)
    return optimizers, configs


def _init_optimizers_and_lr_schedulers(model: Any) -> tuple[list, list[SchedulerConfig]]:
    """Calls `model.configure_optimizers()` and parses what it returns (Lightning's helper);
    None warns that the run has no optimizer."""
    value = model.configure_optimizers()
    if value is None:
        rank_zero_warn(
            "`LightningModule.configure_optimizers` returned `None`, this fit will run with no "
            "optimizer"
        )
    return parse_optimizers(value, getattr(model, "automatic_optimization", True), model)


def step_schedulers(
    schedulers: list,
    interval: str,
    count: int,
    metrics: dict,
    module: Any = None,
    plateau: bool | None = None,
) -> None:
    """Steps each scheduler whose `interval` ("step" or "epoch") matches and whose `frequency`
    divides `count` (the global step, or the number of epochs done); a `reduce_on_plateau` one on
    its `monitor` metric's latest value. `plateau`: only those (True), only the others (False), or
    both (None): Lightning steps the others as soon as the step (or the epoch's last batch) is done
    and the plateau ones once validation has logged. The Module's `lr_scheduler_step(scheduler,
    metric)` does the stepping when given (Lightning's hook, overridden for schedulers such as
    timm's). A monitored metric that was not logged is a ConfigError, or with `strict=False` a
    warning and no step."""
    step = (
        module.lr_scheduler_step
        if module is not None
        else (
            lambda scheduler, metric: scheduler.step() if metric is None else scheduler.step(metric)
        )
    )
    for cfg in schedulers:
        on_plateau = cfg.reduce_on_plateau or (
            cfg.monitor is not None and _is_plateau(cfg.scheduler)
        )
        if cfg.interval != interval or count % cfg.frequency or plateau not in (None, on_plateau):
            continue
        if on_plateau:
            if cfg.monitor not in metrics:
                if cfg.strict:
                    raise ConfigError(
                        f"ReduceLROnPlateau conditioned on metric {cfg.monitor} which is not "
                        f"available. Available metrics are: {sorted(metrics)}. Condition can be "
                        "set using `monitor` key in lr scheduler dict"
                    )
                rank_zero_warn(
                    f"ReduceLROnPlateau conditioned on metric {cfg.monitor} which is not available "
                    "but strict is set to `False`. Skipping learning rate update.",
                    category=RuntimeWarning,
                )
                continue
            step(cfg.scheduler, float(metrics[cfg.monitor]))
        else:
            step(cfg.scheduler, None)


class LightningOptimizer:
    """Lightning's wrapper of a user's optimizer, by composition: every attribute not defined here
    is the wrapped optimizer's (`param_groups`, `state`, ...). `step(closure)` calls the closure
    first when the optimizer itself would not (DeepSpeed's step takes none)."""

    def __init__(self, optimizer: Any) -> None:
        self._optimizer = optimizer
        self._strategy: Any = None

    @property
    def optimizer(self) -> Any:
        return self._optimizer

    @classmethod
    def _to_lightning_optimizer(cls, optimizer: Any, strategy: Any = None) -> LightningOptimizer:
        wrapped = optimizer if isinstance(optimizer, LightningOptimizer) else cls(optimizer)
        wrapped._strategy = strategy
        return wrapped

    @contextmanager
    def toggle_model(self, sync_grad: bool = True) -> Iterator[None]:
        """While inside, only this optimizer's parameters train (Lightning's toggle)."""
        module = getattr(self._strategy, "lightning_module", None)
        if module is not None:
            module.toggle_optimizer(self._optimizer)
        try:
            yield
        finally:
            if module is not None:
                module.untoggle_optimizer(self._optimizer)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if closure is not None and not callable(closure):
            raise ConfigError(
                "When `optimizer.step(closure)` is called, the closure should be callable"
            )
        if closure is None:
            return self._optimizer.step(**kwargs)
        return self._optimizer.step(closure=closure, **kwargs)  # by keyword, as Lightning passes it

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return self._optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self._optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "_optimizer":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    # `isinstance(wrapper, torch.optim.Adam)` holds for an Adam inside, as for Lightning's wrapper:
    # isinstance falls back to `__class__` (the proxy idiom of unittest.mock and wrapt);
    # `type(wrapper)` stays LightningOptimizer. Pickling then goes through __reduce__: pickle's
    # default refuses an object whose `__class__` is not its type.
    @property
    def __class__(self) -> type:  # type: ignore[override]
        return type(self._optimizer)

    def __reduce__(self) -> tuple:
        return _rewrapped, (self._optimizer, self._strategy)

    def __repr__(self) -> str:
        return f"Lightning{self._optimizer!r}"


def _rewrapped(optimizer: Any, strategy: Any) -> LightningOptimizer:
    return LightningOptimizer._to_lightning_optimizer(optimizer, strategy)
