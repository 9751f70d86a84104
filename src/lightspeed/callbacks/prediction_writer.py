"""BasePredictionWriter: write predictions as they are made (each batch), at the end (the epoch),
or both, instead of holding them all in memory.

    class Writer(BasePredictionWriter):
        def write_on_batch_end(self, trainer, pl_module, prediction, batch_indices, batch,
                               batch_idx, dataloader_idx):
            torch.save(prediction, f"{trainer.global_rank}-{batch_idx}.pt")

    trainer.predict(model, loader, return_predictions=False)   # with callbacks=[Writer("batch")]

`batch_indices` are the dataset indices of the batch's samples (this rank's share under a
distributed sampler), as the batch sampler drew them, random order too: `predict` iterates its
loaders through `overrides.distributed._IndexBatchSamplerWrapper`. A loader without a batch sampler
(an iterable dataset) gives [].
"""

from __future__ import annotations

from typing import Any, Literal

from lightspeed.callbacks.callback import Callback
from lightspeed.errors import ConfigError

INTERVALS = ("batch", "epoch", "batch_and_epoch")


class BasePredictionWriter(Callback):
    """Override `write_on_batch_end` (with `write_interval` "batch" or "batch_and_epoch") and/or
    `write_on_epoch_end` ("epoch" or "batch_and_epoch")."""

    def __init__(self, write_interval: Literal["batch", "epoch", "batch_and_epoch"] = "batch"):
        if write_interval not in INTERVALS:
            raise ConfigError(f"`write_interval` should be one of {list(INTERVALS)}.")
        self.interval = write_interval
        self._indices: list[list[list[int]]] = []  # per loader, per batch
        self._loaders: list[Any] = []
        self._predictions: list[list[Any]] = []

    def write_on_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        prediction: Any,
        batch_indices: list[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        raise NotImplementedError

    def write_on_epoch_end(
        self, trainer: Any, pl_module: Any, predictions: list, batch_indices: list
    ) -> None:
        raise NotImplementedError

    def on_predict_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        loaders = trainer.predict_dataloaders
        self._loaders = list(loaders) if isinstance(loaders, (list, tuple)) else [loaders]
        self._indices = [[] for _ in self._loaders]
        self._predictions = [[] for _ in self._loaders]

    def on_predict_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        # predict iterates its loaders through _IndexBatchSamplerWrapper: the batch's samples
        loader = self._loaders[dataloader_idx] if dataloader_idx < len(self._loaders) else None
        seen = getattr(getattr(loader, "batch_sampler", None), "seen_batch_indices", [])
        indices = list(seen[batch_idx]) if batch_idx < len(seen) else []
        if dataloader_idx < len(self._indices):
            self._indices[dataloader_idx].append(indices)
        if self.interval in ("epoch", "batch_and_epoch"):
            self._predictions[dataloader_idx].append(outputs)
        if self.interval in ("batch", "batch_and_epoch"):
            self.write_on_batch_end(
                trainer, pl_module, outputs, indices, batch, batch_idx, dataloader_idx
            )

    def on_predict_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if self.interval not in ("epoch", "batch_and_epoch"):
            return
        done = [len(p) for p in self._predictions]
        indices = [known[:n] for known, n in zip(self._indices, done)]
        predictions = self._predictions[0] if len(self._predictions) == 1 else self._predictions
        self.write_on_epoch_end(trainer, pl_module, predictions, indices)
        self._predictions = []
