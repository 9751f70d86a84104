"""Lightning's tuner: `Tuner(trainer).lr_find(model)` and `.scale_batch_size(model)`. The callbacks
that run them before a fit are `lightspeed.callbacks.LearningRateFinder` and `BatchSizeFinder`."""

from lightspeed.tuner.tuning import Tuner

__all__ = ["Tuner"]
