"""OnExceptionCheckpoint: a checkpoint of the moment an exception stops fit, to look at or resume.

Trainer(callbacks=[OnExceptionCheckpoint(dirpath="checkpoints")])   # checkpoints/on_exception
"""

from __future__ import annotations

import os
from typing import Any

from lightspeed.callbacks.callback import Callback


class OnExceptionCheckpoint(Callback):
    """Saves `<dirpath>/<filename>` (a `.ckpt` suffix is kept out of the name: the Trainer's
    checkpoint format decides it) when fit raises. The save is collective, like every
    `trainer.save_checkpoint`: every rank must have raised (a KeyboardInterrupt, a preemption, an
    error every rank hits), else the ranks that raised wait for the others."""

    FILE_EXTENSION = ".ckpt"

    def __init__(self, dirpath: str | os.PathLike, filename: str = "on_exception") -> None:
        self.dirpath = os.fspath(dirpath)
        self.filename = filename

    @property
    def ckpt_path(self) -> str:
        return os.path.join(self.dirpath, self.filename + self.FILE_EXTENSION)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if getattr(trainer, "fitting", True):
            trainer.save_checkpoint(self.ckpt_path)
