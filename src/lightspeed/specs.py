"""Plain data types shared across lightspeed: the ground floor, importing nothing of lightspeed but
errors.

RunSpec          the Trainer flags a strategy needs, known before any rank starts
SchedulerConfig  one LR scheduler with Lightning's stepping options
StepStats        what one optimizer step reports (the loop logs it)
LoopState        where the loop is: what a checkpoint must carry to resume exactly
TrainerView      the narrow face of the Trainer that callbacks and the Module use
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypedDict

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]


@dataclass(frozen=True)
class RunSpec:
    """The Trainer flags a strategy needs. Known before launch, so `Strategy.check` can refuse them
    early."""

    device_type: str = "cpu"
    precision: PrecisionName = "32-true"
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

    global_step: int
    current_epoch: int
    should_stop: bool
    fitting: bool
    default_root_dir: str
    cfg: Any  # the validated Trainer flags (config.TrainerConfig)
    strategy: Any
    loggers: list
    callbacks: list
    device: Any
    metrics: Any

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
