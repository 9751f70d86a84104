"""Checkpoints: collective, atomic, resumable, convertible. `Checkpointer` owns the schema; nothing
else reads or writes the files below (ModelCheckpoint only decides when, and under which name).

Where Lightning writes one file, so does lightspeed: the replicated strategies (single device, DDP,
ZeRO-1) write Lightning's `.ckpt`, the dict `torch.load` reads (single_file.py). The sharded ones
write a directory, as Lightning's DeepSpeed and FSDP do:

    <name>/meta.json        written last: marks a complete lightspeed checkpoint (format, strategy,
                            world size, step) and records every file's size and xxh3_64
    <name>/trainer.pt       the LoopState's fields, callback states, LR schedulers, the hooks'
                            on_save_checkpoint extras
    <name>/rng-rank<r>.pt   each rank's RNG states
    <name>/...              whatever the strategy writes: DeepSpeed's ZeRO shards,
                            torch.distributed.checkpoint shards (FSDP)

Any strategy resumes any other's checkpoint, on any world size, and a `.ckpt` Lightning wrote:
where the on-disk layouts differ, `load` reads the checkpoint into a neutral form and the strategy
writes that into its shards (checkpoint/layouts.py; a file always travels that way).

Every rank calls `save` (DeepSpeed and DCP require it). A directory's data goes to `.tmp-<name>`
and is renamed to `<name>` only when every rank has finished; a file is written by rank 0 from what
the strategy wrote into `.parts-<name>`, to `.tmp-<name>`, then renamed. `last.ckpt` (a symlink)
moves only after that rename: a crash at any point leaves it on a complete checkpoint. `resolve`
(locate.py) checks a checkpoint cheaply (sizes and file headers) on rank 0 only, before the load.
Every load then checks the checksum of each file each rank reads (checkpoint/integrity.py: xxh3_64,
or the CRC-32 older checkpoints and a file's zip records carry): what an engine parses (small files,
the pickle records) before the load, with every rank agreeing on the verdict; the bulk, tensor
bytes, on a thread beside the load. `settle()` waits for that verdict and shares it; `save` calls
it first, and the Trainer at the end of fit, so a checkpoint with a changed byte never leads to a
saved checkpoint or a finished fit. A changed byte is a ConfigError naming the file, the two
checksums and the newest checkpoint beside it that is intact.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.checkpoint import single_file
from lightspeed.checkpoint.integrity import (
    TRAINER_STATE,
    Mismatch,
    Verification,
    describe,
    files_read,
    first_mismatch,
    is_structure,
    owned,
    split,
    structure_mismatch,
    sums,
    zip_mismatch,
)
from lightspeed.checkpoint.layouts import layout, read_portable, writes_file
from lightspeed.checkpoint.locate import (
    FORMAT,
    LAST,
    META,
    intact_sentence,
    last_intact,
    read_meta,
    resolve,
    unused_name,
    verify,
    with_intact,
)
from lightspeed.checkpoint.neutral import names_by_identity
from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import barrier, broadcast_from_rank0
from lightspeed.runtime.rng import rng_state
from lightspeed.specs import LoopState

__all__ = [  # where the rest of lightspeed finds them
    "LAST",
    "META",
    "TRAINER_STATE",
    "Checkpointer",
    "read_meta",
    "resolve",
    "unused_name",
    "verify",
]
VERSION = 1


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
        # The checksum pass the last load left running beside it (integrity.Verification), with
        # the checkpoint's path; `settle` waits for it.
        self.pending: tuple[Path, Verification] | None = None

    def save(
        self, path: str | os.PathLike, loop: LoopState, on_save: Callable[[dict], None]
    ) -> Path:
        """Collective. Writes a complete checkpoint at `path` atomically (one file under the
        replicated strategies, else a directory) and points `<dir>/last.ckpt` at it.
        `on_save(state)` runs the module's and callbacks' `on_save_checkpoint` hooks on the state
        before it is written (rank 0's values are the ones saved). Raises ConfigError, writing
        nothing, when the checkpoint the run resumed from turns out to be corrupt (`settle`)."""
        self.settle()
        path = Path(path)
        if writes_file(self.strategy.name, self.world_size):
            self._save_file(path, loop, on_save)
        else:
            self._save_dir(path, loop, on_save)
        return path

    def _save_file(self, path: Path, loop: LoopState, on_save: Callable[[dict], None]) -> None:
        parts = path.with_name(f".parts-{path.name}")
        if self.rank == 0:
            shutil.rmtree(parts, ignore_errors=True)  # debris of an earlier crash
            parts.mkdir(parents=True)
        barrier()
        self.strategy.save(parts)
        rngs = _gather(rng_state())
        barrier()
        # The model is whole on every rank: its state dict in the module's order (Lightning's), on
        # CPU, named as the strategy saved it. Every rank's hooks see the whole dict; rank 0's is
        # written.
        weights = single_file.module_state(self.strategy.model.state_dict(), parts)
        state = {
            "callbacks": {cb.state_key: cb.state_dict() for cb in self.callbacks},
            "lr_schedulers": [s.scheduler.state_dict() for s in self.strategy.schedulers],
        }
        ckpt = single_file.build(
            parts, weights, loop, state, rngs, self.strategy.name, self.world_size
        )
        on_save(ckpt)
        barrier()
        if self.rank == 0:
            single_file.write(ckpt, path)
            shutil.rmtree(parts, ignore_errors=True)
            if path.name != LAST:  # saved as `last.ckpt` itself: the newest, kept only as that
                _point_last(path)
        barrier()

    def _save_dir(self, path: Path, loop: LoopState, on_save: Callable[[dict], None]) -> None:
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
        # Size and xxh3_64 of every file, each rank reading back the files it wrote (its shards;
        # rank 0 the shared ones) at once: a full read of the checkpoint, split across the ranks.
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

    def load(self, path: Path, with_optimizer: bool = True) -> tuple[LoopState, dict, dict | None]:
        """Collective. Restores the strategy, schedulers and callbacks from `path`; returns (the
        loop state, the saved state dict for the `on_load_checkpoint` hooks, this rank's RNG state
        or None on another world size). The caller restores the RNG at the point the loop reaches
        the saved position.

        A checkpoint another strategy or world size wrote travels through the neutral form
        (`_read_portable`); one line on rank 0 says what was carried over and what was not. Raises
        ConfigError on every rank when a file any rank read differs from its recorded checksum:
        here for what engines parse, at `settle` for tensor bytes (checked beside the load)."""
        self.settle()  # an earlier load's verdict (the tuner restores after its trials)
        if path.is_file():
            ckpt, _ = self._load_file(path, with_optimizer)
            self._restore_trainer_state(ckpt.get("callbacks", {}), ckpt.get("lr_schedulers", []))
            rng = single_file.rng_of(ckpt, self.rank, self.world_size)
            return single_file.position(ckpt), ckpt, rng
        meta = self._meta(path)
        self._check(path, meta, with_optimizer, loop_state=True)
        self._load_strategy(path, meta, with_optimizer)
        state = _torch_load(path / TRAINER_STATE)
        rng_file = path / f"rng-rank{self.rank}.pt"
        # rank r's random stream means nothing on another world size
        same_ranks = meta.get("world_size") == self.world_size
        rng = _torch_load(rng_file) if same_ranks and rng_file.exists() else None
        self._restore_trainer_state(state["callbacks"], state["schedulers"])
        loop = LoopState(**{f.name: state[f.name] for f in dataclasses.fields(LoopState)})
        return loop, state, rng

    def load_strategy(self, path: Path, with_optimizer: bool = False) -> dict:
        """Collective. Loads the model (and with `with_optimizer` the optimizer state) from `path`
        into the set-up strategy, natively or through the neutral form; what evaluation with
        `ckpt_path` needs. Returns meta.json (for a file: the same facts). Raises ConfigError naming
        the checkpoint (and the file at fault, where one is) when it cannot be loaded or a file
        differs from its checksum."""
        self.settle()
        if path.is_file():
            meta = self._load_file(path, with_optimizer)[1]
        else:
            meta = self._meta(path)
            self._check(path, meta, with_optimizer, loop_state=False)
            self._load_strategy(path, meta, with_optimizer)
        self.settle()  # evaluation's results come from verified weights only
        return meta

    def settle(self) -> None:
        """Collective. Waits for the checksum pass the last load left running beside it and shares
        every rank's verdict: when a rank found a changed byte, every rank raises the same
        ConfigError (the file, both checksums, the newest intact checkpoint). Returns at once when
        no pass is pending (every rank alike: loads are collective)."""
        if self.pending is None:
            return
        (path, pending), self.pending = self.pending, None
        self._agree(path, pending.result())

    def _restore_trainer_state(self, callbacks: dict, schedulers: list) -> None:
        for cb in self.callbacks:
            if cb.state_key in callbacks:
                cb.load_state_dict(callbacks[cb.state_key])
        for sched, sd in zip(self.strategy.schedulers, schedulers):
            sched.scheduler.load_state_dict(sd)

    def _load_file(self, path: Path, with_optimizer: bool) -> tuple[dict, dict]:
        """Collective. Every rank checks the CRC-32s of the file's pickle records, starts the check
        of its tensor records beside the load, reads the file (mapped) and writes it into the
        strategy through the neutral form. Returns (the file's dict, its meta)."""
        self._agree(path, zip_mismatch(path, self.rank, records=is_structure))
        rank = self.rank
        tensors = Verification(
            lambda: zip_mismatch(path, rank, records=lambda r: not is_structure(r))
        )
        self.pending = (path, tensors)
        ckpt = single_file.read(path)
        meta = single_file.meta(ckpt)

        def names(states: list[dict]) -> list[list[str]]:  # a file Lightning wrote
            model, optimizers = self.strategy.model, self.strategy.optimizers
            saved = set(ckpt["state_dict"])
            return names_by_identity(model, optimizers, states, saved, str(path))

        portable = single_file.portable(ckpt, path, with_optimizer, names)
        self._say_what_travels(meta, with_optimizer)
        self._write(path, portable, with_optimizer)
        return ckpt, meta

    def _meta(self, path: Path) -> dict:
        # Rank 0's meta.json decides native or neutral for every rank: a per-rank read that differed
        # (a node's stale view of shared storage) would leave some ranks in the broadcast below and
        # others not.
        return broadcast_from_rank0(read_meta(path) if self.rank == 0 else None)

    def _check(self, path: Path, meta: dict, with_optimizer: bool, loop_state: bool) -> None:
        """Collective. Each rank checks what engines parse in the files it is about to read (the
        small files whole, the pickle records of the large ones) and the ranks agree on it; then
        each starts the pass over its large files' bytes beside the load (`pending`)."""
        native = self._is_native(meta)
        names = files_read(meta, self.rank, self.world_size, native, with_optimizer, loop_state)
        now, later = split(path, meta, names)
        rank = self.rank
        found = first_mismatch(path, meta, now, rank) or structure_mismatch(path, meta, later, rank)
        self._agree(path, found)
        self.pending = (path, Verification(lambda: first_mismatch(path, meta, later, rank)))

    def _agree(self, path: Path, mine: Mismatch | None) -> None:
        """Collective. Every rank's verdict gathered; when any rank found a changed byte, every rank
        raises the same ConfigError (the first such rank's file), naming the newest intact
        checkpoint beside `path`."""
        found: list[Mismatch | None] = _gather(mine)
        first = next((m for m in found if m is not None), None)
        if first is None:
            return
        intact = broadcast_from_rank0(last_intact(path) if self.rank == 0 else None)
        raise ConfigError(describe(path, first) + intact_sentence(path, intact))

    def _is_native(self, meta: dict) -> bool:
        saved, ranks = meta.get("strategy", "?"), meta.get("world_size", 0)
        return layout(saved, ranks) == layout(self.strategy.name, self.world_size)

    def _load_strategy(self, path: Path, meta: dict, with_optimizer: bool) -> None:
        portable = self._read_portable(path, meta, with_optimizer)
        self._say_what_travels(meta, with_optimizer)
        self._write(path, portable, with_optimizer)

    def _write(self, path: Path, portable: dict | None, with_optimizer: bool) -> None:
        try:
            self.strategy.load(path, with_optimizer=with_optimizer, portable=portable)
        except (ConfigError, KeyboardInterrupt, SystemExit):
            raise
        # DeepSpeed's bare AssertionError, DCP's CheckpointException (a BaseException)
        except BaseException as e:
            if corrupt := self._corrupt(path):
                raise corrupt from e
            raise ConfigError(
                f"checkpoint {path} could not be loaded by {self.strategy.name}: "
                f"{_culprit(path, e)}"
            ) from e

    def _corrupt(self, path: Path) -> ConfigError | None:
        """After a reader failed on `path`: the checksum error when the pass beside the load found
        a changed byte in this rank's files (bytes it had not cleared yet may be why), else None.
        This rank's verdict alone: the others may be inside the engine's collectives."""
        found = self.pending[1].result() if self.pending is not None else None
        return ConfigError(with_intact(path, describe(path, found))) if found else None

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
                elif corrupt := self._corrupt(path):
                    found = corrupt
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
        """One line on rank 0 when the checkpoint comes from another strategy, world size or from
        Lightning (world size 0 in its meta: it does not record one)."""
        saved, ranks = meta.get("strategy", "?"), meta.get("world_size", 0)
        if self.rank != 0 or (saved, ranks) == (self.strategy.name, self.world_size):
            return
        verb = "Resuming" if with_optimizer else "Loading"
        here = f"{self.strategy.name} on {self.world_size} rank{'s' * (self.world_size != 1)}"
        where = f"from {ranks} rank{'s' * (ranks != 1)} " if ranks else ""
        line = f"{verb} a {saved} checkpoint {where}under {here}: carried weights"
        if not with_optimizer:
            print(line + ".", flush=True)
            return
        same = ranks == self.world_size
        line += ", optimizer state, LR schedulers, loop state (epoch, global step)"
        if same:
            line += ", RNG states; not carried: nothing."
        elif not ranks:
            line += "; not carried: RNG states (Lightning saves none)."
        else:
            line += (
                "; not carried: RNG states and the data order (on another world size each "
                "rank's share of the data and its random stream differ)."
            )
        print(line, flush=True)


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


def _culprit(path: Path, error: BaseException) -> str:
    """What to tell the user when an engine fails on a checkpoint: the file at fault if a full check
    finds one (the load's own check covers the files it read; an engine may read more)."""
    try:
        verify(path, full=True)
    except ConfigError as found:
        return with_intact(path, str(found))
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
