"""The Trainer: Lightning's keyword arguments at the door; fit / validate / test / predict, each in
try/finally; Lightning's names for what a run holds, as plain properties.

    trainer = Trainer(devices=2, strategy="deepspeed_stage_3", max_steps=100)
    trainer.fit(model, train_loader)

Follow one batch: `fit` plans (before any rank starts), starts the run (`start.start`: the launch,
the setup hooks), confirms the micro-batch, then `loop.fit` runs the epochs; `loop.train_epoch`
groups batches into accumulation windows and `loop.train_window` moves each micro-batch to the
device, runs `training_step` through `strategy.forward`, `strategy.backward(loss)`, then one
`strategy.step()`. The run's state lives in one `Run` (run.py), written by loop.py and start.py;
backend code lives behind the Strategy protocol (strategies/base.py), checkpoint files behind the
Checkpointer.
"""

from __future__ import annotations

import ast
import contextlib
import os
import signal
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from lightspeed import loop, start
from lightspeed.accelerators import Accelerator, accelerator_for
from lightspeed.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightspeed.config import check_sync_batchnorm, parse_flags
from lightspeed.core.datamodule import LightningDataModule
from lightspeed.core.module import Module
from lightspeed.data.loaders import BatchMover, estimated_stepping_batches, num_batches
from lightspeed.errors import ConfigError
from lightspeed.hooks import is_overridden, trainer_callbacks
from lightspeed.loggers import Logger
from lightspeed.loggers.build import RunRecord, build_loggers
from lightspeed.loggers.csv_logs import CSVLogger
from lightspeed.loggers.logger import DummyLogger
from lightspeed.loops import _EvaluationLoop
from lightspeed.loops.fit_loop import FitLoopView
from lightspeed.perf.kernels import unwrap_compiled
from lightspeed.perf.precision import input_dtype
from lightspeed.plan.micro_batch import confirm
from lightspeed.plugins.resolve import barebones_flags
from lightspeed.profilers import build_profiler
from lightspeed.run import Fn, Run, Stage
from lightspeed.runtime.distributed import OwnGroup
from lightspeed.runtime.launch import DistInfo, read_dist_info
from lightspeed.runtime.preemption import Preemption
from lightspeed.runtime.rng import seed_everything
from lightspeed.strategies import build_strategy
from lightspeed.trainer.configuration_validator import verify_loop_configuration
from lightspeed.trainer.states import RunningStage, TrainerFn, TrainerState, TrainerStatus
from lightspeed.utilities.rank_zero import rank_zero_info

__all__ = ["Trainer", "TrainerState", "seed_everything"]


class Trainer:
    """Runs a Module's loops on one device, DDP, DeepSpeed ZeRO 1/2/3, ZeRO-1 or FSDP2.

    Every flag is validated here, before any rank is started; bad values raise ConfigError. See
    config.TrainerFlags for the flags and their accepted values.
    """

    def __init__(
        self,
        *,
        strategy: Any = "auto",
        callbacks: list[Callback] | None = None,
        logger: bool | Logger | list[Logger] = True,
        profiler: Any = None,
        **flags: Any,
    ):
        # Lightning's `PL_TRAINER_<FLAG>` variables: defaults for what the call leaves out
        env = _flags_from_env()
        flags = {**{k: v for k, v in env.items() if k not in _NAMED}, **flags}
        strategy = env.get("strategy", strategy) if strategy == "auto" else strategy
        logger = env.get("logger", logger) if logger is True else logger
        profiler = env.get("profiler", profiler) if profiler is None else profiler
        flags = barebones_flags(flags, logger, profiler)
        logger = False if flags.get("barebones") else logger
        self.config = config = parse_flags(flags, _NAMED)
        if config.output.barebones:
            rank_zero_info(
                "barebones=True: checkpointing, the progress bar, the model summary, logging "
                "(self.log records nothing), the sanity check and the run report are off."
            )
        _say_limits(flags)
        env = read_dist_info()  # the launch environment, read once
        launch = config.launch
        # devices=1 inside a running multi-rank job (Trainer(devices=1).test(...) on rank 0 after a
        # distributed fit): one process with a process group of its own (distributed.OwnGroup).
        self._own_group: OwnGroup | None = None
        alone = launch.devices != "auto" and launch.local_devices() * launch.num_nodes == 1
        if env.launcher != "none" and alone and OwnGroup.inside_a_job():
            env, self._own_group = DistInfo(own_group=True), OwnGroup()
        if env.launcher == "none":
            if launch.num_nodes > 1:
                raise ConfigError(
                    f"num_nodes={launch.num_nodes} needs a multi-node launcher (torchrun, srun or "
                    "deepspeed); a plain `python` run starts local ranks only."
                )
            world_size = launch.local_devices() * launch.num_nodes
        else:
            world_size = env.world_size
            if launch.devices != "auto" and launch.local_devices() * launch.num_nodes != world_size:
                raise ConfigError(
                    f"devices={launch.devices} × num_nodes={launch.num_nodes} does not match the "
                    f"{env.launcher} world size {world_size}."
                )
        # "auto" plans from a memory forecast at fit (plan/) on GPUs, or on CPU given a budget.
        self._plans = strategy in ("auto", None) and (
            launch.device_type == "cuda" or config.plan.memory_budget is not None
        )
        strategy_object = build_strategy(strategy, world_size)
        given_callbacks = trainer_callbacks(callbacks, config.limits, config.output)
        check_sync_batchnorm(launch, world_size)
        fast = config.limits.fast_dev_run
        loggers: list[Logger] = build_loggers(
            logger if not fast else False, config.output.default_root_dir
        )
        if fast and logger not in (False, None):  # as Lightning: one that logs nothing
            loggers = [cast(Logger, DummyLogger())]  # a Logger by its methods
        self._run = Run(
            trainer=self,
            strategy=strategy_object,
            callbacks=given_callbacks,
            loggers=loggers,
            env=env,
            world_size=world_size,
            preemption=Preemption(launch.preemption_signals, launch.requeue),
            input_dtype=input_dtype(config.step.precision),
            accumulate_grad_batches=config.limits.accumulate_grad_batches,
            inference_mode=config.launch.inference_mode,
            profiler=build_profiler(profiler),
        )

    # ------------------------------------------------------------------ an entry point's frame
    @contextlib.contextmanager
    def _entry(self, module: Module, fn: Fn, datamodule: Any) -> Iterator[Module]:
        """Wraps fit / validate / test / predict: whatever happens, the bar stops and the loggers
        are finalised; on an exception the `on_exception` hooks run and the strategy is torn down
        before it propagates."""
        compiling = bool(self.config.step.compile)
        module, turned_on = unwrap_compiled(module, compiling, self.print0)  # fit(compile(model))
        if turned_on is not None:
            self.config = self.config.replace(compile=turned_on)
        anomaly = (
            torch.autograd.set_detect_anomaly(True)
            if self.config.launch.detect_anomaly
            else contextlib.nullcontext()
        )
        if self._own_group is not None:
            OwnGroup.check_module(module)  # sharded across the job: it cannot run here alone
        own_group = self._own_group.entered() if self._own_group else contextlib.nullcontext()
        own_group.__enter__()
        loop.begin(self._run, fn, module, datamodule)
        outcome = "failed"
        try:
            yield module
            outcome = "success"
        except BaseException as exc:
            outcome = (
                "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
            )
            loop.on_exception(self._run, module, exc)
            if isinstance(exc, KeyboardInterrupt):
                # As Lightning: Ctrl+C (or a KeyboardInterrupt a hook raises) shuts down gracefully:
                # on_exception has run, the finally below tears down, then the process exits 1.
                self.print0("Detected KeyboardInterrupt, attempting graceful shutdown ...")
                raise SystemExit(1) from exc
            raise
        finally:
            anomaly.__exit__(None, None, None)  # detect_anomaly: restored
            loop.finish(self._run, outcome)
            own_group.__exit__(None, None, None)  # the job's process group is back

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        model: Module,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> None:
        """Trains `model` on the given loaders, else the DataModule's, else the Module's.
        `ckpt_path` ("last", "best", a .ckpt file or directory, Lightning's too) resumes where it
        was saved. Validation runs only if `validation_step` is overridden."""
        _check_weights_only(weights_only)
        train_dataloaders, datamodule = _datamodule_given(train_dataloaders, datamodule)
        # `is None`, not truthiness: len() of a user's sampler may need the ranks (not started yet)
        given = train_dataloaders if train_dataloaders is not None else val_dataloaders
        _one_source("fit", given, datamodule)
        verify_loop_configuration(self, "fit", model, datamodule, val_dataloaders)
        if (
            train_dataloaders is None
            and datamodule is None
            and not is_overridden(model, "train_dataloader")
        ):
            raise ConfigError(
                f"fit needs training data: pass train_dataloaders= or define train_dataloader() on "
                f"{type(model).__name__}."
            )
        # LearningRateFinder / BatchSizeFinder (lightspeed.tuner) run their short trial fits here,
        # where Lightning runs them at fit start; they leave the model and this Trainer as they
        # were.
        for tuner in [cb for cb in self.callbacks if hasattr(cb, "run_before_fit")]:
            cast(Any, tuner).run_before_fit(
                self, model, train_dataloaders, val_dataloaders, datamodule
            )
        run = self._run
        with self._entry(model, Fn.FIT, datamodule) as model:
            # the plan step, before any rank starts: strategy="auto", micro_batch="auto"'s forecast
            forecast = start.plan(run, self.config, model, train_dataloaders, self._plans)
            resume = start.start(run, self.config, Fn.FIT, model, ckpt_path, self._plans)
            # the micro-batch step: the forecast tried in the loop's own steps, the size written
            confirm(forecast, run.strategy, model, partial(loop.trial_step, run))
            loop.fit(run, self.config, model, train_dataloaders, val_dataloaders, resume)
            if run.process is not None:  # a resume's checksum verdict, before fit ends well
                run.process.checkpointer.settle()

    # ------------------------------------------------------------------ evaluation
    def validate(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: Any = None,
        weights_only: bool | None = None,
    ) -> list[dict]:
        """Runs `validation_step` over the data (one loader or several); returns [epoch metrics] and
        prints them. Without `model`, the fitted one."""
        _check_weights_only(weights_only)
        dataloaders, datamodule = _datamodule_given(dataloaders, datamodule)
        _one_source("validate", dataloaders, datamodule)
        model = self._model_for(Fn.VALIDATE, model)
        verify_loop_configuration(self, "validate", model)
        with self._entry(model, Fn.VALIDATE, datamodule) as model:
            results = loop.evaluate(
                self._run, self.config, Fn.VALIDATE, model, dataloaders, ckpt_path, self._plans
            )
        return self._report(Fn.VALIDATE, results, verbose)

    def test(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: Any = None,
        weights_only: bool | None = None,
    ) -> list[dict]:
        """Runs `test_step` over the data (one loader or several); returns [epoch metrics] and
        prints them. Without `model`, the fitted one."""
        _check_weights_only(weights_only)
        dataloaders, datamodule = _datamodule_given(dataloaders, datamodule)
        _one_source("test", dataloaders, datamodule)
        model = self._model_for(Fn.TEST, model)
        verify_loop_configuration(self, "test", model)
        with self._entry(model, Fn.TEST, datamodule) as model:
            results = loop.evaluate(
                self._run, self.config, Fn.TEST, model, dataloaders, ckpt_path, self._plans
            )
        return self._report(Fn.TEST, results, verbose)

    def predict(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        return_predictions: bool | None = None,
        ckpt_path: str | Path | None = None,
        weights_only: bool | None = None,
    ) -> list | None:
        """Returns this rank's `predict_step` outputs in the order of its batches: a list, or one
        list per loader when there are several. Without `model`, the fitted one."""
        keep = return_predictions is not False
        _check_weights_only(weights_only)
        dataloaders, datamodule = _datamodule_given(dataloaders, datamodule)
        _one_source("predict", dataloaders, datamodule)
        model = self._model_for(Fn.PREDICT, model)
        verify_loop_configuration(self, "predict", model)
        with self._entry(model, Fn.PREDICT, datamodule) as model:
            outputs = loop.predict(
                self._run, self.config, model, dataloaders, ckpt_path, self._plans, keep
            )
        return None if not keep else outputs if len(outputs) > 1 else outputs[0]

    def _model_for(self, fn: Fn, model: Module | None) -> Module:
        model = model if model is not None else self._run.module
        if model is None:
            raise ConfigError(
                f"{fn}() got no model and none was fitted: pass the model, {fn}(model, ...)."
            )
        return model

    def _report(self, fn: Fn, results: list[dict[str, float]], verbose: bool) -> list[dict]:
        """Prints Lightning's results table on rank 0 (`verbose`); returns one dict per loader."""
        if self.is_global_zero and verbose:
            _EvaluationLoop._print_results(results, fn.value)
        return results

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path) -> Path:
        """Collective: every rank must call it. Writes atomically at rank 0's `path` (Lightning's
        one .ckpt file under single and ddp, a directory under the sharded strategies), then moves
        `<dir>/last.ckpt` to it.

        Raises ConfigError before fit / validate / test / predict: no model is set up, nothing to
        save."""
        if self._run.process is None or self._run.configured is None:
            raise ConfigError(
                f"save_checkpoint({str(path)!r}) was called before fit, validate, test or predict: "
                "no model is set up on the strategy yet, so there is nothing to save. Call it "
                "after one of them."
            )
        return start.save_checkpoint(self._run, Path(path))

    # ------------------------------------------------------------------ for callbacks
    def print0(self, *args: Any) -> None:
        self._run.print0(*args)

    def is_log_step(self) -> bool:
        return self.global_step % self.config.output.log_every_n_steps == 0

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Sends metrics to every logger (rank 0 only), at the current global step."""
        loop.log_metrics(self._run, metrics)

    # ================================================================== Lightning's names
    # Read-only views of the run state (run.py) and the flags (config.py), in Lightning's names.
    # None runs a collective, so reading one on a single rank (inside `rank_zero_only` code) cannot
    # leave the others waiting; where Lightning agrees on a value inside the property (`log_dir`),
    # lightspeed agreed on it once, at launch (loggers.agree_log_dirs).

    # -- where this process is
    @property
    def global_rank(self) -> int:
        return self._run.global_rank

    @property
    def local_rank(self) -> int:
        return self._run.process.dist.local_rank if self._run.process else 0

    @property
    def node_rank(self) -> int:
        run = self._run
        return run.process.dist.node_rank if run.process else run.env.node_rank

    @property
    def world_size(self) -> int:
        return self._run.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def device(self) -> torch.device:
        return self._run.device

    @property
    def accelerator(self) -> Accelerator:
        """The device family (Lightning's `trainer.accelerator`): `CUDAAccelerator` or
        `CPUAccelerator`, from the `accelerator` flag as resolved."""
        return accelerator_for(self.config.launch.device_type)

    @property
    def dist(self) -> DistInfo | None:
        return self._run.process.dist if self._run.process else None

    @property
    def move(self) -> BatchMover:
        """How batches reach the device (after the launch; AttributeError before)."""
        if self._run.process is None:
            raise AttributeError("'Trainer' object has no attribute 'move' before the launch")
        return self._run.process.move

    # -- what runs now
    @property
    def state(self) -> TrainerState:
        run = self._run
        stage = run.stage.value if run.fn else None
        return TrainerState(
            TrainerFn(run.fn.value) if run.fn else None,
            RunningStage(stage) if stage else None,
            TrainerStatus(run.status),
        )

    training = property(lambda self: self._run.stage is Stage.TRAIN)
    validating = property(lambda self: self._run.stage in (Stage.VALIDATE, Stage.SANITY_CHECK))
    testing = property(lambda self: self._run.stage is Stage.TEST)
    predicting = property(lambda self: self._run.stage is Stage.PREDICT)
    sanity_checking = property(lambda self: self._run.stage is Stage.SANITY_CHECK)
    evaluating = property(
        lambda self: self._run.stage in (Stage.VALIDATE, Stage.TEST, Stage.SANITY_CHECK)
    )
    fitting = property(lambda self: self._run.fitting)  # inside fit, also while it validates
    interrupted = property(lambda self: self._run.status == "interrupted")  # an exception ended it
    received_sigterm = property(lambda self: self._run.preemption.received == signal.SIGTERM)
    ckpt_path = property(lambda self: self._run.ckpt_path)  # the last run's, as rank 0 resolved it
    is_last_batch = property(lambda self: self._run.is_last_batch)
    global_step = property(lambda self: self._run.loop.global_step)
    fit_loop = property(  # read-only: limits and progress
        lambda self: FitLoopView(self, lambda: (self._run.loop, self._run.metrics.in_batch))
    )
    current_epoch = property(lambda self: self._run.loop.epoch)

    @property
    def should_stop(self) -> bool:
        return self._run.should_stop

    @should_stop.setter
    def should_stop(self, value: bool) -> None:  # a callback asks for a stop (EarlyStopping)
        self._run.should_stop = value

    # -- the model, the strategy, its optimizers
    strategy = property(lambda self: self._run.strategy)
    lightning_module = property(lambda self: self._run.module)  # the last entry point's Module
    datamodule = property(lambda self: self._run.datamodule)
    guard = property(lambda self: self._run.guard)  # NonFiniteGuard (after the launch)
    profiler = property(lambda self: self._run.profiler)  # times the hooks and steps

    @property
    def model(self) -> Any:
        """What the strategy runs: the DDP wrapper, the DeepSpeed engine, else the Module (FSDP2
        shards in place)."""
        model = self.strategy.model  # None until the strategy is set up
        return model if model is not None else self._run.module

    optimizers = property(lambda self: self.strategy.optimizers)
    lr_scheduler_configs = property(lambda self: self.strategy.schedulers)  # SchedulerConfig each

    # -- the data, and how many batches of it
    @property
    def train_dataloader(self) -> Any:
        """With its DistributedSampler; several training loaders: their dict / list."""
        train = self._run.loaders.get(Stage.TRAIN)
        return getattr(train, "iterables", train)

    val_dataloaders = property(lambda self: _one_or_list(self._run.loaders.get(Stage.VALIDATE)))
    test_dataloaders = property(lambda self: _one_or_list(self._run.loaders.get(Stage.TEST)))
    predict_dataloaders = property(lambda self: _one_or_list(self._run.loaders.get(Stage.PREDICT)))

    @property
    def num_training_batches(self) -> int | float:
        """This rank's training batches per epoch after `limit_train_batches` (inf before fit or
        without a length)."""
        train = self._run.loaders.get(Stage.TRAIN)
        limit = self.config.limits.limit_train_batches
        return float("inf") if train is None else num_batches(train, limit)

    def _counts(self, stage: Stage) -> list[int | float]:
        limit = self.config.limits.batches(stage)
        return [num_batches(loader, limit) for loader in self._run.loaders.get(stage) or []]

    num_val_batches = property(lambda self: self._counts(Stage.VALIDATE))  # one per loader
    num_test_batches = property(lambda self: self._counts(Stage.TEST))
    num_predict_batches = property(lambda self: self._counts(Stage.PREDICT))

    @property
    def num_sanity_val_batches(self) -> list[int | float]:
        steps = self.config.limits.num_sanity_val_steps
        return [n if steps == -1 else min(n, steps) for n in self.num_val_batches]

    @property
    def estimated_stepping_batches(self) -> int | float:
        return estimated_stepping_batches(self._run.loaders.get(Stage.TRAIN), self.config.limits)

    # -- callbacks, metrics, loggers
    @property
    def callbacks(self) -> list[Callback]:
        return self._run.callbacks

    @callbacks.setter
    def callbacks(self, callbacks: list[Callback]) -> None:  # in place: the Checkpointer holds it
        self._run.callbacks[:] = list(callbacks)

    metrics = property(lambda self: self._run.metrics)  # the self.log store (core.metrics)
    callback_metrics = property(lambda self: self._run.metrics.latest)
    logged_metrics = property(lambda self: self._run.metrics.logged)  # the last sent to loggers
    progress_bar_metrics = property(lambda self: self._run.metrics.prog_bar_values())
    checkpoint_callbacks = property(
        lambda self: [c for c in self.callbacks if isinstance(c, ModelCheckpoint)]
    )
    checkpoint_callback = property(lambda self: next(iter(self.checkpoint_callbacks), None))
    early_stopping_callbacks = property(
        lambda self: [c for c in self.callbacks if isinstance(c, EarlyStopping)]
    )
    early_stopping_callback = property(lambda self: next(iter(self.early_stopping_callbacks), None))
    progress_bar_callback = property(  # the RichProgressBar / TQDMProgressBar given, or None
        lambda self: next((c for c in self.callbacks if getattr(c, "is_progress_bar", False)), None)
    )

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    @logger.setter
    def logger(self, logger: Logger | None) -> None:  # as Lightning's: the only logger, or none
        self.loggers = [logger] if logger else []

    @property
    def accumulate_grad_batches(self) -> int:
        """The accumulation in force: the flag, or what a GradientAccumulationScheduler set."""
        return self._run.accumulate_grad_batches

    @accumulate_grad_batches.setter
    def accumulate_grad_batches(self, value: int) -> None:  # as Lightning's
        self._run.accumulate_grad_batches = value

    @property
    def loggers(self) -> list[Logger]:
        """The loggers as the user gave them (`logger=True`: one TensorBoardLogger, as Lightning's;
        its RunRecord, the report's metrics.csv, is left out of this list)."""
        return [lg for lg in self._run.loggers if not isinstance(lg, RunRecord)]

    @property
    def run_csv(self) -> CSVLogger | None:
        """The CSVLogger whose metrics.csv the run report reads: the default logger's RunRecord,
        else the first CSVLogger given, else None."""
        return next((lg for lg in self._run.loggers if isinstance(lg, CSVLogger)), None)

    @loggers.setter
    def loggers(self, loggers: list[Logger]) -> None:  # as Lightning's
        self._run.loggers = loggers

    @property
    def checkpoint_dir(self) -> Path:
        return start.checkpoint_dir(self.callbacks, self.config.output.default_root_dir)

    @property
    def log_dir(self) -> str:
        """The first logger's folder (its `log_dir`, else its `save_dir`), else `default_root_dir`:
        the same on every rank (agreed at launch), as Lightning's, without its broadcast on each
        read."""
        if not self.loggers:
            return str(self.default_root_dir)
        first = self.loggers[0]
        folder = getattr(first, "log_dir", None) or getattr(first, "save_dir", None)
        return str(folder) if folder is not None else str(self.default_root_dir)

    # -- the Trainer's arguments read back, as Lightning's (trainer.max_steps in
    # configure_optimizers, sizing a OneCycleLR), as resolved (fast_dev_run and overfit_batches
    # applied). An unknown name is an AttributeError, as for any attribute.
    precision = property(lambda self: self.config.step.precision.value)
    gradient_clip_val = property(lambda self: self.config.step.gradient_clip_val)
    gradient_clip_algorithm = property(lambda self: self.config.step.gradient_clip_algorithm)
    num_nodes = property(lambda self: self.config.launch.num_nodes)
    num_devices = property(lambda self: self.config.launch.local_devices())  # per node
    barebones = property(lambda self: self.config.output.barebones)

    @property
    def device_ids(self) -> list[int]:
        """This node's device indices (Lightning's): 0 .. num_devices - 1, each rank's GPU being
        cuda:<local rank>."""
        return list(range(self.num_devices))

    @property
    def max_epochs(self) -> int | None:
        """As given; not given, None until a fit starts, then as Lightning resolves it (1000 with
        no limit set, -1 with max_steps or max_time only)."""
        limits = self.config.limits
        if limits.max_epochs is not None or self._run.fit_started:
            return limits.lightning_max_epochs
        return None

    max_steps = property(lambda self: self.config.limits.max_steps)
    min_epochs = property(lambda self: self.config.limits.min_epochs)
    min_steps = property(lambda self: self.config.limits.min_steps)
    val_check_interval = property(  # None (the epoch's end) reads back as Lightning's 1.0
        lambda self: v if (v := self.config.limits.val_check_interval) is not None else 1.0
    )
    check_val_every_n_epoch = property(lambda self: self.config.limits.check_val_every_n_epoch)
    limit_train_batches = property(lambda self: self.config.limits.limit_train_batches)
    limit_val_batches = property(lambda self: self.config.limits.limit_val_batches)
    limit_test_batches = property(lambda self: self.config.limits.limit_test_batches)
    limit_predict_batches = property(lambda self: self.config.limits.limit_predict_batches)
    num_sanity_val_steps = property(lambda self: self.config.limits.num_sanity_val_steps)
    fast_dev_run = property(lambda self: self.config.limits.fast_dev_run)
    overfit_batches = property(lambda self: self.config.limits.overfit_batches)
    reload_dataloaders_every_n_epochs = property(
        lambda self: self.config.limits.reload_dataloaders_every_n_epochs
    )
    log_every_n_steps = property(lambda self: self.config.output.log_every_n_steps)
    default_root_dir = property(lambda self: self.config.output.default_root_dir)


_NAMED = ("strategy", "callbacks", "logger", "profiler")  # named parameters; the rest: flags


def _flags_from_env() -> dict[str, Any]:
    """The Trainer's arguments set as `PL_TRAINER_<NAME>` environment variables, as Lightning reads
    them (a Python literal, else the string): `PL_TRAINER_MAX_STEPS=7` gives max_steps=7. Read
    once, when a Trainer is built."""
    found = {}
    for key, text in os.environ.items():
        if key.startswith("PL_TRAINER_") and len(key) > len("PL_TRAINER_"):
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                value = text
            found[key.removeprefix("PL_TRAINER_").lower()] = value
    return found


def _say_limits(flags: dict[str, Any]) -> None:
    """Lightning's info line for a batch limit or validation interval given as exactly 1 or 1.0
    (easily meant the other way: one batch, or the whole epoch)."""
    limits = [f"limit_{stage}_batches" for stage in ("train", "val", "test", "predict")]
    for name in [*limits, "overfit_batches", "val_check_interval"]:
        value = flags.get(name)
        if value != 1 or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if name == "val_check_interval":
            when = "after every batch" if isinstance(value, int) else "at the end of each epoch"
            rank_zero_info(
                f"`Trainer({name}={value})` was configured so validation will run {when}."
            )
        else:
            share = "1 batch" if isinstance(value, int) else "100% of the batches"
            rank_zero_info(
                f"`Trainer({name}={value})` was configured so {share} per epoch will be used."
            )


def _one_or_list(loaders: Any) -> Any:
    """As Lightning returns evaluation loaders: the loader itself when there is one, else the list
    (None: none)."""
    if not loaders:
        return None
    return loaders[0] if isinstance(loaders, list) and len(loaders) == 1 else loaders


def _one_datamodule(given: Any, positional: Any) -> Any:
    """The DataModule passed in the loaders' place; a ConfigError when one was also passed as
    datamodule=."""
    if given is not None:
        raise ConfigError(
            f"got two DataModules ({type(positional).__name__} in the loaders' place and "
            f"datamodule={type(given).__name__}): pass one."
        )
    return positional


def _datamodule_given(loaders: Any, datamodule: Any) -> tuple[Any, Any]:
    """(loaders, datamodule) with a DataModule passed in the loaders' place moved to its own
    (`trainer.test(model, dm)`, as Lightning takes it)."""
    if isinstance(loaders, LightningDataModule):
        return None, _one_datamodule(datamodule, loaders)
    return loaders, datamodule


def _one_source(fn: str, loaders: Any, datamodule: Any) -> None:
    """Data comes from the loaders passed or from the DataModule, never both (as Lightning refuses):
    a ConfigError before any rank starts."""
    if loaders is not None and datamodule is not None:
        given = "train_dataloaders/val_dataloaders" if fn == "fit" else "dataloaders"
        raise ConfigError(
            f"trainer.{fn}() got both {given}= and datamodule={type(datamodule).__name__}: pass "
            f"one source of data (the loaders, or the DataModule whose *_dataloader() hooks give "
            f"them)."
        )


def _check_weights_only(weights_only: bool | None) -> None:
    """Lightning 2.6's `weights_only=` of fit/validate/test/predict. None and False load as
    lightspeed always does (its own records are pickled: the loop's state, optimizer state, and the
    checksums in meta.json verify every file); True, torch's weights-only unpickling, cannot read
    them, and is refused rather than ignored."""
    if weights_only:
        raise ConfigError(
            "weights_only=True is not valid: lightspeed's checkpoints hold pickled records (the "
            "loop's state, optimizer state) that torch's weights-only loading refuses; their "
            "checksums (meta.json) verify the files instead. Pass weights_only=None or False for a "
            "checkpoint you trust."
        )
