"""What the memory plan needs to know about a Module, found without touching it: parameter shapes
per optimizer group and the optimizer's state layout (from a copy built on the meta device), and the
activations one step saves for backward (measured on a CPU copy at micro-batch 1 and 2, fitted as a
line). Used by `lightspeed.plan.forecast`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode

from lightspeed.core.optimizer import parse_optimizers
from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import repeated_blocks
from lightspeed.plan.gpu_kernels import GpuKernels, LiveBytes
from lightspeed.plan.model_copy import (
    batch_of,
    build_copy,
    cast_floats,
    stand_in,
    step_args,
    steps_itself,
)

if TYPE_CHECKING:
    from lightspeed.core.module import Module as UserModule

ADAM_STATES = {
    "Adam": 2,
    "AdamW": 2,
    "Adamax": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adadelta": 2,
    "Adagrad": 1,
    "Rprop": 2,
    "ASGD": 2,
    "LBFGS": 2,
    "DeepSpeedCPUAdam": 2,
    "FusedAdam": 2,
}


@dataclass(frozen=True)
class Activations:
    """Saved-for-backward bytes as `base + per_sample × micro_batch`, plain and with activation
    checkpointing, plus the step's working memory above them at its peak (`working_*`: the loss's
    fp32 logits and their gradient at the start of backward, a layer's gradients before they are
    freed), measured for a GPU target only (`probe_activations(device_type="cuda")`)."""

    base: float = 0.0
    per_sample: float = 0.0
    ac_base: float = 0.0
    ac_per_sample: float = 0.0
    is_probed: bool = False
    working_base: float = 0.0
    working_per_sample: float = 0.0
    flops_per_sample: float = 0.0  # the step's forward and backward FLOPs per sample (counted)
    inside_base: float = 0.0  # of `base`: saved inside the repeated blocks (what TP divides)
    inside_per_sample: float = 0.0

    def at(self, micro_batch: int, checkpointed: bool = False) -> int:
        working = self.working_base + self.working_per_sample * micro_batch
        if checkpointed:
            return max(0, round(self.ac_base + self.ac_per_sample * micro_batch + working))
        return max(0, round(self.base + self.per_sample * micro_batch + working))

    def slope(self, checkpointed: bool = False) -> tuple[float, float]:
        """(bytes at micro-batch 0, bytes per sample) of `at`: the line the micro-batch finder
        solves."""
        if checkpointed:
            return self.ac_base + self.working_base, self.ac_per_sample + self.working_per_sample
        return self.base + self.working_base, self.per_sample + self.working_per_sample


@dataclass(frozen=True)
class ModelFacts:
    """What the forecast needs from a model: parameter shapes per optimizer group, the optimizer's
    layout, the largest shard unit (a repeated block), and the activation probe."""

    groups: list[list[tuple[int, ...]]]
    states_per_param: int
    step_counters: bool
    optimizer: str
    unit_numel: int
    activations: Activations = field(default_factory=Activations)
    built_bytes: int = 0  # the Module's tensors already on the host as given (built in __init__)
    engine_activations: Activations = field(default_factory=Activations)  # run in bf16, no autocast
    probe_bytes: int = 0  # the probe's CPU copy while it runs: weights and their gradients
    tokens_per_sample: int = 1  # a text sample's token ids (its first integer tensor), else 1
    blocks: int = 0  # repeated blocks (children of an nn.ModuleList): what checkpointing wraps
    tp_numel: int = 0  # elements of the parameters a tensor-parallel plan splits (`tp_split_numel`)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [s for g in self.groups for s in g]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def inspect_model(
    module: torch.nn.Module,
    batch: Any = None,
    precision: str = "32-true",
    device_type: str = "cpu",
) -> ModelFacts:
    """Facts about `module` without touching it: a copy is built on the meta device
    (`configure_model`) to read parameter shapes and the optimizer `configure_optimizers` returns;
    with `batch`, another copy is built on CPU for the activation probe (`probe_activations`; not
    under manual optimization, whose `training_step` steps optimizers the copy does not have).
    `device_type`: where training will run ("cuda": the probe saves what the GPU's kernels save).
    Raises ConfigError if the module has no parameters."""
    meta = cast("UserModule", build_copy(module, torch.device("meta")))  # the user's Module
    params = list(dict.fromkeys(meta.parameters()))
    if not params:
        raise ConfigError(
            f"module={type(module).__name__} has no parameters after configure_model(): nothing to "
            "plan for."
        )
    optimizers, _ = parse_optimizers(meta.configure_optimizers())
    opt = optimizers[0] if optimizers else None
    groups = (
        [[tuple(p.shape) for p in g["params"]] for g in opt.param_groups if g["params"]]
        if opt
        else [[tuple(p.shape) for p in params]]
    )
    name = type(opt).__name__ if opt else "none"
    units = repeated_blocks(meta)
    unit_numel = max(
        (sum(p.numel() for p in u.parameters()) for u in units),
        default=sum(p.numel() for p in params),
    )
    probed = batch is not None and not steps_itself(module)
    activations = (
        probe_activations(module, batch, precision, device_type) if probed else Activations()
    )
    engine = Activations()
    if probed and precision in ("bf16-mixed", "16-mixed") and find_spec("deepspeed"):
        # DeepSpeed's half-precision modes run the model in that dtype, without autocast.
        half = cast_floats(batch, torch.bfloat16)
        try:
            engine = probe_activations(module, half, "bf16-true", device_type)
        except Exception:  # noqa: BLE001 - a model that cannot run in bf16 on CPU: autocast's line
            engine = Activations()
    width = 2 if precision == "bf16-true" else 4  # the probe's copy: weights, then gradients
    return ModelFacts(
        groups,
        optimizer_states(opt),
        name in ADAM_STATES,
        name,
        unit_numel,
        activations,
        built_bytes=host_bytes(module),
        engine_activations=engine,
        probe_bytes=2 * width * sum(p.numel() for p in params) if probed else 0,
        tokens_per_sample=tokens_in(batch),
        blocks=len(units),
        tp_numel=tp_split_numel(meta),
    )


def tp_split_numel(module: torch.nn.Module) -> int:
    """Elements of `module`'s parameters that tensor parallelism splits across the TP ranks, by the
    plan `FSDP(tp=N)` applies (strategies/tensor_parallel.py: the model's Hugging Face `tp_plan`,
    else the default plan for common shapes): each planned projection's weight, and the bias of a
    column-wise one (a row-wise one's bias stays whole). 0 when no plan applies."""
    from lightspeed.strategies.tensor_parallel import default_plan, expand, hf_plan

    found = hf_plan(module)
    try:
        plan = expand(module, found[0], "tp_plan", strict=False) if found else default_plan(module)
    except ConfigError:
        return 0
    modules, seen, split = dict(module.named_modules()), set(), 0
    for path, style in plan.items():
        owner = modules.get(path)
        if owner is None or style == "replicate":
            continue
        for name, p in owner.named_parameters(recurse=False):
            if id(p) in seen or (name == "bias" and style.startswith("rowwise")):
                continue
            seen.add(id(p))
            split += p.numel()
    return split


def tokens_in(batch: Any) -> int:
    """Tokens per sample of a batch: the elements of one row of its first integer tensor of two or
    more dimensions (token ids), else 1 (an image, a feature row: one sample)."""
    for t in tree_leaves(batch):
        if isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_floating_point():
            return max(1, t[0].numel())
    return 1


def host_bytes(module: torch.nn.Module) -> int:
    """Bytes of `module`'s parameters and buffers that exist on the host (a model built in
    `__init__`); 0 for one that `configure_model` builds."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}.values()
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


def optimizer_states(opt: Any) -> int:
    """Per-parameter state tensors the optimizer keeps (each the parameter's size): AdamW 2 (3 with
    amsgrad), SGD 1 with momentum else 0, RMSprop 1 (+1 momentum, +1 centered); an unknown optimizer
    is taken as Adam's 2."""
    if opt is None:
        return 0
    name, d = type(opt).__name__, getattr(opt, "defaults", {})
    match name:
        case "SGD":
            return 1 if d.get("momentum", 0) else 0
        case "RMSprop":
            return 1 + bool(d.get("momentum", 0)) + bool(d.get("centered", False))
        case "Adam" | "AdamW":
            return 3 if d.get("amsgrad") else 2
    return ADAM_STATES.get(name, 2)


def probe_activations(
    module: torch.nn.Module, batch: Any, precision: str = "32-true", device_type: str = "cpu"
) -> Activations:
    """Runs `training_step` and backward on a CPU copy of `module` at micro-batch 1 and 2 (rows of
    `batch`, repeated if needed) and fits saved-for-backward bytes as a line in the micro-batch.
    Weights (and, under mixed precision, autocast's casts of them: counted as buffers) are not
    activations.

    With activation checkpointing only each block's input stays saved, plus one block's own tensors
    while it is recomputed: the probe attributes saved tensors to the repeated blocks
    (`repeated_blocks`) to derive that line.

    For a GPU target (`device_type="cuda"`) the copy runs as the GPU's kernels would
    (`GpuKernels`: dropout saves a one-byte mask, attention with dropout takes the flash kernel
    instead of the CPU's fp32 fallback), and the line gains the step's working memory above the
    saved tensors at its peak (`LiveBytes`), which the GPU's allocator counts too.
    """
    twin = _probe_copy(module, precision)
    gpu = device_type == "cuda"
    one, two = (_saved_bytes(twin, batch_of(batch, n), precision, gpu) for n in (1, 2))
    slope = [b - a for a, b in zip(one, two)]
    base = [a - s for a, s in zip(one, slope)]
    # (total, inside blocks, block inputs, largest block, working): checkpointed = total - inside
    # + inputs + largest.
    ac = lambda v: v[0] - v[1] + v[2] + v[3]  # noqa: E731
    # The working memory is the peak's excess over the saved tensors, whose moment moves with the
    # micro-batch (the logits' gradient at backward's start, a fixed weight's gradient later): a
    # line that falls is taken as flat at its larger point, never extrapolated below it.
    working = max(0, two[4] - one[4])
    flops = max(0, slope[5])
    return Activations(
        base[0],
        slope[0],
        ac(base),
        ac(slope),
        True,
        one[4] - working,
        working,
        flops,
        base[1],
        slope[1],
    )


def saved_activation_bytes(
    module: torch.nn.Module, batch: Any, precision: str = "32-true", device_type: str = "cpu"
) -> int:
    """Bytes autograd saves for one `training_step` and backward on `batch` itself, on a CPU copy of
    `module` (weights excluded, as in `probe_activations`), plus for a GPU target the step's working
    memory at its peak: a direct measurement to check the probe's line against."""
    saved = _saved_bytes(_probe_copy(module, precision), batch, precision, device_type == "cuda")
    return saved[0] + saved[4]


def _probe_copy(module: torch.nn.Module, precision: str) -> torch.nn.Module:
    twin = build_copy(module, torch.device("cpu"))
    if precision == "bf16-true":
        twin.to(torch.bfloat16)
    stand_in(twin, module)
    return twin.train()


# Autograd nodes that cast, transpose or reshape without computing: walking back through them from a
# saved tensor reaches a parameter's AccumulateGrad when the tensor is only a weight in another
# dtype or layout.
_RELAYOUT = {
    "ToCopyBackward0",
    "TBackward0",
    "TransposeBackward0",
    "ViewBackward0",
    "UnsafeViewBackward0",
    "PermuteBackward0",
    "ExpandBackward0",
    "ReshapeAliasBackward0",
    "AliasBackward0",
}


def is_weight_derived(t: torch.Tensor) -> bool:
    """True when `t` is a parameter cast or re-laid out (autocast's half-precision copy of a weight,
    its transpose): memory the weight cache accounts for, not an activation."""
    fn = t.grad_fn
    for _ in range(8):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return True
        if type(fn).__name__ not in _RELAYOUT or not fn.next_functions:
            return False
        fn = fn.next_functions[0][0]
    return False


def _saved_bytes(
    module: torch.nn.Module, batch: Any, precision: str, gpu: bool = False
) -> tuple[int, int, int, int, int, int]:
    """One step's saved tensors: (all bytes, bytes saved inside blocks, bytes of block inputs,
    largest block, working bytes above the saved ones at the step's peak: `gpu` only, the step's
    FLOPs as torch's FlopCounterMode counts them). With `gpu`
    the step runs as the GPU's kernels would (`GpuKernels`), each parameter's gradient freed once
    accumulated (the strategies keep gradients elsewhere: the forecast's `grads`)."""
    params = list(module.parameters())
    weights = {p.untyped_storage()._cdata for p in params}
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    blocks = repeated_blocks(module)
    seen: set[int] = set()
    inside = [0] * len(blocks)
    state = {"block": None, "total": 0, "inputs": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        # one entry per storage: views and repeated saves of one tensor count once
        key = storage._cdata
        if key in seen or key in weights or is_weight_derived(t):
            return t
        seen.add(key)
        state["total"] += storage.nbytes()
        if state["block"] is not None:
            inside[state["block"]] += storage.nbytes()
        return t

    def enter(i: int):
        def hook(_module, args):
            state["block"] = i
            state["inputs"] += sum(a.nbytes for a in args if isinstance(a, torch.Tensor))

        return hook

    handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(lambda *_: state.update(block=None)) for b in blocks]
    if gpu:
        drop = lambda p: setattr(p, "grad", None)  # noqa: E731
        handles += [p.register_post_accumulate_grad_hook(drop) for p in params if p.requires_grad]
    autocast = (
        torch.autocast("cpu", dtype=half)
        if half is not None
        else torch.autocast("cpu", enabled=False)
    )
    live = LiveBytes(weights)
    kernels = GpuKernels() if gpu else None
    flops = FlopCounterMode(display=False)
    try:
        with flops, live if gpu else nullcontext(), kernels or nullcontext():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
                out = cast("UserModule", module).training_step(*step_args(module, batch))
            loss = out["loss"] if isinstance(out, dict) else out
            del out
            loss.float().backward()
            del loss
    finally:
        for h in handles:
            h.remove()
    working = max(0, live.peak - state["total"]) if gpu else 0
    inputs, largest = state["inputs"], max(inside, default=0)
    return state["total"], sum(inside), inputs, largest, working, flops.get_total_flops()
