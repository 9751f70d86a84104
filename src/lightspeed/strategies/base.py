"""The Strategy protocol: the one seam between the Trainer's loop and a parallelism backend.

The protocol is shaped around DeepSpeed, the most demanding backend, which owns backward, the
optimizer step,
gradient accumulation, clipping and optimizer state. Every method has one call site in trainer.py:

    strategy.check(spec)                                  # each entry point, before any rank starts
    strategy.connect(spec, dist, device)                  # once per process, in the launch step
    strategy.configure_model(module)                      # once per module: sharded if need be
    strategy.setup(module, build_optimizers, micro_batch) # once per phase: fit, or evaluation
    for each micro-batch of an accumulation window:
        out = strategy.forward(module.training_step, batch, i, sync_grads=is_last)
        strategy.backward(loss)
    stats = strategy.step(guard)                          # guard, clip, step, zero grads;
    {"grad_norm": ...} strategy.save(path) / strategy.load(path)             # collective; the
    Checkpointer calls them strategy.teardown()                                   # once per
    process: engine freed, group left

DDP (with or without a sharded optimizer) and FSDP honour that shape easily. No strategy subclasses
another; shared pieces are functions (strategies/common.py, precision.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from lightspeed.runtime.launch import DistInfo
from lightspeed.specs import RunSpec, SchedulerConfig, StepStats

OptimizerFactory = Callable[[], "tuple[list[Any], list[SchedulerConfig]]"]


@runtime_checkable
class Strategy(Protocol):
    """Ten methods every backend honours. See the module docstring for the call order."""

    name: str
    optimizers: list[Any]
    schedulers: list[SchedulerConfig]

    def check(self, spec: RunSpec) -> None:
        """Raises ConfigError for flags this backend cannot honour (precision, clipping, device,
        manual optimization). Pure: runs in the launching process before any rank starts."""

    def connect(self, spec: RunSpec, dist: DistInfo, device: torch.device) -> None:
        """Joins the process group and claims the device. Once per process, in the Trainer's launch
        step."""

    def configure_model(self, module: torch.nn.Module) -> None:
        """Calls `module.configure_model()` once, the backend's way: plainly, inside zero.Init
        (ZeRO-3) or on the meta device (FSDP), so a model larger than one rank's memory is never
        materialised whole."""

    def setup(
        self,
        module: torch.nn.Module,
        build_optimizers: OptimizerFactory | None,
        micro_batch_size: int | None,
    ) -> None:
        """Wraps the model and builds the optimizers (DDP, FSDP shards, the DeepSpeed engine). Once
        per phase.

        `build_optimizers` runs `configure_optimizers` when the backend needs it: FSDP after
        sharding, DeepSpeed before `deepspeed.initialize`. It is None for evaluation. Afterwards
        `self.optimizers` and `self.schedulers` are what the loop steps. `micro_batch_size` is the
        train loader's (DeepSpeed's config)."""

    def forward(self, step: Callable[..., Any], *args: Any, sync_grads: bool = True) -> Any:
        """Runs one of the module's `*_step` methods through the wrapped model, with precision
        applied. `sync_grads` is False for a micro-batch that does not end an accumulation window:
        its gradients then accumulate locally with no communication (DDP's `no_sync`, DeepSpeed's
        boundary, FSDP's sync flag)."""

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagates `loss`, already divided by the accumulation count."""

    def step(self, should_step: Callable[[Any], bool] | None = None) -> StepStats:
        """Clips, steps every optimizer and zeroes gradients. Returns the step's statistics (grad
        norm).

        `should_step(grad_norm)` is the Trainer's non-finite guard, a collective: called once, when
        the gradients are complete and before any optimizer steps (grad_norm None where the backend
        has no norm yet); on False the gradients are dropped and nothing steps. It raises to stop
        training."""

    def save(self, path: Path) -> None:
        """Collective: every rank calls it. Writes model and optimizer state under the directory
        `path`."""

    def load(self, path: Path, with_optimizer: bool = True, portable: dict | None = None) -> None:
        """Collective: restores what `save` wrote (optimizer state too unless `with_optimizer` is
        False). Given `portable`, the neutral form of a checkpoint another strategy or world size
        wrote (strategies/portable.py, the same on every rank), writes that into its model and
        optimizers instead."""

    def teardown(self) -> None:
        """Frees the engine and leaves the process group. Safe to call twice."""
