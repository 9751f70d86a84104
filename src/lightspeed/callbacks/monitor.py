"""Comparing a monitored metric with the best so far, for ModelCheckpoint and EarlyStopping."""

from __future__ import annotations

import math

from lightspeed.errors import ConfigError


def _check_mode(mode: str) -> None:
    if mode not in ("min", "max"):
        raise ConfigError(f"mode={mode!r} is not valid: use 'min' or 'max'.")


def _improved(current: float, best: float | None, mode: str, min_delta: float = 0.0) -> bool:
    if best is None or math.isnan(best):
        return not math.isnan(current)
    return current < best - min_delta if mode == "min" else current > best + min_delta
