"""The Strategy protocol: the one seam between the Trainer's loop and a parallelism backend.

The protocol is shaped around DeepSpeed, the most demanding backend, which owns backward, the optimizer step,
gradient accumulation, clipping and optimizer state. A training step through any strategy is:

    strategy.configure_model(module)                     # once: module.configure_model(), sharded if need be
    strategy.setup(module, build_optimizers)            # once: wrap/shard the model, build optimizers, engine
    strategy.set_grad_sync(is_boundary)                  # is_boundary: last micro-batch of a window
    loss = strategy.forward(module.training_step, batch, i)   # run the step through the wrapper/engine
    strategy.backward(loss)
    if is_boundary: strategy.step()                      # clip, optimizer step, zero grads

DDP, ZeRO-1 and FSDP honour that shape easily. No strategy subclasses another; shared pieces are functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Protocol, runtime_checkable

import torch

from ..launch import DistInfo

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]


@dataclass(frozen=True)
class RunSpec:
    """The few Trainer flags a strategy needs; handed over once in `connect`."""

    dist: DistInfo
    device: torch.device
    precision: PrecisionName = "32-true"
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: Literal["norm", "value"] = "norm"
    micro_batch_size: int | None = None  # from the train dataloader; DeepSpeed's config needs it
    seed: int | None = None


@dataclass
class SchedulerConfig:
    """One LR scheduler with Lightning's stepping options (from `configure_optimizers`)."""

    scheduler: Any
    interval: Literal["step", "epoch"] = "epoch"
    frequency: int = 1
    monitor: str | None = None


OptimizerFactory = Callable[[], "tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]"]


@runtime_checkable
class Strategy(Protocol):
    """Ten methods every backend can honour. See the module docstring for the call order."""

    name: str
    optimizers: list[torch.optim.Optimizer]
    schedulers: list[SchedulerConfig]
    is_manual_optimization_supported: bool

    def connect(self, spec: RunSpec) -> None:
        """Joins the process group and claims the device. Called once per process, before anything else."""

    def configure_model(self, module: torch.nn.Module) -> None:
        """Calls `module.configure_model()` once, the backend's way: plainly, inside zero.Init (ZeRO-3) or on the
        meta device (FSDP), so a model larger than one rank's memory is never materialised whole."""

    def setup(self, module: torch.nn.Module, build_optimizers: OptimizerFactory | None) -> None:
        """Wraps the model and builds the optimizers (DDP, FSDP shards, the DeepSpeed engine).

        `build_optimizers` runs `configure_optimizers` at the moment the backend needs it: FSDP after sharding
        (the optimizer must see the sharded parameters), DeepSpeed before `deepspeed.initialize`. It is None for
        evaluation only. Afterwards `self.optimizers` and `self.schedulers` are what the loop steps."""

    def set_grad_sync(self, is_boundary: bool) -> None:
        """Announces, before the forward, whether this micro-batch ends an accumulation window. Off the
        boundary, gradients accumulate locally without communication (DDP's `no_sync`, DeepSpeed's boundary)."""

    def forward(self, step: Callable[..., Any], *args: Any) -> Any:
        """Runs one of the module's `*_step` methods through the wrapped model, with precision applied."""

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagates `loss`, already divided by the accumulation count."""

    def step(self) -> float | None:
        """Clips, steps every optimizer and zeroes gradients. Returns the gradient norm when clipping by norm."""

    def save(self, path: Path) -> None:
        """Collective: every rank calls it. Writes model and optimizer state under the directory `path`."""

    def load(self, path: Path, with_optimizer: bool = True) -> None:
        """Collective: restores what `save` wrote (optimizer state too unless `with_optimizer` is False)."""

    def teardown(self) -> None:
        """Releases the process group and caches. Safe to call twice."""

