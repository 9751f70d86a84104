"""What the memory plan needs to know about a Module, found without touching it: parameter shapes
per optimizer group and the optimizer's state layout (from a copy built on the meta device), and the
activations one step saves for backward (measured on a CPU copy at micro-batch 1 and 2, fitted as a
line). Used by `lightspeed.plan.forecast`.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from importlib.util import find_spec
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

import torch

from lightspeed.core.metrics import MetricStore
from lightspeed.core.optimizer import parse_optimizers
from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import repeated_blocks
from lightspeed.utilities.signature import accepts

if TYPE_CHECKING:
    from lightspeed.core.module import Module as UserModule
    from lightspeed.specs import TrainerView

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
    checkpointing."""

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

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        return [s for g in self.groups for s in g]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def inspect_model(
    module: torch.nn.Module, batch: Any = None, precision: str = "32-true"
) -> ModelFacts:
    """Facts about `module` without touching it: a copy is built on the meta device
    (`configure_model`) to read parameter shapes and the optimizer `configure_optimizers` returns;
    with `batch`, another copy is built on CPU for the activation probe (`probe_activations`; not
    under manual optimization, whose `training_step` steps optimizers the copy does not have).
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
    activations = probe_activations(module, batch, precision) if probed else Activations()
    engine = Activations()
    if probed and precision in ("bf16-mixed", "16-mixed") and find_spec("deepspeed"):
        # DeepSpeed's half-precision modes run the model in that dtype, without autocast.
        try:
            engine = probe_activations(module, cast_floats(batch, torch.bfloat16), "bf16-true")
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
    )


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """`value` with its floating-point tensors in `dtype` (as DeepSpeed casts a batch)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cast_floats(v, dtype) for v in value)
    return value


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


def build_copy(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of the user's module with `configure_model` run under `device`; the user's object is
    unchanged. On the meta device the copy's tensors are meta tensors of the same shapes from the
    start: planning a model built in `__init__` copies no weights."""
    memo: dict[int, Any] = {}
    if device.type == "meta":
        for p in module.parameters():
            memo[id(p)] = torch.nn.Parameter(p.detach().to("meta"), p.requires_grad)
        for b in module.buffers():
            memo[id(b)] = b.detach().to("meta")
    twin = copy.deepcopy(module, memo)
    with device:
        cast("UserModule", twin).configure_model()  # a copy of the user's Module
    return twin


def batch_of(sample: Any, n: int) -> Any:
    """`sample` (a tensor, or tuples/lists/dicts of them) with `n` rows: the first rows repeated as
    needed."""
    if isinstance(sample, torch.Tensor):
        reps = math.ceil(n / max(1, sample.shape[0]))
        return sample.repeat(reps, *([1] * (sample.dim() - 1)))[:n] if sample.dim() else sample
    if isinstance(sample, dict):
        return {k: batch_of(v, n) for k, v in sample.items()}
    if isinstance(sample, (list, tuple)):
        return type(sample)(batch_of(v, n) for v in sample)
    return sample


class ProbeTrainer:
    """The Trainer a probe's copy of the module sees, so that its `training_step` runs as written: a
    metric store of its own (what it logs goes nowhere), step and epoch 0, rank 0, the CPU, and a
    `strategy` holding the copy's own optimizers and schedulers (`self.optimizers()`,
    `self.lr_schedulers()`: a step that logs its learning rate). Anything else (`max_steps`,
    `world_size`, ...) is read from the real Trainer, `trainer`."""

    global_step = current_epoch = global_rank = 0
    is_global_zero = True
    device = torch.device("cpu")

    def __init__(self, trainer: Any = None, strategy: Any = None):
        self.metrics, self._trainer = MetricStore(), trainer
        self.strategy = (
            strategy if strategy is not None else SimpleNamespace(optimizers=[], schedulers=[])
        )

    @property
    def callback_metrics(self) -> dict:
        return self.metrics.latest

    def __getattr__(self, name: str) -> Any:
        real = self.__dict__.get("_trainer")
        if real is None or name.startswith("_"):
            raise AttributeError(f"the planner's stand-in Trainer has no attribute {name!r}")
        return getattr(real, name)


def stand_in(twin: torch.nn.Module, module: torch.nn.Module, strategy: Any = None) -> ProbeTrainer:
    """Gives `twin` (a copy of `module`) a ProbeTrainer over `module`'s real Trainer, kept alive by
    the twin (a Module holds its Trainer by weak reference). Its `strategy`: the one given (a
    micro-batch trial's, set up later), else the twin's own optimizers and schedulers, built now
    from its `configure_optimizers`."""
    probe = ProbeTrainer(getattr(module, "_trainer", None), strategy)
    object.__setattr__(twin, "_probe_trainer", probe)
    user = cast("UserModule", twin)  # a copy of the user's Module
    user.trainer = cast("TrainerView", probe)  # the real Trainer's view, through __getattr__
    if strategy is None:
        opts, scheds = parse_optimizers(user.configure_optimizers())
        probe.strategy = SimpleNamespace(optimizers=opts, schedulers=scheds)
    return probe


def probe_activations(
    module: torch.nn.Module, batch: Any, precision: str = "32-true"
) -> Activations:
    """Runs `training_step` and backward on a CPU copy of `module` at micro-batch 1 and 2 (rows of
    `batch`, repeated if needed) and fits saved-for-backward bytes as a line in the micro-batch.
    Weights (and, under mixed precision, autocast's casts of them: counted as buffers) are not
    activations.

    With activation checkpointing only each block's input stays saved, plus one block's own tensors
    while it is recomputed: the probe attributes saved tensors to the repeated blocks
    (`repeated_blocks`) to derive that line.
    """
    twin = _probe_copy(module, precision)
    one, two = (_saved_bytes(twin, batch_of(batch, n), precision) for n in (1, 2))
    slope = [b - a for a, b in zip(one, two)]
    base = [a - s for a, s in zip(one, slope)]
    # (total, inside blocks, block inputs, largest block): checkpointed = total - inside + inputs +
    # largest.
    ac = lambda v: v[0] - v[1] + v[2] + v[3]  # noqa: E731
    return Activations(base[0], slope[0], ac(base), ac(slope), True)


def saved_activation_bytes(module: torch.nn.Module, batch: Any, precision: str = "32-true") -> int:
    """Bytes autograd saves for one `training_step` and backward on `batch` itself, on a CPU copy of
    `module` (weights excluded, as in `probe_activations`): a direct measurement to check the
    probe's line against."""
    return _saved_bytes(_probe_copy(module, precision), batch, precision)[0]


def _probe_copy(module: torch.nn.Module, precision: str) -> torch.nn.Module:
    twin = build_copy(module, torch.device("cpu"))
    if precision == "bf16-true":
        twin.to(torch.bfloat16)
    stand_in(twin, module)
    return twin.train()


# Autograd nodes that cast, transpose or reshape without computing: walking back through them from a
# saved
# tensor reaches a parameter's AccumulateGrad when the tensor is only a weight in another dtype or
# layout.
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


def _saved_bytes(module: torch.nn.Module, batch: Any, precision: str) -> tuple[int, int, int, int]:
    """One step's saved tensors: (all bytes, bytes saved inside blocks, bytes of block inputs,
    largest block)."""
    weights = {p.untyped_storage()._cdata for p in module.parameters()}
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    blocks = repeated_blocks(module)
    seen: set[int] = set()
    inside = [0] * len(blocks)
    state = {"block": None, "total": 0, "inputs": 0}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = (
            storage._cdata
        )  # one entry per storage: views and repeated saves of one tensor count once
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
    autocast = (
        torch.autocast("cpu", dtype=half)
        if half is not None
        else torch.autocast("cpu", enabled=False)
    )
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            out = cast("UserModule", module).training_step(*step_args(module, batch))
        loss = out["loss"] if isinstance(out, dict) else out
        loss.float().backward()
    finally:
        for h in handles:
            h.remove()
    return state["total"], sum(inside), state["inputs"], max(inside, default=0)


def plain_cuda_step(module: torch.nn.Module, batch: Any, n: int, precision: str) -> None:
    """One forward, backward and optimizer step of a fresh copy of `module` on the current CUDA
    device."""
    device = torch.device("cuda", torch.cuda.current_device())
    twin = build_copy(module, device)
    if precision == "bf16-true":
        twin.to(torch.bfloat16)
    optimizers = stand_in(twin, module).strategy.optimizers
    half = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    data = move_to(batch_of(batch, n), device)
    try:
        with torch.autocast("cuda", dtype=half, enabled=half is not None):
            out = cast("UserModule", twin).training_step(*step_args(twin, data))
        (out["loss"] if isinstance(out, dict) else out).backward()
        for opt in optimizers:
            opt.step()
        torch.cuda.synchronize(device)
    finally:
        del twin, optimizers, data


def steps_itself(module: torch.nn.Module) -> bool:
    """Manual optimization: `training_step` runs its own backward and steps its optimizers, which a
    probe's copy cannot do, so the planner neither probes it nor runs trial steps of it."""
    return not getattr(module, "automatic_optimization", True)


def step_args(module: torch.nn.Module, batch: Any) -> tuple:
    """`training_step`'s arguments for a probe's step, as the loop passes them: Lightning accepts
    `training_step(self, batch)` without `batch_idx`."""
    step = cast("UserModule", module).training_step
    return (batch, 0) if accepts(step, 2, "batch_idx") else (batch,)


def move_to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: move_to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(move_to(v, device) for v in value)
    return value
