"""An autoencoder: encode 28x28 images to 8 numbers and decode them back; fit, then test the
reconstruction. python examples/autoencoder.py --devices 2 --strategy deepspeed_stage_2
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L


class AutoEncoder(L.LightningModule):
    def __init__(self, code: int = 8):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(28 * 28, 64), nn.ReLU(), nn.Linear(64, code))
        self.decoder = nn.Sequential(nn.Linear(code, 64), nn.ReLU(), nn.Linear(64, 28 * 28))

    def forward(self, x):
        return self.encoder(x.flatten(1))

    def _reconstruction_loss(self, batch):
        (x,) = batch
        x = x.flatten(1)
        return F.mse_loss(self.decoder(self.encoder(x)), x)

    def training_step(self, batch, batch_idx):
        loss = self._reconstruction_loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._reconstruction_loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._reconstruction_loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def images(n: int, seed: int) -> DataLoader:
    return DataLoader(
        TensorDataset(torch.rand(n, 1, 28, 28, generator=torch.Generator().manual_seed(seed))),
        batch_size=32,
    )


def main(args):
    L.seed_everything(7)
    model = AutoEncoder()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
    )
    trainer.fit(model, images(256, 0), images(64, 1))
    results = trainer.test(model, images(64, 2))
    if trainer.is_global_zero:
        print(f"result: test_loss={results[0]['test_loss']:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_epochs", type=int, default=2)
    main(parser.parse_args())
