"""Host memory that DeepSpeed's CPU offload keeps, estimated before DeepSpeed allocates it.

A rank that runs out of host memory is killed by the OS with no Python traceback, so the DeepSpeed
strategy checks first (a warning, since this is an estimate), and under ZeRO-3 decides with the same
figure whether rank 0's plain copy of the model fits beside it. Checked against one H200 host of 125
GiB (docs/benchmarks.md): 5.91B parameters, stage 3, optimizer offloaded unpinned, peaked at 102.7
GiB; fully offloaded and pinned, 5.77B died.
"""

from __future__ import annotations

Offload = str | None  # "cpu", "nvme" or None; NVMe offload keeps its states on disk


def offloaded_bytes_per_param(
    stage: int, offload_optimizer: Offload, offload_params: Offload
) -> int:
    """Host bytes per parameter (DeepSpeed 0.19, mixed precision): fp32 master weights and two Adam
    moments (12), fp32 gradients (4), under ZeRO-3 also a half-precision gradient partition (2);
    offloaded parameters add 2."""
    per_param = (16 + (2 if stage == 3 else 0)) if offload_optimizer == "cpu" else 0
    return per_param + (2 if offload_params == "cpu" else 0)


def host_memory_warning(
    numel: int,
    *,
    stage: int,
    offload_optimizer: Offload,
    offload_params: Offload,
    pinned: bool,
    node_share: float,
    host_bytes: float,
) -> str | None:
    """A warning when CPU offload of `numel` parameters may not fit in this node's host memory, else
    None.

    This node holds `node_share` of the offloaded states (local ranks / all ranks). Pinned blocks
    are rounded up to a power of two by torch: counted here as a third more."""
    need = offloaded_bytes_per_param(stage, offload_optimizer, offload_params) * numel * node_share
    gib = lambda b: f"{b / 2**30:.0f} GiB"  # noqa: E731
    if need > 0.9 * host_bytes:
        return (
            f"DeepSpeed: offloading {numel / 1e9:.2f}B parameters needs about {gib(need)} of host "
            "memory on this "
            f"node, which has {gib(host_bytes)}: the OS may kill the ranks without a traceback. "
            "Use "
            "more nodes, "
            "offload to 'nvme', or keep the parameters on the GPU (offload_params=None)."
        )
    if pinned and need * 4 / 3 > 0.9 * host_bytes:
        return (
            f"DeepSpeed: offloading {numel / 1e9:.2f}B parameters needs about {gib(need)} of host "
            "memory, and "
            f"pinned buffers are rounded up to powers of two (up to twice that); this node has "
            f"{gib(host_bytes)}. If the ranks are killed without a traceback, use "
            "DeepSpeed(pin_memory=False)."
        )
    return None
