"""Dataloaders under data parallelism, and moving nested batches to the device."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from lightspeed.data.samplers import UnrepeatedDistributedSampler
from lightspeed.errors import ConfigError
from lightspeed.runtime.rng import set_rng_state


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`fn` applied to every tensor in a nest of tuples, lists, dicts, namedtuples and
    dataclasses."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)((k, map_tensors(v, fn)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(
            batch,
            **{
                f.name: map_tensors(getattr(batch, f.name), fn)
                for f in dataclasses.fields(batch)
                if f.init
            },
        )
    return batch


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Moves every tensor in a nest of tuples, lists, dicts, namedtuples and dataclasses to
    `device`."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


class BatchMover:
    """How batches reach the device: `mover(batch)` moves one, `mover.loader(loader)` prepares a
    loader.

    On CUDA with `pinned` (`Trainer(pin_memory=True)`, the default), batches are copied from
    page-locked host memory on a side stream that the step waits for. A torch DataLoader with
    workers left at `pin_memory=False` is iterated as a shallow copy with `pin_memory=True` (its
    workers' batches are then pinned in the loader's own thread; the user's object is left as it
    was); any other CPU tensor is pinned here before its copy, and a tensor already on a GPU is left
    where it is. A copy from pageable memory waits behind the kernels already queued and blocks the
    host meanwhile: on an H200, a ViT-B/16 at batch 256 (154 MB of images per step) trained 1.20×
    faster than with its batches moved as given, 1.34× the plain loop users write
    (docs/benchmarks.md). Elsewhere, or with `pinned=False`, batches move as the loader gives them
    (`.to(device, non_blocking=True)`).

    On CUDA, `timed(batches, loader)` also measures how long the GPU waits for the training batches
    (`DataWait`)."""

    def __init__(
        self,
        device: torch.device,
        pinned: bool,
        print0: Callable[[str], None] = print,
        training: Callable[[], bool] = lambda: True,
    ):
        self.device, self.print0 = device, print0
        self.stream = torch.cuda.Stream(device) if pinned and device.type == "cuda" else None
        self.wait = DataWait(device, print0, training) if device.type == "cuda" else None
        self._said = False

    def timed(self, batches: Iterator, loader: Any) -> Iterator:
        """`batches` (the training loader's iterator), measured by `self.wait` on CUDA."""
        return batches if self.wait is None else self.wait.watch(batches, loader)

    def loader(self, loader: Any) -> Any:
        """`loader`, or under pinning a shallow copy of a DataLoader with workers that does not pin,
        with pin_memory=True. Without workers the copy would gain nothing (the loader pins in the
        main thread too, as `_move` does) and could fail: a dataset that returns CUDA tensors cannot
        be pinned, and `_move` leaves those as they are. Workers cannot hand CUDA tensors back under
        torch's default fork."""
        if self.stream is None or not isinstance(loader, DataLoader) or loader.pin_memory:
            return loader
        if not self._said:
            self._said = True
            self.print0(
                f"pin_memory: batches are pinned and copied to {self.device} on a side stream; "
                "Trainer(pin_memory=False) moves them as the loader gives them."
            )
        if loader.num_workers == 0:
            return loader
        pinned = copy.copy(
            loader
        )  # DataLoader refuses few attributes after construction; pin_memory is not one
        pinned.pin_memory = True
        return pinned

    def __call__(self, batch: Any) -> Any:
        batch = self._move(batch)
        if self.wait is not None:
            self.wait.arrived()
        return batch

    def _move(self, batch: Any) -> Any:
        if self.stream is None:
            return move_to_device(batch, self.device)
        moved: list[torch.Tensor] = []

        def copy_one(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu" and not t.is_pinned():
                try:
                    t = t.pin_memory()
                except RuntimeError:  # a layout torch cannot pin: copied as it is
                    pass
            moved.append(t := t.to(self.device, non_blocking=True))
            return t

        with torch.cuda.stream(self.stream):
            batch = map_tensors(batch, copy_one)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self.stream)
        for t in (
            moved
        ):  # allocated on the side stream, used on the compute stream: freed only after that use
            t.record_stream(compute)
        return batch


class DataWait:
    """How long the GPU waits for training data, measured once per fit, told in one line if it is
    long.

    For each optimizer step, an event on the compute stream marks when the host starts fetching the
    step's first batch (`watch`: the GPU reaches it when the previous step's kernels are done) and
    another when that batch has been copied and the forward may start (`arrived`). The time between
    the two is time the GPU had nothing to do because the batch was not there yet; the time between
    two fetch marks is the step. Steps FIRST to LAST are measured (the first ones compile, allocate,
    warm up); the median share is taken, so a step that waited for another reason (a log step's host
    read) does not decide. Above SAY_ABOVE, rank 0 prints the figure, the loader's time per batch on
    the host and what would help. Lightning instead warns whenever a DataLoader has few workers,
    whether or not the GPU waits (docs/porting.md)."""

    FIRST, LAST, SAY_ABOVE = 10, 50, 0.10

    def __init__(
        self, device: torch.device, print0: Callable[[str], None], training: Callable[[], bool]
    ):
        self.device, self.print0, self.training = (
            device,
            print0,
            training,
        )  # training(): a training batch moves
        self.marks: list[
            tuple[Any, Any, float]
        ] = []  # per step: fetch event, arrival event, host fetch seconds
        self._fetch: list | None = (
            None  # this step's fetch mark [event, host seconds], until its batch arrives
        )
        self._loader: Any = None
        self.done = False
        self.share: float | None = (
            None  # the measured median share, once steps FIRST to LAST have run
        )

    def _event(self) -> Any:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def watch(self, batches: Iterator, loader: Any) -> Iterator:
        self._loader = loader
        try:
            while True:
                mark = None
                if not self.done and self._fetch is None:
                    if len(self.marks) > self.LAST:
                        self._report()
                    else:
                        mark = self._fetch = [self._event(), time.perf_counter()]
                try:
                    batch = next(batches)
                except StopIteration:
                    return
                if mark is not None:
                    mark[1] = (
                        time.perf_counter() - mark[1]
                    )  # the host's time in the loader for this batch
                yield batch
        finally:
            self._fetch = (
                None  # the epoch is over: a batch fetched and never trained on is not a step
            )

    def arrived(self) -> None:
        """The batch just moved may start its forward: the end of the wait, if it is a step's first
        batch."""
        if self._fetch is not None and not self.done and self.training():
            self.marks.append((self._fetch[0], self._event(), self._fetch[1]))
            self._fetch = None

    def shares(self) -> tuple[list[float], list[float]]:
        """Per measured step: the share of it the GPU waited for its batch, and the host's fetch
        seconds."""
        self.marks[-1][1].synchronize()
        steps = self.marks[self.FIRST : self.LAST + 1]
        waits = [
            a.elapsed_time(b) / max(a.elapsed_time(nxt[0]), 1e-6)
            for (a, b, _), nxt in zip(steps, steps[1:])
        ]
        return waits, [host for _, _, host in steps[:-1]]

    def _report(self) -> None:
        self.done = True
        waits, hosts = self.shares()
        wait, host = statistics.median(waits), statistics.median(hosts)
        self.share = wait
        if wait <= self.SAY_ABOVE:
            return
        workers = getattr(self._loader, "num_workers", None)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        loader = (
            f"DataLoader(num_workers={workers}) took {host * 1e3:.0f} ms per batch on the host, "
            "which has "
            f"{cores} CPU cores"
            if workers is not None
            else f"the loader took {host * 1e3:.0f} ms per batch"
        )
        self.print0(
            f"data_wait: the GPU sat idle {wait:.0%} of each step waiting for its batch (median of "
            "steps "
            f"{self.FIRST + 1}-{self.LAST}, rank 0); the {loader}. More DataLoader workers, or "
            "augmentations "
            f"moved to the GPU (on_after_batch_transfer), would give that time back."
        )


def with_distributed_sampler(
    loader: DataLoader, replicas: dict[str, int], seed: int, repeat: bool = True
) -> DataLoader:
    """Returns `loader` with a DistributedSampler, keeping its own shuffle setting and other
    arguments; with `repeat=False` (evaluation) an UnrepeatedDistributedSampler: each sample on
    one rank, none repeated to even the ranks (data/samplers.py).

    Applied when world_size > 1, and also on one process when the loader shuffles, so the order of
    each epoch is a function of (seed, epoch): that is what makes resuming mid-epoch exact. A custom
    sampler is kept. `replicas` is the strategy's `distributed_sampler_kwargs`: the data-parallel
    size and rank (`num_replicas`, `rank`), which under tensor parallelism are not the world's.
    """
    rank, world_size = replicas["rank"], replicas["num_replicas"]
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return loader  # no sampler to give: each rank's stream is the user's to shard (Lightning)
    if loader.batch_sampler is None or type(loader.batch_sampler).__name__ != "BatchSampler":
        return loader  # no batching, or a batch sampler of the user's own: kept
    # torch's BatchSampler: built by the loader from `sampler=`/`shuffle=`, or given as
    # `batch_sampler=BatchSampler(sampler, size, drop_last)`; either way its sampler is the one
    # drawn from, and its size and drop_last are the batches'
    batches: Any = loader.batch_sampler
    inner, batch_size, drop_last = batches.sampler, batches.batch_size, batches.drop_last
    if isinstance(inner, DistributedSampler):
        return loader
    shuffle = isinstance(inner, RandomSampler)
    if not shuffle and not isinstance(inner, SequentialSampler):
        return loader  # the user's own sampler: their responsibility
    if world_size == 1 and not shuffle:
        return loader
    sampler = (
        DistributedSampler(
            loader.dataset,
            num_replicas=world_size,
            rank=rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        if repeat or world_size == 1
        else UnrepeatedDistributedSampler(loader.dataset, world_size, rank, shuffle, seed)
    )
    kwargs: dict[str, Any] = dict(
        batch_size=batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
        kwargs["multiprocessing_context"] = loader.multiprocessing_context
    # torchdata's StatefulDataLoader stays one (its state_dict resumes an epoch); any other
    # subclass may take other arguments, and becomes a DataLoader
    cls = type(loader) if type(loader).__name__ == "StatefulDataLoader" else DataLoader
    return cls(loader.dataset, **kwargs)


class CombinedLoader:
    """Several loaders as one, Lightning's way: `fit(model, {"a": loader_a, "b": loader_b})` (or a
    list) trains on batches `{"a": batch_a, "b": batch_b}` (`[batch_a, batch_b]` for a list); a
    training loader can also be built as `CombinedLoader(iterables, mode)` and returned from
    `train_dataloader()`.

    mode "max_size_cycle" (the default): as many batches as the longest loader, the shorter ones
    starting over; "min_size": as many as the shortest; "max_size": as many as the longest, None in
    place of a finished loader. The Trainer gives each loader its DistributedSampler (and pinning)
    as it would a single one (`map`)."""

    MODES = ("max_size_cycle", "min_size", "max_size")

    def __init__(self, iterables: Any, mode: str = "max_size_cycle"):
        if mode not in self.MODES:
            raise ConfigError(
                f"CombinedLoader(mode={mode!r}) is not valid for training: use one of {self.MODES}."
            )
        if not isinstance(iterables, (dict, list, tuple)) or not iterables:
            raise ConfigError(
                f"CombinedLoader(iterables={iterables!r:.100}) is not valid: expected a non-empty "
                "dict "
                "or list of loaders."
            )
        self.iterables, self.mode = iterables, mode
        self._keys = list(iterables) if isinstance(iterables, dict) else None
        self._loaders = list(iterables.values()) if isinstance(iterables, dict) else list(iterables)

    def map(self, fn: Callable[[Any], Any]) -> CombinedLoader:
        """The same combination of `fn(loader)` for each loader."""
        mapped = [fn(loader) for loader in self._loaders]
        return CombinedLoader(
            dict(zip(self._keys, mapped)) if self._keys is not None else mapped, self.mode
        )

    def __len__(self) -> int:
        lengths = [
            len(loader) for loader in self._loaders
        ]  # TypeError for an unsized one: num_batches -> inf
        return min(lengths) if self.mode == "min_size" else max(lengths)

    @property
    def batch_size(self) -> int | None:
        return getattr(self._loaders[0], "batch_size", None)

    def set_epoch(self, epoch: int) -> None:
        for loader in self._loaders:
            set_epoch(loader, epoch)

    def __iter__(self) -> Iterator:
        iterators = [iter(loader) for loader in self._loaders]
        finished = [False] * len(iterators)
        try:
            total: int | float = len(self)
        except TypeError:
            total = float("inf")
        count = 0
        while count < total:
            batch = []
            for i, it in enumerate(iterators):
                try:
                    batch.append(next(it))
                    continue
                except StopIteration:
                    finished[i] = True
                if self.mode == "min_size" or all(finished):
                    return
                if self.mode == "max_size":
                    batch.append(None)
                    continue
                iterators[i] = iter(self._loaders[i])  # max_size_cycle: this one starts over
                batch.append(next(iterators[i]))
            count += 1
            yield dict(zip(self._keys, batch)) if self._keys is not None else batch


def combined(train: Any) -> Any:
    """fit's training data as one loader: a dict or list of DataLoaders becomes a CombinedLoader
    (Lightning's "max_size_cycle"); anything else (a loader, a list of batches) is returned as it
    is."""
    several = (
        isinstance(train, (dict, list, tuple))
        and train
        and all(
            isinstance(v, DataLoader)
            for v in (train.values() if isinstance(train, dict) else train)
        )
    )
    return CombinedLoader(train) if several else train


def set_epoch(loader: Any, epoch: int) -> None:
    """`set_epoch(epoch)` on whatever of the loader's samplers has one, each once: its sampler,
    its batch sampler (a bucketing one of your own) and the sampler that one draws from (a loader
    built with `batch_sampler=` keeps its sampler there)."""
    if isinstance(loader, CombinedLoader):
        loader.set_epoch(epoch)
        return
    batches = getattr(loader, "batch_sampler", None)
    found = (getattr(loader, "sampler", None), batches, getattr(batches, "sampler", None))
    for sampler in {id(s): s for s in found if callable(getattr(s, "set_epoch", None))}.values():
        sampler.set_epoch(epoch)


def num_batches(loader: Any, limit: int | float | None) -> int | float:
    """Batches to run per epoch: all, a fraction (float ≤ 1.0) or a count (int). Unsized loaders
    give inf."""
    try:
        total = len(loader)
    except TypeError:
        total = float("inf")
    if limit is None:
        return total
    if limit == 0:
        return 0  # training (or that stage) turned off, with or without a length
    if isinstance(limit, float) and limit <= 1.0:
        return int(total * limit) if total != float("inf") else float("inf")
    return min(total, int(limit))


def validation_interval(n: int | float, val_check_interval: int | float | None) -> int | None:
    """Validate every this many training batches within an epoch of `n` (`val_check_interval`: a
    batch count, or a fraction of the epoch); None: at the epoch's end only."""
    v = val_check_interval
    if v is None or (isinstance(v, float) and v >= 1.0):
        return None
    if isinstance(v, float):
        return max(1, int(n * v)) if n != float("inf") else None
    return v


def estimated_stepping_batches(loader: Any, cfg: Any) -> int | float:
    """Lightning's `trainer.estimated_stepping_batches`: the optimizer steps fit will take, from
    this rank's (already distributed) training loader, `limit_train_batches`,
    `accumulate_grad_batches`, `max_epochs` and `max_steps`. Infinite for an unsized loader without
    `max_steps`; `max_steps` when epochs are unbounded."""
    per_epoch = num_batches(loader, cfg.limit_train_batches)
    if per_epoch != float("inf"):
        per_epoch = math.ceil(per_epoch / cfg.accumulate_grad_batches)
    if cfg.max_epochs in (None, -1) and cfg.max_steps != -1:
        return cfg.max_steps
    if (
        cfg.max_epochs in (None, -1) and cfg.epochs_limit != 1000
    ):  # -1, or max_time only: epochs unbounded
        return float("inf")
    total = per_epoch * max(cfg.epochs_limit, 1)
    return min(total, cfg.max_steps) if cfg.max_steps != -1 else total


def resumed_iterator(loader: Any, skip: int, rng: dict | None, replay: bool = True) -> Iterator:
    """An iterator over `loader` positioned after `skip` batches, for resuming an epoch: the first
    `skip` batches are drawn and dropped, unless `replay` is False (a stateful loader whose
    `load_state_dict` already put it there).

    `rng` (the saved RNG state, rng.set_rng_state) is restored where the save happened: at an epoch
    boundary (skip 0) that is before the iterator draws its seed from the global RNG; mid-epoch it
    is after, once the sampler has been replayed."""
    if rng is not None and skip == 0:
        set_rng_state(rng)
    iterator = iter(loader)
    if replay:  # a stream shorter than `skip` ends here; the epoch's end is agreed later
        for _ in itertools.islice(iterator, skip):
            pass
    if rng is not None and skip > 0:
        set_rng_state(rng)
    return iterator


def accumulation_windows(
    batches: Iterator, start: int, n: int | float, size: int
) -> Iterator[list[tuple[int, Any]]]:
    """Groups `(batch_idx, batch)` from `batches` (numbered from `start`, at most up to index n - 1)
    into windows of `size` micro-batches: one optimizer step each. The epoch's last window may be
    shorter; windows are aligned to the epoch (index + 1 divisible by `size`), so a resumed epoch
    forms the same windows."""
    window: list[tuple[int, Any]] = []
    if n != math.inf:  # not one batch more than the epoch takes (a stream would move past it)
        batches = itertools.islice(batches, max(int(n) - start, 0))
    for batch_idx, batch in enumerate(batches, start=start):
        window.append((batch_idx, batch))
        if (batch_idx + 1) % size == 0 or batch_idx + 1 == n:
            yield window
            window = []
    if window:
        yield window
