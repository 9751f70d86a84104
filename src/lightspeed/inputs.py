"""Checks of user inputs that need the Trainer's own classes (the flags themselves are checked in config.py)."""

from __future__ import annotations

from typing import Any

from .callbacks import Callback
from .errors import ConfigError


def checked_callbacks(callbacks: Any) -> list[Callback]:
    """`callbacks` as a new list; ConfigError unless it is None or a list/tuple of lightspeed Callback objects."""
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise ConfigError(f"callbacks={callbacks!r} is not valid: pass a list of callbacks, e.g. "
                          f"callbacks=[{type(callbacks).__name__}(...)].")
    for i, cb in enumerate(callbacks):
        if not isinstance(cb, Callback):
            hint = " (pass an instance, not the class)" if isinstance(cb, type) and issubclass(cb, Callback) else ""
            raise ConfigError(f"callbacks[{i}]={cb!r} is not valid: expected a lightspeed.Callback instance"
                              f"{hint}; Lightning callbacks need porting to lightspeed.Callback.")
    return list(callbacks)
