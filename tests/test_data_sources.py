"""Loaders and a DataModule passed together are refused before any rank starts, as Lightning does.

.venv/bin/python -m pytest -q tests/test_data_sources.py
"""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
from lightspeed.errors import ConfigError


class Model(ls.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, batch_idx):
        return self.training_step(batch, batch_idx)

    test_step = validation_step

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader():
    return DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)


class Data(ls.LightningDataModule):
    def train_dataloader(self):
        return _loader()

    val_dataloader = test_dataloader = predict_dataloader = train_dataloader


def _trainer():
    return ls.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )


@pytest.mark.parametrize("fn", ["fit", "validate", "test", "predict"])
def test_loaders_and_a_datamodule_together_are_refused(fn):
    trainer = _trainer()
    kw = {"train_dataloaders": _loader()} if fn == "fit" else {"dataloaders": _loader()}
    with pytest.raises(ConfigError, match=rf"trainer\.{fn}\(\) got both .*datamodule=Data"):
        getattr(trainer, fn)(Model(), datamodule=Data(), **kw)


def test_a_datamodule_alone_still_trains():
    trainer = _trainer()
    trainer.fit(Model(), datamodule=Data())
    assert trainer.global_step == 2
