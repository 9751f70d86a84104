"""Fully sharded data parallel with torch's FSDP2 (`fully_shard`): parameters, gradients and
optimizer state sharded.

    Trainer(strategy="fsdp", devices=2)            # ZeRO-3: parameters resharded after each forward
    Trainer(strategy="fsdp_grad_op", devices=2)    # ZeRO-2-like: gathered from forward to backward
    Trainer(strategy=FSDP(shard_classes=[Block], cpu_offload=True,
                          activation_checkpointing=[Block]), devices=2)

The model is built on the meta device (`configure_model`), sharded block by block, then only the
local shards are materialised. When the whole model fits in host memory, rank 0 also builds it
normally on CPU with the same random numbers, and the shards are filled from it: the same seed gives
the same initial weights as a single-device run.

Checkpoints are torch.distributed.checkpoint (DCP) directories: every rank writes its shards, and
loading reshards to any world size. `full_state_dict(path)` merges one offline into a plain state
dict (`lightspeed convert`). How the model is cut into shard units, and the other FSDP2 pieces
`_shard` composes, are in strategies/fsdp_sharding.py.
"""

from __future__ import annotations

import abc
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
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy

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
from lightspeed.strategies.fsdp_sharding import (
    STEP_METHODS,
    apply_forward_method,
    apply_fsdp,
    apply_ties,
    build_mp_policy,
    find_child_units,
    find_shard_units,
    find_tied_parameters,
    total_norm_sharded,
)
from lightspeed.strategies.tensor_parallel import apply_tensor_parallel, build_mesh, check_degree


@dataclass
class FSDP:
    """FSDP2 sharding.

    Args:
        reshard_after_forward: True frees each block's gathered parameters after its forward and
            gathers them again for the backward (ZeRO-3, least memory). False keeps them gathered
            until the backward (ZeRO-2 communication; at rest between steps the parameters are
            sharded either way).
        shard_classes: module classes that become shard units (each instance is one `fully_shard`
            call). Default: the repeated blocks, i.e. the classes of the children of every
            `nn.ModuleList` in the model (GPT's `Block`). The root module is always a unit too and
            holds the remaining parameters.
        cpu_offload: keep sharded parameters, gradients and optimizer state on CPU
            (CPUOffloadPolicy); the optimizer steps on CPU.
        activation_checkpointing: block classes whose activations are recomputed in the backward.
        tp: tensor-parallel degree (strategies/tensor_parallel.py): each group of `tp` consecutive
            ranks splits the attention and MLP projections, and FSDP shards over the world size / tp
            data-parallel ranks (a 2-D mesh). 1: no tensor parallelism.
        tp_plan: with tp > 1, module path (wildcards allowed) -> style name ("colwise", "rowwise",
            "fused_colwise", ...: `tp_styles.STYLES`), instead of the model's own plan.
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
        # window is one batch, so sync_grads is always on) and the user's opt.step() updates the
        # local shards. Under 16-mixed the gradients would still carry the loss scale, which only
        # the loop's own step removes.
        if not spec.automatic_optimization and spec.precision == "16-mixed":
            raise ConfigError(
                "automatic_optimization=False with precision='16-mixed' is not supported by "
                f"strategy {self.name!r}: the sharded gradients carry the loss scale, which only "
                "automatic optimization removes. Use 'bf16-mixed' or '32-true'."
            )

    def connect(self, spec: RunSpec, dist_info: DistInfo, device: torch.device) -> None:
        self.spec, self.dist, self.device = spec, dist_info, device
        # The fp16 loss scaler, agreeing on overflows across ranks; no autocast (FSDP's
        # MixedPrecisionPolicy).
        self.precision = Precision(spec.precision, device.type, sharded_grads=True)
        # a group of one for one process: FSDP needs it
        init_process_group(dist_info, device, spec.timeout_s)

    def configure_model(self, module: nn.Module) -> None:
        """Builds the model on the meta device; rank 0 also builds it on CPU when it fits (see
        the module doc)."""

        def on_meta() -> None:
            with torch.device("meta"):
                cast(Any, module).configure_model()

        def tensors() -> list[torch.Tensor]:
            return list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())

        def nbytes() -> int:
            return sum(t.numel() * t.element_size() for t in tensors())

        # A model built in __init__ is already materialised (identically on every rank, same
        # seed): no twin.
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
                "initialising each shard locally with reset_parameters(), so weights differ from "
                "a single-device run.",
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
            # reshard_after_forward=False (no backward reshards them): shard them again, since the
            # optimizer must hold the DTensor shards.
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
            # to_empty gives each tied name its own tensor; FSDP manages the first
            apply_ties(module, ties)
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
            # left them uninitialised. Rank 0's plain build has them; every rank takes its values.
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
        # Off the boundary gradients accumulate unsharded and un-reduced; reduce-scatter only at
        # the last one.
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
        # another strategy's checkpoint, in the neutral form (checkpoint/layouts.py)
        if portable is not None:
            write_fsdp(portable, self.module, self.optimizers, with_optimizer, path)
            self.precision.load_state_dict(portable.get("precision", {}))
            return
        # DCP loads in place into tensors shaped like this run's shards, resharding from the
        # saved layout.
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
    # DCP's offline load of every shard
    return read_portable(Path(path), "fsdp", with_optimizer=False)["model"]
