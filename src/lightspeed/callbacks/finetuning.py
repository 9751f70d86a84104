"""Fine-tuning callbacks: freeze part of the model before training, unfreeze it epoch by epoch.

    class Unfreeze(BaseFinetuning):
        def freeze_before_training(self, module):
            self.freeze(module.backbone)                  # before configure_optimizers

        def finetune_function(self, module, epoch, optimizer):
            if epoch == 3:                                # each epoch's start
                self.unfreeze_and_add_param_group(module.backbone, optimizer)

    trainer = Trainer(callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=3)])

A parameter group added this way is remembered by parameter names (`state_dict`), so a resumed fit
can add the same groups again before the optimizer state is loaded. DeepSpeed owns its optimizer's
parameter groups: there the callback refuses to run, as in Lightning.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterable
from typing import Any

import torch
from torch.nn import Module, ModuleDict
from torch.nn.modules.batchnorm import _BatchNorm

from lightspeed.callbacks.callback import Callback
from lightspeed.errors import ConfigError
from lightspeed.utilities.rank_zero import rank_zero_warn

log = logging.getLogger(__name__)
Modules = Module | Iterable[Module | Iterable]


def multiplicative(epoch: int) -> float:
    """BackboneFinetuning's default `lambda_func`: the backbone's LR doubles every epoch."""
    return 2.0


class BaseFinetuning(Callback):
    """Override `freeze_before_training(module)` (runs in `setup`, before `configure_optimizers`)
    and `finetune_function(module, epoch, optimizer)` (runs at each training epoch's start, for
    each optimizer). The static helpers freeze, unfreeze and add parameter groups."""

    def __init__(self) -> None:
        # {optimizer index: its param groups, each with its parameters' names}: what a resume
        # re-creates
        self._internal_optimizer_metadata: dict[int, list[dict[str, Any]]] = {}
        self._restarting = False

    def state_dict(self) -> dict[str, Any]:
        return {"internal_optimizer_metadata": self._internal_optimizer_metadata}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restarting = True
        self._internal_optimizer_metadata = state_dict.get(
            "internal_optimizer_metadata", self._internal_optimizer_metadata
        )

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """On a resumed fit, the optimizers get back the parameter groups this callback added."""
        if not self._restarting:
            return
        named = dict(pl_module.named_parameters())
        for index, optimizer in enumerate(trainer.optimizers):
            groups = self._internal_optimizer_metadata.get(index, [])
            for group in groups[len(optimizer.param_groups) :]:
                optimizer.add_param_group({**group, "params": [named[n] for n in group["params"]]})
        self._restarting = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if str(getattr(trainer.strategy, "name", "")).startswith("deepspeed"):
            raise NotImplementedError(
                "The Finetuning callback does not support running with the DeepSpeed strategy: "
                "DeepSpeed owns the optimizer's parameter groups. Choose a different strategy or "
                "disable the callback."
            )
        self.freeze_before_training(pl_module)

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        for index, optimizer in enumerate(trainer.optimizers):
            before = len(optimizer.param_groups)
            self.finetune_function(pl_module, trainer.current_epoch, optimizer)
            self._remember(pl_module, index, before, optimizer.param_groups)

    def _remember(self, pl_module: Module, index: int, before: int, groups: list[dict]) -> None:
        names = {id(p): n for n, p in pl_module.named_parameters()}

        def named(group: dict) -> dict:
            return {**group, "params": [names[id(p)] for p in group["params"]]}

        if index not in self._internal_optimizer_metadata:
            self._internal_optimizer_metadata[index] = [named(g) for g in groups]
        elif len(groups) != before:
            self._internal_optimizer_metadata[index] += [named(g) for g in groups[before:]]

    def freeze_before_training(self, pl_module: Any) -> None:
        raise NotImplementedError("Override freeze_before_training(pl_module) to freeze modules.")

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        raise NotImplementedError("Override finetune_function(pl_module, epoch, optimizer).")

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def flatten_modules(modules: Modules) -> list[Module]:
        """The leaf modules of `modules` (a module, a ModuleDict or nested iterables of them), and
        the inner modules that hold parameters of their own."""
        if isinstance(modules, ModuleDict):
            modules = modules.values()
        if isinstance(modules, Iterable):
            found: list[Module] = []
            for item in modules:
                found += BaseFinetuning.flatten_modules(item)
            return found
        return [m for m in modules.modules() if not list(m.children()) or m._parameters]

    @staticmethod
    def filter_params(
        modules: Modules, train_bn: bool = True, requires_grad: bool = True
    ) -> Generator[torch.nn.Parameter, None, None]:
        """The parameters of `modules` whose `requires_grad` is `requires_grad`; without
        `train_bn`, batch-norm layers' are left out."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and not train_bn:
                continue
            for param in module.parameters(recurse=False):
                if param.requires_grad == requires_grad:
                    yield param

    @staticmethod
    def make_trainable(modules: Modules) -> None:
        """Every parameter of `modules` trainable; batch-norm layers track running stats again."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm):
                module.track_running_stats = True
            for param in module.parameters(recurse=False):
                param.requires_grad = True

    @staticmethod
    def freeze_module(module: Module) -> None:
        """`module`'s own parameters frozen; a batch-norm layer stops tracking running stats."""
        if isinstance(module, _BatchNorm):
            module.track_running_stats = False
        for param in module.parameters(recurse=False):
            param.requires_grad = False

    @staticmethod
    def freeze(modules: Modules, train_bn: bool = True) -> None:
        """Freezes `modules`; with `train_bn` their batch-norm layers stay trainable."""
        for module in BaseFinetuning.flatten_modules(modules):
            if isinstance(module, _BatchNorm) and train_bn:
                BaseFinetuning.make_trainable(module)
            else:
                BaseFinetuning.freeze_module(module)

    @staticmethod
    def filter_on_optimizer(optimizer: Any, params: Iterable) -> list:
        """`params` less those already in one of `optimizer`'s groups (with a warning: they were
        most likely given to the optimizer while frozen)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = list(params)
        kept = [p for p in params if id(p) not in held]
        if len(kept) != len(params):
            rank_zero_warn(
                "The provided params to be frozen already exist within another group of this "
                "optimizer. Those parameters will be skipped.\nHINT: Did you init your optimizer "
                f"in `configure_optimizer` as such:\n {type(optimizer)}(filter(lambda p: "
                "p.requires_grad, self.parameters()), ...) "
            )
        return kept

    @staticmethod
    def unfreeze_and_add_param_group(
        modules: Modules,
        optimizer: Any,
        lr: float | None = None,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
    ) -> None:
        """Unfreezes `modules` and adds their parameters to `optimizer` as a new group, at `lr`
        (default: the first group's LR divided by `initial_denom_lr`)."""
        BaseFinetuning.make_trainable(modules)
        group_lr = optimizer.param_groups[0]["lr"] / initial_denom_lr if lr is None else float(lr)
        params = BaseFinetuning.filter_params(modules, train_bn=train_bn, requires_grad=True)
        params = BaseFinetuning.filter_on_optimizer(optimizer, params)
        if params:
            optimizer.add_param_group({"params": params, "lr": group_lr})


class BackboneFinetuning(BaseFinetuning):
    """Freezes `module.backbone` until `unfreeze_backbone_at_epoch`, then trains it in a new
    parameter group starting at `backbone_initial_lr` (default: the current LR times
    `backbone_initial_ratio_lr`), multiplied each later epoch by `lambda_func(epoch + 1)` and, with
    `should_align`, never above the other groups' LR."""

    def __init__(
        self,
        unfreeze_backbone_at_epoch: int = 10,
        lambda_func: Callable[[int], float] = multiplicative,
        backbone_initial_ratio_lr: float = 10e-2,
        backbone_initial_lr: float | None = None,
        should_align: bool = True,
        initial_denom_lr: float = 10.0,
        train_bn: bool = True,
        verbose: bool = False,
        rounding: int = 12,
    ) -> None:
        super().__init__()
        self.unfreeze_backbone_at_epoch = unfreeze_backbone_at_epoch
        self.lambda_func = lambda_func
        self.backbone_initial_ratio_lr = backbone_initial_ratio_lr
        self.backbone_initial_lr = backbone_initial_lr
        self.should_align = should_align
        self.initial_denom_lr = initial_denom_lr
        self.train_bn = train_bn
        self.verbose = verbose
        self.rounding = rounding
        self.previous_backbone_lr: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_backbone_lr": self.previous_backbone_lr}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.previous_backbone_lr = state_dict["previous_backbone_lr"]
        super().load_state_dict(state_dict)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if not isinstance(getattr(pl_module, "backbone", None), Module):
            raise ConfigError(
                "BackboneFinetuning: the LightningModule should have a nn.Module `backbone` "
                "attribute."
            )
        super().on_fit_start(trainer, pl_module)

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        current_lr = optimizer.param_groups[0]["lr"]
        if epoch == self.unfreeze_backbone_at_epoch:
            backbone_lr = (
                self.backbone_initial_lr
                if self.backbone_initial_lr is not None
                else current_lr * self.backbone_initial_ratio_lr
            )
            self.unfreeze_and_add_param_group(
                pl_module.backbone,
                optimizer,
                backbone_lr,
                train_bn=self.train_bn,
                initial_denom_lr=self.initial_denom_lr,
            )
        elif epoch > self.unfreeze_backbone_at_epoch:
            backbone_lr = self.lambda_func(epoch + 1) * (self.previous_backbone_lr or 0.0)
            if self.should_align and backbone_lr > current_lr:
                backbone_lr = current_lr
            optimizer.param_groups[-1]["lr"] = backbone_lr
        else:
            return
        self.previous_backbone_lr = backbone_lr
        if self.verbose:
            log.info(
                f"Current lr: {round(current_lr, self.rounding)}, "
                f"Backbone lr: {round(backbone_lr, self.rounding)}"
            )
