"""Turn any lightspeed checkpoint into one fp32 state dict / safetensors file that loads into the
plain model.

    lightspeed convert CKPT OUT.safetensors

Each checkpoint format has one reader, chosen by the strategy recorded in meta.json:
  a .ckpt file (single, ddp, ddp_sharded, Lightning) -> its "state_dict" (already whole)
  single, ddp, ddp_sharded (older directories) -> model.safetensors as written
  deepspeed_*              -> strategies.deepspeed.full_state_dict (DeepSpeed's ZeRO shards merged
  to fp32) fsdp*                    -> strategies.fsdp.full_state_dict (torch.distributed.checkpoint
  shards merged)
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import cast

import torch

from lightspeed.checkpoint import single_file
from lightspeed.checkpoint.checkpointer import read_meta, resolve
from lightspeed.checkpoint.io import WEIGHTS, load_weights, save_weights


def full_state_dict(ckpt: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Reads a checkpoint directory (or its parent with `last`) into one fp32 state dict on CPU."""
    # (None only for "last" with nothing saved: read_meta then fails)
    path = cast(Path, resolve(ckpt, Path(ckpt)))
    strategy = read_meta(path)["strategy"]
    if strategy.startswith("deepspeed"):
        from lightspeed.strategies.deepspeed.shards import full_state_dict as read
    elif strategy.startswith("fsdp"):
        from lightspeed.strategies.fsdp import full_state_dict as read
    else:

        def read(path: Path) -> dict[str, torch.Tensor]:
            return single_file.weights(path) if path.is_file() else load_weights(path / WEIGHTS)

    # DeepSpeed's reader prints its progress; keep a conversion's output to the one line the caller
    # prints.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        state = read(path)
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def consolidate(ckpt: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Writes `full_state_dict(ckpt)` to `out` (.safetensors, else torch.save). Returns the output
    path.

    The file loads with `model.load_state_dict(..., strict=True)`: tied weights are stored under
    each name.
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = full_state_dict(ckpt)
    tmp = out.with_name(f".tmp-{out.name}")
    if out.suffix == ".safetensors":
        save_weights(state, tmp)
    else:
        torch.save(state, tmp)
    os.replace(tmp, out)
    return out
