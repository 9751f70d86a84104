"""Faster kernels for the code users write: fused optimizer steps and `torch.compile` (regional, or
whole on one device).

    optimizers, note = apply_fused_optimizers(optimizers, schedulers, backend="torch",
    device_type="cuda",
                                              offload=False)
    names = apply_compile(model)          # after activation checkpointing, before DDP / FSDP /
    DeepSpeed

Both change nothing the user can observe but speed: the fused optimizer runs the same update in
fewer kernels (tests/test_kernels.py compares per-step losses), and compiling a block in place keeps
its state_dict keys.
"""

from __future__ import annotations

import inspect
import os
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
from torch import nn

# A scheduler re-pointed at the rebuilt optimizer warns once that "optimizer.step() has been
# overridden": torch
# looks for the marker it put on the *original* optimizer's step. The scheduler itself is
# unaffected.
warnings.filterwarnings(
    "ignore", message=r"Seems like `optimizer.step\(\)` has been overridden", category=UserWarning
)

FUSABLE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

# The optimizer each rebuilt one replaced. A `configure_optimizers` that returns the same optimizer
# and scheduler objects at every fit finds its scheduler pointed at the previous fit's rebuilt
# optimizer; `unbind_rebuilt` points it back. Weak: a rebuilt optimizer goes with its fit.
_REBUILT_FROM: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def apply_fused_optimizers(
    optimizers: list,
    schedulers: list,
    *,
    backend: Literal["torch", "deepspeed"],
    device_type: str,
    offload: bool,
    fused_adam: Callable[[Any], Any] | None = None,
) -> tuple[list, str | None]:
    """Rebuilds each plain torch Adam / AdamW / SGD whose user left `fused` and `foreach` unset as
    its fused form.

    Backend "torch": the same class with `fused=True`, where every parameter is a floating-point
    tensor on one device type that torch has fused kernels for (CUDA and CPU among them; the
    parameters' own device decides, so FSDP's cpu_offload gets the CPU kernel). Backend "deepspeed"
    on CUDA: Adam/AdamW become DeepSpeed's FusedAdam (what DeepSpeed builds from its own config),
    SGD gets torch's `fused=True`; off CUDA torch's fused kernels as above (FusedAdam's CPU build is
    a JIT compile). Under optimizer offload nothing changes (DeepSpeedCPUAdam is picked elsewhere).
    Subclasses, optimizers that have stepped, and options the fused kernels lack (differentiable;
    amsgrad or maximize for FusedAdam) are left as written.

    Param groups keep every key (a scheduler's `initial_lr` survives) and the hyper-parameters; the
    schedulers in `schedulers` (SchedulerConfig or bare schedulers, SequentialLR's children too)
    that drove a replaced optimizer are re-pointed at its replacement, in place.

    Args:
        optimizers: what `configure_optimizers` returned, parsed. The list itself is not changed.
        schedulers: their LR schedulers.
        backend: "torch" (single, DDP, ZeRO-1, FSDP) or "deepspeed".
        device_type: the strategy's device type ("cuda", "cpu"); decides for the "deepspeed"
        backend, whose
            parameters are moved there after this call.
        offload: the optimizer state is offloaded (DeepSpeed offload_optimizer).
        fused_adam: builds DeepSpeed's FusedAdam from a torch Adam/AdamW (None where it cannot run
        the same
            update); given by the DeepSpeed strategy, which alone imports DeepSpeed.
    Returns:
        (the optimizers, replaced ones in place of the originals; a one-line note for the log, or
        None if nothing was replaced).
    """
    if backend not in ("torch", "deepspeed"):
        raise ValueError(f"backend={backend!r}: use 'torch' or 'deepspeed'")
    out, replaced = [], []
    for opt in optimizers:
        new = (
            None
            if offload or not _is_unfused(opt)
            else _rebuild(opt, backend, device_type, fused_adam)
        )
        out.append(new or opt)
        if new is not None:
            rebind_schedulers(schedulers, opt, new)
            _REBUILT_FROM[new] = opt
            replaced.append(f"torch.optim.{type(opt).__name__} -> {_describe(new)}")
    if not replaced:
        return out, None
    rebound = " (LR schedulers rebound)" if schedulers else ""
    return out, (
        f"optimizer_kernels='fused': {', '.join(replaced)}, same param groups and hyper-parameters"
        f"{rebound}; Trainer(optimizer_kernels='as_written') keeps the optimizer as written."
    )


def build_optimizers_fast(
    build: Any,
    spec: Any,
    *,
    backend: Literal["torch", "deepspeed"],
    device_type: str,
    offload: bool = False,
    is_global_zero: bool = True,
    fusable: bool = True,
    fused_adam: Callable[[Any], Any] | None = None,
) -> tuple[list, list]:
    """Runs the user's `configure_optimizers` (`build()`) and, unless `spec.optimizer_kernels` is
    "as_written" or the strategy says the kernels do not fit (`fusable` False), swaps in fused
    kernels (`apply_fused_optimizers`), saying so once on rank 0. What every strategy's setup
    calls."""
    optimizers, schedulers = build()
    if spec.optimizer_kernels == "fused" and fusable:
        optimizers, note = apply_fused_optimizers(
            optimizers,
            schedulers,
            backend=backend,
            device_type=device_type,
            offload=offload,
            fused_adam=fused_adam,
        )
        if note and is_global_zero:
            print(note, flush=True)
    if is_global_zero and (hint := matmul_precision_hint(spec)):
        print(hint, flush=True)
    return optimizers, schedulers


def matmul_precision_hint(spec: Any) -> str | None:
    """One line for a run in full fp32 on a CUDA GPU with TF32 tensor cores (compute capability 8.0
    and up) whose fp32 matmuls torch keeps at "highest" (its default): there they skip the tensor
    cores. None otherwise: under mixed precision the matmuls run in bf16/fp16 already, and before
    Ampere there is no TF32 to turn on."""
    if (
        spec.precision != "32-true"
        or spec.device_type != "cuda"
        or torch.get_float32_matmul_precision() != "highest"
    ):
        return None
    if torch.cuda.get_device_capability()[0] < 8:
        return None
    return (
        f"precision='32-true' on {torch.cuda.get_device_name()}: fp32 matmuls skip its TF32 tensor "
        "cores "
        "(torch.get_float32_matmul_precision() is 'highest'). A ViT-B/16 step ran 2.5x faster with "
        "torch.set_float32_matmul_precision('high') on an H200 (docs/benchmarks.md); call it "
        "before "
        "fit, or "
        "train with precision='bf16-mixed'."
    )


def _is_unfused(opt: Any) -> bool:
    """A torch Adam/AdamW/SGD (not a subclass) that has not stepped and whose user chose no
    implementation."""
    if type(opt) not in FUSABLE or opt.state:
        return False
    chosen = [g.get(k) for g in opt.param_groups for k in ("fused", "foreach")] + [
        opt.defaults.get("fused"),
        opt.defaults.get("foreach"),
    ]
    return all(c is None for c in chosen) and not opt.defaults.get("differentiable", False)


def _rebuild(
    opt: torch.optim.Optimizer,
    backend: str,
    device_type: str,
    fused_adam: Callable[[Any], Any] | None,
) -> Any:
    if backend == "deepspeed" and device_type == "cuda" and type(opt) is not torch.optim.SGD:
        return fused_adam(opt) if fused_adam is not None else None
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    params = [p for g in opt.param_groups for p in g["params"]]
    # DeepSpeed moves the model to `device_type` after this and steps on its own flat fp32 copies
    # there; torch's
    # strategies have placed the parameters already (on CPU under FSDP's cpu_offload), so theirs
    # decide.
    devices = {device_type} if backend == "deepspeed" else {p.device.type for p in params}
    if len(devices) != 1 or not devices <= set(_get_fused_kernels_supported_devices()):
        return None
    if not all(torch.is_floating_point(p) for p in params):
        return None
    if type(opt) is torch.optim.SGD and any(hasattr(p, "device_mesh") for p in params):
        # FSDP's DTensor shards: torch has no sharding rule for the fused SGD kernel (Adam's it has)
        return None
    cls: Any = type(opt)  # any torch optimizer class with a `fused` flag
    if cls is torch.optim.SGD and any(type(p).__name__ == "DTensor" for p in params):
        # FSDP2's sharded parameters: DTensor has no sharding rule for torch's fused SGD kernel
        return None
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    # `defaults` can hold bookkeeping keys the constructor does not take (AdamW's
    # decoupled_weight_decay).
    defaults = {
        k: v for k, v in opt.defaults.items() if k in accepted and k not in ("fused", "foreach")
    }
    groups = [dict(g, params=list(g["params"]), fused=True, foreach=None) for g in opt.param_groups]
    return cls(groups, fused=True, **defaults)


def _describe(opt: Any) -> str:
    if type(opt).__module__.startswith("deepspeed"):
        return f"deepspeed FusedAdam(adam_w_mode={bool(opt.adam_w_mode)})"
    return f"{type(opt).__name__}(fused=True)"


def rebind_schedulers(schedulers: list, old: Any, new: Any) -> None:
    """Points every scheduler (a SchedulerConfig or a bare scheduler, and the children of
    SequentialLR or ChainedScheduler) that drives `old` at `new`. Schedulers keep their own state
    (step count, base lrs) and only read and write `optimizer.param_groups`, whose keys the rebuilt
    optimizer carries over."""
    for sched in _all_schedulers(schedulers):
        if getattr(sched, "optimizer", None) is old:
            sched.optimizer = new


def unbind_rebuilt(schedulers: list) -> None:
    """Points every scheduler that drives an optimizer rebuilt by an earlier fit back at the
    user's optimizer it replaced (see `_REBUILT_FROM`), which takes over the rebuilt one's state
    and hyper-parameters (the scheduled lr): the new fit goes on from there, as with one object."""
    for sched in _all_schedulers(schedulers):
        rebuilt = getattr(sched, "optimizer", None)
        if rebuilt is None or rebuilt not in _REBUILT_FROM:  # False for no weak reference
            continue
        original = sched.optimizer = _REBUILT_FROM[rebuilt]
        state = rebuilt.state_dict()
        for group in state["param_groups"]:
            group.pop("fused", None)  # the user's choice (None) stays
        original.load_state_dict(state)


def _all_schedulers(schedulers: list) -> list:
    """The schedulers (SchedulerConfigs unwrapped) and, within them, SequentialLR's and
    ChainedScheduler's children."""
    stack, out = [getattr(s, "scheduler", s) for s in schedulers], []
    while stack:
        out.append(sched := stack.pop())
        stack.extend(getattr(sched, "_schedulers", []))
    return out


# ----------------------------------------------------------------------------------------------
# compile
def skip_alignment_asserts() -> None:
    """Turns off inductor's `alignment_asserts` (a debug check in the code it generates) for this
    process, unless the user set TORCHINDUCTOR_ALIGNMENT_ASSERTS. torch's inductor checks every
    output of a fallback op, and an output the op leaves undefined fails it: cuDNN attention without
    grad (validation, prediction) leaves its
    logsumexp undefined, and the compiled forward stopped with "TypeError: expected Tensor() for op:
    torch.ops.aten._scaled_dot_product_cudnn_attention.default" (an H200, torch 2.11; pytorch issue
    #196226). PyTorch's own fbcode builds ship with the check off. Called wherever lightspeed
    compiles."""
    if "TORCHINDUCTOR_ALIGNMENT_ASSERTS" not in os.environ:
        import torch._inductor.config as inductor

        inductor.alignment_asserts = False


def apply_compile(
    module: nn.Module,
    *,
    block_classes: list[type] | None = None,
    options: bool | dict = True,
    whole: bool = False,
) -> list[str]:
    """Compiles, in place, the repeated blocks of `module` with `torch.compile` (regional
    compilation), or with `whole` the modules `training_step` calls, each as one unit.

    The blocks are the children of every nn.ModuleList (the units FSDP shards), or the modules whose
    class is in `block_classes`; a block already wrapped by activation checkpointing is compiled
    with its wrapper. A model with neither, or any model with `whole`, gets each direct child that
    holds parameters compiled (what `training_step` calls, whether it is `self(x)` or
    `self.model(x)`; a ModuleList or ModuleDict child: each of its items), or, with no such child,
    the module itself. `Module.compile()` is used, so `state_dict()` keys and parameter names do not
    change and the blocks stay where they are.

    `whole` is for one device (the single strategy), where no hook has to run between blocks:
    inductor then fuses across the blocks' boundaries (a block's residual add with the next block's
    layer norm, the embeddings, the final norm) and `CompiledStep` traces the step with the model
    inside one graph, loss included. On one H200 the suite's GPT ran 0.3-1.1% faster than block by
    block, for a longer first compile (24 blocks: 32 s against 13; 48 blocks: 74 s against 14; from
    inductor's warm cache, a few seconds more; docs/benchmarks.md). The strategies that hook between
    blocks (DDP's bucketed all-reduce during the backward, FSDP2's and ZeRO-3's gathers, ZeRO-2's
    gradient reduction) compile block by block, so their hooks still fire block by block.

    Order: after activation checkpointing (a checkpointed block is compiled whole, recomputation
    included) and before DDP / FSDP / DeepSpeed wrap the model (their hooks then stay outside the
    compiled code: dynamo skips FSDP2's hooks and DeepSpeed marks its ZeRO-3 hooks
    `torch.compiler.disable`).

    `options` is the Trainer's `compile` flag: True, or a dict of torch.compile options (mode,
    backend, ...).

    Returns:
        the qualified names of the compiled modules ("" for the root), in module order.
    """
    skip_alignment_asserts()
    if whole:
        found = []  # no blocks: the modules the step calls, below
    elif block_classes:
        classes = tuple(block_classes)
        found = [(n, m) for n, m in module.named_modules() if isinstance(_unwrapped(m), classes)]
    else:
        found = [
            (f"{n}.{i}" if n else str(i), child)
            for n, m in module.named_modules()
            if isinstance(m, nn.ModuleList)
            for i, child in enumerate(m)
        ]
    names, taken = [], []
    for name, m in found:  # outermost first: a compiled block's own sub-blocks run inside its graph
        if any(name == t or name.startswith(t + ".") or t == "" for t in taken):
            continue
        taken.append(name)
        names.append(name)
    if not names:
        names = _called_children(module) or [""]
    for name in names:
        target = module.get_submodule(name)
        if (
            getattr(target, "_compiled_call_impl", None) is None
        ):  # already compiled: leave its cache
            target.compile(**(options if isinstance(options, dict) else {}))
    return names


def _called_children(module: nn.Module) -> list[str]:
    """The names of `module`'s direct children that hold parameters, a ModuleList's or ModuleDict's
    items in its place (those containers have no forward of their own to compile)."""
    names = []
    for name, child in module.named_children():
        items = (
            child.named_children()
            if isinstance(child, (nn.ModuleList, nn.ModuleDict))
            else [("", child)]
        )
        names += [
            f"{name}.{n}" if n else name for n, m in items if any(True for _ in m.parameters())
        ]
    return names


def _unwrapped(m: nn.Module) -> nn.Module:
    """The block inside an activation-checkpointing wrapper, or `m` itself. A wrapper and its block
    match the same class; the wrapper comes first in module order, so it is the one compiled."""
    return getattr(m, "_checkpoint_wrapped_module", m)


def compiled_frames() -> int:
    """How many frames torch.compile has compiled in this process so far. A compiled block is
    compiled on its first call, so a count that has not grown since `apply_compile` means no
    compiled code has run. 0 while torch.compile has not been imported (importing it takes a
    second)."""
    if "torch._dynamo.utils" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def compiled_ran(since: int) -> bool:
    """True if torch.compile compiled (hence ran) any frame after `since`, a `compiled_frames()`
    taken before the first step. Used by the Trainer for its "compile=True but nothing compiled ran"
    warning."""
    return compiled_frames() > since


# ----------------------------------------------------------------------------------------------
# compiled step
def unwrap_compiled(module: Any, compiling: bool, print0: Any = print) -> tuple[Any, dict | None]:
    """Lightning's way to compile, `trainer.fit(torch.compile(model))`: returns the Module inside
    torch.compile's wrapper (an OptimizedModule, whose state_dict keys would carry an `_orig_mod.`
    prefix into checkpoints and whose compiled `forward` the steps never call), with the `compile`
    flag to turn on when it is off (`compiling` False): `{"backend": <the wrapper's>}`, said through
    `print0`, so the model is compiled the lightspeed way (blocks, then the step) under any
    strategy. Anything else is returned as it is, with None."""
    compiled = sys.modules.get(
        "torch._dynamo.eval_frame"
    )  # imported by any torch.compile; not here (1 s)
    if compiled is None or not isinstance(module, compiled.OptimizedModule):
        return module, None
    if compiling:
        return module._orig_mod, None
    from torch._dynamo.eval_frame import innermost_backend

    # The wrapper's backend carries the user's mode and options (inductor's wrapper holds them as
    # its config).
    backend = innermost_backend(module.dynamo_ctx.callback)
    print0(
        "torch.compile(model) was passed: lightspeed trains the module inside it with "
        "compile=True "
        "and its backend (its repeated blocks, then training_step around them); checkpoints "
        "keep the "
        "module's keys."
    )
    return module._orig_mod, {"backend": backend}


def compile_step(module: nn.Module, options: bool | dict) -> Any:
    """What the Trainer calls as `training_step`: the module's own, or with the `compile` flag set
    (True or a dict of torch.compile options) and automatic optimization a `CompiledStep` of it.
    Under manual optimization the step holds optimizer calls, left as written."""
    if options is False or not getattr(module, "automatic_optimization", True):
        return module.training_step
    return CompiledStep(
        module,
        **{
            k: v
            for k, v in (options if isinstance(options, dict) else {}).items()
            if k != "fullgraph"
        },
    )  # the step graph-breaks at each module call, by design


RECOMPILE_CALLS = (
    3  # CompiledStep: consecutive recompiling calls after which the step runs as written
)


class CompiledStep:
    """`module.training_step` compiled by torch.compile, with the modules it calls kept out of its
    graph.

    Regional compilation (`apply_compile`) leaves out what `training_step` computes around the
    model; for a language model that is the fp32 cast and cross-entropy of the logits (8×1024×32000
    on the suite's GPT), which eager mode runs as several passes over a GiB-sized tensor and
    compiled as one fused kernel each way. Here the step's own frame is compiled while the modules
    it may call (`_opaque_modules`: all but torch.nn's parameter-free ones, not looking inside
    compiled blocks) are opaque to it for the duration of the call: such a call, hooks included
    (DDP, FSDP2, ZeRO-3), runs as it would without this, and its regionally compiled blocks run
    their own compiled code. So the graphs hold only the arithmetic around the model, no parameter
    is read inside them, and the strategies' gradient hooks fire where they did. On one device the
    model is compiled whole (`apply_compile(whole=True)`), so it is not opaque: the step is traced
    with the model inlined, one graph from the tokens to the loss, as `torch.compile` of a function
    computing both would give. `self.log`, `log_dict` and `print` (the names in the module's
    `_compile_opaque`) are made opaque the same way: they graph-break and run eagerly.

    A call is made opaque by pointing the module's `_compiled_call_impl` (what `nn.Module.__call__`
    runs when set) at `torch.compiler.disable` of its `_call_impl`, with its bound `forward` in the
    instance's `__dict__` (without it dynamo inlines the class's `forward` directly); both are
    undone after the step, so nothing stays changed outside it (deep copies, checkpoints and other
    callers see the module as it was).

    If torch.compile fails on the step (an error of dynamo or a backend, not of the user's code),
    the step warns once and runs as written from then on; the blocks stay compiled. An error of the
    user's code then surfaces from the step as written.
    """

    def __init__(self, module: nn.Module, **options: Any):
        skip_alignment_asserts()
        self.step = cast("Callable[..., Any]", module.training_step)  # the user's Module's
        self.compiled = torch.compile(self.step, **options)
        self.opaque = [
            (m, torch.compiler.disable(m._call_impl), m.forward) for m in _opaque_modules(module)
        ]
        # The module's own conveniences that touch Python state (Module._compile_opaque: self.log,
        # ...).
        self.module, self.methods = (
            module,
            [
                (name, torch.compiler.disable(getattr(module, name)))
                for name in getattr(module, "_compile_opaque", ())
                if name not in module.__dict__
            ],
        )
        self.failed: str | None = None  # why the step runs as written, once it does
        self.calls, self.recompiling = 0, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed is None:
            from torch._dynamo.exc import TorchDynamoException

            for m, hidden, forward in self.opaque:
                m._compiled_call_impl = hidden
                m.__dict__["forward"] = (
                    forward  # dynamo otherwise goes straight to the class's forward
                )
            self.module.__dict__.update(self.methods)
            frames = compiled_frames()
            try:
                out = self.compiled(*args, **kwargs)
                self._count(compiled_frames() > frames)
                return out
            except (
                TorchDynamoException
            ) as err:  # the compiler's failure; the user's errors re-raise below
                self._give_up(
                    f"it could not be compiled ({type(err).__name__}: "
                    f"{str(err).splitlines()[0][:200]})"
                )
            finally:
                for m, _, _ in self.opaque:
                    m._compiled_call_impl = None
                    del m.__dict__["forward"]
                for name, _ in self.methods:
                    del self.module.__dict__[name]
        return self.step(*args, **kwargs)

    def _count(self, compiled: bool) -> None:
        """After the first call (which compiles), a step that compiles again on RECOMPILE_CALLS
        calls in a row is guarded on Python state it changes itself (a list it appends to, a
        counter): each call would pay a compilation until torch's recompile limit. It runs as
        written from then on."""
        self.calls += 1
        self.recompiling = self.recompiling + 1 if compiled and self.calls > 1 else 0
        if self.recompiling >= RECOMPILE_CALLS:
            self._give_up(
                f"it compiled again on each of {RECOMPILE_CALLS} calls in a row: torch.compile "
                "guards on "
                "Python state the step changes (a list it appends to, a counter; "
                "TORCH_LOGS=recompiles "
                "names it)"
            )

    def _give_up(self, why: str) -> None:
        self.failed = why
        warnings.warn(
            f"compile=True: training_step runs as written from now on, {why}; the blocks stay "
            "compiled.",
            stacklevel=3,
        )


def _opaque_modules(module: nn.Module) -> list[nn.Module]:
    """`module` and its submodules, less compiled ones and what they hold (a compiled block's guards
    expect the block as it was traced; called from the step directly, it is inlined, still
    compiled), less those torch.nn defines that hold no parameter or buffer (a loss, an activation,
    dropout: what the step's graph should fuse), less modules whose instance already carries a
    `forward`. A user's module without parameters stays opaque: it may keep Python state (a metric's
    counters) that would make torch.compile recompile each step."""
    out, stack, seen = [], [module], set()
    while stack:
        m = stack.pop()
        if id(m) in seen or m._compiled_call_impl is not None or "forward" in m.__dict__:
            continue  # a module shared by two parents is made opaque once
        seen.add(id(m))
        stack.extend(m.children())
        if not (
            type(m).__module__.startswith("torch.nn.")
            and next(m.parameters(), None) is None
            and next(m.buffers(), None) is None
        ):
            out.append(m)
    return out


def repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of every nn.ModuleList: the shard units FSDP picks by default and the blocks
    activation checkpointing wraps."""
    return [c for m in module.modules() if isinstance(m, torch.nn.ModuleList) for c in m]
