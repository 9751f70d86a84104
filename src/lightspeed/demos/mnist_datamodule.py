"""MNIST and a DataModule for it, under the names of `lightning.pytorch.demos.mnist_datamodule`.

    from lightspeed.demos.mnist_datamodule import MNIST, MNISTDataModule

    train = MNIST("./data", train=True)   # 60000 items of ((1, 28, 28) float32, int label)
    Trainer(max_epochs=1).fit(model, datamodule=MNISTDataModule(batch_size=64))

The files are the ones Lightning's demo hosts (processed tensors, in `root/MNIST/complete/`, so a
folder Lightning filled is reused). Offline, with no file on disk, MNIST warns once and serves
synthetic digits instead: seven-segment glyphs of the label, shifted, dimmed and speckled at
random. Each item is drawn from a generator seeded by its index, so the set is deterministic and
nothing is held in memory but the labels.

Where Lightning's behaviour depends on whether torchvision is installed, this module follows what
Lightning does with torchvision where it can, and does the same without it:
- a `transform` is handed a PIL image ("L" mode), as torchvision's MNIST does (a (1, 28, 28)
  float tensor in [0, 1] when Pillow is missing too);
- without a transform the item is a (1, 28, 28) float32 tensor, scaled to [0, 1] and then
  normalized by `normalize` (Lightning's fallback normalizes the raw 0..255 values instead);
- MNISTDataModule yields [0, 1] images, or [-1, 1] with `normalize=True`, with or without
  torchvision (Lightning's fallback ignores the flag).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, random_split

from lightspeed.core.datamodule import LightningDataModule
from lightspeed.demos._download import ensure_file
from lightspeed.utilities.imports import _TORCHVISION_AVAILABLE

__all__ = ["MNIST", "MNISTDataModule"]

_DATASETS_PATH = "./data"
_SIDE = 28


class MNIST(Dataset):
    """The MNIST digits: 60000 training and 10000 test images of 28x28 pixels, labels 0..9.

    Args:
        root: folder holding (or to hold) `MNIST/complete/training.pt` and `test.pt`.
        train: the training split, else the test split.
        normalize: (mean, std) applied to [0, 1] pixels when there is no `transform`; None for
            none.
        download: fetch the split's file when it is not under `root`.
        transform: called on each image (a PIL image); its result is the item's first element.
        target_transform: called on each label.

    Items are (image, label): image as described above, label an int.
    """

    RESOURCES = (
        "https://pl-public-data.s3.amazonaws.com/MNIST/processed/training.pt",
        "https://pl-public-data.s3.amazonaws.com/MNIST/processed/test.pt",
    )
    TRAIN_FILE_NAME = "training.pt"
    TEST_FILE_NAME = "test.pt"
    cache_folder_name = "complete"

    def __init__(
        self,
        root: str | Path,
        train: bool = True,
        normalize: tuple[float, float] | None = (0.1307, 0.3081),
        download: bool = True,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[int], Any] | None = None,
    ) -> None:
        super().__init__()
        self.root = str(root)
        self.train = train
        self.normalize = normalize
        self.transform = transform
        self.target_transform = target_transform
        url = self.RESOURCES[0 if train else 1]
        path = Path(self.cached_folder_path) / os.path.basename(url)
        self.images: Tensor | _SyntheticDigits
        if ensure_file(url, path, download, what="MNIST"):
            self.images, self.targets = torch.load(path, weights_only=True)
        else:
            self.images = _SyntheticDigits(60000 if train else 10000, seed=0 if train else 1)
            self.targets = self.images.targets

    @property
    def cached_folder_path(self) -> str:
        """The folder of the processed files, as Lightning lays it out."""
        return os.path.join(self.root, "MNIST", self.cache_folder_name)

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, idx: int) -> tuple[Any, Any]:
        pixels = self.images[idx]  # (28, 28) uint8
        label = int(self.targets[idx])
        if self.transform is not None:
            image = self.transform(_to_pil(pixels))
        else:
            image = pixels.float().div(255).unsqueeze(0)
            if self.normalize is not None:
                mean, std = self.normalize
                image = (image - mean) / std
        target = self.target_transform(label) if self.target_transform is not None else label
        return image, target


def _to_pil(pixels: Tensor) -> Any:
    """A (28, 28) uint8 tensor as torchvision's MNIST hands it to a transform: a PIL "L" image.
    Without Pillow, a (1, 28, 28) float tensor in [0, 1]."""
    try:
        from PIL import Image
    except ImportError:
        return pixels.float().div(255).unsqueeze(0)
    return Image.fromarray(pixels.numpy())  # 2-D uint8 gives an "L" image


# The seven segments of a digital display as (rows, columns) slices of the 28x28 canvas, and the
# segments lit for each digit.
_SEGMENTS = {
    "top": (slice(5, 7), slice(9, 19)),
    "upper_left": (slice(5, 15), slice(9, 11)),
    "upper_right": (slice(5, 15), slice(17, 19)),
    "middle": (slice(13, 15), slice(9, 19)),
    "lower_left": (slice(13, 23), slice(9, 11)),
    "lower_right": (slice(13, 23), slice(17, 19)),
    "bottom": (slice(21, 23), slice(9, 19)),
}
_DIGIT_SEGMENTS = (
    "top upper_left upper_right lower_left lower_right bottom",
    "upper_right lower_right",
    "top upper_right middle lower_left bottom",
    "top upper_right middle lower_right bottom",
    "upper_left upper_right middle lower_right",
    "top upper_left middle lower_right bottom",
    "top upper_left middle lower_left lower_right bottom",
    "top upper_right lower_right",
    "top upper_left upper_right middle lower_left lower_right bottom",
    "top upper_left upper_right middle lower_right bottom",
)


def _glyphs() -> Tensor:
    """(10, 28, 28) float masks, 1 where digit d's segments are lit."""
    glyphs = torch.zeros(10, _SIDE, _SIDE)
    for digit, names in enumerate(_DIGIT_SEGMENTS):
        for name in names.split():
            rows, cols = _SEGMENTS[name]
            glyphs[digit, rows, cols] = 1.0
    return glyphs


class _SyntheticDigits:
    """`length` deterministic digit images, drawn on demand.

    Labels are drawn once (a small tensor); image i comes from a generator seeded by (seed, i), so
    it is the same whatever the order of access, in any worker process.
    """

    def __init__(self, length: int, seed: int) -> None:
        self.seed = seed
        self.targets = torch.randint(
            10, (length,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64
        )
        self.glyphs = _glyphs()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, idx: int) -> Tensor:
        """Image `idx` as a (28, 28) uint8 tensor."""
        if not 0 <= idx < len(self.targets):
            raise IndexError(f"index {idx} out of range for {len(self.targets)} images")
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + idx)
        shift = torch.randint(-3, 4, (2,), generator=generator)
        brightness = 150 + 105 * torch.rand((), generator=generator)
        glyph = self.glyphs[int(self.targets[idx])].roll(shifts=tuple(shift.tolist()), dims=(0, 1))
        speckle = 60 * torch.rand(_SIDE, _SIDE, generator=generator) ** 4
        return (glyph * brightness + speckle).clamp(0, 255).to(torch.uint8)


class MNISTDataModule(LightningDataModule):
    """MNIST's training split cut into train and validation sets, and its test split.

    Args:
        data_dir: where MNIST is stored (see `MNIST`'s `root`).
        val_split: training images held out for validation.
        num_workers: loader worker processes.
        normalize: map pixels to [-1, 1] rather than [0, 1].
        seed: seed of the train/validation split.
        batch_size: images per batch.

    Every loader drops its last partial batch and pins memory; only the training loader
    shuffles. Batches are ((batch, 1, 28, 28) float32 images, (batch,) int64 labels).
    """

    name = "mnist"

    def __init__(
        self,
        data_dir: str = _DATASETS_PATH,
        val_split: int = 5000,
        num_workers: int = 16,
        normalize: bool = False,
        seed: int = 42,
        batch_size: int = 32,
    ) -> None:
        super().__init__()
        if num_workers and os.name == "nt":
            warnings.warn(
                f"num_workers={num_workers} on Windows starts slow worker processes; using 0."
            )
            num_workers = 0
        self.data_dir = data_dir
        self.val_split = val_split
        self.num_workers = num_workers
        self.normalize = normalize
        self.seed = seed
        self.batch_size = batch_size

    @property
    def num_classes(self) -> int:
        return 10

    def prepare_data(self) -> None:
        """Download both splits into `data_dir` (once, on one process)."""
        MNIST(self.data_dir, train=True, download=True)
        MNIST(self.data_dir, train=False, download=True)

    def setup(self, stage: str) -> None:
        """Split the training images into train and validation sets, the same way every run."""
        dataset = self._dataset(train=True)
        self.dataset_train, self.dataset_val = random_split(
            dataset,
            [len(dataset) - self.val_split, self.val_split],
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.dataset_train, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.dataset_val, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._dataset(train=False), shuffle=False)

    @property
    def default_transforms(self) -> Callable[[Any], Tensor] | None:
        """torchvision's ToTensor (then Normalize to [-1, 1] with `normalize`), or None without
        torchvision, in which case MNIST's own scaling gives the same values."""
        if not _TORCHVISION_AVAILABLE:
            return None
        from torchvision import transforms  # pyright: ignore[reportMissingImports] (optional)

        if self.normalize:
            return transforms.Compose(
                [transforms.ToTensor(), transforms.Normalize(mean=(0.5,), std=(0.5,))]
            )
        return transforms.ToTensor()

    def _dataset(self, train: bool) -> MNIST:
        transform = self.default_transforms
        normalize = (0.5, 0.5) if self.normalize else None  # used only when transform is None
        return MNIST(
            self.data_dir, train=train, download=False, normalize=normalize, transform=transform
        )

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            drop_last=True,
            pin_memory=True,
        )
