"""The speed model: tokens per second per device for a candidate at a micro-batch, the measure the
planner ranks by (`lightspeed.plan.choice.speed_order`). The step's compute comes from the FLOPs the
activation probe counted, at the device's rate; the strategy's own work from the `SPEED` table
(lightspeed.plan.candidates); offload adds the host link and the host's optimizer step.
"""

from __future__ import annotations

import os

from lightspeed.plan.candidates import SPEED, Candidate, activations_for
from lightspeed.plan.probe import ModelFacts

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


def throughput(
    c: Candidate, micro_batch: int, facts: ModelFacts, precision: str, device_type: str
) -> float:
    """The speed model's tokens per second per device for `c` at `micro_batch` (see DEVICE_FLOPS).
    Without a probe the FLOPs are taken as 6 per parameter and token."""
    per_sample = activations_for(c, facts).flops_per_sample or 6 * facts.numel
    rate = DEVICE_FLOPS.get(device_type, DEVICE_FLOPS["cpu"])
    if device_type == "cuda" and precision not in ("bf16-mixed", "16-mixed", "bf16-true"):
        rate /= 4
    flops = micro_batch * per_sample * (RECOMPUTE if c.activation_checkpointing else 1)
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
    return micro_batch * facts.tokens_per_sample / seconds
