"""DeepSpeed's compiled ops, as lightspeed uses them: FusedAdam in place of a torch Adam/AdamW,
DeepSpeedCPUAdam in its place under optimizer offload, and the op report of `lightspeed env` (which
ops are installed, which compile just in time)."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import torch

from lightspeed.perf.kernels import rebind_schedulers


def fused_adam(opt: torch.optim.Optimizer) -> Any:
    """DeepSpeed's FusedAdam with `opt`'s groups and hyper-parameters, or None where it cannot run
    the same update (amsgrad, maximize, or groups that disagree on decoupled weight decay: FusedAdam
    has one mode)."""
    from deepspeed.ops.adam import FusedAdam

    groups = opt.param_groups
    decoupled = {
        type(opt) is torch.optim.AdamW or bool(g.get("decoupled_weight_decay", False))
        for g in groups
    }
    if len(decoupled) != 1 or any(g.get("amsgrad") or g.get("maximize") for g in groups):
        return None
    d = opt.defaults
    # Every key of every group is kept (FusedAdam reads only its own), so a scheduler's "initial_lr"
    # survives.
    return FusedAdam(
        [dict(g, params=list(g["params"])) for g in groups],
        lr=d["lr"],
        betas=d["betas"],
        eps=d["eps"],
        weight_decay=d["weight_decay"],
        adam_w_mode=decoupled.pop(),
    )


def cpu_adam(opt: torch.optim.Optimizer, schedulers: list, log0: Callable[[str], None]) -> Any:
    """A torch Adam/AdamW as DeepSpeedCPUAdam (several times faster on offloaded states) with the
    same groups and hyper-parameters, the user's `schedulers` rebound to it; any other optimizer as
    it is. For optimizer offload only; says on rank 0 (`log0`) what it replaced."""
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return opt
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    d = opt.defaults
    groups = [
        dict(g) for g in opt.param_groups
    ]  # every key, so a scheduler's "initial_lr" survives
    new = DeepSpeedCPUAdam(
        groups,
        lr=d["lr"],
        betas=d["betas"],
        eps=d["eps"],
        weight_decay=d["weight_decay"],
        amsgrad=d.get("amsgrad", False),
        adamw_mode=type(opt) is torch.optim.AdamW,
    )
    rebind_schedulers(schedulers, opt, new)  # their state (step count, base lrs) is in them
    log0(
        f"DeepSpeed: optimizer offload replaces torch.optim.{type(opt).__name__} with "
        "DeepSpeedCPUAdam, "
        f"same hyper-parameters{' (LR schedulers rebound to it)' if schedulers else ''}."
    )
    return new


def environment() -> tuple[list[tuple[str, str]], list[tuple[str, str, str]]]:
    """(rows of (what, value): DeepSpeed's version and accelerator; (op, installed, compatible) for
    every op builder of the accelerator, as ds_report lists them). Not installed but compatible
    means: compiled just in time on first use. Raises ImportError if DeepSpeed is not installed."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()._name
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from deepspeed.ops.op_builder.all_ops import ALL_OPS

    ops = []
    for name, builder in ALL_OPS.items():
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                compatible = bool(builder.is_compatible(verbose=False))
            # noqa: BLE001 - a builder that cannot probe this machine is not compatible
            except Exception:
                compatible = False
        installed = installed_ops.get(name, False) and accelerator_name == accelerator
        ops.append((name, "yes" if installed else "no", "yes" if compatible else "no"))
    return [("deepspeed", deepspeed.__version__), ("DeepSpeed accelerator", accelerator)], ops
