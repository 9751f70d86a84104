"""Run a function, or print, on global rank 0 only, as Lightning's `rank_zero_only` does.

    @rank_zero_only
    def log_something(): ...          # returns None on the other ranks

The rank is the launch's: the process group's when one is up, else what the launch environment says
(a rank that lightspeed started knows its rank from its first line, before any Trainer exists).
`rank_zero_only.rank = n` overrides it, as in Lightning.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from lightspeed.runtime.launch import read_dist_info

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("lightspeed")
if log.level == logging.NOTSET:  # unless the user chose one: Lightning's INFO, so that its info
    log.setLevel(logging.INFO)  # lines reach the handlers set up (none by default: not printed)


class _RankZeroOnly:
    """The decorator; `.rank` is this process's global rank (settable)."""

    def __init__(self) -> None:
        self._rank: int | None = None

    @property
    def rank(self) -> int:
        if self._rank is not None:
            return self._rank
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return read_dist_info().rank

    @rank.setter
    def rank(self, value: int) -> None:
        self._rank = value

    def __call__(self, fn: F) -> F:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            return fn(*args, **kwargs) if self.rank == 0 else None

        return wrapped  # type: ignore[return-value]


rank_zero_only = _RankZeroOnly()


@rank_zero_only
def rank_zero_info(*args: Any, **kwargs: Any) -> None:
    """logging.info on rank 0."""
    log.info(*args, **kwargs)


@rank_zero_only
def rank_zero_debug(*args: Any, **kwargs: Any) -> None:
    """logging.debug on rank 0."""
    log.debug(*args, **kwargs)


@rank_zero_only
def rank_zero_warn(
    message: str, category: type[Warning] = UserWarning, stacklevel: int = 4, **kwargs: Any
) -> None:
    """warnings.warn on rank 0."""
    warnings.warn(message, category, stacklevel=stacklevel)


@rank_zero_only
def rank_zero_deprecation(message: str, stacklevel: int = 5, **kwargs: Any) -> None:
    """A DeprecationWarning on rank 0."""
    warnings.warn(message, DeprecationWarning, stacklevel=stacklevel)


def rank_prefixed_message(message: str, rank: int | None) -> str:
    """`message` prefixed with `[rank: n]` when the rank is known."""
    return f"[rank: {rank}] {message}" if rank is not None else message


class WarningCache(set):
    """Warns (or logs) each message once per process, on rank 0."""

    def warn(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        if message not in self:
            self.add(message)
            rank_zero_warn(message, stacklevel=stacklevel, **kwargs)

    def deprecation(self, message: str, stacklevel: int = 6, **kwargs: Any) -> None:
        if message not in self:
            self.add(message)
            rank_zero_deprecation(message, stacklevel=stacklevel, **kwargs)

    def info(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        if message not in self:
            self.add(message)
            rank_zero_info(message, stacklevel=stacklevel, **kwargs)
