"""ZeRO stage 1 as a function on a torch optimizer: `apply_zero1` rebuilds the user's optimizers as
ZeroRedundancyOptimizers (same class, param groups and options) and re-points their LR schedulers.
DDP composes it when `shard_optimizer=True` (strategy "ddp_sharded", `ZeRO1()`).

Every rank keeps the whole model and its whole gradient (DDP all-reduces it), but each rank holds
the optimizer state of only its partition of the parameters, steps only those and broadcasts them to
the others. Manual optimization works unchanged: `self.optimizers()` hands the user the
ZeroRedundancyOptimizer, whose step() updates the local partition and broadcasts it, exactly what
the automatic loop does.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from lightspeed.errors import ConfigError
from lightspeed.perf import kernels
from lightspeed.specs import SchedulerConfig

# A scheduler created on the user's optimizer and re-pointed at the rebuilt one warns once that
# "optimizer.step()
# has been overridden": torch looks for the marker it put on the *original* optimizer's step.
# Nothing is wrong.
warnings.filterwarnings(
    "ignore", message=r"Seems like `optimizer.step\(\)` has been overridden", category=UserWarning
)


def apply_zero1(
    optimizers: list, schedulers: list[SchedulerConfig], parameters_as_bucket_view: bool = False
) -> tuple[list, list[SchedulerConfig]]:
    """Returns (the optimizers rebuilt as ZeroRedundancyOptimizers, the schedulers pointed at
    them)."""
    sharded = [build_zero_optimizer(opt, parameters_as_bucket_view) for opt in optimizers]
    return sharded, rebind_schedulers(schedulers, optimizers, sharded)


def build_zero_optimizer(
    opt: Any, parameters_as_bucket_view: bool = False
) -> torch.optim.Optimizer:
    """Rebuilds the torch optimizer `opt` as a ZeroRedundancyOptimizer: same class, same param
    groups with their own options, same defaults. `opt` must not have stepped yet (its state is not
    carried over).

    Raises:
        ConfigError: if `opt` is not a `torch.optim.Optimizer` (ZeroRedundancyOptimizer needs the
        class to
            build one local optimizer per partition).
    """
    # Imported here: torch.distributed.optim pulls in FSDP and DTensor, a second of start-up every
    # rank pays.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    if isinstance(opt, ZeroRedundancyOptimizer):
        return opt  # the user built it already
    if not isinstance(opt, torch.optim.Optimizer):
        raise ConfigError(
            f"strategy 'ddp_sharded' needs a torch.optim.Optimizer from configure_optimizers, got "
            f"{type(opt).__module__}.{type(opt).__name__}: ZeroRedundancyOptimizer rebuilds the "
            "optimizer from its "
            "class and hyper-parameters per rank. Use a torch optimizer, or strategy='ddp' / "
            "'deepspeed'."
        )
    cls = type(opt)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    # `defaults` can hold bookkeeping keys the constructor does not take (e.g. AdamW's
    # decoupled_weight_decay).
    defaults = {k: v for k, v in opt.defaults.items() if k in accepted}
    # The group dicts are new objects (the user's stay with the discarded optimizer) but carry every
    # option,
    # including a scheduler's `initial_lr`.
    groups = [dict(g, params=list(g["params"])) for g in opt.param_groups]
    return ZeroRedundancyOptimizer(
        groups, optimizer_class=cls, parameters_as_bucket_view=parameters_as_bucket_view, **defaults
    )


def rebind_schedulers(
    schedulers: list[SchedulerConfig], old: list, new: list
) -> list[SchedulerConfig]:
    """Points each LR scheduler that adjusted an optimizer in `old` at its replacement in `new`
    (SequentialLR's children too; see kernels.rebind_schedulers). Returns `schedulers`."""
    for before, after in zip(old, new):
        kernels.rebind_schedulers(schedulers, before, after)
    return schedulers
