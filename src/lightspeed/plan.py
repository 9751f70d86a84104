"""Plan a run before it starts: bytes per device for every strategy, the fastest one that fits, the largest
micro-batch.

    from lightspeed.plan import forecast, choose, auto_strategy
    rows = forecast(module, devices=2, precision="bf16-mixed", micro_batch=8, batch=next(iter(loader)))
    choice = choose(rows, device_bytes=80 * 2**30, host_bytes=500 * 2**30)   # prints the table, marks the choice
    lightspeed plan examples/train.py:Model --devices 2 --micro-batch 8 --device-memory 80GiB

What each term of a `Forecast` means (bytes on the busiest device, i.e. the largest rank):
- params: the weights this rank keeps between steps (a shard under ZeRO-3/FSDP; DeepSpeed's half-precision copy
  under bf16/fp16).
- grads: gradients held after backward, where `lightspeed.memory.measure` reads them: the full set for torch DDP
  and ZeRO-1, this rank's partition for FSDP and DeepSpeed (stage 1 too: it partitions at the step boundary).
- optim: optimizer states (e.g. AdamW's two moments and its step counters), sharded as the strategy shards them.
- master: DeepSpeed's separate fp32 copy of this rank's weight partition; torch strategies step the weights.
- activations: tensors autograd saves for backward at the target micro-batch, from a measured probe (below).
- buffers: transient framework memory at the backward peak: autocast's half-precision weight cache (torch mixed
  precision), FSDP's gathered units, DeepSpeed's reduce bucket, stage 1's unpartitioned gradients.
- host: host bytes per rank that offload keeps (fp32 master, moments and gradients; offloaded weights).

The model-state terms come from the parameter shapes (the model is built on the meta device, no memory), the
dtypes the strategy uses, and the optimizer's state layout. Activations come from one forward and backward run
at micro-batch 1 and 2 on CPU, recording the bytes of every tensor autograd saves (weights excluded), then
extrapolated linearly: a measured slope per sample, not a constant.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .config import PRECISION_ALIASES
from .errors import ConfigError
from .strategies.host_memory import offloaded_bytes_per_param

# ---------------------------------------------------------------------------------------------------- candidates

# The speed model, as one table: relative tokens/s per GPU against DDP (1.00). Calibrated by docs/benchmarks.md:
# the 2×H200 weak-scaling table (GPT 1.28B, micro-batch 4: ddp 44,561, deepspeed_stage_2 41,025, fsdp 27,951,
# deepspeed_stage_3 10,881 tok/s per GPU) and the 1×H200 table (stage 1 ≈ stage 2: 53,706 vs 53,841;
# fsdp_grad_op at the plain loop's speed: 58,804 vs 58,397). ddp_sharded and fsdp_grad_op were not timed on two
# GPUs: taken from their tier (ZeRO-1 is DDP plus a sharded step; grad-op communicates like ZeRO-2).
SPEED = {
    "single": 1.00, "ddp": 1.00,
    "ddp_sharded": 0.95, "deepspeed_stage_1": 0.92, "deepspeed_stage_2": 0.92, "fsdp_grad_op": 0.92,
    "fsdp": 0.63, "deepspeed_stage_3": 0.24,
}
# Activation checkpointing, from the 1×H200 table: stage 2 45,886 / 53,841; fsdp 43,649 / 57,983.
AC_SPEED = 0.80
# Offload, from the 1×H200 table: deepspeed_stage_2_offload 11,764 / 53,841. Offloaded candidates always rank
# below every on-device one (the order: no sharding > ZeRO-2 > ZeRO-3 > offload).
OFFLOAD_SPEED = 0.22

ADAM_STATES = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adadelta": 2, "Adagrad": 1,
               "Rprop": 2, "ASGD": 2, "LBFGS": 2, "DeepSpeedCPUAdam": 2, "FusedAdam": 2}
DS_REDUCE_BUCKET = 200_000_000  # DeepSpeed(reduce_bucket_size=...) default, in elements
NAMED = {"single", "ddp", "ddp_sharded", "fsdp", "fsdp_grad_op", "deepspeed_stage_1", "deepspeed_stage_2",
         "deepspeed_stage_3", "deepspeed_stage_1_offload", "deepspeed_stage_2_offload", "deepspeed_stage_3_offload"}


@dataclass(frozen=True)
class Candidate:
    """One way to run: a base strategy plus optimizer offload, parameter offload, activation checkpointing."""

    strategy: str
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: bool = False

    @property
    def name(self) -> str:
        """The Trainer's strategy string where one exists (`deepspeed_stage_3_offload`), else a descriptive one."""
        base = self.strategy
        if base.startswith("deepspeed") and self.offload_optimizer:
            base += "_offload" if self.offload_params or base != "deepspeed_stage_3" else "_offload_opt"
        elif self.offload_optimizer:
            base += "_offload"
        return base + ("+ac" if self.activation_checkpointing else "")

    @property
    def is_named(self) -> bool:
        """True when `name` is a string `Trainer(strategy=...)` accepts."""
        return self.name in NAMED

    @property
    def speed(self) -> float:
        return (SPEED[self.strategy] * (AC_SPEED if self.activation_checkpointing else 1.0)
                * (OFFLOAD_SPEED if self.offload_optimizer else 1.0))

    @property
    def is_deepspeed(self) -> bool:
        return self.strategy.startswith("deepspeed")


def build_candidates(devices: int, deepspeed: bool = True) -> list[Candidate]:
    """Every candidate for `devices` ranks: the plain strategies, each with activation checkpointing, and the
    offloaded ones (DeepSpeed stages 1-3 with the optimizer on the host, stage 3 also with the weights; FSDP with
    CPU offload of everything)."""
    plain = ["single"] if devices == 1 else ["ddp", "ddp_sharded", "fsdp_grad_op", "fsdp"]
    if deepspeed:
        plain += ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"]
    out = []
    for ac in (False, True):
        out += [Candidate(s, activation_checkpointing=ac) for s in plain]
        if deepspeed:
            out += [Candidate(f"deepspeed_stage_{k}", offload_optimizer=True, activation_checkpointing=ac)
                    for k in (1, 2, 3)]
            out.append(Candidate("deepspeed_stage_3", True, True, ac))
        if devices > 1:
            out.append(Candidate("fsdp", offload_optimizer=True, offload_params=True, activation_checkpointing=ac))
    return out


# ---------------------------------------------------------------------------------------------------- model facts

@dataclass(frozen=True)
class Activations:
    """Saved-for-backward bytes as `base + per_sample × micro_batch`, plain and with activation checkpointing."""

    base: float = 0.0
    per_sample: float = 0.0
    ac_base: float = 0.0
    ac_per_sample: float = 0.0
    is_probed: bool = False

    def at(self, micro_batch: int, checkpointed: bool = False) -> int:
        if checkpointed:
            return max(0, round(self.ac_base + self.ac_per_sample * micro_batch))
        return max(0, round(self.base + self.per_sample * micro_batch))


@dataclass(frozen=True)
class ModelFacts:
    """What the forecast needs from a model: parameter shapes per optimizer group, the optimizer's layout, the
    largest shard unit (a repeated block), and the activation probe."""

    groups: list[list[tuple[int, ...]]]
    states_per_param: int
    step_counters: bool
    optimizer: str
    unit_numel: int
    activations: Activations = field(default_factory=Activations)

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [s for g in self.groups for s in g]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def inspect_model(module: torch.nn.Module, batch: Any = None, precision: str = "32-true") -> ModelFacts:
    """Facts about `module` without touching it: a copy is built on the meta device (`configure_model`) to read
    parameter shapes and the optimizer `configure_optimizers` returns; with `batch`, another copy is built on CPU
    for the activation probe (`probe_activations`). Raises ConfigError if the module has no parameters."""
    from .optim import parse_optimizers

    meta = _built_copy(module, torch.device("meta"))
    params = list(dict.fromkeys(meta.parameters()))
    if not params:
        raise ConfigError(f"module={type(module).__name__} has no parameters after configure_model(): nothing to "
                          "plan for.")
    optimizers, _ = parse_optimizers(meta.configure_optimizers())
    opt = optimizers[0] if optimizers else None
    groups = ([[tuple(p.shape) for p in g["params"]] for g in opt.param_groups if g["params"]] if opt
              else [[tuple(p.shape) for p in params]])
    name = type(opt).__name__ if opt else "none"
    units = repeated_blocks(meta)
    unit_numel = max((sum(p.numel() for p in u.parameters()) for u in units), default=sum(p.numel() for p in params))
    activations = probe_activations(module, batch, precision) if batch is not None else Activations()
    return ModelFacts(groups, optimizer_states(opt), name in ADAM_STATES, name, unit_numel, activations)


def optimizer_states(opt: Any) -> int:
    """Per-parameter state tensors the optimizer keeps (each the parameter's size): AdamW 2 (3 with amsgrad),
    SGD 1 with momentum else 0, RMSprop 1 (+1 momentum, +1 centered); an unknown optimizer is taken as Adam's 2."""
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


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of every nn.ModuleList: the shard units FSDP picks by default and the blocks activation
    checkpointing wraps."""
    return [c for m in module.modules() if isinstance(m, torch.nn.ModuleList) for c in m]


def _built_copy(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of the user's module with `configure_model` run under `device`; the user's object is unchanged."""
    twin = copy.deepcopy(module)
    with device:
        twin.configure_model()
    return twin


def batch_of(sample: Any, n: int) -> Any:
    """`sample` (a tensor, or tuples/lists/dicts of them) with `n` rows: the first rows repeated as needed."""
    if isinstance(sample, torch.Tensor):
        reps = math.ceil(n / max(1, sample.shape[0]))
        return sample.repeat(reps, *([1] * (sample.dim() - 1)))[:n] if sample.dim() else sample
    if isinstance(sample, dict):
        return {k: batch_of(v, n) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(batch_of(v, n) for v in sample)
    return sample


class _ProbeTrainer:
    """Just enough of a Trainer for a probe's `training_step` to call `self.log` and read `callback_metrics`."""

    global_step = current_epoch = global_rank = 0
    is_global_zero = True
    device = torch.device("cpu")

    def __init__(self):
        from .metrics import MetricStore

        self.metrics = MetricStore()

    @property
    def callback_metrics(self) -> dict:
        return self.metrics.latest


def probe_activations(module: torch.nn.Module, batch: Any, precision: str = "32-true") -> Activations:
    """Runs `training_step` and backward on a CPU copy of `module` at micro-batch 1 and 2 (rows of `batch`,
    repeated if needed) and fits saved-for-backward bytes as a line in the micro-batch. Weights (and, under mixed
    precision, autocast's casts of them: counted as buffers) are not activations.

    With activation checkpointing only each block's input stays saved, plus one block's own tensors while it is
    recomputed: the probe attributes saved tensors to the repeated blocks (`repeated_blocks`) to derive that line.
    """
    twin = _built_copy(module, torch.device("cpu"))
    twin.trainer = _ProbeTrainer()
    if precision == "bf16-true":
        twin.to(torch.bfloat16)
    twin.train()
    one, two = (_saved_bytes(twin, batch_of(batch, n), precision) for n in (1, 2))
    slope = [b - a for a, b in zip(one, two)]
    base = [a - s for a, s in zip(one, slope)]
    # (total, inside blocks, block inputs, largest block): checkpointed = total - inside + inputs + largest.
    ac = lambda v: v[0] - v[1] + v[2] + v[3]  # noqa: E731
    return Activations(base[0], slope[0], ac(base), ac(slope), True)


def _saved_bytes(module: torch.nn.Module, batch: Any, precision: str) -> tuple[int, int, int, int]:
    """One step's saved tensors: (all bytes, bytes saved inside blocks, bytes of block inputs, largest block)."""
    weights = {p.untyped_storage()._cdata for p in module.parameters()}
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    weight_shapes = {tuple(p.shape) for p in module.parameters()}
    blocks = repeated_blocks(module)
    seen: set[int] = set()
    inside = [0] * len(blocks)
    state = {"block": None, "total": 0, "inputs": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata  # one entry per storage: views and repeated saves of one tensor count once
        is_weight_cast = half is not None and t.dtype == half and tuple(t.shape) in weight_shapes
        if key in seen or key in weights or is_weight_cast:
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
    autocast = torch.autocast("cpu", dtype=half) if half is not None else torch.autocast("cpu", enabled=False)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            out = module.training_step(batch, 0)
        loss = out["loss"] if isinstance(out, dict) else out
        loss.float().backward()
    finally:
        for h in handles:
            h.remove()
    return state["total"], sum(inside), state["inputs"], max(inside, default=0)


# ---------------------------------------------------------------------------------------------------- forecast

@dataclass(frozen=True)
class Forecast:
    """Bytes per device for one candidate (see the module doc for what each term means)."""

    candidate: Candidate
    params: int
    grads: int
    optim: int
    master: int
    activations: int
    buffers: int
    host: int = 0

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optim + self.master

    @property
    def device_total(self) -> int:
        return self.model_states + self.activations + self.buffers


def forecast(module: torch.nn.Module, devices: int, precision: str = "32-true", micro_batch: int = 1,
             batch: Any = None, candidates: list[Candidate] | None = None,
             facts: ModelFacts | None = None) -> list[Forecast]:
    """Forecasts every candidate (default: `build_candidates(devices)`) for `module` on `devices` ranks.

    Args:
        module: the user's Module, before `configure_model` (it is not changed: copies are built).
        devices: the world size. precision: a Trainer precision string. micro_batch: per device.
        batch: a sample training batch for the activation probe; without one, activations are 0 (not probed).
        facts: reuse an earlier `inspect_model` result (the probe then runs once).
    Raises:
        ConfigError: bad devices, precision or micro_batch, or a module without parameters.
    """
    precision = _check(devices, precision, micro_batch)
    facts = facts or inspect_model(module, batch, precision)
    candidates = candidates or build_candidates(devices, deepspeed=_has_deepspeed())
    return [forecast_candidate(c, facts, devices, precision, micro_batch) for c in candidates]


def forecast_candidate(c: Candidate, facts: ModelFacts, devices: int, precision: str, micro_batch: int) -> Forecast:
    """One candidate's bytes per device, from `facts`. The formulas follow what each backend allocates."""
    states, steps = facts.states_per_param, 4 if facts.step_counters else 0  # a step counter is an fp32 scalar
    total, count, half = facts.numel, len(facts.shapes), precision in ("bf16-mixed", "16-mixed")
    act = facts.activations.at(micro_batch, c.activation_checkpointing)
    if c.is_deepspeed:
        return _deepspeed(c, facts, devices, precision, act)
    w = 2 if precision == "bf16-true" else 4  # torch strategies keep weights, grads and states in one dtype
    compute = 2 if half else w
    if c.strategy in ("single", "ddp", "ddp_sharded"):
        owned, owned_count = (total, count) if c.strategy != "ddp_sharded" else zero1_partition(facts.groups, devices)
        # Autocast caches a half-precision copy of every weight for the forward; DDP's gradients are views into
        # its buckets (gradient_as_bucket_view=True), so the buckets add nothing.
        return Forecast(c, total * w, total * w, states * owned * w + steps * owned_count, 0, act,
                        total * 2 if half else 0)
    local = fsdp_local_numel(facts.shapes, devices)
    # Gathered units: the one computing and the one prefetched (fsdp), or every unit from forward to backward
    # (fsdp_grad_op); plus one unit's unsharded gradient before its reduce-scatter.
    gathered = (2 * facts.unit_numel if c.strategy == "fsdp" else total) * compute + facts.unit_numel * w
    states_bytes = (local * w, local * w, states * local * w + steps * count)
    if c.offload_optimizer:  # CPUOffloadPolicy: sharded weights, gradients and states live on the host
        return Forecast(c, 0, 0, 0, 0, act, gathered, sum(states_bytes))
    return Forecast(c, *states_bytes, 0, act, gathered)


def _deepspeed(c: Candidate, facts: ModelFacts, devices: int, precision: str, act: int) -> Forecast:
    stage = int(c.strategy[-1])
    states, steps = facts.states_per_param, 4 if facts.step_counters else 0
    total = facts.numel
    wd = 4 if precision == "32-true" else 2  # DeepSpeed's bf16/fp16 modes keep the module's weights and grads half
    if stage == 3:  # every parameter partitioned on its own, padded to a multiple of the world size
        part = sum(math.ceil(math.prod(s) / devices) for s in facts.shapes)
        params = part * wd
    else:  # one flat buffer per parameter group, padded to 2 × world size (DeepSpeed's alignment), then split
        part = sum(_round_up(sum(math.prod(s) for s in g), 2 * devices) // devices for g in facts.groups)
        params = total * wd
    bucket = min(DS_REDUCE_BUCKET, total) * wd
    # Stage 1 keeps whole gradients until the boundary; stage 3 holds a gathered block and the prefetched next.
    buffers = bucket + {1: (total - part) * wd, 2: 0, 3: 2 * facts.unit_numel * wd}[stage]
    grads, optim, master = part * wd, states * part * 4 + steps * len(facts.groups), part * 4
    if not c.offload_optimizer:
        return Forecast(c, params, grads, optim, master, act, buffers)
    host = offloaded_bytes_per_param(stage, "cpu", "cpu" if c.offload_params else None) * part
    return Forecast(c, 0 if c.offload_params else params, 0, 0, 0, act, buffers, host)


def zero1_partition(groups: list[list[tuple[int, ...]]], devices: int) -> tuple[int, int]:
    """(numel, tensor count) of the busiest rank under torch's ZeroRedundancyOptimizer, which hands whole
    parameters, largest first within each group, to the rank with the fewest elements so far."""
    sizes, counts = [0] * devices, [0] * devices
    for group in groups:
        for numel in sorted((math.prod(s) for s in group), reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += numel
            counts[rank] += 1
    busiest = max(range(devices), key=lambda r: sizes[r])
    return sizes[busiest], counts[busiest]


def fsdp_local_numel(shapes: list[tuple[int, ...]], devices: int) -> int:
    """Elements rank 0 (the busiest) holds under FSDP2, which splits each parameter's first dimension into
    chunks of ceil(rows / world size)."""
    return sum(min(math.ceil(s[0] / devices), s[0]) * math.prod(s[1:]) if s else 1 for s in shapes)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _has_deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _check(devices: int, precision: str, micro_batch: int) -> str:
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ConfigError(f"devices={devices!r} is not valid: expected an integer ≥ 1.")
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
        raise ConfigError(f"micro_batch={micro_batch!r} is not valid: expected an integer ≥ 1.")
    if precision not in PRECISION_ALIASES:
        raise ConfigError(f"precision={precision!r} is not valid: use one of '32-true', 'bf16-mixed', '16-mixed', "
                          "'bf16-true'.")
    return PRECISION_ALIASES[precision]
