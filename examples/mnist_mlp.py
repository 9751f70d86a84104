"""An MNIST-style classifier: a two-layer MLP on 28x28 grey images, 10 classes.

Random images of MNIST's shapes stand in for the download, so the script runs anywhere in seconds:
    python examples/mnist_mlp.py --devices 2 --strategy ddp
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L


def random_mnist(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    images = torch.rand(n, 1, 28, 28, generator=g)
    labels = (
        images.mean(dim=(1, 2, 3)) * 1000
    ).long() % 10  # a label the model can learn from the pixels
    return TensorDataset(images, labels)


class MNISTClassifier(L.LightningModule):
    def __init__(self, hidden: int = 64, lr: float = 1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(28 * 28, hidden), nn.ReLU(), nn.Linear(hidden, 10)
        )

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main(args):
    L.seed_everything(42)
    model = MNISTClassifier()
    train = DataLoader(random_mnist(256, 0), batch_size=32, shuffle=True)
    val = DataLoader(random_mnist(64, 1), batch_size=32)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
    )
    trainer.fit(model, train, val)
    if trainer.is_global_zero:
        print(f"result: val_acc={float(trainer.callback_metrics['val_acc']):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_epochs", type=int, default=2)
    main(parser.parse_args())
