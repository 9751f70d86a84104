"""What every run records without being asked: the `RunMetrics` callback.

At fit start, rank 0 logs the run's settings as hyper-parameters (strategy and its effective config,
devices,
precision, the Trainer's flags, parameter count). At every log step, rank 0 logs:

    lr-<Optimizer>[-i][/pgN]   learning rate per param group (LearningRateMonitor's names)
    samples_per_s, tokens_per_s, step_time_s   over the steps since the previous log step,
    validation excluded;
                               tokens when the batch's first tensor holds integer token ids (2-D)
    peak_memory_gib/rank<r>    every rank's peak memory, gathered: CUDA max_memory_allocated, on CPU
    the peak RSS epoch

At fit end it logs `fit_time_s`, `data_wait` (on CUDA, the median share of a step the GPU waited for
its batch over steps 11-50, data.DataWait) and, when a CSVLogger is present, writes the run report
next to its metrics.csv.
"""

from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.callbacks import Callback, LearningRateMonitor
from lightspeed.loggers.logger import plain
from lightspeed.report.run_report import MEMORY_PREFIX, RUN_SETTINGS
from lightspeed.specs import TrainerView as Trainer

Module = torch.nn.Module


def optimizer_name(opt: Any) -> str:
    """The class name of the user's optimizer, also when a backend wraps it (DeepSpeed's ZeRO
    optimizer keeps it in `.optimizer`, ZeroRedundancyOptimizer in `.optim`), so runs under
    different strategies share metric names."""
    for attr in ("optimizer", "optim"):
        inner = getattr(opt, attr, None)
        if isinstance(inner, torch.optim.Optimizer):
            return optimizer_name(inner)
    return type(opt).__name__


def learning_rates(optimizers: list) -> dict[str, float]:
    """`{"lr-AdamW": 1e-3}`; several optimizers get `-<i>`, several param groups `/pg<j>` (1-based),
    as Lightning's LearningRateMonitor names them."""
    out: dict[str, float] = {}
    for i, opt in enumerate(optimizers):
        base = f"lr-{optimizer_name(opt)}" + (f"-{i}" if len(optimizers) > 1 else "")
        groups = opt.param_groups
        for j, group in enumerate(groups):
            lr = group["lr"]
            out[base if len(groups) == 1 else f"{base}/pg{j + 1}"] = float(
                lr.item() if torch.is_tensor(lr) else lr
            )
    return out


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: CUDA `max_memory_allocated` on a GPU, the peak resident set size
    on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # bytes on macOS, KiB on Linux


def gather_peak_memory(device: torch.device) -> list[int]:
    """Collective when a process group of several ranks exists (every rank must call it): each
    rank's peak memory in bytes, indexed by rank."""
    mine = peak_memory_bytes(device)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    # NCCL gathers device tensors only; gloo takes CPU tensors. The trainer's device fits the
    # group's backend.
    t = torch.tensor([mine], dtype=torch.int64, device=device)
    parts = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return [int(p.item()) for p in parts]


def count_parameters(module: torch.nn.Module) -> int:
    """Parameters of the whole model, also when sharded: ZeRO-3 keeps the full count in `ds_numel`,
    an FSDP2 DTensor reports its global shape. Tied weights count once."""
    unique = {id(p): p for p in module.parameters()}.values()
    return int(sum(getattr(p, "ds_numel", p.numel()) for p in unique))


def run_settings(trainer: Trainer, module: Module) -> dict[str, Any]:
    """What the report's settings table shows and `run.yaml` holds: strategy (name and options),
    world size, device, precision, parameter count, the Trainer's flags and the module's `hparams`
    if it has any."""
    settings: dict[str, Any] = {
        "strategy": trainer.strategy.name,
        "world_size": trainer.world_size,
        "device": trainer.device.type,
        "precision": trainer.precision,
        "parameters": count_parameters(module),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "strategy_options": trainer.strategy.settings(),  # its options (Strategy.settings)
        "trainer": trainer.config.as_flags(),
    }
    hparams = getattr(module, "hparams", None)
    if isinstance(hparams, dict) and hparams:
        settings["module"] = dict(hparams)
    return settings


def _batch_counts(batch: Any) -> tuple[int, int | None]:
    """(samples, tokens) of one micro-batch: the first tensor's length, and its element count when
    it holds integer token ids of shape (batch, sequence); tokens is None otherwise."""
    first = batch
    while isinstance(first, (list, tuple, dict)) and first:
        first = next(iter(first.values())) if isinstance(first, dict) else first[0]
    if not torch.is_tensor(first) or first.dim() == 0:
        return 1, None
    is_ids = first.dim() == 2 and not first.is_floating_point() and not first.is_complex()
    return int(first.shape[0]), (int(first.numel()) if is_ids else None)


class RunMetrics(Callback):
    """Records learning rates, grad norm, throughput, step time, peak memory per rank and epoch at
    every log step (see the module docstring), the run's settings at fit start, and writes the
    report at fit end.

    Args:
        report: write `report.html` and its PNGs into the CSVLogger's folder at fit end (rank 0).
    """

    def __init__(self, report: bool = True):
        self.report = report
        self.peak_memory: list[int] = []  # bytes per rank, at the last log step
        self.report_path = None
        self._reset(time.perf_counter())

    def _reset(self, now: float) -> None:
        self._window_start, self._steps, self._samples, self._tokens = now, 0, 0, 0
        self._has_tokens = True

    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        self._fit_start = time.perf_counter()
        self._reset(self._fit_start)
        # A LearningRateMonitor the user added logs the rates under the same names: one writer per
        # key.
        self._log_lr = not any(isinstance(cb, LearningRateMonitor) for cb in trainer.callbacks)
        # The run's settings go to `run.yaml` beside the CSVLogger's metrics (the report's table),
        # not to the loggers: as in Lightning, they receive the user's hyper-parameters only.
        csv_logger = trainer.run_csv
        if trainer.is_global_zero and csv_logger is not None:
            import yaml

            Path(csv_logger.log_dir).mkdir(parents=True, exist_ok=True)
            settings = plain(run_settings(trainer, module))
            (Path(csv_logger.log_dir) / RUN_SETTINGS).write_text(
                yaml.safe_dump(settings, sort_keys=False)
            )

    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        self._reset(
            time.perf_counter()
        )  # the sanity check's validation batches do not count as training time

    def on_validation_epoch_start(self, trainer: Trainer, module: Module) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        if trainer.fitting:  # validation time does not count towards training throughput
            self._window_start += time.perf_counter() - self._validation_start

    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Called once per optimizer step with the window's last micro-batch; all windows are taken
        # to be full.
        samples, tokens = _batch_counts(batch)
        # The data-parallel ranks' batches: the ranks of a tensor-parallel group share theirs.
        replicas = (trainer.strategy.distributed_sampler_kwargs or {}).get("num_replicas", 1)
        scale = trainer.accumulate_grad_batches * replicas
        self._steps += 1
        self._samples += samples * scale
        self._has_tokens = self._has_tokens and tokens is not None
        self._tokens += (tokens or 0) * scale
        if trainer.global_step % trainer.log_every_n_steps:
            return
        self.peak_memory = gather_peak_memory(
            trainer.device
        )  # collective: every rank is at this step
        now = time.perf_counter()
        elapsed = max(now - self._window_start, 1e-9)
        if trainer.is_global_zero:
            metrics = learning_rates(trainer.strategy.optimizers) if self._log_lr else {}
            metrics.update(
                samples_per_s=self._samples / elapsed,
                step_time_s=elapsed / self._steps,
                epoch=trainer.current_epoch,
            )
            if self._has_tokens:
                metrics["tokens_per_s"] = self._tokens / elapsed
            metrics.update(
                {f"{MEMORY_PREFIX}{r}": b / 2**30 for r, b in enumerate(self.peak_memory)}
            )
            trainer.log_metrics(metrics)
        self._reset(now)

    def on_fit_end(self, trainer: Trainer, module: Module) -> None:
        if not trainer.is_global_zero:
            return
        wait = getattr(
            getattr(trainer, "move", None), "wait", None
        )  # data.DataWait: CUDA runs of 51+ steps
        measured = {"data_wait": wait.share} if wait is not None and wait.share is not None else {}
        trainer.log_metrics({"fit_time_s": time.perf_counter() - self._fit_start, **measured})
        csv_logger = trainer.run_csv
        if csv_logger is not None:
            csv_logger.save()  # the rows it still holds: the report reads the file
        if self.report and csv_logger is not None and csv_logger.path.exists():
            from lightspeed.report.run_report import write_report

            self.report_path = write_report(csv_logger.log_dir)
