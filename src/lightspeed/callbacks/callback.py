"""The base class of every callback: a hook for each moment of the loop, and state that travels in
checkpoints.

A callback sees the Trainer through `specs.TrainerView` (step, epoch, rank, metrics, log_metrics,
save_checkpoint), not its internals. Decisions that every rank must share (save or not, the
checkpoint's name, stop or not) are taken on rank 0 and broadcast: metric values may differ between
ranks.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from lightspeed.specs import TrainerView as Trainer

Module = torch.nn.Module

# each callback's running Module (Callback.attach), for its `self.log`
_RUNNING: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()


class Callback:
    """Override any hook. Callbacks with state override `state_dict`/`load_state_dict` (saved in
    checkpoints)."""

    @property
    def state_key(self) -> str:
        return type(self).__name__

    def setup(self, trainer: Trainer, module: Module, stage: str) -> None: ...
    def on_fit_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_fit_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int
    ) -> None: ...
    def on_before_backward(self, trainer: Trainer, module: Module, loss: torch.Tensor) -> None: ...
    def on_after_backward(self, trainer: Trainer, module: Module) -> None: ...
    def on_before_optimizer_step(
        self, trainer: Trainer, module: Module, optimizer: Any
    ) -> None: ...
    def on_before_zero_grad(self, trainer: Trainer, module: Module, optimizer: Any) -> None: ...
    def on_validation_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_predict_batch_start(
        self, trainer: Trainer, module: Module, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_train_batch_end(
        self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int
    ) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_batch_end(
        self,
        trainer: Trainer,
        module: Module,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None: ...
    def on_validation_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_test_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_test_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_predict_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_predict_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_sanity_check_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_sanity_check_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_test_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_test_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_predict_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_predict_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_save_checkpoint(self, trainer: Trainer, module: Module, checkpoint: dict) -> None: ...
    def on_load_checkpoint(self, trainer: Trainer, module: Module, checkpoint: dict) -> None: ...
    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None: ...
    def teardown(self, trainer: Trainer, module: Module, stage: str) -> None: ...

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...

    # -- Lightning lets a callback log from its hooks (`self.log`), through the running Module
    def attach(self, module: Module) -> None:
        """Called by the loop at each entry point's setup: the Module `self.log` logs through (held
        by weak reference, outside the callback: it stays picklable)."""
        _RUNNING[self] = weakref.ref(module)

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        """The running Module's `self.log(name, value, **kwargs)`, from a hook of this callback
        (Lightning's keywords; the defaults follow the hook, as in the Module). Raises RuntimeError
        outside a run."""
        ref = _RUNNING.get(self)
        module = ref() if ref is not None else None
        if module is None:
            raise RuntimeError(
                f"{type(self).__name__}.log({name!r}, ...) was called outside a run: a callback "
                "logs from its hooks, while the Trainer runs."
            )
        module.log(name, value, **kwargs)

    def log_dict(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        """`self.log` for each item, with the same keywords."""
        for name, value in metrics.items():
            self.log(name, value, **kwargs)
