"""`LambdaCallback`: a callback made of functions, one per hook, for a quick probe without a class.

LambdaCallback(on_train_epoch_end=lambda trainer, module: print(trainer.current_epoch))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightspeed.callbacks.callback import Callback

# every hook a callback may have: Callback's methods that the loop calls
HOOKS = frozenset(
    name
    for name, value in vars(Callback).items()
    if callable(value) and (name.startswith("on_") or name in ("setup", "teardown"))
)


class LambdaCallback(Callback):
    """Each keyword names a hook and gives the function to run there, called with the hook's
    arguments (`trainer, module, ...`). A name that is not a hook is a TypeError naming the
    hooks."""

    def __init__(self, **hooks: Callable[..., Any] | None) -> None:
        unknown = sorted(set(hooks) - HOOKS)
        if unknown:
            raise TypeError(
                f"LambdaCallback got {', '.join(map(repr, unknown))}, which is not a hook; the "
                f"hooks are: {', '.join(sorted(HOOKS))}."
            )
        for name, fn in hooks.items():
            if fn is not None:
                setattr(self, name, fn)  # the instance's function replaces the class's no-op
