"""RichProgressBar: lightspeed's own bar (rich: epoch, step, loss, prog_bar metrics, it/s, ETA;
plain periodic lines without a terminal), its refresh rate and whether it shows."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from lightspeed.callbacks.progress.progress_bar import ProgressBar
from lightspeed.errors import ConfigError

_RICH_AVAILABLE = importlib.util.find_spec("rich") is not None


@dataclass
class RichProgressBarTheme:
    """Lightning's styles for the rich bar's parts; accepted for the port (lightspeed's bar keeps
    its own look)."""

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


class RichProgressBar(ProgressBar):
    """Lightspeed draws its one rich bar whichever bar is asked for, unless a bar that draws itself
    (TQDMProgressBar) is given; `refresh_rate=0` turns it off. The bar redraws by time, not every
    `refresh_rate` batches; the other arguments are accepted for the port."""

    def __init__(
        self,
        refresh_rate: int = 1,
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
