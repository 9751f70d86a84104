"""Distributed data parallel: torch's DistributedDataParallel, gloo on CPU, nccl on CUDA.

Gradients are all-reduced only on the last micro-batch of an accumulation window: `require_backward_grad_sync`
is the flag `no_sync()` toggles, set here before the forward so the loop needs no context manager.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint_io import load_replicated, save_replicated
from ..precision import Precision, build_clip_fn
from .base import RunSpec
from .common import barrier, ddp_backward, destroy_process_group, init_process_group, wrap_ddp

CommHook = Literal["fp16", "bf16", "powersgd"]


@dataclass
class DDP:
    """Data parallel with torch DDP.

    Args:
        comm_hook: a torch DDP communication hook, by name ("fp16", "bf16" compression, "powersgd") or as a
            `(state, hook)` pair passed to `register_comm_hook` unchanged.
        powersgd_rank: matrix approximation rank for "powersgd".
        find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view: passed to DDP.
    """

    comm_hook: CommHook | tuple[Any, Callable] | None = None
    powersgd_rank: int = 1
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = True
    name: str = "ddp"
    is_manual_optimization_supported: bool = True
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)

    def connect(self, spec: RunSpec) -> None:
        self.spec = spec
        self.precision = Precision(spec)
        init_process_group(spec)

    def configure_model(self, module) -> None:
        module.configure_model()

    def setup(self, module, build_optimizers) -> None:
        self.module = self.precision.convert_module(module.to(self.spec.device))
        if build_optimizers is not None:
            self.optimizers, self.schedulers = build_optimizers()
        self.wrapped = wrap_ddp(self.module, self.spec, find_unused_parameters=self.find_unused_parameters,
                                static_graph=self.static_graph, bucket_cap_mb=self.bucket_cap_mb,
                                gradient_as_bucket_view=self.gradient_as_bucket_view)
        self._in_forward = False  # set while a step runs inside DDP's forward (see common.ddp_backward)
        if isinstance(self.wrapped, DistributedDataParallel):
            self._register_comm_hook()
        self.clip_fn = build_clip_fn(self.spec)

    def _register_comm_hook(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        match self.comm_hook:
            case None:
                return
            case "fp16":
                self.wrapped.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
            case "bf16" if self.spec.device.type == "cuda":
                self.wrapped.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
            case "bf16":
                self.wrapped.register_comm_hook(dist.group.WORLD, bf16_compress_hook_any_backend)
            case "powersgd":
                state = powerSGD_hook.PowerSGDState(
                    process_group=None, matrix_approximation_rank=self.powersgd_rank, start_powerSGD_iter=2
                )
                self.wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            case (state, hook):
                self.wrapped.register_comm_hook(state, hook)

    def set_grad_sync(self, is_boundary: bool) -> None:
        if isinstance(self.wrapped, DistributedDataParallel):
            self.wrapped.require_backward_grad_sync = is_boundary

    def forward(self, step, *args):
        self._in_forward = True
        try:
            with self.precision.autocast():
                return self.wrapped(step, *args)
        finally:
            self._in_forward = False

    def backward(self, loss) -> None:
        ddp_backward(self.wrapped, loss, self.precision, self._in_forward, self.find_unused_parameters)

    def step(self):
        return self.precision.step(self.optimizers, self.clip_fn)

    def save(self, path: Path) -> None:
        if self.spec.dist.is_global_zero:
            save_replicated(path, self.module, self.optimizers, {"precision": self.precision.state_dict()})
        barrier()

    def load(self, path: Path, with_optimizer: bool = True) -> None:
        state = load_replicated(path, self.module, self.optimizers, with_optimizer)
        self.precision.load_state_dict(state.get("precision", {}))

    def teardown(self) -> None:
        destroy_process_group()


def bf16_compress_hook_any_backend(process_group, bucket):
    """torch's bf16_compress_hook for any backend: all-reduces the bucket in bf16, averaged, then casts back.

    torch refuses to register its own hook unless NCCL ≥ 2.10 is present (a check by function name), yet gloo
    all-reduces bf16 too; this is the same computation under another name, used on CPU.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)
