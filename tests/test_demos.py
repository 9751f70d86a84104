"""lightspeed.demos.boring_classes: Lightning's test models and datasets, trained by the Trainer.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 0 tests/test_demos.py

Run as a script (`python tests/test_demos.py OUT_DIR`) it is the 2-rank DDP run of
test_boring_model_on_two_ddp_ranks: BoringModel for one epoch on 2 gloo ranks, each rank writing
OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

import lightspeed
from lightspeed.demos import BoringDataModule, BoringModel, DemoModel
from lightspeed.demos.boring_classes import (
    BoringDataModuleNoLen,
    IterableBoringDataModule,
    ManualOptimBoringModel,
    Net,
    RandomDataset,
    RandomDictDataset,
    RandomIterableDataset,
    RandomIterableDatasetWithLen,
)

QUIET = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


def test_datasets_shapes_lengths_and_seeding():
    torch.manual_seed(0)
    ds = RandomDataset(32, 64)
    assert len(ds) == 64 and ds[3].shape == (32,) and torch.equal(ds[3], ds.data[3])
    torch.manual_seed(0)
    assert torch.equal(RandomDataset(32, 64).data, ds.data)  # drawn once, when built
    d = RandomDictDataset(4, 5)[2]
    assert set(d) == {"a", "b"} and torch.allclose(d["b"], d["a"] + 2)
    it = RandomIterableDataset(7, 3)
    assert [x.shape for x in it] == [(7,)] * 3 and not hasattr(it, "__len__")
    assert (
        len(RandomIterableDatasetWithLen(7, 5))
        == 5
        == len(list(RandomIterableDatasetWithLen(7, 5)))
    )
    assert Net()(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_datamodules_split_by_stage():
    dm = BoringDataModule()
    assert len(dm.random_full) == 256
    dm.setup("fit")
    assert (len(dm.random_train), len(dm.random_val)) == (64, 64)
    assert not hasattr(dm, "random_test")
    dm.setup("test")
    dm.setup("predict")
    assert list(dm.random_test.indices) == list(range(128, 192))
    assert list(dm.random_predict.indices) == list(range(192, 256))
    assert next(iter(dm.train_dataloader())).shape == (1, 32)  # DataLoader defaults: batch 1

    nolen = BoringDataModuleNoLen()
    nolen.setup("fit")
    assert sum(1 for _ in nolen.train_dataloader()) == 512
    assert sum(1 for _ in nolen.val_dataloader()) == 128

    it = IterableBoringDataModule()
    it.setup("validate")
    loaders = it.val_dataloader()
    assert isinstance(loaders, list) and len(loaders) == 2
    assert [sum(1 for _ in dl) for dl in loaders] == [32, 32]


class RecordingBoringModel(BoringModel):
    def __init__(self, lr: float | None = None):
        super().__init__()
        self.lr, self.losses, self.epoch_lrs = lr, [], []

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        self.losses.append(out["loss"].item())
        return out

    def on_train_epoch_end(self):
        self.epoch_lrs.append(self.optimizers().param_groups[0]["lr"])

    def configure_optimizers(self):
        if self.lr is None:  # BoringModel's own: SGD(lr=0.1), StepLR(step_size=1)
            return super().configure_optimizers()
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def test_boring_model_fit_predict_test():
    torch.manual_seed(0)
    model = RecordingBoringModel()
    assert (model.layer.in_features, model.layer.out_features) == (32, 2)
    trainer = lightspeed.Trainer(max_epochs=3, limit_train_batches=5, limit_val_batches=2, **QUIET)
    trainer.fit(model)
    assert trainer.global_step == 15 and len(model.losses) == 15
    # its StepLR(step_size=1) (gamma 0.1) steps once per epoch, at the epoch's last batch and
    # before on_train_epoch_end (where Lightning steps it, so an epoch-end checkpoint holds it)
    assert torch.allclose(torch.tensor(model.epoch_lrs), torch.tensor([1e-2, 1e-3, 1e-4]))
    assert abs(model.lr_schedulers().get_last_lr()[0] - 1e-4) < 1e-12

    preds = trainer.predict(model)
    assert len(preds) == 64 and all(p.shape == (1, 2) for p in preds)  # 64 samples, batch 1
    (metrics,) = trainer.test(model)
    assert isinstance(metrics, dict)


def test_boring_model_loss_decreases():
    # MSE to ones; at BoringModel's own lr (0.1, batch 1, 32 N(0,1) inputs) plain SGD overshoots
    # (under Lightning too), so this run trains it at lr 0.02: one epoch of its 64 samples
    torch.manual_seed(0)
    model = RecordingBoringModel(lr=0.02)
    trainer = lightspeed.Trainer(max_epochs=1, limit_val_batches=0, **QUIET)
    trainer.fit(model)
    assert trainer.global_step == 64
    first, last = sum(model.losses[:16]) / 16, sum(model.losses[-16:]) / 16
    assert last < 0.8 * first, (first, last)  # about 0.3x; 0.75x at worst over seeds 0-9


def test_demo_model_with_boring_datamodule():
    torch.manual_seed(0)
    model = DemoModel(out_dim=4, learning_rate=0.05)
    assert model.l1.out_features == 4 and model.learning_rate == 0.05
    assert model.training_step(torch.randn(8, 32), 0).shape == ()  # the sum of the outputs
    bias0 = model.l1.bias.detach().clone()
    trainer = lightspeed.Trainer(max_steps=30, **QUIET)
    trainer.fit(model, datamodule=BoringDataModule())
    assert trainer.global_step == 30
    # d(sum of ReLU outputs)/d(bias) >= 0 on every batch, so each Adam step can only lower the
    # biases: 30 steps at lr 0.05 lower each one by about 0.9
    assert (model.l1.bias < bias0 - 0.5).all(), (bias0, model.l1.bias)


def test_manual_optim_boring_model_steps():
    torch.manual_seed(0)
    model = ManualOptimBoringModel()
    assert model.automatic_optimization is False
    w0 = model.layer.weight.detach().clone()
    trainer = lightspeed.Trainer(max_steps=5, limit_val_batches=0, **QUIET)
    trainer.fit(model)
    assert trainer.global_step == 5
    assert not torch.equal(w0, model.layer.weight)


def test_boring_model_on_two_ddp_ranks(tmp_path):
    from helpers import launch

    run = launch([__file__, str(tmp_path)], tmp_path, "python", timeout=240)
    assert run.returncode == 0, run.stderr[-5000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # 64 samples, batch 1, split over 2 ranks: 32 steps on each
    assert r0["step"] == r1["step"] == 32
    assert (r0["world_size"], r1["world_size"]) == (2, 2)
    # DDP keeps the replicas equal
    assert r0["weight"] == r1["weight"] and r0["weight"] != r0["weight0"]


def _two_rank_main(out: Path) -> None:
    lightspeed.seed_everything(0)
    model = BoringModel()
    weight0 = model.layer.weight.detach().sum().item()
    trainer = lightspeed.Trainer(
        max_epochs=1,
        limit_val_batches=2,
        default_root_dir=str(out),
        **{**QUIET, "devices": 2, "strategy": "ddp"},
    )
    trainer.fit(model, DataLoader(RandomDataset(32, 64)))
    result = dict(
        step=trainer.global_step,
        world_size=trainer.world_size,
        weight0=weight0,
        weight=model.layer.weight.detach().sum().item(),
    )
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _two_rank_main(Path(sys.argv[1]))
