"""Lightning's strategy classes as functions returning lightspeed's own strategies, so a Lightning
script's `DeepSpeedStrategy(stage=3, offload_optimizer=True)` runs with the import changed and
nothing else.

    from lightspeed.strategies import DeepSpeedStrategy, FSDPStrategy, DDPStrategy
    Trainer(strategy=DeepSpeedStrategy(stage=3, offload_optimizer=True))   # is DeepSpeed(stage=3,
    offload_optimizer="cpu")

Each function maps Lightning's keywords onto one lightspeed object (no subclassing, no second code
path). Keywords that configure what lightspeed decides elsewhere (accelerator, cluster environment,
process-group backend, timeouts, logging level) are accepted and have no effect; a keyword Lightning
does not have is a ConfigError naming it. The DeepSpeed keywords that are plain DeepSpeed config
entries (`contiguous_gradients`, `sub_group_size`, `loss_scale`, ...) go into the config when given,
and `.config` on the result shows what the keywords set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightspeed.errors import ConfigError
from lightspeed.strategies.ddp import DDP

# Accepted for compatibility; lightspeed decides these from the Trainer's flags and the launch
# environment.
_NO_EFFECT = {
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

_DS_ZERO_KEYS = {  # Lightning keyword -> key of DeepSpeed's zero_optimization section
    "contiguous_gradients": "contiguous_gradients",
    "overlap_comm": "overlap_comm",
    "allgather_partitions": "allgather_partitions",
    "reduce_scatter": "reduce_scatter",
    "sub_group_size": "sub_group_size",
}
_DS_FP16_KEYS = {
    "loss_scale",
    "initial_scale_power",
    "loss_scale_window",
    "hysteresis",
    "min_loss_scale",
}
_DS_AIO_KEYS = {"block_size", "queue_depth", "single_submit", "overlap_events", "thread_count"}
_DS_OFFLOAD_PARAM_KEYS = {"params_buffer_count", "params_buffer_size", "max_in_cpu"}
_DS_OFFLOAD_OPT_KEYS = {"optimizer_buffer_count": "buffer_count"}
_DS_ACTIVATION_KEYS = {
    "partition_activations",
    "cpu_checkpointing",
    "contiguous_memory_optimization",
    "synchronize_checkpoint_boundary",
}
# Lightning keywords with no counterpart here, and why (kept in one place so docs/porting.md can
# cite them).
_DS_IGNORED = {
    "logging_batch_size_per_gpu": (
        "lightspeed sets train_micro_batch_size_per_gpu from the train loader"
    ),
    "logging_level": "DeepSpeed logs at WARNING under lightspeed",
    "remote_device": "zero.Init places parameters from offload_parameters",
    "zero_allow_untested_optimizer": "always True here",
    "load_full_weights": "load_from_checkpoint and convert read any checkpoint layout",
    "exclude_frozen_parameters": "every parameter is saved",
}
_DS_KEYWORDS = (
    {
        "zero_optimization",
        "stage",
        "offload_optimizer",
        "offload_parameters",
        "offload_params_device",
        "offload_optimizer_device",
        "nvme_path",
        "pin_memory",
        "config",
        "allgather_bucket_size",
        "reduce_bucket_size",
    }
    | set(_DS_ZERO_KEYS)
    | _DS_FP16_KEYS
    | _DS_AIO_KEYS
    | _DS_OFFLOAD_PARAM_KEYS
    | set(_DS_OFFLOAD_OPT_KEYS)
    | _DS_ACTIVATION_KEYS
    | set(_DS_IGNORED)
    | _NO_EFFECT
)


def _check_keywords(cls: str, given: dict, accepted: set[str]) -> None:
    unknown = sorted(set(given) - accepted)
    if unknown:
        raise ConfigError(f"{cls} got unknown keywords {unknown}: accepted are {sorted(accepted)}.")


def DeepSpeedStrategy(
    stage: int | None = None,
    offload_optimizer: bool = False,  # noqa: N802 - Lightning's name
    offload_parameters: bool = False,
    config: dict | str | Path | None = None,
    **kwargs: Any,
):
    """Returns `DeepSpeed(...)` for Lightning's `DeepSpeedStrategy` keywords.

    `stage` defaults to 2, or to the stage in `config` when one is given (as in Lightning).
    `offload_optimizer` and `offload_parameters` are booleans; the device comes from
    `offload_optimizer_device` / `offload_params_device` ("cpu" or "nvme", with `nvme_path`).
    `pin_memory` applies to offloaded buffers only. `config` (a dict or a JSON file; without one,
    the file named by the PL_DEEPSPEED_CONFIG_PATH environment variable, as in Lightning) is merged
    over what the keywords set. `logging_batch_size_per_gpu` and the keywords in `_DS_IGNORED` are
    accepted and ignored (the reason is listed there). Raises ConfigError for an unknown keyword,
    `zero_optimization=False` or the errors of `DeepSpeed` itself.
    """
    from lightspeed.strategies.deepspeed.config import merge, read_config
    from lightspeed.strategies.deepspeed.strategy import DeepSpeed

    _check_keywords("DeepSpeedStrategy", kwargs, _DS_KEYWORDS)
    if kwargs.get("zero_optimization", True) is not True:
        raise ConfigError(
            "DeepSpeedStrategy(zero_optimization=False) is not supported: lightspeed runs "
            "DeepSpeed "
            "with ZeRO (stages 1-3). Use strategy='ddp' for plain data parallelism."
        )
    if config is None and os.environ.get(
        "PL_DEEPSPEED_CONFIG_PATH"
    ):  # Lightning's way to name a config file
        config = os.environ["PL_DEEPSPEED_CONFIG_PATH"]
    user = read_config(config)
    user_zero = user.get("zero_optimization", {})
    stage = stage if stage is not None else user_zero.get("stage", 2)
    # A config may turn offload off with `"offload_optimizer": false` (or null) instead of leaving
    # it out.
    opt_device = (
        kwargs.get("offload_optimizer_device", "cpu")
        if offload_optimizer
        else (user_zero.get("offload_optimizer") or {}).get("device")
    )
    param_device = (
        kwargs.get("offload_params_device", "cpu")
        if offload_parameters
        else (user_zero.get("offload_param") or {}).get("device")
    )
    opt_device, param_device = (
        d if d not in ("none", None) else None for d in (opt_device, param_device)
    )
    zero: dict[str, Any] = {"stage": stage}
    zero.update({_DS_ZERO_KEYS[k]: v for k, v in kwargs.items() if k in _DS_ZERO_KEYS})
    if opt_device:
        zero["offload_optimizer"] = {
            "device": opt_device,
            **{_DS_OFFLOAD_OPT_KEYS[k]: v for k, v in kwargs.items() if k in _DS_OFFLOAD_OPT_KEYS},
        }
    if param_device:
        zero["offload_param"] = {
            "device": param_device,
            **{
                k.removeprefix("params_"): v
                for k, v in kwargs.items()
                if k in _DS_OFFLOAD_PARAM_KEYS
            },
        }
    effective: dict[str, Any] = {"zero_optimization": zero}
    if any(k in kwargs for k in _DS_FP16_KEYS):  # used only when precision is "16-mixed"
        effective["fp16"] = {k: kwargs[k] for k in _DS_FP16_KEYS if k in kwargs}
    if any(k in kwargs for k in _DS_AIO_KEYS):
        effective["aio"] = {k: kwargs[k] for k in _DS_AIO_KEYS if k in kwargs}
    if any(k in kwargs for k in _DS_ACTIVATION_KEYS):
        effective["activation_checkpointing"] = {
            k: kwargs[k] for k in _DS_ACTIVATION_KEYS if k in kwargs
        }
    merged = merge(effective, user)  # the user's config wins, as in Lightning
    for key in (
        "offload_optimizer",
        "offload_param",
    ):  # DeepSpeed's schema takes a section or nothing, not false
        if key in merged["zero_optimization"] and not merged["zero_optimization"][key]:
            del merged["zero_optimization"][key]
    offloaded = bool(opt_device or param_device)
    pin = kwargs.get("pin_memory")
    return DeepSpeed(
        stage=stage,
        offload_optimizer=opt_device,
        offload_params=param_device,
        nvme_path=kwargs.get("nvme_path", "/local_nvme")
        if "nvme" in (opt_device, param_device)
        else None,
        pin_memory=bool(pin) if offloaded and pin is not None else None,
        config=merged,
        allgather_bucket_size=int(kwargs.get("allgather_bucket_size", 200_000_000)),
        reduce_bucket_size=int(kwargs["reduce_bucket_size"])
        if "reduce_bucket_size" in kwargs
        else None,
    )


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
} | _NO_EFFECT


def FSDPStrategy(
    sharding_strategy: Any = "FULL_SHARD",
    cpu_offload: Any = False,  # noqa: N802 - Lightning's name
    activation_checkpointing_policy: Any = None,
    auto_wrap_policy: Any = None,
    **kwargs: Any,
):
    """Returns `FSDP(...)` for Lightning's `FSDPStrategy` keywords.

    `sharding_strategy`: "FULL_SHARD" (FSDP, reshard after forward) or "SHARD_GRAD_OP"
    (fsdp_grad_op), as a string or torch's ShardingStrategy enum. `cpu_offload`: a bool or torch's
    CPUOffload(offload_params=...). `activation_checkpointing_policy` (or the older
    `activation_checkpointing`): a set or list of block classes. `auto_wrap_policy`: a set or list
    of block classes, each instance a shard unit. `state_dict_type`, `mixed_precision`,
    `limit_all_gathers`, `use_orig_params`, `sync_module_states` are accepted and have no effect
    (FSDP2 saves sharded DCP checkpoints, precision follows the Trainer's flag). Raises ConfigError
    for an unknown keyword, another sharding strategy or a callable policy.
    """
    from lightspeed.strategies.fsdp import FSDP

    _check_keywords("FSDPStrategy", kwargs, _FSDP_KEYWORDS)
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
    return FSDP(
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


_DDP_KEYWORDS = {
    "find_unused_parameters",
    "static_graph",
    "gradient_as_bucket_view",
    "bucket_cap_mb",
    "ddp_comm_hook",
    "ddp_comm_state",
    "broadcast_buffers",
} | _NO_EFFECT


def DDPStrategy(**kwargs: Any) -> DDP:  # noqa: N802 - Lightning's name
    """Returns `DDP(...)` for Lightning's `DDPStrategy` keywords: `find_unused_parameters`,
    `static_graph`, `gradient_as_bucket_view`, `bucket_cap_mb`, `ddp_comm_hook` (with
    `ddp_comm_state`). Raises ConfigError for an unknown keyword or `broadcast_buffers=False`."""
    _check_keywords("DDPStrategy", kwargs, _DDP_KEYWORDS)
    if kwargs.get("broadcast_buffers", True) is not True:
        raise ConfigError(
            "DDPStrategy(broadcast_buffers=False) is not supported: buffers are broadcast."
        )
    hook = kwargs.get("ddp_comm_hook")
    return DDP(
        find_unused_parameters=bool(kwargs.get("find_unused_parameters", False)),
        static_graph=bool(kwargs.get("static_graph", False)),
        gradient_as_bucket_view=bool(kwargs.get("gradient_as_bucket_view", True)),
        bucket_cap_mb=kwargs.get("bucket_cap_mb"),
        comm_hook=(kwargs.get("ddp_comm_state"), hook) if hook is not None else None,
    )
