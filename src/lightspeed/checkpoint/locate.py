"""Finding and checking checkpoints on disk, before anything is loaded.

    path = resolve("last", folder)        # "last", "best" or a path -> a complete checkpoint
    meta = read_meta(path)                # who wrote it: strategy, world size, step, files
    verify(path, full=True)               # every byte against its checksum; ConfigError if not

A checkpoint is a directory with meta.json (checkpointer.py) or one file, Lightning's `.ckpt`
(single_file.py), whose zip records carry their own CRC-32s. `last.ckpt` beside them is a symlink
to the newest complete one (or, for a checkpoint kept only as the newest, the file itself).
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from lightspeed.checkpoint import single_file
from lightspeed.checkpoint.integrity import (
    check_zip,
    describe,
    first_mismatch,
    verify_files,
    zip_mismatch,
)
from lightspeed.errors import ConfigError

FORMAT = "lightspeed-checkpoint"
META = "meta.json"
LAST = "last.ckpt"  # Lightning's name; the newest complete checkpoint
OLD_LAST = "last"  # its name before lightspeed wrote Lightning's files: still found


class MissingCheckpoint(ConfigError, FileNotFoundError):
    """A checkpoint path that does not exist: a ConfigError, and the FileNotFoundError Lightning
    raises for it."""


def unused_name(path: Path) -> Path:
    """`path`, or `path` with `-vN` before its `.ckpt` (Lightning's `epoch=0-step=5-v1.ckpt`) with
    the first N that is free: a run never overwrites an earlier run's checkpoint."""
    stem, suffix = (path.stem, path.suffix) if path.suffix == ".ckpt" else (path.name, "")
    candidate, n = path, 0
    while candidate.exists() or candidate.is_symlink():
        n += 1
        candidate = path.with_name(f"{stem}-v{n}{suffix}")
    return candidate


def last_in(directory: Path) -> Path:
    """`directory`'s pointer to its newest checkpoint: `last.ckpt`, else the older `last`."""
    link = directory / LAST
    old = directory / OLD_LAST
    return old if not (link.exists() or link.is_symlink()) and old.is_symlink() else link


def resolve(
    ckpt_path: str | os.PathLike, directory: Path, best: str | None = None, verify: bool = True
) -> Path | None:
    """Turns `ckpt_path` ("last", "best" or a path) into a complete checkpoint (a directory or one
    file).

    "last" is `<directory>/last.ckpt`, returned as that path (Lightning's `trainer.ckpt_path`);
    with nothing saved there yet it warns and returns None (a fresh start: what a requeued job
    killed before its first save needs). "best" is the checkpoint callback's best model (`best`).
    With `verify` the checkpoint is checked cheaply: sizes against meta.json and file headers, a
    file's zip directory (run it on rank 0 only). Raises ConfigError naming the path when it is not
    a complete, intact checkpoint."""
    if str(ckpt_path) == "best":
        if not best:
            raise ConfigError(
                "ckpt_path='best' is not valid: no best checkpoint is known yet (fit with a "
                "ModelCheckpoint first, or pass a path)."
            )
        path = Path(best).resolve()
    elif str(ckpt_path) == "last":
        path = last_in(directory).absolute()
        if path.is_symlink() and not path.exists():
            path = _recover_last(path)
        if not path.exists():
            if verify:
                warnings.warn(
                    f"ckpt_path='last': nothing saved in {directory} yet. No checkpoint will be "
                    "loaded; starting from scratch.",
                    stacklevel=3,
                )
            return None
    else:
        path = Path(ckpt_path)
        if path.is_dir() and not (path / META).exists() and last_in(path).exists():
            path = last_in(path)  # a checkpoint folder given: take its newest
        if not path.exists():
            raise MissingCheckpoint(
                f"ckpt_path={str(ckpt_path)!r} is not valid: the path does not exist "
                "(Checkpoint file not found)."
            )
        path = path.resolve()
    if path.is_file():
        if verify:
            check_zip(path.resolve())  # names the file itself, not the `last.ckpt` link to it
        return path
    meta = read_meta(path)
    if verify:
        verify_files(path, meta)
    return path


def _recover_last(link: Path) -> Path:
    """`last` dangles only when a save that reuses a directory's name was killed between its two
    renames: the new checkpoint is then complete at `.tmp-<name>` (meta.json is written last) or
    the old one at `.old-<name>`."""
    target = os.readlink(link)
    for candidate in (link.parent / f".tmp-{target}", link.parent / f".old-{target}"):
        if (candidate / META).exists():
            warnings.warn(
                f"{link} points to {target!r}, which a save killed mid-rename left at "
                f"{candidate.name}; resuming from there.",
                stacklevel=4,
            )
            return candidate
    raise ConfigError(
        f"ckpt_path='last' is not valid: {link} points to {target!r}, which does not exist (was it "
        "moved or deleted?)."
    )


def read_meta(path: Path) -> dict:
    """Validates a checkpoint and returns its meta.json (for one file: the same facts, read from
    it); ConfigError if it is not a complete one."""
    if path.is_file():
        check_zip(path)
        return single_file.meta(single_file.read(path))
    meta_file = path / META
    if not path.is_dir() or not meta_file.exists():
        raise ConfigError(
            f"ckpt_path={str(path)!r} is not a lightspeed checkpoint: expected a directory with "
            f"{META} (an unfinished save never has one) or a checkpoint file."
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
    """Checks a checkpoint: a directory's meta.json, every listed file present with its size and
    header, and with `full` each file's checksum (xxh3_64; CRC-32 in checkpoints written before)
    against the one written at save time; a file's zip directory, and with `full` each of its
    records against its CRC-32 (reads every byte). Raises ConfigError naming the file that is
    wrong; returns None when the checkpoint is intact. Directories written before checksums were
    recorded are checked for sizes and headers only."""
    path = Path(path)
    if path.is_file():
        check_zip(path)
        if full and (found := zip_mismatch(path, rank=None)):
            raise ConfigError(describe(path, found))
        return
    meta = read_meta(path)
    verify_files(path, meta)
    if not full:
        return
    if found := first_mismatch(path, meta, list(meta.get("files") or {}), rank=None):
        raise ConfigError(describe(path, found))


def last_intact(path: Path) -> Path | None:
    """The newest other checkpoint in `path`'s folder whose every byte matches its checksum (by
    global step, then save time), or None. Reads each candidate whole, newest first, until one
    passes: only on the error path."""
    here, candidates = path.resolve(), []
    for d in path.parent.iterdir():
        if d.is_symlink() or d.name.startswith((".tmp-", ".old-", ".parts-")):
            continue
        if d.resolve() == here:
            continue
        try:
            meta = read_meta(d)
        except ConfigError:
            continue
        saved_at = meta.get("saved_at") or str(d.stat().st_mtime)
        candidates.append((meta.get("global_step", -1), saved_at, d.name, d))
    for *_, d in sorted(candidates, reverse=True):
        try:
            verify(d, full=True)
        except ConfigError:
            continue
        return d
    return None


def intact_sentence(path: Path, intact: Path | None) -> str:
    if intact is None:
        return f" No other checkpoint in {path.parent} is intact."
    return (
        f" The newest intact checkpoint in {path.parent} is {intact.name}: resume with "
        f"ckpt_path={str(intact)!r}."
    )


def with_intact(path: Path, message: str) -> str:
    """`message` and the newest intact checkpoint beside `path` (this rank alone looks)."""
    return message + intact_sentence(path, last_intact(path))
