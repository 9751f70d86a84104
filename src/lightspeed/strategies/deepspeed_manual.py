"""Manual optimization under DeepSpeed: what `Module.optimizers()` returns when `automatic_optimization` is False.

DeepSpeed's engine owns the optimizer step (ZeRO's sharded update, clipping, the bf16/fp16 master weights), so the
user's `opt.step()` must be the engine's step. One engine holds one optimizer; a module with several (a GAN's
generator and discriminator) would need one engine per optimizer over disjoint parameters, which lightspeed does
not build: `check_one_optimizer` refuses it with the alternatives.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


class EngineOptimizer:
    """The engine's optimizer as a manual-optimization module sees it.

    `step()` runs `engine.step()` (which also zeroes the gradients); `zero_grad()` is therefore a no-op between
    steps; `param_groups`, `state_dict()` and every other attribute are the DeepSpeed optimizer's own, so LR
    schedulers and LearningRateMonitor work on it unchanged."""

    def __init__(self, engine: Any, optimizer: Any):
        self.engine, self.optimizer = engine, optimizer

    def step(self, closure=None) -> None:
        if closure is not None:  # Lightning's closure form: forward and backward, then the step
            closure()
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() zeroed them; DeepSpeed keeps its gradients in its own (partitioned) buffers

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)


def check_one_optimizer(count: int, strategy_name: str) -> None:
    """Raises ConfigError when a manual-optimization module returns more than one optimizer under DeepSpeed."""
    if count > 1:
        raise ConfigError(
            f"configure_optimizers returned {count} optimizers with automatic_optimization=False under strategy "
            f"{strategy_name!r}: lightspeed runs one DeepSpeed engine with one optimizer, and one engine per "
            "optimizer (how a GAN would train under DeepSpeed) is not supported. Use strategy 'fsdp' or 'ddp' for "
            "several optimizers, or one optimizer with parameter groups.")
