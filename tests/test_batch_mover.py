"""How batches reach the device (data.BatchMover, `Trainer(pin_memory=...)`).

On CPU the mover must be a pass-through: the user's loader object itself, batches moved as before.
On CUDA (the `gpu` tests) batches come from page-locked memory over a side stream: the values and
the nesting must be those of the loader, the user's DataLoader must be left as it was, and the
losses must equal the unpinned run's.
"""

from __future__ import annotations

import statistics
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
from lightspeed.data.loaders import BatchMover, map_tensors
from lightspeed.errors import ConfigError
from test_trainer import make_trainer

Pair = namedtuple("Pair", "x y")


def _nested(n: int = 3) -> dict:
    g = torch.Generator().manual_seed(n)
    return {
        "images": torch.randn(n, 3, 8, 8, generator=g),
        "parts": [Pair(torch.arange(n), torch.ones(n, 2))],
        "name": "batch",
        "scale": 0.5,
    }


def test_pin_memory_flag_is_validated():
    with pytest.raises(ConfigError, match="pin_memory='yes' is not valid: use True"):
        ls.Trainer(pin_memory="yes")
    assert ls.Trainer(pin_memory=False, logger=False).config.data.pin_memory is False
    assert ls.Trainer(logger=False).config.data.pin_memory is True  # the default


def test_map_tensors_keeps_the_nesting():
    batch = _nested()
    doubled = map_tensors(batch, lambda t: t * 2)
    assert set(doubled) == set(batch) and doubled["name"] == "batch" and doubled["scale"] == 0.5
    assert isinstance(doubled["parts"], list) and isinstance(doubled["parts"][0], Pair)
    assert torch.equal(doubled["images"], batch["images"] * 2)
    assert torch.equal(doubled["parts"][0].x, batch["parts"][0].x * 2)


def test_on_cpu_the_mover_passes_loaders_and_batches_through(tmp_path):
    """No stream, no copy of the loader (on CPU there is nothing to pin), and fit trains on the
    user's loader."""
    mover = BatchMover(torch.device("cpu"), pinned=True, print0=lambda msg: pytest.fail(msg))
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    assert mover.stream is None and mover.loader(loader) is loader
    batch = _nested()
    moved = mover(batch)
    assert (
        moved["images"] is batch["images"]
    )  # already on the device: `.to` returns the tensor itself
    trainer = make_trainer(tmp_path, max_steps=2)
    from test_trainer import Regress, regression_data

    data = regression_data()
    trainer.fit(Regress(), data)
    assert trainer.train_dataloader is data and not data.pin_memory


def test_which_loaders_are_iterated_as_a_pinned_copy():
    """Under pinning (a mover with a copy stream; none is made on CPU, so a stand-in marks it here):
    only a DataLoader with workers that does not pin gets a pinned copy. Without workers the loader
    is kept (it would pin in the main thread as the mover does, and a dataset of CUDA tensors cannot
    be pinned)."""
    said: list[str] = []
    mover = BatchMover(torch.device("cpu"), pinned=True, print0=said.append)
    mover.stream = (
        object()
    )  # what a CUDA device would give: only `loader`'s choice is exercised here
    data = TensorDataset(torch.randn(8, 4))
    with_workers, without = (
        DataLoader(data, batch_size=4, num_workers=2),
        DataLoader(data, batch_size=4),
    )
    already = DataLoader(data, batch_size=4, num_workers=2, pin_memory=True)
    copied = mover.loader(with_workers)
    assert copied is not with_workers and copied.pin_memory and not with_workers.pin_memory
    assert copied.dataset is data and copied.num_workers == 2 and copied.batch_size == 4
    assert mover.loader(without) is without and mover.loader(already) is already
    assert mover.loader([1, 2]) == [1, 2] and len(said) == 1


@pytest.mark.gpu
def test_on_cuda_batches_arrive_pinned_and_intact_and_the_user_loader_is_untouched():
    """A DataLoader with workers is iterated as a pinned copy; many batches through the side stream,
    each checked on the compute stream right away (a batch freed or overwritten too early would show
    as a wrong sum). A dataset already on the GPU passes untouched."""
    device = torch.device("cuda", 0)
    said: list[str] = []
    mover = BatchMover(device, pinned=True, print0=said.append)
    data = TensorDataset(
        torch.randn(64, 3, 32, 32, generator=torch.Generator().manual_seed(0)), torch.arange(64)
    )
    user = DataLoader(data, batch_size=4, shuffle=False, num_workers=2)
    pinned = mover.loader(user)
    assert pinned is not user and pinned.pin_memory and not user.pin_memory
    assert (
        mover.loader(pinned) is pinned and len(said) == 1 and "Trainer(pin_memory=False)" in said[0]
    )
    for epoch in range(3):
        for (x, i), (x_ref, i_ref) in zip(pinned, user):
            assert x.is_pinned()
            x_dev, i_dev = mover((x, i))
            assert x_dev.device == device and i_dev.device == device
            assert torch.equal(i_dev.cpu(), i_ref)
            assert torch.allclose(
                x_dev.sum(dim=(1, 2, 3)).cpu(), x_ref.sum(dim=(1, 2, 3)), rtol=1e-5, atol=1e-4
            )
    # A dataset already on the GPU (no workers): the loader is kept as it is, and its tensors are
    # not copied.
    on_gpu = DataLoader(TensorDataset(torch.arange(8.0, device=device)), batch_size=4)
    assert mover.loader(on_gpu) is on_gpu
    (x,) = next(iter(on_gpu))
    assert mover([x])[0] is x
    # Not from a DataLoader: pageable tensors are pinned on the way; the nesting comes back as it
    # went in.
    batch = _nested()
    moved = mover(batch)
    assert (
        moved["images"].device == device
        and isinstance(moved["parts"][0], Pair)
        and moved["name"] == "batch"
    )
    assert torch.equal(moved["images"].cpu(), batch["images"]) and torch.equal(
        moved["parts"][0].y.cpu(), batch["parts"][0].y
    )


class _Vision(ls.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 10),
        )
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
    """Float inputs from a shuffling DataLoader, 12 steps on one GPU: per-step losses with
    pin_memory on and off agree to 1e-6 relative (the same data and kernels: only the copy's path
    differs)."""
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(
        torch.randn(96, 3, 16, 16, generator=g), torch.randint(0, 10, (96,), generator=g)
    )
    runs = {}
    for pin in (True, False):
        module = _Vision()
        loader = DataLoader(data, batch_size=8, shuffle=True)
        ls.Trainer(
            devices=1,
            accelerator="gpu",
            max_steps=12,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            seed=0,
            pin_memory=pin,
            default_root_dir=str(tmp_path),
        ).fit(module, loader)
        runs[pin] = module.losses
        assert not loader.pin_memory  # the user's loader as it was
    assert len(runs[True]) == 12
    assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(runs[True], runs[False])), runs


# ---------------------------------------------------------------- Lightning's batch-transfer hooks
class Tagged:
    """A batch type of the user's own: `transfer_batch_to_device` is how Lightning moves it."""

    def __init__(self, x, y):
        self.x, self.y = x, y


class TransferHooks(ls.Module):
    """Records each transfer hook (with the trainer's state flags) and what the steps then see. The
    `on_after` hook scales x by 10 on the device, so a step that did not get its batch would train
    on other numbers."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.calls: list[tuple] = []

    def _state(self):
        t = self.trainer
        return "".join(
            k
            for k, v in (
                ("T", t.training),
                ("V", t.validating),
                ("S", t.testing),
                ("P", t.predicting),
            )
            if v
        )

    def on_before_batch_transfer(self, batch, dataloader_idx):
        x, y = batch
        self.calls.append(("before", dataloader_idx, self._state(), x.device.type))
        return Tagged(x, y)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        self.calls.append(("transfer", dataloader_idx, self._state(), str(device)))
        return Tagged(batch.x.to(device), batch.y.to(device))

    def on_after_batch_transfer(self, batch, dataloader_idx):
        self.calls.append(("after", dataloader_idx, self._state(), type(batch).__name__))
        return Tagged(batch.x * 10, batch.y)

    def _loss(self, batch):
        assert isinstance(batch, Tagged)
        self.seen.append(batch.x.abs().max().item())
        return torch.nn.functional.mse_loss(self.layer(batch.x), batch.y)

    seen: list = []

    def training_step(self, batch, batch_idx):
        self.calls.append(("training_step",))
        return self._loss(batch)

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.calls.append(("validation_step", dataloader_idx))
        self.log("val_loss", self._loss(batch))

    def predict_step(self, batch, batch_idx):
        return batch.x.sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _small(n=8):
    g = torch.Generator().manual_seed(0)
    x = torch.rand(n, 4, generator=g)  # in [0, 1): after the hook's ×10 the step sees up to 10
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)


def test_transfer_hooks_run_in_lightning_order_for_every_loop(tmp_path):
    """Each batch of fit (sanity check, training, validation with two loaders), validate and predict
    passes before → transfer → after, with its dataloader_idx and the trainer's state flags, before
    the step sees it."""
    module = TransferHooks()
    module.seen = []
    trainer = make_trainer(tmp_path, max_epochs=1, num_sanity_val_steps=1)
    trainer.fit(module, _small(), [_small(4), _small(4)])
    calls = module.calls
    first_train = calls.index(("training_step",))
    assert calls[first_train - 3 : first_train] == [
        ("before", 0, "T", "cpu"),
        ("transfer", 0, "T", "cpu"),
        ("after", 0, "T", "Tagged"),
    ]
    assert ("before", 1, "V", "cpu") in calls and (
        "validation_step",
        1,
    ) in calls  # the second val loader
    assert sum(c == ("training_step",) for c in calls) == 2
    assert max(module.seen) > 1.0  # the steps got the batches the hook scaled on the device
    module.calls = []
    trainer.validate(module, _small())
    assert module.calls[:3] == [
        ("before", 0, "V", "cpu"),
        ("transfer", 0, "V", "cpu"),
        ("after", 0, "V", "Tagged"),
    ]
    module.calls = []
    out = trainer.predict(module, _small())
    assert module.calls[0] == ("before", 0, "P", "cpu") and len(out) == 2
    assert float(out[0]) == pytest.approx(
        float(_small().dataset.tensors[0][:4].sum() * 10), rel=1e-6
    )


def test_planning_probes_the_step_with_the_batch_the_transfer_hooks_make(tmp_path):
    """strategy="auto" plans before any rank starts (always on CUDA; here, on CPU, because
    memory_budget is set) by running training_step on a copy of the model with one drawn batch. That
    batch must go through the transfer hooks first, as every training batch does: a step written for
    what `on_after_batch_transfer` returns (here a Tagged batch; on a GPU, say, uint8 images turned
    into floats) would otherwise fail before training starts."""
    module = TransferHooks()
    module.seen = []
    make_trainer(tmp_path, max_steps=2, memory_budget=2**30).fit(module, _small())
    assert (
        sum(c == ("training_step",) for c in module.calls) == 2
    )  # the probe ran on a copy, not on the module
    assert max(module.seen) > 1.0


class TransferData(ls.LightningDataModule):
    def train_dataloader(self):
        return _small()

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return Tagged(batch.x * 0, batch.y)  # the DataModule's hook wins: the steps see zeros


def test_a_datamodule_transfer_hook_is_used_instead_of_the_modules_and_warned(tmp_path):
    """As in Lightning: where both override a transfer hook, the DataModule's runs; fit start says
    so."""
    module = TransferHooks()
    module.seen = []
    with pytest.warns(
        UserWarning,
        match="on_after_batch_transfer is overridden in both TransferHooks and "
        "TransferData: the DataModule's runs",
    ):
        make_trainer(tmp_path, max_steps=2).fit(module, datamodule=TransferData())
    assert module.seen == [0.0, 0.0]
    assert (
        "before",
        0,
        "T",
        "cpu",
    ) in module.calls  # the Module's own hooks still run where it alone has them
    assert not any(c[0] == "after" for c in module.calls)


def test_super_transfer_moves_any_nesting_through_the_trainer(tmp_path):
    """A hook that handles its own type and leaves the rest to `super()` (the pattern Lightning
    documents)."""

    class Partly(TransferHooks):
        def transfer_batch_to_device(self, batch, device, dataloader_idx):
            moved = super(TransferHooks, self).transfer_batch_to_device(
                {"x": batch.x, "y": [batch.y]}, device, dataloader_idx
            )
            return Tagged(moved["x"], moved["y"][0])

    module = Partly()
    module.seen = []
    make_trainer(tmp_path, max_steps=1).fit(module, _small())
    assert len(module.seen) == 1


class _Slow(torch.utils.data.Dataset):
    """Each item costs the host `delay` seconds, as a heavy decode or augmentation would."""

    def __init__(self, n: int, delay: float):
        self.n, self.delay = n, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import time

        time.sleep(self.delay)
        return torch.full((64,), float(i % 7)), torch.tensor(float(i % 3))


class _Heavy(ls.Module):
    """A step of `rounds` large matmuls: the GPU is busy for milliseconds whatever the batch."""

    def __init__(self, rounds: int):
        super().__init__()
        self.rounds = rounds
        self.layer = torch.nn.Linear(64, 1)
        self.big = torch.nn.Parameter(torch.randn(2048, 2048) / 64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = self.big
        for _ in range(self.rounds):
            h = torch.tanh(h @ self.big)
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y) + h.mean() * 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("delay,rounds,said", [(0.02, 0, True), (0.0, 40, False)])
def test_data_wait_is_told_only_when_the_gpu_waits(tmp_path, capsys, delay, rounds, said):
    """A loader that takes 20 ms per batch in front of a tiny step: the GPU waits most of each step,
    and one line
    says so with the share and the loader's time per batch. A fast loader in front of 40 large
    matmuls per step: the GPU never waits, and nothing is said (Lightning would warn about
    num_workers=0 in both)."""
    loader = DataLoader(_Slow(70, delay), batch_size=1)
    trainer = ls.Trainer(
        devices=1,
        accelerator="gpu",
        max_steps=60,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(_Heavy(rounds), loader)
    out = capsys.readouterr().out
    waits, hosts = trainer.move.wait.shares()
    assert (
        len(waits) == 40
        and trainer.move.wait.done
        and trainer.move.wait.share == statistics.median(waits)
    )
    if said:
        assert "data_wait: the GPU sat idle" in out and "DataLoader(num_workers=0) took" in out, out
        assert min(hosts) >= 0.02 and sorted(waits)[20] > 0.5
    else:
        assert "data_wait" not in out, out
        assert sorted(waits)[20] < 0.1
