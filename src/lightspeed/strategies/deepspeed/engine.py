"""The one DeepSpeed engine of the strategy's `setup` under automatic optimization (several, under
manual optimization, are multi.py's): the user's optimizers built with their parameters' true
shapes (`build_user_optimizers`), the one optimizer it takes (`only_optimizer`), and
`deepspeed.initialize` within the room the process's memory cap leaves (`initialize_engine`)."""

from __future__ import annotations

from typing import Any, cast

import torch

from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import build_optimizers_fast
from lightspeed.runtime.launch import DistInfo
from lightspeed.specs import RunSpec
from lightspeed.strategies.deepspeed.autotp import drop_input_check
from lightspeed.strategies.deepspeed.ops import fused_adam
from lightspeed.strategies.deepspeed.room import room_under_cap
from lightspeed.strategies.deepspeed.zero3 import full_shapes


def build_user_optimizers(
    deepspeed,
    module: torch.nn.Module,
    build: Any,
    spec: RunSpec,
    info: DistInfo,
    device: torch.device,
    offload: bool,
    log0,
) -> tuple[list, list]:
    """(optimizers, schedulers) of configure_optimizers (`build()`), fused where they may be
    (perf/kernels.py), run with the parameters' full shapes under ZeRO-3 (zero3.full_shapes).
    Collective under ZeRO-3."""
    with full_shapes(deepspeed, module, device, info.local_world_size, log0):
        return build_optimizers_fast(
            build,
            spec,
            backend="deepspeed",
            device_type=device.type,
            offload=offload,
            is_global_zero=info.is_global_zero,
            fused_adam=fused_adam,
        )


def only_optimizer(optimizers: list) -> torch.optim.Optimizer:
    """The one optimizer of `configure_optimizers` under automatic optimization, which runs one
    engine. Raises ConfigError for several, or none (and no config 'optimizer' section)."""
    if len(optimizers) > 1:
        raise ConfigError(
            f"configure_optimizers returned {len(optimizers)} optimizers; DeepSpeed runs one "
            "engine with one optimizer. Return a single optimizer (with parameter groups)."
        )
    if not optimizers:
        raise ConfigError(
            "configure_optimizers returned no optimizer and the DeepSpeed config has no "
            "'optimizer' section: provide one or the other."
        )
    return optimizers[0]


def initialize_engine(
    deepspeed, runner: Any, module: torch.nn.Module, optimizer: Any, config: dict, device
) -> tuple[Any, Any]:
    """(engine, DeepSpeed's optimizer) of `deepspeed.initialize` on `runner`, with `optimizer`, or
    the config's built over `module`'s trainable parameters when None."""
    # (DeepSpeed annotates model_parameters as a Module; it takes parameters)
    trained = [p for p in module.parameters() if p.requires_grad] if optimizer is None else None
    with room_under_cap(device):  # ZeRO-1/2's flatten copy: on the device if it fits
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=runner,
            optimizer=optimizer,
            config=config,
            dist_init_required=False,
            model_parameters=cast(Any, trained),
        )
    drop_input_check(engine)
    return engine, ds_optimizer
