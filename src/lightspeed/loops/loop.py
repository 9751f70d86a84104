"""`_Loop`, at Lightning's path: the base of Lightning's loop classes."""

from __future__ import annotations

from typing import Any

__all__ = ["_Loop"]


class _Loop:
    """A loop knows the Trainer it runs for (`self.trainer`). lightspeed's own loops are functions
    (lightspeed/loop.py); this base is for code written against Lightning's."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
