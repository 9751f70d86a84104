"""Where a training step's time goes: one setup of speed_single_gpu.py / scaling_multi_gpu.py,
profiled on the GPU.

    python benchmarks/profile_step.py --setup plain_deepspeed_zero3   # DeepSpeed's ZeRO-3 loop
    python benchmarks/profile_step.py --setup deepspeed_stage_3       # lightspeed, user's AdamW
    python benchmarks/profile_step.py --setup fsdp --devices 2 --micro-batch 4
    python benchmarks/profile_step.py --setup deepspeed_stage_3 --legacy-guard
                                                    # a host sync before every step
    python benchmarks/profile_step.py --setup deepspeed_stage_3 --trace t.json   # chrome trace
    python benchmarks/profile_step.py --setup single --micro-batch 1 --cprofile  # host Python

On a lent GPU machine, benchmarks/gpu.sh profile runs lists of these (one GPU each, then two).
For `--timed` steps after `--warmup` it reports the median step (the clock between batch ends, as
the suite), then, over 3 more steps, every synchronising CUDA call (torch.cuda.set_sync_debug_mode)
counted by where it was made, then a torch.profiler table over 2 more steps (CPU time by op,
including the `record_function` labels torch and DeepSpeed put on forward, backward, optimizer and
communication calls, and GPU time by kernel), the sum of GPU kernel time against the wall clock,
and, for DeepSpeed, the effective ZeRO settings of the engine (`engine._config.zero_config`).
`--legacy-guard` puts back a full host sync before each optimizer step, which the non-finite guard
made before it published its flags behind the forward. Rank 0 reports; lightspeed's setups run
through `Trainer(devices=N)`, the plain loop alone (one GPU).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

# noqa: E402
from speed_single_gpu import LIGHTSPEED, ZERO3_DEFAULTS, UserGPT, _model_cfg, run_plain_deepspeed

import lightspeed as ls  # noqa: E402
from lightspeed.demos.gpt import RandomTokens  # noqa: E402

if (
    os.environ.get("LS_PROFILE_LEGACY_GUARD") == "1"
):  # set by --legacy-guard; inherited by the spawned ranks
    from lightspeed.runtime.guard import NonFiniteGuard

    _should_step = NonFiniteGuard.should_step

    def _synced_should_step(self, grad_norm):
        # the old guard read its flags after the backward: the host waited for it
        torch.cuda.synchronize()
        return _should_step(self, grad_norm)

    NonFiniteGuard.should_step = _synced_should_step

CUDA = torch.cuda.is_available()


class Probe:
    """Called after every step with the engine (or None): times steps, then counts syncs, then
    profiles."""

    def __init__(
        self,
        warmup: int,
        timed: int,
        report: bool,
        trace: str | None = None,
        cprofile: bool = False,
        free_run: bool = False,
    ):
        self.warmup, self.timed, self.report, self.trace, self.cprofile = (
            warmup,
            timed,
            report,
            trace,
            cprofile,
        )
        # no synchronisation before or between the 2 profiled steps: the host runs ahead
        self.free_run = free_run
        self.stamps: list[float] = []
        self.syncs: collections.Counter = collections.Counter()
        self.prof = None
        self.config_printed = False
        self._saved_showwarning = None

    @property
    def total_steps(self) -> int:
        return self.warmup + self.timed + 3 + 2 + 1

    def __call__(self, engine) -> None:
        if CUDA and not (
            self.free_run and len(self.stamps) + 1 - self.warmup - self.timed in (3, 4)
        ):
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())
        k = len(self.stamps)  # steps done
        if k == 1 and engine is not None and self.report:
            zero = engine._config.zero_config.model_dump()
            print("ZERO_CONFIG " + json.dumps(zero, default=str, sort_keys=True), flush=True)
            top = {
                k: v
                for k, v in vars(engine._config).items()
                if isinstance(v, (int, float, str, bool, type(None)))
            }
            print("ENGINE_CONFIG " + json.dumps(top, default=str, sort_keys=True), flush=True)
            print(
                f"OPTIMIZER {type(engine.optimizer).__name__} / "
                f"{type(getattr(engine.optimizer, 'optimizer', None)).__name__}"
            )
        if k == self.warmup + self.timed:
            self._start_python_profile() if self.cprofile else self._start_sync_count()
        elif k == self.warmup + self.timed + 3:
            self._stop_python_profile() if self.cprofile else self._stop_sync_count()
            activities = [torch.profiler.ProfilerActivity.CPU] + (
                [torch.profiler.ProfilerActivity.CUDA] if CUDA else []
            )
            self.prof = torch.profiler.profile(activities=activities)
            self.prof.__enter__()
            self._prof_start = time.perf_counter()
        elif k == self.warmup + self.timed + 5:
            self.prof.__exit__(None, None, None)
            self._prof_wall = time.perf_counter() - self._prof_start
            if self.report:
                self._print()
                if self.trace:
                    self.prof.export_chrome_trace(self.trace)
                    print(trace_summary(self.trace))

    def _start_python_profile(self) -> None:
        import cProfile

        self._py = cProfile.Profile()
        self._py.enable()

    def _stop_python_profile(self) -> None:
        """Rank 0's Python over 3 steps. From Python 3.12 cProfile sees every thread (autograd's,
        which runs the backward's hooks on CUDA, included); before, the thread that started it
        only."""
        import io
        import pstats

        self._py.disable()
        if self.report:
            for key in ("tottime", "cumulative"):
                out = io.StringIO()
                pstats.Stats(self._py, stream=out).strip_dirs().sort_stats(key).print_stats(30)
                print(
                    f"CPROFILE main thread, 3 steps, by {key}:\n"
                    + out.getvalue().split("ncalls", 1)[-1][:6000]
                )

    def _start_sync_count(self) -> None:
        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing" not in str(message):
                return
            frames = [
                f
                for f in traceback.extract_stack()[:-1]
                if "/torch/" not in f.filename and "warnings" not in f.filename
            ]
            where = " <- ".join(
                f"{_short(f.filename)}:{f.lineno}:{f.name}" for f in frames[::-1][:3]
            )
            self.syncs[where] += 1

        self._saved_showwarning = warnings.showwarning
        warnings.showwarning = record
        warnings.simplefilter("always")
        if CUDA:
            torch.cuda.set_sync_debug_mode(1)

    def _stop_sync_count(self) -> None:
        if CUDA:
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._saved_showwarning
        if self.report:
            print(f"SYNCS over 3 steps: {sum(self.syncs.values())}")
            for where, n in self.syncs.most_common(15):
                print(f"  {n:4d}  {where}")

    def _print(self) -> None:
        times = [b - a for a, b in zip(self.stamps, self.stamps[1:])][
            self.warmup - 1 : self.warmup - 1 + self.timed
        ]
        print(
            f"STEP median {statistics.median(times) * 1e3:.1f} ms (min {min(times) * 1e3:.1f}, "
            f"max {max(times) * 1e3:.1f}, {len(times)} steps)"
            + (f"; peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if CUDA else "")
        )
        events = self.prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 1e3
        print(
            f"PROFILE 2 steps: wall {self._prof_wall * 1e3:.1f} ms, GPU kernel time {gpu:.1f} ms "
            f"({gpu / (self._prof_wall * 1e3):.0%} of the wall clock; streams may overlap)"
        )
        print(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
        print(
            events.table(sort_by="self_device_time_total", row_limit=20, max_name_column_width=60)
        )


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _length(intervals) -> float:
    return sum(b - a for a, b in intervals)


def _minus(xs, ys) -> float:
    """Length of the union `xs` not covered by the union `ys` (both sorted, disjoint)."""
    covered, j = 0.0, 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k = j
        while k < len(ys) and ys[k][0] < b:
            covered += max(0.0, min(b, ys[k][1]) - max(a, ys[k][0]))
            k += 1
    return _length(xs) - covered


def trace_summary(path: str) -> str:
    """Rank 0's timeline over the profiled steps, from the chrome trace: how long the GPU ran
    anything, compute kernels, communication (NCCL) kernels, and communication that no compute
    kernel hid; the host's blocking CUDA calls; and the GPU's longest idle gaps with the host op
    that ran at each gap's middle (what the GPU waited for)."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        return "TRACE no GPU kernels"
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" in e["name"].lower()])
    compute = _union(
        [(e["ts"], e["ts"] + e["dur"]) for e in kernels if "nccl" not in e["name"].lower()]
    )
    anything = _union(comm + compute)
    t0, t1 = anything[0][0], anything[-1][1]
    wall = t1 - t0
    lines = [
        f"TRACE window {wall / 1e3:.1f} ms (first to last kernel): GPU busy "
        f"{_length(anything) / wall:.0%}, "
        f"compute {_length(compute) / 1e3:.1f} ms, NCCL {_length(comm) / 1e3:.1f} ms of which not "
        f"under compute {_minus(comm, compute) / 1e3:.1f} ms, "
        f"idle {(wall - _length(anything)) / 1e3:.1f} ms"
    ]
    blocking = collections.Counter()
    blocking_ms = collections.Counter()
    for e in events:
        if e.get("cat") == "cuda_runtime" and (
            "Synchronize" in e["name"] or e["name"] in ("cudaMemcpy", "cudaMemcpyAsync")
        ):
            blocking[e["name"]] += 1
            blocking_ms[e["name"]] += e["dur"] / 1e3
    lines.append(
        "TRACE host CUDA calls that may block: "
        + (", ".join(f"{n} x{blocking[n]} {blocking_ms[n]:.1f} ms" for n in blocking) or "none")
    )
    gaps = [(b[0] - a[1], a[1], b[0]) for a, b in zip(anything, anything[1:]) if b[0] - a[1] > 50]
    cpu_ops = [
        e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "python_function")
    ]
    by_op = collections.Counter()
    for length, a, b in gaps:
        mid = (a + b) / 2
        covering = [e for e in cpu_ops if e["ts"] <= mid <= e["ts"] + e["dur"]]
        outer = min(covering, key=lambda e: e["ts"], default=None)
        inner = max(covering, key=lambda e: e["ts"], default=None)
        key = f"{outer['name'][:50]} > {inner['name'][:50]}" if outer else "(no host op)"
        by_op[key] += length / 1e3
    lines.append(
        f"TRACE GPU idle gaps over 50 us: {len(gaps)}, {sum(g[0] for g in gaps) / 1e3:.1f} ms; by "
        "the host "
        "op at the gap's middle (outermost > innermost):"
    )
    lines += [f"  {ms:7.1f} ms  {k}" for k, ms in by_op.most_common(15)]
    return "\n".join(lines)


def _short(path: str) -> str:
    for marker in ("site-packages/", "src/", "benchmarks/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


class ProbeCallback(ls.Callback):
    def __init__(self, probe: Probe):
        self.probe = probe

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.probe(getattr(trainer.strategy, "engine", None))


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--setup", required=True, help="plain_deepspeed_zero3, or a lightspeed strategy name"
    )
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--timed", type=int, default=10)
    p.add_argument("--legacy-guard", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run with the tiny GPT")
    p.add_argument(
        "--cprofile", action="store_true", help="cProfile rank 0 instead of counting syncs"
    )
    p.add_argument(
        "--trace", help="write rank 0's chrome trace of the profiled steps here, and summarise it"
    )
    p.add_argument(
        "--free-run",
        action="store_true",
        help="no synchronisation between the 2 profiled steps, as in "
        "training (each step otherwise ends in one, which leaves the GPU idle while the next one "
        "starts)",
    )
    args = p.parse_args()
    if (
        args.legacy_guard and os.environ.get("LS_PROFILE_LEGACY_GUARD") != "1"
    ):  # re-run with the patch in place
        os.environ["LS_PROFILE_LEGACY_GUARD"] = "1"
        os.execv(sys.executable, [sys.executable, *sys.argv])
    cfg = _model_cfg(argparse.Namespace(tiny=args.tiny, layers=None))
    rank = int(os.environ.get("RANK", "0"))
    probe = Probe(
        args.warmup,
        args.timed,
        report=rank == 0,
        trace=args.trace,
        cprofile=args.cprofile,
        free_run=args.free_run,
    )
    print(
        f"SETUP {args.setup} devices={args.devices} micro_batch={args.micro_batch} "
        f"legacy_guard={args.legacy_guard}",
        flush=True,
    )
    if args.setup == "plain_deepspeed_zero3":
        device = torch.device("cuda", 0) if CUDA else torch.device("cpu")
        run_plain_deepspeed(
            cfg, args.micro_batch, probe.total_steps, 1, device, ZERO3_DEFAULTS, on_step=probe
        )
        return
    torch.manual_seed(0)
    strategy = (
        LIGHTSPEED[args.setup]() if args.setup in LIGHTSPEED else args.setup
    )  # e.g. deepspeed_stage_3+ds_defaults
    trainer = ls.Trainer(
        strategy=strategy,
        devices=args.devices,
        accelerator="gpu" if CUDA else "cpu",
        precision="bf16-mixed",
        compile="+compile" in args.setup,
        max_steps=probe.total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[ProbeCallback(probe)],
    )
    data = RandomTokens(
        cfg.vocab_size, cfg.block_size, args.micro_batch * args.devices * probe.total_steps
    )
    trainer.fit(UserGPT(cfg), torch.utils.data.DataLoader(data, batch_size=args.micro_batch))


if __name__ == "__main__":
    main()
