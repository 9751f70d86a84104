"""Writing the neutral checkpoint form (checkpoint/layouts.py) into a DeepSpeed ZeRO engine: how any
strategy's checkpoint resumes under DeepSpeed, on any world size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightspeed.checkpoint.layouts import IMPLEMENTATION, Portable, check_model, param_names
from lightspeed.errors import ConfigError
from lightspeed.strategies.deepspeed.zero3 import load_weights as load_module_weights


def write_deepspeed(
    deepspeed: Any,
    engine: Any,
    module: torch.nn.Module,
    portable: Portable,
    with_optimizer: bool,
    path: Path,
) -> None:
    """Writes the neutral form into a DeepSpeed ZeRO 1/2/3 engine through DeepSpeed's
    tensor-fragment API (`_set_full`): the module's own weights (under ZeRO-3 gathered, set by rank
    0 and re-partitioned), the fp32 master weights and every optimizer state tensor (each rank keeps
    its fragment), the optimizer's step and `engine.global_steps`."""
    check_model(portable, module, path)
    load_module_weights(deepspeed, module, portable["model"])
    engines = getattr(engine, "engines", [engine])  # one per optimizer under manual optimization
    if (
        engines[0].optimizer is None
    ):  # an evaluation engine: no fp32 master weights, no optimizer state
        return
    names = param_names(module)
    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        _set_full(p, portable["model"][names[id(p)]].float())
    if not with_optimizer:
        return
    saved = portable["optim"]
    steps = [st["step"] for st in saved["state"].values() if st.get("step") is not None]
    step = float(steps[0]) if steps else 0.0
    keys = {
        k
        for st in saved["state"].values()
        for k, v in st.items()
        if k != "step" and torch.is_tensor(v)
    }
    for e in engines:
        _create_optimizer_state(e.optimizer, keys, step)
    for p in params:
        for key, value in saved["state"].get(names[id(p)], {}).items():
            if key in keys:
                _set_full(p, value.float(), key)
    groups = [g for e in engines for g in e.optimizer.optimizer.param_groups]
    if len(groups) == len(
        saved["param_groups"]
    ):  # engines in optimizer order, groups in the user's order
        for group, source in zip(groups, saved["param_groups"]):
            group.update(
                {k: v for k, v in source.items() if k in group and k not in IMPLEMENTATION}
            )
    for e in engines:
        # Adam's step counts the optimizer steps taken, as engine.global_steps does (SGD keeps none)
        if steps:
            e.global_steps = int(step)


def _set_full(p: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
    """Sets this rank's fragment of `p`'s fp32 master weight (key None) or optimizer state `key`
    from the whole `value`: DeepSpeed's `safe_set_full_fp32_param` /
    `safe_set_full_optimizer_state`. Under ZeRO-3 the same steps are taken here, because DeepSpeed
    0.19.8's version reads past the end of `value` on the last rank when the world size does not
    divide the parameter's size (the last partition is padded)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    if not hasattr(p, "ds_id"):
        safe_set_full_fp32_param(p, value) if key is None else safe_set_full_optimizer_state(
            p, value, key
        )
        return
    zero = p._z3_optimizer  # pyright: ignore[reportAttributeAccessIssue]  (DeepSpeed's attribute)
    part, group = zero._get_fp32_opt_state_partition(
        p, release_swap_buffers=False, optim_state_key=key
    )
    piece = value.flatten()[part.numel() * zero._get_param_partition_rank(p) :][: part.numel()]
    part.data.zero_()
    part.data[: piece.numel()].copy_(piece)
    if zero._swappable_optimizer_subgroup(
        group
    ):  # NVMe offload: write the subgroup back, as DeepSpeed does
        zero._optimizer_states_and_gradient_swap_out(group)


def _create_optimizer_state(zero: Any, keys: set[str], step: float) -> None:
    """ZeRO's torch optimizer creates its state at its first step; a resume needs it now. One state
    per flat fp32 partition, zeros to be filled by the fragment API, then linked to the parameters'
    fragments as DeepSpeed does after its first step (stages 1-2)."""
    flats = getattr(zero, "single_partition_of_fp32_groups", None) or getattr(
        zero, "fp32_partitioned_groups_flat", None
    )
    if flats is None:
        raise ConfigError(
            f"resuming a foreign checkpoint needs DeepSpeed's ZeRO optimizer, not "
            f"{type(zero).__name__}."
        )
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    inner = zero.optimizer
    on_device = any(g.get("fused") or g.get("capturable") for g in inner.param_groups)
    for flat in flats:
        st = inner.state[flat]
        for key in keys:
            st.setdefault(key, torch.zeros_like(flat))
        st["step"] = (
            int(step)
            if isinstance(inner, DeepSpeedCPUAdam)
            else torch.tensor(  # its C++ kernel takes an int
                step, dtype=torch.float32, device=flat.device if on_device else "cpu"
            )
        )
    for group in inner.param_groups:
        if "step" in group:  # DeepSpeed's FusedAdam keeps the step per group
            group["step"] = int(step)
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._lazy_init_hp_params_optimizer_state()
