"""The progress bars: the `ProgressBar` base, `TQDMProgressBar` (tqdm, draws itself) and
`RichProgressBar` (lightspeed's own rich bar)."""

from lightspeed.callbacks.progress.progress_bar import ProgressBar
from lightspeed.callbacks.progress.rich_progress import RichProgressBar
from lightspeed.callbacks.progress.tqdm_progress import TQDMProgressBar

__all__ = ["ProgressBar", "RichProgressBar", "TQDMProgressBar"]
