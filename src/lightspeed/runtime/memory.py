"""Measured, not computed: the bytes of the tensors this rank actually holds for the model's
training state.

    from lightspeed.runtime.memory import measure
    measure(trainer.strategy)   # {"params": ..., "grads": ..., "optim": ..., "master": ...} bytes
    on this rank

Only local storage counts: a DTensor (FSDP) counts its local shard, a ZeroRedundancyOptimizer its
own partition's state, DeepSpeed its partitioned flat buffers. Tensors shared between entries (tied
weights, gradient views into DDP buckets) count once. `master` is a separate fp32 copy of the
weights kept by the optimizer (DeepSpeed's fp32 partitions); torch strategies step the weights
themselves and have none. Call it between backward and step to see gradients: the step frees them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, cast

import torch

CATEGORIES = ("params", "grads", "optim", "master")


def cuda_free(device: torch.device) -> float:
    """Free bytes on a CUDA device, honouring a cap set with
    torch.cuda.set_per_process_memory_fraction."""
    free, total = torch.cuda.mem_get_info(device)
    capped = torch.cuda.get_per_process_memory_fraction(
        device
    ) * total - torch.cuda.memory_reserved(device)
    return min(free, capped)


def measure(strategy: Any) -> dict[str, int]:
    """Returns this rank's bytes per category (see the module doc) for a set-up strategy: its
    `measure()` (the protocol's; `measure_module` for the torch strategies, DeepSpeed reads its
    ZeRO partitions). Not collective."""
    return strategy.measure()


def measure_module(module: torch.nn.Module, optimizers: Iterable[Any]) -> dict[str, int]:
    """Bytes of `module`'s parameters and gradients and the optimizers' state on this rank (torch
    strategies)."""
    params = list(module.parameters())
    states = []
    for opt in optimizers:
        # A ZeroRedundancyOptimizer keeps the state of its partition in the local optimizer
        # `.optim`.
        local = getattr(opt, "optim", opt)
        states += [
            v for s in local.state.values() for v in s.values() if isinstance(v, torch.Tensor)
        ]
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params),
        "optim": tensor_bytes(states),
        "master": 0,
    }


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Sum of the bytes of the local part of each distinct tensor (None entries are skipped)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        if hasattr(t, "to_local"):  # DTensor: this rank's shard only
            t = cast(Any, t).to_local()
        if t.numel() == 0 or t.device.type == "meta":
            continue
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total
