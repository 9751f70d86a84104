"""What an entry point checks of the Module before anything runs, at Lightning's path
(`lightspeed.trainer.configuration_validator`).

    verify_loop_configuration(trainer, "fit", model, datamodule, val_given)   # Trainer.fit

A step set to None switches it off, as in Lightning (`model.validation_step = None`): fit then
skips validation with a warning, and an entry point whose own step is missing (`validate` without
`validation_step`, `fit` without `training_step`) is refused before any rank starts.
Lightning's own tests import two of its private helpers from here; they are this module's
`check_fit` and `check_evaluation` under Lightning's names (the end of the file).
"""

from __future__ import annotations

from typing import Any

from lightspeed.core.datamodule import LightningDataModule
from lightspeed.errors import ConfigError
from lightspeed.hooks import is_overridden
from lightspeed.utilities.rank_zero import rank_zero_warn

__all__ = ["check_evaluation", "check_fit", "verify_loop_configuration"]

# the epoch-end hooks Lightning 2.0 removed, and what replaces each
_REMOVED = {
    "training_epoch_end": "on_train_epoch_end",
    "validation_epoch_end": "on_validation_epoch_end",
    "test_epoch_end": "on_test_epoch_end",
}
_STAGE_STEP = {"val": "validation_step", "test": "test_step", "predict": "predict_step"}
_STAGE_ENTRY = {"val": "validate", "test": "test", "predict": "predict"}


def verify_loop_configuration(
    trainer: Any, fn: str, model: Any, datamodule: Any = None, val_given: Any = None
) -> None:
    """Checks `model` for the entry point `fn` ("fit", "validate", "test", "predict"). Raises
    ConfigError (a MisconfigurationException) for a missing step or a flag manual optimization
    cannot honour, NotImplementedError for an epoch-end hook Lightning 2.0 removed."""
    if fn == "fit":
        check_fit(trainer, model, datamodule, val_given)
    else:
        check_evaluation(model, {"validate": "val"}.get(fn, fn))


def _removed_hooks(model: Any, names: tuple[str, ...]) -> None:
    for name in names:
        if callable(getattr(model, name, None)):
            raise NotImplementedError(
                f"`{name}` has been removed in v2.0 of Lightning, and lightspeed does not call it: "
                f"{type(model).__name__} defines it. Move its work to `{_REMOVED[name]}` (keep the "
                "step outputs you need on the module yourself)."
            )


def check_fit(trainer: Any, model: Any, datamodule: Any = None, val_given: Any = None) -> None:
    """fit's rules: `training_step` and `configure_optimizers` defined; validation data without a
    `validation_step` (or the reverse) is skipped with a warning; under manual optimization no
    `gradient_clip_val` and no `accumulate_grad_batches` (the user clips and steps)."""
    _removed_hooks(model, ("training_epoch_end", "validation_epoch_end"))
    for name in ("training_step", "configure_optimizers"):
        if not is_overridden(model, name):
            raise ConfigError(
                f"No `{name}()` method defined on {type(model).__name__}: fit needs at least "
                "`training_step()`, `configure_optimizers()` and training data "
                "(`train_dataloader()` or loaders passed to fit)."
            )
    has_val_data = val_given is not None or (
        is_overridden(datamodule, "val_dataloader", LightningDataModule)
        if datamodule is not None
        else is_overridden(model, "val_dataloader")
    )
    has_val_step = is_overridden(model, "validation_step")
    if has_val_data and not has_val_step:
        rank_zero_warn(
            "You passed in a `val_dataloader` but have no `validation_step`. Skipping val loop."
        )
    if has_val_step and not has_val_data:
        rank_zero_warn(
            "You defined a `validation_step` but have no `val_dataloader`. Skipping val loop."
        )
    if model.automatic_optimization:
        return
    if trainer.gradient_clip_val:
        raise ConfigError(
            "Automatic gradient clipping is not supported for manual optimization: "
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) would clip nothing. Call "
            "self.clip_gradients(opt, gradient_clip_val=...) before opt.step(), or use automatic "
            "optimization."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ConfigError(
            "Automatic gradient accumulation is not supported for manual optimization: "
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) would accumulate "
            "nothing. Step the optimizer every N batches yourself, or use automatic optimization."
        )


def check_evaluation(model: Any, stage: str) -> None:
    """validate / test / predict (`stage` "val", "test" or "predict"): the stage's step defined
    (predict: `predict_step`, or `forward` for the default one)."""
    if stage in ("val", "test"):
        _removed_hooks(model, (f"{'validation' if stage == 'val' else stage}_epoch_end",))
    step = _STAGE_STEP[stage]
    if stage == "predict":
        if getattr(model, step, None) is None:
            raise ConfigError(
                "`predict_step` cannot be None: define it, or leave the default one, which "
                "returns `self(batch)`."
            )
        if not is_overridden(model, step) and not is_overridden(model, "forward"):
            raise ConfigError(
                f"`Trainer.predict` requires `forward` method to run: {type(model).__name__} has "
                "neither `predict_step` nor `forward`."
            )
        return
    if not is_overridden(model, step):
        raise ConfigError(
            f"No `{step}()` method defined to run `Trainer.{_STAGE_ENTRY[stage]}` on "
            f"{type(model).__name__}."
        )


# Lightning's private helper names, which its own tests import from this path.
__verify_train_val_loop_configuration = check_fit
__verify_eval_loop_configuration = check_evaluation
