"""Lightning's layer-sync plugins: `TorchSyncBatchNorm()` is `Trainer(sync_batchnorm=True)`."""

from __future__ import annotations


class LayerSync:
    """Base class. A subclass of your own is refused by the Trainer."""

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class TorchSyncBatchNorm(LayerSync):
    """BatchNorm layers become torch's SyncBatchNorm on more than one rank."""
