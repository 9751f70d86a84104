"""Precision and the optimizer step for the torch strategies (single, DDP with or without a sharded
optimizer, FSDP): autocast, an fp16 loss scaler, and `optimizer_step`, the one clip-then-step they
share. DeepSpeed brings its own precision machinery and uses none of this."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lightspeed.data.loaders import map_tensors
from lightspeed.specs import RunSpec, StepStats

NormFn = Callable[[list[torch.Tensor]], torch.Tensor]
StepGate = Callable[
    [Any], bool
]  # the non-finite guard: given the global grad norm (or None), step or not
# Their fused step reads `found_inf`. Not SGD: its fused kernel skipped on the first step leaves the
# momentum buffer
# uninitialised (torch.empty), so a skipped first step would poison the next ones.
_SKIP_ON_FLAG = (torch.optim.Adam, torch.optim.AdamW)


class Precision:
    """Autocast context and the optional fp16 loss scaler for one precision name."""

    def __init__(self, name: str, device_type: str, sharded_grads: bool = False):
        self.name, self.device_type = name, device_type
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(name)
        # fp16 needs loss scaling; bf16 has fp32's exponent range and does not. With sharded
        # gradients (FSDP) an
        # overflow may show in one rank's shard only: the sharded scaler agrees on it across ranks,
        # so every
        # rank skips the same steps (a plain GradScaler would let the other ranks step and the
        # shards drift).
        self.scaler = None
        if name == "16-mixed":
            if sharded_grads:
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device_type)
            else:
                self.scaler = torch.amp.GradScaler(device_type)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """bf16-true keeps weights and optimizer states in bf16; the mixed modes keep fp32
        weights."""
        return module.to(torch.bfloat16) if self.name == "bf16-true" else module

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor, **options: Any) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward(**options)

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def input_dtype(precision: str) -> torch.dtype | None:
    """The dtype a step's floating-point inputs take: bf16 under "bf16-true" (the weights are
    bf16, so an fp32 batch would not multiply them: Lightning's HalfPrecision casts too), else
    None (the batch as the loader gave it)."""
    return torch.bfloat16 if precision == "bf16-true" else None


def to_dtype(batch: Any, dtype: torch.dtype | None) -> Any:
    """Every floating-point tensor of `batch` in `dtype` (integers, token ids, masks as they
    are); `batch` itself when dtype is None."""
    if dtype is None:
        return batch
    return map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """torch's default dtype is `dtype` inside (a tensor the step makes, `torch.randn(...)`, is
    bf16 beside bf16 weights, as under Lightning's HalfPrecision); nothing changes for None."""
    if dtype is None:
        yield
        return
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    return torch.nn.utils.get_total_norm(grads, 2.0)


def optimizer_step(
    optimizers: list,
    precision: Precision,
    spec: RunSpec,
    total_norm: NormFn = _total_norm,
    should_step: StepGate | None = None,
) -> StepStats:
    """Unscales (fp16), measures the gradient norm, asks `should_step`, clips by the Trainer's
    flags, steps and zeroes every optimizer.

    `total_norm(grads)` must return the global norm; a strategy with sharded gradients passes one
    that reduces across ranks. `should_step(norm)` (the non-finite guard, collective) runs once,
    after every norm is known and before any optimizer steps; on False the gradients are dropped and
    nothing steps. Under an fp16 scaler it gets None: the scaler skips overflowing steps itself.
    Returns {"grad_norm": norm over all optimizers}.

    The norm is one multi-tensor pass after the backward (torch's get_total_norm). Taking it beside
    the backward instead, on a side stream as each gradient completed, was measured slower on an
    H200 (docs/benchmarks.md, thirteenth session): the side stream hid none of the pass, and its
    per-parameter hooks cost host time."""
    clip = float(spec.gradient_clip_val or 0.0)
    groups, norms = (
        [],
        [],
    )  # per optimizer: the parameters with gradients, their norm (None if there are none)
    for opt in optimizers:
        if precision.scaler is not None:
            precision.scaler.unscale_(opt)
        params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
        groups.append(params)
        norms.append(total_norm([p.grad for p in params]) if params else None)
    present = [n for n in norms if n is not None]
    grad_norm = (
        present[0] if len(present) == 1 else torch.stack(present).norm() if present else None
    )
    # A gate with `step_flag` (the guard) can decide on the device when every optimizer skips on a
    # flag: the
    # steps are queued with it and the host reads the verdict a step later (guard.settle), so it
    # never waits.
    on_device = (
        precision.scaler is None
        and grad_norm is not None
        and hasattr(should_step, "step_flag")
        and all(skips_on_flag(opt) for opt in optimizers)
    )
    found_inf = should_step.step_flag(grad_norm) if on_device else None
    go = (
        on_device
        or should_step is None
        or should_step(grad_norm if precision.scaler is None else None)
    )
    for opt, params, norm in zip(optimizers, groups, norms):
        if go and params and clip > 0 and spec.gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, clip)
        elif go and params and clip > 0:
            torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        if go and precision.scaler is not None:
            precision.scaler.step(opt)
        elif go and found_inf is not None:
            opt.found_inf = found_inf  # read by torch's fused step, as under an AMP grad scaler
            try:
                opt.step()
            finally:
                del opt.found_inf
        elif go:
            opt.step()
        opt.zero_grad(set_to_none=True)
    if precision.scaler is not None:
        precision.scaler.update()
    return {"grad_norm": grad_norm}


def skips_on_flag(opt: Any) -> bool:
    """True for torch's own fused Adam and AdamW (not subclasses): their step skips the update, and
    undoes its step count, when `opt.found_inf` is 1, on the device (the moments stay as they
    were)."""
    return type(opt) in _SKIP_ON_FLAG and bool(opt.defaults.get("fused"))
