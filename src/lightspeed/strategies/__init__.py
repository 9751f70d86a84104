"""Strategies: the protocol (base.py), the string -> object registry (registry.py), one file per
backend, and DeepSpeed in its own package (the only one that imports `deepspeed`). Lightning's
strategy classes live at Lightning's module paths (`strategies.ddp.DDPStrategy`,
`strategies.fsdp.FSDPStrategy`, `strategies.deepspeed.DeepSpeedStrategy`) and are exported here."""

from typing import TYPE_CHECKING, Any

from lightspeed.strategies.base import Strategy
from lightspeed.strategies.ddp import DDP, DDPStrategy, ZeRO1
from lightspeed.strategies.registry import STRATEGIES, build_strategy
from lightspeed.strategies.single import SingleDevice, SingleDeviceStrategy

if TYPE_CHECKING:  # loaded by __getattr__ at run time
    from lightspeed.strategies.deepspeed.lightning import DeepSpeedStrategy
    from lightspeed.strategies.fsdp import FSDPStrategy


def __getattr__(name: str) -> Any:
    # FSDP and DeepSpeed import heavy modules: loaded on first use, as `lightspeed.FSDP` is.
    if name == "FSDPStrategy":
        from lightspeed.strategies.fsdp import FSDPStrategy

        return FSDPStrategy
    if name == "DeepSpeedStrategy":
        from lightspeed.strategies.deepspeed.lightning import DeepSpeedStrategy

        return DeepSpeedStrategy
    raise AttributeError(f"module 'lightspeed.strategies' has no attribute {name!r}")


__all__ = [
    "DDP",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ZeRO1",
    "SingleDevice",
    "SingleDeviceStrategy",
    "Strategy",
    "STRATEGIES",
    "build_strategy",
]
