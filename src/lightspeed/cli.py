"""Lightning's command line interface on lightspeed's Trainer: `LightningCLI`, on jsonargparse.

    # train.py
    from lightspeed.cli import LightningCLI
    LightningCLI(MyModel, MyDataModule)  # or LightningCLI() and --model=pkg.Class

    python train.py fit --config run.yaml --trainer.max_steps=100 --model.lr=0.01
    python train.py fit --config run.yaml --print_config > full.yaml  # reads back as is

Each subcommand (fit, validate, test, predict) takes `--trainer.*` (the Trainer's flags),
`--model.*`, `--data.*`, `--seed_everything`, `--optimizer`, `--lr_scheduler` and the entry
point's own arguments (`--ckpt_path`). `run=False` has no subcommands: the CLI only builds
`cli.model`, `cli.datamodule` and `cli.trainer`. With devices > 1 the Trainer re-runs the script
for the other ranks, which parse the same command line; a random seed reaches them through the
PL_GLOBAL_SEED variable they inherit.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import random
import re
import sys
import typing
import warnings
from collections.abc import Callable, Iterable
from functools import partial
from types import MethodType
from typing import Any, Optional, Union

import torch
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from lightspeed import (
    Callback,
    ConfigError,
    LightningDataModule,
    LightningModule,
    Trainer,
    __version__,
    seed_everything,
)

try:  # jsonargparse with its `signatures` extra (docstring-parser, typeshed-client)
    import docstring_parser  # noqa: F401
    from jsonargparse import (
        ActionConfigFile,
        ArgumentParser,
        Namespace,
        class_from_function,
        register_unresolvable_import_paths,
    )

    register_unresolvable_import_paths(torch)  # torch's C callables print by their public path
    _JSONARGPARSE_SIGNATURES_AVAILABLE = True
except ImportError:  # the module still imports; building a parser says what to install
    from argparse import ArgumentParser, Namespace  # stand-ins

    _JSONARGPARSE_SIGNATURES_AVAILABLE = False


class ReduceLROnPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """torch's ReduceLROnPlateau naming the metric it follows (`monitor`): from `--lr_scheduler`,
    there is no `configure_optimizers` of the user's to name it."""

    def __init__(self, optimizer: Optimizer, monitor: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(optimizer, *args, **kwargs)
        self.monitor = monitor


EVALUATION = ("validate", "test", "predict")
LRSchedulerTypeTuple = (LRScheduler, ReduceLROnPlateau)
LRSchedulerTypeUnion = Union[LRScheduler, ReduceLROnPlateau]
ArgsType = Optional[Union[list[str], dict[str, Any], Namespace]]  # what `args=` takes
OptimizerCallable = Callable[[Iterable], Optimizer]  # an init argument: `--model.optim=Adam`
LRSchedulerCallable = Callable[[Optimizer], LRSchedulerTypeUnion]


def instantiate_class(args: Any, init: dict[str, Any]) -> Any:
    """Imports `init["class_path"]` and calls it with `args` (one positional value, or a tuple
    of them) and `init["init_args"]` (a dict or Namespace; default none) as keywords."""
    module_name, _, name = init["class_path"].rpartition(".")
    kwargs: Any = init.get("init_args") or {}
    kwargs = kwargs.as_dict() if hasattr(kwargs, "as_dict") else dict(kwargs)
    cls = getattr(importlib.import_module(module_name), name)
    return cls(*(args if isinstance(args, tuple) else (args,)), **kwargs)


def _with_class_path(cls: type, init_args: Any) -> dict[str, Any]:
    """`{"class_path", "init_args"}` for one class's init arguments (a Namespace, dict or None)."""
    init_args = init_args.as_dict() if hasattr(init_args, "as_dict") else dict(init_args or {})
    return {"class_path": f"{cls.__module__}.{cls.__name__}", "init_args": init_args}


def _forwards_flags(cls: type) -> bool:
    """Whether `cls(**flags)` passes flags on to lightspeed's `Trainer(**flags)`: a Trainer class
    (not a builder function) whose `__init__` takes `**kwargs`."""
    kinds = [p.kind for p in inspect.signature(cls).parameters.values()]
    return not hasattr(cls, "wrapped_function") and inspect.Parameter.VAR_KEYWORD in kinds


def _add_trainer_arguments(parser: Any, cls: type, key: str | None) -> list[str]:
    """The Trainer's arguments: its signature's (strategy, callbacks, logger, a subclass's own)
    and, when they reach `Trainer(**flags)`, the flags it validates (lightspeed's TrainerConfig)."""
    kwargs = dict(fail_untyped=False, instantiate=False, sub_configs=True)
    added = parser.add_class_arguments(cls, key, **kwargs)
    if not _forwards_flags(cls):
        return added
    from lightspeed import config  # the dataclass of the Trainer's flags: types and defaults

    flags = getattr(config, "TrainerFlags", None) or getattr(config, "TrainerConfig")
    hints, prefix = typing.get_type_hints(flags), f"{key}." if key else ""
    group = parser.groups.get(key, parser) if key else parser
    for field in dataclasses.fields(flags):
        if prefix + field.name in added:
            continue
        default, hint = field.default, hints[field.name]
        if default is dataclasses.MISSING:
            default = field.default_factory()  # type: ignore[misc]
        if typing.get_origin(hint) is tuple:  # a list, as YAML reads it back
            hint, default = list[typing.get_args(hint)[0]], list(default)
        group.add_argument(f"--{prefix}{field.name}", type=hint, default=default)
        added.append(prefix + field.name)
    return added


class LightningArgumentParser(ArgumentParser):  # pyright: ignore[reportGeneralTypeIssues]
    """jsonargparse's ArgumentParser with helpers for Lightning's classes and optimizers.

    Environment variables are read with `default_env=True` only, named after `env_prefix`
    (PL_TRAINER__MAX_STEPS; PL_FIT__TRAINER__MAX_STEPS under a subcommand). `callback_keys` lists
    the groups that hold a Callback, which the CLI adds to the Trainer's callbacks."""

    def __init__(
        self,
        *args: Any,
        description: str = "lightspeed Trainer command line tool",
        env_prefix: str = "PL",
        default_env: bool = False,
        **kwargs: Any,
    ) -> None:
        if not _JSONARGPARSE_SIGNATURES_AVAILABLE:
            raise ModuleNotFoundError('LightningCLI needs: pip install "jsonargparse[signatures]"')
        kwargs.update(description=description, env_prefix=env_prefix, default_env=default_env)
        super().__init__(*args, **kwargs)
        self.callback_keys: list[str] = []
        self._optimizers: dict[str, tuple[Any, str]] = {}  # key -> (class or classes, link_to)
        self._lr_schedulers: dict[str, tuple[Any, str]] = {}

    def add_lightning_class_args(
        self, lightning_class: Any, nested_key: Any, subclass_mode: bool = False, required=True
    ) -> list[str]:
        """Adds the init arguments of a Trainer, LightningModule, LightningDataModule or Callback
        class (or of a function returning one) under `nested_key`; returns the keys added.
        `subclass_mode`: any subclass, chosen by class_path (`required`: one must be given).
        ConfigError for any other class."""
        cls, key = lightning_class, nested_key
        if callable(cls) and not isinstance(cls, type):
            cls = class_from_function(cls)
        bases = (Trainer, LightningModule, LightningDataModule, Callback)
        if not (isinstance(cls, type) and issubclass(cls, bases)):
            raise ConfigError(
                f"Cannot add arguments from {cls}: expected a subclass of Trainer, "
                "LightningModule, LightningDataModule or Callback, or a function returning one."
            )
        if issubclass(cls, Callback):
            self.callback_keys.append(key)
        if subclass_mode:
            return self.add_subclass_arguments(cls, key, fail_untyped=False, required=required)
        if issubclass(cls, Trainer):  # the CLI builds it, adding its callbacks
            return _add_trainer_arguments(self, cls, key)
        return self.add_class_arguments(cls, key, fail_untyped=False, sub_configs=True)

    def add_optimizer_args(
        self, optimizer_class: Any = (Optimizer,), nested_key="optimizer", link_to="AUTOMATIC"
    ) -> None:
        """Adds an optimizer's init arguments under `nested_key`, left uninstantiated; a tuple of
        classes takes any subclass of them, by class_path. `link_to`: "AUTOMATIC" (the CLI gives
        the model a `configure_optimizers`) or an init argument's key, which then receives
        `{"class_path", "init_args"}`. ValueError for a class that is no Optimizer."""
        self._add_uninstantiated(optimizer_class, (Optimizer,), nested_key, {"params"})
        self._optimizers[nested_key] = (optimizer_class, link_to)

    def add_lr_scheduler_args(
        self,
        lr_scheduler_class=LRSchedulerTypeTuple,
        nested_key="lr_scheduler",
        link_to="AUTOMATIC",
    ) -> None:
        """As `add_optimizer_args`, for an LR scheduler (its `optimizer` argument left out)."""
        bases, skip = LRSchedulerTypeTuple, {"optimizer"}
        self._add_uninstantiated(lr_scheduler_class, bases, nested_key, skip)
        self._lr_schedulers[nested_key] = (lr_scheduler_class, link_to)

    def _add_uninstantiated(self, classes: Any, bases: tuple, key: str, skip: set[str]) -> None:
        listed = classes if isinstance(classes, tuple) else (classes,)
        if not all(isinstance(c, type) and issubclass(c, bases) for c in listed):
            raise ValueError(f"{classes} is not a subclass (or a tuple of subclasses) of {bases}.")
        kwargs = dict(instantiate=False, fail_untyped=False, skip=skip)
        if isinstance(classes, tuple):
            self.add_subclass_arguments(classes, key, **kwargs)
        else:
            self.add_class_arguments(classes, key, sub_configs=True, **kwargs)


def _broadcast(value: Any) -> Any:
    """Rank 0's `value` on every rank; `value` itself without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class SaveConfigCallback(Callback):
    """Saves the CLI's config as `<trainer.log_dir>/<config_filename>` at the first `setup`.

    Rank 0 writes. If the file exists and `overwrite` is False, every rank raises RuntimeError
    first (a second run in one folder keeps the first run's config). `multifile`: keep the
    input's split into files. `save_to_log_dir=False` writes no file, for a subclass overriding
    `save_config` (ValueError otherwise). `save_config` runs once, on rank 0 only."""

    def __init__(
        self,
        parser: LightningArgumentParser,
        config: Namespace,
        config_filename: str = "config.yaml",
        overwrite: bool = False,
        multifile: bool = False,
        save_to_log_dir: bool = True,
    ) -> None:
        self.parser, self.config, self.config_filename = parser, config, config_filename
        self.overwrite, self.multifile, self.save_to_log_dir = overwrite, multifile, save_to_log_dir
        self.already_saved = False
        if not save_to_log_dir and type(self).save_config is SaveConfigCallback.save_config:
            raise ValueError(
                "`save_to_log_dir=False` only makes sense in a SaveConfigCallback subclass that "
                "overrides `save_config`: the config would be saved nowhere."
            )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.already_saved:
            return
        if self.save_to_log_dir:
            path = os.path.join(trainer.log_dir, self.config_filename)
            if not self.overwrite and _broadcast(trainer.is_global_zero and os.path.isfile(path)):
                raise RuntimeError(
                    f"{type(self).__name__}: {path} exists. Aborting to avoid overwriting the "
                    "config of an earlier run: delete it, or pass LightningCLI(save_config_kwargs="
                    "{'overwrite': True}), or save_config_callback=None."
                )
            if trainer.is_global_zero:
                os.makedirs(trainer.log_dir, exist_ok=True)
                kwargs = dict(skip_none=False, overwrite=self.overwrite, multifile=self.multifile)
                self.parser.save(self.config, path, **kwargs)
        if trainer.is_global_zero:
            self.save_config(trainer, pl_module, stage)
            self.already_saved = True
        self.already_saved = _broadcast(self.already_saved)

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Override to save the config elsewhere too (a logger's hyper-parameters); rank 0 only,
        so no collectives. `self.parser.dump(self.config, skip_none=False)` is its YAML."""


class LightningCLI:
    """Parses the command line (or `args`: a list, dict or Namespace) into a model, a datamodule
    and a Trainer, then runs the subcommand (none with `run=False`).

    `model_class` / `datamodule_class`: a class or a function returning an instance; None (or
    `subclass_mode_*`): any subclass, by class_path (`--model=pkg.Class`; data then optional).
    `save_config_callback(parser, config, **save_config_kwargs)` saves the config (None: no;
    never under fast_dev_run). `trainer_defaults` are the `--trainer.*` defaults; its
    "callbacks" are always added. `parser_kwargs` go to every parser, or, under a subcommand's
    name, to its own. `auto_configure_optimizers`: `--optimizer` / `--lr_scheduler`, which once
    given replace the model's `configure_optimizers`. `load_from_checkpoint_support` is accepted
    and has no effect. Afterwards: `parser`, `config` (under `config[subcommand]` when run),
    `config_init` (instantiated), `subcommand`, `model`, `datamodule` (or None), `trainer`.
    Hooks: add_arguments_to_parser, before/after_instantiate_classes, before_<subcommand>,
    after_<subcommand>; a method named like a subcommand replaces the Trainer's.
    """

    def __init__(
        self,
        model_class: Any = None,
        datamodule_class: Any = None,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_class: Any = Trainer,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        parser_kwargs: dict[str, Any] | None = None,
        parser_class: type[LightningArgumentParser] = LightningArgumentParser,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: ArgsType = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
        load_from_checkpoint_support: bool = True,
    ) -> None:
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = save_config_kwargs or {}
        self.trainer_class, self.trainer_defaults = trainer_class, trainer_defaults or {}
        self.seed_everything_default = seed_everything_default
        self.parser_kwargs, self.parser_class = parser_kwargs or {}, parser_class
        self.auto_configure_optimizers = auto_configure_optimizers
        self.model_class, self.datamodule_class = model_class, datamodule_class
        self._model_class = model_class or LightningModule
        self._datamodule_class = datamodule_class or LightningDataModule
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data

        names = self.subcommands()
        main_kwargs = {k: v for k, v in self.parser_kwargs.items() if k not in names}
        sub_kwargs = {k: v for k, v in self.parser_kwargs.items() if k in names}
        self.setup_parser(run, main_kwargs, sub_kwargs)
        self.parse_arguments(self.parser, args)
        self.subcommand = self.config["subcommand"] if run else None
        self._parse_ckpt_path()
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if self.subcommand is not None:
            self._run_subcommand(self.subcommand)

    # ------------------------------------------------------------------ the parser
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """A new `parser_class(**kwargs)` with `-c/--config`."""
        kwargs.setdefault("dump_header", [f"lightspeed=={__version__}"])
        parser = self.parser_class(**kwargs)
        help = "A config file (YAML or JSON); several merge, later ones winning."
        parser.add_argument("-c", "--config", action=ActionConfigFile, help=help)
        return parser

    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict
    ) -> None:
        """Builds `self.parser`: one subparser per subcommand, or (run=False) the arguments."""
        self.parser = self.init_parser(**main_kwargs)
        if not add_subcommands:
            self._add_arguments(self.parser)
            return
        self._subcommand_method_arguments: dict[str, list[str]] = {}
        self._subcommand_parsers: dict[str, LightningArgumentParser] = {}
        trainer_class = self.trainer_class
        if not isinstance(trainer_class, type):
            trainer_class = class_from_function(trainer_class)
        subcommands = self.parser.add_subcommands()
        for name, skip in self.subcommands().items():
            doc = inspect.getdoc(getattr(trainer_class, name)) or ""  # its first sentence:
            summary = " ".join(re.split(r"\.\s", doc + " ")[0].split()) + "." if doc else None
            parser = self.init_parser(**{"description": summary, **subparser_kwargs.get(name, {})})
            self._add_arguments(parser)
            added = parser.add_method_arguments(trainer_class, name, skip=set(skip))
            self._subcommand_method_arguments[name] = added
            self._subcommand_parsers[name] = parser
            subcommands.add_subcommand(name, parser, help=summary)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands (Trainer methods), each with the arguments the CLI passes itself."""
        fit = {"model", "train_dataloaders", "val_dataloaders", "datamodule"}
        evaluation = {name: {"model", "dataloaders", "datamodule"} for name in EVALUATION}
        return {"fit": fit, **evaluation}

    def _add_arguments(self, parser: LightningArgumentParser) -> None:
        self.add_default_arguments_to_parser(parser)
        self.add_core_arguments_to_parser(parser)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            if not parser._optimizers:  # unless add_arguments_to_parser added some
                parser.add_optimizer_args((Optimizer,))
            if not parser._lr_schedulers:
                parser.add_lr_scheduler_args(LRSchedulerTypeTuple)
        self.link_optimizers_and_lr_schedulers(parser)

    def add_default_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Adds `--seed_everything`."""
        help = "An int: the seed, set before anything is built; true: a random one; false: none."
        default = self.seed_everything_default
        parser.add_argument("--seed_everything", type=Union[bool, int], default=default, help=help)

    def add_core_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Adds the `trainer`, `model` and `data` groups; `trainer_defaults` are the defaults."""
        parser.add_lightning_class_args(self.trainer_class, "trainer")
        defaults = {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        parser.set_defaults(defaults)
        parser.add_lightning_class_args(self._model_class, "model", self.subclass_mode_model)
        data, required = self._datamodule_class, self.datamodule_class is not None
        parser.add_lightning_class_args(data, "data", self.subclass_mode_data, required)

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        """Override to add arguments (`parser.add_lightning_class_args(MyCallback, "cb")`, optimizer
        groups) or links (`parser.link_arguments("data.num_classes", "model.num_classes")`)."""

    @staticmethod
    def link_optimizers_and_lr_schedulers(parser: LightningArgumentParser) -> None:
        """Links each optimizer or LR scheduler group that has a `link_to` key to that key."""
        for key, (classes, link_to) in {**parser._optimizers, **parser._lr_schedulers}.items():
            if link_to != "AUTOMATIC":
                compute = None if isinstance(classes, tuple) else partial(_with_class_path, classes)
                parser.link_arguments(key, link_to, compute_fn=compute)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        """Parses `args` (None: sys.argv[1:]) into `self.config`; warns when both are given."""
        if args is not None and len(sys.argv) > 1:
            message = f"sys.argv[1:]={sys.argv[1:]} are ignored for args={args}"
            warnings.warn(f"LightningCLI's args parameter replaces the command line: {message}.")
        if isinstance(args, (dict, Namespace)):
            self.config = parser.parse_object(args)
        else:
            self.config = parser.parse_args(args)

    def _parse_ckpt_path(self) -> None:
        """With `--ckpt_path` naming a checkpoint (file or folder), the hyper-parameters saved
        in it become the model's config (`predict --ckpt_path=...` rebuilds the trained shapes)."""
        path = self.subcommand and self.config[self.subcommand].get("ckpt_path")
        if not path or not os.path.exists(path):
            return
        from lightspeed.core import saving  # the checkpoint (file or trainer.pt) holds the hparams

        saved = saving.checkpoint_state(path).get(saving.HPARAMS_KEY)
        if not saved:
            return
        model = {"init_args": dict(saved)} if self.subclass_mode_model else dict(saved)
        try:
            self.config = self.parser.parse_object({self.subcommand: {"model": model}}, self.config)
        except SystemExit:
            sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
            raise

    def _set_seed(self) -> None:
        """Seeds with the configured seed (True: PL_GLOBAL_SEED when set, else a random one), and
        writes the seed used into the config and PL_GLOBAL_SEED (ranks started later read it)."""
        config = self.config.get(str(self.subcommand), self.config)
        seed = config.get("seed_everything")
        if seed is False:
            return
        if seed is True:
            seed = int(os.environ.get("PL_GLOBAL_SEED") or random.SystemRandom().randrange(2**32))
        seed_everything(seed)
        os.environ["PL_GLOBAL_SEED"] = str(seed)
        config["seed_everything"] = seed

    # ------------------------------------------------------------------ instantiation
    def before_instantiate_classes(self) -> None:
        """Override to run code after parsing, before any class is built."""

    def after_instantiate_classes(self) -> None:
        """Override to run code once model, datamodule and trainer exist."""

    def instantiate_classes(self) -> None:
        """Builds the configured classes (`config_init`), then `model`, `datamodule`, `trainer`."""
        self.config_init = self.parser.instantiate_classes(self.config)
        self.datamodule = self._get(self.config_init, "data")
        self.model = self._get(self.config_init, "model")
        self._add_configure_optimizers_method_to_model(self.subcommand)
        self.trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """A new Trainer from the config, `kwargs` winning. Its callbacks: the configured ones,
        the callback groups', `trainer_defaults["callbacks"]`, then a `save_config_callback`."""
        trainer_config = self._get(self.config_init, "trainer")
        config = {**(vars(trainer_config) if trainer_config is not None else {}), **kwargs}
        if "callbacks" not in config:
            name = self.trainer_class.__qualname__
            message = "argument, so the CLI's callbacks (SaveConfigCallback too) are left out."
            warnings.warn(f"The `{name}` class does not expose the `callbacks` {message}")
            return self.trainer_class(**config)
        given = config["callbacks"]
        callbacks = [] if given is None else list(given) if isinstance(given, list) else [given]
        callbacks += [self._get(self.config_init, k) for k in self._parser().callback_keys]
        defaults = self.trainer_defaults.get("callbacks", [])
        for cb in defaults if isinstance(defaults, list) else [defaults]:
            callbacks.append(instantiate_class((), cb) if isinstance(cb, dict) else cb)
        if self.save_config_callback and not config.get("fast_dev_run", False):
            saved = self.config.get(str(self.subcommand), self.config)
            callback = self.save_config_callback(self._parser(), saved, **self.save_config_kwargs)
            callbacks.append(callback)
        return self.trainer_class(**{**config, "callbacks": callbacks})

    def _parser(self) -> LightningArgumentParser:
        """The subcommand's parser (the main one with run=False)."""
        return self.parser if self.subcommand is None else self._subcommand_parsers[self.subcommand]

    def _get(self, config: Namespace, key: str, default: Any = None) -> Any:
        """`config[key]`, under the subcommand's name when there is one."""
        return config.get(str(self.subcommand), config).get(key, default)

    # ------------------------------------------------------------------ optimizers
    @staticmethod
    def configure_optimizers(lightning_module: Any, optimizer: Any, lr_scheduler=None) -> Any:
        """What the model's `configure_optimizers` returns once `--optimizer` is given; override
        to change it. A ReduceLROnPlateau (this module's) comes with its `monitor`."""
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, ReduceLROnPlateau):
            scheduler = {"scheduler": lr_scheduler, "monitor": lr_scheduler.monitor}
            return {"optimizer": optimizer, "lr_scheduler": scheduler}
        return [optimizer], [lr_scheduler]

    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        """Gives the model a `configure_optimizers` building the configured optimizer (and LR
        scheduler) on its parameters at each call, so a strategy's copy of the model gets its own.
        Only for an AUTOMATIC optimizer group that got a value; two such groups: ConfigError."""
        parser = self._parser()
        groups = [parser._optimizers, parser._lr_schedulers]
        optimizers, schedulers = ([k for k, v in g.items() if v[1] == "AUTOMATIC"] for g in groups)
        if not self.auto_configure_optimizers or not optimizers:
            return
        if len(optimizers) > 1 or len(schedulers) > 1:
            raise ConfigError(
                f"{type(self).__name__} adds configure_optimizers for one AUTOMATIC optimizer and "
                f"LR scheduler, not {optimizers + schedulers}: pass link_to= to their groups and "
                "write the model's configure_optimizers."
            )
        optimizer_init = self._init_of(parser._optimizers, optimizers[0])
        if not optimizer_init:  # none given: the model's own configure_optimizers stays
            return
        scheduler_init = self._init_of(parser._lr_schedulers, schedulers[0]) if schedulers else None
        if type(self.model).configure_optimizers is not LightningModule.configure_optimizers:
            model, cli = type(self.model).__name__, type(self).__name__
            name = "configure_optimizers"
            message = f"`{model}.{name}` will be overridden by `{cli}.{name}`."
            warnings.warn(message, UserWarning, stacklevel=4)
        cli = self

        def configure_optimizers(module: Any) -> Any:
            optimizer = instantiate_class(module.parameters(), optimizer_init)
            scheduler = instantiate_class(optimizer, scheduler_init) if scheduler_init else None
            return cli.configure_optimizers(module, optimizer, scheduler)

        self.model.configure_optimizers = MethodType(configure_optimizers, self.model)

    def _init_of(self, register: dict[str, tuple[Any, str]], key: str) -> dict | None:
        """The `{"class_path", "init_args"}` under `key`; None for a subclass group given none."""
        value, classes = self._get(self.config_init, key), register[key][0]
        if not isinstance(classes, tuple):
            return _with_class_path(classes, value)
        return value.as_dict() if hasattr(value, "as_dict") else value

    # ------------------------------------------------------------------ running
    def _run_subcommand(self, subcommand: str) -> None:
        """`before_<subcommand>`, this CLI's method of that name or else the Trainer's, then
        `after_<subcommand>`."""
        if callable(before := getattr(self, f"before_{subcommand}", None)):
            before()
        fn = getattr(self, subcommand, None) or getattr(self.trainer, subcommand)
        config = self.config_init[subcommand]
        kwargs = {k: config.get(k) for k in self._subcommand_method_arguments[subcommand]}
        kwargs["model"] = self.model
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        fn(**kwargs)
        if callable(after := getattr(self, f"after_{subcommand}", None)):
            after()


LOGO = r"""
      ____
     /   /_      lightspeed
    /_    /
     /  /'
    /.'
"""


def cli_lightning_logo() -> None:
    """Prints lightspeed's logo, a bolt, in magenta."""
    print("\n\033[0;35m" + LOGO + "\033[0m\n")
