"""Checkpoints: collective, atomic, resumable, convertible.

A checkpoint is a directory:

    <name>/meta.json          written last: marks a complete lightspeed checkpoint (format, strategy, world size)
    <name>/trainer.pt         loop progress, callback states, LR schedulers, the module's on_save_checkpoint extras
    <name>/rng-rank<r>.pt     each rank's RNG states
    <name>/...                whatever the strategy writes: model.safetensors + optimizer.pt (single, DDP),
                              DeepSpeed's ZeRO shards, torch.distributed.checkpoint shards (FSDP)

Every rank calls `save_checkpoint` (DeepSpeed and DCP require it). The data goes to `.tmp-<name>` and is renamed
to `<name>` only when every rank has finished; the `last` symlink moves only after that rename. A crash at any
point leaves `last` pointing at a complete checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ConfigError
from .strategies.common import barrier

FORMAT = "lightspeed-checkpoint"
VERSION = 1
META = "meta.json"
TRAINER_STATE = "trainer.pt"
LAST = "last"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(path: str | os.PathLike, strategy, trainer_state: dict, rank: int, world_size: int) -> Path:
    """Collective. Writes a complete checkpoint at `path` atomically and points `<dir>/last` at it."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash
        tmp.mkdir(parents=True)
    barrier()
    strategy.save(tmp)
    torch.save(rng_state(), tmp / f"rng-rank{rank}.pt")
    barrier()
    if rank == 0:
        torch.save(trainer_state, tmp / TRAINER_STATE)
        meta = {"format": FORMAT, "version": VERSION, "strategy": strategy.name, "world_size": world_size,
                "global_step": trainer_state.get("global_step"), "epoch": trainer_state.get("epoch"),
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / META).write_text(json.dumps(meta, indent=1))
        _replace_dir(tmp, path)
        _point_last(path)
    barrier()
    return path


def _replace_dir(src: Path, dst: Path) -> None:
    if dst.exists():
        old = dst.with_name(f".old-{dst.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def _point_last(path: Path) -> None:
    link = path.parent / LAST
    tmp_link = path.parent / f".tmp-{LAST}-{os.getpid()}"
    if tmp_link.is_symlink() or tmp_link.exists():
        tmp_link.unlink()
    tmp_link.symlink_to(path.name)
    os.replace(tmp_link, link)  # atomic: readers see the old target or the new one, never neither


def resolve(ckpt_path: str | os.PathLike, default_dir: Path) -> Path:
    """Turns `ckpt_path` ("last" or a path) into a checkpoint directory; raises ConfigError if it is not one."""
    if str(ckpt_path) == "last":
        path = default_dir / LAST
        if not path.exists():
            raise ConfigError(f"ckpt_path='last' is not valid: no checkpoint at {path} (nothing saved yet).")
    else:
        path = Path(ckpt_path)
        if path.is_dir() and not (path / META).exists() and (path / LAST).exists():
            path = path / LAST  # a checkpoint folder given: take its newest
        if not path.exists():
            raise ConfigError(f"ckpt_path={str(ckpt_path)!r} is not valid: the path does not exist.")
    path = path.resolve()
    read_meta(path)
    verify_files(path)
    return path


def verify_files(path: Path) -> None:
    """Cheap integrity check of every file in a checkpoint (zip directories, safetensors headers), so a
    truncated file is reported before any rank starts rather than deep inside a load."""
    import zipfile

    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        try:
            if file.suffix in (".pt", ".pth", ".bin") and zipfile.is_zipfile(file):
                with zipfile.ZipFile(file) as z:
                    bad = z.testzip()
                if bad is not None:
                    raise ValueError(f"member {bad} fails its CRC")
            elif file.suffix in (".pt", ".pth"):
                raise ValueError("not a torch zip archive")
            elif file.suffix == ".safetensors":
                _check_safetensors_size(file)
        except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
            raise ConfigError(f"checkpoint file {file} is truncated or corrupt ({e}).") from None


def read_meta(path: Path) -> dict:
    """Validates a checkpoint directory and returns its meta.json; ConfigError if it is not a complete one."""
    meta_file = path / META
    if not path.is_dir() or not meta_file.exists():
        raise ConfigError(f"ckpt_path={str(path)!r} is not a lightspeed checkpoint: expected a directory with "
                          f"{META} (an unfinished save never has one).")
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"ckpt_path={str(path)!r} is corrupt: {META} is not valid JSON ({e}).") from None
    if meta.get("format") != FORMAT:
        raise ConfigError(f"ckpt_path={str(path)!r} is not a lightspeed checkpoint (format={meta.get('format')!r}).")
    return meta


def _check_safetensors_size(file: Path) -> None:
    # Layout: 8-byte little-endian header length, JSON header with each tensor's data offsets, then the data.
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if file.stat().st_size < 8 + n + end:
        raise ValueError(f"{file.stat().st_size} bytes, the header promises {8 + n + end}")


def load_trainer_state(path: Path, rank: int) -> tuple[dict, dict | None]:
    """Returns (trainer state, this rank's RNG state or rank 0's, if the world size changed)."""
    state = _torch_load(path / TRAINER_STATE)
    rng_file = path / f"rng-rank{rank}.pt"
    rng = _torch_load(rng_file) if rng_file.exists() else None
    return state, rng


def _torch_load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint is incomplete: {file} is missing.") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # truncated zip, bad pickle
        raise ConfigError(f"checkpoint file {file} is truncated or corrupt ({type(e).__name__}: {e}).") from None
