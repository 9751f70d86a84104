"""RichProgressBar: Lightning's rich bar, one task per stage: the sanity check, the training epoch
(with the `prog_bar` metrics beside it), each validation run, test and predict.

    Trainer(callbacks=[RichProgressBar(leave=True)])   # keep every epoch's bar on the screen

Subclasses change the look through `configure_columns(trainer)` and read the bars through
`progress` (rich's `Progress`) and the task ids (`train_progress_bar_id`, ...).

Without a bar given, the Trainer adds `DefaultProgressBar`, a RichProgressBar that leaves the
drawing to lightspeed's own bar (report/progress.py: the fit's optimizer steps, rich on a terminal,
periodic lines in CI logs).
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from lightspeed.callbacks.progress.progress_bar import ProgressBar, convert_inf
from lightspeed.errors import ConfigError

_RICH_AVAILABLE = importlib.util.find_spec("rich") is not None
if _RICH_AVAILABLE:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, ProgressColumn, Task, TaskID, TextColumn
    from rich.text import Text
else:  # the bar needs rich; the classes still define, so the names import
    ProgressColumn = object  # type: ignore[assignment,misc]


@dataclass
class RichProgressBarTheme:
    """The styles of the bar's parts (rich style strings); `metrics_format` formats each number
    shown beside the training bar, `metrics_text_delimiter` joins them."""

    description: str = ""
    progress_bar: str = "#6206E0"
    progress_bar_finished: str = "#6206E0"
    progress_bar_pulse: str = "#6206E0"
    batch_progress: str = ""
    time: str = "dim"
    processing_speed: str = "dim underline"
    metrics: str = "italic"
    metrics_text_delimiter: str = " "
    metrics_format: str = ".3f"


class _TextOf(ProgressColumn):  # type: ignore[misc,valid-type]
    """A column showing `text(task)` in `style`."""

    def __init__(self, text: Callable[[Task], str], style: str) -> None:
        self._text, self._style = text, style
        super().__init__()

    def render(self, task: Task) -> Text:
        return Text(self._text(task), style=self._style)


def _batches(task: Task) -> str:
    return f"{int(task.completed)}/{'--' if task.total is None else int(task.total)}"


def _times(task: Task) -> str:
    def clock(seconds: float | None) -> str:
        return "-:--:--" if seconds is None else str(timedelta(seconds=int(seconds)))

    elapsed = task.finished_time if task.finished else task.elapsed
    return f"{clock(elapsed)} • {clock(task.time_remaining)}"


def _speed(task: Task) -> str:
    return f"{task.speed or 0.0:.2f}it/s"


class _MetricsColumn(ProgressColumn):  # type: ignore[misc,valid-type]
    """The metrics, beside the training bar only. `update` is called between batches; rendering
    reads the last dict given."""

    def __init__(self, bar: RichProgressBar) -> None:
        self._bar, self._metrics = bar, {}
        super().__init__()

    def update(self, metrics: dict[str, Any]) -> None:
        self._metrics = metrics

    def render(self, task: Task) -> Text:
        if task.id != self._bar.train_progress_bar_id:
            return Text()
        theme = self._bar.theme
        texts = [
            f"{name}: {self._formatted(value, theme.metrics_format)}"
            for name, value in self._metrics.items()
        ]
        return Text(theme.metrics_text_delimiter.join(texts), justify="left", style=theme.metrics)

    @staticmethod
    def _formatted(value: Any, spec: str) -> str:
        if isinstance(value, str):
            return value
        try:
            return format(value, spec)
        except (TypeError, ValueError):  # an int version, a dict: as they print
            return str(value)


class RichProgressBar(ProgressBar):
    """Lightning's rich progress bar. `refresh_rate`: redraws per second at most (0: no bar);
    `leave`: keep each epoch's training bar; `theme`: the styles; `console_kwargs`: rich's
    `Console` arguments. Raises ModuleNotFoundError without rich, ConfigError for a
    `refresh_rate` that is not an integer ≥ 0."""

    draws_itself = True

    def __init__(
        self,
        refresh_rate: int = 100,
        leave: bool = False,
        theme: RichProgressBarTheme | None = None,
        console_kwargs: dict[str, Any] | None = None,
    ):
        if not _RICH_AVAILABLE:
            raise ModuleNotFoundError(
                "`RichProgressBar` requires `rich` >= 10.2.2. Install it by running "
                "`pip install -U rich`."
            )
        super().__init__()
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ConfigError(
                f"refresh_rate={refresh_rate!r} is not valid: expected an integer ≥ 0 (0: no bar)."
            )
        self.refresh_rate, self.leave = refresh_rate, leave
        self.theme = theme or RichProgressBarTheme()
        self._console_kwargs = console_kwargs or {}
        self._enabled = True
        self.progress: Progress | None = None
        self._progress_stopped = False
        self._metric_component: _MetricsColumn | None = None
        self._last_refresh = 0.0
        self._reset_progress_bar_ids()

    def __getstate__(self) -> dict:
        # rich's Progress and Console hold locks and the terminal: a pickled callback drops them
        return {**super().__getstate__(), "progress": None, "_metric_component": None}

    @property
    def is_enabled(self) -> bool:
        return self._enabled and self.refresh_rate > 0

    @property
    def is_disabled(self) -> bool:
        return not self.is_enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    # ------------------------------------------------------------------ the rich Progress
    def configure_columns(self, trainer: Any) -> list:
        """The columns before the metrics: description, bar, batches done/total, elapsed •
        remaining, speed. Override to change the look."""
        theme = self.theme
        return [
            TextColumn("[progress.description]{task.description}", style=theme.description),
            BarColumn(
                complete_style=theme.progress_bar,
                finished_style=theme.progress_bar_finished,
                pulse_style=theme.progress_bar_pulse,
            ),
            _TextOf(_batches, theme.batch_progress),
            _TextOf(_times, theme.time),
            _TextOf(_speed, theme.processing_speed),
        ]

    def _init_progress(self, trainer: Any) -> None:
        """Starts a new `progress` (its task ids reset) unless one is running."""
        if not (self.draws_itself and self.is_enabled):
            return
        if self.progress is not None and not self._progress_stopped:
            return
        self._reset_progress_bar_ids()
        self._metric_component = _MetricsColumn(self)
        self.progress = Progress(
            *self.configure_columns(trainer),
            self._metric_component,
            auto_refresh=False,  # redrawn from the loop's thread, by refresh()
            console=Console(**self._console_kwargs),
        )
        self.progress.start()
        self._progress_stopped = False

    def _stop_progress(self) -> None:
        if self.progress is not None and not self._progress_stopped:
            self.progress.stop()
        self._progress_stopped = True  # the next stage starts a new Progress

    def _reset_progress_bar_ids(self) -> None:
        self.train_progress_bar_id: TaskID | None = None
        self.val_sanity_progress_bar_id: TaskID | None = None
        self.val_progress_bar_id: TaskID | None = None
        self.test_progress_bar_id: TaskID | None = None
        self.predict_progress_bar_id: TaskID | None = None

    def refresh(self, hard: bool = False) -> None:
        """Redraws, at most `refresh_rate` times a second unless `hard`."""
        now = time.monotonic()
        if self.progress is None or self.is_disabled:
            return
        if hard or now - self._last_refresh >= 1 / self.refresh_rate:
            self._last_refresh = now
            self.progress.refresh()

    def _add_task(self, total: int | float, description: str, visible: bool = True) -> TaskID:
        assert self.progress is not None
        style = self.theme.description
        return self.progress.add_task(
            f"[{style}]{description}" if style else description,
            total=convert_inf(total),  # None: a loader without a length (the bar pulses)
            visible=visible,
        )

    def _replace_task(self, old: TaskID | None, total: int | float, description: str) -> TaskID:
        """A new task for the next evaluation loader or run; the previous one is removed."""
        assert self.progress is not None
        if old is not None:
            self.progress.remove_task(old)
        return self._add_task(total, description, visible=False)  # shown at its first batch

    def _update(self, task_id: TaskID | None, completed: int, visible: bool = True) -> None:
        if self.progress is not None and task_id is not None:
            self.progress.update(task_id, completed=completed, visible=visible)
            self.refresh()

    def _hide(self, task_id: TaskID | None) -> None:
        if self.progress is not None and task_id is not None:
            self.progress.update(task_id, visible=False)
            self.refresh()

    def _get_train_description(self, current_epoch: int) -> str:
        """ "Epoch 3/9" (of max_epochs), padded to the validation description's width so that the
        bars do not shift when the validation bar appears."""
        text = f"Epoch {current_epoch}"
        if self.trainer.max_epochs is not None:
            text += f"/{self.trainer.max_epochs - 1}"
        return text.ljust(len(self.validation_description))

    # ------------------------------------------------------------------ what it shows
    def get_metrics(self, trainer: Any, pl_module: Any) -> dict[str, int | str | float | dict]:
        items = super().get_metrics(trainer, pl_module)
        return {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in items.items()}

    def _update_metrics(self, trainer: Any, pl_module: Any) -> None:
        if self.is_enabled and self._metric_component is not None:
            self._metric_component.update(self.get_metrics(trainer, pl_module))

    # ------------------------------------------------------------------ stages start and end
    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self._init_progress(trainer)

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        self._hide(self.val_sanity_progress_bar_id)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._init_progress(trainer)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._init_progress(trainer)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._init_progress(trainer)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._init_progress(trainer)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._stop_progress()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._stop_progress()

    # ------------------------------------------------------------------ training
    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.train_progress_bar_id is not None and self.leave:
            self._stop_progress()  # the finished epoch's bar stays printed above the new one
            self._init_progress(trainer)
        if self.progress is None:
            return
        description = self._get_train_description(trainer.current_epoch)
        total = convert_inf(self.total_train_batches)
        if self.train_progress_bar_id is None:
            self.train_progress_bar_id = self._add_task(self.total_train_batches, description)
        else:
            self.progress.reset(
                self.train_progress_bar_id, total=total, description=description, visible=True
            )
        self.refresh()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.progress is not None and self.train_progress_bar_id is None:  # resumed mid-epoch
            description = self._get_train_description(trainer.current_epoch)
            self.train_progress_bar_id = self._add_task(self.total_train_batches, description)
        self._update_metrics(trainer, pl_module)
        self._update(self.train_progress_bar_id, batch_idx + 1)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._update_metrics(trainer, pl_module)
        self.refresh()

    # ------------------------------------------------------------------ evaluation
    def on_validation_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.progress is None or not self.has_dataloader_changed(dataloader_idx):
            return
        total = self.total_val_batches_current_dataloader
        if trainer.sanity_checking:
            self.val_sanity_progress_bar_id = self._replace_task(
                self.val_sanity_progress_bar_id, total, self.sanity_check_description
            )
        else:
            self.val_progress_bar_id = self._replace_task(
                self.val_progress_bar_id, total, self.validation_description
            )

    def on_validation_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        sanity = trainer.sanity_checking
        task = self.val_sanity_progress_bar_id if sanity else self.val_progress_bar_id
        self._update(task, batch_idx + 1)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self._hide(self.val_progress_bar_id)  # the training bar goes on alone

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.state.fn == "fit":
            self._update_metrics(trainer, pl_module)
        self.reset_dataloader_idx_tracker()

    def on_test_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.progress is None or not self.has_dataloader_changed(dataloader_idx):
            return
        self.test_progress_bar_id = self._replace_task(
            self.test_progress_bar_id,
            self.total_test_batches_current_dataloader,
            self.test_description,
        )

    def on_test_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._update(self.test_progress_bar_id, batch_idx + 1)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self.reset_dataloader_idx_tracker()

    def on_predict_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.progress is None or not self.has_dataloader_changed(dataloader_idx):
            return
        self.predict_progress_bar_id = self._replace_task(
            self.predict_progress_bar_id,
            self.total_predict_batches_current_dataloader,
            self.predict_description,
        )

    def on_predict_batch_end(
        self,
        trainer: Any,
        pl_module: Any,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._update(self.predict_progress_bar_id, batch_idx + 1)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self.reset_dataloader_idx_tracker()


class DefaultProgressBar(RichProgressBar):
    """The bar the Trainer adds when none is given (`trainer.progress_bar_callback`): its
    switches (`refresh_rate=0`, `disable()`) turn lightspeed's own bar off, which draws instead of
    this callback (report/progress.py)."""

    draws_itself = False
