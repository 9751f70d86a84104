"""Where a stage's data comes from, resolved once the ranks run: the loaders passed in, else the
DataModule's, else the Module's `*_dataloader` method; and the Lightning rules around them.

- `fit` skips validation when `validation_step` is not overridden (as Lightning does), whatever data
is given.
- `overfit_batches`: the training loader without shuffling, used for validation too.
- Evaluation takes one loader or several (a list, tuple or dict, in order): the step receives
`dataloader_idx`
  when it accepts it, metrics get `/dataloader_idx_N`, and `predict` returns one list per loader.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, SequentialSampler

from lightspeed import hooks
from lightspeed.core.metrics import infer_batch_size
from lightspeed.core.module import Module
from lightspeed.data.loaders import combined, num_batches
from lightspeed.errors import ConfigError
from lightspeed.runtime.rng import rng_state, set_rng_state


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
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        shuffle=False,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
    )


def fit_loaders(
    module: Module, datamodule: Any, train: Any, val: Any, overfit: bool
) -> tuple[Any, list]:
    """(the training loader, the validation loaders) for `fit`. Raises ConfigError when there is no
    training data."""
    source = datamodule if datamodule is not None else module
    train = combined(
        train if train is not None else source.train_dataloader()
    )  # a dict / list: CombinedLoader
    if train is None:
        raise ConfigError(
            f"fit needs training data: pass train_dataloaders= or define train_dataloader() on "
            f"{type(source).__name__}."
        )
    val = as_list(val if val is not None else source.val_dataloader())
    if not hooks.is_overridden(module, "validation_step"):
        return (without_shuffle(train) if overfit else train), []
    if overfit:
        train = without_shuffle(train)
        return train, [train]
    return train, val


def eval_loaders(stage: str, module: Module, datamodule: Any, given: Any) -> list:
    """The loaders of `validate` / `test` / `predict`. Raises ConfigError when there are none."""
    source = datamodule if datamodule is not None else module
    match stage:
        case "validate":
            hook = source.val_dataloader
        case "test":
            hook = source.test_dataloader
        case _:
            hook = source.predict_dataloader
    loaders = as_list(given if given is not None else hook())
    if not loaders:
        raise ConfigError(
            f"{stage} needs data: pass dataloaders= (or datamodule=) or define {hook.__name__}() "
            "on "
            f"{type(source).__name__}."
        )
    return loaders


@torch.no_grad()
def run_batches(
    trainer: Any,
    module: Module,
    loaders: list,
    limit: Any,
    stage: str,
    keep: bool = False,
    cap: int | None = None,
) -> list[list]:
    """The one evaluation batch loop: the stage's step through the strategy for each batch of each
    loader (at most `cap` per loader), with its batch hooks; the outputs per loader if `keep`. The
    step gets `batch_idx` and `dataloader_idx` when its signature takes them; the hooks get
    `dataloader_idx` with several loaders. The caller has put the module in eval mode (its
    `on_<stage>_model_eval` hook)."""
    match stage:
        case "validate":
            step = module.validation_step
        case "test":
            step = module.test_step
        case _:
            step = module.predict_step
    takes_idx, takes_batch_idx = (
        hooks.accepts(step, 3, "dataloader_idx"),
        hooks.accepts(step, 2, "batch_idx"),
    )
    outputs: list[list] = []
    for dl_idx, loader in enumerate(loaders):
        several = (dl_idx,) if len(loaders) > 1 else ()
        trainer.metrics.dataloader_idx = dl_idx if several else None
        n, outputs = (
            min(num_batches(loader, limit), cap if cap is not None else float("inf")),
            [*outputs, []],
        )
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= n:
                break
            batch = hooks.batch_to_device(trainer, module, batch, dl_idx)
            trainer.metrics.batch_size = infer_batch_size(batch)
            hooks.on_eval_batch_start(trainer, module, stage, batch, batch_idx, *several)
            args = (batch, batch_idx)[: 2 if takes_batch_idx else 1] + (
                (dl_idx,) if takes_idx else ()
            )
            out = trainer.strategy.forward(step, *args)
            hooks.on_eval_batch_end(trainer, module, stage, out, batch, batch_idx, *several)
            if keep:
                outputs[-1].append(out)
    trainer.metrics.dataloader_idx = None
    return outputs


def sanity_check(trainer: Any, module: Module, val: list) -> None:
    """Lightning's sanity check: `num_sanity_val_steps` validation batches per loader (-1: all)
    before training, with `trainer.sanity_checking` set, nothing logged, no epoch hooks, and the
    training RNG untouched."""
    steps = trainer.cfg.num_sanity_val_steps
    if not val or steps == 0:
        return
    rng, latest, trainer.sanity_checking = rng_state(), dict(trainer.metrics.latest), True
    trainer.stage = trainer.metrics.stage = "validate"
    for cb in trainer.callbacks:
        cb.on_sanity_check_start(trainer, module)
    module.on_validation_model_eval()
    run_batches(
        trainer,
        module,
        val,
        trainer.cfg.limit_val_batches,
        "validate",
        cap=None if steps == -1 else steps,
    )
    trainer.metrics.discard("validate", latest)
    module.on_validation_model_train()
    for cb in trainer.callbacks:  # still sanity checking, as in Lightning
        cb.on_sanity_check_end(trainer, module)
    set_rng_state(rng)
    trainer.stage, trainer.metrics.stage, trainer.sanity_checking = "train", "train", False
