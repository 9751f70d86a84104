"""Lightning's model summary as a utility: `summarize(model, max_depth)` / `ModelSummary`."""

from lightspeed.utilities.model_summary.model_summary import (
    LayerSummary,
    ModelSummary,
    get_formatted_model_size,
    get_human_readable_count,
    parse_batch_shape,
    summarize,
)

__all__ = [
    "LayerSummary",
    "ModelSummary",
    "get_formatted_model_size",
    "get_human_readable_count",
    "parse_batch_shape",
    "summarize",
]
