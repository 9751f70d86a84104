"""The user-facing Module: Lightning's hook names and `self.log`, on a plain `torch.nn.Module`.

Porting from Lightning is one import: `from lightspeed import LightningModule`.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .specs import TrainerView


class Module(torch.nn.Module):
    """Subclass this and implement `training_step` and `configure_optimizers` (as in Lightning)."""

    # Set to False to call `self.optimizers()`, `self.manual_backward(loss)` and `opt.step()` yourself.
    automatic_optimization: bool = True

    def __init__(self) -> None:
        super().__init__()
        # A weak reference, set with object.__setattr__: the trainer is not part of the model's state, and a copy
        # of the module (ZeRO-3's and FSDP's plain twin) shares it instead of copying it.
        object.__setattr__(self, "_trainer_ref", None)

    # ----------------------------------------------------------------- steps (override)
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict | None:
        raise NotImplementedError("training_step must be implemented to call Trainer.fit")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError("validation_step must be implemented to call Trainer.validate")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError("test_step must be implemented to call Trainer.test")

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError("configure_optimizers must be implemented to call Trainer.fit")

    def configure_model(self) -> None:
        """Build layers here (not in __init__) to let ZeRO-3/FSDP create them sharded from the start."""

    def configure_deepspeed(self, config: dict) -> dict:
        """Receives the DeepSpeed config lightspeed built from the Trainer's flags; returns the one to use."""
        return config

    # ----------------------------------------------------------------- data (override, or pass loaders to fit)
    def train_dataloader(self) -> Any: return None
    def val_dataloader(self) -> Any: return None
    def test_dataloader(self) -> Any: return None
    def predict_dataloader(self) -> Any: return None

    # ----------------------------------------------------------------- hooks (override as needed)
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_save_checkpoint(self, checkpoint: dict) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict) -> None: ...
    def on_exception(self, exception: BaseException) -> None: ...

    # ----------------------------------------------------------------- conveniences
    @property
    def _trainer(self) -> TrainerView | None:
        ref = self.__dict__.get("_trainer_ref")
        return ref() if ref is not None else None

    @property
    def trainer(self) -> TrainerView:
        if self._trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return self._trainer

    @trainer.setter
    def trainer(self, trainer: TrainerView | None) -> None:
        object.__setattr__(self, "_trainer_ref", weakref.ref(trainer) if trainer is not None else None)

    @property
    def device(self) -> torch.device:
        if self._trainer is not None:
            return self._trainer.device
        p = next(self.parameters(), None)
        return p.device if p is not None else torch.device("cpu")

    @property
    def global_rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def current_epoch(self) -> int:
        return self.trainer.current_epoch

    @property
    def global_step(self) -> int:
        return self.trainer.global_step

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only."""
        if self.global_rank == 0:
            print(*args, **kwargs)

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        sync_dist: bool = False,
        reduce_fx: str = "mean",
        logger: bool = True,
    ) -> None:
        """Records a metric. Defaults follow Lightning: per step in training, per epoch in evaluation."""
        self.trainer.metrics.log(name, value, prog_bar, on_step, on_epoch, sync_dist, reduce_fx, logger)

    def log_dict(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    # ----------------------------------------------------------------- manual optimization
    def optimizers(self) -> Any:
        """The optimizer(s) after strategy setup: one object if there is one, else a list."""
        opts = self.trainer.strategy.optimizers
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        scheds = [s.scheduler for s in self.trainer.strategy.schedulers]
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(self, loss: torch.Tensor) -> None:
        """Use instead of `loss.backward()` so the strategy applies precision and gradient sync."""
        self.trainer.strategy.backward(loss)


LightningModule = Module
