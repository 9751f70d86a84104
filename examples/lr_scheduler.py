"""A learning-rate schedule returned as Lightning's dict (stepped every optimizer step), with
LearningRateMonitor writing the learning rate to the logger.
    python examples/lr_scheduler.py --devices 2 --strategy fsdp
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L
from lightspeed.callbacks import LearningRateMonitor
from lightspeed.loggers import CSVLogger


class Classifier(L.LightningModule):
    def __init__(self, lr: float = 0.1, warmup: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        warmup = self.hparams.warmup
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: min(1.0, (step + 1) / warmup)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }


def main(args):
    L.seed_everything(3)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 20, generator=g)
    data = DataLoader(TensorDataset(x, x[:, :4].argmax(1)), batch_size=32)
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
        logger=CSVLogger("logs"),
        log_every_n_steps=1,
        callbacks=[LearningRateMonitor(logging_interval="step")],
    )
    model = Classifier()
    trainer.fit(model, data)
    if trainer.is_global_zero:
        lr = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
        print(f"result: lr={lr:.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_epochs", type=int, default=1)
    main(parser.parse_args())
