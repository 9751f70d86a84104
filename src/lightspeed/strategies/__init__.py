"""Strategies: the protocol (base.py), the string -> object registry (registry.py), one file per
backend, and DeepSpeed in its own package (the only one that imports `deepspeed`)."""

from lightspeed.strategies.base import Strategy
from lightspeed.strategies.ddp import DDP, ZeRO1
from lightspeed.strategies.lightning import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from lightspeed.strategies.registry import STRATEGIES, build_strategy
from lightspeed.strategies.single import SingleDevice

__all__ = [
    "DDP",
    "DDPStrategy",
    "DeepSpeedStrategy",
    "FSDPStrategy",
    "ZeRO1",
    "SingleDevice",
    "Strategy",
    "STRATEGIES",
    "build_strategy",
]
