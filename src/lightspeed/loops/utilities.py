"""`_no_grad_context`, at Lightning's path (`loops.utilities`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from lightspeed.loops.loop import _Loop

__all__ = ["_no_grad_context"]

F = TypeVar("F", bound=Callable[..., Any])


def _no_grad_context(method: F) -> F:
    """Runs a `_Loop` method under `torch.inference_mode()` when the loop's `inference_mode` is
    True, else under `torch.no_grad()` (the Trainer's `inference_mode` flag picks between them).

    Raises TypeError when decorating a method of something that is not a `_Loop`, or of a loop
    without an `inference_mode` attribute."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self, _Loop):
            raise TypeError(f"`{type(self).__name__}` needs to be a Loop.")
        if not hasattr(self, "inference_mode"):
            raise TypeError(f"`{type(self).__name__}.inference_mode` needs to be defined")
        context = torch.inference_mode if getattr(self, "inference_mode") else torch.no_grad
        with context():
            return method(self, *args, **kwargs)

    return cast(F, wrapper)  # the same signature, wrapped
