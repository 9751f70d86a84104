"""Evaluation's sampler on several ranks: each sample on exactly one rank.

torch's DistributedSampler evens the ranks by repeating the first samples, so a test set of 5 on
2 ranks is evaluated as 6 (sample 0 twice) and its metrics are off. Validation, test and predict
take `UnrepeatedDistributedSampler` instead: rank r takes positions r, r + n, r + 2n, ... of the
order, and a rank may hold one sample less. The evaluation loop ends every rank together when the
counts differ (`epoch_windows.EvalBatches`), running a rank that ran out on its last batch where the
step is collective, so nothing is repeated and nothing waits forever.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class UnrepeatedDistributedSampler(DistributedSampler):
    """A DistributedSampler (`set_epoch`, `seed`, `shuffle` as torch's) without the padding: the
    ranks' shares of `dataset` are disjoint and together hold every sample once."""

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        seed: int = 0,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last=False)
        size = len(dataset)  # type: ignore[arg-type]
        self.total_size = size
        self.num_samples = len(range(self.rank, size, self.num_replicas))

    def __iter__(self) -> Iterator[int]:
        size = self.total_size
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(size, generator=g).tolist()
        else:
            order = list(range(size))
        return iter(order[self.rank : size : self.num_replicas])


def even_across_ranks(loader: Any) -> bool:
    """False when `loader` draws from an UnrepeatedDistributedSampler whose shares give the ranks
    different batch counts; True otherwise. Worked out from the dataset's size, so every rank
    answers alike without a collective."""
    if not isinstance(loader, DataLoader):
        return True
    # through the batch sampler (predict's index-recording wrapper holds the loader's)
    batches = loader.batch_sampler
    sampler = getattr(batches, "sampler", loader.sampler)
    if not isinstance(sampler, UnrepeatedDistributedSampler):
        return True
    size, ranks = sampler.total_size, sampler.num_replicas
    batch = getattr(batches, "batch_size", None) or loader.batch_size or 1
    drop_last = getattr(batches, "drop_last", loader.drop_last)
    round_ = math.floor if drop_last else math.ceil
    return len({round_(len(range(r, size, ranks)) / batch) for r in range(ranks)}) == 1
