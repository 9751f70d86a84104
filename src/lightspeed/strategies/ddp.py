"""Distributed data parallel: torch's DistributedDataParallel, gloo on CPU, nccl on CUDA; optionally
with the optimizer state sharded by torch's ZeroRedundancyOptimizer (ZeRO stage 1, `ddp_sharded`).

    Trainer(strategy="ddp", devices=2)              # or DDP(comm_hook="bf16")
    Trainer(strategy="ddp_sharded", devices=2)      # or ZeRO1(), i.e. DDP(shard_optimizer=True)

Gradients are all-reduced only on the last micro-batch of an accumulation window:
`require_backward_grad_sync` is the flag `no_sync()` toggles, set here before the forward so the
loop needs no context manager.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import lightspeed.strategies.lightning as lightning
from lightspeed.checkpoint.io import load_replicated, save_replicated
from lightspeed.checkpoint.layouts import Portable, optimizer_param_names, write_torch
from lightspeed.perf.kernels import apply_compile, build_optimizers_fast
from lightspeed.perf.precision import Precision, StepGate, optimizer_step
from lightspeed.runtime.distributed import barrier, destroy_process_group, init_process_group
from lightspeed.runtime.launch import DistInfo
from lightspeed.runtime.memory import measure_module
from lightspeed.specs import RunSpec, StepStats
from lightspeed.strategies.common import (
    StepRunner,
    checkpoint_layout,
    fork_of,
    options_of,
    sampler_kwargs,
)
from lightspeed.strategies.zero1 import apply_zero1

CommHook = Literal["fp16", "bf16", "powersgd"]


@dataclass
class DDP:
    """Data parallel with torch DDP.

    Args:
        comm_hook: a torch DDP communication hook, by name ("fp16", "bf16" compression, "powersgd")
        or as a
            `(state, hook)` pair passed to `register_comm_hook` unchanged.
        powersgd_rank: matrix approximation rank for "powersgd".
        find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view: passed to DDP.
        shard_optimizer: ZeRO-1: each rank keeps the optimizer state of its partition of the
        parameters only
            (ZeroRedundancyOptimizer of the user's optimizer class; see zero1.py). Checkpoints keep
            the replicated layout, so they load on any world size.
        parameters_as_bucket_view: with shard_optimizer, passed to ZeroRedundancyOptimizer.
    """

    comm_hook: CommHook | tuple[Any, Callable] | None = None
    powersgd_rank: int = 1
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = True
    shard_optimizer: bool = False
    parameters_as_bucket_view: bool = False
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name = "ddp_sharded" if self.shard_optimizer else "ddp"
        self.dist: DistInfo | None = None
        self.device: Any = None  # a torch.device, once connected
        self.module: Any = None  # the user's Module, once set up
        self.wrapped: Any = None  # DDP around a StepRunner, once set up
        self.is_fork = False

    # What others may read (strategies/base.py), and Lightning's names for it.
    distributed_sampler_kwargs = sampler_kwargs

    @property
    def model(self) -> Any:
        return self.wrapped

    @property
    def layout(self) -> str | None:
        return checkpoint_layout(self)

    root_device, lightning_module = lightning.root_device, lightning.lightning_module
    world_size, global_rank = lightning.world_size, lightning.global_rank
    local_rank, is_global_zero = lightning.local_rank, lightning.is_global_zero
    barrier, broadcast, reduce = lightning.COLLECTIVES

    def measure(self) -> dict[str, int]:
        return measure_module(self.module, self.optimizers)

    def settings(self) -> dict[str, Any]:
        return options_of(self)

    def fork(self) -> DDP:
        return fork_of(self)

    def check(self, spec: RunSpec) -> None:
        pass  # DDP honours every flag, manual optimization included

    def connect(self, spec: RunSpec, dist_info: DistInfo, device: torch.device) -> None:
        self.spec, self.dist, self.device = spec, dist_info, device
        self.precision = Precision(spec.precision, device.type)
        init_process_group(dist_info, device, spec.timeout_s)

    def configure_model(self, module) -> None:
        module.configure_model()

    def setup(self, module, build_optimizers, micro_batch_size=None) -> None:
        self.module = self.precision.convert_module(module.to(self.device))
        if self.spec.compile:
            # before DDP wraps it: DDP's hooks stay outside the compiled code
            apply_compile(module, options=self.spec.compile)
        if build_optimizers is not None:
            self.optimizers, self.schedulers = build_optimizers_fast(
                build_optimizers,
                self.spec,
                backend="torch",
                device_type=self.device.type,
                is_global_zero=self.dist.is_global_zero,
            )
            if self.shard_optimizer:
                self.optimizers, self.schedulers = apply_zero1(
                    self.optimizers, self.schedulers, self.parameters_as_bucket_view
                )
        self.wrapped = wrap_ddp(
            self.module,
            self.device,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )
        self._in_forward = False  # set while a step runs inside DDP's forward (see `backward`)
        if isinstance(self.wrapped, DistributedDataParallel):
            self._register_comm_hook()

    def _register_comm_hook(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        match self.comm_hook:
            case None:
                return
            case "fp16":
                self.wrapped.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
            case "bf16" if self.device.type == "cuda":
                self.wrapped.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
            case "bf16":
                self.wrapped.register_comm_hook(dist.group.WORLD, bf16_compress_hook_any_backend)
            case "powersgd":
                state = powerSGD_hook.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=self.powersgd_rank,
                    start_powerSGD_iter=2,
                )
                self.wrapped.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
            case (state, hook):
                self.wrapped.register_comm_hook(state, hook)

    def forward(self, step, *args, sync_grads: bool = True):
        if isinstance(self.wrapped, DistributedDataParallel):
            self.wrapped.require_backward_grad_sync = sync_grads
        self._in_forward = True
        try:
            with self.precision.autocast():
                return self.wrapped(step, *args)
        except RuntimeError as err:
            if (
                "finished reduction in the prior iteration" not in str(err)
                or self.find_unused_parameters
            ):
                raise
            # torch's advice (a DistributedDataParallel keyword) is out of the user's reach here.
            raise RuntimeError(
                "Some parameters got no gradient in the last step (e.g. toggle_optimizer freezing "
                "half of a GAN, "
                "or a layer the loss does not use), which plain DDP cannot reduce. Use "
                "strategy='ddp_find_unused_parameters_true' (or DDP(find_unused_parameters=True))."
            ) from err
        finally:
            self._in_forward = False

    def backward(self, loss, **options) -> None:
        """Backward through DDP, also from inside `training_step` (manual optimization).

        There the backward runs inside DDP's forward, before DDP's post-forward arms the gradient
        reducer. Arm it here, then clear the sync flag so the post-forward does not arm it a second
        time for a backward that never comes (the next forward's bucket rebuild would then fail)."""
        wrapped = self.wrapped
        if not (self._in_forward and isinstance(wrapped, DistributedDataParallel)):
            self.precision.backward(loss, **options)
            return
        wrapped.require_backward_grad_sync = True
        wrapped.reducer.prepare_for_backward([loss] if self.find_unused_parameters else [])
        self.precision.backward(loss, **options)
        wrapped.require_backward_grad_sync = False

    def step(self, should_step: StepGate | None = None) -> StepStats:
        # After DDP's all-reduce every rank holds the full gradient, so the local norm is already
        # global.
        return optimizer_step(self.optimizers, self.precision, self.spec, should_step=should_step)

    def save(self, path: Path) -> None:
        if self.shard_optimizer:
            # Each rank holds a slice of the optimizer state; torch gathers it on rank 0, a
            # collective every rank
            # must enter, before rank 0's state_dict() can return the whole of it.
            for opt in self.optimizers:
                opt.consolidate_state_dict(to=0)
        if self.dist.is_global_zero:
            save_replicated(
                path,
                self.module,
                self.optimizers,
                {
                    "precision": self.precision.state_dict(),
                    "param_names": optimizer_param_names(self.module, self.optimizers),
                },
            )  # read on other strategies
        barrier()

    def load(
        self, path: Path, with_optimizer: bool = True, portable: Portable | None = None
    ) -> None:
        if (
            portable is not None
        ):  # another strategy's checkpoint, in the neutral form (strategies/portable.py)
            write_torch(portable, self.module, self.optimizers, with_optimizer, path)
            self.precision.load_state_dict(portable.get("precision", {}))
            return
        # A ZeroRedundancyOptimizer takes the consolidated state and keeps this rank's partition, so
        # a checkpoint
        # saved on any world size loads here.
        state = load_replicated(path, self.module, self.optimizers, with_optimizer)
        self.precision.load_state_dict(state.get("precision", {}))

    def teardown(self) -> None:
        if not self.is_fork:  # a fork's group is its parent's
            destroy_process_group()


class DDPStrategy(abc.ABC):
    """Lightning's `DDPStrategy`: `DDPStrategy(find_unused_parameters=True, ...)` takes Lightning's
    keywords (`lightning.ddp_options`) and returns a `DDP`; every DDP is an instance, also one built
    from a string ("ddp", "ddp_sharded")."""

    def __new__(cls, **kwargs: Any) -> DDP:  # type: ignore[misc]
        return DDP(**lightning.ddp_options(**kwargs))


DDPStrategy.register(DDP)


# noqa: N802 - the name users type
def ZeRO1(parameters_as_bucket_view: bool = False, **ddp_options: Any) -> DDP:
    """ZeRO stage 1 the torch-native way: `DDP(shard_optimizer=True)`, the strategy behind
    "ddp_sharded"."""
    return DDP(
        shard_optimizer=True, parameters_as_bucket_view=parameters_as_bucket_view, **ddp_options
    )


def wrap_ddp(module: torch.nn.Module, device: torch.device, **ddp_kwargs) -> torch.nn.Module:
    """DistributedDataParallel around a StepRunner of `module`.

    A model with nothing to train (evaluation only) gets the bare StepRunner: DDP refuses such a
    model."""
    if not any(p.requires_grad for p in module.parameters()):
        return StepRunner(module)
    kwargs = {k: v for k, v in ddp_kwargs.items() if v is not None}
    if device.type == "cuda":
        kwargs["device_ids"] = [device.index]
    return DistributedDataParallel(StepRunner(module), **kwargs)


def bf16_compress_hook_any_backend(process_group, bucket):
    """torch's bf16_compress_hook for any backend: all-reduces the bucket in bf16, averaged, then
    casts back.

    torch refuses to register its own hook unless NCCL ≥ 2.10 is present (a check by function name),
    yet gloo all-reduces bf16 too; this is the same computation under another name, used on CPU.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(dist.get_world_size(group))
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return future.then(decompress)
