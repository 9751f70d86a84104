"""Manual optimization under DeepSpeed: what `Module.optimizers()` returns when
`automatic_optimization` is False.

DeepSpeed's engine owns the optimizer step (ZeRO's sharded update, clipping, the bf16/fp16 master
weights), so the user's `opt.step()` must be the engine's step. One engine holds one optimizer; a
module with several (a GAN's generator and discriminator) gets one engine per optimizer
(deepspeed_multi.py), each handle driving its own.
"""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.errors import ConfigError


class EngineOptimizer:
    """The engine's optimizer as a manual-optimization module sees it.

    `step()` runs `engine.step()` (which also zeroes the gradients); `zero_grad()` therefore only
    matters with one engine per optimizer, where the group holds each engine's gradients until its
    step and drops them; `param_groups`, `state_dict()` and every other attribute are the DeepSpeed
    optimizer's own, so LR schedulers and LearningRateMonitor work on it unchanged.
    `model_parameters()` lists the module's parameters it trains (what `toggle_optimizer` keeps
    trainable; ZeRO's own param_groups hold flat fp32 partitions)."""

    group = None  # the EngineGroup when there is one engine per optimizer

    def __init__(self, engine: Any, optimizer: Any):
        self.engine, self.optimizer = engine, optimizer
        self.clip: float | None = None  # set by clip_gradients for the next step only

    def clip_gradients(self, max_norm: float, algorithm: str = "norm") -> None:
        """`Module.clip_gradients(opt, ...)`: this engine's next step clips its gradients to a
        global norm of `max_norm`. ZeRO measures the norm of the reduced (partitioned) gradients
        inside `engine.step()`, so the clip is applied there, as DeepSpeed applies its
        `gradient_clipping`: the same result as `torch.nn.utils.clip_grad_norm_` after DDP's
        all-reduce, per optimizer. Raises ConfigError for algorithm "value" (DeepSpeed clips by norm
        only)."""
        if algorithm != "norm":
            raise ConfigError(
                f"clip_gradients(gradient_clip_algorithm={algorithm!r}) is not valid under "
                "DeepSpeed: "
                "its engine clips by global norm only. Use 'norm'."
            )
        self.clip = float(max_norm)

    def step(self, closure=None) -> None:
        if closure is not None:  # Lightning's closure form: forward and backward, then the step
            closure()
        kept = self.optimizer.clip_grad  # the config's gradient_clipping, which ZeRO's step applies
        if self.clip is not None:
            self.optimizer.clip_grad, self.clip = self.clip, None
        try:
            if self.group is None:
                self.engine.step()
            else:
                self.group.step(self.engine)
        finally:
            self.optimizer.clip_grad = kept

    def zero_grad(self, set_to_none: bool = True) -> None:
        # engine.step() zeroed them; DeepSpeed keeps its gradients in its own (partitioned) buffers
        if self.group is not None:
            self.group.discard_gradients(self.engine)

    def model_parameters(self) -> list[torch.nn.Parameter]:
        groups = getattr(self.optimizer, "bit16_groups", None) or getattr(
            self.optimizer, "fp16_groups", None
        )
        return (
            [p for g in groups for p in g]
            if groups
            else [p for g in self.param_groups for p in g["params"]]
        )

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)
