"""The Trainer's flags, validated once, before anything is spawned."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch

from lightspeed.errors import ConfigError
from lightspeed.runtime.preemption import check_signals
from lightspeed.runtime.rng import seed_everything
from lightspeed.specs import RunSpec

PRECISION_ALIASES = {
    "32-true": "32-true",
    "32": "32-true",
    32: "32-true",
    "bf16-mixed": "bf16-mixed",
    "bf16": "bf16-mixed",
    "16-mixed": "16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
    "bf16-true": "bf16-true",
}


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


@dataclass(frozen=True)
class TrainerConfig:
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    devices: int | str = "auto"
    num_nodes: int = 1
    precision: str = "32-true"
    max_epochs: int | None = None
    max_steps: int = -1
    min_epochs: int | None = (
        None  # a requested stop (EarlyStopping, max_time) waits until this many epochs ran,
    )
    min_steps: int | None = (
        None  # and this many optimizer steps; max_epochs and max_steps still end fit
    )
    max_time: str | timedelta | dict | None = (
        None  # "DD:HH:MM:SS", a timedelta or its keywords: a Timer stops fit
    )
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: Literal["norm", "value"] = "norm"
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    reload_dataloaders_every_n_epochs: int = (
        0  # n > 0: fit asks for its loaders again every n epochs
    )
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    log_every_n_steps: int = 50
    default_root_dir: str = "."
    seed: int | None = None
    memory_budget: float | None = (
        None  # bytes per device that strategy="auto" plans for (default: what is free)
    )
    # "auto" (= "binsearch") or "power": the largest micro-batch that fits, forecast then tried
    # (micro_batch.py)
    micro_batch: Literal["auto", "binsearch", "power"] | None = None
    micro_batch_trials: int = 25  # at most this many trial runs (Lightning's max_trials)
    deterministic: bool = False
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    # True: torch.compile of the repeated blocks (on one device: of the model whole), then of
    # training_step around
    # them (lightspeed.perf.kernels);
    # a dict: the same with these torch.compile options (mode, backend, dynamic, fullgraph,
    # options).
    compile: bool | dict = False
    # "fused": a plain torch Adam/AdamW/SGD without fused/foreach runs its fused kernel
    # (lightspeed.perf.kernels);
    # "as_written": the optimizer exactly as configure_optimizers built it.
    optimizer_kernels: Literal["fused", "as_written"] = "fused"
    # True: on CUDA, batches are copied from page-locked memory on a side stream (data.BatchMover);
    # False: moved as the loader gives them.
    pin_memory: bool = True
    fast_dev_run: bool | int = (
        False  # n batches of train/val/test/predict, 1 epoch, no checkpoints or loggers
    )
    overfit_batches: int | float = (
        0.0  # the same first batches (unshuffled) for training and validation
    )
    num_sanity_val_steps: int = (
        2  # validation batches run before training (-1: all), nothing logged
    )
    enable_model_summary: bool = True  # parameters per top-level child, printed at fit start
    on_nonfinite: Literal["stop", "skip", "warn"] = "stop"
    preemption_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    timeout: float = 600.0
    benchmark: bool | None = (
        None  # torch.backends.cudnn.benchmark on every rank; None leaves it as it is
    )
    detect_anomaly: bool = (
        False  # torch.autograd's anomaly detection around fit / validate / test / predict
    )
    inference_mode: bool = (
        True  # accepted as in Lightning; evaluation runs under torch.no_grad either way
    )
    use_distributed_sampler: bool = (
        True  # False: every loader keeps its sampler (no DistributedSampler added)
    )
    sync_batchnorm: bool = (
        False  # on more than one rank, BatchNorm layers become SyncBatchNorm (CUDA only)
    )

    def __post_init__(self) -> None:
        if self.accelerator not in ("auto", "cpu", "gpu", "cuda"):
            raise ConfigError(
                f"accelerator={self.accelerator!r} is not valid: use 'auto', 'cpu' or 'gpu'."
            )
        if self.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ConfigError(
                f"accelerator={self.accelerator!r} is not valid here: no CUDA GPU is visible. "
                "Use 'cpu' or 'auto'."
            )
        if self.precision not in PRECISION_ALIASES:
            raise ConfigError(
                f"precision={self.precision!r} is not valid: use one of "
                "'32-true', 'bf16-mixed', '16-mixed', 'bf16-true'."
            )
        object.__setattr__(self, "precision", PRECISION_ALIASES[self.precision])
        if self.devices != "auto":
            object.__setattr__(self, "devices", self._device_count(self.devices))
            available = self.available_devices()
            if self.devices > available:
                kind = ("CUDA GPU" if self.device_type == "cuda" else "CPU core") + (
                    "s" if available != 1 else ""
                )
                raise ConfigError(
                    f"devices={self.devices!r} is not valid: this machine has {available} {kind}."
                )
        _positive_int("num_nodes", self.num_nodes)
        if self.max_epochs != -1:  # -1: no epoch limit, as in Lightning
            _positive_int("max_epochs", self.max_epochs, allow_none=True, minimum=0)
        if not isinstance(self.max_steps, int) or self.max_steps < -1:
            raise ConfigError(
                f"max_steps={self.max_steps!r} is not valid: expected -1 (no limit) or an integer "
                "≥ "
                "0."
            )
        _positive_int("accumulate_grad_batches", self.accumulate_grad_batches)
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ConfigError(
                f"gradient_clip_algorithm={self.gradient_clip_algorithm!r} is not valid: "
                "use 'norm' or 'value'."
            )
        if self.gradient_clip_val is not None and (
            not isinstance(self.gradient_clip_val, (int, float)) or self.gradient_clip_val < 0
        ):
            raise ConfigError(
                f"gradient_clip_val={self.gradient_clip_val!r} is not valid: expected a number ≥ 0."
            )
        if self.val_check_interval is not None:
            _limit("val_check_interval", self.val_check_interval)
        _positive_int("check_val_every_n_epoch", self.check_val_every_n_epoch, allow_none=True)
        for name in (
            "limit_train_batches",
            "limit_val_batches",
            "limit_test_batches",
            "limit_predict_batches",
        ):
            _limit(name, getattr(self, name))
        _positive_int("log_every_n_steps", self.log_every_n_steps)
        _positive_int(
            "reload_dataloaders_every_n_epochs", self.reload_dataloaders_every_n_epochs, minimum=0
        )
        self._check_stopping()
        for name in (
            "detect_anomaly",
            "inference_mode",
            "use_distributed_sampler",
            "sync_batchnorm",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"{name}={getattr(self, name)!r} is not valid: use True or False."
                )
        if self.benchmark not in (None, True, False):
            raise ConfigError(
                f"benchmark={self.benchmark!r} is not valid: use True or False (the value of "
                "torch.backends.cudnn.benchmark on every rank) or None (leave it as it is)."
            )
        if self.optimizer_kernels not in ("fused", "as_written"):
            raise ConfigError(
                f"optimizer_kernels={self.optimizer_kernels!r} is not valid: use 'fused' (torch's "
                "fused "
                "Adam/AdamW/SGD, DeepSpeed's FusedAdam) or 'as_written'."
            )
        _compile_options(self.compile)
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(
                f"pin_memory={self.pin_memory!r} is not valid: use True (on CUDA, copy batches "
                "from "
                "page-locked memory on a side stream) or False (move them as the loader gives "
                "them)."
            )
        if self.memory_budget is not None and (
            isinstance(self.memory_budget, bool)
            or not isinstance(self.memory_budget, (int, float))
            or self.memory_budget <= 0
        ):
            raise ConfigError(
                f"memory_budget={self.memory_budget!r} is not valid: expected bytes per device (> "
                "0) "
                "or None."
            )
        if self.micro_batch not in (None, "auto", "binsearch", "power"):
            raise ConfigError(
                f"micro_batch={self.micro_batch!r} is not valid: use 'auto' (the largest that "
                "fits: "
                "forecast, then real steps, bisecting on out-of-memory), 'binsearch' (the same), "
                "'power' (halving only) or None (the loader's batch size as given)."
            )
        _positive_int("micro_batch_trials", self.micro_batch_trials)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed={self.seed!r} is not valid: expected an integer or None.")
        if (
            not isinstance(self.num_sanity_val_steps, int)
            or isinstance(self.num_sanity_val_steps, bool)
            or (self.num_sanity_val_steps < -1)
        ):
            raise ConfigError(
                f"num_sanity_val_steps={self.num_sanity_val_steps!r} is not valid: expected an "
                "integer ≥ 0, or -1 for every validation batch."
            )
        _limit("overfit_batches", self.overfit_batches)
        if (
            self.overfit_batches
        ):  # Lightning's meaning: that many batches (or that fraction) for train and val
            object.__setattr__(self, "limit_train_batches", self.overfit_batches)
            object.__setattr__(self, "limit_val_batches", self.overfit_batches)
        if self.on_nonfinite not in ("stop", "skip", "warn"):
            raise ConfigError(
                f"on_nonfinite={self.on_nonfinite!r} is not valid: use 'stop' (raise, the "
                "default), "
                "'skip' (skip the optimizer step on every rank) or 'warn'."
            )
        object.__setattr__(self, "preemption_signals", check_signals(self.preemption_signals))
        if (
            isinstance(self.timeout, bool)
            or not isinstance(self.timeout, (int, float))
            or not self.timeout > 0
        ):
            raise ConfigError(
                f"timeout={self.timeout!r} is not valid: expected the collective timeout in "
                "seconds, "
                "a number > 0 (default 600)."
            )
        self._apply_fast_dev_run()

    def _device_count(self, value: Any) -> int:
        """Lightning's forms of `devices`, as a count: an int or its string ("2"); -1 or "-1" for
        every GPU; GPU indices ([0, 1] or "0,1") when they are the first n, since local rank r takes
        the r-th visible GPU. Other indices are a ConfigError that says how to pick those GPUs."""
        given = value
        if isinstance(value, str):
            parts = [p.strip() for p in value.split(",")]
            if all(p.lstrip("-").isdigit() for p in parts if p) and any(parts):
                value = [int(p) for p in parts if p] if "," in value else int(parts[0])
        if isinstance(value, (list, tuple)):
            if (
                self.device_type != "cuda"
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
            if self.device_type != "cuda":
                raise ConfigError(
                    f"devices={given!r} is not valid on CPU: -1 means every GPU; pass a count of "
                    "CPU "
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

    def _check_stopping(self) -> None:
        """min_epochs / min_steps / max_time, and their agreement with max_epochs / max_steps."""
        _positive_int("min_epochs", self.min_epochs, allow_none=True, minimum=0)
        _positive_int("min_steps", self.min_steps, allow_none=True, minimum=0)
        parse_duration("max_time", self.max_time)
        if (
            self.min_epochs
            and self.max_epochs is not None
            and self.max_epochs != -1
            and self.min_epochs > self.max_epochs
        ):
            raise ConfigError(
                f"min_epochs={self.min_epochs} is not valid with max_epochs={self.max_epochs}: "
                "max_epochs ends fit first; expected min_epochs ≤ max_epochs."
            )
        if self.min_steps and self.max_steps != -1 and self.min_steps > self.max_steps:
            raise ConfigError(
                f"min_steps={self.min_steps} is not valid with max_steps={self.max_steps}: "
                "max_steps ends fit first; expected min_steps ≤ max_steps."
            )

    def _apply_fast_dev_run(self) -> None:
        n = self.fast_dev_run
        if not isinstance(n, int) or n < 0:
            raise ConfigError(
                f"fast_dev_run={n!r} is not valid: expected True/False or a batch count (int ≥ 0)."
            )
        if n is False or n == 0:
            return
        n = 1 if n is True else n
        # As in Lightning: n batches of each loop, one epoch, validation at its end, nothing saved
        # or logged.
        for name, value in (
            ("limit_train_batches", n),
            ("limit_val_batches", n),
            ("limit_test_batches", n),
            ("limit_predict_batches", n),
            ("max_steps", n),
            ("max_epochs", 1),
            ("val_check_interval", None),
            ("check_val_every_n_epoch", 1),
            ("num_sanity_val_steps", 0),
            ("enable_checkpointing", False),
            ("log_every_n_steps", 1),
        ):
            object.__setattr__(self, name, value)

    def apply_to_process(self) -> None:
        """The flags that set process-wide state, on each rank once it is known: `seed`,
        `deterministic` (torch's deterministic algorithms, warning where none exists) and
        `benchmark` (cuDNN's autotuner)."""
        if self.seed is not None:
            seed_everything(self.seed)
        if self.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
        if self.benchmark is not None:
            torch.backends.cudnn.benchmark = self.benchmark

    def run_spec(self, automatic_optimization: bool) -> RunSpec:
        """The flags a strategy needs (its `check` and `connect`), for a module's optimization
        mode."""
        return RunSpec(
            device_type=self.device_type,
            precision=self.precision,  # type: ignore[arg-type]
            accumulate_grad_batches=self.accumulate_grad_batches,
            gradient_clip_val=self.gradient_clip_val,
            gradient_clip_algorithm=self.gradient_clip_algorithm,
            automatic_optimization=automatic_optimization,
            seed=self.seed,
            optimizer_kernels=self.optimizer_kernels,
            compile=self.compile,
            timeout_s=float(self.timeout),
        )

    @property
    def device_type(self) -> str:
        if self.accelerator == "cpu":
            return "cpu"
        if self.accelerator in ("gpu", "cuda"):
            return "cuda"
        return "cuda" if torch.cuda.is_available() else "cpu"

    def available_devices(self) -> int:
        return torch.cuda.device_count() if self.device_type == "cuda" else (os.cpu_count() or 1)

    def local_devices(self) -> int:
        if self.devices == "auto":
            return torch.cuda.device_count() if self.device_type == "cuda" else 1
        return int(self.devices)

    @property
    def epochs_limit(self) -> int:
        # Lightning's rule: with no limit set (max_epochs, max_steps, max_time), stop after 1000
        # epochs.
        if self.max_epochs is not None and self.max_epochs != -1:
            return self.max_epochs
        return (
            1000
            if self.max_epochs is None and self.max_steps == -1 and self.max_time is None
            else 2**31
        )


def check_sync_batchnorm(cfg: TrainerConfig, world_size: int) -> None:
    """sync_batchnorm=True needs CUDA once there is more than one rank: torch's DDP refuses
    SyncBatchNorm in a CPU module ("SyncBatchNorm layers only work with GPU modules"), so say so
    before any rank starts."""
    if cfg.sync_batchnorm and world_size > 1 and cfg.device_type != "cuda":
        raise ConfigError(
            f"sync_batchnorm=True is not valid on {world_size} CPU ranks: torch's SyncBatchNorm "
            "runs "
            "on CUDA GPUs only. Use accelerator='gpu', or sync_batchnorm=False (each rank then "
            "normalises with its own batch statistics)."
        )


# Lightning Trainer arguments lightspeed does not take: accepted at Lightning's default (configs and
# argparse
# namespaces pass them), refused otherwise, saying what to use instead.
NOT_TAKEN = {
    "profiler": (
        None,
        "profile with torch.profiler around fit (benchmarks/profile_step.py shows how)",
    ),
    "plugins": (
        None,
        "precision is Trainer(precision=...); the launch environment (torchrun, SLURM, deepspeed) "
        "is read by itself",
    ),
    "barebones": (
        False,
        "pass enable_progress_bar=False, enable_checkpointing=False, logger=False and "
        "enable_model_summary=False",
    ),
    "model_registry": (None, "upload the checkpoint directory yourself"),
}


def trainer_flags(flags: dict[str, Any], extra: tuple[str, ...]) -> dict[str, Any]:
    """The Trainer's keyword arguments that TrainerConfig takes: NOT_TAKEN ones at Lightning's
    default dropped, anything else unknown a ConfigError naming it (`extra`: the Trainer's own
    keywords, for the message)."""
    fields = sorted(f.name for f in dataclasses.fields(TrainerConfig))
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


# Lightning's Trainer reads its arguments back as attributes: `self.trainer.max_steps` in
# configure_optimizers (a
# OneCycleLR's total_steps), `trainer.precision` in a callback. These are the ones lightspeed takes
# by that name.
READ_BACK = (
    "max_steps",
    "precision",
    "num_nodes",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "val_check_interval",
    "check_val_every_n_epoch",
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
    "log_every_n_steps",
    "fast_dev_run",
    "overfit_batches",
    "num_sanity_val_steps",
    "default_root_dir",
    "min_epochs",
    "min_steps",
    "reload_dataloaders_every_n_epochs",
)


def read_back(trainer: Any, name: str) -> Any:
    """`trainer.<name>` for a Trainer argument (READ_BACK), `max_epochs` as Lightning resolves it
    (1000 with neither limit set, -1 with max_steps only) and `num_devices` (devices per node);
    AttributeError otherwise."""
    cfg = vars(trainer).get("cfg")
    if cfg is None or name not in (*READ_BACK, "max_epochs", "num_devices"):
        raise AttributeError(f"{type(trainer).__name__!r} object has no attribute {name!r}")
    if name == "max_epochs":
        return (
            cfg.max_epochs
            if cfg.max_epochs is not None
            else (1000 if cfg.epochs_limit == 1000 else -1)
        )
    return cfg.local_devices() if name == "num_devices" else getattr(cfg, name)


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
