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
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import psutil
import torch
import torch.distributed as dist

import lightspeed.strategies.lightning as lightning
from lightspeed.checkpoint.io import (
    DEEPSPEED_DIR as TAG,
)  # the sub-directory that holds DeepSpeed's files
from lightspeed.checkpoint.layouts import Portable, read_portable
from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import apply_compile, build_optimizers_fast, rebind_schedulers
from lightspeed.runtime.distributed import init_process_group
from lightspeed.runtime.launch import DistInfo
from lightspeed.specs import RunSpec, SchedulerConfig, StepStats
from lightspeed.strategies.common import (
    StepRunner,
    apply_activation_checkpointing,
    checkpoint_layout,
    configure_with_plain_twin,
    fork_of,
    options_of,
)
from lightspeed.strategies.deepspeed.autotp import (
    build_plan,
    check_tp,
    config_section,
    dp_sampler_kwargs,
    drop_input_check,
    local_portable,
)
from lightspeed.strategies.deepspeed.config import (
    REDUCE_BUCKET,
    cast_floats,
    check_extension_locks,
    engine_dtype,
    merge,
    read_config,
)
from lightspeed.strategies.deepspeed.host_memory import (
    host_memory_warning,
    offloaded_bytes_per_param,
)
from lightspeed.strategies.deepspeed.manual import EngineOptimizer
from lightspeed.strategies.deepspeed.measure import measure_engine
from lightspeed.strategies.deepspeed.multi import (
    check_group,
    deepspeed_backward_options,
    initialize_group,
    leave_process_group,
    merge_engines,
)
from lightspeed.strategies.deepspeed.ops import fused_adam
from lightspeed.strategies.deepspeed.portable import write_deepspeed
from lightspeed.strategies.deepspeed.quiet import (
    quiet_logger,
    use_current_collectives,
    without_build_notes,
)
from lightspeed.strategies.deepspeed.room import room_under_cap
from lightspeed.strategies.deepspeed.zero3 import (
    check_deepcompile_run,
    check_leaf_modules,
    copy_from_rank0,
    deepcompile_hint,
    destroy_engine,
    full_shapes,
    load_weights,
    mark_leaf_modules,
    partitioned_init,
    prefetch_bucket,
    release_engine,
    start_deepcompile,
    wants_deepcompile,
    whole_numel,
)

Offload = Literal["cpu", "nvme"] | None


def _import_deepspeed():
    quiet_logger()  # before DeepSpeed's import logs its accelerator line
    # DeepSpeed's autotuner imports mlflow whenever it is installed (0.7 s of every rank's start
    # here), for autotuning runs lightspeed never starts: hidden during the first import only (a
    # user's own `import mlflow`, before or after, is untouched).
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # import mlflow -> ImportError
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError(
            f"strategy DeepSpeed needs the deepspeed package, which is not importable ({e}). "
            "Install it with `pip install 'deepspeed>=0.16,<0.20'`."
        ) from None
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed


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
        if self.stage not in (1, 2, 3):
            raise ConfigError(f"DeepSpeed stage={self.stage!r} is not valid: use 1, 2 or 3.")
        for what, value in (
            ("offload_optimizer", self.offload_optimizer),
            ("offload_params", self.offload_params),
        ):
            if value not in (None, "cpu", "nvme"):
                raise ConfigError(
                    f"DeepSpeed {what}={value!r} is not valid: use None, 'cpu' or 'nvme'."
                )
        if self.offload_params and self.stage != 3:
            raise ConfigError(
                f"DeepSpeed offload_params={self.offload_params!r} needs stage=3 (got "
                f"{self.stage}): "
                "only stage 3 partitions the parameters."
            )
        if "nvme" in (self.offload_optimizer, self.offload_params) and self.nvme_path is None:
            raise ConfigError(
                "DeepSpeed offload to 'nvme' needs nvme_path=<a directory on a fast local disk>, "
                "e.g. "
                "DeepSpeed(stage=3, offload_optimizer='nvme', offload_params='nvme', "
                "nvme_path='/nvme')."
            )
        if self.pin_memory not in (None, True, False):
            raise ConfigError(
                f"DeepSpeed pin_memory={self.pin_memory!r} is not valid: "
                "use None (pinned on CUDA), True or False."
            )
        if self.pin_memory is not None and not (self.offload_optimizer or self.offload_params):
            raise ConfigError(
                f"DeepSpeed pin_memory={self.pin_memory!r} needs offload_optimizer or "
                "offload_params: "
                "only offloaded host buffers are pinned."
            )
        check_leaf_modules(self.leaf_modules)
        self.reduce_bucket_size = self.reduce_bucket_size or REDUCE_BUCKET[self.stage]
        if importlib.util.find_spec("deepspeed") is None:
            _import_deepspeed()  # raises the install hint now, before any rank is started
        # One dict: a change to `.config` before fit reaches the engine, as in Lightning.
        self.config = self.user_config = read_config(self.config) or {
            "zero_optimization": {"stage": self.stage}
        }
        self.tp = check_tp(self.tp, self.stage, self.offload_optimizer, self.user_config)
        self.deepcompile = wants_deepcompile(
            self.deepcompile,
            self.user_config,
            self.stage,
            bool(self.offload_optimizer or self.offload_params),
            self.leaf_modules,
        )
        offload = "_offload" if self.offload_optimizer or self.offload_params else ""
        nvme = "_nvme" if "nvme" in (self.offload_optimizer, self.offload_params) else ""
        tp = f"_tp{self.tp}" if self.tp > 1 else ""
        self.name = f"deepspeed_stage_{self.stage}{offload}{nvme}{tp}"
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
        return None if info is None else dp_sampler_kwargs(info.world_size, info.rank, self.tp)

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
        # a killed op build's lock would make every rank wait forever, silently
        check_extension_locks()
        if spec.gradient_clip_algorithm == "value":
            raise ConfigError(
                f"gradient_clip_algorithm='value' is not valid with strategy {self.name!r}: it "
                "clips "
                "by global norm only. Use 'norm'."
            )
        if (
            spec.gradient_clip_val and not spec.automatic_optimization
        ):  # every engine would clip on its own
            raise ConfigError(
                f"gradient_clip_val={spec.gradient_clip_val} is not valid with "
                "automatic_optimization="
                f"False under {self.name!r} (nor in Lightning): call self.clip_gradients(opt, "
                "gradient_clip_val=...) before opt.step() in training_step."
            )
        if (
            spec.precision == "16-mixed" and spec.device_type != "cuda"
        ):  # DeepSpeed would refuse it in initialize
            raise ConfigError(
                f"precision='16-mixed' is not valid with DeepSpeed on {spec.device_type}: its CPU "
                "accelerator has no fp16 support. Use '32-true', 'bf16-mixed' or 'bf16-true'."
            )
        if self.deepcompile:
            check_deepcompile_run(spec)
        if self.tp > 1 and not spec.automatic_optimization:  # one engine per optimizer there
            raise ConfigError(
                f"automatic_optimization=False is not offered with {self.name!r}: DeepSpeed's "
                "AutoTP runs one engine, with automatic optimization. Use tp=1, or FSDP(tp=...)."
            )

    def connect(self, spec: RunSpec, dist_info: DistInfo, device: torch.device) -> None:
        deepspeed = _import_deepspeed()
        if dist_info.own_group and getattr(deepspeed.comm.comm, "cdb", None) is not None:
            raise ConfigError(
                f"strategy {self.name!r} cannot run in a Trainer made inside a running DeepSpeed "
                "job (devices=1 on one rank): DeepSpeed keeps one set of process groups per "
                "process, the job's. Give this Trainer the default strategy (one device), or run "
                "it in the job on every rank."
            )
        self.spec, self.dist, self.device = spec, dist_info, device
        # A group of one for a single process: DeepSpeed needs a group.
        init_process_group(dist_info, device, spec.timeout_s)
        if not dist_info.is_distributed:
            # DeepSpeed's CUDA path reads its rank from the launcher's variables; a plain
            # one-process run has none.
            os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
        # DeepSpeed's comm layer adopts the torch process group that is already there.
        with without_build_notes():
            deepspeed.init_distributed(
                dist_backend=dist.get_backend(), dist_init_required=False, verbose=False
            )
        use_current_collectives(deepspeed)  # no FutureWarning on each ZeRO collective (quiet.py)
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        self._log0(deepcompile_hint(self))  # None: no line

    @property
    def _pinned(self) -> bool:
        return self.device.type == "cuda" if self.pin_memory is None else self.pin_memory

    def build_config(self, module: torch.nn.Module | None = None) -> dict:
        """The DeepSpeed config: Trainer flags, the user's config over them, then
        `module.configure_deepspeed`.

        Raises ConfigError when a user key contradicts a Trainer flag, naming both values."""
        spec = self.spec
        zero: dict[str, Any] = {
            # Overlapping the gradient reduce with the backward is DeepSpeed's stage-3 default and
            # where stage 3
            # lost to DeepSpeed's own loop on 2 GPUs; CPU ranks have no streams to overlap on.
            "stage": self.stage,
            "contiguous_gradients": True,
            "overlap_comm": self.stage == 3 and self.device.type == "cuda",
            "allgather_bucket_size": self.allgather_bucket_size,
            "reduce_bucket_size": self.reduce_bucket_size,
        }
        if self.stage == 3 and self.device.type != "cuda":
            # CPU ranks (the test suite) partition every parameter, however small, so ZeRO-3's
            # shares can be checked
            # on tiny models. On GPUs small parameters stay whole (DeepSpeed's default: no
            # all-gather per LayerNorm).
            zero.update(
                stage3_param_persistence_threshold=0,
                stage3_prefetch_bucket_size=self.reduce_bucket_size,
            )
        elif (
            self.stage == 3 and self._leaf_numel
        ):  # prefetch the next two leaf blocks (zero3.prefetch_bucket)
            zero["stage3_prefetch_bucket_size"] = prefetch_bucket(self._leaf_numel)
        for key, device in (
            ("offload_optimizer", self.offload_optimizer),
            ("offload_param", self.offload_params),
        ):
            if device:
                zero[key] = {"device": device, "pin_memory": self._pinned}
                if device == "nvme":
                    zero[key]["nvme_path"] = str(self.nvme_path)
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro_batch_size or 1,
            "gradient_accumulation_steps": spec.accumulate_grad_batches,
            "gradient_clipping": float(spec.gradient_clip_val or 0.0),
            "zero_optimization": zero,
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 2**62,  # off: lightspeed's loggers report progress
            "wall_clock_breakdown": False,
        }
        if self.deepcompile:
            config["compile"] = {"deepcompile": True}
        if self.tp > 1:
            config["tensor_parallel"] = config_section(self._plan, self.tp)
        if self.offload_optimizer:
            # A non-Adam optimizer may run on offloaded states too (slowly); Adam/AdamW become
            # DeepSpeedCPUAdam.
            config["zero_force_ds_cpu_optimizer"] = False
        match spec.precision:
            case "bf16-mixed" | "bf16-true":
                config["bf16"] = {"enabled": True}
            case "16-mixed":
                config["fp16"] = {
                    "enabled": True,
                    "loss_scale": 0,
                    "initial_scale_power": 16,
                    "loss_scale_window": 1000,
                    "hysteresis": 2,
                    "min_loss_scale": 1,
                }
        merged = merge(config, self.user_config)
        self._check_contradictions(config, merged)
        return (
            cast(Any, module).configure_deepspeed(merged)
            if hasattr(module, "configure_deepspeed")
            else merged
        )

    def _check_contradictions(self, ours: dict, merged: dict) -> None:
        spec, zero = self.spec, merged.get("zero_optimization", {})
        checks: list[tuple[str, Any, str, Any]] = [
            (
                "gradient_accumulation_steps",
                merged["gradient_accumulation_steps"],
                "accumulate_grad_batches",
                spec.accumulate_grad_batches,
            ),
            ("zero_optimization.stage", zero.get("stage"), "DeepSpeed(stage=...)", self.stage),
            (
                "bf16.enabled",
                merged.get("bf16", {}).get("enabled", False),
                "precision",
                spec.precision,
            ),
            (
                "fp16.enabled",
                merged.get("fp16", {}).get("enabled", False),
                "precision",
                spec.precision,
            ),
        ]
        if self.micro_batch_size is not None:
            checks.append(
                (
                    "train_micro_batch_size_per_gpu",
                    merged["train_micro_batch_size_per_gpu"],
                    "the train dataloader's batch_size",
                    self.micro_batch_size,
                )
            )
        if (
            spec.gradient_clip_val
        ):  # the Trainer set clipping; a config without the flag may add its own
            checks.append(
                (
                    "gradient_clipping",
                    merged["gradient_clipping"],
                    "gradient_clip_val",
                    spec.gradient_clip_val,
                )
            )
        expected: dict[str, Any] = {"bf16.enabled": "bf16" in ours, "fp16.enabled": "fp16" in ours}
        for key, got, flag, flag_value in checks:
            want = expected.get(key, flag_value)
            if got != want and not (isinstance(got, float | int) and float(got) == float(want)):
                raise ConfigError(
                    f"DeepSpeed config {key}={got!r} contradicts the Trainer's "
                    f"{flag}={flag_value!r}; "
                    "set it in one place."
                )
        dp = self.dist.world_size // self.tp  # DeepSpeed's data-parallel size
        want = (self.micro_batch_size or 0) * spec.accumulate_grad_batches * dp
        if merged.get("train_batch_size", want) != want and self.micro_batch_size is not None:
            raise ConfigError(
                f"DeepSpeed config train_batch_size={merged['train_batch_size']} contradicts the "
                f"Trainer: batch_size × accumulate_grad_batches × data-parallel size = {want}."
            )

    # ------------------------------------------------------------------ model
    def configure_model(self, module: torch.nn.Module) -> None:
        if self.stage != 3:
            cast(Any, module).configure_model()
            return
        deepspeed = _import_deepspeed()
        config = self.build_config(module)
        # Same seed, same weights as DDP: rank 0 also builds the model plainly and its values
        # overwrite the
        # partitions (see common.configure_with_plain_twin), unless that copy would not fit in host
        # memory.

        def sharded() -> None:
            # zero.Init patches torch's tensor constructors; a library imported for the first time
            # inside it
            # (transformers' lazy modules import torch._dynamo) would introspect the patched
            # functions and fail
            # ("Signature mismatch ... new_tensor"). Import dynamo with the constructors unpatched.
            import torch._dynamo  # noqa: F401

            with partitioned_init(
                deepspeed, config, self.offload_params
            ):  # deep copies too (zero3.py)
                cast(Any, module).configure_model()

        def fits() -> (
            bool
        ):  # rank 0's fp32 copy, beside what offload keeps in host memory for the whole run
            resident = offloaded_bytes_per_param(
                self.stage, self.offload_optimizer, self.offload_params
            )
            return (4 + resident) * whole_numel(module) < 0.8 * psutil.virtual_memory().available

        built, plain = configure_with_plain_twin(module, sharded, fits)
        if not built:
            self._log0(
                f"DeepSpeed stage 3: the model ({whole_numel(module)} parameters) would not fit in "
                "host memory "
                "twice; initialised sharded only (zero.Init), so parent-applied init may differ "
                "from DDP."
            )
            return
        copy_from_rank0(deepspeed, module, plain)

    def setup(
        self, module: torch.nn.Module, build_optimizers, micro_batch_size: int | None = None
    ) -> None:
        deepspeed = _import_deepspeed()
        self.module, self.micro_batch_size = module, micro_batch_size
        if not self._prepared:  # once, before the first engine wraps the module
            if self.tp > 1:  # paths before activation checkpointing's wrappers
                self._plan, lines = build_plan(module, self.tp, self.tp_plan)
                self._log0("\n".join(lines))
            if self.activation_checkpointing:
                apply_activation_checkpointing(module, self.activation_checkpointing)
            if self.spec.compile:
                apply_compile(module, options=self.spec.compile)
            if (
                self.stage == 3 and not self.deepcompile
            ):  # DeepCompile gathers blocks without leaf hooks
                self._leaf_numel = mark_leaf_modules(deepspeed, module, self.leaf_modules)
            self._prepared = True
        config = self.config = self.build_config(module)  # `.config` shows what the engine got
        self.input_dtype = engine_dtype(
            config
        )  # forward casts the batch's float tensors to the weights' dtype
        optimizer = None
        if build_optimizers is None:  # evaluation: an inference-only engine, no optimizer state
            config = {
                k: v for k, v in config.items() if k not in ("optimizer", "scheduler", "compile")
            }
            if (
                self.stage < 3
            ):  # stages 1 and 2 shard optimizer state only, and refuse to run without an optimizer
                config["zero_optimization"] = {**config["zero_optimization"], "stage": 0}
            self.config = config
        elif "optimizer" in config:
            self.schedulers = []  # a config scheduler joins them below
            self._log0(
                "DeepSpeed: the config has an 'optimizer' section; configure_optimizers is not "
                "used."
            )
        else:
            with full_shapes(
                deepspeed, module, self.device, self.dist.local_world_size, self._log0
            ):
                optimizers, self.schedulers = build_optimizers_fast(
                    build_optimizers,
                    self.spec,
                    backend="deepspeed",
                    device_type=self.device.type,
                    offload=bool(self.offload_optimizer),
                    is_global_zero=self.dist.is_global_zero,
                    fused_adam=fused_adam,
                )
            # Manual optimization: one engine per optimizer (a GAN), and for one optimizer too,
            # since the group keeps what several manual_backward calls add before one step (ZeRO's
            # own reduction at a boundary replaces what an earlier backward reduced)
            if not self.spec.automatic_optimization and optimizers:
                check_group(self.spec.precision, optimizers, self.name)
                if self.engine is not None:
                    destroy_engine(self.engine, module)  # an evaluation engine built before fit
                self.engine, self.optimizers = initialize_group(
                    deepspeed,
                    StepRunner(module),
                    [self._maybe_cpu_adam(o) for o in optimizers],
                    config,
                    self.name,
                )
                return
            if len(optimizers) > 1:
                raise ConfigError(
                    f"configure_optimizers returned {len(optimizers)} optimizers; DeepSpeed runs "
                    "one "
                    "engine with one optimizer. Return a single optimizer (with parameter groups)."
                )
            if not optimizers:
                raise ConfigError(
                    "configure_optimizers returned no optimizer and the DeepSpeed config has no "
                    "'optimizer' section: provide one or the other."
                )
            optimizer = self._maybe_cpu_adam(optimizers[0])
        if build_optimizers is not None and (
            self.offload_optimizer == "cpu" or self.offload_params == "cpu"
        ):
            info = self.dist
            if warning := host_memory_warning(
                whole_numel(module),
                stage=self.stage,
                offload_optimizer=self.offload_optimizer,
                offload_params=self.offload_params,
                pinned=self._pinned,
                node_share=info.local_world_size / info.world_size,
                host_bytes=psutil.virtual_memory().total,
            ):
                self._log0(warning)
        if self.engine is not None:
            destroy_engine(self.engine, module)  # an evaluation engine built before fit
        # AutoTP marks the model it split, so every engine of this run gets the same one
        self._runner = self._runner if self.tp > 1 and self._runner else StepRunner(module)
        with room_under_cap(self.device):  # ZeRO-1/2's flatten copy: on the device if it fits
            self.engine, ds_optimizer, _, _ = deepspeed.initialize(
                model=self._runner,
                optimizer=optimizer,
                config=config,
                dist_init_required=False,
                # (DeepSpeed annotates model_parameters as a Module; it takes parameters)
                model_parameters=cast(
                    Any,
                    [p for p in module.parameters() if p.requires_grad]
                    if optimizer is None
                    else None,
                ),
            )
        drop_input_check(self.engine)
        self.optimizers = (
            [ds_optimizer] if build_optimizers is not None and ds_optimizer is not None else []
        )
        if self.engine.lr_scheduler is not None and self.spec.automatic_optimization:
            # The config's scheduler steps with the loop's, after each optimizer step (Lightning's
            # way): `trainer.lr_scheduler_configs` shows it and a checkpoint carries its state.
            config_scheduler = SchedulerConfig(self.engine.lr_scheduler, interval="step")
            self.schedulers, self.engine.lr_scheduler = [*self.schedulers, config_scheduler], None
        # DeepCompile starts at the first training step, after any checkpoint load; evaluation
        # engines keep hooks
        self._compile_pending = self.deepcompile and bool(self.optimizers)
        if (
            self.optimizers and not self.spec.automatic_optimization
        ):  # the user's opt.step() is the engine's
            self.optimizers = [EngineOptimizer(self.engine, ds_optimizer)]

    def _maybe_cpu_adam(self, opt: torch.optim.Optimizer) -> Any:
        """Under optimizer offload, a torch Adam/AdamW becomes DeepSpeedCPUAdam (several times
        faster on offloaded states) with the same groups and hyper-parameters; the user's schedulers
        follow it."""
        if not self.offload_optimizer or type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
            return opt
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        d = opt.defaults
        groups = [
            dict(g) for g in opt.param_groups
        ]  # every key, so a scheduler's "initial_lr" survives
        new = DeepSpeedCPUAdam(
            groups,
            lr=d["lr"],
            betas=d["betas"],
            eps=d["eps"],
            weight_decay=d["weight_decay"],
            amsgrad=d.get("amsgrad", False),
            adamw_mode=type(opt) is torch.optim.AdamW,
        )
        rebind_schedulers(
            self.schedulers, opt, new
        )  # their state (step count, base lrs) is in the schedulers
        self._log0(
            f"DeepSpeed: optimizer offload replaces torch.optim.{type(opt).__name__} with "
            "DeepSpeedCPUAdam, "
            f"same hyper-parameters{' (LR schedulers rebound to it)' if self.schedulers else ''}."
        )
        return new

    # ------------------------------------------------------------------ the step
    def forward(self, step, *args, sync_grads: bool = True):
        if self.optimizers:  # an evaluation engine has no optimizer to tell
            self.engine.set_gradient_accumulation_boundary(sync_grads)
        if self.engine.training != self.module.training:
            self.engine.train(
                self.module.training
            )  # the Trainer switches the user's module; follow it
        if self._compile_pending and self.module.training:
            self._compile_pending = False
            start_deepcompile(self.engine, self._log0)
        return self.engine(step, *cast_floats(args, self.input_dtype))

    def backward(self, loss: torch.Tensor, **options: Any) -> None:
        # the Trainer already divided by the accumulation; DeepSpeed's backward takes retain_graph
        self.engine.backward(loss, scale_wrt_gas=False, **deepspeed_backward_options(options))

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
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        # The universal-checkpoint marker lets DeepSpeed's ds_to_universal convert this checkpoint
        # for another
        # world size (without it the conversion asserts); save_latest lets zero_to_fp32.py run
        # without a tag.
        client: dict[str, Any] = {"lightspeed_strategy": self.name}
        if self.tp == 1:  # AutoTP's engine records its own (how each split layer was cut)
            client[UNIVERSAL_CHECKPOINT_INFO] = {"universal_checkpoint_version": 0.2}
        self.engine.save_checkpoint(str(path), tag=TAG, client_state=client, save_latest=True)

    def load(
        self, path: Path, with_optimizer: bool = True, portable: Portable | None = None
    ) -> None:
        if (
            portable is not None
        ):  # another strategy's or world size's checkpoint (strategies/portable.py)
            if self.tp > 1:  # the whole tensors cut to this TP rank's share, as AutoTP cut them
                portable = local_portable(portable, self._plan, self.tp, self.dist.rank % self.tp)
            return write_deepspeed(
                _import_deepspeed(), self.engine, self.module, portable, with_optimizer, path
            )
        if not self.optimizers:
            # An evaluation engine has no optimizer, and ZeRO keeps the fp32 weights with the
            # optimizer state
            # (DeepSpeed's own weights-only load needs one), so merge the shards and load them.
            state = full_state_dict(Path(path))
            if self.tp > 1:  # this TP rank's cut of each split tensor
                whole: Portable = {"model": state, "optim": {"state": {}, "param_groups": []}}
                rank = self.dist.rank % self.tp
                state = local_portable(whole, self._plan, self.tp, rank)["model"]
            load_weights(_import_deepspeed(), self.module, state)
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
            release_engine(engine)
            return
        if self.engine is not None:  # left to interpreter shutdown, gloo's threads can abort a rank
            self.engine, engine = None, self.engine
            if (
                dist.is_initialized()
            ):  # another Trainer of this process may have left the shared group already
                destroy_engine(engine, self.module)
        # and drop DeepSpeed's references to it: a later Trainer here joins a new one
        leave_process_group()

    def _log0(self, message: str | None) -> None:
        print(message, flush=True) if message and self.dist.is_global_zero else None


def full_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Merges a lightspeed DeepSpeed checkpoint's ZeRO shards (every engine's) into one fp32 state
    dict on CPU.

    Keys are the user's Module's own `state_dict()` keys (the engine's `module.` and activation
    checkpointing's prefixes removed); tied weights appear under each name. Uses DeepSpeed's
    zero_to_fp32; for an AutoTP checkpoint (one model file per TP rank) DeepSpeed's ds_to_universal,
    which joins the TP cuts too (checkpoint/layouts.py). Raises ConfigError if `path` has no
    DeepSpeed shards."""
    _import_deepspeed()
    if any((Path(path) / TAG).glob("mp_rank_01_model_states.pt")):
        return read_portable(Path(path), "deepspeed_stage_2", with_optimizer=False)["model"]
    return merge_engines(Path(path), TAG)
