"""The Trainer: fit / validate / test / predict, one readable loop over any strategy.

    trainer = Trainer(devices=2, strategy="deepspeed_stage_3", max_steps=100)
    trainer.fit(model, train_loader)

Follow one batch: `_train_epoch` groups batches into accumulation windows; `_train_window` moves
each micro-batch (hooks.batch_to_device), runs `training_step` through `strategy.forward` (gradients
synchronised on the window's last one only), `strategy.backward(loss)`, then one `strategy.step()`;
`_after_step` logs once. Backend-specific code lives behind those calls (strategies/base.py);
checkpoint files behind `Checkpointer`. Every entry point runs in `_entry`: on an exception it stops
the progress bar, runs `on_exception`, finalises loggers, tears down.
"""

from __future__ import annotations

import atexit
import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightspeed import hooks
from lightspeed.callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ModelSummary,
    RichProgressBar,
    Timer,
)
from lightspeed.callbacks.rich_model_summary import default_model_summary
from lightspeed.callbacks.run_metrics import RunMetrics
from lightspeed.checkpoint.checkpointer import Checkpointer, resolve
from lightspeed.config import TrainerConfig, check_sync_batchnorm, read_back, trainer_flags
from lightspeed.core.metrics import MetricStore, infer_batch_size
from lightspeed.core.module import Module
from lightspeed.core.optimizer import parse_optimizers, step_schedulers
from lightspeed.core.saving import DATAMODULE_HPARAMS_KEY, HPARAMS_KEY, HPARAMS_NAME
from lightspeed.data.loaders import (
    BatchMover,
    CombinedLoader,
    accumulation_windows,
    check_batch_counts,
    num_batches,
    resumed_iterator,
    set_epoch,
    validation_interval,
    with_distributed_sampler,
)
from lightspeed.errors import ConfigError
from lightspeed.eval_loaders import eval_loaders, fit_loaders, run_batches, sanity_check
from lightspeed.inputs import checked_callbacks
from lightspeed.lightning_names import LightningNames
from lightspeed.loggers import Logger
from lightspeed.loggers.build import agree_log_dirs, build_loggers
from lightspeed.loggers.logger import DummyLogger
from lightspeed.perf.kernels import compile_step, compiled_frames, compiled_ran, unwrap_compiled
from lightspeed.plan.fallback import connected, plan_hint, set_up_or_fall_back
from lightspeed.plan.micro_batch import plan_fit
from lightspeed.report.progress import ProgressBar, metrics_table, print_table, start_progress
from lightspeed.runtime.distributed import broadcast_from_rank0
from lightspeed.runtime.guard import NonFiniteGuard
from lightspeed.runtime.launch import (
    DistInfo,
    end_with_os_exit,
    export_env,
    read_dist_info,
    start_local_ranks,
    watch_parent,
)
from lightspeed.runtime.preemption import Preemption
from lightspeed.runtime.rng import rng_state, seed_everything, set_rng_state
from lightspeed.specs import LoopState, RunSpec, StepStats
from lightspeed.strategies import build_strategy
from lightspeed.utilities.rank_zero import rank_zero_info

__all__ = ["Trainer", "seed_everything"]
SKIP_EPOCH = object()  # what _train_window returns when on_train_batch_start returned -1


class Trainer(LightningNames):
    """Runs a Module's loops on one device, DDP, DeepSpeed ZeRO 1/2/3, ZeRO-1 or FSDP2.

    Every flag is validated here, before any rank is started; bad values raise ConfigError. See
    TrainerConfig for the flags and their accepted values.
    """

    def __init__(
        self,
        *,
        strategy: Any = "auto",
        callbacks: list[Callback] | None = None,
        logger: bool | Logger | list[Logger] = True,
        **flags: Any,
    ):
        self.cfg = cfg = TrainerConfig(**trainer_flags(flags, ("strategy", "callbacks", "logger")))
        self._env = read_dist_info()  # the launch environment, read once
        if self._env.launcher == "none":
            if cfg.num_nodes > 1:
                raise ConfigError(
                    f"num_nodes={cfg.num_nodes} needs a multi-node launcher (torchrun, srun or "
                    "deepspeed); a plain `python` run starts local ranks only."
                )
            self._world_size = cfg.local_devices() * cfg.num_nodes
        else:
            self._world_size = self._env.world_size
            if cfg.devices != "auto" and cfg.local_devices() * cfg.num_nodes != self._world_size:
                raise ConfigError(
                    f"devices={cfg.devices} × num_nodes={cfg.num_nodes} does not match the "
                    f"{self._env.launcher} world size {self._world_size}."
                )
        self.strategy = build_strategy(strategy, self._world_size)
        # "auto" plans from a memory forecast at fit (plan.py) on GPUs, or on CPU given a memory
        # budget.
        self._plans = strategy in ("auto", None) and (
            cfg.device_type == "cuda" or cfg.memory_budget is not None
        )
        off = (
            (ModelCheckpoint, EarlyStopping, LearningRateMonitor) if cfg.fast_dev_run else ()
        )  # as Lightning
        self.callbacks = [
            c
            for c in checked_callbacks(callbacks, cfg.enable_progress_bar)
            if not isinstance(c, off)
        ]
        if cfg.enable_checkpointing and not any(
            isinstance(c, ModelCheckpoint) for c in self.callbacks
        ):
            self.callbacks.append(ModelCheckpoint())
        if not any(
            isinstance(c, RunMetrics) for c in self.callbacks
        ):  # lr, throughput, memory; the report
            self.callbacks.append(RunMetrics())
        if cfg.max_time is not None:  # Lightning's max_time is a Timer, checked after every step
            if any(isinstance(c, Timer) for c in self.callbacks):
                rank_zero_info(
                    "Ignoring `Trainer(max_time=...)`, callbacks list already contains a Timer."
                )
            else:
                self.callbacks.append(Timer(cfg.max_time))
        # what the loop reads each epoch; a GradientAccumulationScheduler sets it at epoch start
        self.accumulate_grad_batches = cfg.accumulate_grad_batches
        summaries = [c for c in self.callbacks if isinstance(c, ModelSummary)]
        if cfg.enable_model_summary and not summaries:  # it prints at fit start, as Lightning's
            self.callbacks.append(default_model_summary(self.callbacks))
        if cfg.enable_progress_bar and self.progress_bar_callback is None:
            # lightspeed's own bar, as trainer.progress_bar_callback (Lightning always has one)
            self.callbacks.append(RichProgressBar())
        check_sync_batchnorm(cfg, self._world_size)
        self.loggers = build_loggers(
            logger if not cfg.fast_dev_run else False, cfg.default_root_dir
        )
        if cfg.fast_dev_run and logger not in (False, None):  # as Lightning: one that logs nothing
            self.loggers = [DummyLogger()]
        self.dist: DistInfo | None = None
        self.device = torch.device("cpu")
        self.metrics = MetricStore()
        self.stage, self.current_epoch, self.global_step, self.should_stop = "train", 0, 0, False
        self.fitting = (
            False  # True inside fit, also while it validates (EarlyStopping acts only then)
        )
        self.sanity_checking = False  # True while the validation batches before training run
        self.datamodule: Any = None  # the one given to the last entry point that took one
        self.step_stats: StepStats = {}  # what the last optimizer step reported (grad norm)
        self._loaders: dict[
            str, Any
        ] = {}  # this process's loaders by stage ("train", "validate", ...), distributed
        self._module: Module | None = None
        self._phase: str | None = (
            None  # what the strategy is set up for: "fit" (serves evaluation too) or "eval"
        )
        self._progress: ProgressBar | None = None
        self._checkpointer: Checkpointer | None = None
        self._fallbacks: tuple[str, ...] | None = None  # strategy="auto": the next plans that fit
        self._batches_done, self._epoch_done, self._preemption = (
            0,
            False,
            Preemption(cfg.preemption_signals),
        )

    # ------------------------------------------------------------------ what callbacks see
    # (specs.TrainerView)
    @property
    def global_rank(self) -> int:
        return self.dist.rank if self.dist else 0

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        return self.metrics.latest

    # Lightning's other names for what the trainer holds are LightningNames' (lightning_names.py)
    # the Trainer's arguments read back, as in Lightning: trainer.max_steps, .precision, ...
    __getattr__ = read_back

    def print0(self, *args: Any) -> None:
        if self.is_global_zero:
            print(*args, flush=True)

    def is_log_step(self) -> bool:
        return self.global_step % self.cfg.log_every_n_steps == 0

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Sends metrics to every logger (rank 0 only), at the current global step."""
        if self.is_global_zero and metrics:
            for lg in self.loggers:
                lg.log_metrics(metrics, self.global_step)

    # ------------------------------------------------------------------ lifecycle
    @contextlib.contextmanager
    def _entry(self, module: Module, fn: str):
        """Wraps fit / validate / test / predict (`fn`): whatever happens, the bar stops and the
        loggers are finalised; on an exception the `on_exception` hooks run and the strategy is torn
        down before it propagates."""
        status, module = (
            "failed",
            unwrap_compiled(self, module),
        )  # Lightning's trainer.fit(torch.compile(model))
        self._fn, self._status = fn, "running"
        anomaly = (
            torch.autograd.set_detect_anomaly(True)
            if self.cfg.detect_anomaly
            else contextlib.nullcontext()
        )
        try:
            yield module
            status = "success"
        except BaseException as exc:
            status = "interrupted" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "failed"
            module.on_exception(exc)
            for cb in self.callbacks:
                cb.on_exception(self, module, exc)
            raise
        finally:
            self.fitting, self._status = False, "finished" if status == "success" else "interrupted"
            anomaly.__exit__(None, None, None)  # detect_anomaly: restored
            self._preemption.uninstall()
            if self._progress is not None:
                self._progress.stop(self.metrics.prog_bar_values() if status == "success" else None)
                self._progress = None
            for lg in self.loggers if self.is_global_zero else []:
                lg.finalize(status)
            if status != "success" and self.dist is not None:
                self.strategy.teardown()

    def _prepare(
        self, stage: str, module: Module, ckpt_path: Any, data: Callable[[], Any]
    ) -> tuple[Path | None, Any]:
        """Checks, launches (first call), runs the setup hooks, gets the data (`data()`), configures
        the model (first time) and sets up the strategy for this phase. Returns (the checkpoint to
        load, resolved by rank 0 and verified there before any rank starts; what `data()`
        returned)."""
        spec = self.cfg.run_spec(module.automatic_optimization)
        self.strategy.check(spec)
        best = self.checkpoint_callback.best_model_path if self.checkpoint_callback else None
        path = (
            resolve(ckpt_path, self.checkpoint_dir, best, verify=self._env.rank == 0)
            if ckpt_path
            else None
        )
        hooks.attach_module_callbacks(
            self, module
        )  # configure_callbacks, once "best" is resolved (as Lightning)
        self._launch(spec)
        path = (
            broadcast_from_rank0(path) if ckpt_path else None
        )  # every rank loads what rank 0 resolved
        self._ckpt_path = str(path) if path else None
        if self._plans and broadcast_from_rank0(self.strategy.name) != self.strategy.name:
            raise ConfigError(
                f"strategy='auto' planned {self.strategy.name!r} on rank {self.global_rank} but "
                "another on rank 0 (their free memory differs): pass the strategy or memory_budget."
            )
        module.trainer = self
        hooks.setup(
            self, module, self.datamodule, stage
        )  # prepare_data, then setup(stage): callbacks, data, module
        loaders = data()
        self._loaders["train"] = self._distribute(loaders[0]) if stage == "fit" else None
        phase, configure = "fit" if stage == "fit" else "eval", self._module is not module
        if configure or self._phase not in ("fit", phase):
            # Under strategy="auto" a plan that runs out of memory here gives way to the next one
            # that fits (plan/fallback.py); a strategy the user chose keeps its error, plus a hint.
            before, cfg, dev = self.strategy, self.cfg, self.device
            self.strategy = set_up_or_fall_back(
                self.strategy,
                module,
                lambda s: self._set_up(s, module, phase, loaders, configure),
                self._fallbacks,
                lambda name: connected(build_strategy(name, self.world_size), spec, self.dist, dev),
                cfg.memory_budget if cfg.device_type == "cpu" else None,
                self.print0,
                plan_hint(
                    module, self.world_size, cfg.precision, cfg.device_type, cfg.memory_budget
                ),
            )
            self._fallbacks = None  # only the first setup falls back
            if self.strategy is not before:  # a fork set up: checkpoints and teardown follow it
                self._checkpointer = Checkpointer(
                    self.strategy, self.callbacks, self.global_rank, self.world_size
                )
                atexit.register(self.strategy.teardown)  # runs before the parent's: LIFO
        return path, loaders

    def _set_up(
        self, strategy: Any, module: Module, phase: str, loaders: Any, configure: bool
    ) -> None:
        """Configures `module` on `strategy` (when `configure`: a new module) and sets it up for
        `phase` ("fit" serves evaluation too)."""
        if configure:
            strategy.configure_model(module)
            if self.cfg.sync_batchnorm and self.world_size > 1:  # before any wrapper, as Lightning
                torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
            self._module, self._phase = module, None
        if self._phase not in ("fit", phase):
            factory = (
                (
                    lambda: parse_optimizers(
                        module.configure_optimizers(), module.automatic_optimization, module
                    )
                )
                if phase == "fit"
                else None
            )
            strategy.setup(
                module, factory, getattr(loaders[0], "batch_size", None) if phase == "fit" else None
            )
            if phase == "fit" and module.automatic_optimization and not strategy.optimizers:
                raise ConfigError(
                    "configure_optimizers returned no optimizer: return one of the forms in "
                    "lightspeed.core.optimizer (an optimizer, a list, a dict with 'optimizer', "
                    "...)."
                )
            self._phase = phase

    def _launch(self, spec: RunSpec) -> None:
        """Once per process: starts the other local ranks (plain `python` with devices > 1) or joins
        the external launcher's, then connects the strategy (process group, device)."""
        if self.dist is not None:
            return
        if self.world_size > 1:
            end_with_os_exit()  # before start_local_ranks, whose exit handler must run first
        if self._env.launcher == "none" and self.world_size > 1:
            self.dist = start_local_ranks(self.world_size, self.cfg.timeout)
        else:
            self.dist = self._env
            if self._env.launcher == "lightspeed":
                watch_parent()
        export_env(self.dist)  # the rank variables, and this rank's share of the host's CPUs
        self.device = (
            torch.device("cuda", self.dist.local_rank)
            if spec.device_type == "cuda"
            else torch.device("cpu")
        )
        self.metrics.device = (
            self.device
        )  # batches reach it through self.move; its wait is timed while training
        self.move = BatchMover(
            self.device, self.cfg.pin_memory, self.print0, training=lambda: self.training
        )
        self.strategy.connect(spec, self.dist, self.device)
        # Torn down at exit after success (an exception: at once, in `_entry`); after handlers
        # registered later.
        atexit.register(self.strategy.teardown)
        self._checkpointer = Checkpointer(
            self.strategy, self.callbacks, self.global_rank, self.world_size
        )
        self.guard = NonFiniteGuard(
            self.cfg.on_nonfinite, self.global_rank, self.world_size, self.print0
        )
        self.cfg.apply_to_process()  # seed, deterministic, benchmark
        agree_log_dirs(self.loggers)  # trainer.log_dir names rank 0's folder on every rank

    def _distribute(self, loaders: Any) -> Any:
        if isinstance(loaders, list):
            return [self._distribute(loader) for loader in loaders]
        if isinstance(
            loaders, CombinedLoader
        ):  # several training loaders: each as a single one would be
            return loaders.map(self._distribute)
        if self.cfg.use_distributed_sampler:
            loaders = with_distributed_sampler(
                loaders, self.strategy.distributed_sampler_kwargs, self.cfg.seed or 0
            )
        return self.move.loader(loaders)

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        model: Module,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        datamodule: Any = None,
        ckpt_path: str | Path | None = None,
    ) -> None:
        """Trains `model` on the given loaders, else the DataModule's, else the Module's.
        `ckpt_path` ("last", "best", a directory) resumes where it was saved. Validation runs only
        if `validation_step` is overridden."""
        if (
            train_dataloaders is None
            and datamodule is None
            and not hooks.is_overridden(model, "train_dataloader")
        ):
            raise ConfigError(
                f"fit needs training data: pass train_dataloaders= or define train_dataloader() on "
                f"{type(model).__name__}."
            )
        # LearningRateFinder / BatchSizeFinder (lightspeed.tuner) run their short trial fits here,
        # where Lightning runs them at fit start; they leave the model and this Trainer as they
        # were.
        for tuner in [cb for cb in self.callbacks if hasattr(cb, "run_before_fit")]:
            tuner.run_before_fit(self, model, train_dataloaders, val_dataloaders, datamodule)
        self.datamodule = datamodule
        with self._entry(model, "fit") as model:
            data = lambda: fit_loaders(
                model,
                datamodule,
                train_dataloaders,
                val_dataloaders,  # noqa: E731
                bool(self.cfg.overfit_batches),
            )
            if self.dist is None and (
                self._plans or self.cfg.micro_batch
            ):  # before any rank starts (micro_batch.py)
                self.strategy, data, self._fallbacks = plan_fit(
                    model,
                    train_dataloaders,
                    datamodule,
                    self.strategy,
                    self._plans,
                    self,
                    data,
                    show=self._env.rank == 0,
                    as_step_sees=lambda b: hooks.probe_batch(self, model, datamodule, b),
                )
            resume, (train, val) = self._prepare("fit", model, ckpt_path, data)
            # a signal only sets a flag; `_train_epoch` acts on it at a step boundary
            self._preemption.install()
            train, val = (
                self._loaders["train"],
                self._distribute(val),
            )  # _prepare distributed the training loader
            self._loaders["validate"] = val
            n = num_batches(train, self.cfg.limit_train_batches)
            check_batch_counts(n, self.cfg.limit_train_batches)  # empty or uneven: ConfigError
            self.stage, self.metrics.stage, self.fitting = "train", "train", True
            skip, rng = self._restore(model, resume) if resume else (0, None)
            self._train_args = hooks.fit_start(
                self, model
            )  # unknown hooks warned of, the summary, the hparams
            self._progress = start_progress(self, math.ceil(n / self.cfg.accumulate_grad_batches))
            self._frames_at_start, self._training_step = (
                compiled_frames(),
                compile_step(model, self.cfg.compile),
            )
            self.should_stop = False  # before on_fit_start: a Timer already spent stops at once
            hooks.call(self, model, "on_fit_start")
            sanity_check(self, model, val)
            hooks.call(self, model, "on_train_start")
            self._held, loaded_at = False, self.current_epoch
            while not self._stops() and self.current_epoch < self.cfg.epochs_limit:
                if (
                    every := self.cfg.reload_dataloaders_every_n_epochs
                ) and self.current_epoch - loaded_at >= every:
                    loaded_at, (train, val) = self.current_epoch, self._reload(data)
                self._train_epoch(model, train, val, skip, rng)
                skip, rng = 0, None
            hooks.call(self, model, "on_train_end")
            hooks.call(self, model, "on_fit_end")
            hooks.teardown(self, model, datamodule, "fit")

    def _reload(self, data: Callable[[], Any]) -> tuple[Any, Any]:
        """reload_dataloaders_every_n_epochs: fit's loaders asked for again (the DataModule's or
        Module's `train_dataloader()` / `val_dataloader()`; loaders given to fit stay), then
        distributed as at the start."""
        train, val = data()
        self._loaders.update(train=self._distribute(train), validate=self._distribute(val))
        limit = self.cfg.limit_train_batches
        check_batch_counts(num_batches(self._loaders["train"], limit), limit)
        return self._loaders["train"], self._loaders["validate"]

    def _train_epoch(
        self, module: Module, loader: Any, val_loader: Any, skip: int, rng: dict | None
    ) -> None:
        n = num_batches(loader, self.cfg.limit_train_batches)
        val_every = validation_interval(n, self.cfg.val_check_interval)
        set_epoch(loader, self.current_epoch)
        self._epoch_done, self._batches_done, self.skips_rest = False, skip, False
        module.train()
        hooks.call(self, module, "on_train_epoch_start")
        batches = self.move.timed(
            resumed_iterator(loader, skip, rng), loader
        )  # rng: restored where it was saved
        # Manual optimization steps per batch, however the user accumulates.
        size = self.accumulate_grad_batches if module.automatic_optimization else 1
        for window in accumulation_windows(batches, skip, n, size):
            self.is_last_batch = window[-1][0] + 1 >= n
            if (out := self._train_window(module, window)) is SKIP_EPOCH:
                break
            self._batches_done = window[-1][0] + 1
            self._after_step(module, out, batch=window[-1][1], batch_idx=window[-1][0])
            if (
                signum := self._preemption.requested()
            ):  # collective: every rank stops after the same step
                self._preemption.stop(signum, self)
            if (
                val_loader
                and val_every
                and self._batches_done < n
                and any((i + 1) % val_every == 0 for i, _ in window)
            ):
                self._validate_during_fit(module, val_loader)
            if self._stops() or self.skips_rest:
                break
        self._end_train_epoch(
            module, val_loader, epoch_done=self._batches_done >= n or self.skips_rest
        )

    def _stops(self) -> bool:
        """Lightning's rule: reaching max_steps ends fit; a requested stop (`should_stop`:
        EarlyStopping, max_time) waits until min_epochs epochs and min_steps steps have run. Every
        rank decides alike: the inputs agree."""
        if self.cfg.max_steps != -1 and self.global_step >= self.cfg.max_steps:
            self.should_stop = True
            return True
        held = self.current_epoch < (self.cfg.min_epochs or 0) or self.global_step < (
            self.cfg.min_steps or 0
        )
        if self.should_stop and held and not self._held:
            self._held = True
            self.print0(
                f"Stopping was requested at step {self.global_step}, epoch {self.current_epoch}, "
                "but "
                f"min_epochs={self.cfg.min_epochs} / min_steps={self.cfg.min_steps} are not "
                "reached "
                "yet: "
                "training continues until they are."
            )
        return self.should_stop and not held

    def _train_window(self, module: Module, window: list[tuple[int, Any]]) -> Any:
        """One optimizer step: every micro-batch forward and backward (gradients synchronised on the
        last one only), then `strategy.step()`. Returns the last micro-batch's `training_step`
        output."""
        out = None
        self.guard.begin(self.global_step, self.current_epoch, [i for i, _ in window])
        for i, (batch_idx, batch) in enumerate(window):
            batch = hooks.batch_to_device(
                self, module, batch
            )  # the three transfer hooks around self.move
            self.metrics.batch_size = infer_batch_size(batch)
            if (
                hooks.on_train_batch_start(self, module, batch, batch_idx) and i == 0
            ):  # -1: skip the epoch's rest
                return SKIP_EPOCH
            out = self.strategy.forward(
                self._training_step,
                *self._train_args(batch, batch_idx),
                sync_grads=i == len(window) - 1,
            )
            if module.automatic_optimization:
                self.guard.observe(loss := hooks.loss_of(out), i)
                loss = loss / self.accumulate_grad_batches
                hooks.on_before_backward(self, module, loss)
                self.strategy.backward(loss)
                hooks.on_after_backward(self, module)
        if (
            module.automatic_optimization
        ):  # under manual optimization the user stepped inside training_step
            hooks.before_step(
                self, module
            )  # on_before_optimizer_step, on_before_zero_grad (hooks.py says why)
            self.step_stats = self.strategy.step(self.guard)  # the guard decides before any step
        self.global_step += 1
        if module.automatic_optimization:
            step_schedulers(
                self.strategy.schedulers, "step", self.global_step, self.metrics.latest, module
            )
        return out

    def _after_step(self, module: Module, out: Any, batch: Any, batch_idx: int) -> None:
        step_metrics = self.metrics.pop_step()
        if self.is_log_step():
            norm = self.step_stats.get("grad_norm")
            self.log_metrics(
                {
                    **({"grad_norm": float(norm)} if norm is not None else {}),
                    **self.guard.log_values(),
                    **{k: float(v) for k, v in step_metrics.items()},
                }
            )
        if self._progress is not None:
            self._progress.advance(
                f"epoch {self.current_epoch}", self.metrics.prog_bar_values, self.is_log_step()
            )
        hooks.on_train_batch_end(self, module, out, batch, batch_idx)
        if self.cfg.compile and self.global_step == 3 and not compiled_ran(self._frames_at_start):
            self.print0(
                "Warning: compile=True, but nothing compiled ran in 3 steps (see "
                "kernels.apply_compile)."
            )

    def _end_train_epoch(self, module: Module, val_loader: Any, epoch_done: bool) -> None:
        # the last step's non-finite verdict, if the host has not read it yet (guard.py)
        self.guard.settle()
        # Lightning's order: validation first, so on_train_epoch_end and epoch schedulers
        # (ReduceLROnPlateau
        # on val_loss) see this epoch's validation metrics; then the checkpoint callbacks save the
        # result.
        every = self.cfg.check_val_every_n_epoch
        if val_loader and every and (self.current_epoch + 1) % every == 0 and epoch_done:
            self._validate_during_fit(module, val_loader)
        module.on_train_epoch_end()
        epoch_metrics = self.metrics.pop_epoch()
        if epoch_metrics:
            self.log_metrics(
                {"epoch": self.current_epoch, **{k: float(v) for k, v in epoch_metrics.items()}}
            )
        if (
            epoch_done and module.automatic_optimization
        ):  # under manual optimization the user steps them
            step_schedulers(
                self.strategy.schedulers,
                "epoch",
                self.current_epoch + 1,
                self.metrics.latest,
                module,
            )
        self._epoch_done = epoch_done
        for cb in self.callbacks:
            cb.on_train_epoch_end(self, module)
        if epoch_done:
            self.current_epoch += 1

    def _validate_during_fit(self, module: Module, loaders: list) -> None:
        if num_batches(loaders[0], self.cfg.limit_val_batches) == 0:
            return  # limit_val_batches=0 turns validation off, hooks included (as in Lightning)
        # Validation must not move the training RNG (its loader draws a seed): training then gives
        # the same
        # losses whatever val_check_interval is, and a checkpoint saved just before a validation
        # resumes exactly.
        rng = rng_state()
        self._evaluation_epoch(
            module, loaders, "validate"
        )  # ends in on_validation_model_train: train() again
        set_rng_state(rng)
        self.stage, self.metrics.stage = "train", "train"

    # ------------------------------------------------------------------ evaluation
    def validate(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> list[dict]:
        """Runs `validation_step` over the data (one loader or several); returns [epoch metrics] and
        prints them. Without `model`, the fitted one."""
        model = self._model_for("validate", model, datamodule)
        with self._entry(model, "validate") as model:
            loaders = self._prepare_eval("validate", model, dataloaders, ckpt_path)
            results = self._evaluation_epoch(model, loaders, "validate")
            hooks.teardown(self, model, self.datamodule, "validate")
        return self._report("validate", results, verbose)

    def test(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        ckpt_path: str | Path | None = None,
        verbose: bool = True,
        datamodule: Any = None,
    ) -> list[dict]:
        """Runs `test_step` over the data (one loader or several); returns [epoch metrics] and
        prints them. Without `model`, the fitted one."""
        model = self._model_for("test", model, datamodule)
        with self._entry(model, "test") as model:
            loaders = self._prepare_eval("test", model, dataloaders, ckpt_path)
            results = self._evaluation_epoch(model, loaders, "test")
            hooks.teardown(self, model, self.datamodule, "test")
        return self._report("test", results, verbose)

    def predict(
        self,
        model: Module | None = None,
        dataloaders: Any = None,
        datamodule: Any = None,
        return_predictions: bool | None = None,
        ckpt_path: str | Path | None = None,
    ) -> list | None:
        """Returns this rank's `predict_step` outputs in the order of its batches: a list, or one
        list per loader when there are several. Without `model`, the fitted one."""
        model = self._model_for("predict", model, datamodule)
        with self._entry(model, "predict") as model:
            loaders = self._prepare_eval("predict", model, dataloaders, ckpt_path)
            hooks.start_evaluation(self, model, "predict")
            outputs = run_batches(
                self,
                model,
                loaders,
                self.cfg.limit_predict_batches,
                "predict",
                keep=return_predictions is not False,
            )
            hooks.call(self, model, "on_predict_epoch_end", "on_predict_end")
            hooks.teardown(self, model, self.datamodule, "predict")
            return (
                None if return_predictions is False else outputs if len(loaders) > 1 else outputs[0]
            )

    def _model_for(self, stage: str, model: Module | None, datamodule: Any) -> Module:
        self.datamodule = datamodule if datamodule is not None else self.datamodule
        if model is None and self._module is None:
            raise ConfigError(
                f"{stage}() got no model and none was fitted: pass the model, {stage}(model, ...)."
            )
        return model if model is not None else self._module

    def _prepare_eval(self, stage: str, model: Module, given: Any, ckpt_path: Any) -> list:
        resume, loaders = self._prepare(
            stage, model, ckpt_path, lambda: eval_loaders(stage, model, self.datamodule, given)
        )
        if resume:
            self._checkpointer.load_strategy(resume)  # any strategy's checkpoint, on any world size
        self.stage, self.metrics.stage = stage, stage
        self._loaders[stage] = self._distribute(loaders)
        return self._loaders[stage]

    def _evaluation_epoch(self, module: Module, loaders: list, stage: str) -> dict[str, float]:
        """A validation or test epoch in Lightning's order: on_<x>_model_eval (eval mode),
        on_<x>_start, on_<x>_epoch_start, the batches, on_<x>_epoch_end (the Module's before the
        epoch's results are logged, the callbacks' after), on_<x>_end, then on_<x>_model_train
        (train mode again, unless overridden)."""
        name, limit = (
            ("validation", self.cfg.limit_val_batches)
            if stage == "validate"
            else ("test", self.cfg.limit_test_batches)
        )
        self.stage, self.metrics.stage = stage, stage
        hooks.start_evaluation(self, module, stage)
        run_batches(self, module, loaders, limit, stage)
        getattr(module, f"on_{name}_epoch_end")()
        results = self._epoch_results()
        for cb in self.callbacks:
            getattr(cb, f"on_{name}_epoch_end")(self, module)
        hooks.call(self, module, f"on_{name}_end")
        getattr(module, f"on_{name}_model_train")()
        return results

    def _epoch_results(self) -> dict[str, float]:
        results = {k: float(v) for k, v in self.metrics.pop_epoch().items()}
        self.log_metrics(results)
        return results

    def _report(self, stage: str, results: dict[str, float], verbose: bool) -> list[dict]:
        if self.is_global_zero and results and verbose:
            print_table(metrics_table(f"{stage} results", results))
        return [results]

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path) -> Path:
        """Collective: every rank must call it. Writes atomically (at rank 0's `path`), then moves
        `<dir>/last` to it.

        Raises ConfigError before fit / validate / test / predict: no model is set up, nothing to
        save."""
        module = self._module
        if self._checkpointer is None or module is None:
            raise ConfigError(
                f"save_checkpoint({str(path)!r}) was called before fit, validate, test or predict: "
                "no model is set up on the strategy yet, so there is nothing to save. Call it "
                "after "
                "one of them."
            )
        self.guard.settle()  # a non-finite verdict not yet read: under "stop" nothing is written
        loop = LoopState(
            self.current_epoch,
            self.global_step,
            self._batches_done,
            self._epoch_done and self.stage == "train",
        )

        def on_save(state: dict) -> None:
            state[HPARAMS_KEY] = dict(
                module.hparams
            )  # load_from_checkpoint rebuilds the module from these
            state[HPARAMS_NAME] = module.__dict__.get("_hparams_name")
            state["datamodule"] = (
                self.datamodule.state_dict() if self.datamodule is not None else {}
            )
            state[DATAMODULE_HPARAMS_KEY] = dict(getattr(self.datamodule, "hparams", {}) or {})
            module.on_save_checkpoint(state)
            for cb in self.callbacks:
                cb.on_save_checkpoint(self, module, state)

        return self._checkpointer.save(broadcast_from_rank0(Path(path)), loop, on_save)

    def _restore(self, module: Module, path: Path) -> tuple[int, dict | None]:
        """Loads a checkpoint into the set-up strategy; returns (batches to skip in this epoch, RNG
        state)."""
        loop, state, rng = self._checkpointer.load(path, with_optimizer=True)
        self.global_step, self.current_epoch = loop.global_step, loop.resume_epoch
        if self.datamodule is not None and state.get("datamodule"):
            self.datamodule.load_state_dict(state["datamodule"])
        hooks.on_load_checkpoint(self, module, state)
        self.print0(
            f"Resumed from {path} at epoch {self.current_epoch}, global step {self.global_step}."
        )
        return loop.batches_to_skip, rng
