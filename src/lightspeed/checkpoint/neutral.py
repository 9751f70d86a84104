"""The neutral form a checkpoint travels in (layouts.py), and the parameter names that key it.

    {"model": {name: tensor},                      # the user Module's state_dict keys
     "optim": {"state": {name: {"exp_avg": ..., "step": ...}},
               "param_groups": [{hyper-parameters..., "params": [name, ...]}]},
     "precision": {...}}                           # the loss scaler's state, where there is one

A torch optimizer's state dict keys its parameters by index (0, 1, ... over its groups in order):
turning it into the neutral form needs each index's name, which lightspeed records at save
(`optimizer_param_names`) and finds for a file Lightning wrote (`names_by_identity`).
"""

from __future__ import annotations

from typing import Any

import torch

from lightspeed.errors import ConfigError

Portable = dict[str, Any]
# Activation checkpointing wraps a block; its parameters' names gain this infix (see
# strategies/common.py).
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."
# Optimizer options that choose an implementation, not the update: the target keeps its own.
IMPLEMENTATION = {"params", "fused", "foreach", "capturable", "differentiable"}


def canonical(name: str) -> str:
    """A parameter's name as the user's Module's state_dict spells it (no engine or
    checkpoint-wrapper prefix)."""
    return name.removeprefix("module.").replace(CHECKPOINT_PREFIX, "")


def param_names(module: torch.nn.Module) -> dict[int, str]:
    """id(parameter) -> its name; a tied parameter gets its first name, as torch's optimizer state
    dicts do."""
    return {id(p): canonical(n) for n, p in module.named_parameters()}


def optimizer_param_names(module: torch.nn.Module, optimizers: list) -> list[list[str]]:
    """For each optimizer, the names of its parameters in index order: what turns a saved torch
    optimizer state dict (keyed 0, 1, ...) into the neutral form on another strategy."""
    names = param_names(module)
    return [[names[id(p)] for g in opt.param_groups for p in g["params"]] for opt in optimizers]


def named_optimizer_state(states: list[dict], names: list[list[str]]) -> dict:
    """Torch optimizers' state dicts (keyed by index) as the neutral form's one name-keyed state:
    `names[i]` names optimizer i's parameters in index order."""
    out: dict = {"state": {}, "param_groups": []}
    for sd, own in zip(states, names):
        out["state"].update({own[i]: st for i, st in sd["state"].items()})
        out["param_groups"] += [
            {**g, "params": [own[i] for i in g["params"]]} for g in sd["param_groups"]
        ]
    return out


def wrapper_prefix(live: list[str], saved: set[str]) -> str:
    """The prefix the wrappers around the user's module (DDP's `module.`, a step runner's, an
    engine's) put before its names: the one that turns every name in `live` (the running model's)
    into one of `saved` (the user module's). "" when none does."""
    first = live[0] if live else ""
    for prefix in ["", *(first[: i + 1] for i, c in enumerate(first) if c == ".")]:
        if all(n.startswith(prefix) and n[len(prefix) :] in saved for n in live):
            return prefix
    return ""


def names_by_identity(
    module: torch.nn.Module, optimizers: list, states: list[dict], saved: set[str], where: str
) -> list[list[str]]:
    """Each saved optimizer's parameter names, for optimizer state dicts that do not record them
    (a file Lightning wrote), as the checkpoint's state dict (`saved`, its keys) spells them: the
    running optimizers built by the same `configure_optimizers` hold the same parameters in the
    same order, found in the running `module` by identity. Where the running optimizers do not
    hold the module's parameters (DeepSpeed's flat partitions), one optimizer over all parameters
    is named in the module's order, each saved state tensor checked against its parameter's
    shape. Raises ConfigError naming `where` when neither fits."""
    counts = [sum(len(g["params"]) for g in sd["param_groups"]) for sd in states]
    running = [n for n, _ in module.named_parameters()]
    cut = len(wrapper_prefix(running, saved))
    own = {id(p): n[cut:] for n, p in module.named_parameters()}
    try:
        names = [[own[id(p)] for g in o.param_groups for p in g["params"]] for o in optimizers]
    except KeyError:
        names = None
    if names is not None and [len(n) for n in names] == counts:
        return names
    shapes = {
        n[cut:]: tuple(getattr(p, "ds_shape", p.shape))  # ZeRO-3 keeps the whole shape there
        for n, p in module.named_parameters()
    }
    ordered = list(shapes)
    if len(states) == 1 and counts[0] == len(ordered):
        fits = all(
            tuple(t.shape) == shapes[ordered[i]]
            for i, st in states[0]["state"].items()
            for t in st.values()
            if isinstance(t, torch.Tensor) and t.dim() > 0
        )
        if fits:
            return [ordered]
    raise ConfigError(
        f"checkpoint {where}: its optimizer state ({counts} parameters per optimizer) does not "
        f"match this run's optimizers ({[len(n) for n in names or []]}) or, in order, the model's "
        f"{len(ordered)} parameters: was it written for another model or configure_optimizers?"
    )
