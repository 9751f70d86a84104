"""Checkpoint integrity: the sizes and checksums meta.json records, and the checks that read them.

    meta["files"] = sums(tmp, owned(names, rank, world_size))    # save: each rank its own files
    now, later = split(path, files_read(...))                    # load: what the parser reads
    found = first_mismatch(path, meta, now, rank)                #   checked first; the bulk
    pending = Verification(lambda: first_mismatch(path, meta, later, rank))  # beside the load
    strategy.load(path); ...; pending.result()                   # before the first save

Two levels. `verify_files` is cheap (sizes against meta.json, zip central directories, safetensors
headers): a truncated or missing file. A checksum finds a changed byte, and costs a pass over the
data: xxh3_64 (xxhash) since 2026-12, 15-20 GB/s on one core, 4-5x zlib's CRC-32; a checkpoint
written before then records CRC-32s and is checked with CRC-32 (the name of each file's sum in
meta.json is its algorithm's, `ALGORITHMS`).

When the pass runs (docs/reliability.md has the figures). Before the load, on every rank: the
bytes an engine parses, where a changed byte could steer it (a huge allocation, a wrong file
offset): every file under SMALL bytes whole (trainer.pt, rng states, DCP's .metadata) and the
pickle records of a large torch file (`zip_mismatch(..., records=is_structure)`, the archive's own
CRC-32s). The bulk, tensor bytes no parser interprets, is hashed on a thread beside the load
(`Verification`), from the same pages the engine reads (mapped, so storage is read once): a
checked resume costs the load what the thread takes from it, and the Checkpointer waits for the
verdict, and the ranks agree on it, before anything lasting happens (the first checkpoint save, the
end of fit). A load that fails on bytes the thread has not cleared yet waits for its verdict and
reports the checksum.

Which files a rank checks (`files_read`): those it reads. A shared file (model.safetensors,
optimizer.pt, DeepSpeed's mp_rank_00 model states, DCP's .metadata) is read, and checked, by every
rank; a per-rank file (DeepSpeed's zero_pp_rank_<k> shards, DCP's __<k>_0.distcp, rng-rank<k>.pt)
by rank k (k modulo the world size when it changed). Where an engine also reads another rank's file
(DCP's rank 0 reads parts of every shard), that file's own rank checks it and the Checkpointer
shares every rank's verdict. A checkpoint in another layout is read by rank 0 alone (the neutral
form, layouts.py): rank 0 checks every file of it.

A checkpoint that is one file (Lightning's `.ckpt`, single_file.py) carries its checksums inside:
torch writes it as a zip archive whose every record holds the CRC-32 of its bytes (kept: Lightning
writes and reads the same file, and a file Lightning wrote is checked the same way). `zip_mismatch`
recomputes them (mapped, as above), the pickle records before the load and the tensor records
beside it; `check_zip` is the cheap check (the central directory, at the end of the file, is where
a truncation shows). Every rank reads the whole file, so every rank checks all of it.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import threading
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import xxhash

from lightspeed.checkpoint.io import OPTIMIZER
from lightspeed.errors import ConfigError

CHUNK = 1 << 24  # 16 MiB per hash call; zlib.crc32 and xxhash run without the GIL on such calls
SMALL = 1 << 24  # files up to this size are checked whole before the load, larger ones beside it
ALGORITHM = "xxh3_64"  # what `sums` records now; meta.json names each file's sum by its algorithm
TRAINER_STATE = "trainer.pt"
# Files one rank writes and reads: rng-rank<k>.pt, DeepSpeed's ZeRO shards, DCP's shard files.
_PER_RANK = re.compile(r"(?:^rng-rank|zero_pp_rank_|(?:^|/)__)(\d+)[._]")
_TENSOR_RECORD = re.compile(r"(?:^|/)data/\d+$")  # torch.save's record of one storage's bytes


class Mismatch(NamedTuple):
    """A file whose bytes are not the ones written: `found` None when it could not be read."""

    name: str  # relative to the checkpoint directory ("" for a one-file checkpoint)
    expected: int
    found: int | None
    rank: int | None  # the rank that read it (None: an offline check)
    error: str = ""
    record: str = ""  # in a one-file checkpoint: the zip record whose CRC-32 differs
    algorithm: str = "crc32"


class _Crc32:
    """zlib's CRC-32 behind xxhash's update/intdigest interface."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


ALGORITHMS: dict[str, Callable[[], _Crc32 | xxhash.xxh3_64]] = {
    "xxh3_64": xxhash.xxh3_64,
    "crc32": _Crc32,
}


def checksum(file: Path, algorithm: str = ALGORITHM, chunk: int = CHUNK) -> int:
    """The `algorithm` sum (a key of ALGORITHMS) of a file's bytes, `chunk` bytes at a time.

    The file is mapped, not read: the hash runs on the page cache's own pages, with no copy into a
    buffer, and pages a concurrent load already brought in are not read from storage again."""
    h = ALGORITHMS[algorithm]()
    with file.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return h.intdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_SEQUENTIAL)  # a larger read-ahead from storage
            view = memoryview(m)
            try:
                for start in range(0, len(m), chunk):
                    h.update(view[start : start + chunk])
            finally:
                view.release()
    return h.intdigest()


def crc32(file: Path, chunk: int = CHUNK) -> int:
    """The zlib CRC-32 of a file's bytes (what checkpoints written before xxh3_64 record)."""
    return checksum(file, "crc32", chunk)


def sums(path: Path, names: list[str]) -> dict[str, dict]:
    """meta.json's entry of each file: {"size": bytes, "xxh3_64": its sum in hex}."""
    return {
        n: {"size": (path / n).stat().st_size, ALGORITHM: f"{checksum(path / n):016x}"}
        for n in names
    }


def recorded(entry: object) -> tuple[str, int] | None:
    """(algorithm, sum) of a meta.json file entry; None for one written before checksums. An
    xxh3_64 sum is recorded in hex, a CRC-32 (earlier checkpoints) as a number."""
    if not isinstance(entry, dict):
        return None
    if isinstance(value := entry.get("xxh3_64"), str):
        return "xxh3_64", int(value, 16)
    if isinstance(value := entry.get("crc32"), int):
        return "crc32", value
    return None


def rank_of(name: str) -> int | None:
    """The rank that writes the per-rank file `name` (a path relative to the checkpoint), or None
    for a file every rank shares."""
    found = _PER_RANK.search(name)
    return int(found.group(1)) if found else None


def owned(names: list[str], rank: int, world_size: int) -> list[str]:
    """The files whose checksums `rank` computes at save: the per-rank files it wrote; rank 0 also
    the shared ones (it writes them). Every rank hashes its share at once."""
    return [n for n in names if (rank_of(n) or 0) % world_size == rank]


def files_read(
    meta: dict,
    rank: int,
    world_size: int,
    native: bool,
    with_optimizer: bool,
    loop_state: bool,
) -> list[str]:
    """The files of a checkpoint (meta.json's list) that `rank` reads when it loads it, each
    checked by it (see the module's docstring).

    Args:
        native: the running strategy reads the layout on disk itself (else rank 0 reads all of it
            into the neutral form).
        with_optimizer: the optimizer state is loaded too (optimizer.pt is read only then).
        loop_state: trainer.pt and this rank's RNG state are read too (a resume, not an evaluation).
    """
    same_ranks = meta.get("world_size") == world_size
    out = []
    for name in meta.get("files") or {}:
        owner = rank_of(name)
        if name == TRAINER_STATE:
            take = loop_state
        elif name.startswith("rng-rank"):
            take = loop_state and same_ranks and owner == rank
        elif name == OPTIMIZER and not with_optimizer:
            take = False
        elif not native:
            take = rank == 0
        else:
            take = owner is None or owner % world_size == rank
        if take:
            out.append(name)
    return out


def split(path: Path, meta: dict, names: list[str]) -> tuple[list[str], list[str]]:
    """`names` as (checked whole before the load: files up to SMALL bytes, what engines parse;
    hashed beside the load: the larger ones, mostly tensor bytes)."""
    listed = meta.get("files") or {}

    def size(name: str) -> int:
        entry = listed.get(name)
        return entry["size"] if isinstance(entry, dict) else (path / name).stat().st_size

    small = [n for n in names if size(n) <= SMALL]
    return small, [n for n in names if n not in small]


def first_mismatch(path: Path, meta: dict, names: list[str], rank: int | None) -> Mismatch | None:
    """Checks the sum of each of `names` (files under `path`) against `meta`'s, in order, with the
    algorithm meta.json recorded it with; returns the first that differs (or cannot be read), else
    None. Files meta.json lists without a checksum (checkpoints from before checksums) are skipped.
    `rank`: the rank checking, for the message."""
    listed = meta.get("files") or {}
    for name in names:
        if (entry := recorded(listed.get(name))) is None:
            continue
        algorithm, expected = entry
        try:
            found = checksum(path / name, algorithm)
        except (OSError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
            return Mismatch(name, expected, None, rank, error, algorithm=algorithm)
        if found != expected:
            return Mismatch(name, expected, found, rank, algorithm=algorithm)
    return None


def structure_mismatch(
    path: Path, meta: dict, names: list[str], rank: int | None
) -> Mismatch | None:
    """Checks what an engine parses in the large files `names` before the load: the pickle records
    of each torch file (its zip's own CRC-32s; a few KiB each). Where one differs, the whole file
    is hashed for the message (meta.json's sum, recorded and found). Other large files (safetensors,
    DCP's shards) hold tensor bytes at offsets their small headers give, checked by `verify_files`
    and, for DCP, with .metadata. Returns the first file at fault, else None."""
    for name in names:
        if Path(name).suffix not in (".pt", ".pth", ".bin"):
            continue
        bad = zip_mismatch(path / name, rank, records=is_structure)
        if bad is not None:
            whole = first_mismatch(path, meta, [name], rank)
            return whole or bad._replace(name=name)
    return None


def is_structure(record: str) -> bool:
    """Whether a torch.save record is one its reader parses (the pickle, the version, the byte
    order), not one storage's bytes (`data/<n>`)."""
    return _TENSOR_RECORD.search(record) is None


class Verification:
    """A checksum pass, `check()`, on a thread of its own, started at once, beside a load.

    The thread runs at a lower CPU priority (nice 10) where the system allows: on a host with no
    idle core the load and the first steps come first, and the verdict later. `result()` waits
    for the verdict: the first Mismatch, or None."""

    def __init__(self, check: Callable[[], Mismatch | None]):
        self._found: Mismatch | None = None
        self._thread = threading.Thread(
            target=self._run, args=(check,), name="lightspeed-verify", daemon=True
        )
        self._thread.start()

    def _run(self, check: Callable[[], Mismatch | None]) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only
        except (AttributeError, OSError):
            pass
        try:
            self._found = check()
        except Exception as e:  # noqa: BLE001 - the caller reports it as the file's failure
            self._found = Mismatch("", 0, None, None, f"{type(e).__name__}: {e}")

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> Mismatch | None:
        self._thread.join()
        return self._found


def describe(path: Path, m: Mismatch) -> str:
    """The sentence naming a Mismatch: the file, the recorded and the found checksum, the rank."""
    where = "" if m.rank is None else f" on rank {m.rank}"
    file = path / m.name if m.name else path
    if m.found is None:
        return f"checkpoint file {file} could not be read{where} ({m.error})."
    if m.record:
        return (
            f"checkpoint file {file} is corrupt: the CRC-32 of its record {m.record!r} differs "
            f"from the one recorded when it was written (recorded {m.expected:08x}, found "
            f"{m.found:08x}{where})."
        )
    name, width = ("CRC-32", 8) if m.algorithm == "crc32" else (m.algorithm, 16)
    return (
        f"checkpoint file {file} is corrupt: its {name} differs from the one recorded "
        f"when it was written (recorded {m.expected:0{width}x}, found {m.found:0{width}x}{where})."
    )


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
            # a bare size: written before checksums
            size = entry["size"] if isinstance(entry, dict) else entry
            if size is not None and file.stat().st_size != size:
                raise ValueError(f"{file.stat().st_size} bytes, written with {size}")
            if file.suffix in (".pt", ".pth"):
                # reads the central directory at the end: truncation shows here
                zipfile.ZipFile(file).close()
            elif file.suffix == ".safetensors":
                _check_safetensors_size(file)
        except Exception as e:  # noqa: BLE001 - any failure here means the same thing to the user
            raise ConfigError(f"checkpoint file {file} is truncated or corrupt ({e}).") from None


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


# --------------------------------------------------------------------------------------- one file
_LOCAL_HEADER = 30  # a zip local file header's fixed part; the name and extra field follow it


def check_zip(file: Path) -> None:
    """Cheap check of a one-file checkpoint: a zip archive (torch's format) whose central directory
    reads, with torch's pickle record, and whose records fit in the file. Raises ConfigError naming
    the file when it is truncated, not a zip archive or not written by torch.save."""
    try:
        with zipfile.ZipFile(file) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        raise ConfigError(
            f"ckpt_path={str(file)!r} is not a lightspeed checkpoint (nor Lightning's) that can be "
            f"read: checkpoint file {file} is truncated or corrupt, or not a torch.save file ({e})."
        ) from None
    if not any(i.filename.endswith("/data.pkl") or i.filename == "data.pkl" for i in infos):
        raise ConfigError(f"checkpoint file {file} is a zip archive but not a torch.save file.")
    size = file.stat().st_size
    if any(i.header_offset + _LOCAL_HEADER + i.compress_size > size for i in infos):
        raise ConfigError(f"checkpoint file {file} is truncated or corrupt (a record ends past it)")


def zip_mismatch(
    file: Path, rank: int | None, records: Callable[[str], bool] | None = None
) -> Mismatch | None:
    """The first record of the zip archive `file` whose bytes differ from the CRC-32 the archive
    holds for it (torch.save writes one per record), or None when all match. Reads the records'
    bytes, mapped: every record's, or those whose name `records` accepts. `rank`: the rank
    checking, for the message."""
    try:
        with zipfile.ZipFile(file) as z:
            infos = [i for i in z.infolist() if records is None or records(i.filename)]
        with file.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if hasattr(m, "madvise"):
                m.madvise(mmap.MADV_SEQUENTIAL)
            view = memoryview(m)
            try:
                for info in infos:
                    found = _record_crc(view, info)
                    if found != info.CRC:
                        return Mismatch("", info.CRC, found, rank, record=info.filename)
            finally:
                view.release()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        return Mismatch("", 0, None, rank, f"{type(e).__name__}: {e}")
    return None


def _record_crc(view: memoryview, info: zipfile.ZipInfo) -> int:
    """The CRC-32 of one stored record's bytes, read in place (torch stores records uncompressed;
    a compressed one is read through zipfile, which checks it)."""
    head = view[info.header_offset : info.header_offset + _LOCAL_HEADER]
    if bytes(head[:4]) != b"PK\x03\x04":
        raise ValueError(f"record {info.filename!r} has no local header")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"record {info.filename!r} is compressed; torch.save stores records")
    start = (
        info.header_offset
        + _LOCAL_HEADER
        + int.from_bytes(head[26:28], "little")
        + int.from_bytes(head[28:30], "little")
    )
    value = 0
    for at in range(start, start + info.compress_size, CHUNK):
        value = zlib.crc32(view[at : min(at + CHUNK, start + info.compress_size)], value)
    return value
