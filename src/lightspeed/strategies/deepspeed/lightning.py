"""Lightning's `DeepSpeedStrategy`, at Lightning's module path (`strategies.deepspeed`): an abstract
class with `DeepSpeed` registered as its one implementation (strategies/lightning.py says why).

    from lightspeed.strategies.deepspeed import DeepSpeedStrategy
    DeepSpeedStrategy(stage=3, offload_optimizer=True)     # a DeepSpeed(stage=3, ...="cpu")
    isinstance(Trainer(strategy="deepspeed_stage_2").strategy, DeepSpeedStrategy)      # True

Lightning's keywords map onto one DeepSpeed object (`deepspeed_options`). The keywords that are
plain DeepSpeed config entries (`contiguous_gradients`, `sub_group_size`, `loss_scale`, ...) go
into the config when given; `.config` shows it.
"""

from __future__ import annotations

import abc
import os
from pathlib import Path
from typing import Any

from lightspeed.errors import ConfigError
from lightspeed.strategies.deepspeed.config import merge, read_config
from lightspeed.strategies.deepspeed.strategy import DeepSpeed
from lightspeed.strategies.lightning import NO_EFFECT, check_keywords

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
    | NO_EFFECT
)


class DeepSpeedStrategy(abc.ABC):
    """Lightning's `DeepSpeedStrategy`: `DeepSpeedStrategy(stage=3, offload_optimizer=True, ...)`
    takes Lightning's keywords (`deepspeed_options`) and returns a `DeepSpeed`; every DeepSpeed is
    an instance, also one built from a string ("deepspeed_stage_3"). Lightning code reads back
    `.config`, `.zero_stage_3`, `.deepspeed_engine`, `.model` and the rank names from it."""

    def __new__(cls, *args: Any, **kwargs: Any) -> DeepSpeed:  # type: ignore[misc]
        return DeepSpeed(**deepspeed_options(*args, **kwargs))


DeepSpeedStrategy.register(DeepSpeed)


def deepspeed_options(
    stage: int | None = None,
    offload_optimizer: bool = False,
    offload_parameters: bool = False,
    config: dict | str | Path | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """`DeepSpeed(...)`'s keywords for Lightning's `DeepSpeedStrategy` keywords.

    `stage` defaults to the stage in `config` when one is given, else 2 (as in Lightning).
    `offload_optimizer` and `offload_parameters` are booleans; the device comes from
    `offload_optimizer_device` / `offload_params_device` ("cpu" or "nvme", with `nvme_path`).
    `pin_memory` applies to offloaded buffers only. `config` (a dict or a JSON file; without one,
    the file named by the PL_DEEPSPEED_CONFIG_PATH environment variable, as in Lightning) is merged
    over what the keywords set; with a config and no `stage`, `.config` is that config unchanged.
    `logging_batch_size_per_gpu` and the keywords in `_DS_IGNORED` are accepted and ignored (the
    reason is listed there). Raises ConfigError for an unknown keyword, `zero_optimization=False`
    or the errors of `DeepSpeed` itself.
    """
    check_keywords("DeepSpeedStrategy", kwargs, _DS_KEYWORDS)
    if kwargs.get("zero_optimization", True) is not True:
        raise ConfigError(
            "DeepSpeedStrategy(zero_optimization=False) is not supported: lightspeed runs "
            "DeepSpeed with ZeRO (stages 1-3). Use strategy='ddp' for plain data parallelism."
        )
    if config is None and os.environ.get("PL_DEEPSPEED_CONFIG_PATH"):  # Lightning's way
        config = os.environ["PL_DEEPSPEED_CONFIG_PATH"]
    user = read_config(config)
    user_zero = user.get("zero_optimization", {})
    zero: dict[str, Any] = {} if stage is None and user else {"stage": stage or 2}
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
    effective: dict[str, Any] = {"zero_optimization": zero} if zero else {}
    if any(k in kwargs for k in _DS_FP16_KEYS):  # used only when precision is "16-mixed"
        effective["fp16"] = {k: kwargs[k] for k in _DS_FP16_KEYS if k in kwargs}
    if any(k in kwargs for k in _DS_AIO_KEYS):
        effective["aio"] = {k: kwargs[k] for k in _DS_AIO_KEYS if k in kwargs}
    if any(k in kwargs for k in _DS_ACTIVATION_KEYS):
        effective["activation_checkpointing"] = {
            k: kwargs[k] for k in _DS_ACTIVATION_KEYS if k in kwargs
        }
    merged = merge(effective, user)  # the user's config wins, as in Lightning
    # DeepSpeed's schema takes a section or nothing, not false
    for key in ("offload_optimizer", "offload_param"):
        if key in merged.get("zero_optimization", {}) and not merged["zero_optimization"][key]:
            del merged["zero_optimization"][key]
    offloaded = bool(opt_device or param_device)
    pin = kwargs.get("pin_memory")
    return dict(
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
