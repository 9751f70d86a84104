"""What lightspeed checks of the user's hooks and callbacks, and what it says at fit start. The
hooks themselves are called by name in loop.py and start.py, through `call` and `timed` here
(timed by the profiler); `batch_to_device` runs the batch-transfer hooks of their owners.

    callbacks = trainer_callbacks(given, config.limits, config.output)  # Trainer.__init__
    run.callbacks[:] = with_module_callbacks(run.callbacks, module, print0)  # each entry point
    warn_unknown_hooks(module, callbacks); log_hparams(...)             # start.set_up_training
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, MutableMapping
from typing import Any

from lightspeed.callbacks import (
    Callback,
    ModelCheckpoint,
    ModelSummary,
    Timer,
)
from lightspeed.callbacks.progress.rich_progress import DefaultProgressBar
from lightspeed.callbacks.rich_model_summary import default_model_summary
from lightspeed.callbacks.run_metrics import RunMetrics
from lightspeed.config import Limits, Output
from lightspeed.core.datamodule import LightningDataModule
from lightspeed.core.mixins.hparams_mixin import hparams_to_log
from lightspeed.core.module import Module
from lightspeed.errors import ConfigError
from lightspeed.perf.precision import to_dtype
from lightspeed.run import Run
from lightspeed.utilities.parsing import clean_namespace
from lightspeed.utilities.rank_zero import rank_zero_info


def is_overridden(obj: Any, name: str, base: type = Module) -> bool:
    """Whether `obj` brings its own `name`: set on the instance, or defined by its class (or a
    parent below `base`, lightspeed's Module by default). A hook set to None on the instance
    (`model.validation_step = None`) is switched off, as in Lightning: False."""
    attr = getattr(obj, name, None)
    if attr is None:
        return False
    if name in getattr(obj, "__dict__", {}):
        return True
    return getattr(type(obj), name, None) is not getattr(base, name, None)


# Lightning methods a LightningModule overrides to change the loop itself; lightspeed's strategies
# own these steps (DeepSpeed runs backward and step itself), so an override would be silently
# skipped.
LIGHTNING_OVERRIDES = ("backward", "optimizer_step", "optimizer_zero_grad")


def warn_unknown_hooks(module: Module, callbacks: list[Callback]) -> None:
    """Warns once per fit about each `on_*` / `configure_*` method (or Lightning loop override such
    as `backward`, `optimizer_step`) that a Module or Callback subclass defines and lightspeed never
    calls (a Lightning hook not implemented here, or a typo): it would be silently ignored."""
    for obj, base in [(module, Module), *((cb, Callback) for cb in callbacks)]:
        # lightspeed's own classes (RichProgressBar.configure_columns) call their methods
        own = [c for c in type(obj).__mro__ if c.__module__.partition(".")[0] == "lightspeed"]
        for cls in type(obj).__mro__:
            if cls in own or not issubclass(cls, base):
                continue
            for name in vars(cls):
                hook_like = name.startswith(("on_", "configure_")) or name in LIGHTNING_OVERRIDES
                known = hasattr(base, name) or any(name in vars(c) for c in own)
                if hook_like and not known and callable(vars(cls)[name]):
                    warnings.warn(
                        f"{cls.__name__}.{name} is not a hook lightspeed calls: it will never run. "
                        "Known hooks are the on_*/configure_* methods of "
                        f"lightspeed.{base.__name__}.",
                        stacklevel=3,
                    )


def log_hparams(module: Module, datamodule: Any, loggers: list, is_global_zero: bool) -> None:
    """Once per fit: drops (with a warning) hparams that cannot be pickled and sends the Module's
    and DataModule's `hparams_initial` to the loggers (rank 0). The model summary is the
    ModelSummary callback's, at on_fit_start."""
    if isinstance(module.hparams, MutableMapping):
        clean_namespace(module.hparams)
    params = hparams_to_log(module, datamodule)  # the DataModule's too, as Lightning
    for lg in loggers if is_global_zero and params else []:
        lg.log_hyperparams(params)


# ------------------------------------------------------------------ callbacks
def checked_callbacks(callbacks: Any, enable_progress_bar: bool = True) -> list[Callback]:
    """`callbacks` as a new list; ConfigError unless it is None, one lightspeed Callback (as
    Lightning accepts) or a list/tuple of them, or when a progress-bar callback comes with
    `enable_progress_bar=False` (Lightning refuses that too)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        callbacks = [callbacks]
    if not isinstance(callbacks, (list, tuple)):
        raise ConfigError(
            f"callbacks={callbacks!r} is not valid: pass a list of callbacks, e.g. "
            f"callbacks=[{type(callbacks).__name__}(...)]."
        )
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            hint = (
                " (pass an instance, not the class)"
                if isinstance(cb, type) and issubclass(cb, Callback)
                else ""
            )
            raise ConfigError(
                f"callbacks[{i}]={cb!r} is not valid: expected a lightspeed.Callback instance"
                f"{hint}; Lightning callbacks need porting to lightspeed.Callback."
            )
    bars = [type(cb).__name__ for cb in callbacks if getattr(cb, "is_progress_bar", False)]
    if len(bars) > 1:
        raise ConfigError(
            "You added multiple progress bar callbacks to the Trainer, but currently only one "
            f"progress bar is supported ({', '.join(bars)})."
        )
    if bars and not enable_progress_bar:
        raise ConfigError(
            f"enable_progress_bar=False is not valid with {bars[0]} in callbacks: drop one of them "
            "(refresh_rate=0 also turns the bar off). Trainer was configured with "
            f"`enable_progress_bar=False` but found `{bars[0]}` in callbacks list."
        )
    return list(callbacks)


def trainer_callbacks(given: Any, limits: Limits, output: Output) -> list[Callback]:
    """The Trainer's callbacks: those given (checked; under fast_dev_run ModelCheckpoint and
    EarlyStopping stay and do nothing, as Lightning's), plus a ModelCheckpoint
    (`enable_checkpointing`), RunMetrics (lr, throughput, memory; the report), a Timer for
    `max_time` (unless one is given), a ModelSummary (`enable_model_summary`) and lightspeed's bar
    (`enable_progress_bar`, unless a bar callback is given)."""
    callbacks = checked_callbacks(given, output.enable_progress_bar)
    if output.enable_checkpointing and not any(isinstance(c, ModelCheckpoint) for c in callbacks):
        callbacks.append(ModelCheckpoint())
    if not output.barebones and not any(isinstance(c, RunMetrics) for c in callbacks):
        callbacks.append(RunMetrics())  # barebones: no run report
    if limits.max_time is not None:  # Lightning's max_time is a Timer, checked after every step
        if any(isinstance(c, Timer) for c in callbacks):
            rank_zero_info(
                "Ignoring `Trainer(max_time=...)`, callbacks list already contains a Timer."
            )
        else:
            callbacks.append(Timer(limits.max_time))
    summaries = [c for c in callbacks if isinstance(c, ModelSummary)]
    if output.enable_model_summary and not summaries:  # it prints at fit start, as Lightning's
        callbacks.append(default_model_summary(callbacks))
    bars = [c for c in callbacks if getattr(c, "is_progress_bar", False)]
    if output.enable_progress_bar and not bars:
        # lightspeed's own bar, as trainer.progress_bar_callback (Lightning always has one)
        callbacks.append(DefaultProgressBar())
    return callbacks


def with_module_callbacks(
    callbacks: list[Callback], module: Module, print0: Callable[..., None]
) -> list[Callback]:
    """Lightning's `configure_callbacks`: the Module's callbacks join `callbacks` at each entry
    point, each replacing those of its type (said once on rank 0), checkpoint callbacks last.
    Returns the new list (the caller puts it in place: the Checkpointer holds the list)."""
    given = module.configure_callbacks()
    extra = checked_callbacks(
        list(given) if isinstance(given, (list, tuple)) else [] if given is None else [given]
    )
    if not extra:
        return list(callbacks)
    types = {type(cb) for cb in extra}
    replaced = sorted(
        {type(cb).__name__ for cb in callbacks if type(cb) in types and cb not in extra}
    )
    if replaced:
        print0(
            f"{type(module).__name__}.configure_callbacks replaces the Trainer's "
            f"{', '.join(replaced)}."
        )
    merged = [cb for cb in callbacks if type(cb) not in types] + extra
    # sorted is stable, so only checkpoint callbacks move (last)
    return sorted(merged, key=lambda cb: isinstance(cb, ModelCheckpoint))


# ================================================================== calling a hook
def call(
    run: Run,
    module_hook: Callable[..., Any],
    callback_hook: Callable[[Callback], Callable[..., Any]],
    *args: Any,
) -> Any:
    """A hook without a return the loop needs: the Module's (`module_hook(*args)`), then each
    callback's (`callback_hook(cb)`, e.g. `lambda cb: cb.on_fit_start`) with the trainer and the
    module before `args`. Returns the Module hook's value. Each is timed by `run.profiler`."""
    with profiled(run, "LightningModule", module_hook):
        out = module_hook(*args)
    for cb in run.callbacks:
        hook = callback_hook(cb)
        with profiled(run, "Callback", hook):
            hook(run.trainer, run.module, *args)
    return out


def profiled(run: Run, kind: str, hook: Callable[..., Any]) -> Any:
    """`run.profiler` timing `hook` (a bound method) under Lightning's action name,
    `[LightningModule]Model.on_fit_start`, `[Callback]<state_key>.on_fit_start`, ..."""
    owner = getattr(hook, "__self__", None)
    who = owner.state_key if kind == "Callback" and owner is not None else type(owner).__name__
    return run.profiler.profile(f"[{kind}]{who}.{getattr(hook, '__name__', 'hook')}")


def timed(run: Run, kind: str, hook: Callable[..., Any], *args: Any) -> Any:
    """`hook(*args)`, timed by `run.profiler` (`profiled`)."""
    with profiled(run, kind, hook):
        return hook(*args)


TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def transfer_owners(module: Module, datamodule: Any) -> dict[str, Any]:
    """Whose batch-transfer hook runs, per hook: the DataModule's where it overrides it, else the
    Module's (as in Lightning, which also takes the DataModule's when both override one;
    `check_transfer_hooks` says so)."""

    def overrides(name: str) -> bool:  # a duck-typed DataModule may lack the hook: the Module's
        return getattr(type(datamodule), name, None) not in (
            None,
            getattr(LightningDataModule, name),
        )

    return {
        name: datamodule if datamodule is not None and overrides(name) else module
        for name in TRANSFER_HOOKS
    }


def check_transfer_hooks(module: Module, datamodule: Any) -> None:
    """Warns once per fit for each batch-transfer hook both the Module and the DataModule
    override."""
    owners = transfer_owners(module, datamodule)
    for name in TRANSFER_HOOKS:
        if owners[name] is datamodule and datamodule is not None and is_overridden(module, name):
            warnings.warn(
                f"{name} is overridden in both {type(module).__name__} and "
                f"{type(datamodule).__name__}: the DataModule's runs (as in Lightning).",
                stacklevel=3,
            )


def batch_to_device(
    run: Run, module: Module, batch: Any, dataloader_idx: int = 0, device: Any = None
) -> Any:
    """The batch through `on_before_batch_transfer`, `transfer_batch_to_device` (to `device`, by
    default the run's) and `on_after_batch_transfer`, each the DataModule's or the Module's
    (`transfer_owners`); under bf16-true its floating-point tensors are then cast to bf16."""
    owners = transfer_owners(module, run.datamodule)
    batch = owners["on_before_batch_transfer"].on_before_batch_transfer(batch, dataloader_idx)
    batch = owners["transfer_batch_to_device"].transfer_batch_to_device(
        batch, device or run.device, dataloader_idx
    )
    batch = owners["on_after_batch_transfer"].on_after_batch_transfer(batch, dataloader_idx)
    return to_dtype(batch, run.input_dtype)  # bf16-true: the floats in bf16, as the weights
