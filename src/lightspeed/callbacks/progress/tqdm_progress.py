"""TQDMProgressBar: Lightning's name for the progress bar; lightspeed draws it with rich."""

from __future__ import annotations

from lightspeed.callbacks.progress.rich_progress import RichProgressBar


class TQDMProgressBar(RichProgressBar):
    """Lightning's default bar, ported as RichProgressBar (lightspeed draws with rich)."""

    def __init__(self, refresh_rate: int = 1, process_position: int = 0, leave: bool = False):
        super().__init__(refresh_rate, leave)
