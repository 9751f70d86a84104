"""DeepSpeed's room check made to see this process's memory cap.

ZeRO-1/2 flatten each group's half-precision weights into one buffer at setup. DeepSpeed makes
that copy on the device when `accelerator.available_memory()` (NVML's free bytes) covers it, else
it moves the weights to the host and flattens there. NVML does not see a per-process cap
(`torch.cuda.set_per_process_memory_fraction`, which the benchmarks' caps use), so under a cap
DeepSpeed would flatten on the device past the cap and run out of memory where a card of that size
would have flattened on the host. Inside `room_under_cap`, the check answers what the cap leaves:
min(NVML's free bytes, cap - bytes the caching allocator holds). The forecast counts the flatten
copy as yielding (plan/forecast.py, `Forecast.setup_yields`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def room_left(cap_bytes: float, reserved_bytes: int, free_bytes: int) -> int:
    """Bytes a new buffer may take: what the device has free, within what the cap leaves."""
    return max(0, min(free_bytes, int(cap_bytes) - reserved_bytes))


@contextmanager
def room_under_cap(device: torch.device) -> Iterator[None]:
    """While inside, DeepSpeed's `available_memory()` honours the process's memory fraction on
    `device`. Nothing changes on CPU ranks or without a cap."""
    fraction = 1.0
    if device.type == "cuda" and hasattr(torch.cuda, "get_per_process_memory_fraction"):
        fraction = torch.cuda.get_per_process_memory_fraction(device)
    if fraction >= 1.0:
        yield
        return
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    free = accelerator.available_memory  # the accelerator's own (bound) method
    cap = fraction * torch.cuda.get_device_properties(device).total_memory

    def available_memory(device_index=None):
        return room_left(cap, torch.cuda.memory_reserved(device), free(device_index))

    accelerator.available_memory = available_memory
    try:
        yield
    finally:
        del accelerator.available_memory  # the class's method again
