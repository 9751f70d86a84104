"""Several GPUs of one host: throughput scaling, parity, memory per GPU, and the model DDP cannot
fit.

    python benchmarks/scaling_multi_gpu.py --devices 2                # every section on 2 GPUs
    python benchmarks/scaling_multi_gpu.py --devices 8 --sections scaling
    python benchmarks/scaling_multi_gpu.py --cpu --tiny --devices 2   # the same code on 2 CPU ranks

On a lent GPU machine run it through benchmarks/gpu.sh (its `suite`, `variants`, `interleaved`,
`parity` and `memory` parts, or `run`), which keeps NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 set, as shared hosts need. Each
measurement is one `Trainer(devices=N)` run in its own process (lightspeed starts the other ranks
itself); rank 0 prints one RESULT line, and this script collects them into tables:

- parity: per-step losses of ddp, ddp_sharded, fsdp and deepspeed_stage_1/2/3 on the same 30 steps,
  against ddp (bf16: relative 2e-2 per step);
- memory: peak memory per GPU of each strategy on a 2.29B GPT (d=2560, 28 layers), beside the ZeRO
  paper's model-state figures (DDP 16Ψ; ZeRO-1 4Ψ+12Ψ/N; ZeRO-2 2Ψ+14Ψ/N; ZeRO-3 16Ψ/N bytes
  for Ψ parameters, before activations);
- scaling: tokens/s per GPU at 1 and N GPUs for ddp, fsdp, deepspeed_stage_2/3, the hand-written
  DeepSpeed ZeRO-3 loops (speed_single_gpu.py's, under torchrun: DeepSpeed's default stage-3
  settings, and tuned) and the hand-written torch DDP loop `plain_ddp`
  (speed_single_gpu.run_plain_ddp, under torchrun; ddp's row gives its ratio to it at N GPUs), each
  pair `--repeats` times round robin (median, spread = (max - min) / median; with `--windows W`
  each run's timed steps give W samples, as in speed_single_gpu.py); efficiency = per-GPU ratio of
  the medians; `--counts` picks the GPU counts (default 1 and N); `--module user` trains the model
  as users write it (speed_single_gpu.py's UserGPT: the user's torch AdamW, no per-step loss
  reduction) instead of the parity module; the first N-GPU run of a strategy that parity already
  made in this invocation is reused;
- fit: the deepest GPT that DDP trains for 5 steps, then deepspeed_stage_3 at N times its
  parameters (and, where plain stage 3 does not fit there, stage 3 with CPU offload). `--cap-gib`
  caps every GPU, to find the edge quickly.

With `--json`, every result is written there as soon as it arrives, so a run cut short keeps what it
measured.

Every rank builds its model directly on cuda:<LOCAL_RANK> (speed_single_gpu.prebuild:
`configure_model` under `with torch.device(...)` before `fit`; ZeRO-3 in zero.Init, which allocates
on the GPU) instead of on the CPU and then moving it: that cuts each process's start-up by the ~10 s
a 1.3B CPU build costs and does not change tok/s. Strategy names take `+` variants (see `variant`),
e.g. `ddp+bf16+ctas8`, `deepspeed_stage_3+prefetch1e8`; the full name is what the tables and the
JSON carry.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import lightspeed as ls  # noqa: E402
from lightspeed.demos.gpt import GPT, SIZES, GPTModule, RandomTokens  # noqa: E402

PARITY = [
    "ddp",
    "ddp_sharded",
    "fsdp",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
]
MEMORY = [
    "ddp",
    "ddp_sharded",
    "fsdp",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
]
SCALING = [
    "ddp",
    "fsdp",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "plain_deepspeed_zero3",
    "plain_deepspeed_zero3_tuned",
    "plain_ddp",
]
PLAIN = (
    "plain_deepspeed_zero3",
    "plain_deepspeed_zero3_tuned",
    "plain_ddp",
)  # hand-written, started with torchrun
# model-state bytes per parameter on each GPU, from the ZeRO paper (mixed precision Adam)
ZERO_BYTES = {
    "ddp": lambda n: 16,
    "ddp_sharded": lambda n: 4 + 12 / n,
    "deepspeed_stage_1": lambda n: 4 + 12 / n,
    "deepspeed_stage_2": lambda n: 2 + 14 / n,
    "deepspeed_stage_3": lambda n: 16 / n,
    "fsdp": lambda n: 16 / n,
}


class Recorder(ls.Callback):
    """Rank 0 keeps each step's loss (averaged over ranks) and time (speed_single_gpu.Clock: CUDA
    events, no host sync)."""

    def __init__(self, strategy_name: str = ""):
        from speed_single_gpu import Clock, resting_gib

        self.resting = resting_gib  # speed_single_gpu's: GPU memory allocated between steps
        self.name = strategy_name
        self.gc_mode = {"gcfreeze", "nogc"} & set(
            strategy_name.split("+")[1:]
        )  # scaling_multi_gpu.py's `+` variants
        self.losses: list[float] = []
        self.clock = Clock()
        self.gc_pauses: list[
            tuple[int, int, float]
        ] = []  # (batch, generation, ms) of each garbage collection
        self.resting_gib = float("nan")  # GPU memory allocated when the last batch ended
        self._gc_start, self._batch = 0.0, 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            self.gc_pauses.append(
                (self._batch, info["generation"], (time.perf_counter() - self._gc_start) * 1e3)
            )

    def on_train_start(self, trainer, module):
        bind_cpus(self.name, trainer.local_rank)
        if (
            self.gc_mode
        ):  # the objects that exist now (model, engines) are never scanned again; or no collection
            gc.collect()
            gc.freeze() if "gcfreeze" in self.gc_mode else gc.disable()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self._batch += 1
        self.clock.stamp(trainer.device)
        self.resting_gib = self.resting(trainer.device)
        if (
            "loss" in trainer.callback_metrics
        ):  # the parity module logs it; the user's module does not
            self.losses.append(float(trainer.callback_metrics["loss"]))


class SyncedLossGPT(GPTModule):
    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log(
            "loss", loss, sync_dist=True
        )  # the global mean, so every strategy reports the same quantity
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(
            self.parameters(),
            lr=1e-4,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            fused=torch.cuda.is_available(),
        )


def model_cfg(args, layers: int | None = None, d: int | None = None):
    base = replace(SIZES["tiny"], vocab_size=256) if args.tiny else SIZES["1.3b"]
    return replace(base, n_layer=layers or base.n_layer, n_embd=d or base.n_embd)


def host_facts(times: list[float], gc_pauses: list | None = None, warmup: int = 0) -> dict:
    """Each timed step (ms), this rank's CPUs and torch threads, and with a Recorder's `gc_pauses`
    the garbage collections in the timed steps: [step, generation, ms] of those over 0.5 ms, and
    their total."""
    facts = {
        "step_ms": [round(t * 1e3, 1) for t in times],
        "cpus": len(os.sched_getaffinity(0)),
        "threads": torch.get_num_threads(),
    }
    if gc_pauses is not None:
        timed = [(b - warmup, g, ms) for b, g, ms in gc_pauses if b >= warmup]
        facts["gc_ms"] = [[b, g, round(ms, 1)] for b, g, ms in timed if ms > 0.5]
        facts["gc_total_ms"] = round(sum(ms for _, _, ms in timed), 1)
    return facts


def run_plain(args, cfg) -> dict:
    """One rank of a hand-written loop (started by torchrun): DeepSpeed ZeRO-3, or torch DDP for
    `plain_ddp`; each rank trains on its own random tokens (seed = rank). Rank 0 returns the
    figures."""
    from speed_single_gpu import (
        ZERO3_DEFAULTS,
        resting_gib,
        run_plain_ddp,
        run_plain_deepspeed,
        windows,
        zero3_tuned,
    )

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if args.cpu else torch.device("cuda", local)
    bind_cpus(args.strategy, local)
    steps = args.warmup + args.steps
    rest = [float("nan")]  # the ZeRO-3 loops: memory between steps, as Recorder.resting_gib
    if _base(args.strategy) == "plain_ddp":
        times = run_plain_ddp(cfg, args.micro_batch, steps, args.warmup, device, seed=rank)
    else:
        zero = zero3_tuned(cfg) if _base(args.strategy).endswith("_tuned") else ZERO3_DEFAULTS
        opts = args.strategy.split("+")[
            1:
        ]  # +dc / +dceager: DeepCompile with inductor / eager (run_plain_deepspeed)
        dc = "inductor" if "dc" in opts else "eager" if "dceager" in opts else None
        times = run_plain_deepspeed(
            cfg,
            args.micro_batch,
            steps,
            args.warmup,
            device,
            zero,
            seed=rank,
            deepcompile=dc,
            on_step=lambda engine: rest.append(resting_gib(device)),
        )
    if rank != 0:
        return {}
    with torch.device("meta"):
        n_params = GPT(cfg).num_params()
    step_s = statistics.median(times)
    tokens = args.micro_batch * cfg.block_size
    return {
        "strategy": args.strategy,
        "devices": args.devices,
        "params": n_params,
        "losses": [],
        "tok_s_per_gpu": tokens / step_s,
        "step_s": step_s,
        "window_tok_s": [tokens / w for w in windows(times, args.windows)],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if not args.cpu else float("nan"),
        "resting_gib": rest[-1],
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "nccl_max_ctas": os.environ.get("NCCL_MAX_CTAS"),
        "nccl_proto": os.environ.get("NCCL_PROTO"),
        "zero3_fetch": FETCH or None,
        "cpus_bound": BOUND or None,
        **host_facts(times),
    }


def run_one(args) -> dict:
    """One Trainer run on `args.devices` ranks; rank 0 returns the figures."""
    cfg = model_cfg(args, args.layers, args.d)
    if _base(args.strategy) in PLAIN:
        return run_plain(args, cfg)
    # Rank 0 is this process (LOCAL_RANK unset); lightspeed starts the others with LOCAL_RANK set.
    device = (
        torch.device("cpu")
        if args.cpu
        else torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    )
    if (
        args.cap_gib and not args.cpu
    ):  # every rank caps its own GPU (the Trainer picks cuda:<local rank>)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    strategy, leaf = variant(args.strategy)
    if (
        "nobeat" in args.strategy.split("+")[1:]
    ):  # no heartbeat thread in any rank (lightspeed.runtime.heartbeat)
        import lightspeed.runtime.heartbeat

        lightspeed.runtime.heartbeat.start = lambda *a, **k: None
    ls.seed_everything(0)
    rec = Recorder(args.strategy)
    steps = args.warmup + args.steps
    data = RandomTokens(cfg.vocab_size, cfg.block_size, args.micro_batch * args.devices * steps)
    trainer = ls.Trainer(
        strategy=strategy,
        devices=args.devices,
        accelerator="cpu" if args.cpu else "gpu",
        precision="32-true" if args.cpu else "bf16-mixed",
        max_steps=steps,
        seed=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[rec],
    )
    if args.module == "user":
        from speed_single_gpu import UserGPT

        class LeafGPT(
            UserGPT
        ):  # ZeRO-3 fetches each Block's parameters at once: one hook per block
            def configure_model(self):
                super().configure_model()
                _mark_leaf(self)

        module = LeafGPT(cfg) if leaf else UserGPT(cfg)
    else:
        module = SyncedLossGPT(cfg)
    from speed_single_gpu import kept, prebuild

    built = prebuild(
        module, trainer.strategy, device
    )  # on cuda:<local rank>; CPU runs and ZeRO-3 unchanged
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=args.micro_batch))
    if not trainer.is_global_zero:
        return {}
    with torch.device("meta"):
        n_params = GPT(cfg).num_params()
    times = rec.clock.step_times(args.warmup)
    step_s = statistics.median(times)
    from speed_single_gpu import windows

    tokens = args.micro_batch * cfg.block_size
    return {
        "strategy": args.strategy,
        "devices": args.devices,
        "params": n_params,
        "losses": rec.losses,
        "prebuilt": kept(module, built),
        "tok_s_per_gpu": tokens / step_s,
        "step_s": step_s,
        "window_tok_s": [tokens / w for w in windows(times, args.windows)],
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if not args.cpu else float("nan"),
        "resting_gib": rec.resting_gib,
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "nccl_max_ctas": os.environ.get("NCCL_MAX_CTAS"),
        "nccl_proto": os.environ.get("NCCL_PROTO"),
        "zero3_fetch": FETCH or None,
        "cpus_bound": BOUND or None,
        **host_facts(times, rec.gc_pauses, args.warmup),
    }


def _mark_leaf(module) -> None:
    from deepspeed.utils import set_z3_leaf_modules

    from lightspeed.demos.gpt import Block

    set_z3_leaf_modules(module, [Block])


def _base(name: str) -> str:
    """The strategy name without its `+` variants."""
    return name.split("+")[0]


# hiprio: high-priority NCCL streams (environment only, `nccl_env`); gcfreeze/nogc: Python's garbage
# collector
# frozen over the objects that exist when training starts, or off (Recorder); nobeat: no heartbeat
# thread (run_one);
# protoSimple/protoLL128/protoLL: NCCL_PROTO (`nccl_env`)
# numanode/numasocket/numaexclusive: every rank bound to the CPUs near its GPU (`bind_cpus`,
# torch.numa's modes,
# what `torchrun --numa-binding` applies)
ANY_OPTIONS = (
    "hiprio",
    "gcfreeze",
    "nogc",
    "nobeat",
    "protoSimple",
    "protoLL128",
    "protoLL",
    "numanode",
    "numasocket",
    "numaexclusive",
)
OPTIONS = {
    "ddp": ("bucket", "static", "bf16"),
    "fsdp": ("bf16reduce",),
    "deepspeed_stage_3": ("leaf", "prefetch", "nomeml", "dc", "events", "fastleaf", "bucket"),
    "plain_deepspeed_zero3": ("dc", "dceager"),
    "plain_deepspeed_zero3_tuned": ("dc", "dceager"),
}


def check_name(name: str) -> None:
    """Raises ValueError for a `+` option `variant`/`nccl_env` would not apply (a typo would measure
    the default)."""
    base, *opts = name.split("+")
    for o in opts:
        m = re.fullmatch(r"(bucket|prefetch|ctas|events)([0-9.e]+)", o)
        try:
            ok = (
                m
                and float(m[2]) > 0
                and (m[1] == "ctas" and m[2].isdigit() or m[1] in OPTIONS.get(base, ()))
                or o in OPTIONS.get(base, ())
                and o not in ("bucket", "prefetch", "events")
                or o in ANY_OPTIONS
            )
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"strategy {name!r}: unknown or malformed option {o!r}; accepted: +ctasN and "
                f"+{', +'.join(ANY_OPTIONS)} on any strategy, and for {base!r}: "
                f"{', '.join(OPTIONS.get(base, ())) or 'none'}"
            )


def nccl_env(name: str) -> dict[str, str]:
    """The environment a variant sets in every process of its run, before any process group exists:
    `+ctasN` -> NCCL_MAX_CTAS=N (any strategy, the hand-written loops included); `+hiprio` ->
    TORCH_NCCL_HIGH_PRIORITY=1; `+protoSimple` -> NCCL_PROTO=Simple."""
    env = {}
    for o in name.split("+")[1:]:
        if o.startswith("ctas"):
            env["NCCL_MAX_CTAS"] = str(int(o[len("ctas") :]))
        elif o == "hiprio":
            env["TORCH_NCCL_HIGH_PRIORITY"] = "1"
        elif o.startswith("proto"):
            env["NCCL_PROTO"] = o[len("proto") :]
    return env


def variant(name: str):
    """Experimental settings behind a strategy name (every rank parses the same command line),
    combinable: `ddp+bucketN` (bucket_cap_mb=N), `ddp+static`, `ddp+bf16` (comm_hook='bf16'),
    `fsdp+bf16reduce` (gradients reduce-scattered in bf16), `deepspeed_stage_3+leaf` (each Block one
    ZeRO-3 leaf module), `deepspeed_stage_3+prefetchN`
    (zero_optimization.stage3_prefetch_bucket_size=N, e.g. 1e8, through DeepSpeed(config=...)),
    `deepspeed_stage_3+nomeml` (memory_efficient_linear off: torch's own Linear),
    `deepspeed_stage_3+dc` (DeepSpeed's DeepCompile: `DeepSpeed(stage=3, deepcompile=True)`),
    `deepspeed_stage_3+bucketN` (`DeepSpeed(stage=3, reduce_bucket_size=N)`), and `+ctasN` on any
    name (NCCL_MAX_CTAS=N, set by `_launch`: see `nccl_env`). ZeRO-3's parameter fetches:
    `deepspeed_stage_3+eventsN` lets the host queue N fetch events before it waits on the oldest
    (DeepSpeed's coordinator waits after 2), `deepspeed_stage_3+fastleaf` takes DeepSpeed's fast
    fetch for the leaf blocks (no fetch events, no record_stream: what
    `stage3_module_granularity_threshold` turns on for the leaves it picks). Returns (strategy,
    leaf)."""
    base, *opts = name.split("+")
    events = [int(float(o[len("events") :])) for o in opts if o.startswith("events")]
    if base == "deepspeed_stage_3" and (events or "fastleaf" in opts):
        patch_fetch(events[0] if events else None, "fastleaf" in opts)
    zero = {
        "stage3_prefetch_bucket_size": int(float(o[len("prefetch") :]))
        for o in opts
        if o.startswith("prefetch")
    }
    if "nomeml" in opts:
        zero["memory_efficient_linear"] = False
    if (
        base == "deepspeed_stage_3" and "dc" in opts
    ):  # DeepSpeed's DeepCompile (the strategy's deepcompile flag)
        return ls.DeepSpeed(
            stage=3, deepcompile=True, config={"zero_optimization": zero} if zero else None
        ), False
    buckets = [int(float(o[len("bucket") :])) for o in opts if o.startswith("bucket")]
    if base == "deepspeed_stage_3" and (
        zero or buckets
    ):  # +bucketN: reduce_bucket_size=N (elements)
        return ls.DeepSpeed(
            stage=3,
            config={"zero_optimization": zero} if zero else None,
            **({"reduce_bucket_size": buckets[0]} if buckets else {}),
        ), "leaf" in opts
    if base == "ddp" and opts:
        kw = {}
        for o in opts:
            if o.startswith("bucket"):
                kw["bucket_cap_mb"] = float(o[len("bucket") :])
            elif o == "static":
                kw["static_graph"] = True
            elif o == "bf16":
                kw["comm_hook"] = "bf16"
        return (ls.DDP(**kw) if kw else base), False
    if base == "fsdp" and "bf16reduce" in opts:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        import lightspeed.strategies.fsdp as fsdp_mod

        fsdp_mod.build_mp_policy = lambda precision: MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16
        )
        return "fsdp", False
    return base, "leaf" in opts


# bind_cpus: the mode and the CPUs this rank was bound to (a run's JSON carries rank 0's)
BOUND: dict = {}


def bind_cpus(name: str, local_rank: int) -> None:
    """`+numaMODE` (node, socket, exclusive): binds every thread of this process to the CPUs
    torch.numa picks for GPU `local_rank` in that mode, as `torchrun --numa-binding=MODE` does for
    its workers. Called once the ranks exist (a lightspeed rank 0 binds after it has started the
    others, which would otherwise inherit its CPUs)."""
    modes = [o[len("numa") :] for o in name.split("+")[1:] if o.startswith("numa")]
    if not modes:
        return
    from torch.numa.binding import (
        AffinityMode,
        NumaOptions,
        _maybe_apply_numa_binding_to_current_process,
    )

    before = len(os.sched_getaffinity(0))
    _maybe_apply_numa_binding_to_current_process(
        gpu_index=local_rank, numa_options=NumaOptions(AffinityMode(modes[0]))
    )
    cpus = sorted(os.sched_getaffinity(0))
    BOUND.update(mode=modes[0], cpus=f"{len(cpus)} of {before}: {cpus[0]}..{cpus[-1]}")


FETCH: dict = {}  # what patch_fetch set on the coordinator this run built (a run's JSON carries it)


def patch_fetch(events: int | None, fast: bool) -> None:
    """Changes DeepSpeed's ZeRO-3 parameter coordinator in this process (every rank parses the same
    name): its limit of queued fetch events (`events`) and its fast fetch of leaf modules
    (`fast`)."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    init = ppc.PartitionedParameterCoordinator.__init__

    def patched(self, *a, **kw):
        if fast:
            kw["fast_sharding_for_leaf_module"] = True
        init(self, *a, **kw)
        if events is not None:
            self._PartitionedParameterCoordinator__max_ongoing_fetch_events = events
        FETCH.update(
            fast_leaf=self.fast_sharding_for_leaf_module,
            events=self._PartitionedParameterCoordinator__max_ongoing_fetch_events,
        )

    ppc.PartitionedParameterCoordinator.__init__ = patched


RESULTS: dict[str, dict] = {}  # every run of this invocation, keyed by its command line


def launch(
    args,
    strategy: str,
    devices: int,
    extra: list[str] | None = None,
    timeout: float = 900,
    repeat: int = 0,
) -> dict:
    """Runs one measurement in its own process (or returns the identical one already made) and
    records it; `repeat` > 0 asks for another run of the same command."""
    key = " ".join(
        [
            strategy,
            str(devices),
            str(args.steps),
            str(args.warmup),
            str(args.micro_batch),
            *(extra or []),
        ]
    )
    key += f" #{repeat + 1}" if repeat else ""
    if key in RESULTS:
        return RESULTS[key]
    started = time.perf_counter()
    result = _launch(args, strategy, devices, extra, timeout) | {
        "wall_s": round(time.perf_counter() - started, 1)
    }
    print(
        f"[scaling_multi_gpu] {key}: "
        + json.dumps({k: v for k, v in result.items() if k != "losses"}),
        file=sys.stderr,
        flush=True,
    )
    RESULTS[key] = result
    if args.json:
        from speed_single_gpu import write_json

        write_json(args.json, RESULTS)
    return result


def _launch(args, strategy: str, devices: int, extra: list[str] | None, timeout: float) -> dict:
    from speed_single_gpu import for_setup

    warmup, timeout = for_setup(strategy, args.warmup, timeout)
    # The hand-written loops are started as users start them: torchrun, one process per GPU.
    start = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(devices),
            "--",
        ]
        if _base(strategy) in PLAIN
        else [sys.executable]
    )
    cmd = [
        *start,
        __file__,
        "--run",
        "--strategy",
        strategy,
        "--devices",
        str(devices),
        "--steps",
        str(args.steps),
        "--warmup",
        str(warmup),
        "--micro-batch",
        str(args.micro_batch),
        "--windows",
        str(args.windows),
        "--module",
        args.module,
        *(["--cpu"] if args.cpu else []),
        *(["--tiny"] if args.tiny else []),
        *(["--cap-gib", str(args.cap_gib)] if args.cap_gib else []),
        *(extra or []),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "NVSHMEM_DISABLE_NVLS": "1",
        **nccl_env(strategy),
    }
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {
            "strategy": strategy,
            "devices": devices,
            "error": f"timed out after {timeout:.0f}s",
        }
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :]) | {"warmup": warmup}
    oom = "out of memory" in proc.stderr.lower()
    return {
        "strategy": strategy,
        "devices": devices,
        "error": "OOM" if oom else " | ".join(proc.stderr.strip().splitlines()[-2:])[-300:],
    }


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*r)
    Console(width=140).print(table)


def parity(args) -> list[dict]:
    results = [launch(args, s, args.devices) for s in args.strategies or PARITY]
    ref = results[0].get("losses")
    rows = []
    for r in results:
        if "error" in r or not ref:
            rows.append([r["strategy"], r.get("error", "no reference"), ""])
            continue
        worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref))
        rows.append([r["strategy"], f"{worst:.2e}", "ok" if worst <= args.parity_rtol else "FAIL"])
    _table(
        f"Parity on {args.devices} devices: worst per-step relative loss difference vs ddp, "
        f"{len(ref or [])} steps",
        ["strategy", "max rel. diff", f"≤ {args.parity_rtol:g}"],
        rows,
    )
    return results


def memory(args) -> list[dict]:
    layers, d = (None, None) if args.tiny else (28, 2560)  # 2.29B parameters
    extra = [] if args.tiny else ["--layers", str(layers), "--d", str(d)]
    saved = (args.steps, args.warmup)
    args.steps, args.warmup = (
        4,
        1,
    )  # the peak is reached in the first optimizer step; no timing here
    results = [launch(args, s, args.devices, extra) for s in args.strategies or MEMORY]
    args.steps, args.warmup = saved
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["strategy"], r["error"], "", ""])
            continue
        states = ZERO_BYTES[_base(r["strategy"])](args.devices) * r["params"] / 2**30
        rows.append(
            [r["strategy"], f"{r['params'] / 1e9:.2f}B", f"{r['peak_gib']:.1f}", f"{states:.1f}"]
        )
    _table(
        f"Peak memory per GPU on {args.devices} GPUs",
        ["strategy", "params", "peak GiB (measured)", "model states GiB (ZeRO formula)"],
        rows,
    )
    return results


def scaling(args) -> list[dict]:
    strategies = args.strategies or SCALING
    for s in strategies:  # before any run: a typo would otherwise cost a run of the default
        check_name(s)
    runs: dict[tuple[str, int], list[dict]] = {}
    counts = [int(c) for c in args.counts.split(",")] if args.counts else [1, args.devices]
    for repeat in range(
        args.repeats
    ):  # round robin, so drift over the session spreads over every setup alike
        for s in strategies:
            for n in counts:
                runs.setdefault((s, n), []).append(
                    launch(args, s, n, timeout=args.per_run_timeout, repeat=repeat)
                )
    if counts != [
        1,
        args.devices,
    ]:  # no efficiency without both ends; speed_single_gpu / suite_table.py pair them
        return [r for v in runs.values() for r in v]
    med = {k: _median(v) for k, v in runs.items()}
    z3 = med.get(("plain_deepspeed_zero3", args.devices))
    plain_ddp = med.get(("plain_ddp", args.devices))
    rows = []
    for s in strategies:
        one, many = med[(s, 1)], med[(s, args.devices)]
        if one is None or many is None:
            errors = [
                r.get("error", "") for r in runs[(s, 1)] + runs[(s, args.devices)] if "error" in r
            ]
            rows.append([s, errors[0] if errors else "no run", "", "", "", ""])
            continue
        vs_z3 = f"{many[0] / z3[0]:.3f}" if z3 else "-"
        vs_ddp = f"{many[0] / plain_ddp[0]:.3f}" if plain_ddp and _base(s) == "ddp" else "-"
        rows.append(
            [
                s,
                f"{one[0]:,.0f} ±{one[1]:.0%}",
                f"{many[0]:,.0f} ±{many[1]:.0%}",
                f"{many[0] / one[0]:.2f}",
                vs_z3,
                vs_ddp,
            ]
        )
    _table(
        f"Tokens/s per GPU, 1 vs {args.devices} GPUs, median of {args.repeats} runs "
        "± spread (max - min) / median (target efficiency ≥ 0.95)",
        [
            "strategy",
            "1 GPU",
            f"{args.devices} GPUs",
            "efficiency",
            f"× DS Z3 loop ({args.devices} GPUs)",
            f"× plain DDP loop ({args.devices} GPUs)",
        ],
        rows,
    )
    return [r for v in runs.values() for r in v]


def _median(results: list[dict]) -> tuple[float, float] | None:
    """(median tokens/s per GPU, spread (max - min) / median) over the samples of the runs that
    succeeded (every window of every run, with `--windows` > 1), or None."""
    done = [r for r in results if "tok_s_per_gpu" in r]
    ok = (
        [w for r in done for w in r.get("window_tok_s", [])]
        if all(len(r.get("window_tok_s", [])) > 1 for r in done)
        else [r["tok_s_per_gpu"] for r in done]
    )
    if not ok:
        return None
    m = statistics.median(ok)
    return m, (max(ok) - min(ok)) / m


def _params(args, layers: int) -> int:
    with torch.device("meta"):
        return GPT(model_cfg(args, layers)).num_params()


def largest(args) -> list[dict]:
    """The deepest GPT DDP trains (5 steps, micro-batch 1), then ZeRO-3 at devices× its
    parameters."""
    saved = (args.steps, args.warmup, args.micro_batch)
    args.steps, args.warmup, args.micro_batch = 4, 1, 1
    lo, hi, best, fail = args.fit_lo, args.fit_hi, None, None
    while lo <= hi:  # bisection on depth; each probe is its own N-rank process
        mid = (lo + hi) // 2
        r = launch(args, "ddp", args.devices, ["--layers", str(mid)]) | {"layers": mid}
        if "error" in r:
            fail, hi = r, mid - 1
        else:
            best, lo = r, mid + 1
    results = [r for r in (best, fail) if r is not None]
    if best:
        layers = best["layers"]
        while _params(args, layers) < args.devices * best["params"]:
            layers += 1
        for strategy in ("deepspeed_stage_3", "deepspeed_stage_3_offload"):
            r = launch(args, strategy, args.devices, ["--layers", str(layers)]) | {"layers": layers}
            results.append(r)
            if "error" not in r:
                break
    args.steps, args.warmup, args.micro_batch = saved
    cap = f", each GPU capped at {args.cap_gib:g} GiB" if args.cap_gib else ""
    _table(
        f"Largest GPT on {args.devices} GPUs (micro-batch 1, 5 steps{cap})",
        ["strategy", "layers", "params", "× DDP's largest", "s/step", "result"],
        [
            [
                r["strategy"],
                str(r["layers"]),
                f"{_params(args, r['layers']) / 1e9:.2f}B",
                f"{_params(args, r['layers']) / best['params']:.2f}" if best else "-",
                f"{r['step_s']:.2f}" if "step_s" in r else "-",
                r.get("error", "trains"),
            ]
            for r in results
        ],
    )
    return results


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--sections", default="parity,memory,scaling,fit")
    p.add_argument(
        "--strategies", type=lambda v: v.split(","), help="comma-separated; default: each section's"
    )
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--layers", type=int)
    p.add_argument("--d", type=int)
    p.add_argument("--parity-rtol", type=float, default=2e-2)
    p.add_argument(
        "--repeats", type=int, default=3, help="scaling: runs of each (strategy, GPU count)"
    )
    p.add_argument(
        "--windows", type=int, default=1, help="scaling: timed windows per run (samples)"
    )
    p.add_argument("--counts", help="scaling: comma-separated GPU counts (default 1 and --devices)")
    p.add_argument(
        "--module",
        choices=("parity", "user"),
        default="parity",
        help="scaling: the parity module or the model as users write it",
    )
    p.add_argument(
        "--per-run-timeout", type=float, default=900, help="scaling: seconds before a run is killed"
    )
    p.add_argument(
        "--cap-gib", type=float, help="cap each GPU's memory (set_per_process_memory_fraction)"
    )
    p.add_argument("--fit-lo", type=int, default=4, help="fit: fewest layers DDP is tried at")
    p.add_argument("--fit-hi", type=int, default=200, help="fit: most layers DDP is tried at")
    p.add_argument("--cpu", action="store_true", help="gloo ranks on CPU (fp32)")
    p.add_argument("--tiny", action="store_true", help="the tiny GPT")
    p.add_argument("--json", help="also write every result here")
    args = p.parse_args()
    if args.run:
        result = run_one(args)
        if result:
            print("RESULT " + json.dumps(result), flush=True)
        return
    sections = {"parity": parity, "memory": memory, "scaling": scaling, "fit": largest}
    for name in args.sections.split(","):
        sections[name](args)


if __name__ == "__main__":
    main()
