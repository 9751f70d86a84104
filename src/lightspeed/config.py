"""The Trainer's flags: Lightning's flat keyword arguments at the door, checked once before anything
is spawned, then split into the narrow frozen pieces that the loop's functions take.

    config = parse_flags({"max_steps": 100, "precision": "bf16"})  # ConfigError on a bad value
    config.limits.max_steps, config.step.precision, config.run_spec(automatic_optimization=True)
    config.replace(enable_progress_bar=False)                       # checked again, a new Config

`TrainerFlags` declares the flags (types and defaults: what `Trainer(**flags)` and the CLI take);
nothing reads it past `parse_flags`. The pieces: `Launch` (where and how the processes run),
`Step` (how one optimizer step computes), `Limits` (how much runs), `Output` (what a run shows and
writes), `DataOptions` (how loaders are prepared) and `PlanOptions` (the memory planner's inputs).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import MappingProxyType
from typing import Any, Literal

import torch

from lightspeed.errors import ConfigError
from lightspeed.plugins.resolve import plugin_flags
from lightspeed.runtime.preemption import check_signals
from lightspeed.runtime.rng import seed_everything
from lightspeed.specs import PRECISION_ALIASES, Precision, RunSpec, Stage

__all__ = [
    "PRECISION_ALIASES",
    "Config",
    "DataOptions",
    "Launch",
    "Limits",
    "Output",
    "PlanOptions",
    "Step",
    "TrainerFlags",
    "check_sync_batchnorm",
    "parse_duration",
    "parse_flags",
]


@dataclass(frozen=True)
class TrainerFlags:
    """The keyword arguments `Trainer(**flags)` takes (besides strategy, callbacks and logger), with
    Lightning's names, types and defaults. `parse_flags` checks them and splits them."""

    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    devices: int | str = "auto"
    num_nodes: int = 1
    precision: str = "32-true"
    max_epochs: int | None = None
    max_steps: int = -1
    # A requested stop (EarlyStopping, max_time) waits until this many epochs and optimizer steps
    # ran; max_epochs and max_steps still end fit.
    min_epochs: int | None = None
    min_steps: int | None = None
    max_time: str | timedelta | dict | None = None  # "DD:HH:MM:SS", a timedelta or its keywords
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: Literal["norm", "value"] = "norm"
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    reload_dataloaders_every_n_epochs: int = 0  # n > 0: fit asks for its loaders every n epochs
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    log_every_n_steps: int = 50
    default_root_dir: str = "."
    seed: int | None = None
    memory_budget: float | None = None  # bytes per device strategy="auto" plans for (None: free)
    # "auto" (= "binsearch") or "power": the largest micro-batch that fits, forecast then tried
    # (plan/micro_batch.py)
    micro_batch: Literal["auto", "binsearch", "power"] | None = None
    micro_batch_trials: int = 25  # at most this many trial runs (Lightning's max_trials)
    deterministic: bool = False
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    # True: torch.compile of the repeated blocks (on one device: of the model whole), then of
    # training_step around them (lightspeed.perf.kernels); a dict: the same with these
    # torch.compile options (mode, backend, dynamic, fullgraph, options).
    compile: bool | dict = False
    # "fused": a plain torch Adam/AdamW/SGD without fused/foreach runs its fused kernel
    # (lightspeed.perf.kernels); "as_written": the optimizer exactly as configure_optimizers built.
    optimizer_kernels: Literal["fused", "as_written"] = "fused"
    # True: on CUDA, batches are copied from page-locked memory on a side stream
    # (data.BatchMover); False: moved as the loader gives them.
    pin_memory: bool = True
    fast_dev_run: bool | int = False  # n batches of each loop, 1 epoch, no checkpoints or loggers
    overfit_batches: int | float = 0.0  # the same first batches (unshuffled) for train and val
    num_sanity_val_steps: int = 2  # validation batches run before training (-1: all)
    enable_model_summary: bool = True  # parameters per top-level child, printed at fit start
    on_nonfinite: Literal["stop", "skip", "warn"] = "stop"
    preemption_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    requeue: bool = True  # under SLURM a preempted job requeues itself (scontrol requeue)
    barebones: bool = False  # Lightning's: nothing that costs speed (`barebones_flags`)
    timeout: float = 600.0
    benchmark: bool | None = None  # torch.backends.cudnn.benchmark on every rank; None: as it is
    detect_anomaly: bool = False  # torch.autograd's anomaly detection around each entry point
    inference_mode: bool = True  # evaluation under torch.inference_mode (else torch.no_grad)
    use_distributed_sampler: bool = True  # False: every loader keeps its sampler
    sync_batchnorm: bool = False  # on more than one rank, BatchNorm becomes SyncBatchNorm (CUDA)


# ------------------------------------------------------------------ the pieces
@dataclass(frozen=True)
class Launch:
    """Where the processes run, and what each sets process-wide once it is known."""

    accelerator: str
    devices: int | str  # a count per node, or "auto"
    num_nodes: int
    timeout: float  # how long a collective may wait for a rank
    seed: int | None
    deterministic: bool
    benchmark: bool | None
    sync_batchnorm: bool
    detect_anomaly: bool
    inference_mode: bool
    on_nonfinite: Literal["stop", "skip", "warn"]
    preemption_signals: tuple[str, ...]
    requeue: bool

    @property
    def device_type(self) -> str:
        return _device_type(self.accelerator)

    def local_devices(self) -> int:
        if self.devices == "auto":
            return torch.cuda.device_count() if self.device_type == "cuda" else 1
        return int(self.devices)

    def apply_to_process(self) -> None:
        """`seed`, `deterministic` (torch's deterministic algorithms, warning where none exists)
        and `benchmark` (cuDNN's autotuner), on each rank once it is known."""
        if self.seed is not None:
            seed_everything(self.seed)
        if self.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        if self.benchmark is not None:
            torch.backends.cudnn.benchmark = self.benchmark


@dataclass(frozen=True)
class Step:
    """How one optimizer step computes."""

    precision: Precision
    gradient_clip_val: float | None
    gradient_clip_algorithm: Literal["norm", "value"]
    optimizer_kernels: Literal["fused", "as_written"]
    compile: bool | dict


@dataclass(frozen=True)
class Limits:
    """How much runs: epochs, steps, time, batches per stage and per optimizer step, and when
    validation runs. `fast_dev_run` and `overfit_batches` are already applied to the others."""

    max_epochs: int | None
    max_steps: int
    min_epochs: int | None
    min_steps: int | None
    max_time: str | timedelta | dict | None
    accumulate_grad_batches: int
    limit_train_batches: int | float | None
    limit_val_batches: int | float | None
    limit_test_batches: int | float | None
    limit_predict_batches: int | float | None
    val_check_interval: int | float | None
    check_val_every_n_epoch: int | None
    num_sanity_val_steps: int
    reload_dataloaders_every_n_epochs: int
    fast_dev_run: bool | int
    overfit_batches: int | float

    def batches(self, stage: Stage) -> int | float | None:
        """The `limit_*_batches` of `stage` (the sanity check's is validation's)."""
        match stage:
            case Stage.TRAIN:
                return self.limit_train_batches
            case Stage.VALIDATE | Stage.SANITY_CHECK:
                return self.limit_val_batches
            case Stage.TEST:
                return self.limit_test_batches
            case Stage.PREDICT:
                return self.limit_predict_batches

    @property
    def epochs_limit(self) -> int:
        """Lightning's rule: with no limit set (max_epochs, max_steps, max_time), stop after 1000
        epochs."""
        if self.max_epochs is not None and self.max_epochs != -1:
            return self.max_epochs
        none_set = self.max_epochs is None and self.max_steps == -1 and self.max_time is None
        return 1000 if none_set else 2**31

    @property
    def lightning_max_epochs(self) -> int:
        """`trainer.max_epochs` as Lightning resolves it: 1000 with no limit set, -1 with max_steps
        (or max_time) only."""
        if self.max_epochs is not None:
            return self.max_epochs
        return 1000 if self.epochs_limit == 1000 else -1


@dataclass(frozen=True)
class Output:
    """What a run shows and writes: logs, checkpoints, the bar, the model summary."""

    default_root_dir: str
    log_every_n_steps: int
    enable_progress_bar: bool
    enable_model_summary: bool
    enable_checkpointing: bool
    barebones: bool


@dataclass(frozen=True)
class DataOptions:
    """How loaders are prepared for the ranks."""

    pin_memory: bool
    use_distributed_sampler: bool


@dataclass(frozen=True)
class PlanOptions:
    """What the memory planner (plan/) takes: strategy="auto" and micro_batch="auto"."""

    device_type: str
    precision: Precision
    memory_budget: float | None
    micro_batch: Literal["auto", "binsearch", "power"] | None
    micro_batch_trials: int


@dataclass(frozen=True)
class Config:
    """The checked flags in pieces; `flags` keeps them flat, as resolved (the run report's table,
    `replace`)."""

    launch: Launch
    step: Step
    limits: Limits
    output: Output
    data: DataOptions
    plan: PlanOptions
    flags: Mapping[str, Any]

    def run_spec(self, automatic_optimization: bool) -> RunSpec:
        """The flags a strategy needs (its `check` and `connect`), for a module's optimization
        mode."""
        return RunSpec(
            device_type=self.launch.device_type,
            precision=self.step.precision,
            accumulate_grad_batches=self.limits.accumulate_grad_batches,
            gradient_clip_val=self.step.gradient_clip_val,
            gradient_clip_algorithm=self.step.gradient_clip_algorithm,
            automatic_optimization=automatic_optimization,
            seed=self.launch.seed,
            optimizer_kernels=self.step.optimizer_kernels,
            compile=self.step.compile,
            timeout_s=float(self.launch.timeout),
        )

    def as_flags(self) -> dict[str, Any]:
        """The flags as plain values (precision as its name), in TrainerFlags' order."""
        return {k: (v.value if isinstance(v, Precision) else v) for k, v in self.flags.items()}

    def replace(self, **changes: Any) -> Config:
        """A new Config with these flags changed, checked as at the door."""
        return parse_flags({**self.as_flags(), **changes})


# ------------------------------------------------------------------ the door
def parse_flags(flags: dict[str, Any], extra: tuple[str, ...] = ()) -> Config:
    """Checks the Trainer's keyword arguments (`extra`: its own keywords, for the message) and
    returns them in pieces. Raises ConfigError naming the first flag that is not valid."""
    given = {k: v for k, v in flags.items() if k != "plugins"}
    f = TrainerFlags(**_taken({**given, **plugin_flags(flags.get("plugins"), given)}, extra))
    _check_device(f)
    precision = Precision.parse(f.precision)
    devices = f.devices if f.devices == "auto" else _device_count(f.devices, f.accelerator)
    if devices != "auto":
        available = _available_devices(f.accelerator)
        if devices > available:
            kind = ("CUDA GPU" if _device_type(f.accelerator) == "cuda" else "CPU core") + (
                "s" if available != 1 else ""
            )
            raise ConfigError(
                f"devices={devices!r} is not valid: this machine has {available} {kind}."
            )
    _check_limits(f)
    _check_switches(f)
    _check_plan_and_run(f)
    resolved = {
        **{k.name: getattr(f, k.name) for k in dataclasses.fields(TrainerFlags)},
        "precision": precision,
        "devices": devices,
        "preemption_signals": check_signals(f.preemption_signals),
        **_overrides(f),
    }
    return Config(
        launch=_piece(Launch, resolved),
        step=_piece(Step, resolved),
        limits=_piece(Limits, resolved),
        output=_piece(Output, resolved),
        data=_piece(DataOptions, resolved),
        plan=_piece(PlanOptions, {**resolved, "device_type": _device_type(f.accelerator)}),
        flags=MappingProxyType(resolved),
    )


def _piece(cls: type, values: dict[str, Any]) -> Any:
    return cls(**{f.name: values[f.name] for f in dataclasses.fields(cls)})


def _overrides(f: TrainerFlags) -> dict[str, Any]:
    """What `overfit_batches` and then `fast_dev_run` set in place of the flags given: Lightning's
    meanings (the same first batches for training and validation; n batches of each loop, one
    epoch, validation at its end, nothing saved or logged)."""
    out: dict[str, Any] = {}
    if f.overfit_batches:
        out.update(limit_train_batches=f.overfit_batches, limit_val_batches=f.overfit_batches)
    n = f.fast_dev_run
    if n is not False and n != 0:
        n = 1 if n is True else n
        out.update(
            limit_train_batches=n,
            limit_val_batches=n,
            limit_test_batches=n,
            limit_predict_batches=n,
            max_steps=n,
            max_epochs=1,
            val_check_interval=None,
            check_val_every_n_epoch=1,
            num_sanity_val_steps=0,
            enable_checkpointing=False,
            log_every_n_steps=1,
        )
    return out


# ------------------------------------------------------------------ checks, in the door's order
def _positive_int(name: str, value, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(
            f"{name}={value!r} is not valid: expected an integer ≥ {minimum}"
            + (" or None." if allow_none else ".")
        )


def _limit(name: str, value) -> None:
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < 0
        or (isinstance(value, float) and value > 1.0)
    ):
        raise ConfigError(
            f"{name}={value!r} is not valid: expected a fraction in [0.0, 1.0], "
            "a batch count (int ≥ 0), or None for all."
        )


def _check_device(f: TrainerFlags) -> None:
    if f.accelerator not in ("auto", "cpu", "gpu", "cuda"):
        raise ConfigError(
            f"accelerator={f.accelerator!r} is not valid: use 'auto', 'cpu' or 'gpu'."
        )
    if f.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(
            f"accelerator={f.accelerator!r} is not valid here: no CUDA GPU is visible. "
            "Use 'cpu' or 'auto'."
        )


def _check_limits(f: TrainerFlags) -> None:
    """Nodes, epochs, steps, accumulation, clipping, validation cadence, batch limits, logging
    cadence, reloads, and the stopping flags."""
    _positive_int("num_nodes", f.num_nodes)
    if f.max_epochs != -1:  # -1: no epoch limit, as in Lightning
        _positive_int("max_epochs", f.max_epochs, allow_none=True, minimum=0)
    if not isinstance(f.max_steps, int) or f.max_steps < -1:
        raise ConfigError(
            f"max_steps={f.max_steps!r} is not valid: expected -1 (no limit) or an integer ≥ 0."
        )
    _positive_int("accumulate_grad_batches", f.accumulate_grad_batches)
    if f.gradient_clip_algorithm not in ("norm", "value"):
        raise ConfigError(
            f"gradient_clip_algorithm={f.gradient_clip_algorithm!r} is not valid: "
            "use 'norm' or 'value'."
        )
    if f.gradient_clip_val is not None and (
        not isinstance(f.gradient_clip_val, (int, float)) or f.gradient_clip_val < 0
    ):
        raise ConfigError(
            f"gradient_clip_val={f.gradient_clip_val!r} is not valid: expected a number ≥ 0."
        )
    if f.val_check_interval is not None:
        _limit("val_check_interval", f.val_check_interval)
    _positive_int("check_val_every_n_epoch", f.check_val_every_n_epoch, allow_none=True)
    if f.check_val_every_n_epoch is None and isinstance(f.val_check_interval, float):
        raise ConfigError(  # with no epochs to validate in, a fraction of one means nothing
            f"val_check_interval={f.val_check_interval} is a fraction of an epoch, but "
            "check_val_every_n_epoch=None counts training batches across epochs: give "
            "`val_check_interval` as an integer (a number of batches)."
        )
    for stage in ("train", "val", "test", "predict"):
        _limit(f"limit_{stage}_batches", getattr(f, f"limit_{stage}_batches"))
    _positive_int("log_every_n_steps", f.log_every_n_steps)
    _positive_int(
        "reload_dataloaders_every_n_epochs", f.reload_dataloaders_every_n_epochs, minimum=0
    )
    _check_stopping(f)


def _check_stopping(f: TrainerFlags) -> None:
    """min_epochs / min_steps / max_time, and their agreement with max_epochs / max_steps."""
    _positive_int("min_epochs", f.min_epochs, allow_none=True, minimum=0)
    _positive_int("min_steps", f.min_steps, allow_none=True, minimum=0)
    parse_duration("max_time", f.max_time)
    if (
        f.min_epochs
        and f.max_epochs is not None
        and f.max_epochs != -1
        and f.min_epochs > f.max_epochs
    ):
        raise ConfigError(
            f"min_epochs={f.min_epochs} is not valid with max_epochs={f.max_epochs}: "
            "max_epochs ends fit first; expected min_epochs ≤ max_epochs."
        )
    if f.min_steps and f.max_steps != -1 and f.min_steps > f.max_steps:
        raise ConfigError(
            f"min_steps={f.min_steps} is not valid with max_steps={f.max_steps}: "
            "max_steps ends fit first; expected min_steps ≤ max_steps."
        )


def _check_switches(f: TrainerFlags) -> None:
    """The on/off flags, benchmark, optimizer kernels, compile and pin_memory."""
    switches = ("detect_anomaly", "inference_mode", "use_distributed_sampler", "sync_batchnorm")
    for name in (*switches, "requeue", "barebones"):
        if not isinstance(getattr(f, name), bool):
            raise ConfigError(f"{name}={getattr(f, name)!r} is not valid: use True or False.")
    if f.benchmark not in (None, True, False):
        raise ConfigError(
            f"benchmark={f.benchmark!r} is not valid: use True or False (the value of "
            "torch.backends.cudnn.benchmark on every rank) or None (leave it as it is)."
        )
    if f.optimizer_kernels not in ("fused", "as_written"):
        raise ConfigError(
            f"optimizer_kernels={f.optimizer_kernels!r} is not valid: use 'fused' (torch's "
            "fused Adam/AdamW/SGD, DeepSpeed's FusedAdam) or 'as_written'."
        )
    _compile_options(f.compile)
    if not isinstance(f.pin_memory, bool):
        raise ConfigError(
            f"pin_memory={f.pin_memory!r} is not valid: use True (on CUDA, copy batches from "
            "page-locked memory on a side stream) or False (move them as the loader gives them)."
        )


def _check_plan_and_run(f: TrainerFlags) -> None:
    """The planner's flags, seed, the sanity check, overfit_batches, the non-finite policy, the
    collective timeout and fast_dev_run."""
    budget = f.memory_budget
    if budget is not None and (
        isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0
    ):
        raise ConfigError(
            f"memory_budget={budget!r} is not valid: expected bytes per device (> 0) or None."
        )
    if f.micro_batch not in (None, "auto", "binsearch", "power"):
        raise ConfigError(
            f"micro_batch={f.micro_batch!r} is not valid: use 'auto' (the largest that fits: "
            "forecast, then real steps, bisecting on out-of-memory), 'binsearch' (the same), "
            "'power' (halving only) or None (the loader's batch size as given)."
        )
    _positive_int("micro_batch_trials", f.micro_batch_trials)
    if f.seed is not None and not isinstance(f.seed, int):
        raise ConfigError(f"seed={f.seed!r} is not valid: expected an integer or None.")
    steps = f.num_sanity_val_steps
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < -1:
        raise ConfigError(
            f"num_sanity_val_steps={steps!r} is not valid: expected an "
            "integer ≥ 0, or -1 for every validation batch."
        )
    _limit("overfit_batches", f.overfit_batches)
    if f.on_nonfinite not in ("stop", "skip", "warn"):
        raise ConfigError(
            f"on_nonfinite={f.on_nonfinite!r} is not valid: use 'stop' (raise, the default), "
            "'skip' (skip the optimizer step on every rank) or 'warn'."
        )
    check_signals(f.preemption_signals)
    if isinstance(f.timeout, bool) or not isinstance(f.timeout, (int, float)) or not f.timeout > 0:
        raise ConfigError(
            f"timeout={f.timeout!r} is not valid: expected the collective timeout in seconds, "
            "a number > 0 (default 600)."
        )
    n = f.fast_dev_run
    if not isinstance(n, int) or n < 0:
        raise ConfigError(
            f"fast_dev_run={n!r} is not valid: expected True/False or a batch count (int ≥ 0)."
        )


def _device_type(accelerator: str) -> str:
    if accelerator == "cpu":
        return "cpu"
    if accelerator in ("gpu", "cuda"):
        return "cuda"
    return "cuda" if torch.cuda.is_available() else "cpu"


def _available_devices(accelerator: str) -> int:
    if _device_type(accelerator) == "cuda":
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def _device_count(value: Any, accelerator: str) -> int:
    """Lightning's forms of `devices`, as a count: an int or its string ("2"); -1 or "-1" for every
    GPU; GPU indices ([0, 1] or "0,1") when they are the first n, since local rank r takes the r-th
    visible GPU. Other indices are a ConfigError that says how to pick those GPUs."""
    given, cuda = value, _device_type(accelerator) == "cuda"
    if isinstance(given, str):
        parts = [p.strip() for p in given.split(",")]
        if all(p.lstrip("-").isdigit() for p in parts if p) and any(parts):
            value = [int(p) for p in parts if p] if "," in given else int(parts[0])
    if isinstance(value, (list, tuple)):
        if (
            not cuda
            or not value
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
        ):
            raise ConfigError(
                f'devices={given!r} is not valid: GPU indices (a list, or "0,1") need CUDA; '
                "otherwise pass a count (an integer ≥ 1)."
            )
        if sorted(value) != list(range(len(value))):
            raise ConfigError(
                f"devices={given!r} is not valid here: lightspeed gives local rank r the r-th "
                f"visible GPU, so select these GPUs with CUDA_VISIBLE_DEVICES="
                f"{','.join(map(str, value))} and pass devices={len(value)}."
            )
        return len(value)
    if value == -1 and not isinstance(value, bool):
        if not cuda:
            raise ConfigError(
                f"devices={given!r} is not valid on CPU: -1 means every GPU; pass a count of CPU "
                "ranks (an integer ≥ 1)."
            )
        return torch.cuda.device_count()
    if value is not given and (isinstance(value, bool) or value < 1):
        raise ConfigError(
            f'devices={given!r} is not valid: expected an integer ≥ 1, -1 (every GPU), "auto" '
            "or GPU indices."
        )
    _positive_int("devices", value)
    return value


def parse_duration(name: str, value: Any) -> timedelta | None:
    """Lightning's forms of a duration (Trainer's `max_time`, Timer's `duration`): "DD:HH:MM:SS", a
    timedelta, or a dict of timedelta's keywords ({"hours": 12}); None for no limit. ConfigError
    otherwise."""
    if value is None or isinstance(value, timedelta):
        out = value
    elif isinstance(value, str) and re.fullmatch(r"\s*\d+:\d+:\d+:\d+\s*", value):
        days, hours, minutes, seconds = (int(v) for v in value.strip().split(":"))
        out = timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif (
        isinstance(value, dict)
        and value
        and set(value) <= set(_TIMEDELTA_KEYS)
        and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values())
    ):
        out = timedelta(**value)
    else:
        out = timedelta(-1)
    if out is not None and out.total_seconds() <= 0:
        raise ConfigError(
            f'{name}={value!r} is not valid: expected a positive duration as "DD:HH:MM:SS" (e.g. '
            f'"00:12:00:00"), a datetime.timedelta, a dict of its keywords {_TIMEDELTA_KEYS} '
            "(e.g. {'hours': 12}), or None for no limit."
        )
    return out


_TIMEDELTA_KEYS = ("weeks", "days", "hours", "minutes", "seconds", "milliseconds", "microseconds")


def check_sync_batchnorm(launch: Launch, world_size: int) -> None:
    """sync_batchnorm=True needs CUDA once there is more than one rank: torch's DDP refuses
    SyncBatchNorm in a CPU module ("SyncBatchNorm layers only work with GPU modules"), so say so
    before any rank starts."""
    if launch.sync_batchnorm and world_size > 1 and launch.device_type != "cuda":
        raise ConfigError(
            f"sync_batchnorm=True is not valid on {world_size} CPU ranks: torch's SyncBatchNorm "
            "runs on CUDA GPUs only. Use accelerator='gpu', or sync_batchnorm=False (each rank "
            "then normalises with its own batch statistics)."
        )


# Lightning Trainer arguments lightspeed does not take: accepted at Lightning's default (configs
# and argparse namespaces pass them), refused otherwise, saying what to use instead.
NOT_TAKEN = {
    "model_registry": (None, "upload the checkpoint directory yourself"),
}


def _taken(flags: dict[str, Any], extra: tuple[str, ...]) -> dict[str, Any]:
    """The keyword arguments TrainerFlags takes: NOT_TAKEN ones at Lightning's default dropped,
    anything else unknown a ConfigError naming it."""
    fields = sorted(f.name for f in dataclasses.fields(TrainerFlags))
    for name, (default, instead) in NOT_TAKEN.items():
        if name in flags and flags[name] != default:
            raise ConfigError(
                f"{name}={flags[name]!r} is a Lightning Trainer argument lightspeed does not take "
                f"(only its default, {default!r}): {instead}."
            )
    unknown = set(flags) - set(fields) - set(NOT_TAKEN)
    if unknown:
        raise ConfigError(
            f"Trainer got unknown arguments {sorted(unknown)}; accepted: {fields}, "
            f"{', '.join(extra)}."
        )
    return {k: v for k, v in flags.items() if k not in NOT_TAKEN}


COMPILE_OPTIONS = ("mode", "backend", "dynamic", "fullgraph", "options")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compile_options(value: Any) -> None:
    """`compile` is a bool or a dict of torch.compile options; a typo would otherwise fail at the
    first step."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict) or set(value) - set(COMPILE_OPTIONS):
        wrong = sorted(set(value) - set(COMPILE_OPTIONS)) if isinstance(value, dict) else None
        raise ConfigError(
            f"compile={value!r} is not valid"
            + (f" (unknown keys {wrong})" if wrong else "")
            + ": expected True, False or a dict of torch.compile options, keys among "
            + f"{COMPILE_OPTIONS}."
        )
    if value.get("mode") not in COMPILE_MODES:
        raise ConfigError(
            f"compile={{'mode': {value['mode']!r}}} is not valid: torch.compile's modes are "
            f"{COMPILE_MODES[1:]}."
        )
