"""Lightning's `core.mixins`: `HyperparametersMixin` (save_hyperparameters, hparams)."""

from lightspeed.core.mixins.hparams_mixin import HyperparametersMixin

__all__ = ["HyperparametersMixin"]
