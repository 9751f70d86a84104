"""Lightning's checkpoint IO plugins. lightspeed's checkpointer writes every checkpoint itself:
collective, to a temporary name renamed into place, checksummed (`checkpoint/`), so only the
default, `TorchCheckpointIO`, is taken; another is refused by the Trainer."""

from __future__ import annotations

from typing import Any


class CheckpointIO:
    """Base class."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class TorchCheckpointIO(CheckpointIO):
    """torch.save / torch.load: what lightspeed does (its own layout)."""


class AsyncCheckpointIO(CheckpointIO):
    """Saving on a background thread: refused (a save here is collective and atomic, and `last`
    moves only after it is complete)."""

    def __init__(self, checkpoint_io: Any = None) -> None:
        self.checkpoint_io = checkpoint_io


class XLACheckpointIO(CheckpointIO):
    """TPU checkpoints: refused."""
