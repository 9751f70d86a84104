"""Plan a run before it starts: bytes per device for every strategy (`forecast`), one candidate at a
time (`forecast_candidate`).

    from lightspeed.plan.forecast import forecast
    from lightspeed.plan.choice import choose
    rows = forecast(module, devices=2, precision="bf16-mixed", micro_batch=8, batch=sample)
    choice = choose(rows, device_bytes=80 * 2**30, host_bytes=500 * 2**30)  # prints the table

or from the command line (lightspeed.plan.cli):

    lightspeed plan examples/train.py:Model --devices 2 --micro-batch 8 --device-memory 80GiB

What each term of a `Forecast` means (bytes on the busiest device, i.e. the largest rank):
- params: the weights this rank keeps between steps (a shard under ZeRO-3/FSDP; DeepSpeed's
  half-precision copy under bf16/fp16).
- grads: gradients held after backward, where `lightspeed.runtime.memory.measure` reads them: the
  full set for torch DDP and ZeRO-1, this rank's partition for FSDP and DeepSpeed (stage 1 too: it
  partitions at the step boundary).
- optim: optimizer states (e.g. AdamW's two moments and its step counters), sharded as the strategy
  shards them.
- master: DeepSpeed's separate fp32 copy of this rank's weight partition; torch strategies step the
  weights.
- activations: tensors autograd saves for backward at the target micro-batch, from a measured probe
  (below).
- buffers: transient framework memory at the backward peak: autocast's half-precision weight cache
  (torch mixed precision), FSDP's gathered units, DeepSpeed's reduce bucket, stage 1's
  unpartitioned gradients.
- host: host bytes per rank that offload keeps (fp32 master, moments and gradients; offloaded
  weights), pinned blocks rounded up to a power of two as torch's pinned allocator does.
- transient peaks, each its own moment in `device_total`: setup (ZeRO-3's defragmenting copy and
  gathered block; ZeRO-1/2's flatten copy of the half-precision weights is shown but yields: it
  is made on the host when the room under the process's cap lacks it), the optimizer step
  (its first call allocates the states while the gradients are held), a save that gathers (ZeRO-1's
  consolidated optimizer state on rank 0); and on the host `host_setup`: the CPU copy the model is
  built in, the probe's copy, DeepSpeed's half-precision cast and the offload buffers being filled.

The model-state terms come from the parameter shapes (the model is built on the meta device, no
memory; lightspeed.plan.partitions splits them as each backend does), the dtypes the strategy uses,
and the optimizer's state layout. Activations come from one forward and backward run at micro-batch
1 and 2 on CPU, recording the bytes of every tensor autograd saves (weights excluded), then
extrapolated linearly: a measured slope per sample, not a constant (lightspeed.plan.probe).
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightspeed.config import PRECISION_ALIASES
from lightspeed.errors import ConfigError
from lightspeed.plan.candidates import Candidate, activations_for, build_candidates, tp_degree
from lightspeed.plan.partitions import (
    deepspeed_parts,
    fsdp_local_numel,
    offload_host_bytes,
    zero1_partition,
)
from lightspeed.plan.probe import Activations, ModelFacts, inspect_model
from lightspeed.plan.speed import throughput
from lightspeed.strategies.deepspeed.config import REDUCE_BUCKET


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
    tokens_per_s: float = 0.0  # tokens per second per device, the speed model's (`throughput`)

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
    precision = check_plan_args(devices, precision, micro_batch)
    facts = facts or inspect_model(module, batch, precision, device_type)
    candidates = candidates or build_candidates(devices, deepspeed=has_deepspeed())
    rows = [
        forecast_candidate(c, facts, devices, precision, micro_batch, pinned, trials)
        for c in candidates
    ]
    return [
        replace(
            f,
            is_accumulating=accumulate > 1,
            tokens_per_s=throughput(f.candidate, f.micro_batch, facts, precision, device_type),
        )
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
    built = facts.built_bytes or (0 if c.starts("fsdp") else total * 4)
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


def _steady(
    c: Candidate, facts: ModelFacts, devices: int, precision: str, micro_batch: int, pinned: bool
) -> Forecast:
    # a step counter is an fp32 scalar
    states, steps = facts.states_per_param, 4 if facts.step_counters else 0
    total, count, half = facts.numel, len(facts.shapes), precision in ("bf16-mixed", "16-mixed")
    line = activations_for(c, facts)
    act = line.at(micro_batch, c.activation_checkpointing)
    working = min(act, round(line.working_base + line.working_per_sample * micro_batch))
    if c.is_deepspeed:
        return replace(_deepspeed(c, facts, devices, precision, act, pinned), working=working)
    w = 2 if precision == "bf16-true" else 4  # torch strategies: weights, grads, states alike
    compute = 2 if half else w
    if c.strategy in ("single", "ddp", "ddp_sharded"):
        owned, owned_count = (
            (total, count)
            if c.strategy != "ddp_sharded"
            else zero1_partition(facts.groups, devices)
        )
        # Autocast caches a half-precision copy of every weight for the forward; DDP's gradients are
        # views into its buckets (gradient_as_bucket_view=True), so the buckets add nothing.
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
    # backward (fsdp_grad_op); plus one unit's unsharded gradient before its reduce-scatter.
    gathered = (
        2 * facts.unit_numel if c.strategy == "fsdp" else total
    ) * compute + facts.unit_numel * w
    states_bytes = (local * w, local * w, states * local * w + steps * count)
    if c.offload_optimizer:  # CPUOffloadPolicy: sharded weights, gradients and states on the host
        return Forecast(c, 0, 0, 0, 0, act, gathered, sum(states_bytes))
    return Forecast(c, *states_bytes, 0, act, gathered)


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
    gathered = (2 * unit if c.starts("fsdp_tp") else per_tp_rank) * compute + unit * w
    count = len(facts.shapes)
    return Forecast(c, local * w, local * w, states * local * w + steps * count, 0, act, gathered)


def _deepspeed(
    c: Candidate, facts: ModelFacts, devices: int, precision: str, act: int, pinned: bool
) -> Forecast:
    stage = int(c.strategy[-1])
    states, steps = facts.states_per_param, 4 if facts.step_counters else 0
    total = facts.numel
    wd = 4 if precision == "32-true" else 2  # bf16/fp16 modes keep weights and grads half
    if stage == 3:  # every parameter partitioned on its own, padded to a multiple of the world size
        part = sum(math.ceil(math.prod(s) / devices) for s in facts.shapes)
        params = part * wd
    # one flat buffer per parameter group, padded to 2 × world size (DeepSpeed's alignment), split
    else:
        part = sum(deepspeed_parts(stage, facts, devices))
        params = total * wd
    bucket = min(REDUCE_BUCKET[stage], total) * wd  # DeepSpeed(reduce_bucket_size=None)'s
    # Stage 1 keeps whole gradients until the boundary; stage 3 holds a gathered block and the
    # prefetched next.
    buffers = bucket + {1: (total - part) * wd, 2: 0, 3: 2 * facts.unit_numel * wd}[stage]
    grads, optim, master = part * wd, states * part * 4 + steps * len(facts.groups), part * 4
    setup = _deepspeed_setup(c, facts, stage, part, wd)
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


def _deepspeed_setup(c: Candidate, facts: ModelFacts, stage: int, part: int, wd: int) -> int:
    """Device bytes beside the weights while DeepSpeed's setup builds. ZeRO-1/2 flatten each
    group's weights into one buffer while the weights still exist, on the device only when the room
    under the process's cap holds it, else on the host (room.py makes DeepSpeed's check see the
    cap): a moment that yields. ZeRO-3 copies its partitions (`part` elements) into flat sub-groups
    of at most 1e9 elements (on the host with offloaded weights) and gathers a block to initialise
    it."""
    if stage < 3:
        return max(sum(math.prod(s) for s in g) for g in facts.groups) * wd
    return (0 if c.offload_params else min(part, 10**9) * wd) + 2 * facts.unit_numel * wd


def has_deepspeed() -> bool:
    """Whether DeepSpeed is installed (its candidates are planned only then)."""
    return importlib.util.find_spec("deepspeed") is not None


def check_plan_args(devices: int, precision: str, micro_batch: int) -> str:
    """The planner's arguments checked: returns the precision's canonical name. Raises
    ConfigError naming a bad devices, micro_batch or precision."""
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
