"""Tensor parallelism (Megatron-style) with torch's DTensor: each rank of a tensor-parallel group
holds 1/tp of every attention and MLP projection and computes its share of the heads.

    Trainer(strategy="fsdp_tp2", devices=4)        # 2-D: FSDP2 over 2 data-parallel ranks x TP 2
    Trainer(strategy=FSDP(tp=2), devices=2)        # plain TP: one data-parallel rank of 2 TP ranks

The plan (module path -> style name) comes from, in order:
  1. `Module.configure_tensor_parallel(mesh)`, if it makes any parameter a DTensor (the user calls
     torch's `parallelize_module` there, as in Lightning's `configure_model`);
  2. `FSDP(tp_plan={...})`, style names as in Hugging Face plans (`STYLES` in
     strategies/tp_styles.py), wildcards allowed;
  3. a Hugging Face model's own `tp_plan` (its config's `base_model_tp_plan`, plus the head);
  4. `default_plan`: the common shapes by name inside the repeated blocks (attention q/k/v
     colwise, a fused qkv split per chunk, o/proj rowwise; MLP up/gate/fc colwise, down rowwise).
Embeddings and the head stay replicated unless the plan names them.

`apply_tp` applies a plan with `parallelize_module` (`src_data_rank=None`: every rank already
holds the same weights, built from one seed or on the meta device), then makes every parameter the
plan left whole a `Replicate()` DTensor on the same mesh (`apply_replicated`), whose owner computes
with its local tensor. So every parameter lives on one mesh, which FSDP2 then shards over the
data-parallel dimension and torch's foreach optimizers and clipping accept. Order, torchtitan's:
TP -> activation checkpointing -> compile -> FSDP.
"""

from __future__ import annotations

import fnmatch
import re
from functools import partial
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import parallelize_module

from lightspeed.errors import ConfigError
from lightspeed.strategies.tp_styles import SPLIT_DIM, STYLES, is_conv1d

Plan = dict[str, str]  # module path -> style name (a key of STYLES)


# --------------------------------------------------------------------------------------------------
# where the plan comes from
COLWISE = {"q_proj", "k_proj", "v_proj", "query", "key", "value", "wq", "wk", "wv", "gate_proj"}
COLWISE |= {"up_proj", "w1", "w3", "fc1", "c_fc", "fc_in", "dense_h_to_4h"}
ROWWISE = {"o_proj", "out_proj", "wo", "proj", "c_proj", "down_proj", "w2", "fc2", "fc_out"}
ROWWISE |= {"dense_4h_to_h"}
FUSED = {"qkv", "c_attn", "qkv_proj", "Wqkv"}
# Head counts an attention module (or its config) may hold: each must divide by tp.
HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "num_key_value_heads")
HEAD_ATTRIBUTES += ("n_kv_heads", "num_kv_heads")


def _is_projection(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def default_plan(module: nn.Module) -> Plan:
    """The common shapes, found by name inside the repeated blocks (children of an nn.ModuleList):
    attention q/k/v colwise, a fused qkv (`qkv`, `c_attn`) per chunk, o/proj rowwise; MLP
    up/gate/fc colwise, down/proj rowwise; an nn.Sequential MLP (GPT's `mlp`) with two Linears:
    the first colwise, the last rowwise. Embeddings, norms and the head stay replicated."""
    blocks = [b for m in module.modules() if isinstance(m, nn.ModuleList) for b in m]
    inside = {id(m) for b in blocks for m in b.modules()}
    plan: Plan = {}
    for path, m in module.named_modules():
        if id(m) not in inside:
            continue
        leaf = path.rpartition(".")[2]
        if _is_projection(m) and leaf in FUSED:
            plan[path] = "fused_colwise"
        elif _is_projection(m) and leaf in COLWISE:
            plan[path] = "colwise"
        elif _is_projection(m) and leaf in ROWWISE:
            plan[path] = "rowwise"
        elif isinstance(m, nn.Sequential):
            linear = [f"{path}.{n}" for n, c in m.named_children() if _is_projection(c)]
            if len(linear) == 2:
                plan |= {linear[0]: "colwise", linear[1]: "rowwise"}
    return plan


def hf_plan(module: nn.Module) -> tuple[Plan, str] | None:
    """The tensor-parallel plan a Hugging Face model carries (`model.tp_plan`: its config's
    `base_model_tp_plan` under the base model's prefix, plus the head's), keyed from `module`, and
    the model's class name; None when no HF model inside `module` has one."""
    for path, m in module.named_modules():
        plan = getattr(m, "tp_plan", None) or getattr(m, "_tp_plan", None)
        config = getattr(m, "config", None)
        if not plan and config is not None and getattr(m, "base_model_prefix", None) is not None:
            base = getattr(config, "base_model_tp_plan", None) or {}
            prefix = str(m.base_model_prefix)
            prefix = prefix if hasattr(m, prefix) else ""
            plan = {f"{prefix}.{k}" if prefix else k: v for k, v in base.items()}
        if plan and isinstance(plan, dict):
            return {f"{path}.{k}" if path else k: v for k, v in plan.items()}, type(m).__name__
    return None


def expand(module: nn.Module, plan: Plan, origin: str, strict: bool) -> Plan:
    """Resolves the wildcards (`layers.*.q_proj`) of `plan` into module paths.

    Raises:
        ConfigError: for a style name not in STYLES, or (with `strict`) a key that names no module
            of `module`; the message lists candidate projections.
    """
    paths = [p for p, _ in module.named_modules() if p]
    out: Plan = {}
    for key, style in plan.items():
        if style not in STYLES:
            raise ConfigError(
                f"{origin}: {key!r}: {style!r} is not a tensor-parallel style lightspeed applies: "
                f"use one of {', '.join(sorted(STYLES))}, or call parallelize_module yourself in "
                "Module.configure_tensor_parallel(mesh)."
            )
        pattern = key.split(".")
        found = [p for p in paths if _matches(p.split("."), pattern)]
        if not found and strict:
            projections = sorted(
                {_collapse(p) for p, m in module.named_modules() if _is_projection(m)}
            )
            raise ConfigError(
                f"{origin}: {key!r} names no module of {type(module).__name__}. Its projections: "
                f"{', '.join(projections[:12]) or 'none'}{' ...' if len(projections) > 12 else ''}."
            )
        out |= {p: style for p in found}
    return out


def _matches(parts: list[str], pattern: list[str]) -> bool:
    return len(parts) == len(pattern) and all(
        fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pattern)
    )


def _collapse(path: str) -> str:
    """`blocks.3.attn.qkv` -> `blocks.*.attn.qkv`: layer indices (not leaves: `mlp.0`) as `*`."""
    return re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", path)


# --------------------------------------------------------------------------------------------------
# checks
def check_degree(tp: int, world_size: int | None, what: str) -> None:
    """Raises ConfigError unless `tp` is a positive int dividing `world_size` (dp x tp ranks; None:
    not known yet)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ConfigError(f"{what}(tp={tp!r}) is not valid: use a positive int (1: no TP).")
    if world_size is not None and world_size % tp:
        raise ConfigError(
            f"{what}(tp={tp}) needs a world size divisible by {tp} (data-parallel x tensor-parallel"
            f" ranks), but the world size is {world_size}: use devices x num_nodes a multiple of "
            f"{tp}, or a tp among {[d for d in range(1, world_size + 1) if world_size % d == 0]}."
        )


def check_plan(module: nn.Module, plan: Plan, tp: int, origin: str) -> None:
    """Raises ConfigError naming the module and the size when `tp` does not divide the features a
    style splits, or a head count of the attention module above a split projection; or when a
    planned module is not a Linear, HF Conv1D or Embedding."""
    for path, style in plan.items():
        m = module.get_submodule(path)
        if style == "replicate":
            continue
        if not (_is_projection(m) or isinstance(m, nn.Embedding)):
            raise ConfigError(
                f"{origin}: {path!r} is a {type(m).__name__}; the style {style!r} splits a Linear, "
                "Hugging Face's Conv1D or an Embedding."
            )
        dim = SPLIT_DIM[style] ^ (1 if is_conv1d(m) else 0)
        weight: Any = m.weight
        size = weight.shape[dim] // (3 if style == "fused_colwise" else 1)
        if size % tp:
            kind = "output" if SPLIT_DIM[style] == 0 else "input"
            raise ConfigError(
                f"tp={tp} does not divide {path}'s {size} {kind} features"
                f"{' per q/k/v chunk' if style == 'fused_colwise' else ''} ({origin}): use a tp "
                f"that divides {size}, or leave {path} out of the plan."
            )
        if SPLIT_DIM[style] == 0 and "." in path:
            parent = path.rpartition(".")[0]
            for name, heads in _head_counts(module.get_submodule(parent)).items():
                if heads % tp:
                    raise ConfigError(
                        f"tp={tp} does not divide {parent}'s {name}={heads}: each rank must hold "
                        f"whole heads. Use a tp that divides {heads}."
                    )


def _head_counts(attention: nn.Module) -> dict[str, int]:
    found = {}
    for source in (attention, getattr(attention, "config", None)):
        for name in HEAD_ATTRIBUTES:
            value = getattr(source, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                found.setdefault(name, value)
    return found


def untie(module: nn.Module, plan: Plan) -> tuple[Plan, list[str]]:
    """Drops from `plan` the modules whose weight is tied to another module's (GPT's head and token
    embedding): a tied pair stays replicated. Returns the plan and the dropped paths."""
    owners: dict[int, list[str]] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(path)
    tied = [
        path
        for path in plan
        if any(len(owners[id(p)]) > 1 for p in module.get_submodule(path).parameters())
    ]
    return {k: v for k, v in plan.items() if k not in tied}, tied


# --------------------------------------------------------------------------------------------------
# applying
def build_mesh(device_type: str, world_size: int, tp: int) -> DeviceMesh:
    """The 2-D ("dp", "tp") mesh: ranks `dp_rank * tp + tp_rank`, so a TP group is `tp` consecutive
    ranks (one host's GPUs, where the per-layer collectives run)."""
    return init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def apply_tp(module: nn.Module, mesh: DeviceMesh, plan: Plan) -> None:
    """Applies `plan` (module paths, already expanded) to `module` in place on the 1-D TP `mesh`:
    torch's `parallelize_module` with the styles named, the fused projections' parents told their
    local split (HF GPT-2's `split_size`), then `apply_replicated` for each parameter left whole."""
    styles = {path: STYLES[name]() for path, name in plan.items() if name != "replicate"}
    parallelize_module(module, mesh, styles, src_data_rank=None)
    for path, name in plan.items():
        parent = module.get_submodule(path.rpartition(".")[0]) if "." in path else module
        split = getattr(parent, "split_size", None)
        if name == "fused_colwise" and isinstance(split, int) and split % mesh.size() == 0:
            setattr(parent, "split_size", split // mesh.size())  # `.split()` of the local output
    apply_replicated(module, mesh)


def apply_replicated(module: nn.Module, mesh: DeviceMesh) -> None:
    """Makes every parameter of `module` that is not yet a DTensor a `Replicate()` DTensor on the TP
    `mesh` (tied parameters stay tied), and has its owner compute with the local tensor: a hook
    swaps the local tensor in for the owner's forward and the DTensor back after. The gradients of
    replicated weights are whole on every TP rank (the activations they see are), so the local
    gradient is the DTensor's."""
    made: dict[int, nn.Parameter] = {}
    for owner in module.modules():
        names = [
            n for n, p in owner._parameters.items() if p is not None and not isinstance(p, DTensor)
        ]
        for name in names:
            p = owner._parameters[name]
            if id(p) not in made:
                local = distribute_tensor(p.detach(), mesh, [Replicate()], src_data_rank=None)
                made[id(p)] = nn.Parameter(local, requires_grad=p.requires_grad)
            owner._parameters[name] = made[id(p)]
        if names:
            held: list[dict[str, Any]] = []
            owner.register_forward_pre_hook(partial(_swap_in_local, names, held))
            owner.register_forward_hook(partial(_swap_back, held), always_call=True)


def _swap_in_local(names: list[str], held: list, owner: nn.Module, args: Any) -> None:
    slots: dict[str, Any] = owner._parameters  # a plain tensor for the forward's duration
    params = {n: slots[n] for n in names}
    held.append(params)
    for n, p in params.items():
        slots[n] = p.to_local() if isinstance(p, DTensor) else p


def _swap_back(held: list, owner: nn.Module, args: Any, output: Any) -> None:
    owner._parameters.update(held.pop())


def apply_tensor_parallel(module: nn.Module, mesh: DeviceMesh, given: Plan | None) -> list[str]:
    """The strategy's entry point: the plan from its first source (see the module docstring),
    checked and applied to `module` in place on the TP `mesh`. Returns the plan table's lines.

    Raises:
        ConfigError: a style name or a module path the plan names that `module` lacks, or sizes and
            head counts tp does not divide.
    """
    tp = mesh.size()
    hook = getattr(module, "configure_tensor_parallel", None)  # a plain nn.Module has none
    if callable(hook):
        hook(mesh)
    if any(isinstance(p, DTensor) for p in module.parameters()):
        apply_replicated(module, mesh)
        return [
            f"tensor parallel: tp={tp}, plan from {type(module).__name__}.configure_tensor_parallel"
        ]
    if given is not None:
        plan, origin = expand(module, given, "FSDP(tp_plan=...)", strict=True), "tp_plan="
    elif (found := hf_plan(module)) is not None:
        plan, origin = expand(module, found[0], f"{found[1]}.tp_plan", strict=False), found[1]
        origin = f"the Hugging Face tp_plan of {origin}"
    else:
        plan, origin = default_plan(module), "the default plan for common shapes"
    if not any(style != "replicate" for style in plan.values()):
        raise ConfigError(
            f"tensor parallelism (tp={tp}) found nothing to split in {type(module).__name__} with "
            f"{origin}: name the projections with FSDP(tp_plan={{path: 'colwise' | 'rowwise'}}) "
            "or call parallelize_module in Module.configure_tensor_parallel(mesh)."
        )
    plan, tied = untie(module, plan)
    check_plan(module, plan, tp, origin)
    apply_tp(module, mesh, plan)
    return describe(plan, tp, origin, tied)


def describe(plan: Plan, tp: int, origin: str, tied: list[str]) -> list[str]:
    """The plan table: one line per style and collapsed path (layer indices as `*`)."""
    rows: dict[tuple[str, str], int] = {}
    for path, style in plan.items():
        rows[(_collapse(path), style)] = rows.get((_collapse(path), style), 0) + 1
    width = max((len(p) for p, _ in rows), default=0)
    lines = [f"tensor parallel: tp={tp}, {origin}; every other parameter replicated"]
    lines += [f"  {p:<{width}}  {s}  x{n}" for (p, s), n in rows.items()]
    lines += [f"  {p}  replicated (its weight is tied)" for p in tied]
    return lines
