"""`LightningDataModule`: the data of a run in one object, as in Lightning.

    class MNISTData(LightningDataModule):
        def prepare_data(self): download(...)            # once per node (local rank 0), then every
        rank waits def setup(self, stage): self.train_set = ...      # on every rank; stage is
        "fit", "validate", "test", "predict" def train_dataloader(self): return
        DataLoader(self.train_set, batch_size=32, shuffle=True)

    trainer.fit(model, datamodule=MNISTData())

Its `state_dict()` travels in every checkpoint (trainer.pt, under "datamodule") and
`load_state_dict` restores it when fit resumes.
"""

from __future__ import annotations

import inspect
import os
import weakref
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

import lightspeed.core.saving as _hparams
from lightspeed.core.mixins import HyperparametersMixin
from lightspeed.data.loaders import move_to_device
from lightspeed.runtime.distributed import barrier


def prepare_data_once(prepare: Callable[[], None], local_rank: int) -> None:
    """Runs `prepare` on local rank 0 (once per node; pass the global rank for once in all), then
    holds every rank at a barrier until it is done."""
    if local_rank == 0:
        prepare()
    barrier()


class LightningDataModule(HyperparametersMixin):
    """Override `prepare_data`, `setup(stage)`, the `*_dataloader` methods you need, and
    `teardown(stage)`.

    `save_hyperparameters()` in `__init__` keeps its arguments in `self.hparams`, as the Module's
    does; fit sends them to the loggers with the Module's. `prepare_data_per_node = False` runs
    `prepare_data` once in all (global rank 0) rather than once per node."""

    prepare_data_per_node = True
    CHECKPOINT_HYPER_PARAMS_KEY = _hparams.DATAMODULE_HPARAMS_KEY  # Lightning's key
    CHECKPOINT_HYPER_PARAMS_NAME = _hparams.DATAMODULE_HPARAMS_NAME
    CHECKPOINT_HYPER_PARAMS_TYPE = "hparams_type"

    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: Any, map_location: Any = None, **kwargs: Any
    ) -> LightningDataModule:
        """Rebuilds the DataModule from a checkpoint's hyper-parameters (`kwargs` override them)
        and restores its `state_dict`; `map_location` is accepted for Lightning's signature (a
        DataModule holds no tensors)."""
        return _hparams.load_datamodule_from_checkpoint(cls, checkpoint_path, **kwargs)

    @classmethod
    def from_datasets(
        cls,
        train_dataset: Any = None,
        val_dataset: Any = None,
        test_dataset: Any = None,
        predict_dataset: Any = None,
        batch_size: int = 1,
        num_workers: int = 0,
        **datamodule_kwargs: Any,
    ) -> LightningDataModule:
        """Lightning's shortcut: a DataModule whose loaders batch the given datasets (the training
        one shuffled; a list of datasets gives a list of loaders)."""

        def loaders(data: Any, shuffle: bool) -> Any:
            if isinstance(data, (list, tuple)):
                return [loaders(d, shuffle) for d in data]
            return DataLoader(data, batch_size=batch_size, shuffle=shuffle, num_workers=num_workers)

        # batch_size / num_workers also reach __init__ when it takes them (or **kwargs)
        params = inspect.signature(cls).parameters
        takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        for name, value in (("batch_size", batch_size), ("num_workers", num_workers)):
            if takes_all or name in params:
                datamodule_kwargs.setdefault(name, value)
        dm = cls(**datamodule_kwargs)
        for hook, data, shuffle in (
            ("train_dataloader", train_dataset, True),
            ("val_dataloader", val_dataset, False),
            ("test_dataloader", test_dataset, False),
            ("predict_dataloader", predict_dataset, False),
        ):
            if data is not None:
                setattr(dm, hook, lambda data=data, shuffle=shuffle: loaders(data, shuffle))
        return dm

    @property
    def trainer(self) -> Any:
        """The Trainer it was last given to (set when that run starts; None before). A weak
        reference, as the Module's: a DataModule kept by the user does not keep a finished Trainer
        and its model alive."""
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

    def __str__(self) -> str:
        """The size of each stage's datasets as its loaders give them now, one line per stage
        (Lightning's form: `{Train dataloader: size=64}`; `None` before `setup` made them; `NA` for
        a dataset without a length; `1. size=16 ; 2. size=NA` for several loaders)."""
        lines = []
        for title, hook in (
            ("Train", "train_dataloader"),
            ("Validation", "val_dataloader"),
            ("Test", "test_dataloader"),
            ("Predict", "predict_dataloader"),
        ):
            try:
                loaders = getattr(self, hook)()
            except Exception:  # a dataset setup() has not built yet: nothing to describe
                loaders = None
            lines.append(f"{{{title} dataloader: {_sizes(loaders)}}}")
        return os.linesep.join(lines)

    def state_dict(self) -> dict:
        """What to save in checkpoints (default: nothing)."""
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restores what `state_dict` returned, when fit resumes from a checkpoint."""

    # Lightning's batch-transfer hooks: one overridden here is used instead of the Module's
    # (hooks.batch_to_device).
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return batch


def _sizes(loaders: Any) -> str:
    """`size=N` of one loader's dataset (`NA` without a length), numbered for several."""
    if loaders is None:
        return "None"
    loaders = getattr(loaders, "iterables", loaders)  # a CombinedLoader: its loaders
    if isinstance(loaders, dict):
        loaders = list(loaders.values())
    if not isinstance(loaders, (list, tuple)):
        loaders = [loaders]

    def size(loader: Any) -> str:
        data = getattr(loader, "dataset", loader)
        return f"size={len(data)}" if hasattr(data, "__len__") else "size=NA"

    if len(loaders) == 1:
        return size(loaders[0])
    return " ; ".join(f"{i}. {size(loader)}" for i, loader in enumerate(loaders, 1))


DataModule = LightningDataModule
