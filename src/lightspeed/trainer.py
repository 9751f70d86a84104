"""The Trainer: fit / validate / test / predict, one readable loop over any strategy.

    trainer = Trainer(devices=2, strategy="deepspeed_stage_3", max_steps=100)
    trainer.fit(model, train_loader)

Follow one batch: `_train_epoch` moves it to the device, tells the strategy whether it ends an accumulation
window, runs `training_step` through the strategy, calls `strategy.backward(loss)` and, at the window's end,
`strategy.step()`. Everything backend-specific lives behind those calls (see strategies/base.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint
from .callbacks import Callback, ModelCheckpoint
from .config import TrainerConfig
from .data import move_to_device, num_batches, set_epoch, with_distributed_sampler
from .errors import ConfigError
from .launch import DistInfo, end_with_os_exit, export_env, read_dist_info, start_local_ranks, watch_parent
from .loggers import CSVLogger, Logger, TensorBoardLogger
from .metrics import MetricStore
from .module import Module
from .optim import parse_optimizers
from .progress import ProgressBar, metrics_table, print_table
from .strategies import RunSpec, build_strategy


def seed_everything(seed: int) -> None:
    """Seeds Python, NumPy and torch (all devices) with the same seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Trainer:
    """Runs a Module's loops on one device, DDP, DeepSpeed ZeRO 1/2/3, ZeRO-1 or FSDP2.

    Every flag is validated here, before any rank is started; bad values raise ConfigError. See TrainerConfig
    for the flags and their accepted values.
    """

    def __init__(self, *, strategy: Any = "auto", callbacks: list[Callback] | None = None,
                 logger: bool | Logger | list[Logger] = True, **flags: Any):
        unknown = set(flags) - {f.name for f in dataclasses.fields(TrainerConfig)}
        if unknown:
            raise ConfigError(f"Trainer got unknown arguments {sorted(unknown)}; accepted: "
                              f"{sorted(f.name for f in dataclasses.fields(TrainerConfig))}, strategy, callbacks, logger.")
        self.cfg = cfg = TrainerConfig(**flags)
        self._env = read_dist_info()  # the launch environment, read once
        if self._env.launcher == "none":
            if cfg.num_nodes > 1:
                raise ConfigError(f"num_nodes={cfg.num_nodes} needs a multi-node launcher (torchrun, srun or "
                                  "deepspeed); a plain `python` run starts local ranks only.")
            self.world_size = cfg.local_devices() * cfg.num_nodes
        else:
            self.world_size = self._env.world_size
            if cfg.devices != "auto" and cfg.local_devices() * cfg.num_nodes != self.world_size:
                raise ConfigError(f"devices={cfg.devices} × num_nodes={cfg.num_nodes} does not match the "
                                  f"{self._env.launcher} world size {self.world_size}.")
        self.strategy = build_strategy(strategy, self.world_size)
        if cfg.gradient_clip_algorithm not in getattr(self.strategy, "clip_algorithms", ("norm", "value")):
            raise ConfigError(f"gradient_clip_algorithm={cfg.gradient_clip_algorithm!r} is not valid with strategy "
                              f"{self.strategy.name!r}: it clips by global norm only. Use 'norm'.")
        self.callbacks = list(callbacks or [])
        if cfg.enable_checkpointing and not any(isinstance(c, ModelCheckpoint) for c in self.callbacks):
            self.callbacks.append(ModelCheckpoint())
        self.loggers = self._build_loggers(logger)
        self.default_root_dir = cfg.default_root_dir
        self.dist: DistInfo | None = None
        self.device = torch.device("cpu")
        self.metrics = MetricStore()
        self.stage = "train"
        self.current_epoch = self.global_step = 0
        self.should_stop = False
        self.fitting = False  # True inside fit, also while it validates (EarlyStopping acts only then)
        self._module: Module | None = None
        self._setup_for: str | None = None
        self._progress: ProgressBar | None = None

    def _build_loggers(self, logger) -> list[Logger]:
        if logger is True:
            csv = CSVLogger(self.cfg.default_root_dir)
            return [csv, TensorBoardLogger(self.cfg.default_root_dir, version=csv.version)]
        if not logger:
            return []
        return list(logger) if isinstance(logger, (list, tuple)) else [logger]

    # ------------------------------------------------------------------ public properties
    @property
    def global_rank(self) -> int:
        return self.dist.rank if self.dist else 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def callback_metrics(self) -> dict[str, torch.Tensor]:
        return self.metrics.latest

    @property
    def checkpoint_dir(self) -> Path:
        ckpt = next((c for c in self.callbacks if isinstance(c, ModelCheckpoint)), None)
        return Path(ckpt.dirpath) if ckpt and ckpt.dirpath else Path(self.default_root_dir) / "checkpoints"

    @property
    def logger(self) -> Logger | None:
        return self.loggers[0] if self.loggers else None

    def print0(self, *args: Any) -> None:
        if self.is_global_zero:
            print(*args, flush=True)

    # ------------------------------------------------------------------ launch and setup
    def _launch(self) -> None:
        """Starts the other local ranks (plain `python` with devices > 1) or joins the external launcher's."""
        if self.dist is not None:
            return
        if self.world_size > 1:
            end_with_os_exit()  # before start_local_ranks, whose exit handler must run first
        if self._env.launcher == "none" and self.world_size > 1:
            self.dist = start_local_ranks(self.world_size)
        else:
            self.dist = self._env
            if self._env.launcher == "lightspeed":
                watch_parent()
        export_env(self.dist)
        # The one place a strategy is torn down (engine destroyed, process group left), at exit: after any
        # atexit handler registered later, before the launcher's wait for the other ranks and the final os._exit.
        atexit.register(self.strategy.teardown)
        dev_type = self.cfg.device_type
        self.device = torch.device("cuda", self.dist.local_rank) if dev_type == "cuda" else torch.device("cpu")
        self.metrics.device = self.device
        if self.cfg.seed is not None:
            seed_everything(self.cfg.seed)
        if self.cfg.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

    def _setup(self, module: Module, stage: str, micro_batch_size: int | None = None) -> None:
        """Runs `configure_model` (once) and the strategy's setup; fit needs optimizers, evaluation does not."""
        module.trainer = self
        if self._module is not module:
            if not module.automatic_optimization and not self.strategy.is_manual_optimization_supported:
                raise ConfigError(f"automatic_optimization=False is not supported by strategy "
                                  f"{self.strategy.name!r}: it owns backward and the optimizer step. Use 'ddp', "
                                  "'ddp_sharded' or a single device for manual optimization.")
            self.strategy.connect(self._spec(micro_batch_size))
            self.strategy.configure_model(module)
            self._module, self._setup_for = module, None
        want = "fit" if stage == "train" else "eval"
        if self._setup_for in ("fit", want):
            return
        self.strategy.connect(self._spec(micro_batch_size))
        factory = (lambda: parse_optimizers(module.configure_optimizers())) if want == "fit" else None
        self.strategy.setup(module, factory)
        if want == "fit" and module.automatic_optimization and not self.strategy.optimizers:
            raise ConfigError("configure_optimizers returned no optimizer: return one of the forms in "
                              "lightspeed.optim (an optimizer, a list, a dict with 'optimizer', ...).")
        if self.cfg.compile:
            module.compile()
        self._setup_for = want

    def _spec(self, micro_batch_size: int | None) -> RunSpec:
        c = self.cfg
        return RunSpec(dist=self.dist, device=self.device, precision=c.precision,  # type: ignore[arg-type]
                       accumulate_grad_batches=c.accumulate_grad_batches, gradient_clip_val=c.gradient_clip_val,
                       gradient_clip_algorithm=c.gradient_clip_algorithm, micro_batch_size=micro_batch_size,
                       seed=c.seed)

    def _loader(self, given: Any, module: Module, hook: str, required: bool) -> Any:
        loader = given if given is not None else (getattr(module, hook)() if hasattr(module, hook) else None)
        if loader is None and required:
            raise ConfigError(f"fit needs training data: pass train_dataloaders= or define {hook}() on "
                              f"{type(module).__name__}.")
        return loader

    def _distribute(self, loader: Any) -> Any:
        seed = self.cfg.seed if self.cfg.seed is not None else 0
        return with_distributed_sampler(loader, self.dist.rank, self.dist.world_size, seed)

    # ------------------------------------------------------------------ fit
    def fit(self, model: Module, train_dataloaders: Any = None, val_dataloaders: Any = None,
            ckpt_path: str | Path | None = None) -> None:
        """Trains `model`. `ckpt_path` ("last" or a checkpoint directory) resumes exactly where it was saved."""
        train_loader = self._loader(train_dataloaders, model, "train_dataloader", required=True)
        val_loader = self._loader(val_dataloaders, model, "val_dataloader", required=False)
        resume = checkpoint.resolve(ckpt_path, self.checkpoint_dir) if ckpt_path is not None else None
        self._launch()
        train_loader, val_loader = self._distribute(train_loader), self._distribute(val_loader)
        self.stage, self.metrics.stage, self.fitting = "train", "train", True
        self._setup(model, "train", getattr(train_loader, "batch_size", None))
        for cb in self.callbacks:
            cb.setup(self, model, "fit")
        skip_batches, rng = self._restore(resume) if resume else (0, None)
        steps_per_epoch = math.ceil(num_batches(train_loader, self.cfg.limit_train_batches)
                                    / self.cfg.accumulate_grad_batches)
        self._start_progress(steps_per_epoch)
        model.on_fit_start()
        for cb in self.callbacks:
            cb.on_fit_start(self, model)
        self.should_stop = self.cfg.max_steps != -1 and self.global_step >= self.cfg.max_steps
        while not self.should_stop and self.current_epoch < self.cfg.epochs_limit:
            self._train_epoch(model, train_loader, val_loader, skip_batches, rng)
            skip_batches, rng = 0, None
        model.on_fit_end()
        for cb in self.callbacks:
            cb.on_fit_end(self, model)
        self.fitting = False
        self._finish()

    def _train_epoch(self, module: Module, loader: Any, val_loader: Any, skip: int, rng: dict | None) -> None:
        cfg, strategy = self.cfg, self.strategy
        n = num_batches(loader, cfg.limit_train_batches)
        val_every = self._val_every(n)
        set_epoch(loader, self.current_epoch)
        self._epoch_done = False
        module.train()
        module.on_train_epoch_start()
        for cb in self.callbacks:
            cb.on_train_epoch_start(self, module)
        batch_idx = -1
        # Resuming restores the RNG at the point the save happened: at an epoch's end that is before this
        # epoch's iterator draws its seed; mid-epoch it is after, once the sampler has been replayed.
        if rng is not None and skip == 0:
            checkpoint.set_rng_state(rng)
        iterator = iter(loader)
        for batch_idx in range(skip):  # resuming mid-epoch: replay the sampler up to where the save happened
            next(iterator)
        if rng is not None and skip > 0:
            checkpoint.set_rng_state(rng)
        for batch_idx, batch in enumerate(iterator, start=skip):
            if batch_idx >= n:
                break
            batch = move_to_device(batch, self.device)
            is_boundary = (batch_idx + 1) % cfg.accumulate_grad_batches == 0 or batch_idx + 1 == n
            if module.automatic_optimization:
                strategy.set_grad_sync(is_boundary)
                out = strategy.forward(module.training_step, batch, batch_idx)
                strategy.backward(_loss_of(out) / cfg.accumulate_grad_batches)
                if is_boundary:
                    strategy.step()
                    self.global_step += 1
                    self._step_schedulers("step")
            else:
                out = strategy.forward(module.training_step, batch, batch_idx)
                self.global_step += 1  # manual optimization: one step per batch, whatever the user did
            self._batches_done = batch_idx + 1
            if is_boundary or not module.automatic_optimization:
                self._after_step(module, out, batch, batch_idx)
            if val_loader is not None and val_every and (batch_idx + 1) % val_every == 0 and batch_idx + 1 < n:
                self._validate_during_fit(module, val_loader)
            if self.should_stop or (cfg.max_steps != -1 and self.global_step >= cfg.max_steps):
                self.should_stop = True
                break
        self._batches_done = batch_idx + 1
        self._end_train_epoch(module, val_loader, epoch_done=self._batches_done >= n)

    def _after_step(self, module: Module, out: Any, batch: Any, batch_idx: int) -> None:
        step_metrics = self.metrics.pop_step()
        if self.is_log_step():
            self.log_metrics({k: float(v) for k, v in step_metrics.items()})
        if self._progress is not None:
            now = time.perf_counter()
            fresh = now - self._last_bar_refresh > 1.0 or self.is_log_step()
            if fresh:
                self._last_bar_refresh = now
            self._progress.advance(f"epoch {self.current_epoch}",
                                   self.metrics.prog_bar_values() if fresh else None)
        for cb in self.callbacks:
            cb.on_train_batch_end(self, module, out, batch, batch_idx)

    def _end_train_epoch(self, module: Module, val_loader: Any, epoch_done: bool) -> None:
        # Lightning's order: validation first, so on_train_epoch_end and epoch schedulers (ReduceLROnPlateau
        # on val_loss) see this epoch's validation metrics; then the checkpoint callbacks save the result.
        every = self.cfg.check_val_every_n_epoch
        if val_loader is not None and every and (self.current_epoch + 1) % every == 0 and epoch_done:
            self._validate_during_fit(module, val_loader)
        module.on_train_epoch_end()
        epoch_metrics = self.metrics.pop_epoch()
        if epoch_metrics:
            self.log_metrics({"epoch": self.current_epoch, **{k: float(v) for k, v in epoch_metrics.items()}})
        if epoch_done and module.automatic_optimization:  # under manual optimization the user steps them
            self._step_schedulers("epoch")
        self._epoch_done = epoch_done
        for cb in self.callbacks:
            cb.on_train_epoch_end(self, module)
        if epoch_done:
            self.current_epoch += 1

    def _val_every(self, n: int | float) -> int | None:
        v = self.cfg.val_check_interval
        if v is None or (isinstance(v, float) and v >= 1.0):
            return None  # validate at epoch end only
        if isinstance(v, float):
            return max(1, int(n * v)) if n != float("inf") else None
        return v

    def _validate_during_fit(self, module: Module, loader: Any) -> None:
        if num_batches(loader, self.cfg.limit_val_batches) == 0:
            return  # limit_val_batches=0 turns validation off, hooks included (as in Lightning)
        # Validation must not move the training RNG (its loader draws a seed): training then gives the same
        # losses whatever val_check_interval is, and a checkpoint saved just before a validation resumes exactly.
        rng = checkpoint.rng_state()
        self._run_eval("validate", module, loader, self.cfg.limit_val_batches, module.validation_step)
        checkpoint.set_rng_state(rng)
        self.stage, self.metrics.stage = "train", "train"
        module.train()

    def _step_schedulers(self, interval: str) -> None:
        count = self.global_step if interval == "step" else self.current_epoch + 1
        for cfg in self.strategy.schedulers:
            if cfg.interval != interval or count % cfg.frequency:
                continue
            if cfg.monitor is not None:
                if cfg.monitor not in self.metrics.latest:
                    raise ConfigError(f"lr_scheduler monitor={cfg.monitor!r} was not logged: logged metrics are "
                                      f"{sorted(self.metrics.latest)}.")
                cfg.scheduler.step(float(self.metrics.latest[cfg.monitor]))
            else:
                cfg.scheduler.step()

    def is_log_step(self) -> bool:
        return self.global_step % self.cfg.log_every_n_steps == 0

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Sends metrics to every logger (rank 0 only), at the current global step."""
        if self.is_global_zero and metrics:
            for lg in self.loggers:
                lg.log_metrics(metrics, self.global_step)

    def _start_progress(self, steps_per_epoch: int | float) -> None:
        if not (self.cfg.enable_progress_bar and self.is_global_zero):
            return
        total = steps_per_epoch * self.cfg.epochs_limit
        if self.cfg.max_steps != -1:
            total = min(total, self.cfg.max_steps)
        total = None if total in (float("inf"), 2**31) else int(total) - self.global_step
        self._progress = ProgressBar()
        self._last_bar_refresh = 0.0
        self._progress.start(total, f"epoch {self.current_epoch}")

    def _finish(self) -> None:
        if self._progress is not None:
            self._progress.stop(self.metrics.prog_bar_values())
            self._progress = None
        for lg in self.loggers if self.is_global_zero else []:
            lg.finalize()

    # ------------------------------------------------------------------ evaluation
    def validate(self, model: Module, dataloaders: Any = None, ckpt_path: str | Path | None = None) -> list[dict]:
        """Runs `validation_step` over the data; returns [epoch metrics] and prints them as a table."""
        return self._evaluate("validate", model, dataloaders, ckpt_path, "val_dataloader",
                              self.cfg.limit_val_batches)

    def test(self, model: Module, dataloaders: Any = None, ckpt_path: str | Path | None = None) -> list[dict]:
        """Runs `test_step` over the data; returns [epoch metrics] and prints them as a table."""
        return self._evaluate("test", model, dataloaders, ckpt_path, "test_dataloader", self.cfg.limit_test_batches)

    def predict(self, model: Module, dataloaders: Any = None, ckpt_path: str | Path | None = None) -> list:
        """Returns this rank's `predict_step` outputs, in the order of this rank's batches."""
        return self._evaluate("predict", model, dataloaders, ckpt_path, "predict_dataloader",
                              self.cfg.limit_predict_batches)

    def _evaluate(self, stage: str, model: Module, loader: Any, ckpt_path: Any, hook: str, limit: Any) -> Any:
        loader = loader if loader is not None else (getattr(model, hook)() if hasattr(model, hook) else None)
        if loader is None:
            raise ConfigError(f"{stage} needs data: pass dataloaders= or define {hook}() on {type(model).__name__}.")
        resume = checkpoint.resolve(ckpt_path, self.checkpoint_dir) if ckpt_path is not None else None
        self._launch()
        loader = self._distribute(loader)
        self._setup(model, stage)
        if resume:
            self.strategy.load(resume, with_optimizer=False)
        step = {"validate": model.validation_step, "test": model.test_step, "predict": model.predict_step}[stage]
        out = self._run_eval(stage, model, loader, limit, step)
        if stage == "predict":
            return out
        if self.is_global_zero and out:
            print_table(metrics_table(f"{stage} results", out))
        return [out]

    @torch.no_grad()
    def _run_eval(self, stage: str, module: Module, loader: Any, limit: Any, step: Any) -> Any:
        self.stage, self.metrics.stage = stage, stage
        module.eval()
        if stage == "validate":
            module.on_validation_epoch_start()
            for cb in self.callbacks:
                cb.on_validation_epoch_start(self, module)
        elif stage == "test":
            module.on_test_epoch_start()
        n = num_batches(loader, limit)
        predictions = []
        for batch_idx, batch in enumerate(loader):
            if batch_idx >= n:
                break
            out = self.strategy.forward(step, move_to_device(batch, self.device), batch_idx)
            if stage == "predict":
                predictions.append(out)
            elif stage == "validate":
                for cb in self.callbacks:
                    cb.on_validation_batch_end(self, module, out, batch, batch_idx)
        if stage == "predict":
            return predictions
        if stage == "validate":
            module.on_validation_epoch_end()
        else:
            module.on_test_epoch_end()
        results = {k: float(v) for k, v in self.metrics.pop_epoch().items()}
        self.log_metrics(results)
        for cb in self.callbacks:
            if stage == "validate":
                cb.on_validation_epoch_end(self, module)
                cb.on_validation_end(self, module)
            else:
                cb.on_test_epoch_end(self, module)
        return results

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, path: str | Path) -> Path:
        """Collective: every rank must call it. Writes atomically, then moves `<dir>/last` to it.

        Raises ConfigError before fit / validate / test / predict: no model is set up, nothing to save."""
        module = self._module
        if self.dist is None or module is None:
            raise ConfigError(f"save_checkpoint({str(path)!r}) was called before fit, validate, test or predict: "
                              "no model is set up on the strategy yet, so there is nothing to save. Call it after "
                              "one of them.")
        epoch_done = getattr(self, "_epoch_done", False) and self.stage == "train"
        state: dict[str, Any] = {
            "epoch": self.current_epoch, "global_step": self.global_step,
            "batches_done": getattr(self, "_batches_done", 0), "epoch_done": epoch_done,
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "schedulers": [s.scheduler.state_dict() for s in self.strategy.schedulers],
        }
        module.on_save_checkpoint(state)
        for cb in self.callbacks:
            cb.on_save_checkpoint(self, module, state)
        return checkpoint.save_checkpoint(path, self.strategy, state, self.global_rank, self.dist.world_size)

    def _restore(self, path: Path) -> tuple[int, dict | None]:
        """Loads a checkpoint into the set-up strategy; returns (batches to skip in this epoch, RNG state)."""
        self.strategy.load(path, with_optimizer=True)
        state, rng = checkpoint.load_trainer_state(path, self.global_rank)
        self.global_step = state["global_step"]
        self.current_epoch = state["epoch"] + (1 if state["epoch_done"] else 0)
        skip = 0 if state["epoch_done"] else state["batches_done"]
        for cb in self.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        for sched, sd in zip(self.strategy.schedulers, state["schedulers"]):
            sched.scheduler.load_state_dict(sd)
        self._module.on_load_checkpoint(state)
        self.print0(f"Resumed from {path} at epoch {self.current_epoch}, global step {self.global_step}.")
        return skip, rng


def _loss_of(out: Any) -> torch.Tensor:
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(loss)[:80]
        if isinstance(out, dict) and "loss" not in out:
            shape = f"a dict without 'loss' (keys {sorted(map(str, out))})"
        raise ConfigError(f"training_step returned {shape}: under automatic optimization it must return a "
                          "scalar loss tensor or a dict with a 'loss' scalar.")
    return loss.reshape(())
