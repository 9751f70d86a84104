"""Containers and checks for hyper-parameters: `AttributeDict` (what `self.hparams` is),
`is_picklable`, and `clean_namespace` (drops what cannot travel in a checkpoint)."""

from __future__ import annotations

import pickle
from collections.abc import MutableMapping
from typing import Any

from lightspeed.utilities.rank_zero import rank_zero_warn


class AttributeDict(dict):
    """A dict whose keys read and write as attributes too: `self.hparams.lr`.

    >>> AttributeDict(lr=0.1).lr
    0.1
    """

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"hparams has no {key!r}: it holds {sorted(self)}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError:
            raise AttributeError(f"hparams has no {key!r}") from None

    def __repr__(self) -> str:
        # One `"key":   value` row per key, sorted, as Lightning prints hparams.
        if not self:
            return ""
        width = max(len(str(k)) for k in self) + 3
        rows = [(f'"{k}":', self[k]) for k in sorted(self)]
        return "\n".join(f"{name:{width}s} {value}" for name, value in rows)


def is_picklable(obj: object) -> bool:
    """Whether `pickle.dumps(obj)` works (a lambda or an open file does not)."""
    try:
        pickle.dumps(obj)
    except (pickle.PickleError, AttributeError, RuntimeError, TypeError):
        return False
    return True


def clean_namespace(hparams: MutableMapping) -> None:
    """Removes, with a warning each, the entries of `hparams` that cannot be pickled: a checkpoint
    could not hold them."""
    for key in [k for k, v in hparams.items() if not is_picklable(v)]:
        rank_zero_warn(
            f"Attribute '{key}' removed from hparams because it cannot be pickled. You can "
            f"suppress this warning by setting `self.save_hyperparameters(ignore=['{key}'])`."
        )
        del hparams[key]
