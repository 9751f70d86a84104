"""Small models, datamodules and random datasets for tests and quick experiments, under the names
`lightning.pytorch.demos.boring_classes` gives them, so tests written against Lightning's run here
by changing the import.

    from lightspeed.demos.boring_classes import BoringModel, RandomDataset

Every dataset yields float vectors drawn from a standard normal. The data is drawn when the dataset
is built (map-style) or as it is iterated (iterable), in that order, so a seeded run draws the
same numbers as under Lightning. Loaders are built with DataLoader's defaults (batch size 1, no
shuffling). These are for testing and debugging: their shapes and defaults are a contract that
tests assert on, so they stay fixed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from lightspeed.core.datamodule import LightningDataModule
from lightspeed.core.module import LightningModule

__all__ = [
    "BoringDataModule",
    "BoringDataModuleNoLen",
    "BoringModel",
    "DemoModel",
    "IterableBoringDataModule",
    "ManualOptimBoringModel",
    "Net",
    "RandomDataset",
    "RandomDictDataset",
    "RandomIterableDataset",
    "RandomIterableDatasetWithLen",
]

# The width of every boring sample and the length of each of BoringModel's loaders.
_WIDTH = 32
_LENGTH = 64


# ----------------------------------------------------------------------------------- datasets
class RandomDataset(Dataset):
    """`length` random vectors of `size` floats, drawn once when built; item i is row i of
    `self.data`."""

    def __init__(self, size: int, length: int):
        self.len = length
        self.data = torch.randn(length, size)

    def __len__(self) -> int:
        return self.len

    def __getitem__(self, index: int) -> Tensor:
        return self.data[index]


class RandomDictDataset(Dataset):
    """As RandomDataset, but item i is a dict: "a" is row i, "b" is row i plus 2."""

    def __init__(self, size: int, length: int):
        self.len = length
        self.data = torch.randn(length, size)

    def __len__(self) -> int:
        return self.len

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        row = self.data[index]
        return {"a": row, "b": row + 2}


class RandomIterableDataset(IterableDataset):
    """An iterable of `count` fresh random vectors of `size` floats per pass, with no `__len__`."""

    def __init__(self, size: int, count: int):
        self.size = size
        self.count = count

    def __iter__(self) -> Iterator[Tensor]:
        return (torch.randn(self.size) for _ in range(self.count))


class RandomIterableDatasetWithLen(IterableDataset):
    """As RandomIterableDataset (not a subclass of it), but `len()` reports `count`."""

    def __init__(self, size: int, count: int):
        self.size = size
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[Tensor]:
        return (torch.randn(self.size) for _ in range(len(self)))


# ----------------------------------------------------------------------------------- models
class BoringModel(LightningModule):
    """One `Linear(32, 2)` trained to output ones (mean squared error), with every loader and step
    defined: subclass it and override only what a test is about.

    training_step returns {"loss": loss}, validation_step {"x": loss}, test_step {"y": loss};
    predict_step is the Module's default (the forward pass). The optimizer is SGD (lr 0.1) with a
    StepLR(step_size=1) scheduler, returned as ([optimizer], [scheduler]). Each of the four loaders
    is a DataLoader over a fresh RandomDataset(32, 64), batch size 1.
    """

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(_WIDTH, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)

    def loss(self, preds: Tensor, labels: Tensor | None = None) -> Tensor:
        """Mean squared error against `labels`, or against ones when there are none: a loss
        that gives the weights something to learn whatever the input."""
        target = torch.ones_like(preds) if labels is None else labels
        return F.mse_loss(preds, target)

    def step(self, batch: Any) -> Tensor:
        return self.loss(self(batch))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return {"loss": self.step(batch)}

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return {"x": self.step(batch)}

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        return {"y": self.step(batch)}

    def configure_optimizers(self) -> Any:
        sgd = torch.optim.SGD(self.parameters(), lr=0.1)
        return [sgd], [torch.optim.lr_scheduler.StepLR(sgd, step_size=1)]

    @staticmethod
    def _random_loader() -> DataLoader:
        return DataLoader(RandomDataset(_WIDTH, _LENGTH))

    def train_dataloader(self) -> DataLoader:
        return self._random_loader()

    def val_dataloader(self) -> DataLoader:
        return self._random_loader()

    def test_dataloader(self) -> DataLoader:
        return self._random_loader()

    def predict_dataloader(self) -> DataLoader:
        return self._random_loader()


class ManualOptimBoringModel(BoringModel):
    """BoringModel under manual optimization: each training_step zeroes the gradients, calls
    `manual_backward(loss)`, steps the one optimizer and returns the loss tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        optimizer = self.optimizers()
        assert callable(getattr(optimizer, "step", None)), f"not an optimizer: {optimizer!r}"
        loss = self.step(batch)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


class DemoModel(LightningModule):
    """A `Linear(32, out_dim)` followed by ReLU (inputs are flattened to (batch, 32) first), whose
    training_step returns the sum of the outputs; Adam at `learning_rate`. It defines no loaders:
    pair it with BoringDataModule."""

    def __init__(self, out_dim: int = 10, learning_rate: float = 0.02):
        super().__init__()
        self.l1 = nn.Linear(_WIDTH, out_dim)
        self.learning_rate = learning_rate

    def forward(self, x: Tensor) -> Tensor:
        return torch.relu(self.l1(x.view(x.size(0), -1)))

    def training_step(self, batch: Any, batch_nb: int) -> Any:
        return self(batch).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=self.learning_rate)


class Net(nn.Module):
    """A plain torch MNIST classifier (no Lightning hooks) for (N, 1, 28, 28) inputs: two 3x3
    convolutions (32 and 64 channels) with ReLU, a 2x2 max-pool, dropout 0.25, Linear(9216, 128)
    with ReLU, dropout 0.5, Linear(128, 10); returns log-probabilities over the 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: Tensor) -> Tensor:
        features = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        hidden = F.relu(self.fc1(torch.flatten(self.dropout1(features), 1)))
        return F.log_softmax(self.fc2(self.dropout2(hidden)), dim=1)


# ----------------------------------------------------------------------------------- datamodules
class BoringDataModule(LightningDataModule):
    """256 random vectors of 32 floats (`self.random_full`, drawn when built), cut into four
    consecutive Subsets of 64: train, val, test, predict. `setup(stage)` makes the ones the stage
    needs: "fit" train and val, "validate" val, "test" test, "predict" predict (as
    `self.random_train`, `random_val`, `random_test`, `random_predict`). Loaders have batch size 1.
    """

    def __init__(self) -> None:
        super().__init__()
        self.random_full = RandomDataset(_WIDTH, _LENGTH * 4)

    def _part(self, i: int) -> Subset:
        return Subset(self.random_full, indices=range(_LENGTH * i, _LENGTH * (i + 1)))

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.random_train = self._part(0)
        if stage in ("fit", "validate"):
            self.random_val = self._part(1)
        if stage == "test":
            self.random_test = self._part(2)
        if stage == "predict":
            self.random_predict = self._part(3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.random_train)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.random_val)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.random_test)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.random_predict)


class BoringDataModuleNoLen(LightningDataModule):
    """BoringDataModule's shape over RandomIterableDatasets, so no loader has a length: 512 train,
    128 val, 256 test and 64 predict samples of 32 floats, made by `setup(stage)` as in
    BoringDataModule."""

    _COUNTS = {"train": 512, "val": 128, "test": 256, "predict": 64}

    def __init__(self) -> None:
        super().__init__()

    def _make(self, split: str) -> RandomIterableDataset:
        return RandomIterableDataset(_WIDTH, self._COUNTS[split])

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.random_train = self._make("train")
        if stage in ("fit", "validate"):
            self.random_val = self._make("val")
        if stage == "test":
            self.random_test = self._make("test")
        if stage == "predict":
            self.random_predict = self._make("predict")

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.random_train)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.random_val)

    def test_dataloader(self) -> DataLoader:
        return DataLoader(self.random_test)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.random_predict)


class IterableBoringDataModule(LightningDataModule):
    """Two loaders per stage, a map-style RandomDataset and a RandomIterableDataset of the same
    length, of 4-float vectors: 16 samples each for train, 32 for val, 64 for test, 128 for
    predict. Each `*_dataloader` returns the list of the two loaders (batch size 1)."""

    _LENGTHS = {"train": 16, "val": 32, "test": 64, "predict": 128}

    def __init__(self) -> None:
        super().__init__()

    def _pair(self, split: str) -> list[Dataset]:
        n = self._LENGTHS[split]
        return [RandomDataset(4, n), RandomIterableDataset(4, n)]

    def setup(self, stage: str) -> None:
        if stage == "fit":
            self.train_datasets = self._pair("train")
        if stage in ("fit", "validate"):
            self.val_datasets = self._pair("val")
        if stage == "test":
            self.test_datasets = self._pair("test")
        if stage == "predict":
            self.predict_datasets = self._pair("predict")

    @staticmethod
    def _loaders(datasets: list[Dataset]) -> list[DataLoader]:
        return [DataLoader(d) for d in datasets]

    def train_dataloader(self) -> list[DataLoader]:
        return self._loaders(self.train_datasets)

    def val_dataloader(self) -> list[DataLoader]:
        return self._loaders(self.val_datasets)

    def test_dataloader(self) -> list[DataLoader]:
        return self._loaders(self.test_datasets)

    def predict_dataloader(self) -> list[DataLoader]:
        return self._loaders(self.predict_datasets)
