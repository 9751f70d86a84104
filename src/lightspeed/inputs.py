"""Checks of user inputs that need the Trainer's own classes (the flags themselves are checked in
config.py)."""

from __future__ import annotations

from typing import Any

from lightspeed.callbacks import Callback
from lightspeed.errors import ConfigError


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
