"""`CombinedLoader` at Lightning's path (`utilities.combined_loader`): several loaders iterated
together, as one training loader (`max_size_cycle`, `min_size`, `max_size`). It lives in
lightspeed.data.loaders, with the other loader machinery."""

from lightspeed.data.loaders import CombinedLoader

__all__ = ["CombinedLoader"]
