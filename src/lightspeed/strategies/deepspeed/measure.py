"""The bytes of a DeepSpeed engine's training state on this rank (`DeepSpeed.measure()`; see
runtime/memory.py for the categories). ZeRO keeps that state in its optimizer's flat partitions,
not in module `.grad`s: this reads them, through DeepSpeed's internals (0.19)."""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.runtime.memory import tensor_bytes


def measure_engine(engine: Any) -> dict[str, int]:
    """{"params", "grads", "optim", "master"}: bytes of this rank's local parameter shards, gradient
    partitions, optimizer states and fp32 master partitions. Not collective."""
    zero = engine.optimizer
    inner = getattr(zero, "optimizer", zero)
    params = list(engine.module.parameters())
    # ZeRO-3 replaces each parameter's data with an empty placeholder and keeps the local shard in
    # ds_tensor.
    local_params = [getattr(p, "ds_tensor", p) for p in params]
    master = list(
        getattr(zero, "single_partition_of_fp32_groups", None)  # stages 1 and 2
        or getattr(zero, "fp32_partitioned_groups_flat", None)  # stage 3
        or []
    )
    grads = [p.grad for p in params] + [p.grad for p in master]
    # Stages 1/2 reduce into `averaged_gradients` (group -> partition tensors); stage 3 into
    # per-parameter partitions. Both hold this rank's slice only.
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
