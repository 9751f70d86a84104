"""The one place that turns a strategy string into a strategy object: `"deepspeed_stage_2_offload"`
-> `DeepSpeed(stage=2, offload_optimizer="cpu")`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from lightspeed.errors import ConfigError
from lightspeed.strategies.base import METHODS, READABLE, Strategy
from lightspeed.strategies.ddp import DDP, ZeRO1
from lightspeed.strategies.single import SingleDevice


def _deepspeed(
    stage: Literal[1, 2, 3], offload: Literal["cpu", "nvme"] | None = None, tp: int = 1
) -> Callable[[], Any]:
    def build():
        from lightspeed.strategies.deepspeed.strategy import DeepSpeed

        return DeepSpeed(
            stage=stage,
            offload_optimizer=offload,
            offload_params=offload if stage == 3 else None,
            tp=tp,
        )

    return build


def _fsdp(reshard_after_forward: bool, tp: int = 1):
    def build():
        from lightspeed.strategies.fsdp import FSDP

        return FSDP(reshard_after_forward=reshard_after_forward, tp=tp)

    return build


# Every accepted string; the values build fresh objects so no two Trainers share a strategy.
STRATEGIES: dict[str, Callable[[], Any]] = {
    "single": SingleDevice,
    "single_device": SingleDevice,
    "ddp": DDP,
    "ddp_find_unused_parameters_true": lambda: DDP(
        find_unused_parameters=True
    ),  # Lightning's names
    "ddp_find_unused_parameters_false": DDP,
    "ddp_spawn": DDP,
    "ddp_sharded": ZeRO1,
    "zero1": ZeRO1,
    "fsdp": _fsdp(True),
    "fsdp_grad_op": _fsdp(False),
    # FSDP2 x tensor parallelism over a 2-D mesh (world size / tp data-parallel ranks; with devices
    # == tp, plain TP): strategies/tensor_parallel.py
    **{f"fsdp_tp{tp}": _fsdp(True, tp) for tp in (2, 4, 8)},
    **{f"fsdp_grad_op_tp{tp}": _fsdp(False, tp) for tp in (2, 4, 8)},
    "deepspeed": _deepspeed(2),
    "deepspeed_stage_1": _deepspeed(1),
    "deepspeed_stage_1_offload": _deepspeed(1, "cpu"),
    "deepspeed_stage_2": _deepspeed(2),
    "deepspeed_stage_2_offload": _deepspeed(2, "cpu"),
    "deepspeed_stage_3": _deepspeed(3),
    "deepspeed_stage_3_offload": _deepspeed(3, "cpu"),
    "deepspeed_stage_3_offload_nvme": _deepspeed(3, "nvme"),
    # DeepSpeed's AutoTP beside ZeRO 1/2 (world size / tp data-parallel ranks): deepspeed/autotp.py
    **{
        f"deepspeed_stage_{stage}_tp{tp}": _deepspeed(stage, tp=tp)
        for stage in (1, 2)
        for tp in (2, 4, 8)
    },
}


def build_strategy(value: Any, world_size: int) -> Strategy:
    """Returns the strategy object for `Trainer(strategy=value)`.

    "auto" means SingleDevice for one process and DDP for more. A strategy object passes through
    unchanged. Raises ConfigError naming the value and listing the accepted names.
    """
    if value == "auto" or value is None:
        return SingleDevice() if world_size == 1 else DDP()
    if isinstance(value, str):
        key = value.lower()
        if key not in STRATEGIES:
            raise ConfigError(
                f"strategy={value!r} is not valid: use 'auto', one of "
                f"{', '.join(sorted(STRATEGIES))}, "
                "or a strategy object such as DeepSpeed(stage=3)."
            )
        return _checked(STRATEGIES[key](), world_size)
    if isinstance(value, Strategy):
        return _checked(value, world_size)
    raise ConfigError(
        f"strategy={value!r} is not valid: expected a strategy name or an object with the Strategy "
        f"methods ({', '.join(METHODS)}) and members ({', '.join(READABLE)}): "
        "lightspeed.strategies.base."
    )


def _checked(strategy: Any, world_size: int) -> Any:
    """`strategy`, once its tensor-parallel degree is known to divide the world size: a ConfigError
    in the Trainer's constructor, before any rank starts."""
    tp = getattr(strategy, "tp", 1)  # FSDP's (and DeepSpeed's) option; 1 where there is none
    if tp != 1:
        from lightspeed.strategies.tensor_parallel import check_degree

        check_degree(tp, world_size, type(strategy).__name__)
    return strategy
