"""Fully sharded data parallel with torch's FSDP2 (`fully_shard`): parameters, gradients and
optimizer state sharded.

    Trainer(strategy="fsdp", devices=2)            # ZeRO-3: parameters resharded after each forward
    Trainer(strategy="fsdp_grad_op", devices=2)    # ZeRO-2-like: parameters stay gathered from
    forward to backward Trainer(strategy=FSDP(shard_classes=[Block], cpu_offload=True,
    activation_checkpointing=[Block]), devices=2)

The model is built on the meta device (`configure_model`), sharded block by block, then only the
local shards are materialised. When the whole model fits in host memory, rank 0 also builds it
normally on CPU with the same random numbers, and the shards are filled from it: the same seed gives
the same initial weights as a single-device run.

Checkpoints are torch.distributed.checkpoint (DCP) directories: every rank writes its shards, and
loading reshards to any world size. `full_state_dict(path)` merges one offline into a plain state
dict (`lightspeed convert`).
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor

import lightspeed.strategies.lightning as lightning
from lightspeed.checkpoint.io import DCP_DIR, FSDP_EXTRA
from lightspeed.checkpoint.layouts import Portable, read_portable, write_fsdp
from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import apply_compile, build_optimizers_fast
from lightspeed.perf.precision import Precision, StepGate, optimizer_step
from lightspeed.runtime.distributed import barrier, destroy_process_group, init_process_group
from lightspeed.runtime.launch import DistInfo
from lightspeed.runtime.memory import measure_module
from lightspeed.specs import RunSpec, StepStats
from lightspeed.strategies.common import (
    apply_activation_checkpointing,
    checkpoint_layout,
    configure_with_plain_twin,
    fork_of,
    options_of,
)
from lightspeed.strategies.tensor_parallel import apply_tensor_parallel, build_mesh, check_degree

STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


@dataclass
class FSDP:
    """FSDP2 sharding.

    Args:
        reshard_after_forward: True frees each block's gathered parameters after its forward and
        gathers them
            again for the backward (ZeRO-3, least memory). False keeps them gathered until the
            backward (ZeRO-2 communication; at rest between steps the parameters are sharded either
            way).
        shard_classes: module classes that become shard units (each instance is one `fully_shard`
        call).
            Default: the repeated blocks, i.e. the classes of the children of every `nn.ModuleList`
            in the model (GPT's `Block`). The root module is always a unit too and holds the
            remaining parameters.
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU
        (CPUOffloadPolicy); the
            optimizer steps on CPU.
        activation_checkpointing: block classes whose activations are recomputed in the backward.
        tp: tensor-parallel degree (strategies/tensor_parallel.py): each group of `tp` consecutive
            ranks splits the attention and MLP projections, and FSDP shards over the world size / tp
            data-parallel ranks (a 2-D mesh). 1: no tensor parallelism.
        tp_plan: with tp > 1, module path (wildcards allowed) -> style name ("colwise", "rowwise",
            "fused_colwise", ...: `tensor_parallel.STYLES`), instead of the model's own plan.
    """

    reshard_after_forward: bool = True
    shard_classes: list[type] | None = None
    cpu_offload: bool = False
    activation_checkpointing: list[type] | None = None
    tp: int = 1
    tp_plan: dict[str, str] | None = None
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        for what in ("reshard_after_forward", "cpu_offload"):
            if not isinstance(getattr(self, what), bool):
                raise ConfigError(
                    f"FSDP {what}={getattr(self, what)!r} is not valid: use True or False."
                )
        for what in ("shard_classes", "activation_checkpointing"):
            value = getattr(self, what)
            if value is not None and (
                not isinstance(value, (list, tuple))
                or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in value)
            ):
                raise ConfigError(
                    f"FSDP {what}={value!r} is not valid: use None or a list of nn.Module classes "
                    "(the classes themselves, e.g. [Block], not their names)."
                )
        check_degree(self.tp, None, "FSDP")
        self.name = "fsdp" if self.reshard_after_forward else "fsdp_grad_op"
        self.name += f"_tp{self.tp}" if self.tp > 1 else ""
        self._full_state: dict[str, torch.Tensor] | None = None
        self._twin_buffers: dict[str, torch.Tensor] = {}
        self._needs_init = self._is_from_full_state = False
        self.module: Any = None  # the user's Module, sharded in place by `setup`
        self.dist: DistInfo | None = None
        self.device: Any = None  # a torch.device, once connected
        self.is_fork = False

    # What others may read (strategies/base.py), and Lightning's names for it.
    @property
    def model(self) -> Any:
        return self.module

    @property
    def layout(self) -> str | None:
        return checkpoint_layout(self)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """The ranks of one TP group (`tp` consecutive ranks) share their batches."""
        if self.dist is None:
            return None
        return {"num_replicas": self.dist.world_size // self.tp, "rank": self.dist.rank // self.tp}

    root_device, lightning_module = lightning.root_device, lightning.lightning_module
    world_size, global_rank = lightning.world_size, lightning.global_rank
    local_rank, is_global_zero = lightning.local_rank, lightning.is_global_zero
    barrier, broadcast, reduce = lightning.COLLECTIVES

    def measure(self) -> dict[str, int]:
        return measure_module(self.module, self.optimizers)

    def settings(self) -> dict[str, Any]:
        return options_of(self)

    def fork(self) -> FSDP:
        return fork_of(self)

    def check(self, spec: RunSpec) -> None:
        # Manual optimization is plain torch here: each manual_backward reduce-scatters (the loop's
        # window is one
        # batch, so sync_grads is always on) and the user's opt.step() updates the local shards.
        # Under 16-mixed
        # the gradients would still carry the loss scale, which only the loop's own step removes.
        if not spec.automatic_optimization and spec.precision == "16-mixed":
            raise ConfigError(
                "automatic_optimization=False with precision='16-mixed' is not supported by "
                "strategy "
                f"{self.name!r}: the sharded gradients carry the loss scale, which only automatic "
                "optimization removes. Use 'bf16-mixed' or '32-true'."
            )

    def connect(self, spec: RunSpec, dist_info: DistInfo, device: torch.device) -> None:
        self.spec, self.dist, self.device = spec, dist_info, device
        # The fp16 loss scaler, agreeing on overflows across ranks; no autocast (FSDP's
        # MixedPrecisionPolicy).
        self.precision = Precision(spec.precision, device.type, sharded_grads=True)
        init_process_group(
            dist_info, device, spec.timeout_s
        )  # a group of one for one process: FSDP needs it

    def configure_model(self, module: nn.Module) -> None:
        """Builds the model on the meta device; rank 0 also builds it on CPU when it fits (see the
        module doc)."""

        def on_meta() -> None:
            with torch.device("meta"):
                cast(Any, module).configure_model()

        def tensors() -> list[torch.Tensor]:
            return list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())

        def nbytes() -> int:
            return sum(t.numel() * t.element_size() for t in tensors())

        # A model built in __init__ is already materialised (identically on every rank, same seed):
        # no twin.
        built, plain = configure_with_plain_twin(
            module,
            on_meta,
            lambda: any(t.is_meta for t in tensors()) and _fits_in_host_memory(nbytes()),
        )
        self._needs_init = any(t.is_meta for t in tensors())
        self._is_from_full_state = built
        if built and plain is not None:
            self._full_state = plain.state_dict()
            self._twin_buffers = dict(plain.named_buffers())
        elif self._needs_init and not built and dist.get_rank() == 0:
            print(
                f"FSDP: the full model ({nbytes() / 2**30:.1f} GiB) does not fit in host memory; "
                "initialising "
                "each shard locally with reset_parameters(), so weights differ from a "
                "single-device run.",
                flush=True,
            )

    def setup(
        self, module: nn.Module, build_optimizers, micro_batch_size: int | None = None
    ) -> None:
        if self.module is None:
            self.module = module
            self._shard(module)
        if build_optimizers is not None:
            # An evaluation before fit leaves the parameters gathered when
            # reshard_after_forward=False (no
            # backward reshards them): shard them again, since the optimizer must hold the DTensor
            # shards.
            for m in module.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
            self.optimizers, self.schedulers = build_optimizers_fast(
                build_optimizers,
                self.spec,
                backend="torch",
                device_type=self.device.type,
                is_global_zero=dist.get_rank() == 0,
                # torch's fused Adam rejects the sharded fp16 scaler's found_inf (shape [1], not
                # []): as written.
                fusable=self.spec.precision != "16-mixed",
            )

    def _shard(self, module: nn.Module) -> None:
        self.precision.convert_module(module)  # bf16-true: bf16 weights and optimizer states
        if self.tp > 1:  # TP -> activation checkpointing -> compile -> FSDP (torchtitan's order)
            mesh_2d = build_mesh(self.device.type, dist.get_world_size(), self.tp)
            plan = apply_tensor_parallel(module, mesh_2d["tp"], self.tp_plan)
            if dist.get_rank() == 0:
                print("\n".join(plan), flush=True)  # the plan table
        if self.activation_checkpointing:
            apply_activation_checkpointing(module, self.activation_checkpointing)
        if (
            self.spec.compile
        ):  # after activation checkpointing, before sharding (torchtitan's order)
            apply_compile(module, options=self.spec.compile)
        ties = find_tied_parameters(module)
        device = torch.device("cpu") if self.cpu_offload else self.device
        if not self._needs_init:
            module.to(device)
        mesh = (
            mesh_2d["dp"]  # FSDP shards over the data-parallel ranks; TP DTensors become 2-D
            if self.tp > 1
            else init_device_mesh(self.device.type, (dist.get_world_size(),))
        )
        units = find_shard_units(module, self.shard_classes)
        if not self.spec.automatic_optimization:
            units += find_child_units(module, units)
        apply_fsdp(
            module,
            units,
            mesh,
            self.reshard_after_forward,
            build_mp_policy(self.spec.precision),
            self.cpu_offload
            and CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
            or OffloadPolicy(),
        )
        if self._needs_init:
            module.to_empty(device=device)  # allocates the local shards only
            apply_ties(
                module, ties
            )  # to_empty gives each tied name its own tensor; FSDP manages the first
            self._init_shards(module)
        for name in STEP_METHODS:
            apply_forward_method(module, name)

    def _init_shards(self, module: nn.Module) -> None:
        if self._is_from_full_state:
            # Rank 0 holds the full state dict; torch broadcasts it and each rank keeps its shards.
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            # (torch annotates a dict[str, ValueType] where a read-only Mapping would do)
            full_state = cast("dict[str, Any]", self._full_state or {})
            set_model_state_dict(module, full_state, options=options)
            # Non-persistent buffers (rotary embeddings' inv_freq) are in no state dict: to_empty
            # left them
            # uninitialised. Rank 0's plain build has them; every rank takes its values.
            persistent = set(module.state_dict())
            for name, buf in module.named_buffers():
                if name not in persistent:
                    if dist.get_rank() == 0:
                        buf.copy_(self._twin_buffers[name])
                    dist.broadcast(buf, src=0)
            self._full_state, self._twin_buffers = None, {}
            return
        for m in module.modules():  # the fallback: shard-local init, drawn from DTensor's own RNG
            if hasattr(m, "reset_parameters"):
                cast(Any, m).reset_parameters()

    def forward(self, step, *args, sync_grads: bool = True):
        # Off the boundary gradients accumulate unsharded and un-reduced; reduce-scatter only at the
        # last one.
        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(sync_grads)
        return step(*args)  # mixed precision is FSDP's MixedPrecisionPolicy, not autocast

    def backward(self, loss, **options) -> None:
        self.precision.backward(loss, **options)

    def step(self, should_step: StepGate | None = None) -> StepStats:
        return optimizer_step(
            self.optimizers,
            self.precision,
            self.spec,
            total_norm=total_norm_sharded,
            should_step=should_step,
        )

    def save(self, path: Path) -> None:
        state: dict[str, Any] = {"model": get_model_state_dict(self.module)}
        if self.optimizers:
            state["optim"] = get_optimizer_state_dict(self.module, self.optimizers)
        dcp.save(state, checkpoint_id=str(path / DCP_DIR))
        if dist.get_rank() == 0:
            torch.save({"precision": self.precision.state_dict()}, path / FSDP_EXTRA)
        barrier()

    def load(
        self, path: Path, with_optimizer: bool = True, portable: Portable | None = None
    ) -> None:
        if (
            portable is not None
        ):  # another strategy's checkpoint, in the neutral form (strategies/portable.py)
            write_fsdp(portable, self.module, self.optimizers, with_optimizer, path)
            self.precision.load_state_dict(portable.get("precision", {}))
            return
        # DCP loads in place into tensors shaped like this run's shards, resharding from the saved
        # layout.
        state: dict[str, Any] = {"model": get_model_state_dict(self.module)}
        if with_optimizer and self.optimizers:
            state["optim"] = get_optimizer_state_dict(self.module, self.optimizers)
        dcp.load(state, checkpoint_id=str(path / DCP_DIR))
        set_model_state_dict(self.module, state["model"])
        if "optim" in state:
            set_optimizer_state_dict(self.module, self.optimizers, state["optim"])
        if with_optimizer and (path / FSDP_EXTRA).exists():
            self.precision.load_state_dict(
                torch.load(path / FSDP_EXTRA, weights_only=False).get("precision", {})
            )

    def teardown(self) -> None:
        if not self.is_fork:  # a fork's group is its parent's
            destroy_process_group()


class FSDPStrategy(abc.ABC):
    """Lightning's `FSDPStrategy`: `FSDPStrategy(sharding_strategy=..., cpu_offload=...,
    activation_checkpointing_policy=..., auto_wrap_policy=...)` takes Lightning's keywords
    (`lightning.fsdp_options`) and returns an `FSDP`; every FSDP is an instance, also one built from
    a string ("fsdp", "fsdp_grad_op")."""

    def __new__(cls, *args: Any, **kwargs: Any) -> FSDP:  # type: ignore[misc]
        return FSDP(**lightning.fsdp_options(*args, **kwargs))


FSDPStrategy.register(FSDP)


def apply_forward_method(module: nn.Module, name: str) -> None:
    """Registers the step method `name` of a sharded `module` with FSDP, so that it runs FSDP's root
    pre/post-forward (lazy init, gathering the root's parameters) like a forward: the Trainer calls
    `module.training_step(...)`, not `module(...)`. Nothing for a missing or None method.

    torch's wrapper copies the metadata of the *bound* method, so a signature read through it loses
    the user's first parameter (`training_step(self, batch, i)` would read as `(i)` and the loop
    would pass `batch` alone). The wrapper is given the user's own signature back."""
    user = getattr(module, name, None)
    if not (callable(user) and isinstance(module, FSDPModule)):
        return
    register_fsdp_forward_method(module, name)
    wrapper = getattr(module, name).__func__
    signature = inspect.signature(user)  # bound: without `self`; the wrapper is bound too
    first = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    wrapper.__signature__ = signature.replace(parameters=[first, *signature.parameters.values()])


def find_shard_units(module: nn.Module, classes: list[type] | None) -> list[nn.Module]:
    """Returns the submodules that become shard units, children before parents (the order
    fully_shard needs).

    With `classes` None, the units are the repeated blocks: instances of the classes of the children
    of every nn.ModuleList. A model without a ModuleList gets no units besides the root.

    Raises:
        ConfigError: if `classes` names a class not in the model, or the units hold no parameters at
        all.
    """
    if classes is None:
        classes = [type(c) for m in module.modules() if isinstance(m, nn.ModuleList) for c in m]
    kinds = tuple(dict.fromkeys(classes))
    units = [m for m in module.modules() if m is not module and isinstance(m, kinds)]
    candidates = sorted(
        {
            type(c).__name__
            for m in module.modules()
            if isinstance(m, (nn.ModuleList, nn.Sequential))
            for c in m
        }
    )
    if kinds and not units:
        raise ConfigError(
            f"FSDP(shard_classes={[c.__name__ for c in kinds]}) is not valid: no submodule of "
            f"{type(module).__name__} has those classes. Candidate block classes: "
            f"{', '.join(candidates) or 'none'}."
        )
    if units and not any(True for u in units for _ in u.parameters()):
        raise ConfigError(
            f"FSDP shard units {sorted({type(u).__name__ for u in units})} hold no parameters, so "
            "there is nothing to shard in them. Pass shard_classes= naming blocks that own "
            "weights "
            f"(candidates: {', '.join(candidates) or 'none'})."
        )
    if not any(True for _ in module.parameters()):
        raise ConfigError(
            f"FSDP got {type(module).__name__} with no parameters: nothing to shard or train."
        )
    return units[::-1]


def find_child_units(
    module: nn.Module, units: list[nn.Module]
) -> list[nn.Module | list[nn.Module]]:
    """Under manual optimization, the root's children (a GAN's generator and discriminator) become
    units too.

    The user's `training_step` runs backward and `opt.step()` several times and calls children
    directly (`self.discriminator(x)`). As units, each child gathers its parameters for its own
    forward and backward only, so between them the module holds the sharded parameters the
    optimizers hold: `toggle_optimizer` matches them by identity, and no backward reshards
    parameters that a later call in the same step still uses (the root's would be). Containers
    (ModuleList, ModuleDict) are never called, so their children count instead; children that share
    a parameter (tied weights) are one unit; a child whose parameters all lie in `units` is skipped.

    Raises:
        ConfigError: if the root holds trainable parameters of its own (they would stay gathered for
        the whole
            step, out of `toggle_optimizer`'s reach, and resharded by the first backward).
    """
    sharded = {id(p) for u in units for p in u.parameters()}
    children, todo = [], list(module.children())
    while todo:
        child = todo.pop(0)
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            todo[:0] = list(child.children())
        elif child not in units and any(id(p) not in sharded for p in child.parameters()):
            children.append(child)
    own = [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]
    if own:
        raise ConfigError(
            f"FSDP with automatic_optimization=False: {type(module).__name__} holds parameters of "
            f"its own ({', '.join(own)}), which cannot be sharded apart from the step. Move them "
            "into a child module (each child is sharded as its own unit)."
        )
    groups: list[list[nn.Module]] = []  # children joined by a shared (tied) parameter
    for child in children:
        ids = {id(p) for p in child.parameters()}
        joined = [g for g in groups if any(id(p) in ids for m in g for p in m.parameters())]
        groups = [g for g in groups if g not in joined] + [[m for g in joined for m in g] + [child]]
    return [g[0] if len(g) == 1 else g for g in groups]


def apply_fsdp(
    module: nn.Module,
    units: Sequence[nn.Module | list[nn.Module]],
    mesh,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
) -> None:
    """Calls `fully_shard` on each unit (children first; a list of modules is one unit), then on the
    root, which takes the rest."""
    kwargs: dict[str, Any] = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for unit in units:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(module, reshard_after_forward=reshard_after_forward, **kwargs)


def build_mp_policy(precision: str) -> MixedPrecisionPolicy:
    """bf16-mixed / 16-mixed: compute in half precision, keep the shards in fp32. bf16-mixed
    reduce-scatters the gradients in bf16, as DeepSpeed's bf16 mode and Lightning's FSDP bf16-mixed
    do: the backward computed them in bf16, and fp32 traffic cost 2-GPU scaling (0.87 against 0.99
    in bf16, docs/benchmarks.md). 16-mixed reduces in fp32 (fp16 sums can overflow)."""
    match precision:
        case "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        case "16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
        case _:
            return MixedPrecisionPolicy()  # 32-true, and bf16-true whose weights are already bf16


def total_norm_sharded(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global norm of sharded (DTensor) gradients, as a plain tensor. Collective.

    Each rank's norm covers its shards only; `full_tensor()` reduces the partial norms across
    ranks."""
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    return total.full_tensor() if isinstance(total, DTensor) else total


def find_tied_parameters(module: nn.Module) -> list[list[str]]:
    """Groups of parameter names that share one tensor (e.g. GPT's lm_head.weight and
    wte.weight)."""
    groups: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def apply_ties(module: nn.Module, ties: list[list[str]]) -> None:
    """Makes every name in each group refer to the first name's parameter again."""
    for first, *others in ties:
        param = module.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(owner), leaf, param)


def _fits_in_host_memory(nbytes: int) -> bool:
    import psutil

    return 2 * nbytes < psutil.virtual_memory().available  # the CPU copy plus its state dict


def full_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """Merges the model part of an FSDP checkpoint directory into one state dict on CPU, offline (no
    process group), keyed like the user's module's `state_dict()`; tied weights appear under each of
    their names.

    Raises:
        ConfigError: if `path` holds no DCP checkpoint.
    """
    return read_portable(Path(path), "fsdp", with_optimizer=False)[
        "model"
    ]  # DCP's offline load of every shard
