"""Each backend's share of the parameters on the busiest rank, from their shapes alone: torch's
ZeroRedundancyOptimizer hands whole parameters to ranks (`zero1_partition`), FSDP2 splits each
parameter's first dimension (`fsdp_local_numel`), DeepSpeed flattens and pads each optimizer group
(ZeRO-1/2) or partitions every parameter (ZeRO-3) (`deepspeed_parts`), and keeps its offloaded
buffers on the host in page-locked blocks (`offload_host_bytes`). Used by
`lightspeed.plan.forecast`.
"""

from __future__ import annotations

import math

from lightspeed.plan.probe import ModelFacts


def zero1_partition(groups: list[list[tuple[int, ...]]], devices: int) -> tuple[int, int]:
    """(numel, tensor count) of the busiest rank under torch's ZeroRedundancyOptimizer, which hands
    whole parameters, largest first within each group, to the rank with the fewest elements so
    far."""
    sizes, counts = [0] * devices, [0] * devices
    for group in groups:
        for numel in sorted((math.prod(s) for s in group), reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += numel
            counts[rank] += 1
    busiest = max(range(devices), key=lambda r: sizes[r])
    return sizes[busiest], counts[busiest]


def fsdp_local_numel(shapes: list[tuple[int, ...]], devices: int) -> int:
    """Elements rank 0 (the busiest) holds under FSDP2, which splits each parameter's first
    dimension into chunks of ceil(rows / world size)."""
    return sum(min(math.ceil(s[0] / devices), s[0]) * math.prod(s[1:]) if s else 1 for s in shapes)


def deepspeed_parts(stage: int, facts: ModelFacts, devices: int) -> list[int]:
    """Elements of this rank's partition per flat group: one per optimizer group under ZeRO-1/2
    (padded to 2 × world size, then split), one per 1e9 elements (a sub-group) under ZeRO-3."""
    if stage < 3:
        return [
            _round_up(sum(math.prod(s) for s in g), 2 * devices) // devices for g in facts.groups
        ]
    part = sum(math.ceil(math.prod(s) / devices) for s in facts.shapes)
    return [min(10**9, part - i) for i in range(0, part, 10**9)]


def offload_host_bytes(
    stage: int, facts: ModelFacts, devices: int, pinned: bool, offload_params: bool, wd: int
) -> int:
    """Host bytes per rank that DeepSpeed's CPU offload keeps (0.19, per flat group of this rank's
    partition P elements): the fp32 master (4P), the fp32 gradient (4P) and, under ZeRO-1/2, a
    half-precision staging copy (wdP), each page-locked when `pinned` (rounded up to a power of
    two); the optimizer's states (Adam 8P, allocated at the first step, pageable); ZeRO-3 also a
    half-precision gradient partition and, with the weights offloaded, the weights (wdP each)."""
    parts = deepspeed_parts(stage, facts, devices)
    lock = _pow2 if pinned else (lambda n: n)
    kept = sum(2 * lock(4 * p) + (lock(wd * p) if stage < 3 else 0) for p in parts)
    extra = wd * sum(parts) * (1 + bool(offload_params)) if stage == 3 else 0
    return kept + extra + facts.states_per_param * 4 * sum(parts)


def _pow2(n: int) -> int:
    """Bytes torch's pinned (page-locked) allocator reserves for `n`: the next power of two."""
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k
