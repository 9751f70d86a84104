"""The Strategy protocol: the one seam between the loop and a parallelism backend.

The protocol is shaped around DeepSpeed, the most demanding backend, which owns backward, the
optimizer step, gradient accumulation, clipping and optimizer state. The call order:

    strategy.check(spec)                                  # each entry point, before any rank starts
    strategy.connect(spec, dist, device)                  # once per process, in the launch step
    strategy.configure_model(module)                      # once per module: sharded if need be
    strategy.setup(module, build_optimizers, micro_batch) # once per phase: fit, or evaluation
    for each micro-batch of an accumulation window:
        out = strategy.forward(module.training_step, batch, i, sync_grads=is_last)
        strategy.backward(loss)
    stats = strategy.step(guard)                          # guard, clip, step, zero grads
    strategy.save(path) / strategy.load(path)             # collective; the Checkpointer calls them
    strategy.teardown()                                   # once per process: engine freed

Where each method is called from is the table in docs/architecture.md (tests/test_protocol.py
checks it against the code). Besides the ten methods, the protocol declares what the rest of
lightspeed may read of a strategy (`name`, `device`, `optimizers`, `schedulers`, `model`, `layout`,
`measure()`, `settings()`, `fork()`); nothing outside strategies/ reads anything else
(tests/test_protocol.py runs a fit behind a proxy that raises on any other name, and scans src/).
Lightning's read-back names (`world_size`, `config`, ...) are for user code
(strategies/lightning.py).

DDP (with or without a sharded optimizer) and FSDP honour that shape easily. No strategy subclasses
another; shared pieces are functions (strategies/common.py, perf/precision.py).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from lightspeed.runtime.launch import DistInfo
from lightspeed.specs import RunSpec, SchedulerConfig, StepStats

OptimizerFactory = Callable[[], "tuple[list[Any], list[SchedulerConfig]]"]

# The ten methods, in call order, and the members others may read: what tests/test_protocol.py
# holds the code to.
METHODS = (
    "check",
    "connect",
    "configure_model",
    "setup",
    "forward",
    "backward",
    "step",
    "save",
    "load",
    "teardown",
)
READABLE = (
    "name",
    "device",
    "optimizers",
    "schedulers",
    "model",
    "layout",
    "distributed_sampler_kwargs",
    "measure",
    "settings",
    "fork",
)


@runtime_checkable
class Strategy(Protocol):
    """Ten methods every backend honours (see the module docstring for the call order), and what
    the rest of lightspeed may read. Every member exists from construction (a value the run decides
    is None until then), so `isinstance(obj, Strategy)` holds for a strategy not yet connected."""

    name: str
    """The registry's name ("ddp", "deepspeed_stage_3_offload", ...), recorded in meta.json."""
    device: torch.device | None
    """This process's device; None until `connect`."""
    optimizers: list[Any]
    """What the loop steps (and `Module.optimizers()` returns); set by `setup`."""
    schedulers: list[SchedulerConfig]
    """What the loop steps after `step`, by interval; set by `setup`."""

    @property
    def model(self) -> Any:
        """The module as the backend runs it, as Lightning's `trainer.model` shows it: the DDP
        wrapper, the DeepSpeed engine, the FSDP-sharded module, the module. None until `setup`."""

    @property
    def layout(self) -> str | None:
        """How this run's checkpoints lie on disk (`checkpoint.layouts.layout`): two runs of one
        layout load each other's natively. None until `connect`."""

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """Lightning's name: the data-parallel coordinates the Trainer's DistributedSampler uses,
        `{"num_replicas": ..., "rank": ...}` (the world size and rank, except under tensor
        parallelism, where the ranks of one TP group share their batches). None until `connect`."""

    def measure(self) -> dict[str, int]:
        """This rank's bytes of training state by category (runtime/memory.py): "params", "grads",
        "optim", "master". After `setup`; not collective."""
        ...

    def settings(self) -> dict[str, Any]:
        """The strategy's options as the run report shows them (DeepSpeed: and the config its
        engine was built with)."""
        ...

    def fork(self) -> Strategy:
        """A copy for a trial run (the micro-batch planner's), made after `connect` and before
        `configure_model`: same options, device and process group. Its `teardown` frees what the
        trial built and leaves the group joined (it is the parent's)."""
        ...

    def check(self, spec: RunSpec) -> None:
        """Raises ConfigError for flags this backend cannot honour (precision, clipping, device,
        manual optimization). Pure: runs in the launching process before any rank starts."""

    def connect(self, spec: RunSpec, dist_info: DistInfo, device: torch.device) -> None:
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

    def backward(self, loss: torch.Tensor, **options: Any) -> None:
        """Back-propagates `loss`, already divided by the accumulation count (also from the user's
        `manual_backward`). `options` are torch's `backward` keywords a user passes to
        `manual_backward` (`retain_graph`, `create_graph`); the Trainer passes none."""

    def step(self, should_step: Callable[[Any], bool] | None = None) -> StepStats:
        """Clips, steps every optimizer and zeroes gradients. Returns the step's statistics (grad
        norm).

        `should_step(grad_norm)` is the Trainer's non-finite guard, a collective: called once, when
        the gradients are complete and before any optimizer steps (grad_norm None where the backend
        has no norm yet); on False the gradients are dropped and nothing steps. It raises to stop
        training."""
        ...

    def save(self, path: Path) -> None:
        """Collective: every rank calls it. Writes model and optimizer state under the directory
        `path`."""

    def load(self, path: Path, with_optimizer: bool = True, portable: dict | None = None) -> None:
        """Collective: restores what `save` wrote (optimizer state too unless `with_optimizer` is
        False). Given `portable`, the neutral form of a checkpoint another strategy or world size
        wrote (checkpoint/layouts.py, the same on every rank), writes that into its model and
        optimizers instead."""

    def teardown(self) -> None:
        """Frees the engine and leaves the process group (a fork: the engine only). Safe to call
        twice."""
