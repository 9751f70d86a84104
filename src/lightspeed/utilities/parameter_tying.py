"""Tied parameters (one tensor held under several names, such as an embedding shared with the
output head): find them, and tie them again after something untied them (a copy, a load)."""

from __future__ import annotations

from torch import nn


def find_shared_parameters(module: nn.Module) -> list[list[str]]:
    """The groups of parameter names that share one tensor, each group in registration order;
    `[]` when nothing is tied."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def set_shared_parameters(module: nn.Module, shared_params: list[list[str]]) -> nn.Module:
    """Ties each group of `shared_params` (names as `find_shared_parameters` gives them): every
    name of a group is made to hold the group's first parameter. Returns `module`."""
    for group in shared_params:
        first = module.get_parameter(group[0])
        for name in group[1:]:
            owner_name, _, attr = name.rpartition(".")
            setattr(module.get_submodule(owner_name), attr, first)
    return module
