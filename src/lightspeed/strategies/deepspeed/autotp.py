"""Tensor parallelism under DeepSpeed: `DeepSpeed(stage=1|2, tp=N)`, DeepSpeed's AutoTP training
(its `tensor_parallel.autotp_size`) beside ZeRO 1/2 over the world size / tp data-parallel ranks.

    Trainer(devices=2, strategy="deepspeed_stage_2_tp2")         # one data-parallel rank of 2
    Trainer(devices=4, strategy=DeepSpeed(stage=1, tp=2))        # 2 data-parallel groups x TP 2

DeepSpeed swaps each split nn.Linear for its own layer (LinearLayer: output features split;
LinearAllreduce: input features split, outputs all-reduced) inside `deepspeed.initialize`, and
builds its TP and data-parallel groups from one (dp, tp) mesh: a TP group is `tp` consecutive
ranks, as under FSDP(tp). ZeRO then shards over the data-parallel group only.

Which layers split: lightspeed hands AutoTP a `partition_config` (DeepSpeed's own config key for
a plan) built from the plan FSDP(tp) would use (strategies/tensor_parallel.py): `tp_plan=`, else a
Hugging Face model's `tp_plan`, else the default plan for common shapes. DeepSpeed reads a Hugging
Face plan only from the model it is handed, and lightspeed hands it the `StepRunner` around the
user's Module, so without this it would fall back to its name heuristics (which leave HF GPT-2 and
a fused qkv unsplit or wrongly split). A vocabulary-parallel embedding ("embedding_rowwise") stays
replicated here.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lightspeed.checkpoint.layouts import Portable
from lightspeed.errors import ConfigError

if TYPE_CHECKING:
    from lightspeed.strategies.tensor_parallel import Plan

# lightspeed's style names (tensor_parallel.STYLES) -> DeepSpeed's TPLayerSpec fields
SPECS: dict[str, dict[str, Any]] = {
    "colwise": {"partition_type": "column"},
    "rowwise": {"partition_type": "row"},
    "colwise_rep": {"partition_type": "column", "gather_output": True},
    "colwise_gather_output": {"partition_type": "column", "gather_output": True},
    # q, k and v side by side: each rank takes its share of each chunk, as FusedColwise does
    "fused_colwise": {"partition_type": "column", "shape": [3, -1], "partition_dim": 0},
}
LEFT_WHOLE = {"replicate", "embedding_rowwise"}  # replicated on every TP rank under DeepSpeed
WRAPPED = r"\.(?:_checkpoint_wrapped_module\.)?"  # activation checkpointing's level, if applied
# strategies/tensor_parallel.py is imported where a plan is built or tp > 1 checked: it imports
# torch's DTensor (about half a second), which `import lightspeed` and a rank without tp skip.


def check_tp(tp: int, stage: int, offload: str | None, user_config: dict) -> int:
    """The tensor-parallel degree: `tp`, or the user config's `tensor_parallel.autotp_size` when
    `tp` is 1. Raises ConfigError for a degree that is not a positive int, one contradicting the
    config's, ZeRO-3 or NVMe offload with tp > 1 (the optimizer offloaded to "cpu" is tested), or
    a config `partition_config` / `preset_model` (the plan is `DeepSpeed(tp_plan=...)`'s)."""
    section = user_config.get("tensor_parallel") or {}
    autotp = section.get("autotp_size", 0)
    if tp != 1:
        import lightspeed.strategies.tensor_parallel as tpl

        tpl.check_degree(tp, None, "DeepSpeed")
    if isinstance(autotp, int) and autotp > 1:
        if tp not in (1, autotp):
            raise ConfigError(
                f"DeepSpeed(tp={tp}) contradicts the config's tensor_parallel.autotp_size="
                f"{autotp}; set it in one place."
            )
        tp = autotp
    if tp == 1:
        return 1
    if stage == 3:
        raise ConfigError(
            f"DeepSpeed(stage=3, tp={tp}) is not offered: lightspeed runs DeepSpeed's AutoTP with "
            f"ZeRO stage 1 or 2 (its ZeRO-3 build, zero.Init with rank 0's weights copied in, is "
            f'not tested with AutoTP). Use DeepSpeed(stage=2, tp={tp}), or FSDP(tp={tp}) ("fsdp_tp'
            f'{tp}") to shard the parameters too.'
        )
    if offload == "nvme":
        raise ConfigError(
            f"DeepSpeed offload_optimizer='nvme' with tp={tp} is not offered (untested with "
            "DeepSpeed's AutoTP): use offload_optimizer='cpu' or None, or tp=1."
        )
    for key in ("partition_config", "preset_model"):
        if section.get(key) is not None:
            raise ConfigError(
                f"DeepSpeed config tensor_parallel.{key} is not read by lightspeed: give the plan "
                "as DeepSpeed(tp_plan={module path: 'colwise' | 'rowwise' | 'fused_colwise'}), "
                "so checkpoints can be resharded by it."
            )
    return tp


def build_plan(module: nn.Module, tp: int, given: Plan | None) -> tuple[Plan, list[str]]:
    """The plan for `module` (paths inside it -> style) and the plan table's lines, from `given`,
    else a Hugging Face `tp_plan`, else `default_plan`; checked as FSDP(tp) checks it.

    Raises:
        ConfigError: `module` defines `configure_tensor_parallel` (torch's DTensor API, FSDP(tp)'s
            hook), a style DeepSpeed's AutoTP cannot take, a Hugging Face Conv1D (GPT-2) in the
            plan, nothing to split, or sizes and head counts tp does not divide.
    """
    import lightspeed.strategies.tensor_parallel as tpl

    if _overrides_tp_hook(module):
        raise ConfigError(
            f"{type(module).__name__}.configure_tensor_parallel(mesh) is FSDP(tp)'s hook (torch's "
            "DTensor plan), which DeepSpeed's AutoTP cannot take: give the plan as "
            f"DeepSpeed(tp={tp}, tp_plan={{path: style}}), or use FSDP(tp={tp})."
        )
    if given is not None:
        plan, origin = tpl.expand(module, given, "DeepSpeed(tp_plan=...)", strict=True), "tp_plan="
    elif (found := tpl.hf_plan(module)) is not None:
        plan = tpl.expand(module, found[0], f"{found[1]}.tp_plan", strict=False)
        origin = f"the Hugging Face tp_plan of {found[1]}"
    else:
        plan, origin = tpl.default_plan(module), "the default plan for common shapes"
    plan, tied = tpl.untie(module, plan)
    for path, style in plan.items():
        if style not in SPECS and style not in LEFT_WHOLE:
            raise ConfigError(
                f"{origin}: {path!r}: style {style!r} is not offered under DeepSpeed's AutoTP: use "
                f"one of {', '.join(sorted(SPECS))}, or FSDP(tp={tp})."
            )
        if tpl.is_conv1d(module.get_submodule(path)):
            raise ConfigError(
                f"{path!r} is a Hugging Face Conv1D (GPT-2's layers): DeepSpeed's AutoTP training "
                f"splits nn.Linear only (DeepSpeed 0.19.8). Use FSDP(tp={tp}) for this model."
            )
    plan = {path: style for path, style in plan.items() if style in SPECS}
    if not plan:
        raise ConfigError(
            f"tensor parallelism (tp={tp}) found nothing to split in {type(module).__name__} with "
            f"{origin}: name the projections with DeepSpeed(tp_plan={{path: 'colwise' | "
            "'rowwise'}})."
        )
    tpl.check_plan(module, plan, tp, origin)
    lines = tpl.describe(plan, tp, origin, tied)
    lines[0] = lines[0].replace("tensor parallel:", "tensor parallel (DeepSpeed AutoTP):")
    return plan, lines


def _overrides_tp_hook(module: nn.Module) -> bool:
    """Whether `module`'s class defines `configure_tensor_parallel` itself (the Module's default,
    in lightspeed.core.module, does nothing)."""
    owner = next((c for c in type(module).__mro__ if "configure_tensor_parallel" in vars(c)), None)
    return owner is not None and owner.__module__ != "lightspeed.core.module"


def config_section(plan: Plan, tp: int, prefix: str = "module") -> dict[str, Any]:
    """The config's `tensor_parallel` section: AutoTP on `tp` ranks, splitting exactly the plan's
    modules (`prefix`: where the engine's model holds the user's Module)."""
    specs = []
    for path, style in plan.items():
        parts = [prefix, *path.split(".")]
        pattern = "^" + WRAPPED.join(re.escape(p) for p in parts) + r"\.weight$"
        specs.append({"patterns": [pattern], **SPECS[style]})
    return {
        "autotp_size": tp,
        "vocab_parallel_lm_head": False,
        "partition_config": {"use_default_specs": False, "layer_specs": specs},
    }


def drop_input_check(engine: Any) -> None:
    """Removes the check DeepSpeed puts on the first forward, that every rank of a TP group got the
    same inputs: it pickles the arguments, and lightspeed's first argument is the Module's bound
    `training_step` (the Module itself). lightspeed's sampler gives a TP group the same batches
    (`dp_sampler_kwargs`), which the loss parity tests check."""
    check = getattr(engine, "first_dataloader_check", None)
    if check is not None:
        check.remove()
        engine.first_dataloader_check = None


def dp_sampler_kwargs(world_size: int, rank: int, tp: int) -> dict[str, int]:
    """The data-parallel size and rank: DeepSpeed's mesh is (world / tp, tp), row-major, so the
    `tp` consecutive ranks of a TP group share one data-parallel rank and read the same batches."""
    return {"num_replicas": world_size // tp, "rank": rank // tp}


def local_portable(portable: Portable, plan: Plan, tp: int, tp_rank: int) -> Portable:
    """The neutral form with each tensor of a split module (weight, and a colwise bias; optimizer
    state too) cut to this TP rank's share, as AutoTP cut the live parameters: what DeepSpeed's
    fragment API then writes into this rank's ZeRO partitions. Everything else as given."""

    def cut(name: str, value: Any) -> Any:
        path, _, leaf = name.rpartition(".")
        style = plan.get(path)
        if style is None or not torch.is_tensor(value) or value.ndim == 0:
            return value
        if style == "rowwise":  # the weight's input features; the bias stays whole
            return value.chunk(tp, dim=1)[tp_rank].clone() if leaf == "weight" else value
        if style == "fused_colwise":  # each of q, k, v's output features
            parts = value.chunk(3, dim=0)
            return torch.cat([p.chunk(tp, dim=0)[tp_rank] for p in parts]).clone()
        return value.chunk(tp, dim=0)[tp_rank].clone()

    optim = portable["optim"]
    return {
        **portable,
        "model": {k: cut(k, v) for k, v in portable["model"].items()},
        "optim": {
            **optim,
            "state": {
                k: {key: cut(k, v) for key, v in st.items()} for k, st in optim["state"].items()
            },
        },
    }
