"""The DeepSpeed config of strategies.deepspeed: the strategy's arguments checked
(`check_options`), the sections built from them and the Trainer's flags (`zero_section`,
`trainer_config`), the user's config read and merged over them, and a merged
key that contradicts a Trainer flag refused (`check_contradictions`). Also casting a batch to the
engine's dtype, and the stale op-build lock that would hang every rank."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any, Literal

import torch

from lightspeed.errors import ConfigError
from lightspeed.specs import RunSpec
from lightspeed.strategies.deepspeed.zero3 import check_deepcompile_run, prefetch_bucket

Offload = Literal["cpu", "nvme"] | None

# ZeRO's reduce bucket (elements): a half-precision buffer every GPU keeps whole, whatever the GPU
# count. Stage 3
# takes 64M (0.12 GiB in bf16) instead of 200M (0.37 GiB): on a 1.28B GPT it left speed unchanged on
# 1 and 2
# H200s (1.02x and 1.01x the median tok/s of 200M, 8 and 6 runs) and puts ZeRO-3's memory between
# steps within
# 8% of the ZeRO paper's 16 bytes per parameter / 8 GPUs (docs/benchmarks.md, 2026-12-01).
REDUCE_BUCKET = {1: 200_000_000, 2: 200_000_000, 3: 64_000_000}


def check_options(
    stage: int,
    offload_optimizer: Offload,
    offload_params: Offload,
    nvme_path: str | Path | None,
    pin_memory: bool | None,
) -> None:
    """Checks `DeepSpeed`'s stage and offload arguments against each other.

    Raises:
        ConfigError: a stage other than 1, 2, 3; an offload other than None, "cpu", "nvme";
            offload_params below stage 3; "nvme" without nvme_path; pin_memory not None/True/False,
            or set with nothing offloaded.
    """
    if stage not in (1, 2, 3):
        raise ConfigError(f"DeepSpeed stage={stage!r} is not valid: use 1, 2 or 3.")
    for what, value in (
        ("offload_optimizer", offload_optimizer),
        ("offload_params", offload_params),
    ):
        if value not in (None, "cpu", "nvme"):
            raise ConfigError(
                f"DeepSpeed {what}={value!r} is not valid: use None, 'cpu' or 'nvme'."
            )
    if offload_params and stage != 3:
        raise ConfigError(
            f"DeepSpeed offload_params={offload_params!r} needs stage=3 (got {stage}): "
            "only stage 3 partitions the parameters."
        )
    if "nvme" in (offload_optimizer, offload_params) and nvme_path is None:
        raise ConfigError(
            "DeepSpeed offload to 'nvme' needs nvme_path=<a directory on a fast local disk>, e.g. "
            "DeepSpeed(stage=3, offload_optimizer='nvme', offload_params='nvme', "
            "nvme_path='/nvme')."
        )
    if pin_memory not in (None, True, False):
        raise ConfigError(
            f"DeepSpeed pin_memory={pin_memory!r} is not valid: "
            "use None (pinned on CUDA), True or False."
        )
    if pin_memory is not None and not (offload_optimizer or offload_params):
        raise ConfigError(
            f"DeepSpeed pin_memory={pin_memory!r} needs offload_optimizer or offload_params: "
            "only offloaded host buffers are pinned."
        )


def check_run(spec: RunSpec, strategy_name: str, deepcompile: bool, tp: int) -> None:
    """Checks the Trainer's flags against what DeepSpeed offers, before any rank starts work.

    Raises:
        ConfigError: a stale op-build lock (`check_extension_locks`), clipping by value, clipping
            with manual optimization, 16-mixed off CUDA, a DeepCompile run it cannot compile
            (zero3.check_deepcompile_run), or manual optimization with tp > 1.
    """
    # a killed op build's lock would make every rank wait forever, silently
    check_extension_locks()
    if spec.gradient_clip_algorithm == "value":
        raise ConfigError(
            f"gradient_clip_algorithm='value' is not valid with strategy {strategy_name!r}: it "
            "clips by global norm only. Use 'norm'."
        )
    if spec.gradient_clip_val and not spec.automatic_optimization:
        # every engine would clip on its own
        raise ConfigError(
            f"gradient_clip_val={spec.gradient_clip_val} is not valid with "
            f"automatic_optimization=False under {strategy_name!r} (nor in Lightning): call "
            "self.clip_gradients(opt, gradient_clip_val=...) before opt.step() in "
            "training_step."
        )
    if spec.precision == "16-mixed" and spec.device_type != "cuda":
        # DeepSpeed would refuse it in initialize
        raise ConfigError(
            f"precision='16-mixed' is not valid with DeepSpeed on {spec.device_type}: its CPU "
            "accelerator has no fp16 support. Use '32-true', 'bf16-mixed' or 'bf16-true'."
        )
    if deepcompile:
        check_deepcompile_run(spec)
    if tp > 1 and not spec.automatic_optimization:  # one engine per optimizer there
        raise ConfigError(
            f"automatic_optimization=False is not offered with {strategy_name!r}: DeepSpeed's "
            "AutoTP runs one engine, with automatic optimization. Use tp=1, or FSDP(tp=...)."
        )


def zero_section(
    stage: int,
    *,
    on_cuda: bool,
    buckets: tuple[int, int],
    leaf_numel: int,
    offload: tuple[Offload, Offload],
    pinned: bool,
    nvme_path: str | Path | None,
) -> dict[str, Any]:
    """The config's `zero_optimization` section.

    Args:
        buckets: (allgather_bucket_size, reduce_bucket_size), in elements.
        leaf_numel: stage 3: the elements of the largest leaf block (0: none marked).
        offload: (offload_optimizer, offload_params): the device of each, or None.
    """
    zero: dict[str, Any] = {
        # Overlapping the gradient reduce with the backward is DeepSpeed's stage-3 default and where
        # stage 3 lost to DeepSpeed's own loop on 2 GPUs; CPU ranks have no streams to overlap on.
        "stage": stage,
        "contiguous_gradients": True,
        "overlap_comm": stage == 3 and on_cuda,
        "allgather_bucket_size": buckets[0],
        "reduce_bucket_size": buckets[1],
    }
    if stage == 3 and not on_cuda:
        # CPU ranks (the test suite) partition every parameter, however small, so ZeRO-3's shares
        # can be checked on tiny models. On GPUs small parameters stay whole (DeepSpeed's default:
        # no all-gather per LayerNorm).
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=buckets[1])
    elif stage == 3 and leaf_numel:  # prefetch the next two leaf blocks (zero3.prefetch_bucket)
        zero["stage3_prefetch_bucket_size"] = prefetch_bucket(leaf_numel)
    for key, device in zip(("offload_optimizer", "offload_param"), offload, strict=True):
        if device:
            zero[key] = {"device": device, "pin_memory": pinned}
            if device == "nvme":
                zero[key]["nvme_path"] = str(nvme_path)
    return zero


def strategy_name(stage: int, offload_optimizer: Offload, offload_params: Offload, tp: int) -> str:
    """The strategy's registry name, e.g. "deepspeed_stage_3_offload", "deepspeed_stage_2_tp2"."""
    offload = "_offload" if offload_optimizer or offload_params else ""
    nvme = "_nvme" if "nvme" in (offload_optimizer, offload_params) else ""
    return f"deepspeed_stage_{stage}{offload}{nvme}{f'_tp{tp}' if tp > 1 else ''}"


def trainer_config(
    spec: RunSpec,
    micro_batch_size: int | None,
    zero: dict,
    *,
    deepcompile: bool,
    tensor_parallel: dict | None,
    offload_optimizer: bool,
) -> dict[str, Any]:
    """The config that the Trainer's flags and the strategy's arguments set, with `zero` as its ZeRO
    section and `tensor_parallel` (AutoTP's, or None) as its tensor-parallel one."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size or 1,
        "gradient_accumulation_steps": spec.accumulate_grad_batches,
        "gradient_clipping": float(spec.gradient_clip_val or 0.0),
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,  # off: lightspeed's loggers report progress
        "wall_clock_breakdown": False,
    }
    if deepcompile:
        config["compile"] = {"deepcompile": True}
    if tensor_parallel is not None:
        config["tensor_parallel"] = tensor_parallel
    if offload_optimizer:
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
    return config


def evaluation_config(config: dict, stage: int) -> dict:
    """`config` for an inference-only engine: no optimizer, scheduler or compile sections."""
    config = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler", "compile")}
    if stage < 3:
        # stages 1 and 2 shard optimizer state only, and refuse to run without an optimizer
        config["zero_optimization"] = {**config["zero_optimization"], "stage": 0}
    return config


def check_contradictions(
    ours: dict, merged: dict, spec: RunSpec, stage: int, micro_batch_size: int | None, dp: int
) -> None:
    """Refuses a merged config whose key contradicts the Trainer flag that set it in `ours`.

    Args:
        dp: DeepSpeed's data-parallel size (the world size / tp).
    Raises:
        ConfigError: naming the key, the flag and both values.
    """
    zero = merged.get("zero_optimization", {})
    accumulate = spec.accumulate_grad_batches
    checks: list[tuple[str, Any, str, Any]] = [
        (
            "gradient_accumulation_steps",
            merged["gradient_accumulation_steps"],
            "accumulate_grad_batches",
            accumulate,
        ),
        ("zero_optimization.stage", zero.get("stage"), "DeepSpeed(stage=...)", stage),
        ("bf16.enabled", merged.get("bf16", {}).get("enabled", False), "precision", spec.precision),
        ("fp16.enabled", merged.get("fp16", {}).get("enabled", False), "precision", spec.precision),
    ]
    if micro_batch_size is not None:
        got = merged["train_micro_batch_size_per_gpu"]
        flag = "the train dataloader's batch_size"
        checks.append(("train_micro_batch_size_per_gpu", got, flag, micro_batch_size))
    # The Trainer set clipping; a config without the flag may add its own.
    if spec.gradient_clip_val:
        got = merged["gradient_clipping"]
        checks.append(("gradient_clipping", got, "gradient_clip_val", spec.gradient_clip_val))
    expected: dict[str, Any] = {"bf16.enabled": "bf16" in ours, "fp16.enabled": "fp16" in ours}
    for key, got, flag, flag_value in checks:
        want = expected.get(key, flag_value)
        if got != want and not (isinstance(got, float | int) and float(got) == float(want)):
            raise ConfigError(
                f"DeepSpeed config {key}={got!r} contradicts the Trainer's {flag}={flag_value!r}; "
                "set it in one place."
            )
    want = (micro_batch_size or 0) * accumulate * dp
    if merged.get("train_batch_size", want) != want and micro_batch_size is not None:
        raise ConfigError(
            f"DeepSpeed config train_batch_size={merged['train_batch_size']} contradicts the "
            f"Trainer: batch_size × accumulate_grad_batches × data-parallel size = {want}."
        )


def read_config(config: dict | str | Path | None) -> dict:
    """The user's config as a new dict (None gives {}); a path must hold a JSON object.

    Raises ConfigError naming the path (and the line and column of a JSON syntax error)."""
    if config is None or isinstance(config, dict):
        return copy.deepcopy(config or {})
    path = Path(config)
    if not path.is_file():
        raise ConfigError(
            f"DeepSpeed config={str(config)!r} is not valid. You passed in a path to a DeepSpeed "
            "config but the path does not exist."
        )
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"DeepSpeed config file {path} is not valid JSON: line {e.lineno}, column {e.colno}: "
            f"{e.msg}."
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"DeepSpeed config file {path} must hold a JSON object, not {type(value).__name__}."
        )
    return value


def merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, nested dicts key by key; `over` wins on a conflict."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def engine_dtype(config: dict) -> torch.dtype | None:
    """The dtype DeepSpeed keeps the module's weights in under `config` (bf16 or fp16), or None for
    fp32."""
    if config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if config.get("fp16", {}).get("enabled"):
        return torch.float16
    return None


def cast_floats(value, dtype: torch.dtype | None):
    """`value` with every floating-point tensor in it (through tuples, lists and dicts) cast to
    `dtype`.

    Integer tensors (token ids, labels) and everything else pass unchanged; dtype None returns
    `value` as is. DeepSpeed's bf16/fp16 engine holds low-precision weights, so float inputs must
    match them."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(cast_floats(v, dtype) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, cast_floats(v, dtype)) for k, v in value.items())
    return value


STALE_LOCK_S = (
    15 * 60
)  # a DeepSpeed op build takes one to a few minutes; a lock this old has lost its builder


def check_extension_locks(now: float | None = None) -> None:
    """Refuses to start when torch's extension cache holds a stale build lock.

    DeepSpeed JIT-loads its C++ ops through torch.utils.cpp_extension, which takes a lock file in
    the op's build folder on every load and waits for as long as that file exists. A process killed
    (kill -9, a preempted job) while holding it leaves the file behind, and every later DeepSpeed
    run then waits forever, saying nothing.

    Raises:
        ConfigError: naming each lock file older than STALE_LOCK_S and what to do.
    """
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time() if now is None else now
    stale = [
        p
        for p in [*root.glob("*/lock"), *root.glob("*/*/lock")]
        if now - p.stat().st_mtime > STALE_LOCK_S
    ]
    if stale:
        ages = ", ".join(f"{p} ({(now - p.stat().st_mtime) / 60:.0f} min old)" for p in stale)
        raise ConfigError(
            f"DeepSpeed would wait forever on a stale op build lock: {ages}. A build killed midway "
            "leaves this file; torch waits for it to vanish. If no other process is compiling "
            "DeepSpeed ops now, delete the file and run again."
        )
