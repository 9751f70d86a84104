"""`UnrepeatedDistributedSampler` (data/samplers.py: evaluation's sampler, each sample on one rank)
and `_IndexBatchSamplerWrapper`, at Lightning's path (`overrides.distributed`): `predict` iterates
its loaders through it, so a BasePredictionWriter learns which dataset samples each prediction came
from, in whatever order the sampler drew them (a random one too).

    loader = index_batches(loader)               # loop.prepare_evaluation, predict only
    ...
    loader.batch_sampler.seen_batch_indices[i]   # the dataset indices of the i-th batch
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightspeed.data.samplers import UnrepeatedDistributedSampler

__all__ = ["UnrepeatedDistributedSampler", "_IndexBatchSamplerWrapper", "index_batches"]


class _IndexBatchSamplerWrapper:
    """A batch sampler that remembers the indices of every batch it hands out, in order
    (`seen_batch_indices`, reset at each pass). Everything else is the wrapped batch sampler's
    (`sampler`, `batch_size`, `drop_last`, its length)."""

    def __init__(self, batch_sampler: Any) -> None:
        self._batch_sampler = batch_sampler
        self.seen_batch_indices: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        self.seen_batch_indices = []
        for batch in self._batch_sampler:
            self.seen_batch_indices.append(list(batch))
            yield batch

    def __len__(self) -> int:
        return len(self._batch_sampler)

    def __getattr__(self, name: str) -> Any:
        if name == "_batch_sampler":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._batch_sampler, name)


def index_batches(loader: Any) -> Any:
    """`loader` rebuilt with its batch sampler wrapped in `_IndexBatchSamplerWrapper` (its other
    arguments kept); a loader without a batch sampler (an iterable dataset, a plain iterable) as
    it is."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader
    if loader.batch_sampler is None or isinstance(loader.batch_sampler, _IndexBatchSamplerWrapper):
        return loader
    return DataLoader(
        loader.dataset,
        batch_sampler=_IndexBatchSamplerWrapper(loader.batch_sampler),
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
