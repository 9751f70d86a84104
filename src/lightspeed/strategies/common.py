"""Small functions the strategy files share (composition, not a base class)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .base import RunSpec


def init_process_group(spec: RunSpec, timeout_s: float = 600) -> None:
    """Joins the default process group from the DistInfo read at launch: gloo on CPU, nccl on CUDA."""
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    if dist.is_initialized() or not spec.dist.is_distributed:
        return
    info = spec.dist
    backend = "nccl" if spec.device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        # With nccl, binding the device lets torch create the communicator eagerly and use the right GPU.
        **({"device_id": spec.device} if backend == "nccl" else {}),
    )


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class StepRunner(torch.nn.Module):
    """Lets a wrapper (DDP, the DeepSpeed engine) run any `*_step` of the user's module as its forward.

    Wrappers do their bookkeeping in `forward` (DDP prepares the gradient reducer, ZeRO-3 gathers parameters),
    so a `training_step` must be entered through the wrapper, not by calling the module directly.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, step, *args):
        return step(*args)
