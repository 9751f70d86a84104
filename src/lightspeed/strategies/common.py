"""Small functions the strategy files share (composition, not a base class)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist

from lightspeed.checkpoint.layouts import layout
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import broadcast_from_rank0
from lightspeed.runtime.rng import rng_state, set_rng_state


def checkpoint_layout(strategy: Any) -> str | None:
    """Every backend's `layout`: how its checkpoints lie on disk on this run's world size
    (checkpoint.layouts.layout); None before `connect`."""
    return None if strategy.dist is None else layout(strategy.name, strategy.dist.world_size)


# The protocol's `distributed_sampler_kwargs` where every rank is a data-parallel rank. (A decorated
# function, not `property(lambda ...)`: pyright sees a getter, and its type, only this way.)
@property
def sampler_kwargs(s: Any) -> dict[str, int] | None:
    return None if s.dist is None else {"num_replicas": s.dist.world_size, "rank": s.dist.rank}


def options_of(strategy: Any) -> dict[str, Any]:
    """A backend's `settings()`: its constructor options (its dataclass fields, minus the loop's
    lists), as the run report shows them."""
    skip = {"optimizers", "schedulers", "config"}
    return {
        f.name: getattr(strategy, f.name)
        for f in dataclasses.fields(strategy)
        if f.name not in skip
    }


def fork_of(strategy: Any) -> Any:
    """A backend's `fork()`: a copy of a connected, not yet configured `strategy` (same options,
    device and process group) for a trial run; its `teardown` frees what the trial built and leaves
    the group joined (it is the parent's).

    Raises:
        RuntimeError: if `strategy` was set up already (a copy would duplicate its model).
    """
    if strategy.model is not None:
        raise RuntimeError(f"{strategy.name}.fork() is for a strategy not yet set up.")
    twin = copy.deepcopy(strategy)
    twin.is_fork = True
    return twin


class StepRunner(torch.nn.Module):
    """Lets a wrapper (DDP, the DeepSpeed engine) run any `*_step` of the user's module as its
    forward.

    Wrappers do their bookkeeping in `forward` (DDP prepares the gradient reducer, ZeRO-3 gathers
    parameters), so a `training_step` must be entered through the wrapper, not by calling the module
    directly.
    """

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, step, *args):
        return step(*args)


def apply_activation_checkpointing(module: torch.nn.Module, classes) -> None:
    """Wraps, in place, every submodule of `module` whose type is in `classes` with torch's
    non-reentrant activation checkpointing: its activations are recomputed in the backward instead
    of kept. Hugging Face configs inside `module` get `use_cache=False` (`without_cache`).

    Non-reentrant checkpointing is torch's recommended form: it works with ZeRO-3 and FSDP parameter
    hooks and with inputs that do not require grad. `state_dict()` keys stay unchanged (the
    wrapper's hooks strip its prefix), but `named_parameters()` gain `_checkpoint_wrapped_module.`;
    `CHECKPOINT_PREFIX` names it.

    Args:
        module: the model to change.
        classes: block classes (an iterable of types, or one type) to checkpoint, e.g. `[Block]`.
    Raises:
        ConfigError: if a class is not a type, or no submodule of `module` has that type; the
        message lists the
            candidate block classes (those of modules held in an nn.ModuleList or nn.Sequential).
    """
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing as torch_apply,
    )

    classes = tuple(classes) if isinstance(classes, (list, tuple, set)) else (classes,)
    present = {type(m) for m in module.modules()}
    for cls in classes:
        if not isinstance(cls, type) or cls not in present:
            candidates = sorted(
                {
                    type(child).__name__
                    for m in module.modules()
                    if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential))
                    for child in m
                }
            )
            raise ConfigError(
                f"activation_checkpointing={getattr(cls, '__name__', cls)!r} is not valid: no "
                "submodule of "
                f"{type(module).__name__} has that class. Candidate block classes: "
                f"{', '.join(candidates) or 'none'}."
            )
    without_cache(module)
    torch_apply(
        module,
        checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(
            m, checkpoint_impl=CheckpointImpl.NO_REENTRANT
        ),
        check_fn=lambda m: isinstance(m, classes),
    )


def without_cache(module: torch.nn.Module) -> None:
    """Turns off `use_cache` in every Hugging Face config inside `module` (an encoder-decoder's
    decoder has a config of its own): a key-value cache filled in the forward is found filled by
    the recomputation, which then saves other tensors (HF T5 under checkpointing: torch's
    CheckpointError, 56 tensors saved against 52). Training reads no cache; HF's own gradient
    checkpointing turns it off the same way."""
    for sub in module.modules():
        config = getattr(sub, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False


# What `apply_activation_checkpointing` inserts into parameter names (not into state_dict keys).


def configure_with_plain_twin(
    module: torch.nn.Module, configure_sharded: Callable[[], None], twin_fits: Callable[[], bool]
) -> tuple[bool, torch.nn.Module | None]:
    """Same seed, same initial weights under sharded construction (zero.Init, the meta device).
    Collective.

    Sharded construction loses what a single-device build does: zero.Init partitions a child's
    parameters before its parent's init touches them, and the meta device draws no random numbers at
    all. So `configure_sharded()`
    builds the model the backend's way and, when rank 0 finds `twin_fits()`, rank 0 also builds a
    plain twin: a deep copy of the module taken before `configure_model`, configured from the same
    RNG state, hence with a single-device run's exact weights. Every rank then continues from the
    RNG state that plain build left, as after a single-device build (dropout masks agree).

    Returns (whether the twin was built, the twin on rank 0 or None); the caller copies the twin
    into its shards.
    """
    rank0 = dist.get_rank() == 0
    twin = (
        copy.deepcopy(module) if rank0 else None
    )  # the Module holds its Trainer by weak reference: not copied
    before = rng_state()
    configure_sharded()
    if not broadcast_from_rank0(rank0 and twin_fits()):
        return False, None
    if rank0:
        set_rng_state(before)
        cast(Any, twin).configure_model()  # a copy of the user's Module
    set_rng_state(broadcast_from_rank0(rng_state() if rank0 else None))
    return True, twin
