"""The choice of a plan: `speed_order` ranks forecasts fastest first (ties to headroom),
`choose` takes the first that fits the memory given and renders the table, and `auto_choice` is
`Trainer(strategy="auto")`'s whole plan: the device's memory (`device_memory`), every candidate
`auto` can run (`is_plannable`) forecast at its micro-batch (`first_micro_batch` under
`micro_batch="auto"`), and the choice with its fallbacks (lightspeed.plan.fallback tries them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import psutil
import torch
from rich.console import Console

from lightspeed.errors import ConfigError
from lightspeed.plan.candidates import Candidate, build_candidates
from lightspeed.plan.chart import gib, render_table
from lightspeed.plan.forecast import Forecast, check_plan_args, forecast, has_deepspeed
from lightspeed.plan.micro_batch_fit import largest_micro_batch
from lightspeed.plan.probe import ModelFacts, inspect_model
from lightspeed.runtime.memory import cuda_free

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
    precision = check_plan_args(world_size, precision, micro_batch)
    facts = facts or inspect_model(module, batch, precision, device_type)
    candidates = [
        c
        for c in build_candidates(world_size, deepspeed=has_deepspeed())
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
    has_ac = c.starts("fsdp", "deepspeed")
    return c.activation_checkpointing and base.is_named and has_ac and facts.blocks > 0


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
