"""The user-facing Module: Lightning's hook names and `self.log`, on a plain `torch.nn.Module`.

Porting from Lightning is one import: `from lightspeed import LightningModule`.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any, cast

import torch

import lightspeed.core.saving as _hparams
from lightspeed.core.metrics import is_metric
from lightspeed.core.mixins import HyperparametersMixin
from lightspeed.core.optimizer import LightningOptimizer
from lightspeed.data.loaders import move_to_device
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import gather_all
from lightspeed.specs import TrainerView
from lightspeed.utilities.rank_zero import rank_zero_warn


class Module(HyperparametersMixin, torch.nn.Module):
    """Subclass this and implement `training_step` and `configure_optimizers` (as in Lightning)."""

    # Lightning's checkpoint keys for the hyper-parameters (core.saving writes and reads them)
    CHECKPOINT_HYPER_PARAMS_KEY = _hparams.HPARAMS_KEY
    CHECKPOINT_HYPER_PARAMS_NAME = _hparams.HPARAMS_NAME
    CHECKPOINT_HYPER_PARAMS_TYPE = "hparams_type"

    # Set to False to call `self.optimizers()`, `self.manual_backward(loss)` and `opt.step()`
    # yourself.
    automatic_optimization: bool = True

    def __init__(self) -> None:
        super().__init__()
        # A weak reference, set with object.__setattr__: the trainer is not part of the model's
        # state, and a copy
        # of the module (ZeRO-3's and FSDP's plain twin) shares it instead of copying it.
        object.__setattr__(self, "_trainer_ref", None)

    # ----------------------------------------------------------------- steps (override)
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | dict | None:
        raise NotImplementedError("training_step must be implemented to call Trainer.fit")

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError("validation_step must be implemented to call Trainer.validate")

    def test_step(self, batch: Any, batch_idx: int) -> Any:
        raise NotImplementedError("test_step must be implemented to call Trainer.test")

    def predict_step(self, batch: Any, batch_idx: int = 0, dataloader_idx: int = 0) -> Any:
        """By default `self(batch)`, whichever loader the batch comes from."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        raise NotImplementedError("configure_optimizers must be implemented to call Trainer.fit")

    def configure_model(self) -> None:
        """Build layers here (not in __init__) to let ZeRO-3/FSDP create them sharded from the
        start."""

    def configure_tensor_parallel(self, mesh: Any) -> None:
        """Under tensor parallelism (`FSDP(tp=...)`), called once after `configure_model` with the
        1-D tensor-parallel DeviceMesh: call torch's `parallelize_module(self.model, mesh, plan)`
        here to choose the plan yourself. If no parameter became a DTensor, lightspeed applies the
        model's own plan (a Hugging Face `tp_plan`) or its default one
        (strategies/tensor_parallel.py)."""

    def configure_deepspeed(self, config: dict) -> dict:
        """Receives the DeepSpeed config lightspeed built from the Trainer's flags; returns the one
        to use."""
        return config

    # ----------------------------------------------------------------- data (override, or pass
    # loaders to fit)
    def train_dataloader(self) -> Any:
        return None

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None

    prepare_data_per_node = (
        True  # False: prepare_data runs once in all (global rank 0), not once per node
    )

    # ----------------------------------------------------------------- hooks (override as needed)
    # Each has one call site (trainer.py or hooks.py); the Module's runs before the callbacks'.
    def prepare_data(self) -> None:
        """Download or write data here: runs once per node (local rank 0), before `setup` on every
        rank."""

    def setup(self, stage: str) -> None:
        """Per rank, before `configure_model`, at the start of fit / validate / test / predict."""

    def teardown(self, stage: str) -> None: ...
    def on_fit_start(self) -> None: ...
    def on_fit_end(self) -> None: ...
    def on_train_start(self) -> None: ...
    def on_train_end(self) -> None: ...
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        """Return -1 to skip the rest of this training epoch (from the first batch of an
        accumulation window)."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None: ...
    def on_before_backward(self, loss: torch.Tensor) -> None: ...
    def on_after_backward(self) -> None: ...
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        """Before each optimizer step (for DeepSpeed: before `engine.step()`, which steps inside),
        after backward."""

    def on_before_zero_grad(self, optimizer: Any) -> None:
        """Before gradients are zeroed, i.e. just before `strategy.step()` (which steps, then
        zeroes)."""

    def on_validation_batch_start(
        self, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_test_batch_start(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None: ...
    def on_test_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_start(
        self, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_predict_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None: ...
    def on_train_epoch_start(self) -> None: ...
    def on_train_epoch_end(self) -> None: ...
    def on_validation_epoch_start(self) -> None: ...
    def on_validation_epoch_end(self) -> None: ...
    def on_test_epoch_start(self) -> None: ...
    def on_test_epoch_end(self) -> None: ...
    def on_predict_epoch_start(self) -> None: ...
    def on_predict_epoch_end(self) -> None: ...
    def on_validation_start(self) -> None: ...
    def on_validation_end(self) -> None: ...
    def on_test_start(self) -> None: ...
    def on_test_end(self) -> None: ...
    def on_predict_start(self) -> None: ...
    def on_predict_end(self) -> None: ...

    # Evaluation switches modes through these, as in Lightning: override to keep dropout on (MC
    # dropout), say.
    def on_validation_model_eval(self) -> None:
        self.eval()

    def on_validation_model_train(self) -> None:
        self.train()

    def on_test_model_eval(self) -> None:
        self.eval()

    def on_test_model_train(self) -> None:
        self.train()

    def on_predict_model_eval(self) -> None:
        self.eval()

    def configure_callbacks(self) -> Any:
        """Callbacks this Module brings (one or a list): added at each fit / validate / test /
        predict, each replacing the Trainer's callbacks of its type, as in Lightning."""
        return []

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        """Steps one LR scheduler when its interval comes (metric: the monitored value, or None).
        Override it for schedulers that step otherwise, such as timm's
        `scheduler.step(epoch=self.current_epoch)`."""
        scheduler.step() if metric is None else scheduler.step(metric)

    def on_save_checkpoint(self, checkpoint: dict) -> None: ...
    def on_load_checkpoint(self, checkpoint: dict) -> None: ...
    def on_exception(self, exception: BaseException) -> None: ...

    # Batch transfer, as in Lightning: each batch (train, validate, test, predict) passes through
    # all three; a
    # DataModule that overrides one of them is used for it instead (hooks.batch_to_device).
    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Alter the batch on the host, before it moves. Returns the batch."""
        return batch

    def transfer_batch_to_device(
        self, batch: Any, device: torch.device, dataloader_idx: int
    ) -> Any:
        """Moves every tensor of the batch to `device`: on CUDA from page-locked memory over a side
        stream (the Trainer's `pin_memory`). Override for a batch type of your own; `super()` for
        the rest."""
        trainer = self._trainer
        if (
            trainer is not None
            and getattr(trainer, "device", None) == device
            and hasattr(trainer, "move")
        ):
            return cast(Any, trainer).move(batch)  # the Trainer's, beyond its TrainerView
        return move_to_device(batch, device)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Alter the batch on the device (augmentations on the GPU, say). Returns the batch."""
        return batch

    # ----------------------------------------------------------------- conveniences
    @property
    def _trainer(self) -> TrainerView | None:
        ref = self.__dict__.get("_trainer_ref")
        return ref() if ref is not None else None

    @property
    def trainer(self) -> TrainerView:
        if self._trainer is None:
            if self.__dict__.get("_tracing"):  # torch.jit reads every attribute (see _traced)
                return cast(TrainerView, None)
            raise RuntimeError(f"{type(self).__name__} is not attached to a Trainer")
        return self._trainer

    @contextlib.contextmanager
    def _traced(self) -> Iterator[None]:
        """While torch.jit traces the module outside a run (TensorBoard's `add_graph`), `trainer`
        reads None instead of raising: the tracer reads every attribute of the module."""
        object.__setattr__(self, "_tracing", True)
        try:
            yield
        finally:
            object.__setattr__(self, "_tracing", False)

    @trainer.setter
    def trainer(self, trainer: TrainerView | None) -> None:
        object.__setattr__(
            self, "_trainer_ref", weakref.ref(trainer) if trainer is not None else None
        )

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
        return (
            self._trainer.current_epoch if self._trainer is not None else 0
        )  # Lightning's 0 without one

    @property
    def global_step(self) -> int:
        return self._trainer.global_step if self._trainer is not None else 0

    # Lightning's names for what the Trainer holds, None / empty / 0 without a Trainer, as there
    local_rank = property(lambda self: self._trainer.local_rank if self._trainer is not None else 0)
    logger = property(lambda self: self._trainer.logger if self._trainer is not None else None)
    loggers = property(
        lambda self: list(self._trainer.loggers) if self._trainer is not None else []
    )
    on_gpu = property(lambda self: self.device.type == "cuda")

    @property
    def example_input_array(self) -> Any:
        """An input batch for the model's forward, as Lightning keeps it (None until set)."""
        return self.__dict__.get("_example_input_array")

    @example_input_array.setter
    def example_input_array(self, value: Any) -> None:
        self.__dict__["_example_input_array"] = value

    def freeze(self) -> None:
        """No gradients for any parameter, and eval mode (Lightning's `freeze`)."""
        for p in self.parameters():
            p.requires_grad = False
        self.eval()

    def unfreeze(self) -> None:
        """Gradients for every parameter again, and train mode."""
        for p in self.parameters():
            p.requires_grad = True
        self.train()

    def all_gather(self, data: Any, group: Any = None, sync_grads: bool = False) -> Any:
        """Every rank's `data` (a tensor, a number, or a collection of them), each tensor stacked
        along a new first dimension of size world_size, as Lightning's. `sync_grads`: the gather
        takes part in autograd (each rank's gradient flows back to it). On one process the data is
        returned as it is, as in Lightning. NumPy arrays are made tensors first, as Lightning's."""
        import numpy as np
        from torch.utils._pytree import tree_map

        def tensor(x: Any) -> Any:
            return torch.as_tensor(x, device=self.device) if isinstance(x, np.ndarray) else x

        return gather_all(tree_map(tensor, data), group, sync_grads, self.device)

    # Conveniences that touch the Trainer's Python state: under compile=True (kernels.CompiledStep)
    # they run eagerly,
    # a graph break, rather than have torch.compile guard on that state and recompile as it changes.
    _compile_opaque = ("print", "log", "log_dict")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """print() on rank 0 only; through the progress bar when one is drawing (above tqdm's
        line, as Lightning)."""
        if self.global_rank != 0:
            return
        bar = getattr(self._trainer, "progress_bar_callback", None)
        if bar is not None and getattr(bar, "is_enabled", False):
            bar.print(*args, **kwargs)
        else:
            print(*args, **kwargs)

    def log(
        self,
        name: str,
        value: Any,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: Any = "mean",
        sync_dist: bool = False,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
        add_dataloader_idx: bool = True,
        **ignored: Any,
    ) -> None:
        """Records a metric. Defaults follow Lightning: per step in training, per epoch in
        evaluation; an epoch value is the mean weighted by `batch_size` (default: the size of the
        current batch). A torchmetrics `Metric` logged itself must be held by this module (an
        attribute, or inside one), as in Lightning: one made anew in each step would log a fresh
        state every time (`metric_attribute=` names the attribute, and skips the search).
        Lightning's `sync_dist_group` and `enable_graph` are accepted and have no effect."""
        if getattr(self._trainer, "barebones", False):
            rank_zero_warn(
                "self.log() under Trainer(barebones=True) records nothing: barebones switches "
                "logging off (it would cost speed)."
            )
            return
        if is_metric(value) and ignored.get("metric_attribute") is None:
            self._check_metric_is_held(name, value)
        self.trainer.metrics.log(
            name,
            value,
            prog_bar,
            on_step,
            on_epoch,
            sync_dist,
            reduce_fx,
            logger,
            batch_size,
            rank_zero_only,
            add_dataloader_idx,
        )

    def _check_metric_is_held(self, name: str, metric: Any) -> None:
        if any(m is metric for m in self.modules()):
            return
        held = [n for n, m in self.named_modules() if is_metric(m)]
        fix = (
            f"calling `self.log({name}, ..., metric_attribute=name)` where `name` is one of {held}"
            if held
            else "setting an attribute for the metric in your `LightningModule` (e.g. "
            "`self.acc = Accuracy(...)` in `__init__`) and logging that attribute"
        )
        raise ConfigError(
            f"self.log({name!r}, <{type(metric).__name__}>): the torchmetrics Metric logged is not "
            f"an attribute of {type(self).__name__}, so its state would start anew at each call. "
            f"You can fix this by {fix}."
        )

    def log_dict(self, metrics: dict[str, Any], **kwargs: Any) -> None:
        """`self.log` for each item, with the same keywords."""
        for name, value in metrics.items():
            self.log(name, value, **kwargs)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point parameter (float32 when there is none)."""
        p = next((p for p in self.parameters() if p.is_floating_point()), None)
        return p.dtype if p is not None else torch.float32

    # ----------------------------------------------------------------- hyper-parameters
    # (save_hyperparameters, hparams: core.mixins.HyperparametersMixin)
    @classmethod
    def load_from_checkpoint(
        cls, checkpoint_path: Any, map_location: Any = None, strict: bool = True, **overrides: Any
    ) -> Module:
        """Rebuilds the module from a lightspeed checkpoint of any strategy (see
        hparams.load_from_checkpoint)."""
        return _hparams.load_from_checkpoint(
            cls, checkpoint_path, map_location, strict, **overrides
        )

    # ----------------------------------------------------------------- manual optimization
    def optimizers(self, use_pl_optimizer: bool = True) -> Any:
        """The optimizer(s) after strategy setup: one object if there is one, else a list. As in
        Lightning each comes wrapped in a `LightningOptimizer` (the same wrapper at every call),
        unless `use_pl_optimizer=False`."""
        opts = list(self.trainer.strategy.optimizers)
        if use_pl_optimizer:
            known = {id(w.optimizer): w for w in self.__dict__.get("_lightning_optimizers", [])}
            opts = [known.get(id(o)) or LightningOptimizer(o) for o in opts]
            self.__dict__["_lightning_optimizers"] = opts
        return opts[0] if len(opts) == 1 else opts

    def lr_schedulers(self) -> Any:
        scheds = [s.scheduler for s in self.trainer.strategy.schedulers]
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else scheds

    def toggle_optimizer(self, optimizer: Any) -> None:
        """Freezes every parameter that `optimizer` does not train (for one of several optimizers);
        `untoggle_optimizer` restores what was trainable.

        Parameters are matched by identity. Raises RuntimeError when none of the optimizer's
        parameters is one of the module's now (which would freeze them all), e.g. under FSDP inside
        a forward, where the module holds gathered copies; FSDP's manual optimization keeps the
        shards in place between the children's calls."""
        # A DeepSpeed handle's param_groups hold ZeRO's flat partitions; it lists the module's own
        # parameters.
        params = (
            optimizer.model_parameters()
            if hasattr(optimizer, "model_parameters")
            else [p for group in optimizer.param_groups for p in group["params"]]
        )
        mine = {id(p) for p in params}
        if not any(id(p) in mine for p in self.parameters()):
            raise RuntimeError(
                f"toggle_optimizer: none of the optimizer's {len(mine)} parameters is a parameter "
                f"of {type(self).__name__} at this point, so it would freeze every parameter. Call "
                "it in training_step, outside any forward."
            )
        saved = self.__dict__.setdefault("_toggled", {})
        for p in self.parameters():
            saved.setdefault(id(p), (p, p.requires_grad))
            if id(p) not in mine:
                p.requires_grad_(False)

    def untoggle_optimizer(self, optimizer: Any) -> None:
        for p, requires_grad in self.__dict__.pop("_toggled", {}).values():
            p.requires_grad_(requires_grad)

    def clip_gradients(
        self,
        optimizer: Any,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Under manual optimization, between `manual_backward` and `optimizer.step()`: clips the
        gradients of `optimizer`'s parameters to `gradient_clip_val` by their global norm ("norm",
        the default) or by value. None or 0 clips nothing. Under DeepSpeed the optimizer's engine
        clips in its step (by norm only)."""
        algorithm = gradient_clip_algorithm or "norm"
        if algorithm not in ("norm", "value"):
            raise ConfigError(
                f"clip_gradients(gradient_clip_algorithm={algorithm!r}) is not valid: use 'norm' "
                "or 'value'."
            )
        if not gradient_clip_val:
            return
        if hasattr(
            optimizer, "clip_gradients"
        ):  # a DeepSpeed engine's handle (strategies/deepspeed_manual.py)
            optimizer.clip_gradients(gradient_clip_val, algorithm)
            return
        params = [
            p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        if algorithm == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    def manual_backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Use instead of `loss.backward()` so the strategy applies precision and gradient sync.
        Further arguments are `Tensor.backward`'s (`gradient`, `retain_graph`, `create_graph`,
        `inputs`), by position or keyword, as in Lightning."""
        names = ("gradient", "retain_graph", "create_graph", "inputs")
        if len(args) > len(names):
            raise TypeError(f"manual_backward takes at most {len(names)} arguments after the loss")
        self.trainer.strategy.backward(loss, **dict(zip(names, args)), **kwargs)


LightningModule = Module
