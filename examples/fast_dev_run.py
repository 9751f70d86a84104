"""fast_dev_run: one batch of training, validation and test to check a script end to end before a
long run. No checkpoints and no logs are written.
    python examples/fast_dev_run.py --devices 2 --strategy deepspeed_stage_3
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L


class ConvNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4)
        )
        self.classifier = nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def cifar_like(n: int) -> DataLoader:
    g = torch.Generator().manual_seed(n)
    return DataLoader(
        TensorDataset(
            torch.randn(n, 3, 32, 32, generator=g), torch.randint(0, 10, (n,), generator=g)
        ),
        batch_size=16,
    )


def main(args):
    model = ConvNet()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        fast_dev_run=True,
    )
    trainer.fit(model, cifar_like(512), cifar_like(128))
    trainer.test(model, cifar_like(128))
    if trainer.is_global_zero:
        print(f"result: global_step={trainer.global_step}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    main(parser.parse_args())
