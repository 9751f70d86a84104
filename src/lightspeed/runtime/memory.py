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
from typing import Any

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
    """Returns this rank's bytes per category (see the module doc) for a set-up strategy.

    Works for SingleDevice, DDP, ZeRO1 and FSDP (`strategy.module`, `strategy.optimizers`) and for
    DeepSpeed (`strategy.engine`). Not collective."""
    engine = getattr(strategy, "engine", None)
    if engine is not None:
        return _measure_deepspeed(engine)
    return measure_module(strategy.module, strategy.optimizers)


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
            t = t.to_local()
        if t.numel() == 0 or t.device.type == "meta":
            continue
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _measure_deepspeed(engine: Any) -> dict[str, int]:
    """DeepSpeed keeps training state in the ZeRO optimizer's flat partitions; read those, not
    module .grad."""
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    params = list(engine.module.parameters())
    # ZeRO-3 replaces each parameter's data with an empty placeholder and keeps the local shard in
    # ds_tensor.
    local_params = [getattr(p, "ds_tensor", p) for p in params]
    master = list(
        getattr(zero, "single_partition_of_fp32_groups", None)  # stages 1 and 2
        or getattr(zero, "fp32_partitioned_groups_flat", None)
        or []
    )  # stage 3
    grads = [p.grad for p in params] + [p.grad for p in master]
    # Stages 1/2 reduce into `averaged_gradients` (group -> partition tensors); stage 3 into
    # per-parameter
    # partitions. Both hold this rank's slice only.
    for value in (getattr(zero, "averaged_gradients", None) or {}).values():
        grads += list(value) if isinstance(value, (list, tuple)) else [value]
    grads += list(
        getattr(zero, "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", {}).values()
    )
    states = [v for s in inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": tensor_bytes(local_params),
        "grads": tensor_bytes(grads),
        "optim": tensor_bytes(states),
        "master": tensor_bytes(master),
    }
