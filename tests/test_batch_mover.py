"""How batches reach the device (data.BatchMover, `Trainer(pin_memory=...)`).

On CPU the mover must be a pass-through: the user's loader object itself, batches moved as before. On CUDA (the
`gpu` tests) batches come from page-locked memory over a side stream: the values and the nesting must be those
of the loader, the user's DataLoader must be left as it was, and the losses must equal the unpinned run's.
"""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
from lightspeed.data import BatchMover, map_tensors
from lightspeed.errors import ConfigError
from test_trainer import make_trainer

Pair = namedtuple("Pair", "x y")


def _nested(n: int = 3) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"images": torch.randn(n, 3, 8, 8, generator=g), "parts": [Pair(torch.arange(n), torch.ones(n, 2))],
            "name": "batch", "scale": 0.5}


def test_pin_memory_flag_is_validated():
    with pytest.raises(ConfigError, match="pin_memory='yes' is not valid: use True"):
        ls.Trainer(pin_memory="yes")
    assert ls.Trainer(pin_memory=False, logger=False).cfg.pin_memory is False
    assert ls.Trainer(logger=False).cfg.pin_memory is True  # the default


def test_map_tensors_keeps_the_nesting():
    batch = _nested()
    doubled = map_tensors(batch, lambda t: t * 2)
    assert set(doubled) == set(batch) and doubled["name"] == "batch" and doubled["scale"] == 0.5
    assert isinstance(doubled["parts"], list) and isinstance(doubled["parts"][0], Pair)
    assert torch.equal(doubled["images"], batch["images"] * 2)
    assert torch.equal(doubled["parts"][0].x, batch["parts"][0].x * 2)


def test_on_cpu_the_mover_passes_loaders_and_batches_through(tmp_path):
    """No stream, no copy of the loader (on CPU there is nothing to pin), and fit trains on the user's loader."""
    mover = BatchMover(torch.device("cpu"), pinned=True, print0=lambda msg: pytest.fail(msg))
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    assert mover.stream is None and mover.loader(loader) is loader
    batch = _nested()
    moved = mover(batch)
    assert moved["images"] is batch["images"]  # already on the device: `.to` returns the tensor itself
    trainer = make_trainer(tmp_path, max_steps=2)
    from test_trainer import Regress, regression_data
    data = regression_data()
    trainer.fit(Regress(), data)
    assert trainer._train_data is data and not data.pin_memory


@pytest.mark.gpu
def test_on_cuda_batches_arrive_pinned_and_intact_and_the_user_loader_is_untouched():
    """The DataLoader is iterated as a pinned copy; many batches through the side stream, each checked on the
    compute stream right away (a batch freed or overwritten too early would show as a wrong sum)."""
    device = torch.device("cuda", 0)
    said: list[str] = []
    mover = BatchMover(device, pinned=True, print0=said.append)
    data = TensorDataset(torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0)), torch.arange(64))
    user = DataLoader(data, batch_size=4, shuffle=False)
    pinned = mover.loader(user)
    assert pinned is not user and pinned.pin_memory and not user.pin_memory
    assert mover.loader(pinned) is pinned and len(said) == 1 and "Trainer(pin_memory=False)" in said[0]
    for epoch in range(3):
        for (x, i), (x_ref, i_ref) in zip(pinned, user):
            assert x.is_pinned()
            x_dev, i_dev = mover((x, i))
            assert x_dev.device == device and i_dev.device == device
            assert torch.equal(i_dev.cpu(), i_ref)
            assert torch.allclose(x_dev.sum(dim=(1, 2, 3)).cpu(), x_ref.sum(dim=(1, 2, 3)), rtol=1e-5, atol=1e-4)
    # Not from a DataLoader: pageable tensors are pinned on the way; the nesting comes back as it went in.
    batch = _nested()
    moved = mover(batch)
    assert moved["images"].device == device and isinstance(moved["parts"][0], Pair) and moved["name"] == "batch"
    assert torch.equal(moved["images"].cpu(), batch["images"]) and torch.equal(moved["parts"][0].y.cpu(),
                                                                               batch["parts"][0].y)


class _Vision(ls.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                         torch.nn.Flatten(), torch.nn.Linear(8, 10))
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.gpu
def test_pinned_and_unpinned_runs_have_the_same_losses(tmp_path):
    """Float inputs from a shuffling DataLoader, 12 steps on one GPU: per-step losses with pin_memory on and off
    agree to 1e-6 relative (the same data and kernels: only the copy's path differs)."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 3, 16, 16, generator=g), torch.randint(0, 10, (96,), generator=g))
    runs = {}
    for pin in (True, False):
        module = _Vision()
        loader = DataLoader(data, batch_size=8, shuffle=True)
        ls.Trainer(devices=1, accelerator="gpu", max_steps=12, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, seed=0, pin_memory=pin, default_root_dir=str(tmp_path)).fit(module,
                                                                                                         loader)
        runs[pin] = module.losses
        assert not loader.pin_memory  # the user's loader as it was
    assert len(runs[True]) == 12
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(runs[True], runs[False])), runs
