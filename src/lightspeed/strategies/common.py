"""Small functions the strategy files share (composition, not a base class)."""

from __future__ import annotations

import copy
import gc
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..launch import rendezvous_server
from .base import RunSpec


def init_process_group(spec: RunSpec, timeout_s: float = 600) -> None:
    """Joins the default process group from the DistInfo read at launch: gloo on CPU, nccl on CUDA. A single
    process joins a group of one, so every strategy that needs a group also runs with devices=1."""
    if spec.device.type == "cuda":
        torch.cuda.set_device(spec.device)
    if dist.is_initialized():
        return
    info = spec.dist
    backend = "nccl" if spec.device.type == "cuda" else "gloo"
    if not info.is_distributed:
        # One process still gets a group of one (DDP, ZeRO and FSDP need a group): an in-memory store, no port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                                **({"device_id": spec.device} if backend == "nccl" else {}))
        return
    if info.launcher == "lightspeed":  # ranks we spawned meet at the store rank 0 opened before spawning them
        store = rendezvous_server() if info.rank == 0 else None
        if store is None:
            store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=info.rank == 0,
                                  wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        rendezvous = {"store": store}
    else:
        rendezvous = {"init_method": f"tcp://{info.master_addr}:{info.master_port}"}
    dist.init_process_group(
        backend,
        **rendezvous,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=timeout_s),
        # With nccl, binding the device lets torch create the communicator eagerly and use the right GPU.
        **({"device_id": spec.device} if backend == "nccl" else {}),
    )


def destroy_process_group() -> None:
    """Leaves the default process group, if joined. Strategies' `teardown` calls it; the Trainer runs `teardown`
    at exit, before the interpreter tears down: gloo's threads otherwise abort at exit ("terminate called
    without an active exception"), turning a finished run into a failed one."""
    if dist.is_initialized():
        dist.destroy_process_group()
        # Free what still holds the group (a DDP reducer in a trainer <-> module reference cycle) now, while
        # the interpreter is alive: gloo work freed during interpreter finalization aborts the process.
        gc.collect()


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


def apply_activation_checkpointing(module: torch.nn.Module, classes) -> None:
    """Wraps, in place, every submodule of `module` whose type is in `classes` with torch's non-reentrant
    activation checkpointing: its activations are recomputed in the backward instead of kept.

    Non-reentrant checkpointing is torch's recommended form: it works with ZeRO-3 and FSDP parameter hooks and
    with inputs that do not require grad. `state_dict()` keys stay unchanged (the wrapper's hooks strip its
    prefix), but `named_parameters()` gain `_checkpoint_wrapped_module.`; `CHECKPOINT_PREFIX` names it.

    Args:
        module: the model to change.
        classes: block classes (an iterable of types, or one type) to checkpoint, e.g. `[Block]`.
    Raises:
        ConfigError: if a class is not a type, or no submodule of `module` has that type; the message lists the
            candidate block classes (those of modules held in an nn.ModuleList or nn.Sequential).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing as torch_apply,
        checkpoint_wrapper,
    )

    from ..errors import ConfigError

    classes = tuple(classes) if isinstance(classes, (list, tuple, set)) else (classes,)
    present = {type(m) for m in module.modules()}
    for cls in classes:
        if not isinstance(cls, type) or cls not in present:
            candidates = sorted({type(child).__name__ for m in module.modules()
                                 if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)) for child in m})
            raise ConfigError(
                f"activation_checkpointing={getattr(cls, '__name__', cls)!r} is not valid: no submodule of "
                f"{type(module).__name__} has that class. Candidate block classes: {', '.join(candidates) or 'none'}."
            )
    torch_apply(
        module,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=CheckpointImpl.NO_REENTRANT),
        check_fn=lambda m: isinstance(m, classes),
    )


# What `apply_activation_checkpointing` inserts into parameter names (not into state_dict keys).
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


def wrap_ddp(module: torch.nn.Module, spec: RunSpec, **ddp_kwargs) -> torch.nn.Module:
    """DistributedDataParallel around a StepRunner of `module` (the DDP and ZeRO-1 strategies share it).

    A model with nothing to train (evaluation only) gets the bare StepRunner: DDP refuses such a model."""
    from torch.nn.parallel import DistributedDataParallel

    if not any(p.requires_grad for p in module.parameters()):
        return StepRunner(module)
    kwargs = {k: v for k, v in ddp_kwargs.items() if v is not None}
    if spec.device.type == "cuda":
        kwargs["device_ids"] = [spec.device.index]
    return DistributedDataParallel(StepRunner(module), **kwargs)


def ddp_backward(wrapped: torch.nn.Module, loss: torch.Tensor, precision, inside_forward: bool,
                 find_unused_parameters: bool) -> None:
    """Backward through DDP, also from inside `training_step` (manual optimization).

    There the backward runs inside DDP's forward, before DDP's post-forward arms the gradient reducer. Arm it
    here, then clear the sync flag so the post-forward does not arm it a second time for a backward that never
    comes (the next forward's bucket rebuild would then fail)."""
    from torch.nn.parallel import DistributedDataParallel

    if not (inside_forward and isinstance(wrapped, DistributedDataParallel)):
        precision.backward(loss)
        return
    wrapped.require_backward_grad_sync = True
    wrapped.reducer.prepare_for_backward([loss] if find_unused_parameters else [])
    precision.backward(loss)
    wrapped.require_backward_grad_sync = False


def broadcast_from_rank0(value: Any) -> Any:
    """Every rank gets rank 0's `value` (any picklable object). Collective."""
    dist.broadcast_object_list(box := [value], src=0)
    return box[0]


def configure_with_plain_twin(module: torch.nn.Module, configure_sharded: Callable[[], None],
                              twin_fits: Callable[[], bool]) -> tuple[bool, torch.nn.Module | None]:
    """Same seed, same initial weights under sharded construction (zero.Init, the meta device). Collective.

    Sharded construction loses what a single-device build does: zero.Init partitions a child's parameters before
    its parent's init touches them, and the meta device draws no random numbers at all. So `configure_sharded()`
    builds the model the backend's way and, when rank 0 finds `twin_fits()`, rank 0 also builds a plain twin:
    a deep copy of the module taken before `configure_model`, configured from the same RNG state, hence with a
    single-device run's exact weights. Every rank then continues from the RNG state that plain build left, as
    after a single-device build (dropout masks agree).

    Returns (whether the twin was built, the twin on rank 0 or None); the caller copies the twin into its shards.
    """
    from ..checkpoint import rng_state, set_rng_state

    rank0 = dist.get_rank() == 0
    trainer = module.__dict__.get("_trainer")  # shared with the twin, not copied
    twin = copy.deepcopy(module, {id(trainer): trainer}) if rank0 else None
    before = rng_state()
    configure_sharded()
    if not broadcast_from_rank0(rank0 and twin_fits()):
        return False, None
    if rank0:
        set_rng_state(before)
        twin.configure_model()
    set_rng_state(broadcast_from_rank0(rng_state() if rank0 else None))
    return True, twin
