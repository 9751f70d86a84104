"""A Trainer inside a running 2-rank job (tests/test_nested_trainer.py): `python
tests/nested_trainer_script.py <strategy> <out.json> [<strategy> <out.json> ...]` (each pair a
job, one after another in the same ranks).

A 2-rank fit under `strategy`; then, on rank 0 only, `Trainer(accelerator="cpu", devices=1)` tests
the fitted model and fits a fresh copy, while rank 1 goes straight on to the job's next collective
(an all_reduce), where it waits for rank 0. Then both ranks use the job's group again: that
all_reduce, and a 2-rank `test` with the outer Trainer. Rank 0 writes what it saw.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import lightspeed as ls  # noqa: E402


class Regression(ls.LightningModule):
    def __init__(self):
        super().__init__()
        self.losses: list[float] = []

    def configure_model(self):
        if not hasattr(self, "net"):
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        return loss

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).tanh()), batch_size=8)


def single(**kw) -> ls.Trainer:
    return ls.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, **kw)


def main(strategy: str, out: str) -> None:
    ls.seed_everything(0)
    model = Regression()
    trainer = ls.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(model, data())
    result: dict = {}
    if trainer.is_global_zero:
        nested = single()
        result["nested_world"] = nested.world_size
        result["nested_test"] = nested.test(model, data(), verbose=False)[0]["test_loss"]
        fresh = Regression()
        ls.seed_everything(1)
        nested_fit = single(max_steps=5, enable_checkpointing=False)
        nested_fit.fit(fresh, data())
        result["nested_fit_losses"] = fresh.losses
        result["nested_fit_step"] = nested_fit.global_step
        result["job_world_after"] = dist.get_world_size()
    # The job's group, untouched: rank 1 has been waiting here while rank 0 ran alone.
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    tested = trainer.test(model, data(), verbose=False)[0]["test_loss"]
    if trainer.is_global_zero:
        result.update(job_all_reduce=float(total), job_test=tested)
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    for i in range(1, len(sys.argv), 2):  # strategy, out; more pairs: one job after another
        main(sys.argv[i], sys.argv[i + 1])
