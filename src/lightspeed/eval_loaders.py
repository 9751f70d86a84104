"""Where a stage's data comes from, resolved once the ranks run: the loaders passed in, else the
DataModule's, else the Module's `*_dataloader` method; and the Lightning rules around them.

    train, val = fit_loaders(module, datamodule, train_given, val_given, overfit)   # loop.fit
    loaders = eval_loaders(Stage.TEST, module, datamodule, given)  # loop.prepare_evaluation

- `fit` skips validation when `validation_step` is not overridden (as Lightning does), whatever
  data is given.
- `overfit_batches`: the training loader without shuffling, used for validation too.
- Evaluation takes one loader or several (a list, tuple or dict, in order): the step receives
  `dataloader_idx` when it accepts it, metrics get `/dataloader_idx_N`, and `predict` returns one
  list per loader.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import DataLoader, SequentialSampler

from lightspeed.core.module import Module
from lightspeed.data.loaders import combined
from lightspeed.errors import ConfigError
from lightspeed.hooks import is_overridden
from lightspeed.specs import Stage
from lightspeed.utilities.rank_zero import rank_zero_warn
from lightspeed.utilities.signature import accepts, requires


def as_list(loaders: Any) -> list:
    """One loader or several (list, tuple, dict values in order) as a list; None as []."""
    if loaders is None:
        return []
    if isinstance(loaders, dict):
        return list(loaders.values())
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    return [loaders]


def without_shuffle(loader: Any) -> Any:
    """The same DataLoader with a sequential sampler (other loaders unchanged): `overfit_batches`
    sees the same batches every epoch."""
    if (
        not isinstance(loader, DataLoader)
        or isinstance(loader.sampler, SequentialSampler)
        or (loader.batch_sampler is None or type(loader.batch_sampler).__name__ != "BatchSampler")
    ):
        return loader
    rank_zero_warn(
        "You requested to overfit but enabled train dataloader shuffling: overfit_batches takes "
        "the same first batches every epoch, so the loader is iterated in order (a "
        "SequentialSampler) instead."
    )
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        shuffle=False,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
    )


def from_hook(source: Any, name: str) -> Any:
    """What `source.<name>()` returns; None when the hook is set to None (switched off, as in
    Lightning: `model.val_dataloader = None`)."""
    hook = getattr(source, name, None)
    return hook() if hook is not None else None


def fit_loaders(
    module: Module, datamodule: Any, train: Any, val: Any, overfit: bool
) -> tuple[Any, list]:
    """(the training loader, the validation loaders) for `fit`. Raises ConfigError when there is no
    training data."""
    source = datamodule if datamodule is not None else module
    train = combined(
        train if train is not None else from_hook(source, "train_dataloader")
    )  # a dict / list: CombinedLoader
    if train is None:
        raise ConfigError(
            f"fit needs training data: pass train_dataloaders= or define train_dataloader() on "
            f"{type(source).__name__}."
        )
    val = as_list(val if val is not None else from_hook(source, "val_dataloader"))
    if not is_overridden(module, "validation_step"):
        return (without_shuffle(train) if overfit else train), []
    if overfit:
        train = without_shuffle(train)
        return train, [train]
    return train, val


def eval_loaders(stage: Stage, module: Module, datamodule: Any, given: Any) -> list:
    """The loaders of `validate` / `test` / `predict`. Raises ConfigError when there are none."""
    source = datamodule if datamodule is not None else module
    match stage:
        case Stage.VALIDATE:
            hook = "val_dataloader"
        case Stage.TEST:
            hook = "test_dataloader"
        case _:
            hook = "predict_dataloader"
    loaders = as_list(given if given is not None else from_hook(source, hook))
    if not loaders:
        raise ConfigError(
            f"{stage} needs data: pass dataloaders= (or datamodule=) or define {hook}() "
            f"on {type(source).__name__}."
        )
    return loaders


_HOOKS = {
    Stage.VALIDATE: ("validation", "val"),
    Stage.SANITY_CHECK: ("validation", "val"),
    Stage.TEST: ("test", "test"),
    Stage.PREDICT: ("predict", "predict"),
}


def check_dataloader_idx(module: Module, stage: Stage, several: bool) -> None:
    """Lightning's rule for `dataloader_idx` in the Module's step and batch hooks of `stage`: with
    several loaders each must take it (a parameter of that name, a positional one after the
    others, or `*args`); with one, none may require it (give it a default). Raises RuntimeError
    naming the hook."""
    prefix, loader = _HOOKS[stage]
    for name in (f"{prefix}_step", f"on_{prefix}_batch_start", f"on_{prefix}_batch_end"):
        if not is_overridden(module, name):
            continue
        hook = getattr(module, name)
        where = f"`{type(module).__name__}.{name}()`"
        position = 4 if name.endswith("_end") else 3  # after (outputs,) batch, batch_idx
        if several and not accepts(hook, position, "dataloader_idx"):
            raise RuntimeError(
                f"You provided multiple `{loader}_dataloader`, but no `dataloader_idx` argument in "
                f"{where}: add `dataloader_idx=0` to its signature."
            )
        if not several and requires(hook, "dataloader_idx"):
            raise RuntimeError(
                f"You provided only a single `{loader}_dataloader`, but have included "
                f"`dataloader_idx` in {where}: remove it or give it a default value."
            )
