"""What checking a checkpoint's checksums on resume costs (lightspeed/checkpoint/integrity.py).

    PYTHONPATH=src .venv/bin/python benchmarks/checksum_cost.py [--params 268435456] [--repeat 3] \\
        [--cache warm|cold|both] [--device cpu|cuda] [--layout both|file|dir] [--dir /tmp/cc]

Writes a model of `--params` fp32 parameters with AdamW's two moments (12 bytes per parameter: the
default 2^28 make 3 GiB) both ways the Checkpointer writes it: Lightning's one `.ckpt` file (single
device, DDP, ZeRO-1; its zip records carry CRC-32s) and a directory with meta.json's xxh3_64 sums
(the layout single and DDP runs wrote before the .ckpt: model.safetensors + optimizer.pt, read
here by the same Checkpointer code as DeepSpeed's and DCP's directories). Then, in one run, for
each layout:

  load                   the load with no check: the file read (mapped) into the neutral form
                         and written into the model and a torch AdamW, as SingleDevice.load does
                         (the directory: load_replicated)
  check, then load       the design before 2026-12-03: every byte hashed, then the load (which
                         reads the page cache); the .ckpt with its CRC-32s, the directory once
                         with CRC-32 (what it recorded then) and once with xxh3_64
  lightspeed: load       Checkpointer.load: what engines parse checked first, the tensor bytes
                         on a thread beside the load; timed until it returns (the resume's path)
  lightspeed: verdict    Checkpointer.settle() called at once after it: the wait left for the
                         thread (a run meets it at its first save or at the end of fit)
  first step ...         one AdamW step right after the plain load, and right after
                         lightspeed's load with the pass still running beside it (then settled):
                         what the pass takes from the first training steps. On CPU, where an
                         AdamW step over 2^28 parameters takes minutes on a small shared machine,
                         the step is a fixed piece of CPU work instead (20 matrix products of
                         1024x1024, on torch's threads)
  save sums              the read-back of the directory's files that fills meta.json, with
                         xxh3_64 (now) and CRC-32 (before)

--cache cold drops the checkpoint's files from the page cache (posix_fadvise DONTNEED) before each
timed case (both: a warm table, then a cold one, from the same files); --device cuda keeps the model and optimizer on the GPU (the load then copies to it).
Ratios are against the plain load of the same layout in the same run: absolute times on a shared
machine drift. The Checkpointer runs here with no process group (one rank).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from lightspeed.checkpoint import single_file
from lightspeed.checkpoint.checkpointer import Checkpointer
from lightspeed.checkpoint.integrity import crc32, first_mismatch, sums, zip_mismatch
from lightspeed.checkpoint.io import OPTIMIZER, WEIGHTS, load_replicated, save_replicated
from lightspeed.checkpoint.layouts import optimizer_param_names, write_torch
from lightspeed.checkpoint.locate import FORMAT, META
from lightspeed.specs import LoopState

CKPT, DIR = "resume.ckpt", "resume-dir"
LOOP = LoopState(0, 10, 0, False)


class Strategy:
    """What the Checkpointer needs of a strategy to load: SingleDevice.load, without precision."""

    name = "single"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizers, self.schedulers = model, [optimizer], []

    def load(self, path: Path, with_optimizer: bool = True, portable: Any = None) -> None:
        if portable is not None:
            write_torch(portable, self.model, self.optimizers, with_optimizer, path)
        else:
            load_replicated(path, self.model, self.optimizers, with_optimizer)


def build(params: int, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of `params` fp32 parameters in 64 tensors, and an AdamW whose moments exist."""
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.randn(params // 64, device=device)) for _ in range(64)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, opt)
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step over every parameter (gradients of zero: AdamW's arithmetic still runs)."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in model.parameters():
        p.grad = None
    sync()


def cpu_work() -> None:
    """The first step's stand-in on CPU: 20 products of 1024x1024 fp32 matrices (43 GFLOP)."""
    a = torch.ones(1024, 1024)
    for _ in range(20):
        a = torch.mm(a, a).clamp_(max=1.0)


def sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def write(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, layouts: str) -> dict:
    """Both checkpoints under `root`; returns the directory's meta with CRC-32 sums (the design
    before) for the 'check, then load' rows."""
    if layouts in ("both", "file"):
        ckpt = {
            "epoch": 0,
            "global_step": LOOP.global_step,
            "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "optimizer_states": [opt.state_dict()],
            "callbacks": {},
            "lr_schedulers": [],
            single_file.KEY: {
                "strategy": "single",
                "world_size": 1,
                "loop": dataclasses.asdict(LOOP),
                "rng": [],
                "param_names": optimizer_param_names(model, [opt]),
                "precision": {},
            },
        }
        single_file.write(ckpt, root / CKPT)
    if layouts not in ("both", "dir"):
        return {}
    path = root / DIR
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    save_replicated(path, model, [opt])
    state = {**dataclasses.asdict(LOOP), "callbacks": {}, "schedulers": []}
    torch.save(state, path / "trainer.pt")
    names = [WEIGHTS, OPTIMIZER, "trainer.pt"]
    meta = {"format": FORMAT, "strategy": "single", "world_size": 1, "files": sums(path, names)}
    (path / META).write_text(json.dumps(meta))
    return {
        "files": {n: {"size": (path / n).stat().st_size, "crc32": crc32(path / n)} for n in names}
    }


def evict(root: Path) -> None:
    """Drops the checkpoints' files from the page cache (their next read comes from storage)."""
    for file in [root / CKPT, *(root / DIR).glob("*")]:
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def timed(fn) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def cases(root: Path, model, opt, crc_meta: dict, layout: str) -> dict[str, Any]:
    """name -> a function returning {row: seconds} for one timed repeat."""
    strategy = Strategy(model, opt)
    ck = Checkpointer(strategy, [], rank=0, world_size=1)
    path = root / (CKPT if layout == "file" else DIR)

    def plain_load() -> None:
        if layout == "file":
            ckpt = single_file.read(path)
            strategy.load(path, portable=single_file.portable(ckpt, path, True))
        else:
            strategy.load(path)

    def full_check(algorithm: str) -> None:
        if layout == "file":
            assert zip_mismatch(path, 0) is None
        else:
            meta = crc_meta if algorithm == "crc32" else json.loads((path / META).read_text())
            assert first_mismatch(path, meta, list(meta["files"]), 0) is None

    def lightspeed() -> dict[str, float]:
        load = timed(lambda: ck.load(path, with_optimizer=True))
        verdict = timed(ck.settle)
        return {
            "lightspeed: load": load,
            "lightspeed: verdict, waited for after it": verdict,
            "lightspeed: load, then the verdict": load + verdict,
        }

    on_gpu = next(model.parameters()).is_cuda

    def first_step() -> None:
        step(model, opt) if on_gpu else cpu_work()

    def with_step(checked: bool) -> dict[str, float]:
        what = "first step" if on_gpu else "CPU work (20 matmuls)"
        if checked:
            ck.load(path, with_optimizer=True)
            first = timed(first_step)
            ck.settle()
            return {f"{what}, the pass beside it": first}
        plain_load()
        return {f"{what} after the plain load": timed(first_step)}

    out: dict[str, Any] = {
        "load": lambda: {"load": timed(plain_load)},
        "lightspeed": lightspeed,
        "step plain": lambda: with_step(False),
        "step checked": lambda: with_step(True),
    }
    if layout == "file":
        out["check then load"] = lambda: {
            "check (CRC-32), then load: before": timed(lambda: (full_check("crc32"), plain_load()))
        }
    else:
        out["check then load crc"] = lambda: {
            "check (CRC-32), then load: before": timed(lambda: (full_check("crc32"), plain_load()))
        }
        out["check then load xxh"] = lambda: {
            "check (xxh3_64), then load": timed(lambda: (full_check("xxh3_64"), plain_load()))
        }
        names = [WEIGHTS, OPTIMIZER, "trainer.pt"]
        out["save sums"] = lambda: {
            "save sums: xxh3_64 read-back": timed(lambda: sums(path, names)),
            "save sums: CRC-32 read-back (before)": timed(lambda: [crc32(path / n) for n in names]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=1 << 28)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cache", choices=["warm", "cold", "both"], default="warm")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--layout", choices=["both", "file", "dir"], default="both")
    parser.add_argument("--dir", default="/tmp/checksum-cost")
    a = parser.parse_args()
    root = Path(a.dir)
    root.mkdir(parents=True, exist_ok=True)
    model, opt = build(a.params, a.device)
    crc_meta = write(root, model, opt, a.layout)
    layouts = ["file", "dir"] if a.layout == "both" else [a.layout]
    size = {
        "file": (root / CKPT).stat().st_size if "file" in layouts else 0,
        "dir": sum(f.stat().st_size for f in (root / DIR).glob("*")) if "dir" in layouts else 0,
    }
    print(
        f"{a.params / 1e6:.0f}M parameters (fp32, AdamW): .ckpt {size['file'] / 2**30:.2f} GiB, "
        f"directory {size['dir'] / 2**30:.2f} GiB; {a.repeat} repeats, model on {a.device}, "
        f"{os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"
    )
    for cache in ["warm", "cold"] if a.cache == "both" else [a.cache]:
        for layout in layouts:
            table(root, model, opt, crc_meta, layout, cache, a.repeat)


def table(root: Path, model, opt, crc_meta: dict, layout: str, cache: str, repeat: int) -> None:
    """Times every case of `layout` `repeat` times and prints the table."""
    fns = cases(root, model, opt, crc_meta, layout)
    fns["load"]()  # page cache warm, allocations made
    rows: dict[str, list[float]] = {}
    for _ in range(repeat):
        for fn in fns.values():
            if cache == "cold":
                evict(root)
            for row, t in fn().items():
                rows.setdefault(row, []).append(t)
    base = statistics.median(rows["load"])
    title = "one .ckpt file" if layout == "file" else "a directory (meta.json, xxh3_64)"
    print(f"\n{title + ', page cache ' + cache:50s} {'median s':>9s} {'min s':>7s} {'x load':>7s}")
    for row, times in rows.items():
        med = statistics.median(times)
        print(f"{row:50s} {med:9.3f} {min(times):7.3f} {med / base:7.3f}", flush=True)


if __name__ == "__main__":
    main()
