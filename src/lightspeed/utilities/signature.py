"""Which arguments a user's hook takes: Lightning passes `batch_idx` (and `dataloader_idx`) only to
a step whose signature has room for them (its `is_param_in_hook_signature`), so `training_step(self,
batch)` is valid."""

from __future__ import annotations

import inspect
from collections.abc import Callable


def accepts(fn: Callable, n: int, name: str) -> bool:
    """Whether `fn` takes an n-th positional argument (or has a parameter called `name`, or
    *args)."""
    params = list(inspect.signature(fn).parameters.values())
    if any(p.kind is p.VAR_POSITIONAL for p in params) or any(p.name == name for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= n


def requires(fn: Callable, name: str) -> bool:
    """Whether `fn` has a parameter called `name` without a default (it must be passed)."""
    param = inspect.signature(fn).parameters.get(name)
    return (
        param is not None and param.default is param.empty and param.kind is not param.VAR_KEYWORD
    )
