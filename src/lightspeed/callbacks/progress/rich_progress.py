"""RichProgressBar: the progress bar (rich), its refresh rate and whether it shows."""

from __future__ import annotations

from typing import Any

from lightspeed.callbacks.callback import Callback
from lightspeed.errors import ConfigError


class RichProgressBar(Callback):
    """Lightning's progress-bar callbacks: lightspeed draws its one rich bar (epoch, step, loss,
    prog_bar metrics, it/s, ETA) whichever is given; `refresh_rate=0` turns it off. The bar redraws
    by time, not every `refresh_rate` batches; the other arguments are accepted for the port."""

    is_progress_bar = True

    def __init__(
        self,
        refresh_rate: int = 1,
        leave: bool = False,
        theme: Any = None,
        console_kwargs: Any = None,
    ):
        if isinstance(refresh_rate, bool) or not isinstance(refresh_rate, int) or refresh_rate < 0:
            raise ConfigError(
                f"refresh_rate={refresh_rate!r} is not valid: expected an integer ≥ 0 (0: no bar)."
            )
        self.refresh_rate, self.leave = refresh_rate, leave
