"""ZeRO stage 1 the torch-native way: DDP for gradients, `ZeroRedundancyOptimizer` for the optimizer state.

    Trainer(strategy="ddp_sharded", devices=2)          # or strategy=ZeRO1()

Every rank keeps the whole model and its whole gradient (DDP all-reduces it), but each rank holds the optimizer
state of only its partition of the parameters, steps only those and broadcasts them to the others. The user's
`configure_optimizers` is unchanged: its optimizer is rebuilt as a ZeroRedundancyOptimizer of the same class,
param groups and options, and its LR schedulers are pointed at the rebuilt optimizer.

Checkpoints have the replicated layout (`model.safetensors` + `optimizer.pt`, the optimizer state consolidated on
rank 0), so they load on any world size and `lightspeed convert` reads them like DDP's.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from ..checkpoint_io import load_replicated, save_replicated
from ..errors import ConfigError
from ..precision import Precision, build_clip_fn
from .base import RunSpec, SchedulerConfig
from .common import barrier, ddp_backward, destroy_process_group, init_process_group, wrap_ddp

# A scheduler created on the user's optimizer and re-pointed at the rebuilt one warns once that "optimizer.step()
# has been overridden": torch looks for the marker it put on the *original* optimizer's step. Nothing is wrong.
warnings.filterwarnings("ignore", message=r"Seems like `optimizer.step\(\)` has been overridden", category=UserWarning)


@dataclass
class ZeRO1:
    """DDP + optimizer-state sharding with torch's ZeroRedundancyOptimizer.

    Args:
        parameters_as_bucket_view: passed to ZeroRedundancyOptimizer (flattens each rank's parameters into
            buckets so the post-step broadcast sends fewer, larger messages).
        find_unused_parameters, static_graph, bucket_cap_mb, gradient_as_bucket_view: passed to DDP.
    """

    parameters_as_bucket_view: bool = False
    find_unused_parameters: bool = False
    static_graph: bool = False
    bucket_cap_mb: float | None = None
    gradient_as_bucket_view: bool = True
    name: str = "ddp_sharded"
    # Manual optimization works: `self.optimizers()` hands the user the ZeroRedundancyOptimizer, whose step()
    # updates the local partition and broadcasts it, exactly what the automatic loop does.
    is_manual_optimization_supported: bool = True
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)

    def connect(self, spec: RunSpec) -> None:
        self.spec = spec
        self.precision = Precision(spec)
        init_process_group(spec)

    def configure_model(self, module) -> None:
        module.configure_model()

    def setup(self, module, build_optimizers) -> None:
        self.module = self.precision.convert_module(module.to(self.spec.device))
        if build_optimizers is not None:
            user_optimizers, schedulers = build_optimizers()
            self.optimizers = [build_zero_optimizer(opt) for opt in user_optimizers]
            self.schedulers = rebind_schedulers(schedulers, user_optimizers, self.optimizers)
        self.wrapped = wrap_ddp(self.module, self.spec, find_unused_parameters=self.find_unused_parameters,
                                static_graph=self.static_graph, bucket_cap_mb=self.bucket_cap_mb,
                                gradient_as_bucket_view=self.gradient_as_bucket_view)
        self._is_in_forward = False  # set while a step runs inside DDP's forward (see common.ddp_backward)
        # After DDP's all-reduce every rank holds the full gradient, so the ordinary norm is already global.
        self.clip_fn = build_clip_fn(self.spec)

    def set_grad_sync(self, is_boundary: bool) -> None:
        if isinstance(self.wrapped, DistributedDataParallel):
            self.wrapped.require_backward_grad_sync = is_boundary

    def forward(self, step, *args):
        self._is_in_forward = True
        try:
            with self.precision.autocast():
                return self.wrapped(step, *args)
        finally:
            self._is_in_forward = False

    def backward(self, loss) -> None:
        ddp_backward(self.wrapped, loss, self.precision, self._is_in_forward, self.find_unused_parameters)

    def step(self):
        return self.precision.step(self.optimizers, self.clip_fn)

    def save(self, path: Path) -> None:
        # Each rank holds a slice of the optimizer state; torch gathers it on rank 0, a collective every rank
        # must enter, before rank 0's state_dict() can return the whole of it.
        for opt in self.optimizers:
            opt.consolidate_state_dict(to=0)
        if self.spec.dist.is_global_zero:
            save_replicated(path, self.module, self.optimizers, {"precision": self.precision.state_dict()})
        barrier()

    def load(self, path: Path, with_optimizer: bool = True) -> None:
        # ZeroRedundancyOptimizer.load_state_dict takes the consolidated state and keeps this rank's partition,
        # so a checkpoint saved on any world size loads here.
        state = load_replicated(path, self.module, self.optimizers, with_optimizer)
        self.precision.load_state_dict(state.get("precision", {}))

    def teardown(self) -> None:
        destroy_process_group()


def build_zero_optimizer(opt: Any) -> ZeroRedundancyOptimizer:
    """Rebuilds the torch optimizer `opt` as a ZeroRedundancyOptimizer: same class, same param groups with their
    own options, same defaults. `opt` must not have stepped yet (its state is not carried over).

    Raises:
        ConfigError: if `opt` is not a `torch.optim.Optimizer` (ZeroRedundancyOptimizer needs the class to
            build one local optimizer per partition).
    """
    if isinstance(opt, ZeroRedundancyOptimizer):
        return opt  # the user built it already
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(
            f"strategy 'ddp_sharded' needs a torch.optim.Optimizer from configure_optimizers, got "
            f"{type(opt).__module__}.{type(opt).__name__}: ZeroRedundancyOptimizer rebuilds the optimizer from its "
            "class and hyper-parameters per rank. Use a torch optimizer, or strategy='ddp' / 'deepspeed'."
        )
    cls = type(opt)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    # `defaults` can hold bookkeeping keys the constructor does not take (e.g. AdamW's decoupled_weight_decay).
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
    # The group dicts are new objects (the user's stay with the discarded optimizer) but carry every option,
    # including a scheduler's `initial_lr`.
    groups = [dict(g, params=list(g["params"])) for g in opt.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=cls, **defaults)


def rebind_schedulers(schedulers: list[SchedulerConfig], old: list, new: list) -> list[SchedulerConfig]:
    """Points each LR scheduler that adjusted an optimizer in `old` at its replacement in `new`.

    Schedulers only read and write `optimizer.param_groups`, whose options were copied over, so they resume from
    where they were built (initial_lr and the first lr already set)."""
    replacement = {id(o): n for o, n in zip(old, new)}
    for cfg in schedulers:
        target = getattr(cfg.scheduler, "optimizer", None)
        if id(target) in replacement:
            cfg.scheduler.optimizer = replacement[id(target)]
    return schedulers
