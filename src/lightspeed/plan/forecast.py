"""Plan a run before it starts: bytes per device for every strategy, the fastest one that fits, the
largest micro-batch.

    from lightspeed.plan.forecast import forecast, choose, auto_strategy
    rows = forecast(module, devices=2, precision="bf16-mixed", micro_batch=8,
    batch=next(iter(loader))) choice = choose(rows, device_bytes=80 * 2**30, host_bytes=500 * 2**30)
      # prints the table, marks the choice lightspeed plan examples/train.py:Model --devices 2
      --micro-batch 8 --device-memory 80GiB

What each term of a `Forecast` means (bytes on the busiest device, i.e. the largest rank):
- params: the weights this rank keeps between steps (a shard under ZeRO-3/FSDP; DeepSpeed's
half-precision copy
  under bf16/fp16).
- grads: gradients held after backward, where `lightspeed.runtime.memory.measure` reads them: the
full set for torch DDP
  and ZeRO-1, this rank's partition for FSDP and DeepSpeed (stage 1 too: it partitions at the step
  boundary).
- optim: optimizer states (e.g. AdamW's two moments and its step counters), sharded as the strategy
shards them.
- master: DeepSpeed's separate fp32 copy of this rank's weight partition; torch strategies step the
weights.
- activations: tensors autograd saves for backward at the target micro-batch, from a measured probe
(below).
- buffers: transient framework memory at the backward peak: autocast's half-precision weight cache
(torch mixed
  precision), FSDP's gathered units, DeepSpeed's reduce bucket, stage 1's unpartitioned gradients.
- host: host bytes per rank that offload keeps (fp32 master, moments and gradients; offloaded
weights), pinned blocks rounded up to a power of two as torch's pinned allocator does.
- transient peaks, each its own moment in `device_total`: setup (ZeRO-3's defragmenting copy and
  gathered block; ZeRO-1/2's flatten copy of the half-precision weights is shown but yields: it
  is made on the host when the room under the process's cap lacks it), the optimizer step
  (its first call allocates the states while the gradients are held), a save that gathers (ZeRO-1's
  consolidated optimizer state on rank 0); and on the host `host_setup`: the CPU copy the model is
  built in, the probe's copy, DeepSpeed's half-precision cast and the offload buffers being filled.

The model-state terms come from the parameter shapes (the model is built on the meta device, no
memory), the dtypes the strategy uses, and the optimizer's state layout. Activations come from one
forward and backward run at micro-batch 1 and 2 on CPU, recording the bytes of every tensor autograd
saves (weights excluded), then extrapolated linearly: a measured slope per sample, not a constant.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import math
import os
import runpy
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import torch
from rich.console import Console

from lightspeed.config import PRECISION_ALIASES
from lightspeed.errors import ConfigError
from lightspeed.plan.chart import gib, render_table, write_chart
from lightspeed.plan.probe import (
    Activations,
    ModelFacts,
    batch_of,
    inspect_model,
    plain_cuda_step,
    probe_activations,
    saved_activation_bytes,
    steps_itself,
)
from lightspeed.runtime.memory import cuda_free
from lightspeed.strategies.deepspeed.config import REDUCE_BUCKET

__all__ = [
    "Candidate",
    "Forecast",
    "Choice",
    "MicroBatch",
    "Activations",
    "ModelFacts",
    "build_candidates",
    "inspect_model",
    "probe_activations",
    "saved_activation_bytes",
    "batch_of",
    "forecast",
    "forecast_candidate",
    "choose",
    "speed_order",
    "device_memory",
    "auto_strategy",
    "auto_choice",
    "activations_for",
    "MARGIN",
    "find_micro_batch",
    "largest_micro_batch",
    "first_micro_batch",
    "confirm_micro_batch",
    "plan_cli",
]

# --------------------------------------------------------------------------------------------------
# candidates

# The speed model, as one table: relative tokens/s per GPU against DDP (1.00). Calibrated by
# docs/benchmarks.md:
# the 2×H200 weak-scaling table (GPT 1.28B, micro-batch 4: ddp 44,561, deepspeed_stage_2 41,025,
# fsdp 27,951,
# deepspeed_stage_3 10,881 tok/s per GPU) and the 1×H200 table (stage 1 ≈ stage 2: 53,706 vs 53,841;
# fsdp_grad_op at the plain loop's speed: 58,804 vs 58,397). ddp_sharded and fsdp_grad_op were not
# timed on two
# GPUs: taken from their tier (ZeRO-1 is DDP plus a sharded step; grad-op communicates like ZeRO-2).
SPEED = {
    "single": 1.00,
    "ddp": 1.00,
    "ddp_sharded": 0.95,
    "deepspeed_stage_1": 0.92,
    "deepspeed_stage_2": 0.92,
    "fsdp_grad_op": 0.92,
    "fsdp": 0.63,
    "deepspeed_stage_3": 0.24,
}
# FSDP with tensor parallelism (FSDP(tp=N), "fsdp_tp2"): FSDP's factor less a tenth for the
# all-reduces inside each block. Not calibrated on several GPUs yet (the multi-GPU issue).
TP_DEGREES = (2, 4, 8)
SPEED |= {f"{s}_tp{tp}": SPEED[s] * 0.9 for s in ("fsdp", "fsdp_grad_op") for tp in TP_DEGREES}
# Activation checkpointing, from the 1×H200 table: stage 2 45,886 / 53,841; fsdp 43,649 / 57,983.
AC_SPEED = 0.80
# Offload, from the 1×H200 table: deepspeed_stage_2_offload 11,764 / 53,841. Offloaded candidates
# always rank
# below every on-device one (the order: no sharding > ZeRO-2 > ZeRO-3 > offload).
OFFLOAD_SPEED = 0.22

# Tokens per second, the rank's measure (`throughput`): a step's compute is the FLOPs the probe
# counted (per sample; a third more with activation checkpointing, which runs the forward again) at
# DEVICE_FLOPS, slowed by the strategy's factor in SPEED (its communication and bookkeeping beside
# DDP's); an offloaded optimizer adds the host's step (DeepSpeed's CPU Adam and the copies each way,
# gradient by gradient): HOST_STEP seconds per parameter, per tensor and per step on 16 cores,
# fitted to the six families of docs/planning.md on one H200 (0.23-0.36 s a step for 0.20-0.49B
# parameters in 60-390 tensors, where their compute takes 0.01 s). DEVICE_FLOPS: what the reference
# GPT of docs/benchmarks.md reaches on an H200 in bf16 (53k tok/s × 8.6 GFLOP/token); fp32 (TF32) a
# quarter of it.
DEVICE_FLOPS = {"cuda": 4.5e14, "cpu": 1.0e11}
HOST_STEP = (0.5e-9, 0.5e-3, 0.01)  # seconds per parameter, per tensor, per step (16 cores)
RECOMPUTE = 4 / 3
REFERENCE_TOKENS = 8192  # the SPEED table's step: micro-batch 8 of 1024 tokens
HOST_LINK = 20e9  # bytes/s between host and device (PCIe 5, pinned, as achieved)

NAMED = {
    "single",
    "ddp",
    "ddp_sharded",
    "fsdp",
    "fsdp_grad_op",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
    "deepspeed_stage_1_offload",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3_offload",
    *(f"{s}_tp{tp}" for s in ("fsdp", "fsdp_grad_op") for tp in TP_DEGREES),
}


@dataclass(frozen=True)
class Candidate:
    """One way to run: a base strategy plus optimizer offload, parameter offload, activation
    checkpointing."""

    strategy: str
    offload_optimizer: bool = False
    offload_params: bool = False
    activation_checkpointing: bool = False

    @property
    def name(self) -> str:
        """The Trainer's strategy string where one exists (`deepspeed_stage_3_offload`), else a
        descriptive one."""
        base = self.strategy
        if base.startswith("deepspeed") and self.offload_optimizer:
            base += (
                "_offload" if self.offload_params or base != "deepspeed_stage_3" else "_offload_opt"
            )
        elif self.offload_optimizer:
            base += "_offload"
        return base + ("+ac" if self.activation_checkpointing else "")

    @property
    def is_named(self) -> bool:
        """True when `name` is a string `Trainer(strategy=...)` accepts."""
        return self.name in NAMED

    @property
    def speed(self) -> float:
        return (
            SPEED[self.strategy]
            * (AC_SPEED if self.activation_checkpointing else 1.0)
            * (OFFLOAD_SPEED if self.offload_optimizer else 1.0)
        )

    @property
    def is_deepspeed(self) -> bool:
        return self.strategy.startswith("deepspeed")


def build_candidates(devices: int, deepspeed: bool = True) -> list[Candidate]:
    """Every candidate for `devices` ranks: the plain strategies, each with activation
    checkpointing, and the offloaded ones (DeepSpeed stages 1-3 with the optimizer on the host,
    stage 3 also with the weights; FSDP with CPU offload of everything)."""
    plain = ["single"] if devices == 1 else ["ddp", "ddp_sharded", "fsdp_grad_op", "fsdp"]
    # FSDP x tensor parallelism: each degree that divides the world size (tp = world size: TP only)
    plain += [f"fsdp_tp{tp}" for tp in TP_DEGREES if devices > 1 and devices % tp == 0]
    if deepspeed:
        plain += ["deepspeed_stage_1", "deepspeed_stage_2", "deepspeed_stage_3"]
    out = []
    for ac in (False, True):
        out += [Candidate(s, activation_checkpointing=ac) for s in plain]
        if deepspeed:
            out += [
                Candidate(
                    f"deepspeed_stage_{k}", offload_optimizer=True, activation_checkpointing=ac
                )
                for k in (1, 2, 3)
            ]
            out.append(Candidate("deepspeed_stage_3", True, True, ac))
        # FSDP with CPU offload helps on one device too (docs/benchmarks.md: 4.09B on one 16
        # GiB-capped H200).
        out.append(
            Candidate(
                "fsdp", offload_optimizer=True, offload_params=True, activation_checkpointing=ac
            )
        )
    return out


# --------------------------------------------------------------------------------------------------
# forecast


@dataclass(frozen=True)
class Forecast:
    """Bytes per device for one candidate (see the module doc for what each term means)."""

    candidate: Candidate
    params: int
    grads: int
    optim: int
    master: int
    activations: int
    buffers: int
    host: int = 0
    step_buffers: int = 0  # transient bytes of the optimizer step (activations are freed by then)
    is_accumulating: bool = False  # gradient accumulation: gradients live through the next forward
    working: int = 0  # the part of `activations` that is backward's working memory at its start
    late_buffers: bool = False  # `buffers` come with the first reduced gradient (DeepSpeed 1/2)
    setup_buffers: int = 0  # beside the weights while setup builds (flatten copy, gathered block)
    # the setup copy goes to the host where the device lacks the room (DeepSpeed ZeRO-1/2's flatten,
    # whose check sees the process's cap: strategies/deepspeed/room.py), so it never sets the peak
    setup_yields: bool = False
    save_buffers: int = 0  # beside the model states while a save gathers (ZeRO-1's optimizer state)
    host_setup: int = 0  # host bytes while planning and setup run (the CPU copies, see the doc)
    micro_batch: int = 1  # per device, what the terms are forecast at
    tokens_per_s: float = 0.0  # the speed model's tokens per second per device (`throughput`)

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optim + self.master

    @property
    def host_peak(self) -> int:
        """Host bytes per rank at the worst moment: setup (`host_setup`) or training (`host`)."""
        return max(self.host, self.host_setup)

    @property
    def device_total(self) -> int:
        """The forecast peak: the larger of the forward/backward peak and the optimizer step's. The
        step frees gradients (zero_grad(set_to_none=True)), so a forward's activations and the
        gradients grow and shrink in turn: the larger of the two counts, unless accumulation keeps
        the gradients through the next forward. Buffers that come only with the first gradient
        reduced (`late_buffers`: DeepSpeed ZeRO-1/2's bucket) meet the activations after backward's
        first working memory (the loss's logits and their gradient) is gone."""
        transient = (
            self.grads + self.activations
            if self.is_accumulating
            else max(self.grads, self.activations)
        )
        states = self.params + self.optim + self.master
        if self.late_buffers:
            backward = states + max(transient, transient - self.working + self.buffers)
        else:
            backward = states + self.buffers + transient
        return max(
            backward,
            self.model_states + self.step_buffers,  # the step; its first call allocates the states
            self.params + (0 if self.setup_yields else self.setup_buffers),  # setup
            self.model_states + self.save_buffers,  # a save that gathers
        )


def forecast(
    module: torch.nn.Module,
    devices: int,
    precision: str = "32-true",
    micro_batch: int = 1,
    batch: Any = None,
    candidates: list[Candidate] | None = None,
    facts: ModelFacts | None = None,
    accumulate: int = 1,
    pinned: bool = True,
    trials: bool = False,
    device_type: str = "cpu",
) -> list[Forecast]:
    """Forecasts every candidate (default: `build_candidates(devices)`) for `module` on `devices`
    ranks.

    Args:
        module: the user's Module, before `configure_model` (it is not changed: copies are built).
        devices: the world size. precision: a Trainer precision string. micro_batch: per device.
        batch: a sample training batch for the activation probe; without one, activations are 0 (not
        probed). facts: reuse an earlier `inspect_model` result (the probe then runs once).
        accumulate: the Trainer's accumulate_grad_batches (above 1, gradients and activations
        coexist). pinned: offloaded host buffers are page-locked (DeepSpeed's default on CUDA).
        trials: micro-batch trials run (micro_batch="auto"): a copy of the model beside it.
        device_type: where training runs ("cuda": the probe saves what the GPU's kernels save).
    Raises:
        ConfigError: bad devices, precision or micro_batch, or a module without parameters.
    """
    precision = _check(devices, precision, micro_batch)
    facts = facts or inspect_model(module, batch, precision, device_type)
    candidates = candidates or build_candidates(devices, deepspeed=_has_deepspeed())
    rows = [
        forecast_candidate(c, facts, devices, precision, micro_batch, pinned, trials)
        for c in candidates
    ]
    return [
        throughput(replace(f, is_accumulating=accumulate > 1), facts, precision, device_type)
        for f in rows
    ]


def forecast_candidate(
    c: Candidate,
    facts: ModelFacts,
    devices: int,
    precision: str,
    micro_batch: int,
    pinned: bool = True,
    trials: bool = False,
) -> Forecast:
    """One candidate's bytes per device, from `facts`, with its setup and host moments
    (`with_transients`). The formulas follow what each backend allocates."""
    steady = _steady(c, facts, devices, precision, micro_batch, pinned)
    return replace(
        with_transients(steady, facts, devices, precision, trials), micro_batch=micro_batch
    )


def activations_for(c: Candidate, facts: ModelFacts) -> Activations:
    """The probe's line for `c`: DeepSpeed runs the model in its half dtype without autocast,
    which saves half-precision tensors where autocast saves fp32 ones (softmax, norms), so its
    candidates take the probe run that way when there is one (`ModelFacts.engine_activations`)."""
    engine = facts.engine_activations
    return engine if c.is_deepspeed and engine.is_probed else facts.activations


def _steady(
    c: Candidate, facts: ModelFacts, devices: int, precision: str, micro_batch: int, pinned: bool
) -> Forecast:
    states, steps = (
        facts.states_per_param,
        4 if facts.step_counters else 0,
    )  # a step counter is an fp32 scalar
    total, count, half = facts.numel, len(facts.shapes), precision in ("bf16-mixed", "16-mixed")
    line = activations_for(c, facts)
    act = line.at(micro_batch, c.activation_checkpointing)
    working = min(act, round(line.working_base + line.working_per_sample * micro_batch))
    if c.is_deepspeed:
        return replace(_deepspeed(c, facts, devices, precision, act, pinned), working=working)
    w = (
        2 if precision == "bf16-true" else 4
    )  # torch strategies keep weights, grads and states in one dtype
    compute = 2 if half else w
    if c.strategy in ("single", "ddp", "ddp_sharded"):
        owned, owned_count = (
            (total, count)
            if c.strategy != "ddp_sharded"
            else zero1_partition(facts.groups, devices)
        )
        # Autocast caches a half-precision copy of every weight for the forward; DDP's gradients are
        # views into
        # its buckets (gradient_as_bucket_view=True), so the buckets add nothing.
        # ZeRO-1's save gathers every rank's optimizer state on rank 0 (consolidate_state_dict).
        gathered = (states * (total - owned) * w + steps * (count - owned_count)) * (owned < total)
        return Forecast(
            c,
            total * w,
            total * w,
            states * owned * w + steps * owned_count,
            0,
            act,
            total * 2 if half else 0,
            save_buffers=gathered,
        )
    if (tp := tp_degree(c.strategy)) > 1:
        return _fsdp_tp(c, facts, devices, tp, act, line, micro_batch, w, compute, states, steps)
    local = fsdp_local_numel(facts.shapes, devices)
    # Gathered units: the one computing and the one prefetched (fsdp), or every unit from forward to
    # backward
    # (fsdp_grad_op); plus one unit's unsharded gradient before its reduce-scatter.
    gathered = (
        2 * facts.unit_numel if c.strategy == "fsdp" else total
    ) * compute + facts.unit_numel * w
    states_bytes = (local * w, local * w, states * local * w + steps * count)
    if (
        c.offload_optimizer
    ):  # CPUOffloadPolicy: sharded weights, gradients and states live on the host
        return Forecast(c, 0, 0, 0, 0, act, gathered, sum(states_bytes))
    return Forecast(c, *states_bytes, 0, act, gathered)


def tp_degree(strategy: str) -> int:
    """N of a "..._tpN" strategy name; 1 without tensor parallelism."""
    _, sep, degree = strategy.rpartition("_tp")
    return int(degree) if sep and degree.isdigit() else 1


def _fsdp_tp(
    c: Candidate,
    facts: ModelFacts,
    devices: int,
    tp: int,
    act: int,
    line: Activations,
    micro_batch: int,
    w: int,
    compute: int,
    states: int,
    steps: int,
) -> Forecast:
    """FSDP(tp=N) on `devices` ranks: the parameters the TP plan splits (`facts.tp_numel`) divided
    by tp, the rest whole, then everything sharded over the world size / tp data-parallel ranks;
    the activations saved inside the blocks divided by tp (the blocks' inputs and what is outside
    them stay whole; inside a block the norms' outputs stay whole too, so this is a lower bound).
    Gathered units: a block's TP shard, as fsdp gathers a whole one."""
    dp, split = devices // tp, facts.tp_numel
    per_tp_rank = facts.numel - split + math.ceil(split / tp)
    local = math.ceil(per_tp_rank / dp)
    inside = line.inside_base + line.inside_per_sample * micro_batch
    if not c.activation_checkpointing:
        act = max(0, round(act - inside * (1 - 1 / tp)))
    unit = math.ceil(facts.unit_numel / tp)
    gathered = (2 * unit if c.strategy.startswith("fsdp_tp") else per_tp_rank) * compute + unit * w
    count = len(facts.shapes)
    return Forecast(c, local * w, local * w, states * local * w + steps * count, 0, act, gathered)


def _deepspeed(
    c: Candidate, facts: ModelFacts, devices: int, precision: str, act: int, pinned: bool
) -> Forecast:
    stage = int(c.strategy[-1])
    states, steps = facts.states_per_param, 4 if facts.step_counters else 0
    total = facts.numel
    wd = (
        4 if precision == "32-true" else 2
    )  # DeepSpeed's bf16/fp16 modes keep the module's weights and grads half
    if stage == 3:  # every parameter partitioned on its own, padded to a multiple of the world size
        part = sum(math.ceil(math.prod(s) / devices) for s in facts.shapes)
        params = part * wd
    # one flat buffer per parameter group, padded to 2 × world size (DeepSpeed's alignment), then
    # split
    else:
        part = sum(deepspeed_parts(stage, facts, devices))
        params = total * wd
    bucket = (
        min(REDUCE_BUCKET[stage], total) * wd
    )  # DeepSpeed(reduce_bucket_size=None)'s, in elements
    # Stage 1 keeps whole gradients until the boundary; stage 3 holds a gathered block and the
    # prefetched next.
    buffers = bucket + {1: (total - part) * wd, 2: 0, 3: 2 * facts.unit_numel * wd}[stage]
    grads, optim, master = part * wd, states * part * 4 + steps * len(facts.groups), part * 4
    # Setup: ZeRO-1/2 flatten each group's weights into one buffer while the weights still exist,
    # on the device only when the room under the process's cap holds it, else on the host
    # (room.py makes DeepSpeed's check see the cap): a moment that yields. ZeRO-3 copies its
    # partitions into flat sub-groups of at most 1e9 elements (on the host with offloaded
    # weights) and gathers a block to initialise it.
    if stage < 3:
        setup = max(sum(math.prod(s) for s in g) for g in facts.groups) * wd
    else:
        setup = (0 if c.offload_params else min(part, 10**9) * wd) + 2 * facts.unit_numel * wd
    late = stage < 3  # the bucket (and stage 1's gradients) fill from the first gradient on
    if not c.offload_optimizer:
        # Under bf16/fp16 the step first copies the half-precision gradient partition to fp32 for
        # the optimizer.
        step = part * 4 if wd == 2 else 0
        return Forecast(
            c,
            params,
            grads,
            optim,
            master,
            act,
            buffers,
            step_buffers=step,
            setup_buffers=setup,
            setup_yields=stage < 3,
            late_buffers=late,
        )
    if stage < 3:
        # Offloading gradient by gradient: a device buffer of the largest parameter's size, and
        # the fp32 copy of one gradient made on the device before it goes to the host.
        buffers += max(math.prod(s) for s in facts.shapes) * (wd + 4)
    host = offload_host_bytes(stage, facts, devices, pinned, c.offload_params, wd)
    # Stage 1 reduces and copies gradients to the host only at the boundary: until then this rank's
    # half-precision gradients stay on the device (the rest is in `buffers`); stages 2 and 3 move
    # them bucket by bucket.
    return Forecast(
        c,
        0 if c.offload_params else params,
        grads if stage == 1 else 0,
        0,
        0,
        act,
        buffers,
        host,
        setup_buffers=setup,
        setup_yields=stage < 3,
        late_buffers=late,
    )


def _pow2(n: int) -> int:
    """Bytes torch's pinned (page-locked) allocator reserves for `n`: the next power of two."""
    return 1 << max(0, n - 1).bit_length() if n > 0 else 0


def deepspeed_parts(stage: int, facts: ModelFacts, devices: int) -> list[int]:
    """Elements of this rank's partition per flat group: one per optimizer group under ZeRO-1/2
    (padded to 2 × world size, then split), one per 1e9 elements (a sub-group) under ZeRO-3."""
    if stage < 3:
        return [
            _round_up(sum(math.prod(s) for s in g), 2 * devices) // devices for g in facts.groups
        ]
    part = sum(math.ceil(math.prod(s) / devices) for s in facts.shapes)
    return [min(10**9, part - i) for i in range(0, part, 10**9)]


def offload_host_bytes(
    stage: int, facts: ModelFacts, devices: int, pinned: bool, offload_params: bool, wd: int
) -> int:
    """Host bytes per rank that DeepSpeed's CPU offload keeps (0.19, per flat group of this rank's
    partition P elements): the fp32 master (4P), the fp32 gradient (4P) and, under ZeRO-1/2, a
    half-precision staging copy (wdP), each page-locked when `pinned` (rounded up to a power of
    two); the optimizer's states (Adam 8P, allocated at the first step, pageable); ZeRO-3 also a
    half-precision gradient partition and, with the weights offloaded, the weights (wdP each)."""
    parts = deepspeed_parts(stage, facts, devices)
    lock = _pow2 if pinned else (lambda n: n)
    kept = sum(2 * lock(4 * p) + (lock(wd * p) if stage < 3 else 0) for p in parts)
    extra = wd * sum(parts) * (1 + bool(offload_params)) if stage == 3 else 0
    return kept + extra + facts.states_per_param * 4 * sum(parts)


def throughput(f: Forecast, facts: ModelFacts, precision: str, device_type: str) -> Forecast:
    """`f` with the speed model's tokens per second per device at its micro-batch (see
    DEVICE_FLOPS). Without a probe the FLOPs are taken as 6 per parameter and token."""
    c = f.candidate
    per_sample = activations_for(c, facts).flops_per_sample or 6 * facts.numel
    rate = DEVICE_FLOPS.get(device_type, DEVICE_FLOPS["cpu"])
    if device_type == "cuda" and precision not in ("bf16-mixed", "16-mixed", "bf16-true"):
        rate /= 4
    flops = f.micro_batch * per_sample * (RECOMPUTE if c.activation_checkpointing else 1)
    compute = flops / rate
    # The strategy's own work (communication, hooks, gathers) as SPEED measured it beside DDP's
    # compute, never less than at the reference step's size (REFERENCE_TOKENS per step): it grows
    # with the parameters, not only with the micro-batch.
    floor = facts.numel * 6 * REFERENCE_TOKENS / rate
    seconds = compute + (1 / SPEED[c.strategy] - 1) * max(compute, floor)
    if c.offload_params:  # the weights come from the host for the forward and the backward
        seconds += 2 * facts.numel * 2 / HOST_LINK
    if c.offload_optimizer:
        per_param, per_tensor, per_step = HOST_STEP
        host = facts.numel * per_param + len(facts.shapes) * per_tensor + per_step
        seconds += host * 16 / (os.cpu_count() or 16)
    return replace(f, tokens_per_s=f.micro_batch * facts.tokens_per_sample / seconds)


def with_transients(
    f: Forecast, facts: ModelFacts, devices: int, precision: str, trials: bool = False
) -> Forecast:
    """`f` with its host moment of planning and setup (`host_setup`), per rank:

    - the CPU copy the model is built in: the Module's weights as given (a model built in
      `__init__`), held through setup (the fallback keeps it to retry another plan); a model built
      in `configure_model` is built on the host too, except under FSDP (meta device);
    - while planning, the activation probe's copy of the model and its gradients;
    - at setup, DeepSpeed's half-precision cast of a host-built model (made before it moves to the
      device) or the offload buffers (all but the optimizer's states, which come at the first
      step), a pinned block being first allocated pageable and then copied;
    - with micro-batch `trials`, a trial's copy of the model beside the user's while the trial's
      strategy holds everything it holds in training."""
    c, total = f.candidate, facts.numel
    built = facts.built_bytes or (0 if c.strategy.startswith("fsdp") else total * 4)
    half = precision in ("bf16-mixed", "16-mixed", "bf16-true")
    cast = total * 2 if c.is_deepspeed and half else 0
    offload = 0
    if c.is_deepspeed and c.offload_optimizer:
        parts = deepspeed_parts(int(c.strategy[-1]), facts, devices)
        offload = f.host - facts.states_per_param * 4 * sum(parts) + 4 * max(parts)
    elif c.offload_optimizer:  # FSDP's CPU offload: its shards live on the host
        offload = f.host
    trial = 2 * built + max(cast, f.host) if trials else 0
    setup = max(built + facts.probe_bytes, built + max(cast, offload), trial)
    return replace(f, host_setup=setup)


def zero1_partition(groups: list[list[tuple[int, ...]]], devices: int) -> tuple[int, int]:
    """(numel, tensor count) of the busiest rank under torch's ZeroRedundancyOptimizer, which hands
    whole parameters, largest first within each group, to the rank with the fewest elements so
    far."""
    sizes, counts = [0] * devices, [0] * devices
    for group in groups:
        for numel in sorted((math.prod(s) for s in group), reverse=True):
            rank = sizes.index(min(sizes))
            sizes[rank] += numel
            counts[rank] += 1
    busiest = max(range(devices), key=lambda r: sizes[r])
    return sizes[busiest], counts[busiest]


def fsdp_local_numel(shapes: list[tuple[int, ...]], devices: int) -> int:
    """Elements rank 0 (the busiest) holds under FSDP2, which splits each parameter's first
    dimension into chunks of ceil(rows / world size)."""
    return sum(min(math.ceil(s[0] / devices), s[0]) * math.prod(s[1:]) if s else 1 for s in shapes)


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def _check(devices: int, precision: str, micro_batch: int) -> str:
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ConfigError(f"devices={devices!r} is not valid: expected an integer ≥ 1.")
    if not isinstance(micro_batch, int) or isinstance(micro_batch, bool) or micro_batch < 1:
        raise ConfigError(f"micro_batch={micro_batch!r} is not valid: expected an integer ≥ 1.")
    if precision not in PRECISION_ALIASES:
        raise ConfigError(
            f"precision={precision!r} is not valid: use one of '32-true', 'bf16-mixed', "
            "'16-mixed', "
            "'bf16-true'."
        )
    return PRECISION_ALIASES[precision]


# --------------------------------------------------------------------------------------------------
# choice


# A candidate whose forecast leaves less than this share of the device memory free ranks below one
# of equal speed that leaves more (docs/planning.md): the forecast is within about 10% of the
# measured peak, and the caching allocator's fragmentation comes on top of it.
MARGIN = 0.2


@dataclass(frozen=True)
class Choice:
    """The chosen forecast, every forecast in rank order, the one-line reason, the rendered table,
    and the candidates after the chosen one that also fit (the fallbacks, in rank order)."""

    forecast: Forecast
    ordered: list[Forecast]
    reason: str
    table: Any  # a rich.table.Table
    fallbacks: tuple[Forecast, ...] = ()

    @property
    def name(self) -> str:
        return self.forecast.candidate.name


def speed_order(
    forecasts: list[Forecast], device_bytes: float | None = None, margin: float = MARGIN
) -> list[Forecast]:
    """Fastest first: by the speed model's tokens per second (`throughput`: strategy, offload,
    activation checkpointing and micro-batch together), within 1% counted as equal; forecasts
    without it (made by hand) by the SPEED table, every offloaded candidate after every on-device
    one. Among candidates of equal speed, given `device_bytes`: those whose forecast leaves at
    least `margin` of it free first, then the one that leaves the most (ties go to headroom)."""
    timed = all(f.tokens_per_s > 0 for f in forecasts)

    def key(f: Forecast) -> tuple:
        short = device_bytes is not None and f.device_total > device_bytes * (1 - margin)
        if timed:
            return (
                -round(math.log(f.tokens_per_s) / math.log(1.01)),
                short,
                f.device_total,
                f.model_states,  # an equal peak: the plan that keeps less between steps
                f.host_peak,
            )
        speed = round(f.candidate.speed, 9)  # products of the table's factors compare equal
        return (f.candidate.offload_optimizer, -speed, short, f.device_total, f.host_peak)

    return sorted(forecasts, key=key)


def choose(
    forecasts: list[Forecast],
    device_bytes: float,
    host_bytes: float,
    headroom: float = 0.1,
    show: bool = True,
    margin: float = MARGIN,
) -> Choice:
    """Takes the first candidate in rank order (`speed_order`: speed, then the `margin`, then
    headroom) whose device total and host peak fit in (1 - headroom) of the memory given (both per
    rank). Prints the table with the choice marked and the reason when `show`.

    Raises:
        ConfigError: if no candidate fits, naming the smallest requirement and the memory available.
    """
    if not 0 <= headroom < 1:
        raise ConfigError(f"headroom={headroom!r} is not valid: expected a fraction in [0, 1).")
    dev_limit, host_limit = device_bytes * (1 - headroom), host_bytes * (1 - headroom)
    ordered = speed_order(forecasts, device_bytes, margin)
    fits = [f for f in ordered if f.device_total <= dev_limit and f.host_peak <= host_limit]
    if not fits:
        least = min(ordered, key=lambda f: (f.device_total, f.host_peak))
        raise ConfigError(
            f"the model fits under no strategy: the smallest requirement is {least.candidate.name} "
            f"with {gib(least.device_total)} per device and {gib(least.host_peak)} of host memory "
            f"per rank, and {gib(device_bytes)} per device and {gib(host_bytes)} of host memory "
            f"per rank are available ({headroom:.0%} kept free). Use more devices, a smaller "
            "micro-batch or a smaller model."
        )
    best = fits[0]
    faster = ordered[: ordered.index(best)]
    reason = (
        f"{best.candidate.name}: the first that fits ({gib(best.device_total)} of "
        f"{gib(dev_limit)} per device"
    )
    reason += f", {gib(best.host_peak)} of {gib(host_limit)} host)" if best.host_peak else ")"
    if faster:
        reason += f"; {faster[0].candidate.name} needs {gib(faster[0].device_total)}"
        if faster[0].host_peak > host_limit:
            reason += f" and {gib(faster[0].host_peak)} host"
    table = render_table(
        ordered, best, dev_limit, f"Memory plan per device (fits: ≤ {gib(dev_limit)})", host_limit
    )
    if show:
        console = Console(width=160)
        console.print(table)
        console.print(f"[bold]chosen:[/bold] {reason}")
    return Choice(best, ordered, reason, table, tuple(fits[1:]))


def device_memory(
    device_type: str, world_size: int, memory_budget: float | None = None
) -> tuple[float, float]:
    """(bytes per device, host bytes per rank). CUDA: free memory of the current device, honouring
    set_per_process_memory_fraction; CPU: `memory_budget`, else available host memory / world size.
    A given `memory_budget` wins on either."""
    host = psutil.virtual_memory().available / world_size
    if memory_budget is not None:
        return float(memory_budget), host
    if device_type == "cuda":
        return cuda_free(torch.device("cuda", torch.cuda.current_device())), host
    return host, host


def auto_strategy(
    module: torch.nn.Module,
    world_size: int,
    precision: str = "32-true",
    micro_batch: int = 1,
    device_type: str = "cpu",
    memory_budget: float | None = None,
    batch: Any = None,
    headroom: float = 0.1,
    show: bool = True,
    facts: ModelFacts | None = None,
) -> tuple[str, Any]:
    """`Trainer(strategy="auto")`: the name of `auto_choice`'s choice, and its rich table."""
    choice = auto_choice(
        module,
        world_size,
        precision,
        micro_batch,
        device_type,
        memory_budget,
        batch,
        headroom,
        show,
        facts,
    )
    return choice.name, choice.table


def auto_choice(
    module: torch.nn.Module,
    world_size: int,
    precision: str = "32-true",
    micro_batch: int = 1,
    device_type: str = "cpu",
    memory_budget: float | None = None,
    batch: Any = None,
    headroom: float = 0.1,
    show: bool = True,
    facts: ModelFacts | None = None,
    trials: bool = False,
    max_micro_batch: int | None = None,
) -> Choice:
    """The plan for `Trainer(strategy="auto")`: the fastest candidate that fits this machine, with
    the others that fit behind it (`Choice.fallbacks`, tried in turn when the choice runs out of
    memory at setup or in its first steps: plan/fallback.py).

    Candidates are the strategies with a Trainer string and, where the model has repeated blocks,
    FSDP's and DeepSpeed's with activation checkpointing of those blocks (`+ac`:
    `planned_strategy` builds them), so every rank builds the same; on CPU the offloaded ones are
    left out (the host is the device). With `max_micro_batch` (micro_batch="auto") each candidate
    is forecast at the largest micro-batch it fits (at most that), so the rank weighs strategy,
    offload, activation checkpointing and micro-batch together; else at `micro_batch`. Run it once,
    before ranks start. `facts` reuses an earlier `inspect_model` (the probe then runs once). Raises
    ConfigError when nothing fits (see `choose`). `trials`: micro-batch trials will run (their copy
    of the model counts in the host peak)."""
    device_bytes, host_bytes = device_memory(device_type, world_size, memory_budget)
    precision = _check(world_size, precision, micro_batch)
    facts = facts or inspect_model(module, batch, precision, device_type)
    candidates = [
        c
        for c in build_candidates(world_size, deepspeed=_has_deepspeed())
        if is_plannable(c, facts) and not (device_type == "cpu" and c.offload_optimizer)
    ]
    rows = []
    for c in candidates:
        size = micro_batch
        if max_micro_batch is not None:
            try:
                size = first_micro_batch(
                    c, facts, world_size, precision, device_bytes, device_type, max_micro_batch
                )
            except ConfigError:  # not even 1 fits: shown at 1, marked as not fitting
                size = 1
        rows += forecast(
            module,
            world_size,
            precision,
            size,
            candidates=[c],
            facts=facts,
            pinned=device_type == "cuda",
            trials=trials,
            device_type=device_type,
        )
    return choose(rows, device_bytes, host_bytes, headroom, show=show)


def is_plannable(c: Candidate, facts: ModelFacts) -> bool:
    """A candidate `auto` can run: one with a Trainer strategy string, or FSDP's or DeepSpeed's
    with activation checkpointing when the model has repeated blocks to checkpoint."""
    if c.is_named:
        return True
    base = replace(c, activation_checkpointing=False)
    has_ac = c.strategy.startswith(("fsdp", "deepspeed"))
    return c.activation_checkpointing and base.is_named and has_ac and facts.blocks > 0


# --------------------------------------------------------------------------------------------------
# micro-batch


@dataclass(frozen=True)
class MicroBatch:
    """The finder's answer: the micro-batch, the forecast's own figure, and how it was confirmed."""

    size: int
    forecast_size: int
    note: str


def find_micro_batch(
    module: torch.nn.Module,
    batch: Any,
    devices: int,
    strategy: str,
    device_bytes: float,
    precision: str = "32-true",
    headroom: float = 0.1,
    max_micro_batch: int = 4096,
    device_type: str = "cpu",
    step_fn=None,
) -> MicroBatch:
    """The largest micro-batch that fits `device_bytes` (per device, less `headroom`) under
    `strategy` (a candidate name from `build_candidates`), from the forecast: model states and
    buffers are fixed, activations grow by the probe's measured bytes per sample.

    On CUDA the forecast is then confirmed by a real step, `step_fn(micro_batch)` (default: a plain
    single-device forward, backward and optimizer step of a copy of the module): on
    torch.cuda.OutOfMemoryError the memory is freed and the micro-batch halved until a step
    succeeds. On CPU the answer is the forecast's only (no step is run: host memory has no
    out-of-memory error to recover from), and the note says so.

    Raises:
        ConfigError: unknown strategy, or not even micro-batch 1 fits.
    """
    precision = _check(devices, precision, 1)
    by_name = {c.name: c for c in build_candidates(devices, deepspeed=_has_deepspeed())}
    if strategy not in by_name:
        raise ConfigError(
            f"strategy={strategy!r} is not valid here: use one of {', '.join(sorted(by_name))}."
        )
    candidate, facts = by_name[strategy], inspect_model(module, batch, precision, device_type)
    size = largest_micro_batch(
        candidate, facts, devices, precision, device_bytes, headroom, max_micro_batch
    )
    if device_type != "cuda":
        return MicroBatch(size, size, "forecast only: on CPU no step is run to confirm it")
    confirmed = confirm_micro_batch(
        step_fn or (lambda n: plain_cuda_step(module, batch, n, precision)), size
    )
    return MicroBatch(
        confirmed,
        size,
        f"confirmed by a real step at {confirmed}"
        + (f" (the forecast's {size} ran out of memory)" if confirmed < size else ""),
    )


def first_micro_batch(
    candidate: Candidate,
    facts: ModelFacts,
    devices: int,
    precision: str,
    device_bytes: float,
    device_type: str,
    max_micro_batch: int = 4096,
    headroom: float = 0.1,
) -> int:
    """The micro-batch the first trial runs (`micro_batch="auto"`) and the rank weighs: on a GPU
    the largest that leaves the `MARGIN` free (the caching allocator's fragmentation comes on top
    of the forecast, and a cap like `set_per_process_memory_fraction` counts it), else the largest
    within `headroom`, as everywhere when the margin leaves no micro-batch. Raises ConfigError as
    `largest_micro_batch` does."""
    args = (candidate, facts, devices, precision, device_bytes)
    if device_type == "cuda" and MARGIN > headroom:
        try:
            return largest_micro_batch(*args, MARGIN, max_micro_batch)
        except ConfigError:
            pass
    return largest_micro_batch(*args, headroom, max_micro_batch)


def largest_micro_batch(
    candidate: Candidate,
    facts: ModelFacts,
    devices: int,
    precision: str,
    device_bytes: float,
    headroom: float = 0.1,
    max_micro_batch: int = 4096,
) -> int:
    """The forecast's largest micro-batch for `candidate` within `device_bytes` less `headroom`:
    the largest whose forecast peak (`device_total`, every moment) fits, found by bisection (the
    peak grows with the micro-batch: activations by the probe's measured bytes per sample), capped
    at `max_micro_batch`.

    Raises:
        ConfigError: not even micro-batch 1 fits, naming what it needs and what is available.
    """
    limit = device_bytes * (1 - headroom)

    def peak(size: int) -> int:
        return forecast_candidate(candidate, facts, devices, precision, size).device_total

    if (need := peak(1)) > limit:
        raise ConfigError(
            f"micro_batch: not even 1 fits under {candidate.name}: it needs "
            f"{gib(need)} per device and {gib(limit)} is available "
            f"({headroom:.0%} kept free)."
        )
    fits, over = 1, max_micro_batch + 1
    if peak(max_micro_batch) <= limit:
        return max_micro_batch
    while over - fits > 1:
        mid = (fits + over) // 2
        fits, over = (mid, over) if peak(mid) <= limit else (fits, mid)
    return fits


def confirm_micro_batch(step_fn, size: int) -> int:
    """Runs `step_fn(size)`, halving `size` after each torch.cuda.OutOfMemoryError (memory freed in
    between); returns the first size that ran. Raises the last OutOfMemoryError if even 1 does not
    fit."""
    while True:
        try:
            step_fn(size)
            return size
        except torch.cuda.OutOfMemoryError:
            if size == 1:
                raise
        # Outside the except block: the traceback no longer holds the failed step's frames and
        # tensors.
        gc.collect()
        torch.cuda.empty_cache()
        size //= 2


# --------------------------------------------------------------------------------------------------
# command line


def plan_cli(argv: list[str]) -> int:
    """`lightspeed plan SCRIPT_OR_MODULE:NAME [--batch NAME] [--devices N] [--precision P]
    [--micro-batch B] [--device-memory 80GiB] [--host-memory 500GiB] [--headroom 0.1] [--out DIR]`.

    NAME is a Module class or a function (called with no arguments) or a Module instance, in a
    Python file or an importable module; `--batch` names a sample batch (or a function returning
    one) beside it for the activation probe. Prints the plan table, marks the choice when
    --device-memory is given, writes the bar chart to --out. Returns 0, or 2 after printing a
    ConfigError's message."""
    p = argparse.ArgumentParser(
        prog="lightspeed plan",
        description="Forecast memory per device for each strategy.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("target", help="SCRIPT_OR_MODULE:NAME of the Module class, factory or instance")
    p.add_argument(
        "--batch",
        help="NAME of a sample batch (or a function returning one) in the same file/module",
    )
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--precision", default="32-true")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--device-memory", type=parse_bytes, help="bytes per device, e.g. 80GiB")
    p.add_argument(
        "--host-memory", type=parse_bytes, help="host bytes per rank (default: available / devices)"
    )
    p.add_argument("--headroom", type=float, default=0.1)
    p.add_argument("--out", default="lightspeed_plan", help="folder for memory_plan.png")
    args = p.parse_args(argv)
    console = Console(width=160)
    try:
        module, batch = load_target(args.target, args.batch)
        rows = forecast(
            module, args.devices, args.precision, args.micro_batch, batch=batch, device_type="cuda"
        )
        if args.device_memory is not None:
            host = args.host_memory or device_memory("cpu", args.devices)[1]
            limit = args.device_memory * (1 - args.headroom)
            choose(rows, args.device_memory, host, args.headroom, show=True)
        else:
            limit = None
            console.print(render_table(speed_order(rows), None, None))
        if batch is None or steps_itself(module):
            why = (
                "no --batch given"
                if batch is None
                else "manual optimization: training_step steps its optimizers"
            )
            console.print(f"activations: not probed ({why}): 0 in the table")
        console.print(f"chart: {write_chart(rows, args.out, limit)}")
    except ConfigError as e:
        console.print(f"[red]error:[/red] {e}", markup=True, highlight=False)
        return 2
    return 0


def load_target(target: str, batch_name: str | None = None) -> tuple[torch.nn.Module, Any]:
    """Resolves `SCRIPT_OR_MODULE:NAME` (and an optional batch NAME beside it) to (module, batch).
    Raises ConfigError naming what is missing."""
    source, sep, name = target.rpartition(":")
    if not sep or not source or not name:
        raise ConfigError(
            f"target={target!r} is not valid: expected SCRIPT_OR_MODULE:NAME, e.g. train.py:Model."
        )
    if source.endswith(".py") or Path(source).is_file():
        if not Path(source).is_file():
            raise ConfigError(f"target={target!r} is not valid: the file {source} does not exist.")
        scope = runpy.run_path(
            source, run_name="__lightspeed_plan__"
        )  # not "__main__": its training does not run
    else:
        try:
            scope = vars(importlib.import_module(source))
        except ImportError as e:
            raise ConfigError(
                f"target={target!r} is not valid: cannot import {source} ({e})."
            ) from None
    for wanted in (name, batch_name):
        if wanted is not None and wanted not in scope:
            raise ConfigError(f"{wanted!r} is not defined in {source}.")
    obj = scope[name]
    module = obj if isinstance(obj, torch.nn.Module) else obj()
    if not isinstance(module, torch.nn.Module):
        raise ConfigError(
            f"target={target!r} is not valid: {name} gave {type(module).__name__}, not a Module."
        )
    batch = scope[batch_name] if batch_name else None
    return module, batch() if callable(batch) else batch


def parse_bytes(text: str) -> float:
    """'16GiB', '16G', '512MiB', '1e9' -> bytes (binary units; a bare number is bytes)."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        return float(t[:-1]) * units[t[-1]] if t and t[-1] in units else float(t)
    except ValueError:
        raise ConfigError(
            f"memory size {text!r} is not valid: use bytes or a size such as 16GiB."
        ) from None
