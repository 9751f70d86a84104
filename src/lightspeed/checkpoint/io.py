"""File formats shared by the torch-native strategies: weights as safetensors, everything else with
torch.save."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import torch
from safetensors.torch import load_file, save_file

from lightspeed.errors import ConfigError

WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.pt"
# The other strategies' parts of a checkpoint directory (named here so that the readers of
# strategies/portable.py
# share them with the writers).
DCP_DIR = "dcp"  # FSDP: the torch.distributed.checkpoint shards
FSDP_EXTRA = "fsdp_extra.pt"  # FSDP: rank 0's small non-tensor state (the fp16 loss scaler)
DEEPSPEED_DIR = "deepspeed"  # DeepSpeed: its own checkpoint, saved under this tag


def full_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict safetensors accepts: contiguous CPU tensors, tied weights stored as separate
    copies (so the file loads with `load_state_dict(strict=True)` into the plain model, tied keys
    included)."""
    out, seen = {}, set()
    for key, t in state.items():
        t = t.detach()
        if hasattr(t, "full_tensor"):  # a DTensor
            t = cast(Any, t).full_tensor()
        t = t.to("cpu")
        ptr = (
            (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if t.numel()
            else None
        )
        out[key] = t.clone().contiguous() if ptr in seen or not t.is_contiguous() else t
        if ptr is not None:
            seen.add(ptr)
    return out


def save_weights(state: dict[str, torch.Tensor], path: Path) -> None:
    save_file(full_tensors(state), str(path))


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def save_replicated(
    path: Path, model: torch.nn.Module, optimizers: list, extra: dict | None = None
) -> None:
    """Rank 0 writes the replicated model and optimizer state (single device, DDP). `extra` (the
    precision state, the optimizers' parameter names) goes into the optimizer file beside the
    optimizers' state dicts."""
    save_weights(model.state_dict(), path / WEIGHTS)
    torch.save(
        {"optimizers": [o.state_dict() for o in optimizers], **(extra or {})}, path / OPTIMIZER
    )


def load_replicated(
    path: Path, model: torch.nn.Module, optimizers: list, with_optimizer: bool
) -> dict:
    model.load_state_dict(load_weights(path / WEIGHTS))
    if not with_optimizer:
        return {}
    if not (path / OPTIMIZER).exists():  # never a silent fresh optimizer
        raise ConfigError(
            f"checkpoint {path} has no {OPTIMIZER}: resuming needs the optimizer state. Load the "
            "weights alone with validate/test/predict(ckpt_path=...), or restore the file."
        )
    state = torch.load(path / OPTIMIZER, map_location="cpu", weights_only=False)
    for opt, sd in zip(optimizers, state["optimizers"]):
        opt.load_state_dict(sd)
    return state
