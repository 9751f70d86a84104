"""Lightning's strategy vocabulary over lightspeed's own strategies: the keywords its strategy
classes take, and the names Lightning code reads back from `trainer.strategy`.

    from lightspeed.strategies import DeepSpeedStrategy, FSDPStrategy, DDPStrategy
    Trainer(strategy=DeepSpeedStrategy(stage=3, offload_optimizer=True))  # a DeepSpeed(stage=3)
    isinstance(Trainer(strategy="deepspeed_stage_3").strategy, DeepSpeedStrategy)    # True

Each Lightning class is an abstract class at Lightning's module path (ddp.py, fsdp.py,
deepspeed/lightning.py) with our backend registered as its one implementation: calling it maps
Lightning's keywords (the `*_options` functions here) onto one lightspeed object, so `isinstance`
holds for strategies built from strings too, and no strategy subclasses another. Keywords that
configure what lightspeed decides elsewhere (accelerator, cluster environment, process-group
backend, timeouts) are accepted and have no effect; a keyword Lightning does not have is a
ConfigError naming it.

Read-back names (the same on every backend, assigned in each class body): `root_device`,
`lightning_module`, `world_size`, `global_rank`, `local_rank`, `is_global_zero` (known once the
Trainer connected the strategy; before that the rank names describe one process), and the
collectives `barrier()`, `broadcast(obj, src=0)`, `reduce(tensor, reduce_op="mean")`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightspeed.errors import ConfigError
from lightspeed.runtime import distributed

# Accepted for compatibility; lightspeed decides these from the Trainer's flags and the launch
# environment.
NO_EFFECT = {
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
    "precision",
    "process_group_backend",
    "timeout",
    "start_method",
}


def check_keywords(cls: str, given: dict, accepted: set[str]) -> None:
    """Raises ConfigError naming the keywords of `given` that Lightning's `cls` does not take."""
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ConfigError(f"{cls} got unknown keywords {unknown}: accepted are {sorted(accepted)}.")


# ------------------------------------------------------------------ DDPStrategy
_DDP_KEYWORDS = {
    "find_unused_parameters",
    "static_graph",
    "gradient_as_bucket_view",
    "bucket_cap_mb",
    "ddp_comm_hook",
    "ddp_comm_state",
    "broadcast_buffers",
} | NO_EFFECT


def ddp_options(**kwargs: Any) -> dict[str, Any]:
    """`DDP(...)`'s keywords for Lightning's `DDPStrategy` keywords: `find_unused_parameters`,
    `static_graph`, `gradient_as_bucket_view`, `bucket_cap_mb`, `ddp_comm_hook` (with
    `ddp_comm_state`). Raises ConfigError for an unknown keyword or `broadcast_buffers=False`."""
    check_keywords("DDPStrategy", kwargs, _DDP_KEYWORDS)
    if kwargs.get("broadcast_buffers", True) is not True:
        raise ConfigError(
            "DDPStrategy(broadcast_buffers=False) is not supported: buffers are broadcast."
        )
    hook = kwargs.get("ddp_comm_hook")
    return dict(
        find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
        static_graph=bool(kwargs.get("static_graph", False)),
        gradient_as_bucket_view=bool(kwargs.get("gradient_as_bucket_view", True)),
        bucket_cap_mb=kwargs.get("bucket_cap_mb"),
        comm_hook=(kwargs.get("ddp_comm_state"), hook) if hook is not None else None,
    )


# ------------------------------------------------------------------ FSDPStrategy
_FSDP_KEYWORDS = {
    "sharding_strategy",
    "cpu_offload",
    "activation_checkpointing_policy",
    "activation_checkpointing",
    "auto_wrap_policy",
    "state_dict_type",
    "mixed_precision",
    "limit_all_gathers",
    "use_orig_params",
    "sync_module_states",
    "device_mesh",
} | NO_EFFECT


def fsdp_options(
    sharding_strategy: Any = "FULL_SHARD",
    cpu_offload: Any = False,
    activation_checkpointing_policy: Any = None,
    auto_wrap_policy: Any = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """`FSDP(...)`'s keywords for Lightning's `FSDPStrategy` keywords.

    `sharding_strategy`: "FULL_SHARD" (FSDP, reshard after forward) or "SHARD_GRAD_OP"
    (fsdp_grad_op), as a string or torch's ShardingStrategy enum. `cpu_offload`: a bool or torch's
    CPUOffload(offload_params=...). `activation_checkpointing_policy` (or the older
    `activation_checkpointing`): a set or list of block classes. `auto_wrap_policy`: a set or list
    of block classes, each instance a shard unit. `state_dict_type`, `mixed_precision`,
    `limit_all_gathers`, `use_orig_params`, `sync_module_states` are accepted and have no effect
    (FSDP2 saves sharded DCP checkpoints, precision follows the Trainer's flag). Raises ConfigError
    for an unknown keyword, another sharding strategy or a callable policy.
    """
    check_keywords("FSDPStrategy", kwargs, _FSDP_KEYWORDS)
    name = getattr(sharding_strategy, "name", sharding_strategy)
    if name not in ("FULL_SHARD", "SHARD_GRAD_OP"):
        raise ConfigError(
            f"FSDPStrategy(sharding_strategy={sharding_strategy!r}) is not valid: use 'FULL_SHARD' "
            "or 'SHARD_GRAD_OP' (NO_SHARD is strategy='ddp'; hybrid sharding is not supported)."
        )
    if kwargs.get("device_mesh") is not None:
        raise ConfigError(
            "FSDPStrategy(device_mesh=...) is not supported: lightspeed shards over all ranks."
        )
    checkpointing = activation_checkpointing_policy or kwargs.get("activation_checkpointing")
    return dict(
        reshard_after_forward=name == "FULL_SHARD",
        shard_classes=_classes("auto_wrap_policy", auto_wrap_policy),
        cpu_offload=bool(getattr(cpu_offload, "offload_params", cpu_offload)),
        activation_checkpointing=_classes("activation_checkpointing_policy", checkpointing),
    )


def _classes(what: str, policy: Any) -> list[type] | None:
    if policy is None:
        return None
    if isinstance(policy, type):
        return [policy]
    if isinstance(policy, (set, list, tuple, frozenset)) and all(
        isinstance(c, type) for c in policy
    ):
        return sorted(policy, key=lambda c: c.__qualname__)
    raise ConfigError(
        f"FSDPStrategy({what}={policy!r}) is not valid: give a set of module classes "
        "(e.g. {Block}); callable policies are not supported."
    )


# ------------------------------------------------------------------ read-back names
# Properties over what every backend's `connect` stores (`dist`, `device`) and `setup` (`module`).
# `dist` is None before `connect`: the rank names then describe one process.
def _rank(name: str, alone: Any) -> property:
    return property(lambda s: alone if s.dist is None else getattr(s.dist, name))


root_device = property(lambda s: s.device, doc="Lightning's name for `device`.")
lightning_module = property(lambda s: s.module, doc="The user's Module, once set up.")
world_size = _rank("world_size", 1)
global_rank = _rank("rank", 0)
local_rank = _rank("local_rank", 0)
is_global_zero = _rank("is_global_zero", True)


def barrier(*_name: Any) -> None:
    """Lightning's `strategy.barrier(name=None)`: waits for every rank. Collective."""
    distributed.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    """Lightning's `strategy.broadcast(obj, src=0)`: every rank gets rank `src`'s `obj` (any
    picklable object). Collective; returns `obj` without a process group."""
    if not dist.is_initialized():
        return obj
    dist.broadcast_object_list(box := [obj], src=src)
    return box[0]


def reduce(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """Lightning's `strategy.reduce(tensor, group=None, reduce_op="mean")`: the tensor reduced over
    the ranks ("mean" or "sum", or a torch ReduceOp). Collective; a non-tensor is returned as
    it is, as in Lightning. Raises ConfigError for another reduce_op."""
    if not isinstance(tensor, torch.Tensor) or not distributed.is_distributed():
        return tensor
    op = str(getattr(reduce_op, "name", reduce_op)).lower()
    if op not in ("mean", "avg", "sum"):
        raise ConfigError(f"strategy.reduce(reduce_op={reduce_op!r}) is not valid: use 'mean'.")
    out = tensor.clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out / dist.get_world_size(group) if op in ("mean", "avg") else out


# Each backend's class body takes them as static methods.
COLLECTIVES = staticmethod(barrier), staticmethod(broadcast), staticmethod(reduce)
