"""The one mutable run state: what the loop writes and the Trainer's Lightning names read.

    run = Run(trainer, strategy, callbacks, loggers)  # Trainer.__init__, once
    loop.fit(run, config, model, ...)                 # loop.py and start.py write it; nothing else
    trainer.global_step                               # a property: run.loop.global_step

`Run` holds who takes part (module, strategy, callbacks, loggers), what the launch made
(`Process`), where the loop is (the entry point, the stage, `LoopState`) and what fit set up (the
loaders, the step). loop.py and start.py assign its fields; besides them only the Trainer's setters
for what Lightning lets callbacks set (`should_stop`, `loggers`, `accumulate_grad_batches`, the
callbacks list in place) write here. `run.enter(stage)` is the one place the stage changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import torch

from lightspeed.callbacks import Callback
from lightspeed.checkpoint.checkpointer import Checkpointer
from lightspeed.core.metrics import MetricStore
from lightspeed.core.module import Module
from lightspeed.data.loaders import BatchMover
from lightspeed.loggers import Logger
from lightspeed.profilers import PassThroughProfiler, Profiler
from lightspeed.report.progress import ProgressBar
from lightspeed.runtime.distributed import AgreedMax
from lightspeed.runtime.guard import NonFiniteGuard
from lightspeed.runtime.launch import DistInfo
from lightspeed.runtime.preemption import Preemption
from lightspeed.specs import LoopState, Stage, StepStats

__all__ = ["Fn", "Process", "Run", "Stage", "Status"]

Status = Literal["initializing", "running", "finished", "interrupted"]


class Fn(StrEnum):
    """The entry point running (Lightning's `trainer.state.fn`), and the stage it starts in."""

    FIT = "fit"
    VALIDATE = "validate"
    TEST = "test"
    PREDICT = "predict"

    @property
    def stage(self) -> Stage:
        return Stage.TRAIN if self is Fn.FIT else Stage(self.value)


@dataclass(frozen=True)
class Process:
    """What the launch made, once per process."""

    dist: DistInfo
    move: BatchMover  # how batches reach the device (pinned copies on CUDA)
    checkpointer: Checkpointer


@dataclass
class Run:
    """Everything a run changes as it goes (module docstring)."""

    trainer: Any  # what hooks receive as `trainer` (specs.TrainerView)
    strategy: Any
    callbacks: list[Callback]  # changed in place only: the Checkpointer holds this list
    loggers: list[Logger]
    metrics: MetricStore = field(default_factory=MetricStore)
    env: DistInfo | None = None  # the launch environment, read once (runtime.launch)
    world_size: int = 1
    preemption: Preemption = field(default_factory=lambda: Preemption(()))
    # bf16-true: the batch's floats and the steps' default dtype (perf.precision.input_dtype)
    input_dtype: torch.dtype | None = None
    # -- what the launch made
    process: Process | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    guard: NonFiniteGuard | None = None
    # -- the entry point and where the loop is
    fn: Fn | None = None
    status: Status = "initializing"
    stage: Stage = Stage.TRAIN
    module: Module | None = None  # the entry point's Module
    datamodule: Any = None  # the one given to the last entry point that took one
    configured: Module | None = None  # the Module the strategy configured (configure_model)
    phase: Literal["fit", "eval"] | None = None  # the strategy's set-up (fit serves evaluation)
    fallbacks: tuple[str, ...] | None = None  # strategy="auto": the next plans that fit (plan/)
    first_steps: Any = None  # strategy="auto": plan/fallback.FirstSteps, the first steps' guard
    ckpt_path: str | None = None  # the checkpoint the last entry point loaded (rank 0's path)
    loop: LoopState = field(default_factory=LoopState)
    fitting: bool = False  # inside fit, also while it validates (EarlyStopping acts only then)
    should_stop: bool = False  # a callback asked to stop (EarlyStopping, max_time)
    stop_held: bool = False  # that request waits for min_epochs / min_steps (said once)
    is_last_batch: bool = False  # the epoch's last training batch runs
    skip_rest: bool = False  # on_train_batch_start returned -1 on some rank: the epoch ends
    skip_vote: AgreedMax | None = None  # this epoch's agreement on that -1 (hook overridden)
    # every rank's training batch count known and equal before the epoch; else the ranks agree on
    # the epoch's end step by step (data/epoch_windows.py)
    train_counts_known: bool = True
    train_windows: Any = None  # this epoch's EpochWindows (a stateful loader's position)
    loader_restored: bool = False  # a resume put the stateful training loader where it was saved
    said_uneven: bool = False  # this fit said once that the ranks' streams ended unevenly
    # -- what fit set up
    loaders: dict[Stage, Any] = field(default_factory=dict)  # this process's, distributed
    training_step: Callable[..., Any] | None = None  # the Module's, or compiled (perf.kernels)
    takes_batch_idx: bool = True  # training_step(batch, batch_idx), else training_step(batch)
    compiled_frames: int = 0  # torch.compile's frame count before the first step
    progress: ProgressBar | None = None
    step_stats: StepStats = field(default_factory=StepStats)  # the last step's (grad norm)
    # the accumulation the loop reads each epoch (a GradientAccumulationScheduler sets it)
    accumulate_grad_batches: int = 1
    inference_mode: bool = True  # evaluation under torch.inference_mode (loop.evaluation_context)
    fit_started: bool = False  # a fit has begun: trainer.max_epochs reads its resolved limit
    profiler: Profiler = field(default_factory=PassThroughProfiler)  # Trainer(profiler=...)

    def enter(self, stage: Stage) -> None:
        """The stage changes here only; `self.log` records under it from now on."""
        self.stage, self.metrics.stage = stage, stage.logs_as

    @property
    def global_rank(self) -> int:
        return self.process.dist.rank if self.process else 0

    def print0(self, *args: Any) -> None:
        if self.global_rank == 0:
            print(*args, flush=True)
