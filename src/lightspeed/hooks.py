"""The hooks' call sites that the loop shares, and what lightspeed checks of the user's hooks at fit
start.

Every hook is called explicitly here (no dispatch by name): the Module's first, then each
callback's, as in Lightning. Under DeepSpeed the optimizer step and `zero_grad` happen inside
`engine.step()`, so `on_before_optimizer_step` and `on_before_zero_grad` run just before
`strategy.step()` for every strategy: after the window's backward passes and before clipping, the
step and zeroing (also where torch strategies clip). With precision "16-mixed" the gradients these
hooks see are still loss-scaled (Lightning unscales them first).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, MutableMapping
from typing import Any

import torch

from lightspeed.callbacks import Callback, ModelCheckpoint
from lightspeed.core.datamodule import LightningDataModule, prepare_data_once
from lightspeed.core.mixins.hparams_mixin import hparams_to_log
from lightspeed.core.module import Module
from lightspeed.data.loaders import move_to_device
from lightspeed.errors import ConfigError
from lightspeed.inputs import checked_callbacks
from lightspeed.runtime import heartbeat
from lightspeed.runtime.distributed import AgreedMax
from lightspeed.utilities.parsing import clean_namespace
from lightspeed.utilities.signature import accepts


def is_overridden(module: Module, name: str) -> bool:
    """Whether `type(module)` defines `name` itself (or in a parent below lightspeed's Module)."""
    return getattr(type(module), name, None) is not getattr(Module, name, None)


# Lightning methods a LightningModule overrides to change the loop itself; lightspeed's strategies
# own these steps
# (DeepSpeed runs backward and step itself), so an override here would be silently skipped.
LIGHTNING_OVERRIDES = ("backward", "optimizer_step", "optimizer_zero_grad")


def warn_unknown_hooks(module: Module, callbacks: list[Callback]) -> None:
    """Warns once per fit about each `on_*` / `configure_*` method (or Lightning loop override such
    as `backward`, `optimizer_step`) that a Module or Callback subclass defines and lightspeed never
    calls (a Lightning hook not implemented here, or a typo): it would be silently ignored."""
    for obj, base in [(module, Module), *((cb, Callback) for cb in callbacks)]:
        for cls in type(obj).__mro__:
            if cls is base or not issubclass(cls, base):
                continue
            for name in vars(cls):
                hook_like = name.startswith(("on_", "configure_")) or name in LIGHTNING_OVERRIDES
                if hook_like and not hasattr(base, name) and callable(vars(cls)[name]):
                    warnings.warn(
                        f"{cls.__name__}.{name} is not a hook lightspeed calls: it will never run. "
                        "Known hooks are the on_*/configure_* methods of "
                        f"lightspeed.{base.__name__}.",
                        stacklevel=3,
                    )


def fit_start(trainer: Any, module: Module) -> Callable[[Any, int], tuple]:
    """Once per fit, before its hooks: warns of unknown hooks, drops (with a warning) hparams that
    cannot be pickled, sends the Module's and DataModule's `hparams_initial` to the loggers (rank
    0; the model summary is the ModelSummary callback's, at on_fit_start). Returns how to build
    `training_step`'s arguments from (batch, batch_idx): Lightning accepts
    `training_step(self, batch)`."""
    warn_unknown_hooks(module, trainer.callbacks)
    check_transfer_hooks(module, trainer.datamodule)
    if isinstance(module.hparams, MutableMapping):
        clean_namespace(module.hparams)
    params = hparams_to_log(module, trainer.datamodule)  # the DataModule's too, as Lightning
    for lg in trainer.loggers if trainer.is_global_zero and params else []:
        lg.log_hyperparams(params)
    if accepts(module.training_step, 2, "batch_idx"):
        return lambda batch, batch_idx: (batch, batch_idx)
    return lambda batch, batch_idx: (batch,)


def loss_of(out: Any) -> torch.Tensor:
    """The scalar loss of a `training_step` output (a tensor or a dict with 'loss'); ConfigError
    otherwise."""
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else repr(loss)[:80]
        )
        if isinstance(out, dict) and "loss" not in out:
            shape = f"a dict without 'loss' (keys {sorted(map(str, out))})"
        raise ConfigError(
            f"training_step returned {shape}: under automatic optimization it must return a "
            "scalar loss tensor or a dict with a 'loss' scalar."
        )
    return loss.reshape(())


# ------------------------------------------------------------------ training
TRANSFER_HOOKS = ("on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer")


def transfer_owners(module: Module, datamodule: Any) -> dict[str, Any]:
    """Whose batch-transfer hook runs, per hook: the DataModule's where it overrides it, else the
    Module's (as in Lightning, which also takes the DataModule's when both override one;
    `check_transfer_hooks` says so)."""

    def overrides(
        name: str,
    ) -> bool:  # a DataModule of another type (duck-typed) may lack the hook: the Module's
        return getattr(type(datamodule), name, None) not in (
            None,
            getattr(LightningDataModule, name),
        )

    return {
        name: datamodule if datamodule is not None and overrides(name) else module
        for name in TRANSFER_HOOKS
    }


def check_transfer_hooks(module: Module, datamodule: Any) -> None:
    """Warns once per fit for each batch-transfer hook that both the Module and the DataModule
    override."""
    owners = transfer_owners(module, datamodule)
    for name in TRANSFER_HOOKS:
        if owners[name] is datamodule and datamodule is not None and is_overridden(module, name):
            warnings.warn(
                f"{name} is overridden in both {type(module).__name__} and "
                f"{type(datamodule).__name__}: "
                f"the DataModule's runs (as in Lightning).",
                stacklevel=3,
            )


def batch_to_device(
    trainer: Any,
    module: Module,
    batch: Any,
    dataloader_idx: int = 0,
    device: torch.device | None = None,
) -> Any:
    """The batch through `on_before_batch_transfer`, `transfer_batch_to_device` (to `device`, by
    default `trainer.device`) and `on_after_batch_transfer`, each the DataModule's or the Module's
    (`transfer_owners`)."""
    owners = transfer_owners(module, trainer.datamodule)
    batch = owners["on_before_batch_transfer"].on_before_batch_transfer(batch, dataloader_idx)
    batch = owners["transfer_batch_to_device"].transfer_batch_to_device(
        batch, device or trainer.device, dataloader_idx
    )
    return owners["on_after_batch_transfer"].on_after_batch_transfer(batch, dataloader_idx)


def probe_batch(trainer: Any, module: Module, datamodule: Any, batch: Any) -> Any:
    """A drawn training batch as `training_step` will see it, on the CPU, for the planner's probes
    of the step before any rank starts (micro_batch.plan_fit): through the three transfer hooks as
    every training batch is, so a step written for what `on_after_batch_transfer` returns (uint8
    images made floats, say) runs in the probe too. The hooks see their `trainer` and
    `trainer.training` as in training; what they return is brought back to the CPU, where the
    probe's copy of the model lives."""
    module.trainer = trainer
    if datamodule is not None:
        datamodule.trainer = trainer
    stage, trainer.stage = trainer.stage, "train"
    try:
        cpu = torch.device("cpu")
        return move_to_device(batch_to_device(trainer, module, batch, 0, cpu), cpu)
    finally:
        trainer.stage = stage


def attach_module_callbacks(trainer: Any, module: Module) -> None:
    """Lightning's `configure_callbacks`: the Module's callbacks join the Trainer's at each entry
    point, each replacing the Trainer's callbacks of its type (said once on rank 0), checkpoint
    callbacks last."""
    given = module.configure_callbacks()
    extra = checked_callbacks(
        list(given) if isinstance(given, (list, tuple)) else [] if given is None else [given]
    )
    if not extra:
        return
    types = {type(cb) for cb in extra}
    replaced = sorted(
        {type(cb).__name__ for cb in trainer.callbacks if type(cb) in types and cb not in extra}
    )
    if replaced:
        trainer.print0(
            f"{type(module).__name__}.configure_callbacks replaces the Trainer's "
            f"{', '.join(replaced)}."
        )
    merged = [cb for cb in trainer.callbacks if type(cb) not in types] + extra
    # in place: the Checkpointer holds this list; sorted is stable, so only checkpoint callbacks
    # move (last)
    trainer.callbacks[:] = sorted(merged, key=lambda cb: isinstance(cb, ModelCheckpoint))


def start_evaluation(trainer: Any, module: Module, stage: str) -> None:
    """Lightning's order before the batches of `stage` ("validate", "test", "predict"):
    on_<x>_model_eval (eval mode, unless the Module overrides it), then on_<x>_start and
    on_<x>_epoch_start."""
    name = "validation" if stage == "validate" else stage
    getattr(module, f"on_{name}_model_eval")()
    call(trainer, module, f"on_{name}_start", f"on_{name}_epoch_start")


def call(trainer: Any, module: Module, *names: str) -> None:
    """Hooks without arguments (`on_fit_start`, `on_train_epoch_end`, ...), in turn: the Module's,
    then each callback's."""
    for name in names:
        getattr(module, name)()
        for cb in trainer.callbacks:
            getattr(cb, name)(trainer, module)


def on_train_batch_start(trainer: Any, module: Module, batch: Any, batch_idx: int) -> bool:
    """The hooks; True once the Module's returned -1 in this epoch on any rank (Lightning's way to
    skip the epoch's rest). The ranks agree through one MAX reduction per call, made only when the
    Module overrides the hook; under NCCL it answers one call late (distributed.AgreedMax), so the
    host never waits for the GPU."""
    heartbeat.note_step(
        trainer.global_step
    )  # no I/O: the heartbeat thread publishes it (heartbeat.py)
    skip = module.on_train_batch_start(batch, batch_idx)
    for cb in trainer.callbacks:
        cb.on_train_batch_start(trainer, module, batch, batch_idx)
    if is_overridden(
        module, "on_train_batch_start"
    ):  # a -1 on any rank ends the epoch on every rank, together
        mine = isinstance(skip, int) and not isinstance(skip, bool) and skip == -1
        epoch, agreed = vars(trainer).get("_skip_vote") or (None, None)
        if (
            epoch != trainer.current_epoch
        ):  # a fresh vote each epoch (under NCCL, AgreedMax answers a call late)
            epoch, agreed = trainer.current_epoch, AgreedMax()
            vars(trainer)["_skip_vote"] = (epoch, agreed)
        if agreed(int(mine)):
            trainer.skips_rest = (
                True  # the loop ends the epoch: before this window, or after it when inside one
            )
    return trainer.skips_rest


def on_load_checkpoint(trainer: Any, module: Module, checkpoint: dict) -> None:
    module.on_load_checkpoint(checkpoint)
    for cb in trainer.callbacks:
        cb.on_load_checkpoint(trainer, module, checkpoint)


def on_before_backward(trainer: Any, module: Module, loss: torch.Tensor) -> None:
    module.on_before_backward(loss)
    for cb in trainer.callbacks:
        cb.on_before_backward(trainer, module, loss)


def on_after_backward(trainer: Any, module: Module) -> None:
    module.on_after_backward()
    for cb in trainer.callbacks:
        cb.on_after_backward(trainer, module)


def before_step(trainer: Any, module: Module) -> None:
    """`on_before_optimizer_step` then `on_before_zero_grad`, per optimizer, just before
    `strategy.step()`."""
    for opt in trainer.strategy.optimizers:
        module.on_before_optimizer_step(opt)
        for cb in trainer.callbacks:
            cb.on_before_optimizer_step(trainer, module, opt)
    for opt in trainer.strategy.optimizers:
        module.on_before_zero_grad(opt)
        for cb in trainer.callbacks:
            cb.on_before_zero_grad(trainer, module, opt)


def on_train_batch_end(trainer: Any, module: Module, out: Any, batch: Any, batch_idx: int) -> None:
    module.on_train_batch_end(out, batch, batch_idx)
    for cb in trainer.callbacks:
        cb.on_train_batch_end(trainer, module, out, batch, batch_idx)


# ------------------------------------------------------------------ evaluation
def on_eval_batch_start(
    trainer: Any, module: Module, stage: str, batch: Any, batch_idx: int, *idx: int
) -> None:
    """`on_{validation,test,predict}_batch_start`; `idx` is `(dataloader_idx,)` with several loaders
    only."""
    match stage:
        case "validate":
            module.on_validation_batch_start(batch, batch_idx, *idx)
            for cb in trainer.callbacks:
                cb.on_validation_batch_start(trainer, module, batch, batch_idx, *idx)
        case "test":
            module.on_test_batch_start(batch, batch_idx, *idx)
            for cb in trainer.callbacks:
                cb.on_test_batch_start(trainer, module, batch, batch_idx, *idx)
        case "predict":
            module.on_predict_batch_start(batch, batch_idx, *idx)
            for cb in trainer.callbacks:
                cb.on_predict_batch_start(trainer, module, batch, batch_idx, *idx)


def on_eval_batch_end(
    trainer: Any, module: Module, stage: str, out: Any, batch: Any, batch_idx: int, *idx: int
) -> None:
    """`on_{validation,test,predict}_batch_end`; `idx` is `(dataloader_idx,)` with several loaders
    only."""
    match stage:
        case "validate":
            module.on_validation_batch_end(out, batch, batch_idx, *idx)
            for cb in trainer.callbacks:
                cb.on_validation_batch_end(trainer, module, out, batch, batch_idx, *idx)
        case "test":
            module.on_test_batch_end(out, batch, batch_idx, *idx)
            for cb in trainer.callbacks:
                cb.on_test_batch_end(trainer, module, out, batch, batch_idx, *idx)
        case "predict":
            module.on_predict_batch_end(out, batch, batch_idx, *idx)
            for cb in trainer.callbacks:
                cb.on_predict_batch_end(trainer, module, out, batch, batch_idx, *idx)


def setup(trainer: Any, module: Module, datamodule: Any, stage: str) -> None:
    """Lightning's order once the ranks run: `prepare_data` (once per node), callbacks' `setup`, the
    DataModule's `setup`, the Module's `setup`. The caller then configures the model."""
    if datamodule is not None:
        # as in Lightning: its hooks may read trainer.training, trainer.current_epoch...
        datamodule.trainer = trainer
        prepare_data_once(
            datamodule.prepare_data,
            trainer.local_rank if datamodule.prepare_data_per_node else trainer.global_rank,
        )  # prepare_data_per_node=False: once in all
    prepare_data_once(
        module.prepare_data,
        trainer.local_rank if module.prepare_data_per_node else trainer.global_rank,
    )
    for cb in trainer.callbacks:
        cb.setup(trainer, module, stage)
    if datamodule is not None:
        datamodule.setup(stage)
    module.setup(stage)


def teardown(trainer: Any, module: Module, datamodule: Any, stage: str) -> None:
    """`teardown(stage)` on callbacks, the DataModule and the Module, at the end of a successful
    entry point."""
    for cb in trainer.callbacks:
        cb.teardown(trainer, module, stage)
    if datamodule is not None:
        datamodule.teardown(stage)
    module.teardown(stage)
