"""ProgressBar: the base of the progress-bar callbacks, with Lightning's interface (the batch
totals, `get_metrics`, `enable` / `disable`, `print`).

    class LitProgressBar(ProgressBar):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            done = f"{batch_idx + 1}/{self.total_train_batches}"
            print(done, self.get_metrics(trainer, pl_module))

A subclass that draws itself (`draws_itself = True`, as TQDMProgressBar) replaces lightspeed's
own bar; one that does not (RichProgressBar) configures it.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from lightspeed.callbacks.callback import Callback


def convert_inf(x: int | float | None) -> int | float | None:
    """None for an infinite total (a bar without an end), else `x`."""
    return None if x is None or math.isinf(x) or math.isnan(x) else x


class ProgressBar(Callback):
    """The progress bar's interface; the Trainer holds at most one
    (`trainer.progress_bar_callback`).

    The totals read the Trainer's batch counts (after `limit_*_batches`); `get_metrics` gives what
    the bar shows: the logger's version as `v_num`, then every metric logged with `prog_bar=True`.
    """

    is_progress_bar = True  # what the Trainer and `trainer.progress_bar_callback` look for
    draws_itself = False  # True: lightspeed's own bar stays off while this one draws

    def __init__(self) -> None:
        self._trainer: Any = None
        self._current_eval_dataloader_idx: int | None = None

    def __getstate__(self) -> dict:
        return {**vars(self), "_trainer": None}  # the Trainer does not travel with the callback

    @property
    def trainer(self) -> Any:
        if self._trainer is None:
            raise TypeError(f"The `{type(self).__name__}._trainer` reference has not been set yet.")
        return self._trainer

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._trainer = trainer
        if not trainer.is_global_zero:
            self.disable()  # one bar per job: rank 0's

    # ------------------------------------------------------------------ descriptions
    @property
    def sanity_check_description(self) -> str:
        return "Sanity Checking"

    @property
    def train_description(self) -> str:
        return "Training"

    @property
    def validation_description(self) -> str:
        return "Validation"

    @property
    def test_description(self) -> str:
        return "Testing"

    @property
    def predict_description(self) -> str:
        return "Predicting"

    # ------------------------------------------------------------------ totals
    @property
    def total_train_batches(self) -> int | float:
        """Training batches per epoch (inf for a loader without a length)."""
        return self.trainer.num_training_batches

    def _eval_total(self, counts: list, dataloader_idx: int | None) -> int | float:
        idx = self._current_eval_dataloader_idx if dataloader_idx is None else dataloader_idx
        return counts[idx or 0] if counts else 0

    @property
    def total_val_batches_current_dataloader(self) -> int | float:
        trainer = self.trainer
        counts = (
            trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
        )
        return self._eval_total(counts, None)

    @property
    def total_test_batches_current_dataloader(self) -> int | float:
        return self._eval_total(self.trainer.num_test_batches, None)

    @property
    def total_predict_batches_current_dataloader(self) -> int | float:
        return self._eval_total(self.trainer.num_predict_batches, None)

    @property
    def total_val_batches(self) -> int | float:
        """Validation batches of this fit epoch, every loader together (0 in an epoch without
        validation)."""
        trainer = self.trainer
        every = getattr(trainer, "check_val_every_n_epoch", 1) or 0
        if trainer.fitting and every and (trainer.current_epoch + 1) % every:
            return 0
        return sum(trainer.num_val_batches)

    def has_dataloader_changed(self, dataloader_idx: int) -> bool:
        """Whether `dataloader_idx` is another loader than the previous batch's (a bar resets)."""
        changed = self._current_eval_dataloader_idx != dataloader_idx
        self._current_eval_dataloader_idx = dataloader_idx
        return changed

    def reset_dataloader_idx_tracker(self) -> None:
        self._current_eval_dataloader_idx = None

    # ------------------------------------------------------------------ switches
    def disable(self) -> None:
        """Turns the bar off (the Trainer does so on ranks other than 0)."""
        raise NotImplementedError

    def enable(self) -> None:
        raise NotImplementedError

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Prints without breaking the bar's line."""
        print(*args, **kwargs)

    # ------------------------------------------------------------------ what it shows
    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, int | str | float | dict]:
        """`v_num` (the logger's version) and every `prog_bar=True` metric, as the bar shows them.
        Override to add or drop items."""
        standard = get_standard_metrics(trainer)
        shown = trainer.progress_bar_metrics
        clashing = sorted(set(standard) & set(shown))
        if clashing:
            warnings.warn(
                f"The progress bar already tracks a metric with the name(s) '{', '.join(clashing)}'"
                " and `self.log('{clashing[0]}', ..., prog_bar=True)` will overwrite this value. "
                "If this is undesired, change the name or override `get_metrics()` in the progress "
                "bar callback.",
                stacklevel=2,
            )
        return {**standard, **shown}


def get_standard_metrics(trainer: Any) -> dict[str, int | str]:
    """{"v_num": the version of the Trainer's logger (several: their versions joined by "_"; a long
    string version: its last 4 characters)}; {} without loggers."""
    versions = [getattr(lg, "version", None) for lg in trainer.loggers]
    versions = list(dict.fromkeys(v for v in versions if v not in (None, "")))
    if not versions:
        return {}
    version = versions[0] if len(versions) == 1 else "_".join(map(str, versions))
    return {"v_num": version[-4:] if isinstance(version, str) else version}
