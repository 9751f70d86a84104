"""How FSDP2 is laid over a module: which submodules become shard units, `fully_shard` over them
with a mixed-precision policy, tied parameters kept tied through meta-device materialisation, the
step methods registered as forwards, and the global norm of sharded gradients. Plain functions, in
the order `FSDP._shard` composes them (strategies/fsdp.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

from lightspeed.errors import ConfigError

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def apply_forward_method(module: nn.Module, name: str) -> None:
    """Registers the step method `name` of a sharded `module` with FSDP, so that it runs FSDP's root
    pre/post-forward (lazy init, gathering the root's parameters) like a forward: the Trainer calls
    `module.training_step(...)`, not `module(...)`. Nothing for a missing or None method.

    torch's wrapper copies the metadata of the *bound* method, so a signature read through it loses
    the user's first parameter (`training_step(self, batch, i)` would read as `(i)` and the loop
    would pass `batch` alone). The wrapper is given the user's own signature back."""
    user = getattr(module, name, None)
    if not (callable(user) and isinstance(module, FSDPModule)):
        return
    register_fsdp_forward_method(module, name)
    wrapper = getattr(module, name).__func__
    signature = inspect.signature(user)  # bound: without `self`; the wrapper is bound too
    first = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    wrapper.__signature__ = signature.replace(parameters=[first, *signature.parameters.values()])


def find_shard_units(module: nn.Module, classes: list[type] | None) -> list[nn.Module]:
    """Returns the submodules that become shard units, children before parents (the order
    `fully_shard` needs).

    With `classes` None, the units are the repeated blocks: instances of the classes of the children
    of every nn.ModuleList. A model without a ModuleList gets no units besides the root.

    Raises:
        ConfigError: if `classes` names a class not in the model, or the units hold no parameters
            at all.
    """
    if classes is None:
        classes = [type(c) for m in module.modules() if isinstance(m, nn.ModuleList) for c in m]
    kinds = tuple(dict.fromkeys(classes))
    units = [m for m in module.modules() if m is not module and isinstance(m, kinds)]
    candidates = sorted(
        {
            type(c).__name__
            for m in module.modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential))
            for c in m
        }
    )
    if kinds and not units:
        raise ConfigError(
            f"FSDP(shard_classes={[c.__name__ for c in kinds]}) is not valid: no submodule of "
            f"{type(module).__name__} has those classes. Candidate block classes: "
            f"{', '.join(candidates) or 'none'}."
        )
    if units and not any(True for u in units for _ in u.parameters()):
        raise ConfigError(
            f"FSDP shard units {sorted({type(u).__name__ for u in units})} hold no parameters, so "
            "there is nothing to shard in them. Pass shard_classes= naming blocks that own "
            f"weights (candidates: {', '.join(candidates) or 'none'})."
        )
    if not any(True for _ in module.parameters()):
        raise ConfigError(
            f"FSDP got {type(module).__name__} with no parameters: nothing to shard or train."
        )
    return units[::-1]


def find_child_units(
    module: nn.Module, units: list[nn.Module]
) -> list[nn.Module | list[nn.Module]]:
    """Under manual optimization, the root's children (a GAN's generator and discriminator)
    become units too.

    The user's `training_step` runs backward and `opt.step()` several times and calls children
    directly (`self.discriminator(x)`). As units, each child gathers its parameters for its own
    forward and backward only, so between them the module holds the sharded parameters the
    optimizers hold: `toggle_optimizer` matches them by identity, and no backward reshards
    parameters that a later call in the same step still uses (the root's would be). Containers
    (ModuleList, ModuleDict) are never called, so their children count instead; children that share
    a parameter (tied weights) are one unit; a child whose parameters all lie in `units` is skipped.

    Raises:
        ConfigError: if the root holds trainable parameters of its own (they would stay gathered
            for the whole step, out of `toggle_optimizer`'s reach, and resharded by the first
            backward).
    """
    sharded = {id(p) for u in units for p in u.parameters()}
    children, todo = [], list(module.children())
    while todo:
        child = todo.pop(0)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            todo[:0] = list(child.children())
        elif child not in units and any(id(p) not in sharded for p in child.parameters()):
            children.append(child)
    own = [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]
    if own:
        raise ConfigError(
            f"FSDP with automatic_optimization=False: {type(module).__name__} holds parameters of "
            f"its own ({', '.join(own)}), which cannot be sharded apart from the step. Move them "
            "into a child module (each child is sharded as its own unit)."
        )
    groups: list[list[nn.Module]] = []  # children joined by a shared (tied) parameter
    for child in children:
        ids = {id(p) for p in child.parameters()}
        joined = [g for g in groups if any(id(p) in ids for m in g for p in m.parameters())]
        groups = [g for g in groups if g not in joined] + [[m for g in joined for m in g] + [child]]
    return [g[0] if len(g) == 1 else g for g in groups]


def apply_fsdp(
    module: nn.Module,
    units: Sequence[nn.Module | list[nn.Module]],
    mesh,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> None:
    """Calls `fully_shard` on each unit (children first; a list of modules is one unit), then on the
    root, which takes the rest."""
    kwargs: dict[str, Any] = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(module, reshard_after_forward=reshard_after_forward, **kwargs)


def build_mp_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16-mixed / 16-mixed: compute in half precision, keep the shards in fp32. bf16-mixed
    reduce-scatters the gradients in bf16, as DeepSpeed's bf16 mode and Lightning's FSDP bf16-mixed
    do: the backward computed them in bf16, and fp32 traffic cost 2-GPU scaling (0.87 against 0.99
    in bf16, docs/benchmarks.md). 16-mixed reduces in fp32 (fp16 sums can overflow)."""
    match precision:
        case "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        case "16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        case _:
            return MixedPrecisionPolicy()  # 32-true, and bf16-true whose weights are already bf16


def total_norm_sharded(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global norm of sharded (DTensor) gradients, as a plain tensor. Collective.

    Each rank's norm covers its shards only; `full_tensor()` reduces the partial norms across
    ranks."""
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    return total.full_tensor() if isinstance(total, DTensor) else total


def find_tied_parameters(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (GPT's lm_head.weight and wte.weight)."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def apply_ties(module: nn.Module, ties: list[list[str]]) -> None:
    """Makes every name in each group refer to the first name's parameter again."""
    for first, *others in ties:
        param = module.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, param)
