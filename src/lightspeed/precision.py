"""Precision for the torch-native strategies (single, DDP, ZeRO-1): autocast, a GradScaler for fp16, and the
optimizer step with clipping. DeepSpeed and FSDP bring their own precision machinery and do not use this."""

from __future__ import annotations

import contextlib

import torch

from .strategies.base import RunSpec


class Precision:
    """Autocast context, optional fp16 GradScaler, and the clip-then-step that respects the scaler."""

    def __init__(self, spec: RunSpec, sharded_grads: bool = False):
        self.spec = spec
        self.name = spec.precision
        device_type = spec.device.type
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(self.name)
        self.device_type = device_type
        # fp16 needs loss scaling; bf16 has fp32's exponent range and does not. With sharded gradients (FSDP) an
        # overflow may show in one rank's shard only: the sharded scaler agrees on it across ranks, so every
        # rank skips the same steps (a plain GradScaler would let the other ranks step and the shards drift).
        self.scaler = None
        if self.name == "16-mixed":
            if sharded_grads:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device_type)
            else:
                self.scaler = torch.amp.GradScaler(device_type)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """bf16-true keeps weights and optimizer states in bf16; the mixed modes keep fp32 weights."""
        return module.to(torch.bfloat16) if self.name == "bf16-true" else module

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self, optimizers: list[torch.optim.Optimizer], clip_fn=None) -> torch.Tensor | None:
        """Unscales (fp16), clips with `clip_fn(params) -> norm` if given, steps and zeroes every optimizer."""
        norm = None
        for opt in optimizers:
            if self.scaler is not None:
                self.scaler.unscale_(opt)
            if clip_fn is not None:
                params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
                norm = clip_fn(params)
            if self.scaler is not None:
                self.scaler.step(opt)
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.update()
        return norm

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def build_clip_fn(spec: RunSpec, norm_fn=None):
    """Returns `clip(params) -> norm` for the Trainer's clipping flags, or None when clipping is off.

    `norm_fn` lets a strategy substitute a norm that is correct for sharded gradients.
    """
    if spec.gradient_clip_val is None or spec.gradient_clip_val <= 0:
        return None
    value = float(spec.gradient_clip_val)
    if spec.gradient_clip_algorithm == "value":
        def clip_value(params):
            torch.nn.utils.clip_grad_value_(params, value)
            return None
        return clip_value
    if norm_fn is not None:
        return lambda params: norm_fn(params, value)
    return lambda params: torch.nn.utils.clip_grad_norm_(params, value)  # a tensor: no host sync here
