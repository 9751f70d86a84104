"""The non-finite guard: a NaN/Inf loss (on any rank) or gradient norm is seen by every rank at the
same step.

    Trainer(on_nonfinite="stop")  # default: NonFiniteError before the optimizer step, naming where
    Trainer(on_nonfinite="skip")  # every rank skips that optimizer step; `skipped_steps` is logged
    Trainer(on_nonfinite="warn")  # rank 0 prints a warning and the step runs (as unguarded)

The loop feeds each micro-batch's loss to `observe`; the strategy calls `should_step(norm)` after
the gradients are complete and BEFORE any optimizer steps (precision.optimizer_step for the torch
strategies; before `engine.step()` for DeepSpeed, where the losses decide). The verdict is one
all_reduce (MAX) of a vector with one slot per rank, so every rank agrees, and the message can name
the ranks that saw it. Under "stop" no non-finite update ever reaches the weights, so no checkpoint
can hold one.

DeepSpeed's ZeRO optimizers take the global gradient norm inside `engine.step()` (reduced across
ranks there) and drop a step whose norm is NaN/Inf on every rank, in fp32 and bf16 as in fp16. The
strategy then hands that norm to `after_engine_step`, which applies the same policy with no
collective of its own (every rank holds the same norm): "stop" raises naming the step, "skip"
counts it, "warn" says so; the weights were not touched either way.

On CUDA the loss flags never stall the GPU: `observe` all-reduces them and queues their copy to
pinned host memory right behind the forward, so `should_step` waits only for the forward, not for
the backward queued after it (a host sync there would leave the GPU idle while the host launches the
optimizer step: ZeRO-3's step is long). Where a norm is given, one all_reduce and one read after the
norm remain (the norm is only known then); for an optimizer that can skip its own update on a device
flag (torch's fused Adam/AdamW: the `found_inf` an AMP grad scaler also uses), `step_flag(norm)`
keeps the verdict on the device and the optimizer step is queued with it. The host reads that
verdict one step later: `settle()` runs at the next decision (the next `step_flag` or `should_step`,
when that step's forward and backward are queued and the copy landed long ago), before any
checkpoint is written, at a log step and at the end of the training loop. So the host never waits
for the GPU within a step, and the outcome is the same: a flagged step changes neither the weights
nor the optimizer state, "stop" raises naming the flagged step (before the next optimizer step, and
before any checkpoint after it), and "skip" has counted it by the time `skipped_steps` is logged or
saved.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist

from lightspeed.errors import ConfigError

Policy = Literal["stop", "skip", "warn"]
POLICIES = ("stop", "skip", "warn")
_LOSS, _NORM = 1.0, 2.0  # the bits a rank sets in its slot


class NonFiniteError(RuntimeError):
    """Training stopped: a loss or gradient norm was NaN or Inf. The message names step, epoch,
    batch and ranks."""


def check_policy(value: Any) -> None:
    """Raises ConfigError unless `value` is one of POLICIES."""
    if value not in POLICIES:
        raise ConfigError(
            f"on_nonfinite={value!r} is not valid: use 'stop' (raise, the default), 'skip' (skip "
            "the optimizer step on every rank) or 'warn'."
        )


class NonFiniteGuard:
    """One per Trainer. `begin` a window, `observe` each loss, then the strategy asks
    `should_step(norm)`."""

    def __init__(self, policy: Policy, rank: int = 0, world_size: int = 1, print0=print):
        check_policy(policy)
        self.policy, self.rank, self.world_size, self.print0 = policy, rank, world_size, print0
        self.skipped_steps = 0
        self._flagged = False  # this window's verdict (should_step) found a NaN/Inf
        self._bad_loss: torch.Tensor | None = None
        self._where: dict[str, int] = {}
        self._batches: list[int] = []
        self._first_bad_batch: torch.Tensor | None = None
        self._host: torch.Tensor | None = (
            None  # pinned; the reduced slots of the window (CUDA only)
        )
        self._slots: torch.Tensor | None = None  # the same on the device
        self._landed: Any = None  # a torch.cuda.Event: the copy to `_host` is done
        self._flag_host: torch.Tensor | None = None  # pinned; step_flag's copy (CUDA only)
        # step_flag's verdict, not yet read: its slots (host copy), their event, and where that step
        # was
        self._pending: tuple[torch.Tensor, Any, dict, list] | None = None

    def begin(self, step: int, epoch: int, batch_indices: list[int]) -> None:
        """Starts an accumulation window: the step and epoch it belongs to, the batch indices it
        holds."""
        self._where = {"step": step, "epoch": epoch}
        self._batches = batch_indices
        self._flagged = False
        self._bad_loss = self._first_bad_batch = self._slots = self._landed = None

    def observe(self, loss: torch.Tensor, i: int) -> None:
        """Notes whether micro-batch `i` of the window has a finite loss. Stays on the device: no
        host sync."""
        bad = ~torch.isfinite(loss.detach())
        if self._bad_loss is None:
            self._bad_loss = bad
            self._first_bad_batch = torch.where(bad, i, -1)
        else:
            assert self._first_bad_batch is not None  # set together with _bad_loss
            self._first_bad_batch = torch.where(bad & ~self._bad_loss, i, self._first_bad_batch)
            self._bad_loss = self._bad_loss | bad
        if bad.is_cuda:
            self._publish()

    def _publish(self) -> None:
        """The window's flags so far as a slot vector on the device, reduced (MAX) across ranks, and
        their copy to pinned host memory, queued now (behind the forward); an event marks when the
        copy has landed."""
        slots = self._loss_slots(self._bad_loss.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(slots, op=dist.ReduceOp.MAX)
        if self._host is None or self._host.numel() != slots.numel():
            self._host = torch.empty(slots.numel(), dtype=torch.float64, pin_memory=True)
        self._host.copy_(slots, non_blocking=True)
        self._slots, self._landed = slots, torch.cuda.Event()
        self._landed.record()

    def __call__(self, grad_norm: torch.Tensor | float | None) -> bool:
        """The guard is the strategies' step gate: calling it is `should_step`."""
        return self.should_step(grad_norm)

    def should_step(self, grad_norm: torch.Tensor | float | None) -> bool:
        """Collective: every rank calls it once per optimizer step, before stepping. True means
        step.

        `grad_norm` is the global norm (None where the strategy cannot give it before its step, or
        under an fp16 loss scaler, whose overflows are routine and handled by the scaler). Raises
        NonFiniteError under "stop"."""
        self.settle()
        if self._landed is not None:
            slots = self._published_slots(grad_norm)
        else:
            slots = self._reduced_slots(grad_norm)
        self._flagged = any(v > 0 for v in slots[:-1].tolist())
        return self._verdict(slots)

    def after_engine_step(self, grad_norm: float | None, stepped: bool) -> None:
        """For an engine that takes the global gradient norm inside its own step and drops a
        NaN/Inf one on every rank (DeepSpeed's ZeRO optimizers): applies the policy to that norm,
        which every rank already holds, so no collective. Call it after the engine's step with the
        norm it computed and whether it applied the step; nothing happens when the norm was finite
        and the step applied, or when `should_step` already flagged this window (its losses). Raises
        NonFiniteError under "stop"."""
        finite = grad_norm is None or math.isfinite(grad_norm)
        if self._flagged or (stepped and finite):
            return
        slots = torch.zeros(self.world_size + 1, dtype=torch.float64)
        slots[:-1] = _NORM  # a global norm: every rank saw it, as under DDP and FSDP
        self._flagged = True
        self._verdict(slots, engine_stepped=stepped)

    def step_flag(self, grad_norm: torch.Tensor) -> torch.Tensor | None:
        """Collective, no host read: the same decision as `should_step(grad_norm)`, kept on the
        device as the `found_inf` flag of optimizers that skip on it (1.0: skip the update; None
        under "warn": step anyway). The caller queues the optimizer step with it; the host reads the
        verdict later (`settle`)."""
        self.settle()  # the previous step's verdict: its copy landed while this step's backward ran
        slots = self._with_norm(
            self._slots.clone() if self._slots is not None else self._loss_slots(grad_norm.device),
            grad_norm,
        )
        host, landed = slots, None
        if (
            slots.is_cuda
        ):  # the copy lands right behind the reduction, before the optimizer's kernels
            if self._flag_host is None or self._flag_host.numel() != slots.numel():
                self._flag_host = torch.empty(slots.numel(), dtype=torch.float64, pin_memory=True)
            self._flag_host.copy_(slots, non_blocking=True)
            host, landed = self._flag_host, torch.cuda.Event()
            landed.record()
        self._pending = (host, landed, dict(self._where), list(self._batches))
        return None if self.policy == "warn" else (slots[:-1].amax() > 0).to(torch.float32)

    def settle(self) -> None:
        """Applies the verdict of the last `step_flag`, if not yet read: raises under "stop", counts
        under "skip", warns. Collective in effect: every rank calls it at the same points
        (guard.py's docstring)."""
        if self._pending is None:
            return
        host, landed, where, batches = self._pending
        self._pending = None
        if landed is not None:
            landed.synchronize()
        self._verdict(host, where, batches)  # read at once: the pinned buffer is free again after

    def _loss_slots(self, device: torch.device) -> torch.Tensor:
        """This rank's loss flags as a slot vector on `device` (not yet reduced); zeros if nothing
        was observed."""
        slots = torch.zeros(self.world_size + 1, dtype=torch.float64, device=device)
        if self._bad_loss is not None:
            slots[self.rank] = self._bad_loss.to(device, torch.float64) * _LOSS
            slots[-1] = (self._first_bad_batch + 1).to(device, torch.float64)
        return slots

    def _verdict(
        self,
        slots: torch.Tensor,
        where: dict | None = None,
        batches: list | None = None,
        engine_stepped: bool | None = None,
    ) -> bool:
        """The policy applied to reduced slots (on the host) of the step at `where` (default: the
        current one): True means step. `engine_stepped` is None when the verdict comes before the
        optimizer step, else whether the engine applied it (`after_engine_step`)."""
        flags = [int(v) for v in slots[:-1].tolist()]
        if not any(flags):
            return True
        message = self._message(
            flags,
            int(slots[-1].item()) - 1,
            where or self._where,
            self._batches if batches is None else batches,
        )
        if engine_stepped:  # an engine that applied a NaN/Inf norm: nothing can undo it now
            done = "the engine had already applied this optimizer step"
            kept = "the weights may hold NaN/Inf; no checkpoint is written after it"
        else:
            done = (
                "this optimizer step was not applied"
                if engine_stepped is None
                else "the engine dropped this optimizer step itself (its overflow check)"
            )
            kept = "the weights (and any checkpoint) are still finite"
        if self.policy == "stop":
            raise NonFiniteError(
                f"{message} Training stopped and {done}, so {kept}. Pass "
                "Trainer(on_nonfinite='skip') to skip such steps instead."
            )
        if self.policy == "skip" and engine_stepped:
            self.print0(f"{message} It could not be skipped: {done}.")
            return False
        if self.policy == "skip":
            self.skipped_steps += 1
            self.print0(
                f"{message} Skipped this optimizer step on every rank ({self.skipped_steps} "
                "skipped so far)."
            )
            return False
        if engine_stepped is None:
            self.print0(f"{message} on_nonfinite='warn': stepping anyway.")
        else:
            went_on = "" if engine_stepped else ", so the run goes on without it"
            self.print0(f"{message} on_nonfinite='warn': {done}{went_on}.")
        return True

    def _published_slots(self, grad_norm: torch.Tensor | float | None) -> torch.Tensor:
        """CUDA: the slots `observe` reduced; with a norm, its bit added and the vector reduced once
        more."""
        if grad_norm is None:
            # the last forward's flags: the backward queued behind stays queued
            self._landed.synchronize()
            return self._host.clone()
        return self._with_norm(self._slots.clone(), grad_norm).cpu()

    def _with_norm(self, slots: torch.Tensor, grad_norm: torch.Tensor | float) -> torch.Tensor:
        """`slots` (on the device) with this rank's norm bit added, reduced (MAX) across ranks; no
        host read."""
        norm = torch.as_tensor(grad_norm, device=slots.device).detach().to(torch.float64)
        slots[self.rank] += torch.where(torch.isfinite(norm), 0.0, _NORM)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(slots, op=dist.ReduceOp.MAX)
        return slots

    def _reduced_slots(self, grad_norm: torch.Tensor | float | None) -> torch.Tensor:
        """Off CUDA (or with no loss observed): the slots built on the host and reduced now."""
        slots = torch.zeros(
            self.world_size + 1, dtype=torch.float64
        )  # the last slot: first bad batch, as a max
        if self._bad_loss is not None and bool(self._bad_loss):
            assert self._first_bad_batch is not None  # set together with _bad_loss
            slots[self.rank] += _LOSS
            slots[-1] = float(self._first_bad_batch) + 1
        if grad_norm is not None and not bool(
            torch.isfinite(torch.as_tensor(grad_norm, dtype=torch.float64))
        ):
            slots[self.rank] += _NORM
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = self._bad_loss.device if self._bad_loss is not None else torch.device("cpu")
            reduced = slots.to(device if dist.get_backend() == "nccl" else "cpu")
            dist.all_reduce(reduced, op=dist.ReduceOp.MAX)
            slots = reduced.cpu()
        return slots

    def _message(self, flags: list[int], first_bad: int, step: dict, batches: list) -> str:
        loss_ranks = [r for r, f in enumerate(flags) if f & int(_LOSS)]
        norm_ranks = [r for r, f in enumerate(flags) if f & int(_NORM)]
        batch = batches[first_bad] if 0 <= first_bad < len(batches) else batches[-1]
        where = f"step {step['step']}, epoch {step['epoch']}, batch_idx {batch}"
        what = []
        if loss_ranks:
            what.append(f"the loss was NaN/Inf on rank(s) {loss_ranks}")
        if norm_ranks:
            what.append(f"the gradient norm was NaN/Inf on rank(s) {norm_ranks}")
        return f"Non-finite value at {where}: {' and '.join(what)}."

    def log_values(self) -> dict[str, float]:
        """What the loop logs each log step: the count of skipped optimizer steps (under "skip"
        only), the last step's verdict read first."""
        self.settle()
        return {"skipped_steps": float(self.skipped_steps)} if self.policy == "skip" else {}
