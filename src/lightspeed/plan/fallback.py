"""A plan that runs out of memory at setup is not the end of the run: the next plan that fits is.

    strategy = set_up_or_fall_back(strategy, module, set_up, fallbacks, connect, facts, log0)

Under `strategy="auto"` the plan (`forecast.auto_choice`) ranks every candidate that fits; the
Trainer sets up the first. If `configure_model` or `setup` runs out of memory on any rank (CUDA's
out-of-memory error, a host `MemoryError`, or on CPU the bytes the strategy holds past
`Trainer(memory_budget=...)`), every rank learns it from one min-reduce, the attempt is torn down
(engine, wrappers, its memory returned to the device), the module is put back as it was before the
attempt, and the next candidate is set up. One line says what failed and what runs instead.

Each attempt runs on a fork of its strategy (`Strategy.fork()`: connected, its own engine, the
process group its parent's), so a failed one can be freed without leaving the group. The module is
put back from a snapshot of its structure: every submodule copied, every parameter and buffer
shared with the original tensors, so the snapshot costs no tensor memory beyond keeping the host
copy the model was built in alive until setup ends (the forecast counts it: `host_setup`).

A strategy the user chose has no fallback: its out-of-memory error propagates as before, after one
line naming the plan `lightspeed plan` forecasts would fit (from the model's shapes, activations
not probed).
"""

from __future__ import annotations

import copy
import gc
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.plan.chart import gib
from lightspeed.plan.forecast import auto_choice, device_memory
from lightspeed.plan.probe import ModelFacts
from lightspeed.runtime.rng import rng_state, set_rng_state

__all__ = [
    "SetupOutOfMemory",
    "is_out_of_memory",
    "set_up_or_fall_back",
    "connected",
    "all_ranks_ok",
    "snapshot",
    "restore",
    "release_device_memory",
    "plan_hint",
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
) -> Any:
    """Runs `set_up(s)` (configure_model, then setup) and returns the strategy `s` that is set up.

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
        `strategy` itself for a user's strategy; under `auto` a fork of the candidate that set up.
    Raises:
        The last attempt's out-of-memory error when no candidate is left; for a user's strategy,
        its error, after printing `hint()`. Any other exception propagates at once.
    """
    if fallbacks is None:
        try:
            set_up(strategy)
            return strategy
        except Exception as e:
            if is_out_of_memory(e) and (line := hint()):
                log0(line)
            raise
    names, parent, start = [strategy.name, *fallbacks], strategy, rng_state()
    for i, name in enumerate(names):
        parent = parent if i == 0 else connect(name)
        attempt, kept, error = parent.fork(), snapshot(module), None
        try:
            set_up(attempt)
            held = sum(attempt.measure().values()) if budget is not None else 0
            if budget is not None and held > budget:
                raise SetupOutOfMemory(f"{gib(held)} held after setup, budget {gib(budget)}")
        except Exception as e:
            if not is_out_of_memory(e):
                raise
            error = e
        # One verdict for every rank: a rank that set up frees its attempt when another did not.
        if all_ranks_ok(error is None):
            return attempt
        why = f"out of memory: {str(error).splitlines()[0][:120]}" if error else "another rank"
        error = error or SetupOutOfMemory("another rank ran out of memory at setup")
        release(attempt, module, kept)
        del attempt
        set_rng_state(start)  # the next attempt builds the weights this one built
        if i + 1 == len(names):
            log0(f"strategy='auto': {name} failed at setup ({why}); no other plan fits.")
            raise error
        log0(
            f"strategy='auto': {name} failed at setup ({why}); trying {names[i + 1]}, the next "
            "plan that fits."
        )
    raise AssertionError("unreachable")


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
