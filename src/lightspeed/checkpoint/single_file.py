"""Lightning's checkpoint file: one `.ckpt` that `torch.load` reads as Lightning's dict. The
replicated strategies (single device, DDP, ZeRO-1) write it; it is read whether lightspeed or
Lightning wrote it.

    ckpt = torch.load("checkpoints/epoch=0-step=10.ckpt")
    ckpt["state_dict"]                  # the LightningModule's state_dict (CPU tensors)
    ckpt["optimizer_states"]            # [optimizer.state_dict() for each optimizer]
    ckpt["lr_schedulers"]               # [scheduler.state_dict() for each LR scheduler]
    ckpt["epoch"], ckpt["global_step"]  # the position; ckpt["loops"]: Lightning's loop counters
    ckpt["callbacks"]                   # {callback.state_key: callback.state_dict()}
    ckpt["hyper_parameters"], ckpt["hparams_name"], ckpt["pytorch-lightning_version"]
    ckpt["MixedPrecision"]              # the fp16 loss scaler's state, where there is one
    ckpt["lightspeed"]                  # what Lightning has no key for (below)

`ckpt["lightspeed"]` holds the exact loop position (`LoopState`: Lightning's counters cannot say
how many batches of the epoch ran under gradient accumulation), every rank's RNG state, the
optimizers' parameter names (what lets the file resume under FSDP or DeepSpeed, whose optimizer
state is keyed by name), the precision state and the strategy and world size that wrote it.

A file Lightning wrote has no such key: its position comes from its `loops` counters, its
optimizers' parameter names from the running strategy's optimizers (their parameters, found in the
model by identity), and it carries no RNG state (Lightning saves none).

Everything lightspeed puts in the file loads with `torch.load(weights_only=True)`, Lightning's
default on torch >= 2.6: tensors, lists, dicts, strings and numbers (NumPy's RNG key is stored as a
tensor).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from lightspeed.checkpoint.io import OPTIMIZER, WEIGHTS
from lightspeed.checkpoint.neutral import (
    Portable,
    canonical,
    named_optimizer_state,
    wrapper_prefix,
)
from lightspeed.errors import ConfigError
from lightspeed.specs import LoopState

KEY = "lightspeed"
LIGHTNING_VERSION = "2.6.6"  # the Lightning release whose checkpoint keys this file follows
SCALER_KEY = "MixedPrecision"  # Lightning's key of the loss scaler's state (its plugin's name)


# ------------------------------------------------------------------------------------------ write
def build(
    parts: Path,
    weights: dict[str, torch.Tensor],
    loop: LoopState,
    trainer_state: dict,
    rngs: list[dict],
    strategy: str,
    world_size: int,
) -> dict:
    """Lightning's dict from the model's state dict `weights`, the optimizer state the strategy
    wrote into the folder `parts` (optimizer.pt: each optimizer's state dict, the parameter names,
    the precision state) and the trainer's state (`callbacks`, `lr_schedulers`). `rngs`: every
    rank's RNG state, in rank order."""
    saved = torch.load(parts / OPTIMIZER, map_location="cpu", weights_only=False, mmap=True)
    ckpt = {
        "epoch": loop.epoch,
        "global_step": loop.global_step,
        "pytorch-lightning_version": LIGHTNING_VERSION,
        "state_dict": weights,
        "loops": lightning_loops(loop),
        **trainer_state,
        "optimizer_states": saved["optimizers"],
    }
    if scaler := saved.get("precision", {}).get("scaler"):
        ckpt[SCALER_KEY] = scaler
    ckpt[KEY] = {
        "strategy": strategy,
        "world_size": world_size,
        "loop": dataclasses.asdict(loop),
        "rng": [_safe_rng(r) for r in rngs],
        "param_names": saved.get("param_names"),
        "precision": saved.get("precision", {}),
    }
    return ckpt


def module_state(live: dict[str, torch.Tensor], parts: Path) -> dict[str, torch.Tensor]:
    """The user module's state dict, on CPU, in its own order (Lightning's), from the state dict of
    the model the strategy runs (behind wrappers: DDP's `module.`, a step runner's): the names are
    the ones the strategy saved in `parts` (model.safetensors' header), whose wrapper prefix is the
    one that turns them all into the live names."""
    with safe_open(str(parts / WEIGHTS), framework="pt") as f:
        saved = set(f.keys())
    cut = len(wrapper_prefix(list(live), saved))
    if {k[cut:] for k in live} == saved:
        return {k[cut:]: _on_cpu(v) for k, v in live.items()}
    raise ConfigError(
        f"the model's state dict ({len(live)} entries) does not match what the strategy saved "
        f"({len(saved)}) under any wrapper prefix: cannot write a checkpoint file."
    )


def _on_cpu(value: Any) -> Any:
    return value.detach().to("cpu") if isinstance(value, torch.Tensor) else value


def write(ckpt: dict, path: Path) -> None:
    """Writes `ckpt` at `path` atomically: to `.tmp-<name>` beside it, flushed to storage, then
    renamed over whatever `path` is (a file, a link, an older checkpoint directory)."""
    tmp = path.with_name(f".tmp-{path.name}")
    if tmp.is_dir():  # debris of a directory checkpoint's crashed save under that name
        shutil.rmtree(tmp)
    # Through a file object: torch names the archive's records after a path's stem, which a name
    # starting with "." does not have.
    with tmp.open("wb") as f:
        torch.save(ckpt, f)
        f.flush()
        os.fsync(f.fileno())
    if path.is_dir() and not path.is_symlink():  # a directory checkpoint of the same name
        old = path.with_name(f".old-{path.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, path)


def lightning_loops(loop: LoopState) -> dict:
    """Lightning's `loops` counters for the position `loop`, as Lightning writes them at the same
    point (at an epoch's end, inside its end hooks; mid-epoch, after a batch; before an epoch's
    first batch), so that Lightning's `fit(ckpt_path=...)` resumes there. Counts over the whole
    run use the global step: Lightning compares them with each other, not with the data."""
    e, b, step = loop.epoch, loop.batches_done, loop.global_step
    if loop.epoch_done:
        epochs, batches = _counts(e + 1, e + 1, e + 1, e), _counts(b, b, b, b)
        total = _counts(step, step, step, step)
    elif b:
        epochs, batches = _counts(e + 1, e + 1, e, e), _counts(b, b, b, b - 1)
        total = _counts(step, step, step, max(step - 1, 0))
    else:
        epochs, batches, total = _counts(e + 1, e, e, e), _counts(0, 0, 0, 0), _counts(0, 0, 0, 0)
    steps = {"total": {"ready": step, "completed": step}, "current": {"ready": b, "completed": b}}
    zero_grad = {
        "total": {"ready": step, "started": step, "completed": step},
        "current": {"ready": b, "started": b, "completed": b},
    }
    idle = {"current": _counts(0, 0, 0, 0), "total": _counts(0, 0, 0, 0)}
    fit = {
        "state_dict": {},
        "epoch_loop.state_dict": {"_batches_that_stepped": step},
        "epoch_loop.batch_progress": {
            "current": batches,
            "total": total,
            "is_last_batch": loop.epoch_done,
        },
        "epoch_loop.scheduler_progress": {
            "current": {"ready": 0, "completed": 0},
            "total": {"ready": 0, "completed": 0},
        },
        "epoch_loop.automatic_optimization.state_dict": {},
        "epoch_loop.automatic_optimization.optim_progress": {
            "optimizer": {"step": steps, "zero_grad": zero_grad}
        },
        "epoch_loop.manual_optimization.state_dict": {},
        "epoch_loop.manual_optimization.optim_step_progress": steps,
        "epoch_loop.val_loop.state_dict": {},
        "epoch_loop.val_loop.batch_progress": {**idle, "is_last_batch": False},
        "epoch_progress": {"current": epochs, "total": dict(epochs)},
    }
    evaluation = {"state_dict": {}, "batch_progress": {**idle, "is_last_batch": False}}
    return {
        "fit_loop": fit,
        "validate_loop": evaluation,
        "test_loop": dict(evaluation),
        "predict_loop": {"state_dict": {}, "batch_progress": idle},
    }


def _counts(ready: int, started: int, processed: int, completed: int) -> dict:
    return {"ready": ready, "started": started, "processed": processed, "completed": completed}


def _safe_rng(state: dict) -> dict:
    """An RNG state that loads with weights_only=True: NumPy's key array as a tensor."""
    name, keys, *rest = state["numpy"]
    return {**state, "numpy": (name, torch.from_numpy(np.asarray(keys, dtype=np.int64)), *rest)}


def _numpy_rng(state: dict) -> dict:
    name, keys, *rest = state["numpy"]
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy().astype(np.uint32)
    return {**state, "numpy": (name, keys, *rest)}


# ------------------------------------------------------------------------------------------- read
def read(path: Path) -> dict:
    """The dict in the checkpoint file `path` (tensors mapped from the file, on CPU). Raises
    ConfigError naming the file when it cannot be read or is not a checkpoint (no `state_dict`)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # truncated zip, bad pickle
        raise ConfigError(
            f"checkpoint file {path} is truncated or corrupt ({type(e).__name__}: {e})."
        ) from None
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(
            f"ckpt_path={str(path)!r} is not a lightspeed or Lightning checkpoint: torch.load "
            "reads it, but it holds no 'state_dict'."
        )
    return ckpt


def meta(ckpt: dict) -> dict:
    """What meta.json says of a checkpoint directory, for a file: who wrote it and where it is."""
    own = ckpt.get(KEY) or {}
    return {
        "format": "lightspeed-checkpoint" if own else "lightning-checkpoint",
        "strategy": own.get("strategy", f"Lightning {ckpt.get('pytorch-lightning_version', '?')}"),
        "world_size": own.get("world_size", 0),
        "global_step": ckpt.get("global_step", 0),
        "epoch": ckpt.get("epoch", 0),
        "files": {},
    }


def position(ckpt: dict) -> LoopState:
    """Where training resumes: lightspeed's exact position, else read from Lightning's `loops`
    counters as Lightning itself reads them (an epoch whose batches all ran resumes at the next
    epoch; mid-epoch, after the batches its counter says ran)."""
    if KEY in ckpt:
        return LoopState(**ckpt[KEY]["loop"])
    step = int(ckpt.get("global_step", 0))
    fit = (ckpt.get("loops") or {}).get("fit_loop")
    if not fit or "epoch_progress" not in fit:  # a Lightning 1.x file: its epoch ran to its end
        return LoopState(int(ckpt.get("epoch", 0)), step, 0, epoch_done=True)
    epochs = fit["epoch_progress"]["current"]
    started, processed = epochs["started"], epochs["processed"]
    if started == 0:
        return LoopState(0, step, 0, False)
    batches = fit.get("epoch_loop.batch_progress", {})
    done = batches.get("current", {}).get("ready", 0)
    epoch_done = processed >= started or bool(batches.get("is_last_batch"))
    return LoopState(started - 1, step, done, epoch_done)


def rng_of(ckpt: dict, rank: int, world_size: int) -> dict | None:
    """This rank's RNG state, on the world size that saved it; None otherwise (and for Lightning's
    files, which hold none)."""
    own = ckpt.get(KEY) or {}
    rngs = own.get("rng") or []
    if own.get("world_size") != world_size or rank >= len(rngs):
        return None
    return _numpy_rng(rngs[rank])


def precision_of(ckpt: dict) -> dict:
    own = ckpt.get(KEY) or {}
    if "precision" in own:
        return own["precision"]
    return {"scaler": ckpt[SCALER_KEY]} if ckpt.get(SCALER_KEY) else {}


def portable(
    ckpt: dict,
    path: Path,
    with_optimizer: bool,
    names: Callable[[list[dict]], list[list[str]]] | None = None,
) -> Portable:
    """The file's dict `ckpt` in the neutral form (neutral.py) that every strategy's `load` takes.
    `names(saved optimizer states)` gives each optimizer's parameter names in index order where
    the file does not record them (Lightning's files). Raises ConfigError when the optimizer state
    is needed and the file has none (saved with weights only) or cannot be named."""
    out: Portable = {
        "model": {canonical(k): v for k, v in ckpt["state_dict"].items()},
        "optim": {"state": {}, "param_groups": []},
    }
    if not with_optimizer:
        return out
    states = ckpt.get("optimizer_states")
    if states is None:
        raise ConfigError(
            f"checkpoint {path} has no optimizer_states (saved with weights only?): resuming needs "
            "the optimizer state. Load the weights alone with validate/test/predict(ckpt_path=...) "
            "or Module.load_from_checkpoint."
        )
    recorded = (ckpt.get(KEY) or {}).get("param_names")
    if recorded is None:
        if names is None:
            raise ConfigError(
                f"checkpoint {path} does not name its optimizers' parameters (Lightning wrote it): "
                "resume it with fit(ckpt_path=...), which names them from the running model."
            )
        recorded = names(states)
    out["optim"] = named_optimizer_state(states, recorded)
    if unknown := sorted(set(out["optim"]["state"]) - set(out["model"])):
        raise ConfigError(
            f"checkpoint {path}: its optimizer state names parameters its state_dict does not hold "
            f"({unknown[:3]}): the names of its optimizers' parameters do not fit its model."
        )
    out["precision"] = precision_of(ckpt)
    return out


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's state dict in the checkpoint file `path`."""
    return read(path)["state_dict"]
