"""The samplers the Trainer gives loaders, and the `set_epoch` calls it makes.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_samplers.py
"""

from __future__ import annotations

import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler, TensorDataset

import lightspeed as ls
from lightspeed.data.loaders import with_distributed_sampler


def _rank_batches(loader, rank: int) -> list[list[float]]:
    shared = with_distributed_sampler(loader, {"rank": rank, "num_replicas": 2}, seed=0)
    return [batch[0].tolist() for batch in shared]


def test_a_loader_built_with_batch_sampler_keeps_its_batches_on_two_ranks():
    data = TensorDataset(torch.arange(20.0))
    loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 4, drop_last=True))
    ranks = [_rank_batches(loader, r) for r in (0, 1)]
    # each rank: its 10 samples in batches of 4, the last 2 dropped (the batch sampler's
    # drop_last), shuffled (its RandomSampler); the ranks' samples disjoint
    assert [len(b) for b in ranks[0]] == [4, 4] and [len(b) for b in ranks[1]] == [4, 4]
    seen = sum(ranks[0] + ranks[1], [])
    assert len(set(seen)) == 16 and seen != sorted(seen)


class Recording(Sampler):
    """A sampler of the user's own (kept as it is), recording the epochs it is told."""

    def __init__(self, n: int):
        self.n, self.epochs = n, []

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class Boring(ls.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_nb):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_nb):
        self.log("val", self.layer(batch[0]).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_set_epoch_reaches_samplers_inside_a_batch_sampler_for_training_and_validation():
    data = TensorDataset(torch.randn(8, 2))
    train_sampler, val_sampler = Recording(8), Recording(8)
    train = DataLoader(data, batch_sampler=BatchSampler(train_sampler, 2, drop_last=True))
    val = DataLoader(data, sampler=val_sampler, batch_size=2)
    trainer = ls.Trainer(
        accelerator="cpu",
        max_epochs=2,
        limit_train_batches=1,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Boring(), train, val)
    assert train_sampler.epochs == [0, 1]
    assert val_sampler.epochs == [0, 0, 1]  # the sanity check, then each epoch's validation
    trainer.validate(Boring(), val)
    assert val_sampler.epochs[-1] == 2  # validate after the fit: the epoch the Trainer is at
