"""The progress bar: `RichProgressBar`, and `TQDMProgressBar` under Lightning's name for it."""

from lightspeed.callbacks.progress.rich_progress import RichProgressBar
from lightspeed.callbacks.progress.tqdm_progress import TQDMProgressBar

__all__ = ["RichProgressBar", "TQDMProgressBar"]
