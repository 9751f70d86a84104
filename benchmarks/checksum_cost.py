"""What checking a checkpoint's checksums on load costs (lightspeed/checkpoint/integrity.py).

    PYTHONPATH=src .venv/bin/python benchmarks/checksum_cost.py [--params 268435456] [--repeat 3] \\
        [--ranks 1] [--cold] [--dir /tmp/checksum-cost]

Writes the replicated layout single-device and DDP runs save (model.safetensors + optimizer.pt with
AdamW's two moments: 12 bytes per parameter; the default 2^28 parameters make a 1 GiB weights file
and a 2 GiB optimizer file), then times, in one run:

  save              save_replicated (safetensors + torch.save), as a checkpoint save does
  save sums         the CRC-32 read-back of both files that fills meta.json
  load              load_replicated into the model and a torch AdamW (page cache warm; with
                    --cold both files are dropped from the page cache before each timed case)
  check, then load  integrity.first_mismatch over both files, then the load (which then reads
                    the page cache): what Checkpointer.load does
  check beside      the check on a thread while the load runs (the alternative not taken)
  check alone       first_mismatch on its own
  crc32, xxh3       the two hashes over the optimizer file, for the choice of hash

With --ranks N, N processes load at once (N ranks of one host reading one replicated checkpoint,
as under DDP): each reports its own times, the table their median. Ratios are against the plain
load of the same run; absolute times on a shared machine drift.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import threading
import time
from pathlib import Path

import torch

from lightspeed.checkpoint.integrity import crc32, first_mismatch, sums
from lightspeed.checkpoint.io import OPTIMIZER, WEIGHTS, load_replicated, save_replicated


def build(params: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of `params` fp32 parameters in 64 tensors, and an AdamW whose moments exist."""
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(params // 64)) for _ in range(64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    return model, opt


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def evict(path: Path) -> None:
    """Drops the checkpoint's files from the page cache (their next read comes from storage)."""
    for name in (WEIGHTS, OPTIMIZER):
        fd = os.open(path / name, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def measure(
    path: Path, params: int, repeat: int, cold: bool = False, barrier=None
) -> dict[str, list[float]]:
    model, opt = build(params)
    meta = {"files": sums(path, [WEIGHTS, OPTIMIZER])}
    names = [WEIGHTS, OPTIMIZER]

    def load():
        load_replicated(path, model, [opt], with_optimizer=True)

    def check():
        assert first_mismatch(path, meta, names, rank=0) is None

    def check_beside_load():  # the alternative not taken: the check on a thread during the load
        thread = threading.Thread(target=check)
        thread.start()
        load()
        thread.join()

    def check_then_load():  # what Checkpointer.load does
        check()
        load()

    def hash_xxh3():
        import xxhash

        h = xxhash.xxh3_64()
        with (path / OPTIMIZER).open("rb") as f:
            while block := f.read(1 << 24):
                h.update(block)

    cases = {
        "load": load,
        "check, then load (lightspeed)": check_then_load,
        "check beside the load (thread)": check_beside_load,
        "check alone": check,
        "crc32 (optimizer file)": lambda: crc32(path / OPTIMIZER),
    }
    try:
        import xxhash  # noqa: F401

        cases["xxh3_64 (optimizer file)"] = hash_xxh3
    except ImportError:
        pass
    load()  # page cache warm, allocations made
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeat):
        for name, fn in cases.items():
            if barrier is not None:
                barrier.wait()
            if cold:
                evict(path)
                if barrier is not None:
                    barrier.wait()
            times[name].append(timed(fn))
    return times


def time_save(path: Path, params: int, repeat: int) -> tuple[list[float], list[float]]:
    model, opt = build(params)
    save = [timed(lambda: save_replicated(path, model, [opt])) for _ in range(repeat)]
    return save, [timed(lambda: sums(path, [WEIGHTS, OPTIMIZER])) for _ in range(repeat)]


def _rank(path, params, repeat, cold, barrier, out) -> None:
    torch.set_num_threads(1)
    out.put(measure(path, params, repeat, cold, barrier))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=1 << 28)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--dir", default="/tmp/checksum-cost")
    a = parser.parse_args()
    torch.set_num_threads(1)
    path = Path(a.dir)
    path.mkdir(parents=True, exist_ok=True)
    save, save_sums = time_save(path, a.params, a.repeat)
    if a.ranks == 1:
        ranks = [measure(path, a.params, a.repeat, a.cold)]
    else:
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(a.ranks), ctx.Queue()
        procs = [
            ctx.Process(target=_rank, args=(path, a.params, a.repeat, a.cold, barrier, out))
            for _ in range(a.ranks)
        ]
        for p in procs:
            p.start()
        ranks = [out.get() for _ in procs]
        for p in procs:
            p.join()
    sizes = {n: (path / n).stat().st_size / 2**30 for n in (WEIGHTS, OPTIMIZER)}
    print(
        f"{a.params / 1e6:.0f}M parameters: {WEIGHTS} {sizes[WEIGHTS]:.2f} GiB, {OPTIMIZER} "
        f"{sizes[OPTIMIZER]:.2f} GiB; {a.ranks} rank(s) loading at once, {a.repeat} repeats, "
        f"page cache {'cold' if a.cold else 'warm'}, {os.cpu_count()} CPUs"
    )
    rows = {"save": [save], "save sums (CRC-32 read-back)": [save_sums]}
    for name in ranks[0]:
        rows[name] = [r[name] for r in ranks]
    base = statistics.median(t for r in rows["load"] for t in r)
    print(f"{'':34s} {'median s':>9s} {'min s':>7s} {'x load':>7s}")
    for name, per_rank in rows.items():
        flat = [t for r in per_rank for t in r]
        med = statistics.median(flat)
        print(f"{name:34s} {med:9.2f} {min(flat):7.2f} {med / base:7.3f}")


if __name__ == "__main__":
    main()
