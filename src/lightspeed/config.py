"""The Trainer's flags, validated once, before anything is spawned."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .errors import ConfigError
from .specs import RunSpec
from .preemption import check_signals

PRECISION_ALIASES = {
    "32-true": "32-true", "32": "32-true", 32: "32-true",
    "bf16-mixed": "bf16-mixed", "bf16": "bf16-mixed",
    "16-mixed": "16-mixed", "16": "16-mixed", 16: "16-mixed",
    "bf16-true": "bf16-true",
}


def _positive_int(name: str, value, allow_none: bool = False, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"{name}={value!r} is not valid: expected an integer ≥ {minimum}"
                          + (" or None." if allow_none else "."))


def _limit(name: str, value) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (
            isinstance(value, float) and value > 1.0):
        raise ConfigError(f"{name}={value!r} is not valid: expected a fraction in [0.0, 1.0], "
                          "a batch count (int ≥ 0), or None for all.")


@dataclass(frozen=True)
class TrainerConfig:
    accelerator: Literal["auto", "cpu", "gpu", "cuda"] = "auto"
    devices: int | str = "auto"
    num_nodes: int = 1
    precision: str = "32-true"
    max_epochs: int | None = None
    max_steps: int = -1
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: Literal["norm", "value"] = "norm"
    val_check_interval: int | float | None = None
    check_val_every_n_epoch: int | None = 1
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    log_every_n_steps: int = 50
    default_root_dir: str = "."
    seed: int | None = None
    memory_budget: float | None = None  # bytes per device that strategy="auto" plans for (default: what is free)
    # "auto" (= "binsearch") or "power": the largest micro-batch that fits, forecast then tried (micro_batch.py)
    micro_batch: Literal["auto", "binsearch", "power"] | None = None
    micro_batch_trials: int = 25  # at most this many trial runs (Lightning's max_trials)
    deterministic: bool = False
    enable_progress_bar: bool = True
    enable_checkpointing: bool = True
    # True: torch.compile of the repeated blocks (on one device: of the model whole), then of training_step around
    # them (lightspeed.kernels);
    # a dict: the same with these torch.compile options (mode, backend, dynamic, fullgraph, options).
    compile: bool | dict = False
    # "fused": a plain torch Adam/AdamW/SGD without fused/foreach runs its fused kernel (lightspeed.kernels);
    # "as_written": the optimizer exactly as configure_optimizers built it.
    optimizer_kernels: Literal["fused", "as_written"] = "fused"
    # True: on CUDA, batches are copied from page-locked memory on a side stream (data.BatchMover);
    # False: moved as the loader gives them.
    pin_memory: bool = True
    fast_dev_run: bool | int = False  # n batches of train/val/test/predict, 1 epoch, no checkpoints or loggers
    overfit_batches: int | float = 0.0  # the same first batches (unshuffled) for training and validation
    num_sanity_val_steps: int = 2  # validation batches run before training (-1: all), nothing logged
    enable_model_summary: bool = True  # parameters per top-level child, printed at fit start
    on_nonfinite: Literal["stop", "skip", "warn"] = "stop"
    preemption_signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    timeout: float = 600.0

    def __post_init__(self) -> None:
        if self.accelerator not in ("auto", "cpu", "gpu", "cuda"):
            raise ConfigError(f"accelerator={self.accelerator!r} is not valid: use 'auto', 'cpu' or 'gpu'.")
        if self.accelerator in ("gpu", "cuda") and not torch.cuda.is_available():
            raise ConfigError(f"accelerator={self.accelerator!r} is not valid here: no CUDA GPU is visible. "
                              "Use 'cpu' or 'auto'.")
        if self.precision not in PRECISION_ALIASES:
            raise ConfigError(f"precision={self.precision!r} is not valid: use one of "
                              "'32-true', 'bf16-mixed', '16-mixed', 'bf16-true'.")
        object.__setattr__(self, "precision", PRECISION_ALIASES[self.precision])
        if self.devices != "auto":
            _positive_int("devices", self.devices)
            available = self.available_devices()
            if self.devices > available:
                kind = ("CUDA GPU" if self.device_type == "cuda" else "CPU core") + ("s" if available != 1 else "")
                raise ConfigError(f"devices={self.devices!r} is not valid: this machine has {available} {kind}.")
        _positive_int("num_nodes", self.num_nodes)
        _positive_int("max_epochs", self.max_epochs, allow_none=True, minimum=0)
        if not isinstance(self.max_steps, int) or self.max_steps < -1:
            raise ConfigError(f"max_steps={self.max_steps!r} is not valid: expected -1 (no limit) or an integer ≥ 0.")
        _positive_int("accumulate_grad_batches", self.accumulate_grad_batches)
        if self.gradient_clip_algorithm not in ("norm", "value"):
            raise ConfigError(f"gradient_clip_algorithm={self.gradient_clip_algorithm!r} is not valid: "
                              "use 'norm' or 'value'.")
        if self.gradient_clip_val is not None and (
                not isinstance(self.gradient_clip_val, (int, float)) or self.gradient_clip_val < 0):
            raise ConfigError(f"gradient_clip_val={self.gradient_clip_val!r} is not valid: expected a number ≥ 0.")
        if self.val_check_interval is not None:
            _limit("val_check_interval", self.val_check_interval)
        _positive_int("check_val_every_n_epoch", self.check_val_every_n_epoch, allow_none=True)
        for name in ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches"):
            _limit(name, getattr(self, name))
        _positive_int("log_every_n_steps", self.log_every_n_steps)
        if self.optimizer_kernels not in ("fused", "as_written"):
            raise ConfigError(f"optimizer_kernels={self.optimizer_kernels!r} is not valid: use 'fused' (torch's fused "
                              "Adam/AdamW/SGD, DeepSpeed's FusedAdam) or 'as_written'.")
        _compile_options(self.compile)
        if not isinstance(self.pin_memory, bool):
            raise ConfigError(f"pin_memory={self.pin_memory!r} is not valid: use True (on CUDA, copy batches from "
                              "page-locked memory on a side stream) or False (move them as the loader gives them).")
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool) or
                                               not isinstance(self.memory_budget, (int, float)) or
                                               self.memory_budget <= 0):
            raise ConfigError(f"memory_budget={self.memory_budget!r} is not valid: expected bytes per device (> 0) "
                              "or None.")
        if self.micro_batch not in (None, "auto", "binsearch", "power"):
            raise ConfigError(f"micro_batch={self.micro_batch!r} is not valid: use 'auto' (the largest that fits: "
                              "forecast, then real steps, bisecting on out-of-memory), 'binsearch' (the same), "
                              "'power' (halving only) or None (the loader's batch size as given).")
        _positive_int("micro_batch_trials", self.micro_batch_trials)
        if self.seed is not None and not isinstance(self.seed, int):
            raise ConfigError(f"seed={self.seed!r} is not valid: expected an integer or None.")
        if not isinstance(self.num_sanity_val_steps, int) or isinstance(self.num_sanity_val_steps, bool) or (
                self.num_sanity_val_steps < -1):
            raise ConfigError(f"num_sanity_val_steps={self.num_sanity_val_steps!r} is not valid: expected an "
                              "integer ≥ 0, or -1 for every validation batch.")
        _limit("overfit_batches", self.overfit_batches)
        if self.overfit_batches:  # Lightning's meaning: that many batches (or that fraction) for train and val
            object.__setattr__(self, "limit_train_batches", self.overfit_batches)
            object.__setattr__(self, "limit_val_batches", self.overfit_batches)
        if self.on_nonfinite not in ("stop", "skip", "warn"):
            raise ConfigError(f"on_nonfinite={self.on_nonfinite!r} is not valid: use 'stop' (raise, the default), "
                              "'skip' (skip the optimizer step on every rank) or 'warn'.")
        object.__setattr__(self, "preemption_signals", check_signals(self.preemption_signals))
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"timeout={self.timeout!r} is not valid: expected the collective timeout in seconds, "
                              "a number > 0 (default 600).")
        self._apply_fast_dev_run()

    def _apply_fast_dev_run(self) -> None:
        n = self.fast_dev_run
        if not isinstance(n, int) or n < 0:
            raise ConfigError(f"fast_dev_run={n!r} is not valid: expected True/False or a batch count (int ≥ 0).")
        if n is False or n == 0:
            return
        n = 1 if n is True else n
        # As in Lightning: n batches of each loop, one epoch, validation at its end, nothing saved or logged.
        for name, value in (("limit_train_batches", n), ("limit_val_batches", n), ("limit_test_batches", n),
                            ("limit_predict_batches", n), ("max_steps", n), ("max_epochs", 1),
                            ("val_check_interval", None), ("check_val_every_n_epoch", 1),
                            ("num_sanity_val_steps", 0), ("enable_checkpointing", False), ("log_every_n_steps", 1)):
            object.__setattr__(self, name, value)

    def run_spec(self, automatic_optimization: bool) -> RunSpec:
        """The flags a strategy needs (its `check` and `connect`), for a module's optimization mode."""
        return RunSpec(device_type=self.device_type, precision=self.precision,  # type: ignore[arg-type]
                       accumulate_grad_batches=self.accumulate_grad_batches, gradient_clip_val=self.gradient_clip_val,
                       gradient_clip_algorithm=self.gradient_clip_algorithm,
                       automatic_optimization=automatic_optimization, seed=self.seed,
                       optimizer_kernels=self.optimizer_kernels, compile=self.compile, timeout_s=float(self.timeout))

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
        # Lightning's rule: with neither limit set, stop after 1000 epochs.
        if self.max_epochs is not None:
            return self.max_epochs
        return 1000 if self.max_steps == -1 else 2**31


# Lightning's Trainer reads its arguments back as attributes: `self.trainer.max_steps` in configure_optimizers (a
# OneCycleLR's total_steps), `trainer.precision` in a callback. These are the ones lightspeed takes by that name.
READ_BACK = ("max_steps", "precision", "num_nodes", "accumulate_grad_batches", "gradient_clip_val",
             "gradient_clip_algorithm", "val_check_interval", "check_val_every_n_epoch", "limit_train_batches",
             "limit_val_batches", "limit_test_batches", "limit_predict_batches", "log_every_n_steps", "fast_dev_run",
             "overfit_batches", "num_sanity_val_steps", "default_root_dir")


def read_back(trainer: Any, name: str) -> Any:
    """`trainer.<name>` for a Trainer argument (READ_BACK), `max_epochs` as Lightning resolves it (1000 with
    neither limit set, -1 with max_steps only) and `num_devices` (devices per node); AttributeError otherwise."""
    cfg = vars(trainer).get("cfg")
    if cfg is None or name not in (*READ_BACK, "max_epochs", "num_devices"):
        raise AttributeError(f"{type(trainer).__name__!r} object has no attribute {name!r}")
    if name == "max_epochs":
        return cfg.max_epochs if cfg.max_epochs is not None else (1000 if cfg.max_steps == -1 else -1)
    return cfg.local_devices() if name == "num_devices" else getattr(cfg, name)


COMPILE_OPTIONS = ("mode", "backend", "dynamic", "fullgraph", "options")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compile_options(value: Any) -> None:
    """`compile` is a bool or a dict of torch.compile options; a typo would otherwise fail at the first step."""
    if isinstance(value, bool):
        return
    if not isinstance(value, dict) or set(value) - set(COMPILE_OPTIONS):
        wrong = sorted(set(value) - set(COMPILE_OPTIONS)) if isinstance(value, dict) else None
        raise ConfigError(f"compile={value!r} is not valid" + (f" (unknown keys {wrong})" if wrong else "") +
                          f": expected True, False or a dict of torch.compile options, keys among {COMPILE_OPTIONS}.")
    if value.get("mode") not in COMPILE_MODES:
        raise ConfigError(f"compile={{'mode': {value['mode']!r}}} is not valid: torch.compile's modes are "
                          f"{COMPILE_MODES[1:]}.")
