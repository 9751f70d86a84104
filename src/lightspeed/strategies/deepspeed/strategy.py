"""DeepSpeed ZeRO stages 1/2/3, with optional CPU/NVMe offload, on CPU (gloo) or CUDA (nccl).

    Trainer(devices=2, strategy="deepspeed_stage_3")                       # by name
    Trainer(devices=2, strategy=DeepSpeed(stage=2, offload_optimizer="cpu", config="ds.json"))

DeepSpeed owns the engine's forward, backward, optimizer step, gradient accumulation, clipping and
precision. The config is built from the Trainer's flags (`build_config`), the user's config merges
over it (a key that contradicts a flag is an error), then `Module.configure_deepspeed(config)` may
change it.

Accumulation: the Trainer divides each loss by `accumulate_grad_batches` and announces the window's
end with `forward(..., sync_grads=)`, which sets DeepSpeed's boundary; so `backward` passes
`scale_wrt_gas=False` and DeepSpeed's own micro-step counter never decides. A partial window at an
epoch's end still ends in an optimizer step, on the gradients of the batches it has, each divided by
the full `accumulate_grad_batches`: exactly what DDP does, so losses match across strategies, and
one optimizer step is one `engine.global_steps` (the Trainer's `global_step`).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import psutil
import torch
import torch.distributed as dist

import lightspeed.strategies.deepspeed.autotp as autotp
import lightspeed.strategies.deepspeed.config as dsconfig
import lightspeed.strategies.deepspeed.host_memory as host_memory
import lightspeed.strategies.deepspeed.multi as multi
import lightspeed.strategies.deepspeed.zero3 as zero3
import lightspeed.strategies.lightning as lightning
from lightspeed.checkpoint.layouts import Portable
from lightspeed.perf.kernels import apply_compile
from lightspeed.runtime.launch import DistInfo
from lightspeed.specs import RunSpec, SchedulerConfig, StepStats
from lightspeed.strategies.common import (
    StepRunner,
    apply_activation_checkpointing,
    checkpoint_layout,
    fork_of,
    options_of,
)
from lightspeed.strategies.deepspeed.config import Offload
from lightspeed.strategies.deepspeed.engine import (
    build_user_optimizers,
    initialize_engine,
    only_optimizer,
)
from lightspeed.strategies.deepspeed.group import join_process_group, leave_process_group
from lightspeed.strategies.deepspeed.manual import EngineOptimizer
from lightspeed.strategies.deepspeed.measure import measure_engine
from lightspeed.strategies.deepspeed.ops import cpu_adam
from lightspeed.strategies.deepspeed.portable import write_deepspeed
from lightspeed.strategies.deepspeed.quiet import import_deepspeed
from lightspeed.strategies.deepspeed.shards import TAG, load_weights_only, save_engine


@dataclass
class DeepSpeed:
    """DeepSpeed ZeRO as a lightspeed strategy (Lightning's name for it: `DeepSpeedStrategy`,
    deepspeed/lightning.py, which also takes Lightning's keywords).

    Args:
        stage: ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters.
        offload_optimizer: move optimizer states and step to "cpu" or "nvme" (a torch Adam/AdamW
            becomes DeepSpeedCPUAdam with the same hyper-parameters).
        offload_params: stage 3 only: keep parameters on "cpu" or "nvme" between uses.
        nvme_path: directory for "nvme" offload; required with it.
        pin_memory: page-lock the offloaded host buffers (default: on CUDA). Pinned copies are
            faster, but torch rounds each pinned block up to a power of two, so a multi-GiB buffer
            can take up to twice its size; False lets the largest models fit in host memory
            (docs/benchmarks.md: 5.91B on one H200 that way).
        config: a DeepSpeed config dict or a JSON file; merged over the config built from the
            Trainer's flags. Afterwards `.config` (Lightning's name) is the config as a dict: the
            user's (or the ZeRO stage alone) until `setup`, then the one the engine was built with.
        activation_checkpointing: block classes whose activations are recomputed in the backward.
        allgather_bucket_size, reduce_bucket_size: ZeRO bucket sizes (elements); None:
            REDUCE_BUCKET's for the stage.
        leaf_modules: stage 3: classes whose parameters are gathered at once (one fetch per block,
            not per Linear; docs/benchmarks.md). Default: the repeated blocks (nn.ModuleList
            children); [] is DeepSpeed's default.
        tp: tensor-parallel degree (DeepSpeed's AutoTP, stages 1 and 2; deepspeed/autotp.py): each
            group of `tp` consecutive ranks splits the attention and MLP projections, and ZeRO
            shards over the world size / tp data-parallel ranks. 1: none.
        tp_plan: with tp > 1, module path (wildcards allowed) -> "colwise", "rowwise",
            "fused_colwise" or "colwise_gather_output", instead of the model's own plan.
        deepcompile: stage 3 on CUDA: DeepSpeed's DeepCompile compiles the step (forward, backward
            and ZeRO-3's gathers and reductions in one graph, no per-module hooks;
            `zero3.wants_deepcompile`). The first steps compile (minutes on a cold cache). Also on
            when the config sets `compile.deepcompile`.
    Raises:
        ConfigError: bad stage, offload or leaf_modules, nvme without nvme_path, a missing or
            invalid config file; in `check` clipping by value, 16-mixed off CUDA, or
            gradient_clip_val with manual optimization; later, a config key contradicting a
            Trainer flag. With tp > 1 (autotp.check_tp, build_plan): stage 3, NVMe offload, a
            config plan, manual optimization, a Hugging Face Conv1D or sizes tp does not divide.
    """

    stage: Literal[1, 2, 3] = 2
    offload_optimizer: Offload = None
    offload_params: Offload = None
    nvme_path: str | Path | None = None
    pin_memory: bool | None = None
    config: dict | str | Path | None = None
    activation_checkpointing: list[type] | None = None
    allgather_bucket_size: int = 200_000_000
    reduce_bucket_size: int | None = None
    leaf_modules: list[type] | None = None
    deepcompile: bool = False
    tp: int = 1
    tp_plan: dict[str, str] | None = None
    optimizers: list = field(default_factory=list)
    schedulers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        dsconfig.check_options(
            self.stage, self.offload_optimizer, self.offload_params, self.nvme_path, self.pin_memory
        )
        zero3.check_leaf_modules(self.leaf_modules)
        self.reduce_bucket_size = self.reduce_bucket_size or dsconfig.REDUCE_BUCKET[self.stage]
        if importlib.util.find_spec("deepspeed") is None:
            import_deepspeed()  # raises the install hint now, before any rank is started
        # One dict: a change to `.config` before fit reaches the engine, as in Lightning.
        self.config = self.user_config = dsconfig.read_config(self.config) or {
            "zero_optimization": {"stage": self.stage}
        }
        self.tp = autotp.check_tp(self.tp, self.stage, self.offload_optimizer, self.user_config)
        offloaded = bool(self.offload_optimizer or self.offload_params)
        self.deepcompile = zero3.wants_deepcompile(
            self.deepcompile, self.user_config, self.stage, offloaded, self.leaf_modules
        )
        self.name = dsconfig.strategy_name(
            self.stage, self.offload_optimizer, self.offload_params, self.tp
        )
        self._plan: dict[str, str] = {}  # under tp > 1: module path -> style, found at setup
        self._runner: StepRunner | None = None  # the engine's model (AutoTP marks it once)
        # the DeepSpeed engine (an EngineGroup under several optimizers), once set up
        self.engine: Any = None
        self._prepared, self.micro_batch_size, self._leaf_numel = False, None, 0
        self._compile_pending = False
        self.dist: DistInfo | None = None
        self.device: Any = None  # a torch.device, once connected
        self.module: Any = None  # the user's Module, once set up
        self.is_fork = False

    # What others may read (strategies/base.py), and Lightning's names for it.
    @property
    def distributed_sampler_kwargs(self) -> dict[str, int] | None:
        """The data-parallel ranks: under tp > 1 a TP group's ranks share batches (autotp.py)."""
        info = self.dist
        return (
            None if info is None else autotp.dp_sampler_kwargs(info.world_size, info.rank, self.tp)
        )

    @property
    def model(self) -> Any:
        return self.engine

    @property
    def layout(self) -> str | None:
        return checkpoint_layout(self)

    deepspeed_engine = property(lambda self: self.engine)
    zero_stage_3 = property(lambda self: self.stage == 3)
    root_device, lightning_module = lightning.root_device, lightning.lightning_module
    world_size, global_rank = lightning.world_size, lightning.global_rank
    local_rank, is_global_zero = lightning.local_rank, lightning.is_global_zero
    barrier, broadcast, reduce = lightning.COLLECTIVES

    def measure(self) -> dict[str, int]:
        return measure_engine(self.engine)

    def settings(self) -> dict[str, Any]:
        engine_config = getattr(self.engine, "config", None)
        extra = {"deepspeed_config": engine_config} if isinstance(engine_config, dict) else {}
        return {**options_of(self), **extra}

    def fork(self) -> DeepSpeed:
        return fork_of(self)

    # ------------------------------------------------------------------ config
    def check(self, spec: RunSpec) -> None:
        dsconfig.check_run(spec, self.name, self.deepcompile, self.tp)

    def connect(self, spec: RunSpec, dist_info: DistInfo, device: torch.device) -> None:
        join_process_group(import_deepspeed(), dist_info, device, spec.timeout_s, self.name)
        self.spec, self.dist, self.device = spec, dist_info, device
        self._log0(zero3.deepcompile_hint(self))  # None: no line

    @property
    def _pinned(self) -> bool:
        return self.device.type == "cuda" if self.pin_memory is None else self.pin_memory

    def build_config(self, module: torch.nn.Module | None = None) -> dict:
        """The DeepSpeed config: Trainer flags, the user's config over them, then
        `module.configure_deepspeed`.

        Raises ConfigError when a user key contradicts a Trainer flag, naming both values."""
        zero = dsconfig.zero_section(
            self.stage,
            on_cuda=self.device.type == "cuda",
            buckets=(self.allgather_bucket_size, cast(int, self.reduce_bucket_size)),
            leaf_numel=self._leaf_numel,
            offload=(self.offload_optimizer, self.offload_params),
            pinned=self._pinned,
            nvme_path=self.nvme_path,
        )
        config = dsconfig.trainer_config(
            self.spec,
            self.micro_batch_size,
            zero,
            deepcompile=self.deepcompile,
            tensor_parallel=autotp.config_section(self._plan, self.tp) if self.tp > 1 else None,
            offload_optimizer=bool(self.offload_optimizer),
        )
        merged = dsconfig.merge(config, self.user_config)
        dp = self.dist.world_size // self.tp  # DeepSpeed's data-parallel size
        dsconfig.check_contradictions(
            config, merged, self.spec, self.stage, self.micro_batch_size, dp
        )
        return (
            cast(Any, module).configure_deepspeed(merged)
            if hasattr(module, "configure_deepspeed")
            else merged
        )

    # ------------------------------------------------------------------ model
    def configure_model(self, module: torch.nn.Module) -> None:
        if self.stage != 3:
            cast(Any, module).configure_model()
            return
        host_bytes = host_memory.offloaded_bytes_per_param(
            self.stage, self.offload_optimizer, self.offload_params
        )
        config = self.build_config(module)
        zero3.configure_partitioned(
            import_deepspeed(), module, config, self.offload_params, host_bytes, self._log0
        )

    def setup(
        self, module: torch.nn.Module, build_optimizers, micro_batch_size: int | None = None
    ) -> None:
        """Builds the engine for `module`: the optimizer from `build_optimizers`
        (configure_optimizers) or the config's; None builds an evaluation engine, without one."""
        deepspeed = import_deepspeed()
        self.module, self.micro_batch_size = module, micro_batch_size
        if not self._prepared:  # once, before the first engine wraps the module
            self._prepare(deepspeed, module)
            self._prepared = True
        config = self.config = self.build_config(module)  # `.config` shows what the engine got
        # forward casts the batch's float tensors to the weights' dtype
        self.input_dtype = dsconfig.engine_dtype(config)
        optimizer = None
        if build_optimizers is None:  # evaluation: an inference-only engine, no optimizer state
            config = self.config = dsconfig.evaluation_config(config, self.stage)
        elif "optimizer" in config:
            self.schedulers = []  # a config scheduler joins them below
            self._log0(
                "DeepSpeed: the config has an 'optimizer' section; configure_optimizers is not "
                "used."
            )
        else:
            optimizers, self.schedulers = build_user_optimizers(
                deepspeed,
                module,
                build_optimizers,
                self.spec,
                cast(DistInfo, self.dist),  # connected
                self.device,
                bool(self.offload_optimizer),
                self._log0,
            )
            if not self.spec.automatic_optimization and optimizers:
                self._initialize_group(deepspeed, module, optimizers, config)
                return
            optimizer = self._cpu_adam(only_optimizer(optimizers))
        if build_optimizers is not None and "cpu" in (self.offload_optimizer, self.offload_params):
            info = self.dist
            self._log0(
                host_memory.host_memory_warning(
                    zero3.whole_numel(module),
                    stage=self.stage,
                    offload_optimizer=self.offload_optimizer,
                    offload_params=self.offload_params,
                    pinned=self._pinned,
                    node_share=info.local_world_size / info.world_size,
                    host_bytes=psutil.virtual_memory().total,
                )
            )
        self._initialize(deepspeed, module, optimizer, config, build_optimizers is not None)

    def _prepare(self, deepspeed, module: torch.nn.Module) -> None:
        """What changes the module once, before any engine wraps it: AutoTP's plan, activation
        checkpointing, compile and ZeRO-3's leaf modules."""
        if self.tp > 1:  # paths before activation checkpointing's wrappers
            self._plan, lines = autotp.build_plan(module, self.tp, self.tp_plan)
            self._log0("\n".join(lines))
        if self.activation_checkpointing:
            apply_activation_checkpointing(module, self.activation_checkpointing)
        if self.spec.compile:
            apply_compile(module, options=self.spec.compile)
        # DeepCompile gathers blocks without leaf hooks
        if self.stage == 3 and not self.deepcompile:
            self._leaf_numel = zero3.mark_leaf_modules(deepspeed, module, self.leaf_modules)

    def _cpu_adam(self, opt: torch.optim.Optimizer) -> Any:
        """Under optimizer offload, a torch Adam/AdamW becomes DeepSpeedCPUAdam (ops.cpu_adam)."""
        return cpu_adam(opt, self.schedulers, self._log0) if self.offload_optimizer else opt

    def _initialize_group(
        self, deepspeed, module: torch.nn.Module, optimizers: list, config
    ) -> None:
        """Manual optimization: one engine per optimizer (a GAN), and for one optimizer too, since
        the group keeps what several manual_backward calls add before one step (ZeRO's own
        reduction at a boundary replaces what an earlier backward reduced). multi.py."""
        multi.check_group(self.spec.precision, optimizers, self.name)
        if self.engine is not None:  # an evaluation engine built before fit
            zero3.destroy_engine(self.engine, module)
        runner, offloaded = StepRunner(module), [self._cpu_adam(o) for o in optimizers]
        self.engine, self.optimizers = multi.initialize_group(
            deepspeed, runner, offloaded, config, self.name
        )

    def _initialize(
        self, deepspeed, module: torch.nn.Module, optimizer: Any, config: dict, training: bool
    ) -> None:
        """Builds the one engine (replacing an evaluation engine built before), then adopts the
        config's scheduler and wraps the optimizer for manual optimization."""
        if self.engine is not None:
            zero3.destroy_engine(self.engine, module)  # an evaluation engine built before fit
        # AutoTP marks the model it split, so every engine of this run gets the same one
        self._runner = self._runner if self.tp > 1 and self._runner else StepRunner(module)
        self.engine, ds_optimizer = initialize_engine(
            deepspeed, self._runner, module, optimizer, config, self.device
        )
        self.optimizers = [ds_optimizer] if training and ds_optimizer is not None else []
        if self.engine.lr_scheduler is not None and self.spec.automatic_optimization:
            # The config's scheduler steps with the loop's, after each optimizer step (Lightning's
            # way): `trainer.lr_scheduler_configs` shows it and a checkpoint carries its state.
            config_scheduler = SchedulerConfig(self.engine.lr_scheduler, interval="step")
            self.schedulers, self.engine.lr_scheduler = [*self.schedulers, config_scheduler], None
        # DeepCompile starts at the first training step, after any checkpoint load; evaluation
        # engines keep hooks
        self._compile_pending = self.deepcompile and bool(self.optimizers)
        if self.optimizers and not self.spec.automatic_optimization:
            self.optimizers = [EngineOptimizer(self.engine, ds_optimizer)]  # opt.step(): engine's

    # ------------------------------------------------------------------ the step
    def forward(self, step, *args, sync_grads: bool = True):
        if self.optimizers:  # an evaluation engine has no optimizer to tell
            self.engine.set_gradient_accumulation_boundary(sync_grads)
        if self.engine.training != self.module.training:  # the Trainer switched the user's module
            self.engine.train(self.module.training)
        if self._compile_pending and self.module.training:
            self._compile_pending = False
            zero3.start_deepcompile(self.engine, self._log0)
        return self.engine(step, *dsconfig.cast_floats(args, self.input_dtype))

    def backward(self, loss: torch.Tensor, **options: Any) -> None:
        # the Trainer already divided by the accumulation; DeepSpeed's backward takes retain_graph
        self.engine.backward(loss, scale_wrt_gas=False, **multi.deepspeed_backward_options(options))

    def step(self, should_step: Callable[[Any], bool] | None = None) -> StepStats:
        # ZeRO computes the global gradient norm inside engine.step() (reduced across ranks there),
        # so the guard decides on the losses before it, and on that norm after it: a NaN/Inf norm
        # makes DeepSpeed drop the step on every rank (its overflow check, fp32 and bf16 alike),
        # and the guard applies the Trainer's policy to it, naming the step, with no collective of
        # its own. Under fp16 an overflow is the loss scaler's routine business, not a fault.
        if should_step is not None:
            should_step(None)
        self.engine.step()
        norm, applied = self.engine.get_global_grad_norm(), self.engine.was_step_applied()
        after = getattr(should_step, "after_engine_step", None)
        if after is not None and not self.engine.fp16_enabled():
            after(None if norm is None else float(norm), applied)
        return {"grad_norm": norm, "step_applied": applied}

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: Path) -> None:
        save_engine(self.engine, path, self.name, self.tp)

    def load(
        self, path: Path, with_optimizer: bool = True, portable: Portable | None = None
    ) -> None:
        tp_rank = self.dist.rank % self.tp
        if portable is not None:
            # another strategy's or world size's checkpoint (strategies/portable.py)
            if self.tp > 1:  # the whole tensors cut to this TP rank's share, as AutoTP cut them
                portable = autotp.local_portable(portable, self._plan, self.tp, tp_rank)
            return write_deepspeed(
                import_deepspeed(), self.engine, self.module, portable, with_optimizer, path
            )
        if not self.optimizers:  # an evaluation engine (shards.load_weights_only)
            load_weights_only(self.module, Path(path), self._plan, self.tp, tp_rank)
            return
        self.engine.load_checkpoint(
            str(path),
            tag=TAG,
            load_optimizer_states=with_optimizer,
            load_lr_scheduler_states=False,
            load_module_strict=True,
        )

    def teardown(self) -> None:
        if self.is_fork:  # a trial's engine: freed for collection; the group is the parent's
            self.engine, engine = None, self.engine
            zero3.release_engine(engine)
            return
        if self.engine is not None:  # left to interpreter shutdown, gloo's threads can abort a rank
            self.engine, engine = None, self.engine
            # another Trainer of this process may have left the shared group already
            if dist.is_initialized():
                zero3.destroy_engine(engine, self.module)
        # and drop DeepSpeed's references to it: a later Trainer here joins a new one
        leave_process_group()

    def _log0(self, message: str | None) -> None:
        print(message, flush=True) if message and self.dist.is_global_zero else None
