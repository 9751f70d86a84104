"""Plain data types shared across lightspeed: the ground floor, importing nothing of lightspeed but
errors.

Precision        the one parsed precision value (a str enum: compares equal to its name)
Stage            what the loop runs now, with what each stage's metrics are logged as
RunSpec          the Trainer flags a strategy needs, known before any rank starts
SchedulerConfig  one LR scheduler with Lightning's stepping options
StepStats        what one optimizer step reports (the loop logs it)
LoopState        where the loop is: what a checkpoint must carry to resume exactly
TrainerView      the narrow face of the Trainer that callbacks and the Module use
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol, TypedDict

from lightspeed.errors import ConfigError


class Precision(StrEnum):
    """`Trainer(precision=...)`, parsed once (`Precision.parse`). A member equals its name as a
    string (`Precision.BF16_MIXED == "bf16-mixed"`), so it reads and prints as Lightning's."""

    TRUE_32 = "32-true"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "16-mixed"
    BF16_TRUE = "bf16-true"

    @classmethod
    def parse(cls, value: Any) -> Precision:
        """Lightning's names and aliases (32, "32", "bf16", 16, "16", ...); ConfigError
        otherwise."""
        try:
            name = PRECISION_ALIASES.get(value)
        except TypeError:  # unhashable
            name = None
        if name is None:
            raise ConfigError(
                f"precision={value!r} is not valid: use one of "
                "'32-true', 'bf16-mixed', '16-mixed', 'bf16-true'."
            )
        return cls(name)

    @property
    def is_mixed(self) -> bool:
        """fp32 weights with autocast to a lower precision (bf16-mixed, 16-mixed)."""
        return self in (Precision.BF16_MIXED, Precision.FP16_MIXED)


PRECISION_ALIASES: dict[str | int, str] = {
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


class Stage(StrEnum):
    """What the loop runs now: Lightning's `trainer.state.stage`. The sanity check is validation
    run before training: its metrics are logged (then discarded) as validation's."""

    TRAIN = "train"
    SANITY_CHECK = "sanity_check"
    VALIDATE = "validate"
    TEST = "test"
    PREDICT = "predict"

    @property
    def logs_as(self) -> str:
        """The stage whose metrics `self.log` records now (core.metrics.MetricStore.stage)."""
        return Stage.VALIDATE.value if self is Stage.SANITY_CHECK else self.value


@dataclass(frozen=True)
class RunSpec:
    """The Trainer flags a strategy needs. Known before launch, so `Strategy.check` can refuse them
    early."""

    device_type: str = "cpu"
    precision: Precision = Precision.TRUE_32
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: Literal["norm", "value"] = "norm"
    automatic_optimization: bool = True
    seed: int | None = None
    optimizer_kernels: Literal["fused", "as_written"] = "fused"  # kernels.apply_fused_optimizers
    compile: bool | dict = (
        False  # kernels.apply_compile (a dict: torch.compile options), before a strategy wraps
    )
    timeout_s: float = 600.0  # how long a collective may wait for a rank before the job fails


@dataclass
class SchedulerConfig:
    """One LR scheduler with Lightning's stepping options (from `configure_optimizers`); Lightning's
    `LRSchedulerConfig`, its fields in Lightning's order."""

    scheduler: Any
    name: str | None = None  # LearningRateMonitor's key for it (Lightning's "name")
    interval: Literal["step", "epoch"] = "epoch"
    frequency: int = 1
    reduce_on_plateau: bool = False  # stepped with the `monitor` metric's value
    monitor: str | None = None
    strict: bool = True  # a missing monitored metric is an error (False: a warning, no step)


class StepStats(TypedDict, total=False):
    """What `Strategy.step()` returns. Values stay tensors (no host sync) until a logger reads
    them."""

    grad_norm: Any  # the global gradient norm before clipping (a 0-d tensor or float), or None
    step_applied: bool  # False when the backend skipped the step itself (DeepSpeed on an overflow)


@dataclass
class LoopState:
    """The loop's position; saved in every checkpoint and restored on resume."""

    epoch: int = 0
    global_step: int = 0
    batches_done: int = 0  # batches of `epoch` already consumed
    epoch_done: bool = False  # the save happened after the epoch's last batch

    @property
    def resume_epoch(self) -> int:
        return self.epoch + (1 if self.epoch_done else 0)

    @property
    def batches_to_skip(self) -> int:
        return 0 if self.epoch_done else self.batches_done


class TrainerView(Protocol):
    """What callbacks and the Module may use of the Trainer (and nothing else)."""

    should_stop: bool  # a callback sets it to ask for a stop (EarlyStopping, Timer)
    strategy: Any
    loggers: list
    run_csv: Any  # the CSVLogger whose metrics.csv the run report reads, or None
    callbacks: list

    @property
    def global_step(self) -> int: ...
    @property
    def current_epoch(self) -> int: ...
    @property
    def fitting(self) -> bool: ...
    @property
    def sanity_checking(self) -> bool: ...
    @property
    def fast_dev_run(self) -> bool | int: ...
    @property
    def default_root_dir(self) -> str: ...
    @property
    def precision(self) -> str: ...
    @property
    def accumulate_grad_batches(self) -> int: ...
    @property
    def log_every_n_steps(self) -> int: ...
    @property
    def num_val_batches(self) -> list: ...
    @property
    def config(self) -> Any: ...  # the validated flags in pieces (config.Config)
    @property
    def device(self) -> Any: ...
    @property
    def metrics(self) -> Any: ...
    @property
    def is_global_zero(self) -> bool: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def callback_metrics(self) -> dict: ...
    def is_log_step(self) -> bool: ...
    def log_metrics(self, metrics: dict[str, float]) -> None: ...
    def print0(self, *args: Any) -> None: ...
    def save_checkpoint(self, path: Any) -> Any: ...
