"""The ways to run that the planner weighs. A `Candidate` is a base strategy plus optimizer offload,
parameter offload and activation checkpointing; `build_candidates` lists every one for a world size.
Each carries its speed relative to DDP's (the `SPEED` table and its factors, calibrated on the
tables of docs/benchmarks.md) and takes one line of the activation probe (`activations_for`). What
a candidate needs in bytes is `lightspeed.plan.forecast`'s; in tokens per second,
`lightspeed.plan.speed`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightspeed.plan.probe import Activations, ModelFacts

# The speed model, as one table: relative tokens/s per GPU against DDP (1.00). Calibrated by
# docs/benchmarks.md: the 2×H200 weak-scaling table (GPT 1.28B, micro-batch 4: ddp 44,561,
# deepspeed_stage_2 41,025, fsdp 27,951, deepspeed_stage_3 10,881 tok/s per GPU) and the 1×H200
# table (stage 1 ≈ stage 2: 53,706 vs 53,841; fsdp_grad_op at the plain loop's speed: 58,804 vs
# 58,397). ddp_sharded and fsdp_grad_op were not timed on two GPUs: taken from their tier (ZeRO-1
# is DDP plus a sharded step; grad-op communicates like ZeRO-2).
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
# always rank below every on-device one (the order: no sharding > ZeRO-2 > ZeRO-3 >
# offload).
OFFLOAD_SPEED = 0.22

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
        return self.starts("deepspeed")

    def starts(self, *prefixes: str) -> bool:
        """True when the base strategy's name starts with one of `prefixes` ("fsdp" for
        `fsdp` and `fsdp_tp2`)."""
        return self.strategy.startswith(prefixes)


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


def tp_degree(strategy: str) -> int:
    """N of a "..._tpN" strategy name; 1 without tensor parallelism."""
    _, sep, degree = strategy.rpartition("_tp")
    return int(degree) if sep and degree.isdigit() else 1


def activations_for(c: Candidate, facts: ModelFacts) -> Activations:
    """The probe's line for `c`: DeepSpeed runs the model in its half dtype without autocast,
    which saves half-precision tensors where autocast saves fp32 ones (softmax, norms), so its
    candidates take the probe run that way when there is one (`ModelFacts.engine_activations`)."""
    engine = facts.engine_activations
    return engine if c.is_deepspeed and engine.is_probed else facts.activations
