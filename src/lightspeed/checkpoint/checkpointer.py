"""Checkpoints: collective, atomic, resumable, convertible. `Checkpointer` owns the schema; nothing
else reads or writes the files below (ModelCheckpoint only decides when, and under which name).

A checkpoint is a directory:

    <name>/meta.json          written last: marks a complete lightspeed checkpoint (format,
    strategy, world size) <name>/trainer.pt         the LoopState's fields, callback states, LR
    schedulers, the hooks' on_save_checkpoint extras <name>/rng-rank<r>.pt     each rank's RNG
    states <name>/...                whatever the strategy writes: model.safetensors + optimizer.pt
    (single, DDP),
                              DeepSpeed's ZeRO shards, torch.distributed.checkpoint shards (FSDP)

Any strategy resumes any other's checkpoint, on any world size: where the on-disk layouts differ,
`load` reads the checkpoint into a neutral form and the strategy writes that into its shards
(strategies/portable.py).

Every rank calls `save` (DeepSpeed and DCP require it). The data goes to `.tmp-<name>` and is
renamed to `<name>` only when every rank has finished; the `last` symlink moves only after that
rename. A crash at any point leaves `last` pointing at a complete checkpoint. `resolve` checks a
checkpoint cheaply (sizes and file headers, not full reads) on rank 0 only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightspeed.checkpoint.layouts import layout, read_portable
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import barrier, broadcast_from_rank0
from lightspeed.runtime.rng import rng_state
from lightspeed.specs import LoopState

FORMAT = "lightspeed-checkpoint"
VERSION = 1
META = "meta.json"
TRAINER_STATE = "trainer.pt"
LAST = "last"


class Checkpointer:
    """Writes and reads lightspeed checkpoints for one strategy, with the stateful parts the loop
    hands it.

    Args:
        strategy: the set-up strategy (model and optimizer state, saved and loaded collectively).
        callbacks: objects with `state_key`, `state_dict()` and `load_state_dict()`.
        rank, world_size: this process's place (from the launch step).
    """

    def __init__(self, strategy: Any, callbacks: list[Any], rank: int, world_size: int):
        self.strategy, self.callbacks, self.rank, self.world_size = (
            strategy,
            callbacks,
            rank,
            world_size,
        )

    def save(
        self, path: str | os.PathLike, loop: LoopState, on_save: Callable[[dict], None]
    ) -> Path:
        """Collective. Writes a complete checkpoint at `path` atomically and points `<dir>/last` at
        it. `on_save(state)` runs the module's and callbacks' `on_save_checkpoint` hooks on the
        state before it is written (rank 0's values are the ones saved)."""
        path = Path(path)
        tmp = path.with_name(f".tmp-{path.name}")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # debris of an earlier crash
            tmp.mkdir(parents=True)
        barrier()
        self.strategy.save(tmp)
        torch.save(rng_state(), tmp / f"rng-rank{self.rank}.pt")
        state = {
            **dataclasses.asdict(
                loop
            ),  # the LoopState's fields at the top level, where hooks see them
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "schedulers": [s.scheduler.state_dict() for s in self.strategy.schedulers],
        }
        on_save(state)
        barrier()
        if self.rank == 0:
            torch.save(state, tmp / TRAINER_STATE)
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "strategy": self.strategy.name,
                "world_size": self.world_size,
                "global_step": loop.global_step,
                "epoch": loop.epoch,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                # Size and CRC-32 of every file, read back by rank 0 once all ranks wrote theirs (a
                # full read of
                # the checkpoint at save time; loading checks sizes only, `verify(full=True)` the
                # checksums).
                "files": {
                    str(f.relative_to(tmp)): {"size": f.stat().st_size, "crc32": crc32(f)}
                    for f in sorted(tmp.rglob("*"))
                    if f.is_file()
                },
            }
            (tmp / META).write_text(json.dumps(meta, indent=1))
            _replace_dir(tmp, path)
            _point_last(path)
        barrier()
        return path

    def load(self, path: Path, with_optimizer: bool = True) -> tuple[LoopState, dict, dict | None]:
        """Collective. Restores the strategy, schedulers and callbacks from `path`; returns (the
        loop state, the saved state dict for the `on_load_checkpoint` hooks, this rank's RNG state
        or None on another world size). The caller restores the RNG at the point the loop reaches
        the saved position.

        A checkpoint another strategy or world size wrote travels through the neutral form
        (`_read_portable`); one line on rank 0 says what was carried over and what was not."""
        meta = self.load_strategy(path, with_optimizer)
        state = _torch_load(path / TRAINER_STATE)
        for cb in self.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        for sched, sd in zip(self.strategy.schedulers, state["schedulers"]):
            sched.scheduler.load_state_dict(sd)
        rng_file = path / f"rng-rank{self.rank}.pt"
        loop = LoopState(**{f.name: state[f.name] for f in dataclasses.fields(LoopState)})
        same_ranks = (
            meta.get("world_size") == self.world_size
        )  # rank r's random stream means nothing on another
        return loop, state, _torch_load(rng_file) if same_ranks and rng_file.exists() else None

    def load_strategy(self, path: Path, with_optimizer: bool = False) -> dict:
        """Collective. Loads the model (and with `with_optimizer` the optimizer state) from `path`
        into the set-up strategy, natively or through the neutral form; what evaluation with
        `ckpt_path` needs. Returns meta.json. Raises ConfigError naming the checkpoint (and the file
        at fault, where one is) when it cannot be loaded."""
        # Rank 0's meta.json decides native or neutral for every rank: a per-rank read that differed
        # (a node's
        # stale view of shared storage) would leave some ranks in the broadcast below and others
        # not.
        meta = broadcast_from_rank0(read_meta(path) if self.rank == 0 else None)
        portable = self._read_portable(path, meta, with_optimizer)
        self._say_what_travels(meta, with_optimizer)
        try:
            self.strategy.load(path, with_optimizer=with_optimizer, portable=portable)
        except (ConfigError, KeyboardInterrupt, SystemExit):
            raise
        except (
            BaseException
        ) as e:  # DeepSpeed's bare AssertionError, DCP's CheckpointException (a BaseException)
            raise ConfigError(
                f"checkpoint {path} could not be loaded by {self.strategy.name}: "
                f"{_culprit(path, e)}"
            ) from e
        return meta

    def _read_portable(self, path: Path, meta: dict, with_optimizer: bool) -> dict | None:
        """None when this strategy reads `path` natively (same on-disk layout); else the checkpoint
        in the neutral form, read by rank 0 and broadcast (every rank then holds the whole model and
        optimizer state on CPU for the moment of the load: the price of not needing a shared
        temporary directory). Collective."""
        saved, ranks = meta.get("strategy", "?"), meta.get("world_size", 0)
        if layout(saved, ranks) == layout(self.strategy.name, self.world_size):
            return None
        found: Any = None
        if self.rank == 0:
            try:
                found = read_portable(path, saved, with_optimizer)
            # noqa: BLE001 - every rank must learn of it, or the others wait forever
            except Exception as e:
                found = (
                    e
                    if isinstance(e, ConfigError)
                    else ConfigError(
                        f"checkpoint {path} ({saved} on {ranks} ranks) could not be read for "
                        f"{self.strategy.name}: "
                        f"{type(e).__name__}: {e}"
                    )
                )
        found = broadcast_from_rank0(found)
        if isinstance(found, ConfigError):
            raise found
        return found

    def _say_what_travels(self, meta: dict, with_optimizer: bool) -> None:
        saved, ranks = meta.get("strategy", "?"), meta.get("world_size", 0)
        if self.rank != 0 or (saved, ranks) == (self.strategy.name, self.world_size):
            return
        same = ranks == self.world_size
        print(
            f"{'Resuming' if with_optimizer else 'Loading'} a {saved} checkpoint from {ranks} "
            f"rank{'s' * (ranks != 1)} under {self.strategy.name} on "
            f"{self.world_size} rank{'s' * (self.world_size != 1)}: carried weights"
            + (
                ", optimizer state, LR schedulers, loop state (epoch, global "
                f"step){', RNG states' if same else ''}"
                "; not carried: "
                + (
                    "nothing."
                    if same
                    else "RNG states and the data order (on another world "
                    "size each rank's share of the data and its random stream differ)."
                )
                if with_optimizer
                else "."
            ),
            flush=True,
        )


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


def unused_name(path: Path) -> Path:
    """`path`, or `path-vN` with the first N that is free: a run never overwrites an earlier run's
    checkpoint."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-v{n}")
    return candidate


def resolve(
    ckpt_path: str | os.PathLike, directory: Path, best: str | None = None, verify: bool = True
) -> Path | None:
    """Turns `ckpt_path` ("last", "best" or a path) into a complete checkpoint directory.

    "last" is `<directory>/last`; with nothing saved there yet it warns and returns None (a fresh
    start: what a requeued job killed before its first save needs). "best" is the checkpoint
    callback's best model (`best`). With `verify` the checkpoint's files are checked cheaply: sizes
    against meta.json and file headers (run it on rank 0 only). Raises ConfigError naming the path
    when it is not a complete, intact checkpoint."""
    if str(ckpt_path) == "best":
        if not best:
            raise ConfigError(
                "ckpt_path='best' is not valid: no best checkpoint is known yet (fit with a "
                "ModelCheckpoint first, or pass a path)."
            )
        path = Path(best)
    elif str(ckpt_path) == "last":
        path = directory / LAST
        if path.is_symlink() and not path.exists():
            path = _recover_last(path)
        if not path.exists():
            if verify:
                warnings.warn(
                    f"ckpt_path='last': nothing saved in {directory} yet; starting from scratch.",
                    stacklevel=3,
                )
            return None
    else:
        path = Path(ckpt_path)
        if path.is_dir() and not (path / META).exists() and (path / LAST).exists():
            path = path / LAST  # a checkpoint folder given: take its newest
        if not path.exists():
            raise ConfigError(
                f"ckpt_path={str(ckpt_path)!r} is not valid: the path does not exist."
            )
    path = path.resolve()
    meta = read_meta(path)
    if verify:
        verify_files(path, meta)
    return path


def _recover_last(link: Path) -> Path:
    """`last` dangles only when a save that reuses a name was killed between `_replace_dir`'s two
    renames: the new checkpoint is then complete at `.tmp-<name>` (meta.json is written last) or the
    old one at `.old-<name>`."""
    target = os.readlink(link)
    for candidate in (link.parent / f".tmp-{target}", link.parent / f".old-{target}"):
        if (candidate / META).exists():
            warnings.warn(
                f"{link} points to {target!r}, which a save killed mid-rename left at "
                f"{candidate.name}; "
                "resuming from there.",
                stacklevel=4,
            )
            return candidate
    raise ConfigError(
        f"ckpt_path='last' is not valid: {link} points to {target!r}, which does not exist (was it "
        "moved or deleted?)."
    )


def read_meta(path: Path) -> dict:
    """Validates a checkpoint directory and returns its meta.json; ConfigError if it is not a
    complete one."""
    meta_file = path / META
    if not path.is_dir() or not meta_file.exists():
        raise ConfigError(
            f"ckpt_path={str(path)!r} is not a lightspeed checkpoint: expected a directory with "
            f"{META} (an unfinished save never has one)."
        )
    try:
        meta = json.loads(meta_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(
            f"ckpt_path={str(path)!r} is corrupt: {META} is not valid JSON ({e})."
        ) from None
    if meta.get("format") != FORMAT:
        raise ConfigError(
            f"ckpt_path={str(path)!r} is not a lightspeed checkpoint "
            f"(format={meta.get('format')!r})."
        )
    return meta


def verify_files(path: Path, meta: dict) -> None:
    """Cheap integrity check: every file meta.json lists is there with its size, torch files open as
    zip archives (the central directory, not a CRC pass over the data), safetensors headers promise
    no more than the file holds. A truncated or missing file is reported before any rank starts
    rather than deep inside a load."""
    listed = meta.get("files")
    files = (
        [path / name for name in listed]
        if listed
        else sorted(p for p in path.rglob("*") if p.is_file())
    )
    for file in files:
        try:
            if not file.exists():
                raise ValueError("missing")
            entry = listed[str(file.relative_to(path))] if listed else None
            size = (
                entry["size"] if isinstance(entry, dict) else entry
            )  # a bare size: before checksums
            if size is not None and file.stat().st_size != size:
                raise ValueError(f"{file.stat().st_size} bytes, written with {size}")
            if file.suffix in (".pt", ".pth"):
                zipfile.ZipFile(
                    file
                ).close()  # reads the central directory at the end: truncation shows here
            elif file.suffix == ".safetensors":
                _check_safetensors_size(file)
        except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
            raise ConfigError(f"checkpoint file {file} is truncated or corrupt ({e}).") from None


def crc32(file: Path, chunk: int = 1 << 22) -> int:
    """The zlib CRC-32 of a file's bytes, read in 4 MiB chunks."""
    value = 0
    with file.open("rb") as f:
        while block := f.read(chunk):
            value = zlib.crc32(block, value)
    return value


def verify(path: str | os.PathLike, full: bool = True) -> None:
    """Checks a checkpoint directory: meta.json, every listed file present with its size and header,
    and with `full` each file's CRC-32 against the one written at save time (reads every byte).
    Raises ConfigError naming the file that is wrong; returns None when the checkpoint is intact.
    Checkpoints written before checksums were recorded are checked for sizes and headers only."""
    path = Path(path)
    meta = read_meta(path)
    verify_files(path, meta)
    if not full:
        return
    for name, entry in (meta.get("files") or {}).items():
        if isinstance(entry, dict) and "crc32" in entry and crc32(path / name) != entry["crc32"]:
            raise ConfigError(
                f"checkpoint file {path / name} is corrupt: its CRC-32 differs from the one "
                "recorded "
                "when it was written."
            )


def _culprit(path: Path, error: Exception) -> str:
    """What to tell the user when an engine fails on a checkpoint: the file at fault if a check
    finds one."""
    try:
        verify(path, full=True)
    except ConfigError as found:
        return str(found)
    if missing := getattr(error, "filename", None):
        return f"file {missing} is missing ({type(error).__name__})."
    return (
        f"{type(error).__name__}: {error}. Its files match their recorded checksums: was it "
        "written "
        "by "
        "another strategy, world size or model?"
    )


def _check_safetensors_size(file: Path) -> None:
    # Layout: 8-byte little-endian header length, JSON header with each tensor's data offsets, then
    # the data.
    with file.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        n = int.from_bytes(head, "little")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if file.stat().st_size < 8 + n + end:
        raise ValueError(f"{file.stat().st_size} bytes, the header promises {8 + n + end}")


def _torch_load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint is incomplete: {file} is missing.") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # truncated zip, bad pickle
        raise ConfigError(
            f"checkpoint file {file} is truncated or corrupt ({type(e).__name__}: {e})."
        ) from None
