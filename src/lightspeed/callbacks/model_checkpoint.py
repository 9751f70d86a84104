"""ModelCheckpoint: when to save and under which name, decided on rank 0 and broadcast; the Trainer
saves.

Names are Lightning's: `epoch=0-step=10.ckpt` (`-v1` before `.ckpt` where an earlier run left that
name), and `last.ckpt`, which always points at the newest complete checkpoint. Under the replicated
strategies each is one file; a checkpoint kept only because it is the newest (`save_last`, not in
the top k) is saved as `last.ckpt` itself, so the folder lists what Lightning's does.
"""

from __future__ import annotations

import re
import shutil
import time
import weakref
from pathlib import Path
from typing import Any, Literal, cast

from lightspeed.callbacks.callback import Callback
from lightspeed.callbacks.monitor import _check_mode, _improved
from lightspeed.checkpoint.checkpointer import LAST, unused_name
from lightspeed.checkpoint.layouts import writes_file
from lightspeed.config import parse_duration
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import AgreedMax, broadcast_from_rank0
from lightspeed.specs import TrainerView as Trainer


def format_checkpoint_name(template: str, values: dict[str, Any], insert_names: bool = True) -> str:
    """Lightning's checkpoint file names: "{epoch}-{val/loss:.2f}" -> "epoch=3-val_loss=0.12" (with
    `insert_names`; "/" in a metric name becomes "_"). A name the run never logged is a
    ConfigError."""

    def field(match: re.Match) -> str:
        name, spec = match.group(1), match.group(2) or ""
        if name not in values:
            raise ConfigError(
                f"ModelCheckpoint(filename={template!r}) names {name!r}, which was not logged: "
                f"logged metrics are {sorted(set(values) - {'epoch', 'step'})}."
            )
        text = format(values[name], spec[1:])
        return f"{name.replace('/', '_')}={text}" if insert_names else text

    return re.sub(r"\{([^{}:]+)(:[^{}]*)?\}", field, template)


def remove_checkpoint(path: str | Path) -> None:
    """Deletes a checkpoint, a file or a directory (a symlink: the link only)."""
    path = Path(path)
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


class ModelCheckpoint(Callback):
    """Saves checkpoints (collectively: every rank takes part) and keeps the best `save_top_k` by
    `monitor`.

    Args:
        dirpath: where checkpoints go (default `<default_root_dir>/checkpoints`).
        monitor: a logged metric; None keeps the most recent `save_top_k` instead.
        mode: "min" or "max". save_top_k: -1 keeps all, 0 none (only `last.ckpt`).
        save_last: also keep the newest checkpoint when it is not among the top k (True or
            Lightning's "link"). Whatever is kept, `last.ckpt` (a symlink moved only after a save
            completes, or the newest file itself) points at the newest one.
        every_n_train_steps / every_n_epochs / train_time_interval: when to save (default: every
        epoch end);
            `train_time_interval` ("DD:HH:MM:SS", a timedelta or its keywords) goes by rank 0's
            clock, checked after each step (under NCCL one step late, so the host never waits for
            the GPU).
        save_on_train_epoch_end: False saves after each validation during fit (mid-epoch ones too)
        instead of at
            the training epoch's end; None and True save at the epoch's end, after its validation.
        verbose: says on rank 0 what each save kept. enable_version_counter: False lets a new run
        overwrite a
            checkpoint of the same name an earlier run left in `dirpath` (default: the new one gets
            `-v1`).
        save_weights_only: accepted; every checkpoint holds weights and optimizer state so that it
        resumes
            exactly (`lightspeed.consolidate` writes the weights alone).
    The arguments are Lightning's, in its order.
    """

    CHECKPOINT_NAME_LAST = "last"  # Lightning's class attributes
    FILE_EXTENSION = ".ckpt"

    def __init__(
        self,
        dirpath: str | Path | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        verbose: bool = False,
        save_last: bool | Literal["link"] | None = None,
        save_top_k: int = 1,
        save_weights_only: bool = False,
        mode: Literal["min", "max"] = "min",
        auto_insert_metric_name: bool = True,
        every_n_train_steps: int | None = None,
        train_time_interval: Any = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        enable_version_counter: bool = True,
    ):
        _check_mode(mode)
        if save_top_k < -1:
            raise ConfigError(
                f"save_top_k={save_top_k!r} is not valid: use -1 (all), 0 or a positive count."
            )
        for name, n in (
            ("every_n_train_steps", every_n_train_steps),
            ("every_n_epochs", every_n_epochs),
        ):
            if n is not None and n < 0:
                raise ConfigError(f"{name}={n!r} is not valid: use None or a count ≥ 0.")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.filename = filename or "{epoch}-{step}"
        self.auto_insert_metric_name = auto_insert_metric_name
        self.monitor, self.mode, self.save_top_k, self.save_last = (
            monitor,
            mode,
            save_top_k,
            save_last,
        )
        self.every_n_train_steps = every_n_train_steps or 0
        self.train_time_interval = parse_duration("train_time_interval", train_time_interval)
        self.every_n_epochs = (
            every_n_epochs
            if every_n_epochs is not None
            else (0 if self.every_n_train_steps or self.train_time_interval else 1)
        )
        self.verbose, self.save_weights_only, self.save_on_train_epoch_end = (
            verbose,
            save_weights_only,
            save_on_train_epoch_end,
        )
        self.enable_version_counter = enable_version_counter
        self._agreed, self._time_mark = AgreedMax(), 0.0
        self.best_k: dict[str, float] = {}  # path -> score (Lightning's `best_k_models`)
        self.best_model_path = ""
        self.best_model_score: float | None = None
        self.last_model_path = ""
        self._last_saved_step = -1
        self._last_only: str | None = (
            None  # the newest save when kept only as `last`, not among the top k
        )
        self._earlier_runs: set[str] = (
            set()
        )  # names an earlier run left in dirpath: never overwritten

    @property
    def state_key(self) -> str:
        """Lightning's key, so that a Lightning checkpoint's ModelCheckpoint state restores here
        and ours there."""
        triggers = {
            "monitor": self.monitor,
            "mode": self.mode,
            "every_n_train_steps": self.every_n_train_steps,
            "every_n_epochs": self.every_n_epochs,
            "train_time_interval": self.train_time_interval,
        }
        return f"{type(self).__qualname__}{triggers!r}"

    def setup(self, trainer, module, stage) -> None:
        if self.dirpath is None:
            self.dirpath = Path(trainer.default_root_dir) / "checkpoints"
        if stage == "fit":
            self._earlier_runs = (
                {p.name for p in self.dirpath.iterdir()} if self.dirpath.is_dir() else set()
            )

    def on_train_start(self, trainer, module) -> None:
        self._agreed.reset()
        self._time_mark = time.monotonic()
        if self.save_weights_only and trainer.is_global_zero:
            trainer.print0(
                "ModelCheckpoint(save_weights_only=True): lightspeed checkpoints keep the "
                "optimizer "
                "state too, so that they resume exactly; lightspeed.consolidate writes the weights "
                "alone."
            )

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        n = self.every_n_train_steps
        if n and trainer.global_step % n == 0 and trainer.global_step != self._last_saved_step:
            self._save(trainer)
        if self.train_time_interval is not None:  # rank 0's clock decides for every rank
            due = (
                trainer.is_global_zero
                and time.monotonic() - self._time_mark >= self.train_time_interval.total_seconds()
            )
            if self._agreed(int(due)) and trainer.global_step != self._last_saved_step:
                self._time_mark = time.monotonic()
                self._save(trainer)

    def on_train_epoch_end(self, trainer, module) -> None:
        if self.save_on_train_epoch_end is not False:
            self._every_n_epochs(trainer)

    def on_validation_end(self, trainer, module) -> None:
        if (
            self.save_on_train_epoch_end is False
            and trainer.fitting
            and not trainer.sanity_checking
        ):
            self._every_n_epochs(trainer)

    def _every_n_epochs(self, trainer: Trainer) -> None:
        n = self.every_n_epochs
        if (
            n
            and (trainer.current_epoch + 1) % n == 0
            and trainer.global_step != self._last_saved_step
        ):
            self._save(trainer)

    def _decide(self, trainer: Trainer) -> tuple:
        """(error message or None, keep among the top k, path, score), from this rank's metrics."""
        metrics = trainer.callback_metrics
        # Lightning's candidates: the logged metrics, and "epoch" / "step" unless logged
        candidates = {"epoch": trainer.current_epoch, "step": trainer.global_step, **metrics}
        score = None
        if self.monitor is not None:
            if self.monitor not in candidates:
                return (
                    f"ModelCheckpoint(monitor={self.monitor!r}) was not logged: logged metrics are "
                    f"{sorted(metrics)}.",
                    False,
                    None,
                    None,
                )
            score = float(candidates[self.monitor])
        values = {
            "epoch": trainer.current_epoch,
            "step": trainer.global_step,
            **{k: float(v) for k, v in metrics.items()},
        }
        try:
            name = format_checkpoint_name(self.filename, values, self.auto_insert_metric_name)
            name += self.FILE_EXTENSION
        except ConfigError as e:
            return str(e), False, None, None
        path = self.dirpath / name
        if (
            name in self._earlier_runs and self.enable_version_counter
        ):  # a fresh run: keep the earlier one
            path = unused_name(path)
        keep = self.save_top_k != 0 and (
            self.monitor is None
            or self.save_top_k == -1
            or len(self.best_k) < self.save_top_k
            or _improved(cast(float, score), self._worst(), self.mode)  # monitor set: a score
        )
        return None, keep, path, score

    def _save(self, trainer: Trainer) -> None:
        if trainer.fast_dev_run:  # a trial run of the code: nothing saved (Lightning's rule)
            return
        # Rank 0 decides for every rank: metrics differ between ranks (a val_loss logged without
        # sync_dist), but
        # saving is collective and every rank must write into the same directory.
        error, keep, path, score = broadcast_from_rank0(
            self._decide(trainer) if trainer.is_global_zero else None
        )
        if error:
            raise ConfigError(error)
        self._last_saved_step = trainer.global_step
        if not keep and not self.save_last:
            return
        if not keep and writes_file(trainer.strategy.name, trainer.world_size):
            path = cast(Path, self.dirpath) / LAST  # the newest, kept only as Lightning's last.ckpt
        trainer.save_checkpoint(path)  # also moves `last.ckpt` here, once the save is complete
        self.last_model_path = str(self.dirpath / LAST) if self.save_last else str(path)
        if keep:
            self.best_k[str(path)] = score if score is not None else float(trainer.global_step)
            self._prune(trainer, current=str(path))
        self._drop_previous_last_only(trainer, None if keep or path.name == LAST else str(path))
        for lg in trainer.loggers if trainer.is_global_zero else []:
            if hasattr(lg, "after_save_checkpoint"):  # Lightning's logger hook (W&B uploads here)
                lg.after_save_checkpoint(weakref.proxy(self))
        if self.verbose:
            what = ""
            if self.monitor is not None:
                what = (
                    f"{self.monitor!r} reached {score:.6g} (best {self.best_model_score:.6g}), "
                    if keep
                    else f"{self.monitor!r} was not in the top {self.save_top_k}, "
                )
            trainer.print0(
                f"Epoch {trainer.current_epoch}, global step {trainer.global_step}: {what}saved "
                f"{path}"
            )

    def _drop_previous_last_only(self, trainer, last_only: str | None) -> None:
        # A directory kept only as `last` goes once `last` points elsewhere, whether at a new best
        # or a newer
        # last-only one.
        prev = self._last_only
        if trainer.is_global_zero and prev and prev not in self.best_k and prev != last_only:
            remove_checkpoint(prev)
        self._last_only = last_only

    def _worst(self) -> float | None:
        if not self.best_k:
            return None
        return (max if self.mode == "min" else min)(self.best_k.values())

    def _prune(self, trainer: Trainer, current: str) -> None:
        if self.monitor is None:
            # Without a monitor, "best" means most recent: scores are global steps, keep the
            # highest.
            order = sorted(self.best_k, key=self.best_k.__getitem__, reverse=True)
        else:
            order = sorted(self.best_k, key=self.best_k.__getitem__, reverse=(self.mode == "max"))
        if self.save_top_k > 0:
            for stale in order[self.save_top_k :]:
                del self.best_k[stale]
                if trainer.is_global_zero and stale != current:
                    remove_checkpoint(stale)
            order = order[: self.save_top_k]
        self.best_model_path = order[0]
        self.best_model_score = self.best_k[order[0]] if self.monitor is not None else None

    @property
    def best_k_models(self) -> dict[str, float]:
        """Lightning's name: {checkpoint path: its score} of the checkpoints kept."""
        return self.best_k

    def state_dict(self) -> dict:
        """Lightning's keys (its ModelCheckpoint restores from them), and the step last saved."""
        worst = self._worst()
        kth = next((p for p, s in self.best_k.items() if s == worst), "")
        inf = float("inf") if self.mode == "min" else -float("inf")
        return {
            "monitor": self.monitor,
            "best_model_score": self.best_model_score,
            "best_model_path": self.best_model_path,
            "current_score": None,
            "dirpath": str(self.dirpath),
            "best_k_models": dict(self.best_k),
            "kth_best_model_path": kth,
            "kth_value": worst if worst is not None else inf,
            "last_model_path": self.last_model_path,
            "last_saved_step": self._last_saved_step,
        }

    def load_state_dict(self, state: dict) -> None:
        """Takes our state or Lightning's (its scores are tensors)."""
        best = state.get("best_k_models", state.get("best_k", {}))
        self.best_k = {str(k): float(v) for k, v in best.items()}
        self.best_model_path = state.get("best_model_path", "")
        score = state.get("best_model_score")
        self.best_model_score = float(score) if score is not None else None
        self.last_model_path = state.get("last_model_path", "")
        self._earlier_runs = set()  # a resumed run continues its own line of checkpoints
        # Without it, a resumed run's epoch-end trigger would save again the step the checkpoint was
        # taken at.
        self._last_saved_step = state.get("last_saved_step", -1)
