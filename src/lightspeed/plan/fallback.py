"""A plan that runs out of memory at setup or in its first steps is not the end of the run: the
next plan that fits is.

    strategy, first = set_up_or_fall_back(strategy, module, set_up, fallbacks, connect, ...)
    out = first.guard(module, strategy, lambda: train_window(...))   # the first FIRST_STEPS steps
    strategy, first = first.next_plan(strategy, module, set_up, connect, log0, why)  # on OOM

Under `strategy="auto"` the plan (`forecast.auto_choice`) ranks every candidate that fits; the
Trainer sets up the first. If `configure_model` or `setup` runs out of memory on any rank (CUDA's
out-of-memory error, a host `MemoryError`, or on CPU the bytes the strategy holds past
`Trainer(memory_budget=...)`), every rank learns it from one min-reduce, the attempt is torn down
(engine, wrappers, its memory returned to the device), the module is put back as it was before the
attempt, and the next candidate is set up. One line says what failed and what runs instead.

The first training steps are guarded the same way (`FirstSteps`): an out-of-memory error in one
of them (on CPU: the step's saved tensors or what the strategy holds after it past the budget)
becomes one verdict for every rank at the step's end, the plan is torn down, the module and the
random state are put back as they were before its setup, and the next plan is set up and trains
from step 0 (`start.next_plan`, called by the loop).

Each attempt runs on a fork of its strategy (`Strategy.fork()`: connected, its own engine, the
process group its parent's), so a failed one can be freed without leaving the group. The module is
put back from a snapshot of its structure: every submodule copied, every parameter and buffer
shared with the original tensors, so the snapshot costs no tensor memory beyond keeping the host
copy the model was built in alive until the first steps end (the forecast counts it:
`host_setup`); where the strategy steps those very tensors (single or ddp on the CPU), they are
copied before the first step, so the next plan starts from the same weights.

A strategy the user chose has no fallback: its out-of-memory error propagates as before, after one
line naming the plan `lightspeed plan` forecasts would fit (from the model's shapes, activations
not probed).
"""

from __future__ import annotations

import copy
import gc
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightspeed.plan.chart import gib
from lightspeed.plan.choice import auto_choice, device_memory
from lightspeed.plan.probe import ModelFacts
from lightspeed.runtime.memory import measure
from lightspeed.runtime.rng import rng_state, set_rng_state

__all__ = [
    "FIRST_STEPS",
    "FirstSteps",
    "StepsOutOfMemory",
    "SetupOutOfMemory",
    "is_out_of_memory",
    "set_up_or_fall_back",
    "connected",
    "all_ranks_ok",
    "snapshot",
    "restore",
    "release_device_memory",
    "plan_hint",
    "SavedBoxes",
    "strip_tensors",
    "drop_traceback",
]

OUT_OF_MEMORY = (torch.OutOfMemoryError, MemoryError)
# What torch's host allocators say when the host has no memory left: the CPU allocator raises a
# plain RuntimeError ("DefaultCPUAllocator: can't allocate memory"), a failed pinned allocation a
# CUDA error ("CUDA error: out of memory").
HOST_OUT_OF_MEMORY = ("can't allocate memory", "not enough memory", "out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """True for the device's or the host's out-of-memory error, as torch and Python raise them."""
    if isinstance(error, OUT_OF_MEMORY):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in HOST_OUT_OF_MEMORY)


class SetupOutOfMemory(MemoryError):
    """On CPU under `auto`: the strategy held more bytes after setup than `memory_budget` allows
    (the CPU's out-of-memory: no allocator raises one there)."""


def set_up_or_fall_back(
    strategy: Any,
    module: torch.nn.Module,
    set_up: Callable[[Any], None],
    fallbacks: tuple[str, ...] | None,
    connect: Callable[[str], Any],
    budget: float | None = None,
    log0: Callable[[str], None] = print,
    hint: Callable[[], str | None] = lambda: None,
) -> tuple[Any, FirstSteps | None]:
    """Runs `set_up(s)` (configure_model, then setup) and returns the strategy `s` that is set up,
    with the guard of its first steps.

    Args:
        strategy: the connected strategy the Trainer holds (not set up yet).
        module: the user's Module; after a failed attempt it is put back as before it.
        set_up: configures and sets up `module` on the strategy it is given.
        fallbacks: under `auto`, the names of the candidates after the chosen one that the forecast
            fits, in rank order (attempts then run on forks); None for a strategy the user chose.
        connect: a name -> a new strategy, checked and connected like the Trainer's.
        budget: on CPU, `memory_budget`: an attempt whose strategy holds more after setup fails.
        log0: prints on rank 0. hint: one line naming a plan that fits, for a user's strategy.
    Returns:
        (`strategy` itself, None) for a user's strategy; under `auto` a fork of the candidate that
        set up and the `FirstSteps` that guard its first steps.
    Raises:
        The last attempt's out-of-memory error when no candidate is left; for a user's strategy,
        its error, after printing `hint()`. Any other exception propagates at once.
    """
    if fallbacks is None:
        try:
            set_up(strategy)
            return strategy, None
        except Exception as e:
            if is_out_of_memory(e) and (line := hint()):
                log0(line)
            raise
    names, parent, start = [strategy.name, *fallbacks], strategy, rng_state()
    for i, name in enumerate(names):
        parent = parent if i == 0 else connect(name)
        attempt, kept, error = parent.fork(), snapshot(module), None
        began = time.perf_counter()
        try:
            set_up(attempt)
            held = sum(attempt.measure().values()) if budget is not None else 0
            if budget is not None and held > budget:
                raise SetupOutOfMemory(f"{gib(held)} held after setup, budget {gib(budget)}")
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            # its frames hold the half-built attempt (an engine) through the release below; the
            # last candidate's error keeps them, for the user's traceback
            error = e if i + 1 == len(names) else drop_traceback(e)
        # One verdict for every rank: a rank that set up frees its attempt when another did not.
        if all_ranks_ok(error is None):
            return attempt, FirstSteps(name, tuple(names[i + 1 :]), kept, start, budget)
        why = f"out of memory: {str(error).splitlines()[0][:120]}" if error else "another rank"
        error = error or SetupOutOfMemory("another rank ran out of memory at setup")
        failed_at = time.perf_counter()
        release(attempt, module, kept)
        del attempt
        set_rng_state(start)  # the next attempt builds the weights this one built
        line = (
            f"strategy='auto': {name} failed at setup after {failed_at - began:.2f} s ({why}); "
            f"released in {time.perf_counter() - failed_at:.2f} s"
        )
        if i + 1 == len(names):
            log0(f"{line}; no other plan fits.")
            raise error
        log0(f"{line}; trying {names[i + 1]}, the next plan that fits.")
    raise AssertionError("unreachable")


# The second step runs beside what the first allocated (torch optimizers' state, ZeRO-3's gradient
# partitions): two steps see the plan's steady peak.
FIRST_STEPS = 2

T = TypeVar("T")


class StepsOutOfMemory(MemoryError):
    """Under `auto`: the plan ran out of memory in one of its first steps on some rank (raised on
    every rank, after the one verdict)."""


@dataclass
class FirstSteps:
    """What the first steps of a plan set up under `auto` need to give way to the next plan: its
    name, the plans after it that the forecast fits, the module's snapshot and the random state
    from before its setup, and on CPU the budget. `left`: steps still guarded."""

    name: str
    names: tuple[str, ...]
    kept: torch.nn.Module | None
    start: dict
    budget: float | None = None
    left: int = FIRST_STEPS
    at_first_step: dict | None = None  # the random state the first step found

    def guard(self, module: torch.nn.Module, strategy: Any, step: Callable[[], T]) -> T:
        """Runs `step()` (one training step on `strategy`); while steps are guarded, an
        out-of-memory error in it (on CPU: more held than the budget, saved tensors included) on any
        rank raises StepsOutOfMemory on every rank, at the step's end. Collective while guarded."""
        if self.left <= 0:
            return step()
        if self.at_first_step is None:
            self.at_first_step = rng_state()
            detach_from(self.kept, module)
        meter, out, error = _Meter(strategy, self.budget), None, None
        saved = SavedBoxes(meter.pack)
        try:
            with saved.hooks():
                out = step()
            error = meter.over()
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            error = f"out of memory: {str(e).splitlines()[0][:120]}"
            drop_traceback(e)
        # Outside the except block: the traceback no longer holds the failed step's tensors.
        if not all_ranks_ok(error is None):
            del out
            saved.empty()  # the failed step's graph may outlive it (SavedBoxes)
            raise StepsOutOfMemory(error or "another rank ran out of memory")
        self.left -= 1
        if self.left == 0:
            self.kept = None  # the host copy the model was built in can go
        return out  # type: ignore[return-value]  # set when no error was caught

    def next_plan(
        self,
        failed: Any,
        module: torch.nn.Module,
        set_up: Callable[[Any], None],
        connect: Callable[[str], Any],
        log0: Callable[[str], None],
        why: str,
    ) -> tuple[Any, FirstSteps | None]:
        """Frees `failed` (the strategy whose first steps ran out of memory), puts the module and
        the random state back as before its setup, and sets up the next plan that fits (itself
        falling back at setup), with the random state the first step found. One line says so.
        Raises StepsOutOfMemory when no plan is left."""
        step = FIRST_STEPS - self.left + 1
        assert self.kept is not None, "the first steps are over: nothing to restore"
        # Called while the loop handles StepsOutOfMemory: that error's frames (the failed step's
        # loop, its strategy) would keep the failed plan alive through its release.
        if (handled := sys.exc_info()[1]) is not None:
            drop_traceback(handled)
        began = time.perf_counter()
        release(failed, module, self.kept)
        set_rng_state(self.start)
        line = (
            f"strategy='auto': {self.name} ran out of memory in step {step} ({why}); released in "
            f"{time.perf_counter() - began:.2f} s"
        )
        if not self.names:
            log0(f"{line}; no other plan fits.")
            raise StepsOutOfMemory(why)
        log0(f"{line}; trying {self.names[0]}, the next plan that fits.")
        fallbacks = self.names[1:]
        strategy, first = set_up_or_fall_back(
            connect(self.names[0]), module, set_up, fallbacks, connect, self.budget, log0
        )
        set_rng_state(self.at_first_step or self.start)
        return strategy, first


class _Box:
    """One saved tensor, as the graph holds it (SavedBoxes)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor: torch.Tensor | None = tensor


class SavedBoxes:
    """The `saved_tensors_hooks` of a guarded step (a micro-batch trial's, a plan's first steps):
    every tensor autograd saves is handed to the graph in a box, and `empty()` lets go of them all.

    A backward that raises can leave its graph alive after every Python reference to it is gone:
    under DeepSpeed (0.19) a failed backward's graph stayed alive with no Python referrer (plain
    torch with the same failure frees it), and through a pack hook bound to the trial's meter it
    held the engine, its optimizer and the saved activations (on CPU, with an out-of-memory error
    injected in the backward; on one H200 a failed GPT-2 trial left 3.5 GiB allocated). Emptying
    the boxes returns the activations all the same. The pack hook holds `count` (a bound method)
    weakly, and the boxes weakly: a graph that completes frees its saved tensors as before, and a
    leaked one holds no strategy or engine through these hooks."""

    def __init__(self, count: Callable[[torch.Tensor], Any] | None = None):
        # a bound method (the meter's), held weakly
        self._count = weakref.WeakMethod(count) if count is not None else None  # type: ignore
        self._boxes: list[weakref.ref[_Box]] = []

    def pack(self, t: torch.Tensor) -> _Box:
        count = self._count() if self._count is not None else None
        if count is not None:
            count(t)  # may raise (a host budget passed): before the box exists
        box = _Box(t)
        self._boxes.append(weakref.ref(box))
        return box

    @staticmethod
    def unpack(box: _Box) -> torch.Tensor:
        assert box.tensor is not None, "a saved tensor was let go (SavedBoxes.empty) before use"
        return box.tensor

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def empty(self) -> None:
        """Lets go of every tensor still saved in a box (a failed step's graph is never run)."""
        for ref in self._boxes:
            if (box := ref()) is not None:
                box.tensor = None
        self._boxes.clear()


def strip_tensors(module: torch.nn.Module) -> None:
    """Drops the storage of a discarded module's parameters and buffers, their gradients and
    DeepSpeed partitions: for when the objects themselves may outlive it (a failed backward's
    graph holds its parameters). Parameters another module shares keep their storage there (only
    this module's objects are emptied)."""
    for p in module.parameters():
        try:
            p.grad = None
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        except (RuntimeError, TypeError):  # a wrapper's parameter class that refuses (DTensor)
            continue
        if getattr(p, "ds_tensor", None) is not None:
            p.ds_tensor = None  # type: ignore[attr-defined]
    for b in module.buffers():
        try:
            b.data = torch.empty(0, dtype=b.dtype, device=b.device)
        except (RuntimeError, TypeError):
            continue


def drop_traceback(error: BaseException) -> BaseException:
    """`error` without the frames its traceback holds (nor those of the errors it chained): the
    locals of every finished frame are cleared (a failed setup's half-built engine, a failed step's
    tensors) and the traceback dropped. Frames still running are left as they are. Returns
    `error`."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        e = e.__cause__ or e.__context__
    return error


class _Meter:
    """On CPU with a budget: the bytes a step's saved tensors add (once per storage, weights
    excluded) to what the strategy held before it, and what it holds after it."""

    def __init__(self, strategy: Any, budget: float | None):
        self.strategy, self.budget, self.seen = strategy, budget, set()
        self.total = sum(measure(strategy).values()) if budget is not None else 0

    def pack(self, t: torch.Tensor) -> None:
        if self.budget is None or t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        is_weight = t.requires_grad and t.grad_fn is None
        if not is_weight and storage._cdata not in self.seen:
            self.seen.add(storage._cdata)
            self.total += storage.nbytes()

    def over(self) -> str | None:
        if self.budget is None:
            return None
        held = max(self.total, sum(measure(self.strategy).values()))
        if held <= self.budget:
            return None
        return f"out of memory: {gib(held)} held in the step, budget {gib(self.budget)}"


def detach_from(kept: torch.nn.Module | None, module: torch.nn.Module) -> None:
    """Where the set-up `module` steps the very tensors the snapshot `kept` shares (single or ddp
    on the CPU), gives the snapshot its own copies, so a retry starts from the weights before any
    step. A strategy that moved, cast or sharded the weights left the snapshot's untouched."""
    if kept is None:
        return
    live = {_data_ptr(t) for t in (*module.parameters(), *module.buffers())} - {None}
    copies: dict[int, Any] = {}  # one copy per tensor: a weight tied in two places stays tied

    def own(t: torch.Tensor, make: Callable[[torch.Tensor], Any]) -> Any:
        if id(t) not in copies:
            shared = t.numel() and _data_ptr(t) in live
            copies[id(t)] = make(t) if shared else t
        return copies[id(t)]

    for sub in kept.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = own(
                    p, lambda p: torch.nn.Parameter(p.data.clone(), p.requires_grad)
                )
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = own(b, lambda b: b.clone())


def _data_ptr(t: torch.Tensor) -> int | None:
    """The address of `t`'s storage; None for a tensor subclass without one (FSDP's DTensor)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def connected(strategy: Any, spec: Any, dist_info: Any, device: torch.device) -> Any:
    """`strategy` checked against the run's flags and connected like the Trainer's own (the
    process group exists already: it is joined, not created)."""
    strategy.check(spec)
    strategy.connect(spec, dist_info, device)
    return strategy


def all_ranks_ok(ok: bool) -> bool:
    """True on every rank when `ok` is True on every rank (a min-reduce). Collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    )
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def snapshot(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module`'s structure (every submodule, its hooks and attributes) whose parameters
    and buffers are new objects sharing the original tensors' storage: what the module was, for
    `restore`, at no tensor memory. The root's own non-module attributes (its Trainer, datasets)
    stay the same objects; its nn.Module internals (hook dicts too) are copied."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(p.data, requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.data
    for key, value in vars(module).items():
        if key not in MODULE_INTERNALS:  # the user's own attributes: kept, not copied
            memo[id(value)] = value
    return copy.deepcopy(module, memo)


# What nn.Module keeps in every instance (submodules, parameters, buffers, hook dicts): copied by
# `snapshot`, since an attempt changes them in place (FSDP registers hooks on the root).
MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))


def restore(module: torch.nn.Module, kept: torch.nn.Module) -> None:
    """Puts `module` back as `kept` (its `snapshot`) shows it: its attributes and submodules, and
    its class where a wrapper changed it (FSDP's `fully_shard` makes the root an FSDP class)."""
    state = vars(kept)
    vars(module).clear()
    vars(module).update(state)
    if type(module) is not type(kept):
        module.__class__ = type(kept)


def release(attempt: Any, module: torch.nn.Module, kept: torch.nn.Module) -> None:
    """Frees a failed attempt: its engine and wrappers (a fork's teardown keeps the group), the
    module's state as the attempt left it (put back from `kept`), then the device's cached
    memory."""
    try:
        attempt.teardown()
    except Exception:  # noqa: BLE001 - a half-built engine may fail to tear down; it is dropped
        pass
    # The attempt's parameter objects (the snapshot holds others, over the original storage) may
    # outlive it in a failed backward's graph: their storage (a DeepSpeed flat buffer's views, a
    # device copy) goes now.
    strip_tensors(module)
    restore(module, kept)
    gc.collect()  # the attempt's engine and copies sit in reference cycles
    release_device_memory()


def release_device_memory() -> None:
    """Returns the caching allocator's free blocks and cuBLAS's workspaces (which empty_cache
    keeps, and which can pin a whole freed segment) to the device."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()


def plan_hint(
    module: torch.nn.Module,
    world_size: int,
    precision: str,
    device_type: str,
    memory_budget: float | None = None,
) -> Callable[[], str | None]:
    """For a strategy the user chose: a function returning the one line printed when its setup
    runs out of memory, naming the first plan the forecast fits in this device's memory. The shapes
    are read now (before setup changes them); the forecast runs only if the line is needed.
    Activations are not probed (no batch here): the line says so."""
    params = list(dict.fromkeys(module.parameters()))
    if not params:
        return lambda: None
    shapes = [tuple(p.shape) for p in params]
    blocks = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]
    unit = max(
        (sum(p.numel() for p in b.parameters()) for lst in blocks for b in lst),
        default=sum(p.numel() for p in params),
    )

    def line() -> str | None:
        facts = ModelFacts([shapes], 2, True, "AdamW", unit)  # Adam's layout, as most runs use
        if device_type == "cuda" and memory_budget is None:
            device = torch.device("cuda", torch.cuda.current_device())
            whole = torch.cuda.mem_get_info(device)[1]
            memory_budget_ = torch.cuda.get_per_process_memory_fraction(device) * whole
        else:
            memory_budget_ = device_memory(device_type, world_size, memory_budget)[0]
        try:
            choice = auto_choice(
                module,
                world_size,
                precision,
                1,
                device_type,
                memory_budget_,
                show=False,
                facts=facts,
            )
        except Exception:  # noqa: BLE001 - nothing fits, or the forecast cannot read this model
            return "lightspeed plan: no plan fits this model in this device's memory."
        f = choice.forecast
        return (
            f"lightspeed plan: {choice.name} would fit ({gib(f.device_total)} per device of "
            f"{gib(memory_budget_)}, model states only: activations not probed); "
            f"strategy='auto' chooses and falls back by itself."
        )

    return line
