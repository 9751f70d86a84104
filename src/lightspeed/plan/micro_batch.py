"""`Trainer(micro_batch="auto")`: the largest micro-batch that fits, from the memory forecast,
confirmed by real training steps.

    class Model(ls.Module):
        def __init__(self, batch_size=4): ...; self.batch_size = batch_size
        def train_dataloader(self): return DataLoader(data, batch_size=self.batch_size)
    ls.Trainer(micro_batch="auto").fit(Model())     # writes the size found into model.batch_size

Two steps, split by the launch, each one line of `Trainer.fit`:
1. `plan_fit`, in every process before any rank starts: one activation probe (`plan.inspect_model`)
   serves the strategy choice (`strategy="auto"`) and the micro-batch forecast
   (`plan.first_micro_batch`) under the strategy that will run.
2. `confirm`, once the ranks run and before the real model is built: rank 0's forecast is
   broadcast; each trial builds a copy of the Module on a fork of the (connected, not yet
   configured) strategy and runs two real training steps at that micro-batch, each the loop's own
   train window (`step`: loop.trial_step). An out-of-memory error (CUDA's, or on CPU an
   allocation past the `memory_budget` this module enforces) frees the copy, its gradients and
   optimizer state, empties the CUDA cache and retries smaller: halving ("power"), or halving and
   then bisecting between the last size that ran and the first that did not ("binsearch", the
   default, also called "auto"). Each trial's outcome is min-reduced over the ranks, so every rank
   takes the same size. The user's model, optimizer and RNG are untouched: training then runs
   exactly as with that batch size written by hand.

Where the size goes (Lightning's `Tuner.scale_batch_size` does the same): the first of
`datamodule.batch_size`, `datamodule.hparams.batch_size`, `module.batch_size`,
`module.hparams.batch_size` that exists is set, and the training loader is rebuilt by calling
`train_dataloader()` again. Loaders handed to `fit` directly cannot be rebuilt: that is a
ConfigError, as in Lightning.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from lightspeed.callbacks import Callback
from lightspeed.config import PlanOptions
from lightspeed.core.optimizer import parse_optimizers
from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import repeated_blocks
from lightspeed.plan.candidates import Candidate, build_candidates
from lightspeed.plan.chart import gib
from lightspeed.plan.choice import auto_choice, device_memory, first_micro_batch
from lightspeed.plan.fallback import (
    SavedBoxes,
    drop_traceback,
    is_out_of_memory,
    release_device_memory,
    strip_tensors,
)
from lightspeed.plan.forecast import forecast_candidate
from lightspeed.plan.model_copy import batch_of, build_copy, stand_in, steps_itself
from lightspeed.plan.probe import ModelFacts, inspect_model, is_weight_derived
from lightspeed.runtime.distributed import broadcast_from_rank0
from lightspeed.runtime.memory import measure
from lightspeed.runtime.rng import rng_state, set_rng_state
from lightspeed.strategies import build_strategy

__all__ = [
    "MicroBatchPlan",
    "Trial",
    "HostBudgetExceeded",
    "plan_fit",
    "planned_strategy",
    "plan_micro_batch",
    "confirm",
    "search",
    "batch_size_owner",
    "trials_table",
    "STEPS_PER_TRIAL",
]

# One training step of a trial: (the module's copy, the strategy's fork, a batch as the loader gives
# it, the trial's callbacks) -> None. The Trainer passes the loop's own (loop.trial_step).
TrialStep = Callable[[Any, Any, Any, list], None]

# The first step creates what persists between steps (torch optimizers' state, DeepSpeed ZeRO-3's
# gradient
# partitions): the second forward is the steady peak.
STEPS_PER_TRIAL = 2


class HostBudgetExceeded(MemoryError):
    """On CPU: a trial step held more bytes than `Trainer(memory_budget=...)` allows (the CPU's
    out-of-memory)."""


@dataclass
class Trial:
    """One row of the search: the micro-batch, its forecast bytes, whether the forecast says it
    fits, and what the real steps said (None: not run). `freed`: the trial's copy holds no tensor
    any more (collected, or its storage dropped) and, on CUDA, the allocated bytes are back within 1
    MiB of before the trial."""

    size: int
    forecast_bytes: int
    forecast_fits: bool
    confirmed: bool | None = None
    freed: bool | None = None
    note: str = ""


@dataclass
class MicroBatchPlan:
    """What `plan_fit` hands to `confirm`: the forecast's size and what is needed to try it and
    rebuild."""

    size: int
    candidate: Candidate
    facts: ModelFacts
    device_bytes: float
    precision: str
    world_size: int
    sample: Any  # a training batch as training_step sees it (the probes')
    raw: Any  # the same batch as the loader gave it (the trials')
    owner: Any  # the object whose batch size is set (module, datamodule or an hparams dict)
    key: str
    mode: str
    max_trials: int
    headroom: float = 0.1
    trials: list[Trial] = field(default_factory=list)

    def forecast(self, size: int) -> Trial:
        f = forecast_candidate(self.candidate, self.facts, self.world_size, self.precision, size)
        return Trial(
            size, f.device_total, f.device_total <= self.device_bytes * (1 - self.headroom)
        )


# --------------------------------------------------------------------------------------------------
# before launch


def plan_fit(
    module: Any,
    loader: Any,
    datamodule: Any,
    strategy: Any,
    plans: bool,
    world_size: int,
    options: PlanOptions,
    show: bool,
    as_step_sees: Callable[[Any], Any],
) -> tuple[Any, MicroBatchPlan | None, tuple[str, ...] | None]:
    """Before any rank starts (every process runs it with the same inputs): the strategy for
    `strategy="auto"` when `plans`, and the micro-batch forecast when `options.micro_batch` is set.
    One activation probe serves both. `as_step_sees(batch)` returns a drawn batch as
    `training_step` will see it (the loop's transfer hooks), on the CPU.

    Returns (the strategy object, the forecast for `confirm` to try once the ranks run or None,
    the fallbacks: under `strategy="auto"` the names of the other plans that fit, in rank order,
    for plan/fallback.py; else None).

    Raises:
        ConfigError: micro_batch="auto" with loaders passed to fit, with no batch-size attribute to
            write, or under manual optimization (no trial step can run the user's own backward and
            optimizer steps); nothing fits (see `plan.choose`).
    """
    if options.micro_batch is None and not plans:
        return strategy, None, None
    manual = steps_itself(module)
    if options.micro_batch is not None:
        if manual:
            raise ConfigError(
                f"micro_batch={options.micro_batch!r} needs automatic optimization: it runs trial "
                f"steps of training_step, and {type(module).__name__} sets "
                "automatic_optimization=False (its training_step steps its own optimizers). Leave "
                "micro_batch=None and set the loader's batch_size."
            )
        batch_size_owner(module, datamodule, loader)  # refuse early, before the probe
    source = datamodule if datamodule is not None else module
    loader = loader if loader is not None else source.train_dataloader()
    if loader is None:
        return strategy, None, None  # fit reports the missing data
    # manual optimization: a probe cannot run the step without the optimizers it steps
    raw = sample = None
    if not manual:
        raw = next(iter(loader))
        sample = as_step_sees(raw)  # as the step will see it
    elif show:
        print(
            f"strategy='auto': {type(module).__name__} uses manual optimization, so the planner "
            "does not run its training_step: activations are not probed, and the choice rests on "
            "weights, gradients and optimizer states.",
            flush=True,
        )
    facts = inspect_model(module, sample, options.precision, options.device_type)
    fallbacks = None
    if plans:
        choice = auto_choice(
            module,
            world_size,
            options.precision,
            getattr(loader, "batch_size", None) or 1,
            options.device_type,
            options.memory_budget,
            sample,
            show=show,
            facts=facts,
            trials=options.micro_batch is not None,
            max_micro_batch=(
                samples_per_rank(loader, world_size) if options.micro_batch is not None else None
            ),
        )
        strategy = planned_strategy(choice.name, world_size, module)
        fallbacks = tuple(f.candidate.name for f in choice.fallbacks)
    if options.micro_batch is None:
        return strategy, None, fallbacks
    plan = plan_micro_batch(module, datamodule, strategy, world_size, options, sample, facts, raw)
    return strategy, plan, fallbacks


def plan_micro_batch(
    module: Any,
    datamodule: Any,
    strategy: Any,
    world_size: int,
    options: PlanOptions,
    sample: Any = None,
    facts: ModelFacts | None = None,
    raw: Any = None,
) -> MicroBatchPlan:
    """The forecast half of `micro_batch="auto"` for `strategy` (an object) and the planner's
    `options`: the largest micro-batch the forecast fits in the device memory
    (`plan.device_memory`: `memory_budget`, else free memory), capped at a rank's share of the
    dataset. A training batch is drawn when not given (`raw`, as the loader gives it; `sample`, as
    the step sees it: the same when not given) and probed for `facts`. Raises ConfigError as
    `plan_fit` does, and when not even micro-batch 1 fits."""
    owner, key = batch_size_owner(module, datamodule)
    loader = (datamodule if datamodule is not None else module).train_dataloader()
    raw = raw if raw is not None else next(iter(loader))
    sample = sample if sample is not None else raw
    facts = facts or inspect_model(module, sample, options.precision, options.device_type)
    device_bytes, _ = device_memory(options.device_type, world_size, options.memory_budget)
    candidate = candidate_of(strategy, world_size)
    size = first_micro_batch(
        candidate,
        facts,
        world_size,
        options.precision,
        device_bytes,
        options.device_type,
        samples_per_rank(loader, world_size),
    )
    mode = "binsearch" if options.micro_batch in ("auto", None) else options.micro_batch
    return MicroBatchPlan(
        size,
        candidate,
        facts,
        device_bytes,
        options.precision,
        world_size,
        sample,
        raw,
        owner,
        key,
        mode,
        options.micro_batch_trials,
    )


def batch_size_owner(
    module: Any, datamodule: Any, loader: Any = None, name: str = "batch_size"
) -> tuple[Any, str]:
    """Where the micro-batch is written: the first of datamodule.batch_size,
    datamodule.hparams.batch_size, module.batch_size, module.hparams.batch_size that exists, as
    (object, key).

    Raises:
        ConfigError: a `loader` was handed to fit (it cannot be rebuilt), or no such attribute
        exists.
    """
    if loader is not None:
        raise ConfigError(
            "micro_batch='auto' rebuilds the training loader with the size it finds, so it needs "
            "train_dataloader() on the Module or DataModule (reading self.batch_size), not "
            "fit(train_dataloaders=...)."
        )
    for obj in (datamodule, module):
        if obj is None:
            continue
        if name in vars(obj) or hasattr(type(obj), name):
            return obj, name
        hparams = getattr(obj, "hparams", None)
        if isinstance(hparams, dict) and name in hparams:
            return hparams, name
    raise ConfigError(
        f"micro_batch='auto' needs a batch size to rebuild the training loader from, and "
        f"{type(module).__name__} has none: accepted are `self.{name}` or `self.hparams.{name}` on "
        "the "
        f"Module or the DataModule, read by its train_dataloader()."
    )


def planned_strategy(name: str, world_size: int, module: Any) -> Any:
    """The strategy object for a candidate's name: a Trainer strategy string, or one with `+ac`
    (FSDP's or DeepSpeed's with activation checkpointing of `module`'s repeated blocks: the classes
    of the children of its nn.ModuleLists, found on a meta copy built by `configure_model` where
    the module builds its layers there). Every rank builds the same from the same module."""
    if not name.endswith("+ac"):
        return build_strategy(name, world_size)
    strategy: Any = build_strategy(name.removesuffix("+ac"), world_size)  # a dataclass backend
    found = repeated_blocks(module) or repeated_blocks(build_copy(module, torch.device("meta")))
    blocks = list(dict.fromkeys(type(b) for b in found))
    return dataclasses.replace(strategy, activation_checkpointing=blocks)


def candidate_of(strategy: Any, world_size: int) -> Candidate:
    """The forecast's candidate for a strategy object (its name, offload and activation
    checkpointing)."""
    name = strategy.name.removesuffix("_nvme")
    if world_size == 1 and name == "ddp":
        name = "single"
    options = strategy.settings()
    if options.get("cpu_offload"):
        name += "_offload"
    name += "+ac" if options.get("activation_checkpointing") else ""
    # Every strategy forecasts for any world size (FSDP or ZeRO-1 on one device too), not only the
    # ones planned.
    by_name = {c.name: c for c in build_candidates(1) + build_candidates(8)}
    if name not in by_name:
        raise ConfigError(
            f"micro_batch='auto' has no memory forecast for strategy={strategy.name!r}: use one of "
            f"{', '.join(sorted(n for n in by_name if '+' not in n))}."
        )
    return by_name[name]


def samples_per_rank(loader: Any, world_size: int) -> int:
    """A rank's share of the dataset (the largest micro-batch worth trying), 4096 when its length is
    unknown."""
    try:
        return max(1, len(loader.dataset) // world_size)
    except (AttributeError, TypeError):
        return 4096


# --------------------------------------------------------------------------------------------------
# after launch


def confirm(plan: MicroBatchPlan | None, strategy: Any, module: Any, step: TrialStep) -> int | None:
    """Once the ranks run, before `strategy.configure_model(module)`: tries rank 0's forecast with
    real steps (`step`: the loop's own), recovering smaller on out-of-memory (see the module doc),
    and writes the size found where the training loader reads it. Prints the search as a table on
    rank 0. Collective. Returns the size written; None without a plan (nothing to do).

    Raises:
        ConfigError: not even micro-batch 1 ran.
    """
    if plan is None:
        return None
    plan.size = broadcast_from_rank0(plan.size)
    # trials draw random numbers (the copies' initialisation, dropout): training must not see it
    state = rng_state()
    try:
        plan.trials = search(
            lambda n: try_steps(plan, strategy, module, n, step),
            plan.forecast,
            plan.size,
            plan.mode,
            plan.max_trials,
        )
    finally:
        set_rng_state(state)
    if strategy.device.type == "cuda":  # the run's own peak from here, not the trials'
        torch.cuda.reset_peak_memory_stats(strategy.device)
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if is_rank0:
        Console(width=120).print(trials_table(plan.trials))
    ran = [t.size for t in plan.trials if t.confirmed]
    if not ran:
        raise ConfigError(
            f"micro_batch={plan.mode!r}: not even micro-batch {min(t.size for t in plan.trials)} "
            "ran "
            f"under {plan.candidate.name} within {gib(plan.device_bytes)} per device."
        )
    size = max(ran)
    if isinstance(plan.owner, dict):
        plan.owner[plan.key] = size
    else:
        setattr(plan.owner, plan.key, size)
    if is_rank0:
        owner = "hparams" if isinstance(plan.owner, dict) else type(plan.owner).__name__
        print(
            f"micro_batch: {size} under {plan.candidate.name} (written to {owner}.{plan.key}; "
            f"loader rebuilt; the run's forecast peak {gib(plan.forecast(size).forecast_bytes)})",
            flush=True,
        )
    return size


def search(
    run: Callable[[int], tuple[bool, bool, str]],
    forecast: Callable[[int], Trial],
    start: int,
    mode: str,
    max_trials: int,
) -> list[Trial]:
    """Runs `run(size)` -> (ran, freed, note) from `start` down: halving after each failure; in
    "binsearch" mode,
    once a size ran below a failed one, bisecting between them. At most `max_trials` runs. Returns
    every row: the runs, and the forecast's first size above `start` (not run) to show where the
    forecast stops."""
    trials, good, bad, size = [], 0, start + 1, start
    while size >= 1 and len(trials) < max_trials:
        row = forecast(size)
        row.confirmed, row.freed, row.note = run(size)
        trials.append(row)
        good, bad = (size, bad) if row.confirmed else (good, size)
        if mode == "power" and good:
            break
        if good + 1 >= bad:
            break
        size = (good + bad) // 2 if good else size // 2
    return sorted([*trials, forecast(start + 1)], key=lambda t: t.size)


def try_steps(
    plan: MicroBatchPlan, strategy: Any, module: Any, size: int, step: TrialStep
) -> tuple[bool, bool, str]:
    """Builds a copy of `module` on a fork of `strategy`, runs STEPS_PER_TRIAL real training steps
    (`step`) at micro-batch `size`, then frees everything. Returns (ran on every rank, the copy was
    collected, a note). On CUDA the note ends with the bytes allocated before the trial and after
    its release ("allocated 1.20 GiB -> 1.20 GiB")."""
    cuda = strategy.device.type == "cuda"
    baseline = torch.cuda.memory_allocated(strategy.device) if cuda else 0
    twin, trial = copy.deepcopy(module), strategy.fork()
    stand_in(twin, module, trial)  # the twin's step sees the trial's optimizers once it is set up
    alive, note, ran, saved = weakref.ref(twin), "", True, []
    try:
        trial.configure_model(twin)
        trial.setup(twin, lambda m=twin: parse_optimizers(m.configure_optimizers()), size)
        budget = None if cuda else plan.device_bytes
        peak = _steps(trial, twin, batch_of(plan.raw, size), budget, step, saved)
        if cuda and peak > plan.device_bytes:
            ran, note = False, f"peak {gib(peak)} over {gib(plan.device_bytes)}"
        note = note or f"peak {gib(peak)}"
    except Exception as e:
        if not (is_out_of_memory(e) or isinstance(e, HostBudgetExceeded)):
            raise
        ran, note = False, f"out of memory: {str(e).splitlines()[0][:60]}"
        drop_traceback(e)  # its frames: the failed step's tensors, a half-built engine
    # Outside the except block: its traceback no longer holds the failed step's frames and tensors.
    for boxes in saved:  # a failed backward's graph may outlive it (fallback.SavedBoxes)
        boxes.empty()
    trial.teardown()  # a fork's: frees what the trial built, keeps the process group
    if not ran:  # its parameter objects may outlive it in that graph: their storage goes now
        strip_tensors(twin)
    del twin, trial
    # Held in reference cycles (a full collection costs ~1 s when large): the copy, or after an
    # out-of-memory error the failed step's graph, which frames caught in the error's traceback
    # keep in cycles of their own (a DeepSpeed trial left 3.5 GiB allocated without it).
    if alive() is not None or not ran:
        gc.collect()
    if (held := alive()) is not None:  # still held from outside (ZeRO-3's autograd functions)
        strip_tensors(held)
    left = 0
    if cuda:  # the cache returned, cuBLAS's workspaces too (they can pin a freed segment)
        release_device_memory()
        after = torch.cuda.memory_allocated(strategy.device)
        left = after - baseline
        note += f"; allocated {gib(baseline)} -> {gib(after)}"
    return _min_over_ranks(ran), left <= 2**20 and not _holds_tensors(alive()), note


def _holds_tensors(module: torch.nn.Module | None) -> bool:
    if module is None:
        return False
    return any(
        p.numel() or getattr(p, "ds_tensor", None) is not None or p.grad is not None
        for p in module.parameters()
    )


def _steps(
    trial: Any,
    twin: Any,
    batch: Any,
    budget: float | None,
    step: TrialStep,
    saved: list[SavedBoxes],
) -> int:
    """STEPS_PER_TRIAL training steps (`step`: the loop's train window); returns the peak bytes
    (CUDA: the allocator's peak; CPU: the measured model states (`memory.measure`) plus the bytes
    autograd saves). On CPU raises HostBudgetExceeded as soon as a saved tensor, or the gradients,
    take the total past `budget`. Each step's saved tensors are boxed (`saved` gets the boxes), so
    that a failed step's can be let go."""
    if torch.cuda.is_available() and trial.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(trial.device)
    peak = 0
    for _ in range(STEPS_PER_TRIAL):
        meter = _TrialMeter(trial, budget)
        saved.append(boxes := SavedBoxes(meter.pack))
        with boxes.hooks():
            step(twin, trial, batch, [meter])
        peak = max(peak, meter.peak)
    if trial.device.type == "cuda":
        return torch.cuda.max_memory_allocated(trial.device)
    return peak


class _TrialMeter(Callback):
    """A trial step's only callback. Counts the bytes autograd saves (once per storage, weights
    excluded) on top of the model states held when the step starts, and after the backward the
    model states then held (`peak`); with a `budget`, raises HostBudgetExceeded at the saved tensor
    or the backward that passes it."""

    def __init__(self, strategy: Any, budget: float | None):
        self.strategy, self.budget, self.seen = strategy, budget, set()
        self.total = self.peak = sum(measure(strategy).values())

    def pack(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        is_weight = (t.requires_grad and t.grad_fn is None) or is_weight_derived(t)
        if t.device.type == "cpu" and not is_weight and storage._cdata not in self.seen:
            self.seen.add(storage._cdata)
            self.total += storage.nbytes()
            if self.budget is not None and self.total > self.budget:
                raise HostBudgetExceeded(f"{gib(self.total)} held, budget {gib(self.budget)}")

    def on_after_backward(self, trainer: Any, module: Any) -> None:
        self.peak = max(self.peak, self.total, sum(measure(self.strategy).values()))
        if self.budget is not None and self.peak > self.budget:
            raise HostBudgetExceeded(f"{gib(self.peak)} held, budget {gib(self.budget)}")


def _min_over_ranks(ok: bool) -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    )
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def trials_table(trials: list[Trial]) -> Table:
    """The search as a rich Table: micro-batch, forecast bytes, fits? (the forecast's word),
    confirmed? (the real steps': yes, no, or blank when not run), and a note."""
    table = Table(title="micro_batch='auto': forecast, then real steps")
    for name in ("micro-batch", "forecast", "fits?", "confirmed?", "note"):
        table.add_column(name, justify="right" if name in ("micro-batch", "forecast") else "left")
    for t in trials:
        confirmed = "" if t.confirmed is None else "yes" if t.confirmed else "no"
        table.add_row(
            str(t.size),
            gib(t.forecast_bytes),
            "yes" if t.forecast_fits else "no",
            confirmed,
            t.note,
            style="bold green" if t.confirmed else None,
        )
    return table
