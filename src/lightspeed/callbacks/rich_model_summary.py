"""RichModelSummary: ModelSummary's table drawn with rich."""

from __future__ import annotations

from lightspeed.callbacks.model_summary import ModelSummary


class RichModelSummary(ModelSummary):
    """Lightning's rich-table summary: lightspeed's summary is a rich table already."""
