"""Manual optimization with several optimizers under DeepSpeed ZeRO 1/2/3: one engine per optimizer
(a GAN's generator and discriminator), as DeepSpeed's own GAN tutorial trains them with one
`deepspeed.initialize` per network.

    opt_g, opt_d = self.optimizers()      # EngineOptimizer handles: opt_g.step() is engine_g.step()
    self.toggle_optimizer(opt_g); self.manual_backward(g_loss); opt_g.step(); opt_g.zero_grad()

`EngineGroup` stands where the strategy keeps its one engine, so
`DeepSpeed.forward/backward/save/load/teardown`
drive every engine without knowing there are several:
- under ZeRO 1/2 every engine wraps the whole module (its parameter names and module state are the
whole model's)
  and gets one optimizer, whose parameters must be disjoint from the others'; all share the one
  process group.
- under ZeRO-3 an engine partitions and hooks every module it wraps, so two cannot wrap the same
one: each engine
  wraps only the submodules holding its optimizer's parameters (`split_module`), placed at their own
  paths in a holder, so the names it saves are the whole module's. The user's module still runs the
  forward; each submodule's ZeRO-3 hooks gather its parameters on demand
  (`self.discriminator(self(z))` runs both engines' hooks). No ZeRO-3 leaf modules there
  (`unmark_leaf_modules`): each parameter is gathered with its own submodule and reduced alone.
- the forward calls the module directly: a ZeRO 1/2 engine's forward only casts and adds backward
hooks, and hooks of
  one engine on a loss that another engine's backward runs would confuse both.
- `backward(loss)` walks the loss's autograd graph to the parameters it reaches and differentiates
it once for those
  parameters; the gradients are held per engine (summed over backward calls, dropped by
  `opt.zero_grad()`) and each engine receives its own through one backward of its own in
  `opt.step()`. So one loss may feed several engines, and two losses may feed one, with DDP's
  results. The held gradients are whole (not partitioned) until the step, as `.grad` is under DDP;
  under ZeRO-3 that engine's parameters are gathered for its step's backward.
- a checkpoint holds every engine: engine 0 under the strategy's tag, engine i under `<tag>_<i>`,
each written by
  every rank (its own ZeRO shards), so `full_state_dict` merges the tags and a resume restores every
  optimizer.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

import torch

from lightspeed.checkpoint.layouts import engine_tag, engine_tags
from lightspeed.errors import ConfigError
from lightspeed.strategies.deepspeed.manual import EngineOptimizer

if TYPE_CHECKING:
    from lightspeed.strategies.common import StepRunner


def check_group(precision: str, optimizers: list, strategy_name: str) -> None:
    """Raises ConfigError when several manual-optimization optimizers cannot each get a DeepSpeed
    engine: 16-mixed (the loss scale of several engines on one loss), or optimizers sharing a
    parameter. (Under stage 3, `split_module` also needs the parameters to split along
    submodules.)"""
    if precision == "16-mixed":
        raise ConfigError(
            f"precision='16-mixed' with {len(optimizers)} manual optimizers under "
            f"{strategy_name!r}: "
            "each engine would scale the loss on its own. Use 'bf16-mixed' or '32-true'."
        )
    seen: set[int] = set()
    for i, opt in enumerate(optimizers):
        ids = {id(p) for group in opt.param_groups for p in group["params"]}
        if ids & seen:
            raise ConfigError(
                f"optimizer {i} of configure_optimizers shares parameters with an earlier one "
                "under "
                f"{strategy_name!r}: one DeepSpeed engine per optimizer needs disjoint parameters."
            )
        seen |= ids


def split_module(
    module: torch.nn.Module, optimizers: list, strategy_name: str
) -> list[torch.nn.Module]:
    """Under ZeRO-3, what each optimizer's engine wraps: the fewest submodules of `module` whose
    parameters are all that optimizer's, each set at its own path inside a holder
    (`holder.module.<path>`), so the engine saves the names the whole module's state_dict uses
    (after the usual `module.` prefix, as with one engine).

    Raises ConfigError naming the optimizer and the parameter when the parameters do not split along
    submodules: a parameter held directly by a module whose other parameters belong to another
    optimizer (the root included), a parameter no optimizer trains, or a buffer outside every
    optimizer's submodules (no engine would save it)."""
    owner = {
        id(p): i for i, opt in enumerate(optimizers) for g in opt.param_groups for p in g["params"]
    }
    parts: list[list[tuple[str, torch.nn.Module]]] = [[] for _ in optimizers]

    def refuse(what: str) -> NoReturn:
        raise ConfigError(
            f"{what}, under strategy {strategy_name!r} with {len(optimizers)} manual optimizers: a "
            "ZeRO-3 engine partitions whole submodules, so each optimizer must train exactly the "
            "parameters of some submodules (e.g. self.generator.parameters()). Move the parameter "
            "into such a submodule, or use 'deepspeed_stage_2' or 'fsdp'."
        )

    def visit(path: str, m: torch.nn.Module) -> None:
        owners = {owner.get(id(p), -1) for p in m.parameters()}
        if len(owners) == 1 and -1 not in owners:
            parts[owners.pop()].append((path, m))
            return
        for name, p in m.named_parameters(recurse=False):
            i = owner.get(id(p), -1)
            refuse(
                f"parameter {path + name!r} is trained by no optimizer"
                if i < 0
                else f"optimizer {i} of configure_optimizers trains {path + name!r}, held directly "
                f"by a module ({type(m).__name__}) whose other parameters belong to another "
                "optimizer"
            )
        for name, b in m.named_buffers(recurse=False):
            if name not in m._non_persistent_buffers_set:
                refuse(f"buffer {path + name!r} sits outside every optimizer's submodules")
        for name, child in m.named_children():
            visit(f"{path}{name}.", child)

    visit("", module)
    holders = []
    for i, taken in enumerate(parts):
        if not taken:
            refuse(f"optimizer {i} of configure_optimizers trains no parameter")
        holder = torch.nn.Module()
        holder.module = torch.nn.Module()
        for path, sub in taken:
            if not path:  # one optimizer trains the whole module (manual optimization, one engine)
                holder.module = sub
                break
            parent, names = holder.module, path.rstrip(".").split(".")
            for name in names[:-1]:
                if not hasattr(parent, name):
                    parent.add_module(name, torch.nn.Module())
                parent = getattr(parent, name)
            parent.add_module(names[-1], sub)
        holders.append(holder)
    return holders


def initialize_group(
    deepspeed,
    runner: StepRunner,
    optimizers: list,
    config: dict,
    strategy_name: str = "deepspeed",
) -> tuple[EngineGroup, list]:
    """Builds one engine per optimizer: over the same `runner` (StepRunner(module)) under ZeRO 1/2,
    over the optimizer's own submodules under ZeRO-3 (`split_module`); returns the group and the
    EngineOptimizer handles `Module.optimizers()` gives the user, in `configure_optimizers` order.
    Raises split_module's ConfigError."""
    zero3 = config["zero_optimization"]["stage"] == 3
    models = (
        split_module(runner.module, optimizers, strategy_name)
        if zero3
        else [runner] * len(optimizers)
    )
    if zero3:
        unmark_leaf_modules(runner.module)
    engines, handles = [], []
    for model, opt in zip(models, optimizers):
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=config, dist_init_required=False
        )
        engines.append(engine)
        handles.append(EngineOptimizer(engine, ds_optimizer))
    group = EngineGroup(runner, engines, deepspeed if zero3 else None)
    for handle in handles:
        handle.group = group
    return group, handles


def unmark_leaf_modules(module: torch.nn.Module) -> None:
    """Undoes `zero3.mark_leaf_modules` (and an earlier engine's record of it on the parameters).
    ZeRO-3 reduces a leaf module's gradients from that module's backward hook, and
    `EngineGroup.step` hands each engine its gradients through a backward that runs no module: each
    parameter must be reduced by its own hook instead."""
    for m in module.modules():
        if getattr(m, "_z3_leaf", False):
            m._z3_leaf = False  # pyright: ignore[reportArgumentType]  (torch types only submodules)
    for p in module.parameters():
        if hasattr(p, "ds_z3_leaf_module"):
            del p.ds_z3_leaf_module  # pyright: ignore[reportAttributeAccessIssue]  (DeepSpeed's)


def deepspeed_backward_options(options: dict[str, Any]) -> dict[str, Any]:
    """`manual_backward`'s keywords as DeepSpeed's backward takes them: `retain_graph` only. The
    engine owns the backward (its hooks reduce and partition the gradients), so torch's other
    keywords (`create_graph`, `inputs`, `gradient`) have no place to go: refused by name."""
    unknown = sorted(set(options) - {"retain_graph"})
    if unknown:
        raise ConfigError(
            f"manual_backward(loss, {', '.join(f'{k}=...' for k in unknown)}) under DeepSpeed: its "
            "engine runs the backward and takes retain_graph only; use strategy='ddp' or 'fsdp' "
            "for the others."
        )
    return {"retain_graph": bool(options["retain_graph"])} if "retain_graph" in options else {}


def reached_parameters(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors (parameters) that `loss.backward()` would write a gradient to."""
    found, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # an AccumulateGrad node: the end of the graph at a leaf
            found.add(id(cast(Any, node).variable))
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


class EngineGroup:
    """Several DeepSpeed engines over one module, behaving as one engine toward the DeepSpeed
    strategy."""

    def __init__(self, runner: torch.nn.Module, engines: list, zero3=None):
        self.runner, self.engines = runner, engines
        self.zero3 = (
            zero3  # the deepspeed package under ZeRO-3 (its engines' parameters are partitioned)
        )
        self.owner = {
            id(p): e for e in engines for p in EngineOptimizer(e, e.optimizer).model_parameters()
        }
        self.grads: dict[
            int, dict
        ] = {}  # id(engine) -> {parameter: gradient summed since its last step}
        for e in engines:
            e.set_gradient_accumulation_boundary(True)

    # ---- what DeepSpeed.forward / backward use
    @property
    def training(self) -> bool:
        return self.runner.training

    def train(self, mode: bool = True) -> None:
        self.runner.train(mode)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        # every engine's backward runs inside its own opt.step(), the end of its window (see
        # backward)
        pass

    def __call__(self, step, *args):
        # The user's module runs, not an engine's forward. Under ZeRO-3 the engines' top modules
        # (the holders) are
        # never called, so no engine records a trace of the module order to prefetch along: each
        # submodule's
        # parameters are gathered when it runs and released after (a GAN calls its networks in a
        # different order
        # in each phase of a step, and validation in another, so a recorded order would be wrong).
        return self.runner(step, *args)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False, **options: Any) -> None:
        """Adds the loss's gradients to those of every engine owning a parameter it reaches, as
        `loss.backward()` adds to `.grad` under DDP; each engine receives them in `step` (torch's
        semantics: backward accumulates, `zero_grad` drops, a step without gradients does nothing).
        ZeRO itself cannot keep these: its reduction at a window's boundary replaces what an earlier
        backward reduced, and stepping an engine that no loss reached fails. `scale_wrt_gas` is
        unused: the Trainer already divided the loss."""
        reached = {
            id(self.owner[i]): self.owner[i] for i in reached_parameters(loss) if i in self.owner
        }
        if not reached:
            raise ConfigError(
                "manual_backward(loss): the loss reaches no parameter of any optimizer (detached, "
                "or "
                "every parameter frozen by toggle_optimizer)."
            )
        params = [p for e in reached.values() for p in self._params(e) if p.requires_grad]
        retain = bool(deepspeed_backward_options(options).get("retain_graph", False))
        grads = torch.autograd.grad(loss, params, allow_unused=True, retain_graph=retain)
        if self.zero3 is not None:
            # As DeepSpeed's own backward epilogue does: a submodule whose input needs no gradient
            # (a first layer)
            # never runs its post-backward hook, so the parameters its backward gathered are
            # released here.
            for e in self.engines:
                e.optimizer.parameter_offload.release_backward_leftovers()
        for p, g in zip(params, grads):
            if g is not None:
                held = self.grads.setdefault(id(self.owner[id(p)]), {})
                held[p] = held[p] + g if p in held else g

    def step(self, engine) -> None:
        """Steps one engine on the gradients held for it: its own backward of sum(p * g) over its
        parameters hands ZeRO exactly g (reduced and partitioned as after any backward), then
        `engine.step()`."""
        held = self.grads.pop(id(engine), None)
        if not held:
            return
        # Under ZeRO-3 the parameters are partitioned (empty) between uses: gather them for this
        # product.
        with (
            self.zero3.zero.GatheredParameters(list(held))
            if self.zero3
            else contextlib.nullcontext()
        ):
            engine.backward(sum((p * g).sum() for p, g in held.items()), scale_wrt_gas=False)
        engine.step()

    def discard_gradients(self, engine) -> None:
        """`opt.zero_grad()`: drops the gradients held for the engine."""
        self.grads.pop(id(engine), None)

    @staticmethod
    def _params(engine) -> list[torch.nn.Parameter]:
        return EngineOptimizer(engine, engine.optimizer).model_parameters()

    # ---- facts some callers read from "the engine"
    @property
    def module(self) -> torch.nn.Module:
        return self.runner

    @property
    def optimizer(self) -> Any:
        return self.engines[0].optimizer

    @property
    def config(self) -> dict:
        return self.engines[0].config

    @property
    def global_steps(self) -> int:
        return max(e.global_steps for e in self.engines)

    # ---- checkpoints: every engine, each under its own tag
    def save_checkpoint(
        self, save_dir: str, tag: str, client_state: dict | None = None, save_latest: bool = True
    ) -> None:
        for i, e in enumerate(self.engines):
            e.save_checkpoint(
                save_dir,
                tag=engine_tag(tag, i),
                client_state={**(client_state or {}), "engines": len(self.engines)},
                save_latest=save_latest and i == 0,
            )

    def load_checkpoint(self, load_dir: str, tag: str, **kwargs) -> None:
        found = engine_tags(Path(load_dir), tag)
        if found != [engine_tag(tag, i) for i in range(len(self.engines))]:
            raise ConfigError(
                f"{load_dir} holds DeepSpeed engines {found}, but this module has "
                f"{len(self.engines)} "
                "manual optimizers (one engine each): resume with the same configure_optimizers."
            )
        for i, e in enumerate(self.engines):
            e.load_checkpoint(load_dir, tag=engine_tag(tag, i), **kwargs)
        self.grads.clear()

    def destroy(self) -> None:
        for e in self.engines:
            e.destroy()
