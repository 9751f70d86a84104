"""The largest micro-batch that fits, by the forecast: `largest_micro_batch` solves one candidate's
forecast peak for the micro-batch (bisection: the peak grows with it), `confirm_micro_batch` runs
real steps on a GPU, halving after each out-of-memory error, and `find_micro_batch` does both for a
strategy named by the user. The trials of `micro_batch="auto"`, which run the chosen strategy
itself, are lightspeed.plan.micro_batch's.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import Any

import torch

from lightspeed.errors import ConfigError
from lightspeed.plan.candidates import Candidate, build_candidates
from lightspeed.plan.chart import gib
from lightspeed.plan.forecast import (
    check_plan_args,
    forecast_candidate,
    has_deepspeed,
)
from lightspeed.plan.model_copy import plain_cuda_step
from lightspeed.plan.probe import ModelFacts, inspect_model


@dataclass(frozen=True)
class MicroBatch:
    """The finder's answer: the micro-batch, the forecast's own figure, and how it was confirmed."""

    size: int
    forecast_size: int
    note: str


def find_micro_batch(
    module: torch.nn.Module,
    batch: Any,
    devices: int,
    strategy: str,
    device_bytes: float,
    precision: str = "32-true",
    headroom: float = 0.1,
    max_micro_batch: int = 4096,
    device_type: str = "cpu",
    step_fn=None,
) -> MicroBatch:
    """The largest micro-batch that fits `device_bytes` (per device, less `headroom`) under
    `strategy` (a candidate name from `build_candidates`), from the forecast: model states and
    buffers are fixed, activations grow by the probe's measured bytes per sample.

    On CUDA the forecast is then confirmed by a real step, `step_fn(micro_batch)` (default: a plain
    single-device forward, backward and optimizer step of a copy of the module): on
    torch.cuda.OutOfMemoryError the memory is freed and the micro-batch halved until a step
    succeeds. On CPU the answer is the forecast's only (no step is run: host memory has no
    out-of-memory error to recover from), and the note says so.

    Raises:
        ConfigError: unknown strategy, or not even micro-batch 1 fits.
    """
    precision = check_plan_args(devices, precision, 1)
    by_name = {c.name: c for c in build_candidates(devices, deepspeed=has_deepspeed())}
    if strategy not in by_name:
        raise ConfigError(
            f"strategy={strategy!r} is not valid here: use one of {', '.join(sorted(by_name))}."
        )
    candidate, facts = by_name[strategy], inspect_model(module, batch, precision, device_type)
    size = largest_micro_batch(
        candidate, facts, devices, precision, device_bytes, headroom, max_micro_batch
    )
    if device_type != "cuda":
        return MicroBatch(size, size, "forecast only: on CPU no step is run to confirm it")
    confirmed = confirm_micro_batch(
        step_fn or (lambda n: plain_cuda_step(module, batch, n, precision)), size
    )
    return MicroBatch(
        confirmed,
        size,
        f"confirmed by a real step at {confirmed}"
        + (f" (the forecast's {size} ran out of memory)" if confirmed < size else ""),
    )


def largest_micro_batch(
    candidate: Candidate,
    facts: ModelFacts,
    devices: int,
    precision: str,
    device_bytes: float,
    headroom: float = 0.1,
    max_micro_batch: int = 4096,
) -> int:
    """The forecast's largest micro-batch for `candidate` within `device_bytes` less `headroom`:
    the largest whose forecast peak (`device_total`, every moment) fits, found by bisection (the
    peak grows with the micro-batch: activations by the probe's measured bytes per sample), capped
    at `max_micro_batch`.

    Raises:
        ConfigError: not even micro-batch 1 fits, naming what it needs and what is available.
    """
    limit = device_bytes * (1 - headroom)

    def peak(size: int) -> int:
        return forecast_candidate(candidate, facts, devices, precision, size).device_total

    if (need := peak(1)) > limit:
        raise ConfigError(
            f"micro_batch: not even 1 fits under {candidate.name}: it needs "
            f"{gib(need)} per device and {gib(limit)} is available "
            f"({headroom:.0%} kept free)."
        )
    fits, over = 1, max_micro_batch + 1
    if peak(max_micro_batch) <= limit:
        return max_micro_batch
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if peak(mid) <= limit else (fits, mid)
    return fits


def confirm_micro_batch(step_fn, size: int) -> int:
    """Runs `step_fn(size)`, halving `size` after each torch.cuda.OutOfMemoryError (memory freed in
    between); returns the first size that ran. Raises the last OutOfMemoryError if even 1 does not
    fit."""
    while True:
        try:
            step_fn(size)
            return size
        except torch.cuda.OutOfMemoryError:
            if size == 1:
                raise
        # Outside the except block: the traceback no longer holds the failed step's frames and
        # tensors.
        gc.collect()
        torch.cuda.empty_cache()
        size //= 2
