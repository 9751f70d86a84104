"""DeepSpeed ZeRO stage 3 through the strategy object: parameters, gradients and optimizer states
are split across the ranks, and layers built in `configure_model` are created directly in their
shards. `--strategy deepspeed` (the default) uses `DeepSpeedStrategy(stage=3)`; any other name is
passed to the Trainer.
    python examples/deepspeed_zero3.py --devices 2
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L
from lightspeed.strategies import DeepSpeedStrategy


class DeepMLP(L.LightningModule):
    def __init__(self, width: int = 128, depth: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.layers = None

    def configure_model(self):
        if self.layers is not None:
            return
        w = self.hparams.width
        blocks = [nn.Sequential(nn.Linear(w, w), nn.GELU()) for _ in range(self.hparams.depth)]
        self.layers = nn.Sequential(nn.Linear(16, w), *blocks, nn.Linear(w, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.layers(x), y)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(args):
    L.seed_everything(2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=g)
    data = DataLoader(TensorDataset(x, x.pow(2).mean(1, keepdim=True)), batch_size=16, shuffle=True)
    strategy = DeepSpeedStrategy(stage=3) if args.strategy == "deepspeed" else args.strategy
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=strategy,
        max_epochs=args.max_epochs,
    )
    trainer.fit(DeepMLP(), data)
    if trainer.is_global_zero:
        print(f"result: train_loss={float(trainer.callback_metrics['train_loss']):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="deepspeed")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_epochs", type=int, default=1)
    main(parser.parse_args())
