"""`save_hyperparameters()` and `load_from_checkpoint()`: a Module rebuilt from its own init
arguments.

    class Model(LightningModule):
        def __init__(self, hidden=64, lr=1e-3):
            super().__init__()
            self.save_hyperparameters()           # self.hparams == {"hidden": 64, "lr": 0.001}

    model = Model.load_from_checkpoint("checkpoints/last.ckpt")   # any strategy's checkpoint:
    # a .ckpt file (single, DDP, or written by Lightning), ZeRO-3 or FSDP shards

The hyper-parameters travel in every checkpoint ("hyper_parameters": in a .ckpt file's dict or a
directory's trainer.pt) and go to the loggers at fit start. A file is read as Lightning reads it
(`on_load_checkpoint` sees the dict before its `state_dict` is loaded); a directory's weights are
read with `conversion.full_state_dict`, which merges DeepSpeed's ZeRO shards and FSDP's DCP shards
offline, so (unlike Lightning) no conversion step comes first.
"""

from __future__ import annotations

import ast
import csv
import inspect
import os
import urllib.parse
from argparse import Namespace
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from lightspeed.checkpoint import single_file
from lightspeed.checkpoint.checkpointer import META, TRAINER_STATE, read_meta
from lightspeed.checkpoint.locate import last_in
from lightspeed.errors import ConfigError
from lightspeed.utilities.rank_zero import rank_zero_warn

HPARAMS_KEY = "hyper_parameters"
DATAMODULE_HPARAMS_KEY = "datamodule_hyper_parameters"  # the DataModule's, beside the Module's
# set when __init__ took one dict/Namespace of hyper-parameters: its parameter name
HPARAMS_NAME = "hparams_name"
DATAMODULE_HPARAMS_NAME = "datamodule_hparams_name"  # Lightning's key for the DataModule's


def checkpoint_dir(path: str | os.PathLike) -> Path:
    """The checkpoint `path` names (a checkpoint file or directory, or a folder holding
    `last.ckpt`); a ConfigError naming what is missing when it is not a complete checkpoint."""
    path = _local(path)
    if not path.exists():
        raise ConfigError(f"load_from_checkpoint({str(path)!r}): the path does not exist.")
    if path.is_dir() and not (path / META).exists() and last_in(path).exists():
        path = last_in(path)
    if path.is_file():
        return path.resolve()
    read_meta(path.resolve())  # names meta.json when it is missing
    if not (path / TRAINER_STATE).exists():
        raise ConfigError(
            f"load_from_checkpoint({str(path)!r}): {TRAINER_STATE} is missing (it holds the "
            "hyper-parameters); the checkpoint is incomplete."
        )
    return path.resolve()


def _local(path: str | os.PathLike) -> Path:
    """`path`, or for an http(s) URL (a .ckpt file, as Lightning loads one) the copy downloaded
    into torch.hub's cache (`<hub dir>/checkpoints/<name>`, fetched once)."""
    text = str(path)
    if not text.startswith(("http://", "https://")):
        return Path(path)
    folder = Path(torch.hub.get_dir()) / "checkpoints"
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / os.path.basename(urllib.parse.urlparse(text).path)
    if not file.exists():
        torch.hub.download_url_to_file(text, str(file), progress=False)
    return file


def checkpoint_state(path: str | os.PathLike) -> dict:
    """The trainer's state a checkpoint holds (hyper-parameters, callbacks, loop position, the
    hooks' extras): a .ckpt file's whole dict, or a directory's trainer.pt."""
    path = checkpoint_dir(path)
    if path.is_file():
        return single_file.read(path)
    return torch.load(path / TRAINER_STATE, map_location="cpu", weights_only=False)


def load_from_checkpoint(
    cls: type,
    path: str | os.PathLike,
    map_location: Any = None,
    strict: bool | None = True,
    **overrides: Any,
) -> Any:
    """Builds `cls(**hparams, **overrides)` (overrides win), runs its `configure_model`, loads the
    full weights from the checkpoint at `path` (any strategy's layout) and its `on_load_checkpoint`
    hook; returns the module in eval mode.

    `map_location` is torch.load's (a device, string, dict or function) for a .ckpt file, whose
    module then sits where its tensors were mapped (CPU by default), as Lightning's does; for a
    directory, a device or string to move the module to. `strict=None` takes the module's
    `strict_loading` (default True). Raises ConfigError (a ValueError) when `strict` contradicts
    the module's `strict_loading`, or when the checkpoint is not one. Lightning's keywords
    `hparams_file` (a .yaml or .csv whose hyper-parameters replace the checkpoint's) and
    `weights_only` (torch.load's, for a file) are taken too."""
    from lightspeed.strategies.conversion import full_state_dict

    hparams_file = overrides.pop("hparams_file", None)
    weights_only = overrides.pop("weights_only", None)
    path = checkpoint_dir(path)
    state = checkpoint_state(path)
    if path.is_file() and (map_location is not None or weights_only):
        state = torch.load(path, map_location=map_location, weights_only=bool(weights_only))
    saved = _saved_hparams(state, hparams_file)
    module = cls(**_init_kwargs(cls, {**saved, **overrides}, state.get(HPARAMS_NAME)))
    module.configure_model()
    strict = _strict(module, strict)
    if path.is_file():  # Lightning's order: the hook may edit the state_dict before it is loaded
        module.on_load_checkpoint(state)
        weights = state["state_dict"]
        if not weights:
            rank_zero_warn(f"The state dict in {str(path)!r} contains no parameters.")
    else:
        weights = full_state_dict(path)
    current = module.state_dict()
    # The checkpoint holds fp32; a module built in another dtype (bf16-true) keeps its own.
    weights = {
        k: v.to(current[k].dtype) if k in current and v.is_floating_point() else v
        for k, v in weights.items()
    }
    module.load_state_dict(weights, strict=strict)
    if not path.is_file():
        module.on_load_checkpoint(state)
        if map_location is not None:
            module.to(torch.device(map_location) if isinstance(map_location, str) else map_location)
    else:
        where = next((t.device for t in weights.values() if isinstance(t, torch.Tensor)), None)
        module.to(where or torch.device("cpu"))
    return module.eval()


# Where Lightning checkpoints before 1.0 kept the hyper-parameters (still read, as Lightning does)
PAST_HPARAMS_KEYS = ("hparams", "module_arguments")


def _saved_hparams(state: dict, hparams_file: str | os.PathLike | None) -> dict:
    """The hyper-parameters to rebuild from: `hparams_file`'s (YAML or CSV) where given, else the
    checkpoint's, under its current key or a past one."""
    if hparams_file is not None:
        read = load_hparams_from_tags_csv if str(hparams_file).endswith(".csv") else _yaml
        return dict(read(hparams_file) or {})
    saved: dict = {}
    for key in (*PAST_HPARAMS_KEYS, HPARAMS_KEY):
        saved.update(state.get(key) or {})
    return saved


def _yaml(path: str | os.PathLike) -> Any:
    return load_hparams_from_yaml(path, use_omegaconf=False)


def _strict(module: Any, strict: bool | None) -> bool:
    """`strict`, or the module's `strict_loading` (Lightning's attribute) where `strict` is None;
    ConfigError when both are given and differ."""
    declared = module.__dict__.get("_strict_loading", module.__dict__.get("strict_loading"))
    if declared is not None and strict is not None and strict != declared:
        raise ConfigError(
            f"load_from_checkpoint(strict={strict!r}) is in conflict with "
            f"{type(module).__name__}.strict_loading={declared!r}: set the same value for both."
        )
    if strict is None:
        return True if declared is None else bool(declared)
    return strict


def load_datamodule_from_checkpoint(cls: type, path: str | os.PathLike, **overrides: Any) -> Any:
    """Builds `cls(**hparams, **overrides)` from the DataModule hyper-parameters a checkpoint
    holds (Lightning's `LightningDataModule.load_from_checkpoint`) and restores its `state_dict`.
    Hyper-parameters that `__init__` does not take are left out."""
    state = checkpoint_state(path)
    saved = state.get(DATAMODULE_HPARAMS_KEY) or {}
    name = state.get(DATAMODULE_HPARAMS_NAME)
    datamodule = cls(**_init_kwargs(cls, {**saved, **overrides}, name))
    if state.get("datamodule"):
        datamodule.load_state_dict(state["datamodule"])
    return datamodule


def dict_argument(args: dict[str, Any], value: Any) -> str | None:
    """The name of the `__init__` parameter that holds `value` (a dict of hyper-parameters passed
    whole)."""
    return next((name for name, v in args.items() if v is value), None)


def _init_kwargs(cls: type, hparams: dict[str, Any], dict_name: str | None) -> dict[str, Any]:
    """What to pass to `cls(...)`: the hparams under the one parameter that took them whole, else
    the hparams that `__init__` accepts (all of them with **kwargs). Lightning records "kwargs"
    (the **kwargs parameter's name) for hparams collected from the signature: those are spread."""
    params = inspect.signature(cls.__init__).parameters
    named = params.get(dict_name or "")
    if named is not None and named.kind not in (named.VAR_POSITIONAL, named.VAR_KEYWORD):
        return {named.name: hparams}
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return hparams
    return {k: v for k, v in hparams.items() if k in params}


# ------------------------------------------------------------------ hparams files (Lightning's)
def save_hparams_to_yaml(
    config_yaml: str | os.PathLike, hparams: Any, use_omegaconf: bool = True
) -> None:
    """Writes `hparams` (a dict, Namespace or AttributeDict) to the YAML file `config_yaml`. An Enum
    is written as its name; a value YAML cannot hold is skipped with a warning. Raises
    RuntimeError when the folder is missing."""
    import yaml

    folder = os.path.dirname(os.fspath(config_yaml))
    if folder and not os.path.isdir(folder):
        raise RuntimeError(f"Missing folder: {folder}.")
    if isinstance(hparams, Namespace):
        hparams = vars(hparams)
    if use_omegaconf and _is_omegaconf(hparams):
        from omegaconf import OmegaConf  # pyright: ignore[reportMissingImports]

        OmegaConf.save(hparams, config_yaml, resolve=True)
        return
    kept = {}
    for key, value in dict(hparams).items():
        value = value.name if isinstance(value, Enum) else value
        try:
            yaml.dump(value)
        except (TypeError, ValueError, yaml.YAMLError):
            rank_zero_warn(
                f"Skipping '{key}' parameter because it is not possible to safely dump to YAML."
            )
        else:
            kept[key] = value
    with open(config_yaml, "w", newline="") as f:
        yaml.dump(kept, f)


def load_hparams_from_yaml(config_yaml: str | os.PathLike, use_omegaconf: bool = True) -> Any:
    """The hyper-parameters in the YAML file `config_yaml` (an OmegaConf DictConfig when omegaconf
    is installed and `use_omegaconf`); {} with a warning when the file is missing."""
    import yaml

    if not os.path.exists(config_yaml):
        rank_zero_warn(f"Missing Tags: {config_yaml}.", category=RuntimeWarning)
        return {}
    with open(config_yaml) as f:
        hparams = yaml.full_load(f)
    if use_omegaconf and inspect.ismodule(_omegaconf()):
        from omegaconf import OmegaConf  # pyright: ignore[reportMissingImports]

        return OmegaConf.create(hparams or {})
    return hparams


def save_hparams_to_tags_csv(tags_csv: str | os.PathLike, hparams: Any) -> None:
    """Writes `hparams` as a two-column CSV (key, value). Raises RuntimeError when the folder is
    missing."""
    folder = os.path.dirname(os.fspath(tags_csv))
    if folder and not os.path.isdir(folder):
        raise RuntimeError(f"Missing folder: {folder}.")
    if isinstance(hparams, Namespace):
        hparams = vars(hparams)
    with open(tags_csv, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["key", "value"])
        writer.writerows(hparams.items())


def load_hparams_from_tags_csv(tags_csv: str | os.PathLike) -> dict[str, Any]:
    """The hyper-parameters of a (key, value) CSV, each value read back as a Python literal where
    it is one; {} with a warning when the file is missing."""
    if not os.path.exists(tags_csv):
        rank_zero_warn(f"Missing Tags: {tags_csv}.", category=RuntimeWarning)
        return {}
    with open(tags_csv, newline="") as f:
        rows = list(csv.reader(f))[1:]
    return {key: _literal(value) for key, value in rows}


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def _omegaconf() -> Any:
    try:
        import omegaconf  # pyright: ignore[reportMissingImports]
    except ImportError:
        return None
    return omegaconf


def _is_omegaconf(value: Any) -> bool:
    module = _omegaconf()
    return module is not None and isinstance(value, module.Container)
