"""A float-input regression model: `python tests/float_input_script.py <out.json> <strategy>
<precision>` (more triples of these: one run after another, in the same ranks).

The batch is float features and float targets (no token ids), so under DeepSpeed's bf16 engine the
strategy must cast them to the weights' dtype. Rank 0 writes the per-step global-mean losses and the
dtype the first layer's weight had during training.
"""

import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightspeed import LightningModule, Trainer, seed_everything


class Regression(LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1)
        )
        self.losses: list[float] = []
        self.weight_dtype = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y.float())
        self.log("loss", loss, sync_dist=True)
        self.losses.append(float(self.trainer.callback_metrics["loss"]))
        self.weight_dtype = str(x.dtype)
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def main(out: str, strategy: str, precision: str) -> None:
    seed_everything(0)
    x = torch.randn(256, 8)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1)
    model = Regression()
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        precision=precision,
        max_epochs=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    if trainer.global_rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": model.losses, "input_dtype": model.weight_dtype}, f)


if __name__ == "__main__":
    args = sys.argv[1:]
    for i in range(0, len(args), 3):  # several runs, one after another, in the same ranks
        main(*args[i : i + 3])
