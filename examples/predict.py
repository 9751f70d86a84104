"""Inference with `trainer.predict`: fit a small regressor, then predict on new inputs;
`predict_step` decides what comes back (here the predictions and the inputs' indices, so they can be
put back in order).
    python examples/predict.py --devices 2 --strategy deepspeed_stage_2
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def predict_step(self, batch, batch_idx, dataloader_idx=0):
        x, index = batch
        return {"index": index, "prediction": self(x).squeeze(-1)}

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(args):
    L.seed_everything(5)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 4, generator=g)
    train = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=32, shuffle=True)
    new_x = torch.randn(40, 4, generator=g)
    to_predict = DataLoader(TensorDataset(new_x, torch.arange(40)), batch_size=8)

    model = Regressor()
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        max_epochs=args.max_epochs,
    )
    trainer.fit(model, train)
    batches = trainer.predict(
        model, to_predict
    )  # this rank's batches, on its device (a GPU's, under gpu)
    index = torch.cat([b["index"] for b in batches]).cpu()
    error = (
        (torch.cat([b["prediction"] for b in batches]).float().cpu() - new_x[index].sum(1))
        .abs()
        .mean()
    )
    print(f"rank {trainer.global_rank}: {len(index)} predictions, mean abs error {error:.3f}")
    if trainer.is_global_zero:
        print(f"result: predictions={len(index)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="auto")
    parser.add_argument(
        "--accelerator", default="auto", help="cpu, gpu or auto (a GPU when there is one)"
    )
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--max_epochs", type=int, default=3)
    main(parser.parse_args())
