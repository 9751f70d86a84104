"""A LightningDataModule: the data's preparation, splits and loaders in one class, handed to fit and
test. python examples/datamodule.py --devices 2 --strategy ddp
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

import lightspeed as L


class RegressionData(L.LightningDataModule):
    """y = x·w + noise with 16 features; 80/20 train/val split, a separate test set."""

    def __init__(self, batch_size: int = 16, n: int = 320):
        super().__init__()
        self.batch_size, self.n = batch_size, n

    def prepare_data(self):
        pass  # a download would go here: it runs once per node, before setup

    def setup(self, stage):
        g = torch.Generator().manual_seed(0)
        w = torch.randn(16, 1, generator=g)
        x = torch.randn(self.n, 16, generator=g)
        full = TensorDataset(x, x @ w + 0.01 * torch.randn(self.n, 1, generator=g))
        self.train_set, self.val_set = random_split(full, [0.8, 0.2], generator=g)
        x_test = torch.randn(64, 16, generator=g)
        self.test_set = TensorDataset(x_test, x_test @ w)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)


class LinearRegression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.layer(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self.layer(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main(args):
    L.seed_everything(1)
    dm, model = RegressionData(), LinearRegression()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
    )
    trainer.fit(model, datamodule=dm)
    results = trainer.test(model, datamodule=dm)
    if trainer.is_global_zero:
        print(f"result: test_loss={results[0]['test_loss']:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_epochs", type=int, default=5)
    main(parser.parse_args())
