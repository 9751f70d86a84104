"""Speed on one GPU: every lightspeed strategy side by side with hand-written PyTorch and DeepSpeed
loops, on the same 1.28B GPT; also the largest model under a memory cap and the offloaded step.

    python benchmarks/speed_single_gpu.py                    # the full table on one GPU (bf16)
    python benchmarks/speed_single_gpu.py --only plain_pytorch,deepspeed_stage_2
    python benchmarks/speed_single_gpu.py --only fast_defaults --repeats 3
                                                 # the fused / compile / ZeRO-3 setups
    python benchmarks/speed_single_gpu.py --memory-cap 16    # largest GPT under a 16 GiB cap
    python benchmarks/speed_single_gpu.py --offload-speed --memory-cap 16 --layers 80
    python benchmarks/speed_single_gpu.py --tiny             # CPU smoke run (used by the tests)

On a lent GPU machine run it through benchmarks/gpu.sh (its `speed`, `single`, `compile` and
`largest` parts, or `run`), which sets up the environment.

Each configuration runs in its own subprocess (clean memory, clean peak statistics) on the same GPT
(d=2048, 24 layers, 16 heads, vocab 32000, seq 1024, micro-batch 8, random tokens). Warm-up steps
are excluded; the figure is the median step time of the timed steps. Each setup runs `--repeats`
times (round robin over the setups, so drift spreads evenly); the table gives the median run and the
spread (max - min) / median. With `--windows W` each run's timed steps are also cut into W
consecutive windows, each window's median step a sample of its own, so one process gives W samples
(the median and spread are then over every window of every run). MFU counts 6·N + 12·L·d·T FLOPs
per token (N without the position embedding) against 989 TFLOP/s (H100/H200 dense bf16).

Every model is built directly on its device (`with torch.device(device)`; ZeRO-3 in DeepSpeed's
`zero.Init`, which allocates on the GPU too) rather than on the CPU and then moved: that cuts each
process's start-up by the ~10 s a 1.3B CPU build costs and does not change tok/s. The user's module
code is unchanged: its `configure_model` (where GPTModule builds the GPT) runs under the device
before `fit`, so the Trainer finds the model on its device; ZeRO-3 and FSDP-from-meta are left to
lightspeed's own construction (see `prebuild`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import lightspeed as ls  # noqa: E402
from lightspeed.demos.gpt import GPT, SIZES, Block, GPTModule, RandomTokens  # noqa: E402

PEAK_FLOPS = 989e12
# Trainer(compile=...) of the "+autotune", "+cdt" (inductor's coordinate-descent tuning of its
# kernels) and
# "+cudagraphs" setups (torch.compile's "reduce-overhead": the compiled step replayed as CUDA
# graphs)
COMPILE = {
    "autotune": {"mode": "max-autotune-no-cudagraphs"},
    "cdt": {"options": {"coordinate_descent_tuning": True}},
    "cudagraphs": {"mode": "reduce-overhead"},
}


def _stage3_torch_linear():
    return ls.DeepSpeed(stage=3, config={"zero_optimization": {"memory_efficient_linear": False}})


LIGHTSPEED = {
    "single": lambda: "single",
    "single+compile": lambda: "single",
    "single+compile+loss": lambda: (
        "single"
    ),  # the cross-entropy inside the compiled forward (LossInForwardGPT)
    # "+user": the model as users write it (UserGPT: torch AdamW without fused=, training_step calls
    # self.model);
    # "+as_written": Trainer(optimizer_kernels="as_written"), the optimizer exactly as written.
    "single+user": lambda: "single",
    "single+user+as_written": lambda: "single",
    "single+user+compile": lambda: "single",
    "single+user+compile+autotune": lambda: (
        "single"
    ),  # compile={"mode": "max-autotune-no-cudagraphs"}
    # "+cudnn": attention on cuDNN's kernel only (sdpa_kernel around fit), instead of torch's
    # default choice
    "single+user+cudnn": lambda: "single",
    "single+user+compile+cudnn": lambda: "single",
    # Probes of the single-device step, for measurement only (`probe` patches lightspeed in the
    # run's process):
    # "+readnow": the host reads the guard's verdict right after queuing the optimizer step (a sync
    # per step; the
    # behaviour before the verdict was read a step later); "+nonorm": no pass over the gradients for
    # the guard's
    # norm (it sees a zero norm), to price that pass.
    "single+user+readnow": lambda: "single",
    "single+user+nonorm": lambda: "single",
    "single+user+compile+nonorm": lambda: "single",
    "single+user+compile+regional": lambda: "single",  # block by block, not the GPT whole (`probe`)
    "single+user+compile+cdt": lambda: (
        "single"
    ),  # compile={"options": {"coordinate_descent_tuning": True}}
    "single+user+compile+cudagraphs": lambda: "single",  # compile={"mode": "reduce-overhead"}
    "deepspeed_stage_2+user": lambda: "deepspeed_stage_2",
    "deepspeed_stage_2+user+as_written": lambda: "deepspeed_stage_2",
    "deepspeed_stage_3+user": lambda: "deepspeed_stage_3",
    "deepspeed_stage_2+user+compile": lambda: "deepspeed_stage_2",
    "deepspeed_stage_3+user+compile": lambda: "deepspeed_stage_3",
    "fsdp+user": lambda: "fsdp",
    "ddp+user": lambda: "ddp",  # DDP in a group of one: the one-GPU end of the scaling table
    "fsdp+user+compile": lambda: "fsdp",
    # DeepSpeed's own nn.functional.linear off (a Python autograd function per Linear): host time vs
    # memory
    "deepspeed_stage_3+user+nomeml": _stage3_torch_linear,
    # DeepSpeed's DeepCompile: ZeRO-3's gathers and reductions inside one compiled graph, no module
    # hooks
    "deepspeed_stage_3+user+dc": lambda: ls.DeepSpeed(stage=3, deepcompile=True),
    "deepspeed_stage_3+nomeml": _stage3_torch_linear,
    # lightspeed's stage 3 with the same zero_optimization settings as the two hand-written ZeRO-3
    # loops
    "deepspeed_stage_3+ds_defaults": lambda: ls.DeepSpeed(
        stage=3, config={"zero_optimization": ZERO3_DEFAULTS}
    ),
    "deepspeed_stage_3+tuned": lambda: ls.DeepSpeed(
        stage=3, config={"zero_optimization": zero3_tuned(SIZES["1.3b"])}
    ),
    "deepspeed_stage_1": lambda: "deepspeed_stage_1",
    "deepspeed_stage_2": lambda: "deepspeed_stage_2",
    "deepspeed_stage_2+ac": lambda: ls.DeepSpeed(stage=2, activation_checkpointing=[Block]),
    "deepspeed_stage_3": lambda: "deepspeed_stage_3",
    "deepspeed_stage_3+ac": lambda: ls.DeepSpeed(stage=3, activation_checkpointing=[Block]),
    "deepspeed_stage_2_offload": lambda: "deepspeed_stage_2_offload",
    "fsdp": lambda: "fsdp",
    "fsdp+ac": lambda: ls.FSDP(activation_checkpointing=[Block]),
    "fsdp_grad_op": lambda: "fsdp_grad_op",
    # Used by the memory-cap search only:
    "deepspeed_stage_3_offload_full": lambda: "deepspeed_stage_3_offload",
    "fsdp_offload": lambda: ls.FSDP(cpu_offload=True),
    "deepspeed_stage_3_offload_full+ac": lambda: ls.DeepSpeed(
        stage=3, offload_optimizer="cpu", offload_params="cpu", activation_checkpointing=[Block]
    ),
    "deepspeed_stage_3_offload_opt+ac": lambda: ls.DeepSpeed(
        stage=3, offload_optimizer="cpu", activation_checkpointing=[Block]
    ),
    # The same without page-locked host buffers: torch rounds every pinned allocation up to a power
    # of two, so
    # DeepSpeed's multi-GiB flat buffers can take up to twice their size; pageable memory costs
    # transfer speed.
    "deepspeed_stage_3_offload_opt+ac+unpinned": lambda: ls.DeepSpeed(
        stage=3, offload_optimizer="cpu", activation_checkpointing=[Block], pin_memory=False
    ),
    "deepspeed_stage_3_offload_full+ac+unpinned": lambda: ls.DeepSpeed(
        stage=3,
        offload_optimizer="cpu",
        offload_params="cpu",
        activation_checkpointing=[Block],
        pin_memory=False,
    ),
}
# The offloaded step at a fixed size under the cap, a global batch of 8 sequences per optimizer
# step, three ways:
# (name, micro-batch, accumulation)
OFFLOAD_VARIANTS = [
    (
        "deepspeed_stage_3_offload_full",
        1,
        8,
    ),  # the plain configuration: micro-batch 1, 8 accumulation steps
    (
        "deepspeed_stage_3_offload_full+ac",
        8,
        1,
    ),  # one micro-batch of 8: the CPU optimizer and transfers amortised
    (
        "deepspeed_stage_3_offload_opt+ac",
        8,
        1,
    ),  # parameters stay on the GPU when they fit: offload only Adam
]
# The plain loop, eager and under torch.compile (run_plain_pytorch says how), the reference for
# compile=True
PLAIN_COMPILE = {
    "plain_pytorch": "",
    "plain_pytorch+compile": "model",
    "plain_pytorch+compile+loss": "loss",
    "plain_pytorch+compile+loss+cudagraphs": "loss+cudagraphs",
}
BASELINES = [
    "plain_pytorch",
    "plain_deepspeed_zero2",
    "plain_deepspeed_zero3",
    "plain_deepspeed_zero3_tuned",
]
# DeepSpeed 0.19's own stage-3 defaults, written out (deepspeed/runtime/zero/config.py): what a
# hand-written loop
# with {"stage": 3} gets. Lightspeed's build_config differs (overlap_comm false, persistence
# threshold 0).
ZERO3_DEFAULTS = {
    "stage": 3,
    "overlap_comm": True,
    "contiguous_gradients": True,
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}


def zero3_tuned(cfg) -> dict:
    """Stage-3 settings sized to the model the way the HF/DeepSpeed integration sizes its "auto"
    values (buckets of d² elements, prefetch 0.9·d², parameters under 10·d kept whole), with
    communication overlapped."""
    d = cfg.n_embd
    return {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": d * d,
        "stage3_prefetch_bucket_size": int(0.9 * d * d),
        "stage3_param_persistence_threshold": 10 * d,
        "stage3_max_live_parameters": 1_000_000_000,
        "stage3_max_reuse_distance": 1_000_000_000,
    }


# Named groups for --only.
GROUPS = {
    "fast_defaults": [
        "plain_pytorch",
        "single+user+as_written",
        "single+user",
        "single+user+compile",
        "plain_deepspeed_zero2",
        "deepspeed_stage_2+user+as_written",
        "deepspeed_stage_2+user",
        "plain_deepspeed_zero3",
        "plain_deepspeed_zero3_tuned",
        "deepspeed_stage_3+user",
        "deepspeed_stage_3+ds_defaults",
        "deepspeed_stage_3+tuned",
    ],
    # compile=True under each kind of wrapper (ZeRO-3's per-submodule hooks break the compiled
    # blocks into pieces)
    "compile": [
        "single+user",
        "single+user+compile",
        "deepspeed_stage_2+user",
        "deepspeed_stage_2+user+compile",
        "deepspeed_stage_3+user",
        "deepspeed_stage_3+user+compile",
        "fsdp+user",
        "fsdp+user+compile",
    ],
}
ALL = BASELINES + [
    n
    for n in LIGHTSPEED
    if "offload_full" not in n and "offload_opt" not in n and n != "fsdp_offload"
]
CAP_SEARCH = {
    "plain_pytorch": (12, 40),
    "deepspeed_stage_3_offload_full": (48, 128),
    "fsdp_offload": (24, 96),
}


def flops_per_token(model: GPT) -> float:
    c = model.cfg
    n = model.num_params() - model.wpe.weight.numel()
    return 6 * n + 12 * c.n_layer * c.n_embd * c.block_size


class FusedAdamGPT(GPTModule):
    """The demo module with fused AdamW on CUDA, as a speed-minded user would write it (both loops
    use it)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(
            self.parameters(),
            lr=1e-4,
            betas=(0.9, 0.95),
            weight_decay=0.1,
            fused=torch.cuda.is_available(),
        )


class LossInForwardGPT(FusedAdamGPT):
    """As nanoGPT does it: forward takes the targets and returns the loss, so `compile=True` fuses
    the fp32 cast and cross-entropy of the 8×1024×32000 logits into the compiled graph instead of
    running them eagerly."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.model(idx)
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch
        return self(x, y)


class UserGPT(GPTModule):
    """The model as users write it: `training_step` calls the submodule, the optimizer is torch's
    AdamW as is."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)


class Clock:
    """Batch-end stamps. On CUDA each stamp is an event recorded on the stream behind the step's
    work, read once at the end: the clock between consecutive batch ends on the GPU's own timeline,
    with no host sync added by the measurement (a sync per step would idle the GPU while the host
    prepares the next step, charging every loop its per-step host work, which real training hides
    behind the queued kernels). On CPU, the host clock. The first stamp also notes the host time
    once the first step has run (`first_host`: start-up plus the first step)."""

    def __init__(self):
        self.events: list = []
        self.host: list[float] = []
        self.first_host: float | None = None

    def stamp(self, device) -> None:
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events.append(event)
            if self.first_host is None:
                # once, before any timed step: when the first step really ended
                torch.cuda.synchronize()
        else:
            self.host.append(time.perf_counter())
        if self.first_host is None:
            self.first_host = time.perf_counter()

    def step_times(self, warmup: int) -> list[float]:
        """Seconds between consecutive batch ends, the first `warmup` steps left out."""
        if self.events:
            torch.cuda.synchronize()
            times = [a.elapsed_time(b) / 1000 for a, b in zip(self.events, self.events[1:])]
        else:
            times = [b - a for a, b in zip(self.host, self.host[1:])]
        return times[warmup - 1 :]


class StepTimer(ls.Callback):
    def __init__(self):
        self.clock = Clock()
        self.resting_gib = float("nan")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.clock.stamp(trainer.device)
        self.resting_gib = resting_gib(trainer.device)


def resting_gib(device) -> float:
    """GPU memory allocated on `device` between two steps (after the optimizer's step, before the
    next forward), in GiB: the model states (parameters, gradients, optimizer states) and whatever
    else the strategy keeps from step to step (communication buckets, persistent parameters),
    without activations. NaN on CPU. A counter the allocator keeps on the host: no
    synchronization."""
    return torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def windows(times: list[float], n: int) -> list[float]:
    """The median step time of each of `n` consecutive, equal windows of `times` (the last takes the
    remainder)."""
    size = max(1, len(times) // n)
    cuts = [
        times[i * size : (i + 1) * size if i < n - 1 else len(times)]
        for i in range(min(n, len(times)))
    ]
    return [statistics.median(c) for c in cuts if c]


def _loader(cfg, micro_batch: int, steps: int):
    return torch.utils.data.DataLoader(
        RandomTokens(cfg.vocab_size, cfg.block_size, micro_batch * steps), batch_size=micro_batch
    )


def build_plain(cfg, device) -> tuple[GPT, torch.optim.Optimizer]:
    """The hand-written torch loops' model and optimizer: the GPT (seed 0) built on `device`, and
    torch's AdamW (lr 1e-4, betas (0.9, 0.95), weight decay 0.1), fused on CUDA."""
    torch.manual_seed(0)
    with torch.device(device):  # built where it trains: no CPU init then copy
        model = GPT(cfg)
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=1e-4,
        betas=(0.9, 0.95),
        weight_decay=0.1,
        fused=device.type == "cuda",
    )
    return model, opt


def train_plain(
    model: torch.nn.Module, opt, batches, device, warmup: int, loss_inside: bool = False
) -> list[float]:
    """The hand-written torch loop: forward under bf16 autocast, cross-entropy of the fp32 logits,
    backward, optimizer step. `model` is the GPT or a DistributedDataParallel around it, or with
    `loss_inside` a function of the batch that returns the loss. Returns the step times (`Clock`),
    the first `warmup` steps left out."""
    clock = Clock()
    for x, y in batches:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        if loss_inside:
            loss = model(x, y)
        else:
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = model(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clock.stamp(device)
    return clock.step_times(warmup)


def run_plain_pytorch(
    cfg, micro_batch: int, steps: int, warmup: int, device, compile: str = ""
) -> list[float]:
    """The hand-written torch loop on one device. `compile` "model": the whole GPT under
    `torch.compile(model)`, the cross-entropy eager (what a user adds to the loop first); "loss":
    the forward and the cross-entropy in one compiled function (nanoGPT's way). Both are the
    reference for `compile=True`: what torch.compile makes of the whole model, with no strategy
    around it. "loss+cudagraphs": the same under torch.compile's "reduce-overhead" (the compiled
    forward and backward replayed as CUDA graphs)."""
    model, opt = build_plain(cfg, device)
    if compile == "model":
        model = torch.compile(model)
    elif compile.startswith("loss"):
        gpt = model

        @torch.compile(mode="reduce-overhead" if compile.endswith("cudagraphs") else None)
        def model(x, y):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                logits = gpt(x)
            return F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))

    return train_plain(
        model,
        opt,
        _loader(cfg, micro_batch, steps),
        device,
        warmup,
        loss_inside=compile.startswith("loss"),
    )


def run_plain_ddp(
    cfg, micro_batch: int, steps: int, warmup: int, device, seed: int = 0
) -> list[float]:
    """One rank of a hand-written torch DDP loop, started by torchrun (the process group comes from
    its RANK, WORLD_SIZE and MASTER_* variables; nccl on CUDA, gloo on CPU): `train_plain` around
    torch's DistributedDataParallel, on random tokens drawn with `seed` (one per rank). Returns this
    rank's step times."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model, opt = build_plain(cfg, device)
    # torch's defaults (25 MiB buckets after a 1 MiB first one, buffers broadcast, no static graph,
    # no search for
    # unused parameters), except gradient_as_bucket_view=True, lightspeed's DDP default: no gradient
    # copies.
    ddp = DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    data = RandomTokens(cfg.vocab_size, cfg.block_size, micro_batch * steps, seed=seed)
    try:
        return train_plain(
            ddp, opt, torch.utils.data.DataLoader(data, batch_size=micro_batch), device, warmup
        )
    finally:
        # gloo's worker threads free each finished collective, which takes the GIL; freeing the
        # group (here or when
        # `ddp` goes) joins them while this thread holds the GIL: torch 2.13 hangs there when the
        # last step's
        # all-reduce is not freed yet (1 CPU run in ~4 here). Sleeping releases the GIL and lets
        # them finish.
        time.sleep(0.1)
        dist.destroy_process_group()


def run_plain_deepspeed(
    cfg,
    micro_batch: int,
    steps: int,
    warmup: int,
    device,
    zero: dict | None = None,
    seed: int = 0,
    on_step=None,
    deepcompile: str | None = None,
) -> list[float]:
    """A hand-written DeepSpeed loop, bf16, DeepSpeed's own (fused) Adam from the config: what users
    write today.

    `zero` is the zero_optimization section (default: stage 2 with DeepSpeed's defaults). Under
    torchrun (RANK set) each rank joins the launcher's group; alone, it makes a group of one. Stage
    3 builds the model in zero.Init. `on_step(engine)`, if given, is called after each step
    (profile_step.py's probe). `deepcompile` ("inductor" or "eager") turns on DeepSpeed's
    DeepCompile (`compile.deepcompile` and `engine.compile(backend=...)`): ZeRO's gathers, releases
    and reductions become graph operations instead of module hooks. It recompiles at its 6th step
    with a prefetch schedule measured in the first five, so give it warm-up steps past that."""
    import deepspeed

    from lightspeed.runtime.launch import find_free_port

    if "RANK" not in os.environ:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(find_free_port()),
            RANK="0",
            LOCAL_RANK="0",
            WORLD_SIZE="1",
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    config = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": zero or {"stage": 2},
        "steps_per_print": 10**9,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-4, "betas": [0.9, 0.95], "weight_decay": 0.1},
        },
    }
    if deepcompile:
        config["compile"] = {"deepcompile": True}
    torch.manual_seed(0)
    stage3 = config["zero_optimization"]["stage"] == 3
    # Stage 3: zero.Init allocates each parameter on cuda:LOCAL_RANK and partitions it; below 3,
    # built on the device.
    with (
        deepspeed.zero.Init(config_dict_or_path=config, enabled=stage3),
        contextlib.nullcontext() if stage3 else torch.device(device),
    ):
        model = GPT(cfg)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    if deepcompile:
        engine.compile(backend=deepcompile)
    clock = Clock()
    data = RandomTokens(cfg.vocab_size, cfg.block_size, micro_batch * steps, seed=seed)
    for x, y in torch.utils.data.DataLoader(data, batch_size=micro_batch):
        x, y = x.to(engine.device), y.to(engine.device)
        logits = engine(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        engine.backward(loss)
        engine.step()
        clock.stamp(device)
        if on_step is not None:
            on_step(engine)
    return clock.step_times(warmup)


def probe(name: str) -> None:
    """Patches lightspeed for the "+readnow", "+nonorm" and "+regional" probes (LIGHTSPEED says what
    they measure). Each run has its own process, so nothing is undone."""
    from lightspeed.strategies import single

    if "+readnow" in name:
        queued = single.optimizer_step

        def read_now(*args, should_step=None, **kwargs):
            stats = queued(*args, should_step=should_step, **kwargs)
            if should_step is not None:
                should_step.settle()  # waits for the verdict's copy, behind the backward
            return stats

        single.optimizer_step = read_now
    if (
        "+regional" in name
    ):  # compile=True block by block on one device too, as before the GPT was compiled whole
        apply_compile = single.apply_compile
        single.apply_compile = lambda module, **kwargs: apply_compile(
            module, **(kwargs | {"whole": False})
        )
    if "+nonorm" in name:
        torch.nn.utils.get_total_norm = lambda grads, *a, **k: torch.zeros(
            (), device=grads[0].device
        )


def run_lightspeed(
    name: str, cfg, micro_batch: int, steps: int, warmup: int, device, accumulate: int = 1
):
    """Times optimizer steps (each of `accumulate` micro-batches) of lightspeed's Trainer."""
    torch.manual_seed(0)
    probe(name)
    timer = StepTimer()
    kernels = "as_written" if "+as_written" in name else "fused"
    compile = next((v for k, v in COMPILE.items() if f"+{k}" in name), "+compile" in name)
    trainer = ls.Trainer(
        strategy=LIGHTSPEED[name](),
        devices=1,
        accelerator=device.type,
        precision="bf16-mixed",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[timer],
        compile=compile,
        accumulate_grad_batches=accumulate,
        optimizer_kernels=kernels,
    )
    module = (
        LossInForwardGPT(cfg)
        if name.endswith("+loss")
        else UserGPT(cfg)
        if "+user" in name
        else FusedAdamGPT(cfg)
    )
    built = prebuild(module, trainer.strategy, device)
    started = time.perf_counter()
    if "+cudnn" in name:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            trainer.fit(module, _loader(cfg, micro_batch, steps * accumulate))
    else:
        trainer.fit(module, _loader(cfg, micro_batch, steps * accumulate))
    run_lightspeed.prebuilt = kept(module, built)
    RESTING.append(timer.resting_gib)
    # Setup plus the first step: where torch.compile's compile time shows.
    run_lightspeed.first_step_s = timer.clock.first_host - started
    return timer.clock.step_times(warmup)


def prebuild(module, strategy, device) -> torch.nn.Module | None:
    """Runs `module.configure_model()` under `with torch.device(device)` before `fit`, where the
    strategy would build the model plainly and then move it (single, ddp, DeepSpeed stages 1-2,
    FSDP: a model built before `configure_model` is taken as is); the Trainer's own
    `configure_model` call then finds it built (GPTModule builds once). The user's training_step and
    configure_optimizers are untouched. ZeRO-3 stays with lightspeed's zero.Init, which already
    builds on the GPU; offloaded setups and CPU runs are left alone (BENCH_PREBUILD_ON_CPU=1
    prebuilds on CPU too, to check this path without a GPU; never for timing). Returns the model
    built (`module.model`), or None where it left the build to the strategy."""
    name = getattr(strategy, "name", str(strategy))
    stage3 = "stage_3" in name or getattr(strategy, "stage", None) == 3
    offload = "offload" in name or getattr(strategy, "cpu_offload", False)
    wanted = device.type == "cuda" or os.environ.get("BENCH_PREBUILD_ON_CPU") == "1"
    if not wanted or stage3 or offload:
        return None
    if device.type == "cuda":
        torch.cuda.set_device(
            device
        )  # as the strategy will: no stray context on cuda:0 from another rank
    with torch.device(device):
        module.configure_model()
    return module.model


def kept(module, built) -> bool | None:
    """Whether the model `prebuild` built is the one that trained (None: nothing was prebuilt)."""
    return None if built is None else module.model is built


RESTING: list[
    float
] = []  # this process's run: GPU memory between steps after each step (resting_gib)


def run_one(name: str, args) -> dict:
    """Runs one configuration in this process; returns its figures."""
    device = (
        torch.device("cuda", 0)
        if torch.cuda.is_available() and not args.tiny
        else torch.device("cpu")
    )
    cfg = _model_cfg(args)
    if args.cap_gib and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    steps = args.warmup + args.steps
    if name in PLAIN_COMPILE:
        times = run_plain_pytorch(
            cfg, args.micro_batch, steps, args.warmup, device, PLAIN_COMPILE[name]
        )
    elif name == "plain_deepspeed_zero2":
        times = run_plain_deepspeed(cfg, args.micro_batch, steps, args.warmup, device)
    elif name in ("plain_deepspeed_zero3", "plain_deepspeed_zero3_tuned"):
        zero = zero3_tuned(cfg) if name.endswith("_tuned") else ZERO3_DEFAULTS
        times = run_plain_deepspeed(
            cfg,
            args.micro_batch,
            steps,
            args.warmup,
            device,
            zero,
            on_step=lambda engine: RESTING.append(resting_gib(device)),
        )
    else:
        times = run_lightspeed(
            name, cfg, args.micro_batch, steps, args.warmup, device, args.accumulate
        )
    with torch.device("meta"):
        meta_model = GPT(cfg)
    step_s = statistics.median(times)
    tokens = args.micro_batch * args.accumulate * cfg.block_size  # per optimizer step
    return {
        "name": name,
        "params": meta_model.num_params(),
        "step_s": step_s,
        "tok_s": tokens / step_s,
        "mfu": tokens / step_s * flops_per_token(meta_model) / PEAK_FLOPS,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30
        if device.type == "cuda"
        else float("nan"),
        "resting_gib": RESTING[-1]
        if RESTING
        else float("nan"),  # the Trainer and the ZeRO-3 loops: resting_gib
        "timed_steps": len(times),
        "step_ms": [round(t * 1e3, 1) for t in times],  # each timed step: its profile
        "window_tok_s": [tokens / w for w in windows(times, args.windows)],
        "first_step_s": getattr(run_lightspeed, "first_step_s", None),
        "prebuilt": getattr(
            run_lightspeed, "prebuilt", None
        ),  # the model built on the device before fit, kept
        # Peak resident host memory of this process (ru_maxrss, KiB on Linux): what offload costs
        # the host.
        "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def _model_cfg(args):
    if args.tiny:
        return replace(SIZES["tiny"], vocab_size=256)
    return replace(SIZES["1.3b"], n_layer=args.layers or SIZES["1.3b"].n_layer)


# DeepCompile recompiles at its 6th step with the prefetch schedule it measured: time after that
DC_WARMUP = 8
# seconds: its two compilations take about 3 minutes per process on a cold cache (H200 hosts)
DC_TIMEOUT = 420


def for_setup(name: str, warmup: int, timeout: float) -> tuple[int, float]:
    """The warm-up steps and the time limit a setup runs with: a DeepCompile setup (`+dc`,
    `+dceager`) gets at least DC_WARMUP and DC_TIMEOUT, so its timed steps are the compiled
    schedule's and its compilation is not cut short; every run's result records the warm-up it
    had."""
    if {"dc", "dceager"} & set(name.split("+")[1:]):
        return max(warmup, DC_WARMUP), max(timeout, DC_TIMEOUT)
    return warmup, timeout


def _subprocess(name: str, args, extra: list[str] | None = None, timeout: float = 900) -> dict:
    warmup, timeout = for_setup(name, args.warmup, timeout)
    cmd = [
        sys.executable,
        __file__,
        "--run",
        name,
        "--steps",
        str(args.steps),
        "--warmup",
        str(warmup),
        "--micro-batch",
        str(args.micro_batch),
        "--accumulate",
        str(args.accumulate),
        "--windows",
        str(args.windows),
        *(["--tiny"] if args.tiny else []),
        *(
            ["--layers", str(args.layers)]
            if args.layers and "--layers" not in (extra or [])
            else []
        ),
        *(extra or []),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"timed out after {timeout:.0f}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :]) | {"warmup": warmup}
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    oom = "out of memory" in proc.stderr.lower() or "OutOfMemory" in proc.stderr
    return {"name": name, "error": "OOM" if oom else " | ".join(tail)[-300:]}


def speed_table(args) -> list[dict]:
    from rich.console import Console
    from rich.table import Table

    names = [
        n for item in (args.only.split(",") if args.only else ALL) for n in GROUPS.get(item, [item])
    ]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(
        args.repeats
    ):  # round robin: drift over the session spreads over every setup alike
        for name in names:
            print(
                f"[speed_single_gpu] running {name} ({rep + 1}/{args.repeats}) ...",
                file=sys.stderr,
                flush=True,
            )
            r = _subprocess(name, args, timeout=args.per_run_timeout)
            print(f"[speed_single_gpu] {json.dumps(r)}", file=sys.stderr, flush=True)
            runs[name].append(r)
            if args.json:  # every run as it arrives, so a session cut short keeps what it measured
                write_json(args.json, [summarize(n, rs) for n, rs in runs.items() if rs])
    results = [summarize(name, rs) for name, rs in runs.items()]
    base = {
        r["name"]: r["tok_s"]
        for r in results
        if r["name"] in BASELINES + list(PLAIN_COMPILE) and "tok_s" in r
    }
    params = next((r["params"] for r in results if "params" in r), 0)
    table = Table(
        title=(
            f"GPT {params / 1e9:.2f}B, micro-batch {args.micro_batch}, seq "
            f"{_model_cfg(args).block_size}, "
            f"bf16; median step of {args.steps // args.windows}, median of {args.repeats} runs × "
            f"{args.windows} windows"
        )
    )
    columns = (
        "setup",
        "tok/s",
        "spread",
        "× plain PyTorch",
        "× plain compiled",
        "× DS Z2 loop",
        "× DS Z3 loop",
        "× DS Z3 tuned",
        "MFU",
        "peak GiB",
        "first step s",
    )
    for col in columns:
        table.add_column(col, justify="right", no_wrap=col == "setup")
    for r in results:
        if "tok_s" not in r:
            table.add_row(r["name"], r["error"], *[""] * (len(columns) - 2))
            continue
        ratio = lambda b: f"{r['tok_s'] / base[b]:.3f}" if b in base else "-"  # noqa: E731
        first = f"{r['first_step_s']:.1f}" if r.get("first_step_s") else "-"
        table.add_row(
            r["name"],
            f"{r['tok_s']:,.0f}",
            f"{r['spread']:.1%} ({r['samples']})",
            ratio("plain_pytorch"),
            ratio("plain_pytorch+compile+loss"),
            ratio("plain_deepspeed_zero2"),
            ratio("plain_deepspeed_zero3"),
            ratio("plain_deepspeed_zero3_tuned"),
            f"{r['mfu']:.3f}",
            f"{r['peak_gib']:.1f}",
            first,
        )
    Console(width=160).print(table)
    return results


def write_json(path: str, value) -> None:
    """Writes `value` as JSON to `path` atomically (a temporary file, then a rename): a process
    killed while writing leaves the previous complete file, never half of one."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(value, indent=1))
    os.replace(tmp, path)


def summarize(name: str, runs: list[dict]) -> dict:
    """The median run of a setup (by tok/s) with the median and spread, (max - min) / median, of its
    samples: every window of every run (`--windows`), or each run's tok/s with one window."""
    ok = sorted((r for r in runs if "tok_s" in r), key=lambda r: r["tok_s"])
    if not ok:
        return {"name": name, "error": runs[-1].get("error", "no run"), "all": runs}
    median = ok[(len(ok) - 1) // 2]
    samples = (
        [w for r in ok for w in r.get("window_tok_s", [])]
        if all(len(r.get("window_tok_s", [])) > 1 for r in ok)
        else [r["tok_s"] for r in ok]
    )
    mid = statistics.median(samples)
    return median | {
        "tok_s": mid,
        "runs": len(ok),
        "samples": len(samples),
        "all": runs,
        "spread": (max(samples) - min(samples)) / mid,
    }


def memory_cap(args) -> list[dict]:
    """Largest GPT (by depth) that trains 5 steps at micro-batch 1 under the GPU memory cap, per
    setup."""
    from rich.console import Console
    from rich.table import Table

    setups = dict(CAP_SEARCH)
    if (
        args.lo is not None and args.hi is not None
    ):  # narrow the search where earlier runs located the edge;
        setups = {
            k: (args.lo, args.hi) for k in (args.only.split(",") if args.only else setups)
        }  # any setup
    elif args.only:
        setups = {k: v for k, v in setups.items() if k in args.only.split(",")}
    rows = []
    for name, (lo, hi) in setups.items():
        best = None
        while lo <= hi:  # bisection on the number of layers; each probe is its own process
            mid = (lo + hi) // 2
            r = _subprocess(
                name,
                args,
                ["--layers", str(mid), "--cap-gib", str(args.memory_cap)],
                timeout=args.probe_timeout,
            )
            print(
                f"[speed_single_gpu] cap probe {name} layers={mid}: {json.dumps(r)}",
                file=sys.stderr,
                flush=True,
            )
            if "error" in r:
                hi = mid - 1
            else:
                best, lo = r | {"layers": mid}, mid + 1
        rows.append(best or {"name": name, "error": "nothing fit"})
    table = Table(
        title=f"Largest GPT trained under a {args.memory_cap:g} GiB GPU cap "
        "(micro-batch 1, 5 steps)"
    )
    for col in (
        "setup",
        "layers",
        "parameters",
        "s/step",
        "tok/s",
        "GPU peak GiB",
        "host peak GiB",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(r["name"], "-", r["error"], "", "", "", "")
        else:
            table.add_row(
                r["name"],
                str(r["layers"]),
                f"{r['params'] / 1e9:.2f}B",
                f"{r['step_s']:.2f}",
                f"{r['tok_s']:,.0f}",
                f"{r['peak_gib']:.1f}",
                f"{r['host_peak_gib']:.1f}",
            )
    Console(width=140).print(table)
    return rows


def offload_speed(args) -> list[dict]:
    """Tokens/s of the offloaded stage-3 step at `--layers` under the cap, for each way in
    OFFLOAD_VARIANTS."""
    from rich.console import Console
    from rich.table import Table

    rows = []
    for name, micro, accum in OFFLOAD_VARIANTS:
        args.micro_batch, args.accumulate = micro, accum
        r = _subprocess(
            name,
            args,
            ["--layers", str(args.layers), "--cap-gib", str(args.memory_cap)],
            timeout=args.probe_timeout,
        )
        print(
            f"[speed_single_gpu] offload {name} mb={micro} accum={accum}: {json.dumps(r)}",
            file=sys.stderr,
            flush=True,
        )
        rows.append(r | {"micro_batch": micro, "accumulate": accum})
    base = rows[0].get("tok_s")
    table = Table(
        title=f"Offloaded ZeRO-3 at {args.layers} layers under a {args.memory_cap:g} GiB cap, "
        "8 sequences per optimizer step"
    )
    for col in (
        "setup",
        "micro-batch × accumulation",
        "s/step",
        "tok/s",
        "× plain offload",
        "peak GiB",
    ):
        table.add_column(col, justify="right")
    for r in rows:
        if "error" in r:
            table.add_row(
                r["name"], f"{r['micro_batch']} × {r['accumulate']}", r["error"], "", "", ""
            )
            continue
        ratio = f"{r['tok_s'] / base:.2f}" if base else "-"
        table.add_row(
            r["name"],
            f"{r['micro_batch']} × {r['accumulate']}",
            f"{r['step_s']:.2f}",
            f"{r['tok_s']:,.0f}",
            ratio,
            f"{r['peak_gib']:.1f}",
        )
    Console(width=140).print(table)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--run", help=argparse.SUPPRESS)
    p.add_argument("--only", help="comma-separated configuration names")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--cap-gib", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--memory-cap", type=float, default=None, help="GiB; run the bisection instead of the table"
    )
    p.add_argument("--probe-timeout", type=float, default=300)
    p.add_argument("--lo", type=int, help="memory-cap search: fewest layers to try")
    p.add_argument("--hi", type=int, help="memory-cap search: most layers to try")
    p.add_argument(
        "--offload-speed",
        action="store_true",
        help="with --memory-cap and --layers: compare ways to run the offloaded ZeRO-3 step",
    )
    p.add_argument("--per-run-timeout", type=float, default=900)
    p.add_argument(
        "--repeats",
        type=int,
        help="runs of each setup in the speed table (median, spread); default 3, 1 with --tiny",
    )
    p.add_argument(
        "--windows",
        type=int,
        default=1,
        help="timed windows per run (samples of the median/spread)",
    )
    p.add_argument("--tiny", action="store_true", help="CPU smoke run with the tiny model")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    args.repeats = args.repeats or (1 if args.tiny else 3)
    if args.run:
        print("RESULT " + json.dumps(run_one(args.run, args)), flush=True)
        sys.stderr.flush()
        os._exit(
            0
            # the figures are out: skip tearing down CUDA, DeepSpeed and the compile workers
        )
    if args.offload_speed:
        args.warmup, args.steps = 1, 3
        results = offload_speed(args)
    elif args.memory_cap:
        args.micro_batch, args.warmup, args.steps = (
            1,
            1,
            4,
        )  # 5 steps at micro-batch 1, as the issue asks
        results = memory_cap(args)
    else:
        results = speed_table(args)
    if args.json:
        write_json(args.json, results)


if __name__ == "__main__":
    main()
