"""Checkpoints: collective, atomic, resumable, convertible. `Checkpointer` owns the schema; nothing
else reads or writes the files below (ModelCheckpoint only decides when, and under which name).

A checkpoint is a directory:

    <name>/meta.json        written last: marks a complete lightspeed checkpoint (format, strategy,
                            world size, step) and records every file's size and CRC-32
    <name>/trainer.pt       the LoopState's fields, callback states, LR schedulers, the hooks'
                            on_save_checkpoint extras
    <name>/rng-rank<r>.pt   each rank's RNG states
    <name>/...              whatever the strategy writes: model.safetensors + optimizer.pt
                            (single, DDP), DeepSpeed's ZeRO shards, torch.distributed.checkpoint
                            shards (FSDP)

Any strategy resumes any other's checkpoint, on any world size: where the on-disk layouts differ,
`load` reads the checkpoint into a neutral form and the strategy writes that into its shards
(checkpoint/layouts.py).

Every rank calls `save` (DeepSpeed and DCP require it). The data goes to `.tmp-<name>` and is
renamed to `<name>` only when every rank has finished; the `last` symlink moves only after that
rename. A crash at any point leaves `last` pointing at a complete checkpoint. `resolve` checks a
checkpoint cheaply (sizes and file headers) on rank 0 only, before the load. Every load then checks
the CRC-32 of each file each rank is about to read (checkpoint/integrity.py), and every rank agrees
on the verdict before any state is loaded: a changed byte is a ConfigError naming the file, the two
checksums and the newest checkpoint beside it that is intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.checkpoint.integrity import (
    TRAINER_STATE,
    Mismatch,
    describe,
    files_read,
    first_mismatch,
    owned,
    sums,
    verify_files,
)
from lightspeed.checkpoint.layouts import layout, read_portable
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import barrier, broadcast_from_rank0
from lightspeed.runtime.rng import rng_state
from lightspeed.specs import LoopState

FORMAT = "lightspeed-checkpoint"
VERSION = 1
META = "meta.json"
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
        self.strategy, self.callbacks = strategy, callbacks
        self.rank, self.world_size = rank, world_size

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
            # the LoopState's fields at the top level, where hooks see them
            **dataclasses.asdict(loop),
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "schedulers": [s.scheduler.state_dict() for s in self.strategy.schedulers],
        }
        on_save(state)
        barrier()
        if self.rank == 0:
            torch.save(state, tmp / TRAINER_STATE)
        # Size and CRC-32 of every file, each rank reading back the files it wrote (its shards; rank
        # 0 the shared ones) at once: a full read of the checkpoint, split across the ranks.
        names = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        mine = sums(tmp, [n for n in owned(names, self.rank, self.world_size) if n != META])
        files = {k: v for part in _gather(mine) for k, v in part.items()}
        if self.rank == 0:
            meta = {
                "format": FORMAT,
                "version": VERSION,
                "strategy": self.strategy.name,
                "world_size": self.world_size,
                "global_step": loop.global_step,
                "epoch": loop.epoch,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "files": dict(sorted(files.items())),
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
        (`_read_portable`); one line on rank 0 says what was carried over and what was not. Raises
        ConfigError on every rank when a file any rank read differs from its recorded checksum."""
        meta = self._meta(path)
        self._check(path, meta, with_optimizer, loop_state=True)
        self._load_strategy(path, meta, with_optimizer)
        state = _torch_load(path / TRAINER_STATE)
        rng_file = path / f"rng-rank{self.rank}.pt"
        # rank r's random stream means nothing on another world size
        same_ranks = meta.get("world_size") == self.world_size
        rng = _torch_load(rng_file) if same_ranks and rng_file.exists() else None
        for cb in self.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        for sched, sd in zip(self.strategy.schedulers, state["schedulers"]):
            sched.scheduler.load_state_dict(sd)
        loop = LoopState(**{f.name: state[f.name] for f in dataclasses.fields(LoopState)})
        return loop, state, rng

    def load_strategy(self, path: Path, with_optimizer: bool = False) -> dict:
        """Collective. Loads the model (and with `with_optimizer` the optimizer state) from `path`
        into the set-up strategy, natively or through the neutral form; what evaluation with
        `ckpt_path` needs. Returns meta.json. Raises ConfigError naming the checkpoint (and the file
        at fault, where one is) when it cannot be loaded or a file differs from its checksum."""
        meta = self._meta(path)
        self._check(path, meta, with_optimizer, loop_state=False)
        self._load_strategy(path, meta, with_optimizer)
        return meta

    def _meta(self, path: Path) -> dict:
        # Rank 0's meta.json decides native or neutral for every rank: a per-rank read that differed
        # (a node's stale view of shared storage) would leave some ranks in the broadcast below and
        # others not.
        return broadcast_from_rank0(read_meta(path) if self.rank == 0 else None)

    def _check(self, path: Path, meta: dict, with_optimizer: bool, loop_state: bool) -> None:
        """Collective. Each rank checks the checksums of the files it is about to read; when any
        rank found a changed byte, every rank raises the same ConfigError (the first such rank's
        file), naming the newest intact checkpoint beside it. Nothing is loaded before."""
        native = self._is_native(meta)
        names = files_read(meta, self.rank, self.world_size, native, with_optimizer, loop_state)
        found: list[Mismatch | None] = _gather(first_mismatch(path, meta, names, self.rank))
        first = next((m for m in found if m is not None), None)
        if first is None:
            return
        intact = broadcast_from_rank0(_last_intact(path) if self.rank == 0 else None)
        raise ConfigError(describe(path, first) + _intact_sentence(path, intact))

    def _is_native(self, meta: dict) -> bool:
        saved, ranks = meta.get("strategy", "?"), meta.get("world_size", 0)
        return layout(saved, ranks) == layout(self.strategy.name, self.world_size)

    def _load_strategy(self, path: Path, meta: dict, with_optimizer: bool) -> None:
        portable = self._read_portable(path, meta, with_optimizer)
        self._say_what_travels(meta, with_optimizer)
        try:
            self.strategy.load(path, with_optimizer=with_optimizer, portable=portable)
        except (ConfigError, KeyboardInterrupt, SystemExit):
            raise
        # DeepSpeed's bare AssertionError, DCP's CheckpointException (a BaseException)
        except BaseException as e:
            raise ConfigError(
                f"checkpoint {path} could not be loaded by {self.strategy.name}: "
                f"{_culprit(path, e)}"
            ) from e

    def _read_portable(self, path: Path, meta: dict, with_optimizer: bool) -> dict | None:
        """None when this strategy reads `path` natively (same on-disk layout); else the checkpoint
        in the neutral form, read by rank 0 and broadcast (every rank then holds the whole model and
        optimizer state on CPU for the moment of the load: the price of not needing a shared
        temporary directory). Collective."""
        if self._is_native(meta):
            return None
        saved, ranks = meta.get("strategy", "?"), meta.get("world_size", 0)
        found: Any = None
        if self.rank == 0:
            try:
                found = read_portable(path, saved, with_optimizer)
            # noqa: BLE001 - every rank must learn of it, or the others wait forever
            except Exception as e:
                if isinstance(e, ConfigError):
                    found = e
                else:
                    found = ConfigError(
                        f"checkpoint {path} ({saved} on {ranks} ranks) could not be read for "
                        f"{self.strategy.name}: {type(e).__name__}: {e}"
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
    if found := first_mismatch(path, meta, list(meta.get("files") or {}), rank=None):
        raise ConfigError(describe(path, found))


def _last_intact(path: Path) -> Path | None:
    """The newest other checkpoint in `path`'s folder whose every file matches its checksum (by
    global step, then save time), or None. Reads each candidate whole, newest first, until one
    passes: only on the error path."""
    here, candidates = path.resolve(), []
    for d in path.parent.iterdir():
        if d.is_symlink() or d.name.startswith((".tmp-", ".old-")) or d.resolve() == here:
            continue
        try:
            meta = read_meta(d)
        except ConfigError:
            continue
        candidates.append((meta.get("global_step", -1), meta.get("saved_at", ""), d.name, d))
    for *_, d in sorted(candidates, reverse=True):
        try:
            verify(d, full=True)
        except ConfigError:
            continue
        return d
    return None


def _intact_sentence(path: Path, intact: Path | None) -> str:
    if intact is None:
        return f" No other checkpoint in {path.parent} is intact."
    return (
        f" The newest intact checkpoint in {path.parent} is {intact.name}: resume with "
        f"ckpt_path={str(intact)!r}."
    )


def _with_intact(path: Path, message: str) -> str:
    """`message` and the newest intact checkpoint beside `path` (this rank alone looks)."""
    return message + _intact_sentence(path, _last_intact(path))


def _culprit(path: Path, error: BaseException) -> str:
    """What to tell the user when an engine fails on a checkpoint: the file at fault if a full check
    finds one (the load's own check covers the files it read; an engine may read more)."""
    try:
        verify(path, full=True)
    except ConfigError as found:
        return _with_intact(path, str(found))
    if missing := getattr(error, "filename", None):
        return f"file {missing} is missing ({type(error).__name__})."
    return (
        f"{type(error).__name__}: {error}. Its files match their recorded checksums: was it "
        "written by another strategy, world size or model?"
    )


def _gather(value: Any) -> list:
    """Every rank's `value` (picklable), in rank order. Collective; [value] without a group."""
    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _torch_load(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint is incomplete: {file} is missing.") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:  # truncated zip, bad pickle
        raise ConfigError(
            f"checkpoint file {file} is truncated or corrupt ({type(e).__name__}: {e})."
        ) from None
