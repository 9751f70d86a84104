"""`save_hyperparameters()` and `load_from_checkpoint()`: a Module rebuilt from its own init
arguments.

    class Model(LightningModule):
        def __init__(self, hidden=64, lr=1e-3):
            super().__init__()
            self.save_hyperparameters()           # self.hparams == {"hidden": 64, "lr": 0.001}

    model = Model.load_from_checkpoint("checkpoints/last")    # any strategy's checkpoint: DDP,
    ZeRO-3, FSDP shards

The hyper-parameters travel in every checkpoint (trainer.pt, "hyper_parameters") and go to the
loggers at fit start. Loading reads the weights with `conversion.full_state_dict`, which merges
DeepSpeed's ZeRO shards and FSDP's DCP shards offline, so (unlike Lightning) no conversion step
comes first.
"""

from __future__ import annotations

import copy
import inspect
import os
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from lightspeed.checkpoint.checkpointer import META, TRAINER_STATE, read_meta
from lightspeed.errors import ConfigError

HPARAMS_KEY = "hyper_parameters"
# set when __init__ took one dict/Namespace of hyper-parameters: its parameter name
HPARAMS_NAME = "hparams_name"


class AttributeDict(dict):
    """A dict whose keys read and write as attributes too: `self.hparams.lr`."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"hparams has no {key!r}: it holds {sorted(self)}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value


def init_arguments(frame: FrameType, obj: Any) -> dict[str, Any]:
    """The arguments of the `__init__` call running in `frame` (or the nearest enclosing `__init__`
    frame whose `self` is `obj`, for a call made from a helper), `**kwargs` spread out, `self` left
    out."""
    while frame is not None and not (
        frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is obj
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        raise ConfigError(
            "save_hyperparameters() must be called from the module's __init__ (no __init__ frame "
            "of "
            "this module was found on the call stack)."
        )
    info = inspect.getargvalues(frame)
    args = {name: info.locals[name] for name in info.args if name != "self"}
    if info.varargs and info.locals[info.varargs]:
        args[info.varargs] = info.locals[info.varargs]
    if info.keywords:
        args.update(info.locals[info.keywords])
    return args


def select(args: dict[str, Any], names: tuple, ignore: str | list[str] | None) -> dict[str, Any]:
    """`args` restricted to `names` (all when empty), without `ignore`. An unknown name is a
    ConfigError. One dict or argparse.Namespace instead of names (`save_hyperparameters(hparams)`)
    gives its items."""
    if len(names) == 1 and (isinstance(names[0], dict) or hasattr(names[0], "__dict__")):
        return dict(names[0] if isinstance(names[0], dict) else vars(names[0]))
    ignore = [ignore] if isinstance(ignore, str) else list(ignore or [])
    if len(names) == 1 and isinstance(names[0], (list, tuple)):
        names = tuple(names[0])
    unknown = [n for n in names if n not in args]
    if unknown:
        raise ConfigError(
            f"save_hyperparameters{tuple(names)} names {unknown}, which are not arguments of "
            f"__init__: those are {sorted(args)}."
        )
    return {k: v for k, v in args.items() if (not names or k in names) and k not in ignore}


def store(
    owner: Any, frame: FrameType, names: tuple, ignore: str | list[str] | None, logger: bool
) -> None:
    """`save_hyperparameters` of a Module or DataModule: the arguments of the `__init__` running in
    `frame` (all, or `names`, minus `ignore`) into `owner.hparams`, a copy kept as
    `hparams_initial`, and whether the loggers get them (`logger`). A dict passed whole is
    remembered by its parameter name, for load_from_checkpoint."""
    args = init_arguments(frame, owner)
    owner.hparams.update(select(args, names, ignore))
    owner.__dict__["_hparams_initial"] = copy.deepcopy(dict(owner.hparams))
    if len(names) == 1 and isinstance(names[0], dict):
        owner.__dict__["_hparams_name"] = dict_argument(args, names[0])
    owner.__dict__["_log_hyperparams"] = logger


def initial(owner: Any) -> AttributeDict:
    """`hparams_initial`: the hyper-parameters as `save_hyperparameters` stored them, later changes
    aside."""
    return AttributeDict(copy.deepcopy(owner.__dict__.get("_hparams_initial", {})))


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint directory `path` names (a checkpoint, or a folder holding `last`); a
    ConfigError naming what is missing when it is not a complete lightspeed checkpoint."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"load_from_checkpoint({str(path)!r}): the path does not exist.")
    if path.is_dir() and not (path / META).exists() and (path / "last").exists():
        path = path / "last"
    read_meta(path.resolve())  # names meta.json when it is missing
    if not (path / TRAINER_STATE).exists():
        raise ConfigError(
            f"load_from_checkpoint({str(path)!r}): {TRAINER_STATE} is missing (it holds the "
            "hyper-parameters); the checkpoint is incomplete."
        )
    return path.resolve()


def load_from_checkpoint(
    cls: type,
    path: str | os.PathLike,
    map_location: Any = None,
    strict: bool = True,
    **overrides: Any,
) -> Any:
    """Builds `cls(**hparams, **overrides)` (overrides win), runs its `configure_model`, loads the
    full weights from the checkpoint at `path` (any strategy's layout) and its `on_load_checkpoint`
    hook; returns the module in eval mode, on `map_location` when given (a device or string; default
    CPU)."""
    from lightspeed.strategies.conversion import full_state_dict

    path = checkpoint_dir(path)
    state = torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)
    module = cls(
        **_init_kwargs(cls, {**state.get(HPARAMS_KEY, {}), **overrides}, state.get(HPARAMS_NAME))
    )
    module.configure_model()
    weights = full_state_dict(path)
    current = module.state_dict()
    # The checkpoint holds fp32; a module built in another dtype (bf16-true) keeps its own.
    weights = {
        k: v.to(current[k].dtype) if k in current and v.is_floating_point() else v
        for k, v in weights.items()
    }
    module.load_state_dict(weights, strict=strict)
    module.on_load_checkpoint(state)
    if map_location is not None:
        module.to(torch.device(map_location) if isinstance(map_location, str) else map_location)
    return module.eval()


def dict_argument(args: dict[str, Any], value: Any) -> str | None:
    """The name of the `__init__` parameter that holds `value` (a dict of hyper-parameters passed
    whole)."""
    return next((name for name, v in args.items() if v is value), None)


def _init_kwargs(cls: type, hparams: dict[str, Any], dict_name: str | None) -> dict[str, Any]:
    """What to pass to `cls(...)`: the hparams under the one parameter that took them whole, else
    the hparams that `__init__` accepts (all of them with **kwargs)."""
    if dict_name:
        return {dict_name: hparams}
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return hparams
    return {k: v for k, v in hparams.items() if k in params}
