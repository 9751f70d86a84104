"""The planner's copies of the user's Module, and how it runs their step: `build_copy` builds one
(on the meta device, the CPU or a GPU) with `configure_model` run and the user's object unchanged;
`stand_in` gives it a `ProbeTrainer`, so its `training_step` runs as written; `batch_of` makes a
sample batch `n` rows long; `plain_cuda_step` runs one step of a fresh copy on the GPU (the
micro-batch finder's confirmation). Used by the activation probe, the micro-batch finder and its
trials.
"""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch

from lightspeed.core.metrics import MetricStore
from lightspeed.core.optimizer import parse_optimizers
from lightspeed.utilities.signature import accepts

if TYPE_CHECKING:
    from lightspeed.core.module import Module as UserModule
    from lightspeed.specs import TrainerView


def build_copy(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of the user's module with `configure_model` run under `device`; the user's object is
    unchanged. On the meta device the copy's tensors are meta tensors of the same shapes from the
    start: planning a model built in `__init__` copies no weights."""
    memo: dict[int, Any] = {}
    if device.type == "meta":
        for p in module.parameters():
            memo[id(p)] = torch.nn.Parameter(p.detach().to("meta"), p.requires_grad)
        for b in module.buffers():
            memo[id(b)] = b.detach().to("meta")
    twin = copy.deepcopy(module, memo)
    with device:
        cast("UserModule", twin).configure_model()  # a copy of the user's Module
    return twin


def batch_of(sample: Any, n: int) -> Any:
    """`sample` (a tensor, or tuples/lists/dicts of them) with `n` rows: the first rows repeated as
    needed."""
    if isinstance(sample, torch.Tensor):
        reps = math.ceil(n / max(1, sample.shape[0]))
        return sample.repeat(reps, *([1] * (sample.dim() - 1)))[:n] if sample.dim() else sample
    if isinstance(sample, dict):
        return {k: batch_of(v, n) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(batch_of(v, n) for v in sample)
    return sample


class ProbeTrainer:
    """The Trainer a probe's copy of the module sees, so that its `training_step` runs as written: a
    metric store of its own (what it logs goes nowhere), step and epoch 0, rank 0, the CPU, and a
    `strategy` holding the copy's own optimizers and schedulers (`self.optimizers()`,
    `self.lr_schedulers()`: a step that logs its learning rate). Anything else (`max_steps`,
    `world_size`, ...) is read from the real Trainer, `trainer`."""

    global_step = current_epoch = global_rank = 0
    is_global_zero = True
    device = torch.device("cpu")

    def __init__(self, trainer: Any = None, strategy: Any = None):
        self.metrics, self._trainer = MetricStore(), trainer
        # what it logs is a training step's: per step by default, as inside the loop's batch
        self.metrics.in_batch = True
        self.strategy = (
            strategy if strategy is not None else SimpleNamespace(optimizers=[], schedulers=[])
        )

    @property
    def callback_metrics(self) -> dict:
        return self.metrics.latest

    def __deepcopy__(self, memo: dict) -> ProbeTrainer:
        """Shared, not copied, as a Module's Trainer is: FSDP's and ZeRO-3's plain twin of a trial's
        copy (`configure_with_plain_twin`) deep-copies the module, and the trial's strategy this
        holds cannot be copied once connected (its process group)."""
        return self

    def __getattr__(self, name: str) -> Any:
        real = self.__dict__.get("_trainer")
        if real is None or name.startswith("_"):
            raise AttributeError(f"the planner's stand-in Trainer has no attribute {name!r}")
        return getattr(real, name)


def stand_in(twin: torch.nn.Module, module: torch.nn.Module, strategy: Any = None) -> ProbeTrainer:
    """Gives `twin` (a copy of `module`) a ProbeTrainer over `module`'s real Trainer, kept alive by
    the twin (a Module holds its Trainer by weak reference). Its `strategy`: the one given (a
    micro-batch trial's, set up later), else the twin's own optimizers and schedulers, built now
    from its `configure_optimizers`."""
    probe = ProbeTrainer(getattr(module, "_trainer", None), strategy)
    object.__setattr__(twin, "_probe_trainer", probe)
    user = cast("UserModule", twin)  # a copy of the user's Module
    user.trainer = cast("TrainerView", probe)  # the real Trainer's view, through __getattr__
    if strategy is None:
        opts, scheds = parse_optimizers(user.configure_optimizers())
        probe.strategy = SimpleNamespace(optimizers=opts, schedulers=scheds)
    return probe


def plain_cuda_step(module: torch.nn.Module, batch: Any, n: int, precision: str) -> None:
    """One forward, backward and optimizer step of a fresh copy of `module` on the current CUDA
    device."""
    device = torch.device("cuda", torch.cuda.current_device())
    twin = build_copy(module, device)
    if precision == "bf16-true":
        twin.to(torch.bfloat16)
    optimizers = stand_in(twin, module).strategy.optimizers
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    data = move_to(batch_of(batch, n), device)
    try:
        with torch.autocast("cuda", dtype=half, enabled=half is not None):
            out = cast("UserModule", twin).training_step(*step_args(twin, data))
        (out["loss"] if isinstance(out, dict) else out).backward()
        for opt in optimizers:
            opt.step()
        torch.cuda.synchronize(device)
    finally:
        del twin, optimizers, data


def steps_itself(module: torch.nn.Module) -> bool:
    """Manual optimization: `training_step` runs its own backward and steps its optimizers, which a
    probe's copy cannot do, so the planner neither probes it nor runs trial steps of it."""
    return not getattr(module, "automatic_optimization", True)


def step_args(module: torch.nn.Module, batch: Any) -> tuple:
    """`training_step`'s arguments for a probe's step, as the loop passes them: Lightning accepts
    `training_step(self, batch)` without `batch_idx`."""
    step = cast("UserModule", module).training_step
    return (batch, 0) if accepts(step, 2, "batch_idx") else (batch,)


def move_to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    return value


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """`value` with its floating-point tensors in `dtype` (as DeepSpeed casts a batch)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype) for v in value)
    return value
