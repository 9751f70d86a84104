"""`save_hyperparameters()`: the arguments of the running `__init__` kept in `self.hparams`.

    class Model(LightningModule):
        def __init__(self, hidden=64, lr=1e-3):
            super().__init__()
            self.save_hyperparameters()           # self.hparams == {"hidden": 64, "lr": 0.001}

The `__init__` is found by its class, not by how its parameters are spelled: a frame counts when its
code is the `__init__` of a class of the object in its first argument (`self`, `this`, `me`, ...).
Starting from the first such frame whose object is the one saving, the arguments of the `__init__`
frames that called it (a subclass's, or an enclosing Lightning object's) are gathered as well, the
outer ones winning, as in Lightning.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from argparse import Namespace
from collections.abc import MutableMapping
from types import FrameType
from typing import Any

import torch

from lightspeed.errors import ConfigError
from lightspeed.utilities.parsing import AttributeDict
from lightspeed.utilities.rank_zero import rank_zero_warn

PRIMITIVE_TYPES = (bool, int, float, str)


def _init_class(frame: FrameType) -> type | None:
    """The class whose `__init__` runs in `frame`, matched by its code object among the classes of
    the frame's first argument; None when the frame runs no class's `__init__`."""
    code = frame.f_code
    if code.co_name != "__init__" or code.co_argcount == 0:
        return None
    owner = frame.f_locals.get(code.co_varnames[0])
    for cls in type(owner).__mro__:
        init = cls.__dict__.get("__init__")
        if init is not None and getattr(inspect.unwrap(init), "__code__", None) is code:
            return cls
    return None


def _frame_arguments(frame: FrameType) -> dict[str, Any]:
    """The arguments of the `__init__` running in `frame` as they are now: its named parameters
    (the first, the object itself, and `*args` left out) and its `**kwargs` spread out."""
    info = inspect.getargvalues(frame)
    args = {name: info.locals[name] for name in info.args[1:] if name in info.locals}
    if info.keywords:
        args.update(info.locals.get(info.keywords) or {})
    return args


def init_arguments(frame: FrameType | None, obj: Any) -> dict[str, Any]:
    """The arguments of the `__init__` calls that built `obj`, starting from `frame` (or from the
    nearest `__init__` frame of `obj` above it, for a call made from a helper). Raises ConfigError
    when no such frame is on the call stack."""
    mro = type(obj).__mro__
    while frame is not None:
        cls = _init_class(frame)
        if cls is not None and frame.f_locals.get(frame.f_code.co_varnames[0]) is obj:
            break
        frame = frame.f_back
    if frame is None:
        raise ConfigError(
            "save_hyperparameters() must be called from the module's __init__ (no __init__ frame "
            "of this module was found on the call stack)."
        )
    gathered = []
    while frame is not None and (cls := _init_class(frame)) is not None:
        if cls not in mro and not issubclass(cls, HyperparametersMixin):
            break  # a plain object built this one: its arguments are not ours
        gathered.append(_frame_arguments(frame))
        frame = frame.f_back
    args: dict[str, Any] = {}
    for found in gathered:  # innermost first: a subclass's value of a shared name wins
        args.update(found)
    return args


class HyperparametersMixin:
    """`save_hyperparameters`, `hparams` and `hparams_initial`, for LightningModule,
    LightningDataModule, or any class (as in Lightning)."""

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: str | list[str] | tuple | None = None,
        frame: FrameType | None = None,
        logger: bool = True,
    ) -> None:
        """Keeps the calling `__init__`'s arguments in `self.hparams`: all of them, the ones named
        in `args`, or one dict / Namespace passed whole; `ignore` leaves names out (also removing
        them from what an earlier call kept). `logger=False` keeps them from the loggers.

        Raises ValueError for a primitive passed whole (`save_hyperparameters(3.14)`) and
        ConfigError for a name that is not an argument of `__init__`."""
        self.__dict__["_log_hyperparams"] = logger
        if len(args) == 1 and not isinstance(args[0], str) and not args[0]:
            return  # an empty container: nothing to keep
        if dataclasses.is_dataclass(self):
            init_args = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        else:
            caller = frame or inspect.currentframe().f_back  # type: ignore[union-attr]
            init_args = init_arguments(caller, self)
        ignore = [ignore] if isinstance(ignore, str) else list(ignore or ())
        ignored = {name for name in ignore if isinstance(name, str)}
        init_args = {k: v for k, v in init_args.items() if k not in ignored}
        if len(args) == 1 and isinstance(args[0], (list, tuple)):
            args = tuple(args[0])  # save_hyperparameters(["lr", "hidden"])
        whole = [a for a in args if not isinstance(a, str)]
        if not args:
            hp, name = init_args, None
        elif len(whole) == 1:
            hp = whole[0]
            name = next((k for k, v in init_args.items() if v is hp), None)
        else:
            unknown = [a for a in args if a not in init_args]
            if unknown:
                raise ConfigError(
                    f"save_hyperparameters{tuple(args)} names {unknown}, which are not arguments "
                    f"of __init__ (after ignore): those are {sorted(init_args)}."
                )
            hp, name = {a: init_args[a] for a in args}, None
        self.__dict__["_hparams_name"] = name
        self._set_hparams(hp)
        if isinstance(self.hparams, MutableMapping):
            for key in ignored & set(self.hparams):
                del self.hparams[key]
            for key, value in self.hparams.items():
                if isinstance(value, torch.nn.Module):
                    rank_zero_warn(
                        f"Attribute {key!r} is an instance of `nn.Module` and is already saved "
                        "during checkpointing. It is recommended to ignore them using "
                        f"`self.save_hyperparameters(ignore=[{key!r}])`."
                    )
        self.__dict__["_hparams_initial"] = copy.deepcopy(self.hparams)

    def _set_hparams(self, hp: Any) -> None:
        hp = self._to_hparams_dict(hp)
        if isinstance(hp, dict) and isinstance(self.hparams, dict):
            self.hparams.update(hp)
        else:
            self.__dict__["_hparams"] = hp

    @staticmethod
    def _to_hparams_dict(hp: Any) -> Any:
        if isinstance(hp, Namespace):
            hp = vars(hp)
        if isinstance(hp, dict):
            return AttributeDict(hp)
        if isinstance(hp, PRIMITIVE_TYPES):
            raise ValueError(f"Primitives {PRIMITIVE_TYPES} are not allowed.")
        if not isinstance(hp, MutableMapping):  # an OmegaConf DictConfig is one
            raise ValueError(f"Unsupported config type of {type(hp)}.")
        return hp

    @property
    def hparams(self) -> AttributeDict | MutableMapping:
        """What `save_hyperparameters` kept; saved in checkpoints and sent to the loggers."""
        return self.__dict__.setdefault("_hparams", AttributeDict())

    @property
    def hparams_initial(self) -> AttributeDict:
        """The hyper-parameters as `save_hyperparameters` kept them, later changes aside (a
        copy)."""
        return copy.deepcopy(self.__dict__.get("_hparams_initial", AttributeDict()))


def hparams_to_log(module: Any, datamodule: Any) -> dict[str, Any]:
    """What fit sends to the loggers: the Module's and the DataModule's `hparams_initial` merged
    (each unless saved with logger=False). Raises RuntimeError when a key is in both with
    different values, as Lightning does."""
    logged = [
        dict(owner.hparams_initial)
        for owner in (module, datamodule)
        if owner is not None
        and hasattr(owner, "hparams_initial")
        and owner.__dict__.get("_log_hyperparams", True)
    ]
    if len(logged) == 2:
        ours, theirs = logged
        clashing = [k for k in ours.keys() & theirs.keys() if not _same(ours[k], theirs[k])]
        if clashing:
            raise RuntimeError(
                f"Error while merging hparams: the keys {sorted(clashing)} are present in both the "
                "LightningModule's and LightningDataModule's hparams but have different values."
            )
    return {k: v for found in logged for k, v in found.items()}


def _same(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a is b
    try:
        return bool(a == b)
    except Exception:  # an object whose == is not a truth value
        return a is b
