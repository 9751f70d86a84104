"""`LightningDataModule`: the data of a run in one object, as in Lightning.

    class MNISTData(LightningDataModule):
        def prepare_data(self): download(...)            # once per node (local rank 0), then every rank waits
        def setup(self, stage): self.train_set = ...      # on every rank; stage is "fit", "validate", "test", "predict"
        def train_dataloader(self): return DataLoader(self.train_set, batch_size=32, shuffle=True)

    trainer.fit(model, datamodule=MNISTData())

Its `state_dict()` travels in every checkpoint (trainer.pt, under "datamodule") and `load_state_dict` restores it
when fit resumes.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from .data import move_to_device
from .distributed import barrier


def prepare_data_once(prepare: Callable[[], None], local_rank: int) -> None:
    """Runs `prepare` on local rank 0 (once per node), then holds every rank at a barrier until it is done."""
    if local_rank == 0:
        prepare()
    barrier()


class LightningDataModule:
    """Override `prepare_data`, `setup(stage)`, the `*_dataloader` methods you need, and `teardown(stage)`.

    `save_hyperparameters` is not provided here; keep the DataModule's arguments as attributes."""

    @property
    def trainer(self) -> Any:
        """The Trainer it was last given to (set when that run starts; None before). A weak reference, as the
        Module's: a DataModule kept by the user does not keep a finished Trainer and its model alive."""
        ref = self.__dict__.get("_trainer_ref")
        return ref() if ref is not None else None

    @trainer.setter
    def trainer(self, trainer: Any) -> None:
        self.__dict__["_trainer_ref"] = weakref.ref(trainer) if trainer is not None else None

    def prepare_data(self) -> None:
        """Download or write to disk: once per node, on local rank 0, before `setup`."""

    def setup(self, stage: str) -> None:
        """Build datasets on every rank; `stage` is "fit", "validate", "test" or "predict"."""

    def train_dataloader(self) -> Any:
        return None

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None

    def teardown(self, stage: str) -> None:
        """After fit / validate / test / predict, on every rank."""

    def state_dict(self) -> dict:
        """What to save in checkpoints (default: nothing)."""
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what `state_dict` returned, when fit resumes from a checkpoint."""

    # Lightning's batch-transfer hooks: one overridden here is used instead of the Module's (hooks.batch_to_device).
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


DataModule = LightningDataModule
