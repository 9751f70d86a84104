"""How a training epoch, and an evaluation, end on every rank at once, whether or not its loader
knows its length.

    known = check_batch_counts(n, has_exact_length(loader), limit, val_check_interval)  # once
    for window, is_last in EpochWindows(loader, batches, skip, n, size, None if known else agree):
        ...  # one optimizer step

A loader with an exact `len()` (a DataLoader over a map-style dataset, a list of batches) tells
every rank's count before step 1: uneven counts are refused there, and an epoch is its first `n`
batches with nothing agreed per step. A loader without one (an IterableDataset, a generator, a
`len()` that only estimates) gives each rank its own stream, which may end at any batch: the ranks
then agree before each optimizer step on how many micro-batches all of them have, so the epoch ends
on every rank after the same step, when the first rank runs out. A rank with batches left stops
with the others (its stream is not restarted); one line on rank 0 names the rank that ran short.

    for batch_idx, batch, has in EvalBatches(loader, n, None if exact else agree):  # evaluation
        ...  # has: this rank's own batch; else it waits, or runs a shadow step on `batch`

Evaluation drops nothing: every rank's batches run, the ranks agreeing once per window of
batches how many each holds; a rank whose stream has ended keeps stepping with the others (loop.py
decides whether it waits or runs a shadow forward) until all have ended.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset

from lightspeed.data.loaders import CombinedLoader, accumulation_windows
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import gather_objects


def has_exact_length(loader: Any) -> bool:
    """Whether `len(loader)` is the number of batches its iterator gives: a DataLoader over a
    map-style dataset (its sampler counts), a list of batches, a CombinedLoader of such. An
    IterableDataset's `__len__` is only what its author hoped for."""
    if isinstance(loader, CombinedLoader):
        given = loader.iterables
        return all(map(has_exact_length, given.values() if isinstance(given, dict) else given))
    if isinstance(loader, DataLoader):
        return not isinstance(loader.dataset, IterableDataset)
    return isinstance(loader, (list, tuple))


def check_batch_counts(
    n: int | float, exact: bool, limit: Any, val_check_interval: int | float | None
) -> bool:
    """Collective: whether every rank's training batch count is known and equal before the epoch
    (`n` per epoch after `limit`, from a loader with an exact length on every rank: `exact`). When
    it is not, the ranks agree per step (`EpochWindows`). Decided from every rank's pair, so alike
    on every rank.

    Raises ConfigError on every rank alike when the data is empty on any rank; when counts known on
    every rank differ (a rank would wait in a collective for a peer that has finished its epoch: a
    hang, or a "Connection closed by peer" on one rank while another reports success); and, as
    Lightning does, when a loader without a length meets a fraction of an epoch
    (`limit_train_batches` or `val_check_interval` below 1.0)."""
    pairs = gather_objects((n, exact))
    counts = [count for count, _ in pairs]
    empty = [r for r, c in enumerate(counts) if c == 0]
    if empty and limit != 0:
        raise ConfigError(
            f"fit's training data has no batches (len(train_dataloaders) == 0 on rank(s) {empty}): "
            "give it at least one batch per rank."
        )
    unsized = [r for r, c in enumerate(counts) if c == math.inf]
    for name, value in (("limit_train_batches", limit), ("val_check_interval", val_check_interval)):
        if unsized and isinstance(value, float) and 0 < value < 1.0:
            raise ConfigError(
                f"{name}={value} is a fraction of an epoch, but train_dataloaders has no len() "
                f"on rank(s) {unsized} (an IterableDataset): give an int (a number of training "
                "batches) or 1.0, as Lightning requires."
            )
    known = all(is_exact for _, is_exact in pairs)
    if known and len(set(counts)) > 1:
        per_rank = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise ConfigError(
            f"train_dataloaders has a different number of batches per rank ({per_rank}); every "
            "rank must run the same number of steps. Use a DataLoader with the default sampler "
            "(lightspeed adds a DistributedSampler, which evens the ranks), or make your sampler "
            "give each rank the same count."
        )
    return known


class EpochWindows:
    """One training epoch's accumulation windows on this rank, each with whether it is the epoch's
    last: `for window, is_last in EpochWindows(...)` (windows as `accumulation_windows` forms them
    from `batches`, numbered from `start`, at most `n` batches, `size` micro-batches each).

    `agree` None: every rank's count is known and equal (`check_batch_counts`), and the last window
    is the one that reaches `n`. Otherwise `agree(count)` is a collective returning the fewest and
    the most micro-batches any rank has for a window (distributed.host_min_max): each window is
    fetched one ahead, cut to the fewest, and the window before an agreed 0 is the last. So every
    rank ends the epoch after the same step, when the first rank runs out, and `is_last` is known
    while the last window runs (Lightning prefetches one batch for the same reason).

    `loader_state()` is this rank's position for a checkpoint, from a loader with `state_dict()`
    (torchdata's StatefulDataLoader): after the window handed out, not after the one fetched
    ahead."""

    def __init__(
        self,
        loader: Any,
        batches: Iterator,
        start: int,
        n: int | float,
        size: int,
        agree: Callable[[int], tuple[int, int]] | None = None,
    ):
        self.loader, self.start, self.n, self.size, self.agree = loader, start, n, size, agree
        self.batches = self._counted(batches)
        self.fetched, self.ran_out = start, False  # this rank's stream, read ahead
        self.trained = start  # batches handed out, on every rank alike
        self.uneven = False  # some window's counts differed between ranks: the epoch ended short
        self.ended = False  # the ranks agreed the stream has no more (an epoch of none, too)
        self.is_stateful = callable(getattr(loader, "state_dict", None)) and callable(
            getattr(loader, "load_state_dict", None)
        )
        self._state: Any = None  # the loader's state after the window handed out (read ahead)

    def _counted(self, batches: Iterator) -> Iterator:
        for batch in batches:
            self.fetched += 1
            yield batch
        self.ran_out = True

    def __iter__(self) -> Iterator[tuple[list[tuple[int, Any]], bool]]:
        windows = accumulation_windows(self.batches, self.start, self.n, self.size)
        if self.agree is None:
            for window in windows:
                self.trained = window[-1][0] + 1
                yield window, self.trained >= self.n
            return
        current, state = self._take(windows), self._snapshot()
        while current:
            following = self._take(windows)  # read ahead: is `current` the last?
            self._state, state = state, self._snapshot()
            self.trained = current[-1][0] + 1
            yield current, not following
            current = following
        self.ended = True

    def _take(self, windows: Iterator[list]) -> list:
        """This rank's next window, cut to the micro-batches every rank has for it."""
        assert self.agree is not None
        window = next(windows, [])
        fewest, most = self.agree(len(window))
        self.uneven = self.uneven or fewest != most
        return window[:fewest]

    def _snapshot(self) -> Any:
        return self.loader.state_dict() if self.is_stateful else None

    def loader_state(self) -> Any:
        """The loader's `state_dict()` after the last window handed out, or None (no state)."""
        if not self.is_stateful:
            return None
        return self.loader.state_dict() if self.agree is None else self._state

    def shortfall(self, epoch: int) -> str:
        """Collective: the line that says which rank ran short, after how many batches, and which
        had more, when the epoch ended on uneven ranks (`uneven`, alike on every rank)."""
        try:
            claimed: int | None = len(self.loader)
        except TypeError:
            claimed = None
        ranks = gather_objects((self.ran_out, self.fetched, claimed))
        ended = [r for r, (_, fetched, _) in enumerate(ranks) if fetched == self.trained]
        more = [str(r) for r in range(len(ranks)) if r not in ended]
        said = "; ".join(_ended(r, *ranks[r]) for r in ended)
        return f"train_dataloaders: {said}; every rank ended epoch {epoch} there, together" + (
            f": rank(s) {', '.join(more)} had more, left untrained this epoch." if more else "."
        )


def _ended(rank: int, ran_out: bool, fetched: int, claimed: int | None) -> str:
    if not ran_out:
        return f"rank {rank} reached its limit of {fetched} batches"
    length = f"its len() says {claimed}" if claimed is not None else "it has no len()"
    return f"rank {rank} ran out after {fetched} batches ({length})"


EVAL_WINDOW = 8  # evaluation batches fetched per agreement (benchmarks/epoch_end_vote.py)


class EvalBatches:
    """One evaluation loader's batches on this rank, ended on every rank together: `for batch_idx,
    batch, has in EvalBatches(loader, n, agree)`, at most `n` batches per rank.

    `agree` None: every rank has the same count (a loader with an exact length: the
    DistributedSampler evens the ranks), so each rank runs its batches with no collective; `has` is
    always True. Otherwise the ranks agree once per window of `EVAL_WINDOW` batches: each fetches
    up to that many, and `agree(count)` (a collective: distributed.host_min_max) gives the fewest
    and the most any rank holds; every rank then takes `most` turns, `has` False on the turns past
    its own batches. Then `batch` is None (the caller steps on its last batch, or waits), except on
    the first turn of a rank whose stream was empty from the start: there it is a peer's first
    batch (gathered from every rank once, on every rank alike), so even that rank has a batch to
    step on. The loop ends on every rank after the same turn, when a window comes back short on
    every rank. Between agreements the ranks run at their own pace (one agreement per batch would
    make every batch wait for the slowest rank); a window's batches wait in host memory.

    `uneven` (alike on every rank): some window found ranks holding different counts; `shortfall`
    says which ranks ran short.
    """

    def __init__(self, loader: Any, n: int | float, agree: Callable[[int], tuple[int, int]] | None):
        self.loader, self.n, self.agree = loader, n, agree
        self.taken, self.turns = 0, 0  # this rank's own batches; the turns every rank took
        self.ran_out = False  # this rank's stream ended (rather than its limit `n` was reached)
        self.uneven = False

    def __iter__(self) -> Iterator[tuple[int, Any, bool]]:
        batches, agree = iter(self.loader), self.agree
        if agree is None:
            while self.turns < self.n and (batch := next(batches, _ENDED)) is not _ENDED:
                self.taken = self.turns = self.turns + 1
                yield self.turns - 1, batch, True
            return
        size = EVAL_WINDOW
        while True:
            window = self._fetch(batches, size)
            fewest, most = agree(len(window))
            if most == 0:
                return
            borrowed = None
            if fewest == 0 and self.turns == 0:  # a rank has nothing to step on: a peer's first
                firsts = gather_objects(window[0] if window else _NoBatch())
                borrowed = next(b for b in firsts if not isinstance(b, _NoBatch))
            self.uneven = self.uneven or fewest != most
            for i in range(most):
                has = i < len(window)
                batch = window[i] if has else borrowed if self.turns == 0 else None
                self.turns, self.taken = self.turns + 1, self.taken + has
                yield self.turns - 1, batch, has
            if most < size:  # every rank's stream (or limit) ended inside this window
                return

    def _fetch(self, batches: Iterator, size: int) -> list:
        """Up to `size` more batches of this rank's stream, within its limit `n`."""
        window: list = []
        while len(window) < size and self.taken + len(window) < self.n and not self.ran_out:
            batch = next(batches, _ENDED)
            self.ran_out = batch is _ENDED
            if not self.ran_out:
                window.append(batch)
        return window

    def shortfall(self, name: str) -> str:
        """Collective (every rank alike, when `uneven`): which ranks ran short of the others, by
        how many batches, for the line rank 0 prints."""
        try:
            claimed: int | None = len(self.loader)
        except TypeError:
            claimed = None
        ranks = gather_objects((self.ran_out, self.taken, claimed))
        short = [r for r, (_, taken, _) in enumerate(ranks) if taken < self.turns]
        said = "; ".join(
            f"{_ended(r, *ranks[r])}, {self.turns - ranks[r][1]} short of the longest"
            for r in short
        )
        return f"{name}: {said}; every rank ended after {self.turns} batches, together"


_ENDED = object()  # a stream's end, where None is a batch a loader may give


class _NoBatch:
    """A rank without a first batch, in `EvalBatches`' gather (picklable, unlike a sentinel)."""
