"""Manual optimization with several optimizers under DeepSpeed ZeRO 1/2: one engine per optimizer (a GAN's
generator and discriminator), as DeepSpeed's own GAN tutorial trains them with one `deepspeed.initialize` per network.

    opt_g, opt_d = self.optimizers()      # EngineOptimizer handles: opt_g.step() is engine_g.step()
    self.toggle_optimizer(opt_g); self.manual_backward(g_loss); opt_g.step(); opt_g.zero_grad()

`EngineGroup` stands where the strategy keeps its one engine, so `DeepSpeed.forward/backward/save/load/teardown`
drive every engine without knowing there are several:
- every engine wraps the whole module (its parameter names and module state are the whole model's) and gets one
  optimizer, whose parameters must be disjoint from the others'; all share the one process group.
- the forward calls the module directly: a ZeRO 1/2 engine's forward only casts and adds backward hooks, and hooks of
  one engine on a loss that another engine's backward runs would confuse both.
- `backward(loss)` walks the loss's autograd graph to the parameters it reaches and differentiates it once for those
  parameters; the gradients are held per engine (summed over backward calls, dropped by `opt.zero_grad()`) and
  each engine receives its own through one backward of its own in `opt.step()`. So one loss may feed several
  engines, and two losses may feed one, with DDP's results. The held gradients are whole (not partitioned) until
  the step, as `.grad` is under DDP.
- a checkpoint holds every engine: engine 0 under the strategy's tag, engine i under `<tag>_<i>`, each written by
  every rank (its own ZeRO shards), so `full_state_dict` merges the tags and a resume restores every optimizer.
Stage 3 is refused: a ZeRO-3 engine partitions and hooks the whole module it wraps, and two cannot share one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from .deepspeed_manual import EngineOptimizer


def check_group(stage: int, precision: str, optimizers: list, strategy_name: str) -> None:
    """Raises ConfigError when several manual-optimization optimizers cannot each get a DeepSpeed engine: stage 3,
    16-mixed (the loss scale of several engines on one loss), or optimizers sharing a parameter."""
    if stage == 3:
        raise ConfigError(
            f"configure_optimizers returned {len(optimizers)} optimizers with automatic_optimization=False under "
            f"strategy {strategy_name!r}: one DeepSpeed engine per optimizer works with ZeRO stages 1 and 2 only "
            "(a stage-3 engine partitions the whole module it wraps, and two cannot share one). Use "
            "'deepspeed_stage_2', 'fsdp', or one optimizer with parameter groups.")
    if precision == "16-mixed":
        raise ConfigError(f"precision='16-mixed' with {len(optimizers)} manual optimizers under {strategy_name!r}: "
                          "each engine would scale the loss on its own. Use 'bf16-mixed' or '32-true'.")
    seen: set[int] = set()
    for i, opt in enumerate(optimizers):
        ids = {id(p) for group in opt.param_groups for p in group["params"]}
        if ids & seen:
            raise ConfigError(f"optimizer {i} of configure_optimizers shares parameters with an earlier one under "
                              f"{strategy_name!r}: one DeepSpeed engine per optimizer needs disjoint parameters.")
        seen |= ids


def initialize_group(deepspeed, runner: torch.nn.Module, optimizers: list, config: dict) -> tuple[EngineGroup, list]:
    """Builds one engine per optimizer over the same `runner` (StepRunner(module)); returns the group and the
    EngineOptimizer handles `Module.optimizers()` gives the user, in `configure_optimizers` order."""
    engines, handles = [], []
    for opt in optimizers:
        engine, ds_optimizer, _, _ = deepspeed.initialize(model=runner, optimizer=opt, config=config,
                                                          dist_init_required=False)
        engines.append(engine)
        handles.append(EngineOptimizer(engine, ds_optimizer))
    group = EngineGroup(runner, engines)
    for handle in handles:
        handle.group = group
    return group, handles


def reached_parameters(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors (parameters) that `loss.backward()` would write a gradient to."""
    found, seen, stack = set(), set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):  # an AccumulateGrad node: the end of the graph at a leaf
            found.add(id(node.variable))
        stack.extend(nxt for nxt, _ in node.next_functions)
    return found


class EngineGroup:
    """Several DeepSpeed engines over one module, behaving as one engine toward the DeepSpeed strategy."""

    def __init__(self, runner: torch.nn.Module, engines: list):
        self.runner, self.engines = runner, engines
        self.owner = {id(p): e for e in engines for g in e.optimizer.bit16_groups for p in g}
        self.grads: dict[int, dict] = {}  # id(engine) -> {parameter: gradient summed since its last step}
        for e in engines:
            e.set_gradient_accumulation_boundary(True)

    # ---- what DeepSpeed.forward / backward use
    @property
    def training(self) -> bool:
        return self.runner.training

    def train(self, mode: bool = True) -> None:
        self.runner.train(mode)

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        pass  # every engine's backward runs inside its own opt.step(), the end of its window (see backward)

    def __call__(self, step, *args):
        return self.runner(step, *args)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        """Adds the loss's gradients to those of every engine owning a parameter it reaches, as `loss.backward()`
        adds to `.grad` under DDP; each engine receives them in `step` (torch's semantics: backward accumulates,
        `zero_grad` drops, a step without gradients does nothing). ZeRO itself cannot keep these: its reduction
        at a window's boundary replaces what an earlier backward reduced, and stepping an engine that no loss
        reached fails. `scale_wrt_gas` is unused: the Trainer already divided the loss."""
        reached = {id(self.owner[i]): self.owner[i] for i in reached_parameters(loss) if i in self.owner}
        if not reached:
            raise ConfigError("manual_backward(loss): the loss reaches no parameter of any optimizer (detached, or "
                              "every parameter frozen by toggle_optimizer).")
        params = [p for e in reached.values() for g in e.optimizer.bit16_groups for p in g if p.requires_grad]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        for p, g in zip(params, grads):
            if g is not None:
                held = self.grads.setdefault(id(self.owner[id(p)]), {})
                held[p] = held[p] + g if p in held else g

    def step(self, engine) -> None:
        """Steps one engine on the gradients held for it: its own backward of sum(p * g) over its parameters hands
        ZeRO exactly g (reduced and partitioned as after any backward), then `engine.step()`."""
        held = self.grads.pop(id(engine), None)
        if not held:
            return
        engine.backward(sum((p * g).sum() for p, g in held.items()), scale_wrt_gas=False)
        engine.step()

    def discard_gradients(self, engine) -> None:
        """`opt.zero_grad()`: drops the gradients held for the engine."""
        self.grads.pop(id(engine), None)

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
    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict | None = None,
                        save_latest: bool = True) -> None:
        for i, e in enumerate(self.engines):
            e.save_checkpoint(save_dir, tag=engine_tag(tag, i), client_state={**(client_state or {}), "engines":
                              len(self.engines)}, save_latest=save_latest and i == 0)

    def load_checkpoint(self, load_dir: str, tag: str, **kwargs) -> None:
        found = engine_tags(Path(load_dir), tag)
        if found != [engine_tag(tag, i) for i in range(len(self.engines))]:
            raise ConfigError(f"{load_dir} holds DeepSpeed engines {found}, but this module has {len(self.engines)} "
                              "manual optimizers (one engine each): resume with the same configure_optimizers.")
        for i, e in enumerate(self.engines):
            e.load_checkpoint(load_dir, tag=engine_tag(tag, i), **kwargs)
        self.grads.clear()

    def destroy(self) -> None:
        for e in self.engines:
            e.destroy()


def engine_tag(tag: str, index: int) -> str:
    """The checkpoint tag of engine `index`: the strategy's own tag for the first, `<tag>_<index>` after."""
    return tag if index == 0 else f"{tag}_{index}"


def engine_tags(path: Path, tag: str) -> list[str]:
    """The engine tags a DeepSpeed checkpoint directory holds, in engine order (one unless manual optimizers)."""
    count = 0
    while (path / engine_tag(tag, count)).is_dir():
        count += 1
    return [engine_tag(tag, i) for i in range(count)]
