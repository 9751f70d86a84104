"""What runs before the first batch: the plan, the launch, the setup hooks, the strategy set up
with its optimizers, the loaders distributed, a checkpoint restored; and the save that `restore`
reads back.

    Trainer.fit(model)  ->  start.plan(...)    strategy="auto", micro_batch="auto"'s forecast
                            start.start(...)   flags checked, ckpt_path, launch, setup hooks
                            loop.fit(...)      calls load_fit_data (set_up_strategy between the
                                               loaders), restore, set_up_training
    Trainer.validate / test / predict  ->  loop.prepare_evaluation: start, set_up_strategy, ...
    Trainer.save_checkpoint(path)      ->  start.save_checkpoint

Nothing here iterates over batches: the loops are in loop.py, which calls these by name (this
module does not import it). With loop.py, this module writes the run state (run.py). Functions
here take the narrow config pieces they need (config.py).
"""

from __future__ import annotations

import atexit
import dataclasses
import math
import re
from pathlib import Path
from typing import Any, Literal

import torch

from lightspeed.callbacks import Callback, ModelCheckpoint
from lightspeed.checkpoint.checkpointer import Checkpointer, resolve
from lightspeed.config import Config, DataOptions
from lightspeed.core.datamodule import prepare_data_once
from lightspeed.core.module import Module
from lightspeed.core.optimizer import parse_optimizers
from lightspeed.core.saving import (
    DATAMODULE_HPARAMS_KEY,
    DATAMODULE_HPARAMS_NAME,
    HPARAMS_KEY,
    HPARAMS_NAME,
)
from lightspeed.data.epoch_windows import (
    check_batch_counts,
    has_exact_length,
)
from lightspeed.data.loaders import (
    BatchMover,
    CombinedLoader,
    estimated_stepping_batches,
    move_to_device,
    num_batches,
    with_distributed_sampler,
)
from lightspeed.errors import ConfigError
from lightspeed.eval_loaders import fit_loaders
from lightspeed.hooks import (
    batch_to_device,
    call,
    check_transfer_hooks,
    log_hparams,
    timed,
    warn_unknown_hooks,
    with_module_callbacks,
)
from lightspeed.loggers.build import agree_log_dirs
from lightspeed.perf.kernels import compile_step, compiled_frames
from lightspeed.plan.fallback import (
    connected,
    plan_hint,
    set_up_or_fall_back,
)
from lightspeed.plan.micro_batch import MicroBatchPlan, plan_fit, planned_strategy
from lightspeed.report.progress import start_progress
from lightspeed.run import Fn, Process, Run, Stage
from lightspeed.runtime.distributed import (
    broadcast_from_rank0,
    gather_objects,
)
from lightspeed.runtime.guard import NonFiniteGuard
from lightspeed.runtime.launch import (
    end_with_os_exit,
    export_env,
    start_local_ranks,
    watch_parent,
)
from lightspeed.specs import LoopState, RunSpec
from lightspeed.utilities.rank_zero import rank_zero_warn
from lightspeed.utilities.signature import accepts


# ================================================================== the launch and the setup hooks
def start(
    run: Run, config: Config, fn: Fn, module: Module, ckpt_path: Any, planned: bool
) -> Path | None:
    """Each entry point, before its data: checks the flags against the strategy, resolves
    `ckpt_path` on rank 0 (verified there before any rank starts), adds the Module's
    `configure_callbacks`, launches (the first time), then runs prepare_data and the setup hooks.
    Returns the checkpoint to load (rank 0's path, on every rank) or None.

    Raises ConfigError when `planned` (strategy="auto") chose another strategy on this rank than on
    rank 0."""
    spec = config.run_spec(module.automatic_optimization)
    run.strategy.check(spec)
    path = None
    if ckpt_path:
        best = next(
            (c.best_model_path for c in run.callbacks if isinstance(c, ModelCheckpoint)), None
        )
        folder = checkpoint_dir(run.callbacks, config.output.default_root_dir)
        path = resolve(ckpt_path, folder, best, verify=run.env.rank == 0)
    # configure_callbacks, once "best" is resolved (as Lightning); in place: the Checkpointer
    # holds this list
    run.callbacks[:] = with_module_callbacks(run.callbacks, module, run.print0)
    launch(run, config, spec)
    path = broadcast_from_rank0(path) if ckpt_path else None  # every rank loads rank 0's
    run.ckpt_path = str(path) if path else None
    if planned and broadcast_from_rank0(run.strategy.name) != run.strategy.name:
        raise ConfigError(
            f"strategy='auto' planned {run.strategy.name!r} on rank {run.global_rank} but "
            "another on rank 0 (their free memory differs): pass the strategy or memory_budget."
        )
    module.trainer = run.trainer
    setup_hooks(run, module, fn)
    return path


def launch(run: Run, config: Config, spec: RunSpec) -> None:
    """Once per process: starts the other local ranks (plain `python` with devices > 1) or joins
    the external launcher's, then connects the strategy (process group, device)."""
    if run.process is not None:
        return
    env = run.env
    assert env is not None, "the Trainer reads the launch environment when it is built"
    if run.world_size > 1:
        end_with_os_exit()  # before start_local_ranks, whose exit handler must run first
    if env.launcher == "none" and run.world_size > 1:
        dist = start_local_ranks(run.world_size, config.launch.timeout)
    else:
        dist = env
        if env.launcher == "lightspeed":
            watch_parent()
    export_env(dist)  # the rank variables, and this rank's share of the host's CPUs
    run.device = torch.device("cuda", dist.local_rank) if spec.device_type == "cuda" else run.device
    run.metrics.device = run.device  # batches reach it through `move`; its wait timed in training
    move = BatchMover(
        run.device,
        config.data.pin_memory,
        run.print0,
        training=lambda: run.stage is Stage.TRAIN,
    )
    checkpointer = Checkpointer(run.strategy, run.callbacks, dist.rank, run.world_size)
    run.process = Process(dist, move, checkpointer)
    run.strategy.connect(spec, dist, run.device)
    # Torn down at exit after success (an exception: at once, in `finish`); after handlers
    # registered later.
    atexit.register(run.strategy.teardown)
    run.guard = NonFiniteGuard(config.launch.on_nonfinite, dist.rank, run.world_size, run.print0)
    config.launch.apply_to_process()  # seed, deterministic, benchmark
    agree_log_dirs(run.loggers)  # trainer.log_dir names rank 0's folder on every rank


def plan(
    run: Run, config: Config, module: Module, loader: Any, planned: bool
) -> MicroBatchPlan | None:
    """The plan step (plan/micro_batch.plan_fit), once, before any rank starts: strategy="auto"
    chosen from a memory forecast (`planned`; the plans after it kept as fallbacks), and
    micro_batch="auto"'s forecast; one probe of the model serves both. Returns that forecast (for
    `confirm`, once the ranks run) or None."""
    if run.process is not None or not (planned or config.plan.micro_batch):
        return None
    run.strategy, forecast, run.fallbacks = plan_fit(
        module,
        loader,
        run.datamodule,
        run.strategy,
        planned,
        run.world_size,
        config.plan,
        show=run.env.rank == 0,
        as_step_sees=lambda batch: probe_batch(run, module, batch),
    )
    return forecast


def checkpoint_dir(callbacks: list[Callback], default_root_dir: str) -> Path:
    """The first ModelCheckpoint's `dirpath`, else `<default_root_dir>/checkpoints`."""
    ckpt = next((c for c in callbacks if isinstance(c, ModelCheckpoint)), None)
    return Path(ckpt.dirpath) if ckpt and ckpt.dirpath else Path(default_root_dir) / "checkpoints"


def setup_hooks(run: Run, module: Module, fn: Fn) -> None:
    """Lightning's order once the ranks run: `prepare_data` (once per node, or once in all), the
    callbacks' `setup`, the DataModule's, the Module's. The caller then configures the model."""
    dm, dist = run.datamodule, run.process.dist if run.process else run.env
    run.profiler.setup(fn.value, dist.local_rank, run.trainer.log_dir)
    if dm is not None:
        dm.trainer = run.trainer  # its hooks may read trainer.training, trainer.current_epoch...
        prepare_data_once(
            lambda: timed(run, "LightningDataModule", dm.prepare_data),
            dist.local_rank if dm.prepare_data_per_node else dist.rank,
        )
    prepare_data_once(
        lambda: timed(run, "LightningModule", module.prepare_data),
        dist.local_rank if module.prepare_data_per_node else dist.rank,
    )
    for cb in run.callbacks:
        cb.attach(module)  # a callback's `self.log` logs through this Module
        timed(run, "Callback", cb.setup, run.trainer, module, fn.value)
    if dm is not None:
        timed(run, "LightningDataModule", dm.setup, fn.value)
    timed(run, "LightningModule", module.setup, fn.value)


# ================================================================== the strategy and its optimizers
def set_up_strategy(run: Run, config: Config, fn: Fn, module: Module, micro_batch: Any) -> None:
    """Configures the model (the first time this Module comes) and sets the strategy up for the
    phase: fit (with the optimizers; it serves evaluation too) or evaluation. Under
    strategy="auto" a plan that runs out of memory here gives way to the next one that fits
    (plan/fallback.py); a strategy the user chose keeps its error, plus a hint."""
    phase: Literal["fit", "eval"] = "fit" if fn is Fn.FIT else "eval"
    configure = run.configured is not module
    if not configure and run.phase in ("fit", phase):
        return
    before, plan = run.strategy, config.plan
    spec = config.run_spec(module.automatic_optimization)
    run.strategy, run.first_steps = set_up_or_fall_back(
        run.strategy,
        module,
        lambda strategy: set_up(run, config, strategy, module, phase, micro_batch, configure),
        run.fallbacks,
        lambda name: connected(
            planned_strategy(name, run.world_size, module), spec, run.process.dist, run.device
        ),
        plan.memory_budget if plan.device_type == "cpu" else None,
        run.print0,
        plan_hint(module, run.world_size, plan.precision, plan.device_type, plan.memory_budget),
    )
    run.fallbacks = None  # only the first setup falls back
    follow_fork(run, before)


def follow_fork(run: Run, before: Any) -> None:
    """When a fork of `before` was set up (strategy="auto"), checkpoints and teardown follow it."""
    if run.strategy is not before and run.process is not None:
        checkpointer = Checkpointer(run.strategy, run.callbacks, run.global_rank, run.world_size)
        checkpointer.pending = run.process.checkpointer.pending  # a load's checksum verdict to come
        run.process = dataclasses.replace(run.process, checkpointer=checkpointer)
        atexit.register(run.strategy.teardown)  # runs before the parent's: LIFO


def next_plan(run: Run, config: Config, module: Module, why: str) -> None:
    """strategy="auto" after its plan ran out of memory in one of its first steps
    (plan/fallback.py): the next plan that fits, set up from the module and random state the failed
    one's setup started from; the loop back at step 0 of epoch 0 (callbacks see those steps
    again)."""
    first, before = run.first_steps, run.strategy
    assert first is not None and run.process is not None
    spec, dist = config.run_spec(module.automatic_optimization), run.process.dist
    micro_batch = getattr(run.loaders[Stage.TRAIN], "batch_size", None)
    run.configured = run.phase = None
    run.strategy, run.first_steps = first.next_plan(
        run.strategy,
        module,
        lambda strategy: set_up(run, config, strategy, module, "fit", micro_batch, True),
        lambda name: connected(
            planned_strategy(name, run.world_size, module), spec, dist, run.device
        ),
        run.print0,
        why,
    )
    follow_fork(run, before)
    # the step as the new strategy wraps it (FSDP registers training_step as a forward method)
    run.compiled_frames, run.training_step = (
        compiled_frames(),
        compile_step(module, config.step.compile),
    )
    run.loop.global_step = run.loop.epoch = run.loop.batches_done = 0


def set_up(
    run: Run,
    config: Config,
    strategy: Any,
    module: Module,
    phase: Literal["fit", "eval"],
    micro_batch: Any,
    configure: bool,
) -> None:
    """Configures `module` on `strategy` when `configure` (`configure_model` the strategy's way,
    then SyncBatchNorm) and sets it up for `phase`. Raises ConfigError when fit gets no
    optimizer."""
    if configure:
        strategy.configure_model(module)
        if config.launch.sync_batchnorm and run.world_size > 1:  # before any wrapper, as Lightning
            torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
        run.configured, run.phase = module, None
    if run.phase in ("fit", phase):
        return
    automatic = module.automatic_optimization
    factory = (lambda: build_optimizers(run, config, module)) if phase == "fit" else None
    strategy.setup(module, factory, micro_batch if phase == "fit" else None)
    if phase == "fit" and automatic and not strategy.optimizers:
        if strategy.name.startswith("deepspeed"):  # its engine is built around an optimizer
            raise ConfigError(
                "configure_optimizers returned no optimizer: return one of the forms in "
                "lightspeed.core.optimizer (an optimizer, a list, a dict with 'optimizer', ...)."
            )
        rank_zero_warn(  # as Lightning: forward and backward only
            "`configure_optimizers` returned no optimizer: this fit will run with no optimizer "
            "(forward and backward, no step)."
        )
    run.phase = phase


def build_optimizers(run: Run, config: Config, module: Module) -> Any:
    """The Module's `configure_optimizers`, parsed. A schedule sized by
    `trainer.estimated_stepping_batches` fails on its inf (a training loader without a length, and
    no max_steps): torch's error ("total_steps ... got inf") then comes with the name and the fix.
    """
    try:
        return parse_optimizers(
            module.configure_optimizers(), module.automatic_optimization, module
        )
    except (ValueError, TypeError, OverflowError) as exc:
        steps = estimated_stepping_batches(run.loaders.get(Stage.TRAIN), config.limits)
        said_inf = isinstance(exc, OverflowError) or re.search(r"\binf\b|infinity", str(exc))
        if isinstance(exc, ConfigError) or steps != math.inf or not said_inf:
            raise
        raise ConfigError(
            f"configure_optimizers raised {type(exc).__name__}({exc}): "
            "trainer.estimated_stepping_batches is inf, because train_dataloaders has no len() "
            "(an IterableDataset) and max_steps is not set, so a schedule sized by it "
            "(OneCycleLR's total_steps, a warmup-cosine's length) has no end. "
            "Set Trainer(max_steps=N)."
        ) from exc


# ================================================================== fit's data and where it resumes
def forward_is_collective(strategy: Any) -> bool:
    """Whether every forward of the model is a collective (its parameters gathered from their
    shards: FSDP, ZeRO-3, tensor parallelism), read from the strategy's checkpoint layout: whole
    tensors on every rank ("replicated": single, ddp, ZeRO-1) and DeepSpeed's ZeRO-1 and 2 (which
    shard the optimizer's state and the gradients only) forward on their own."""
    layout = strategy.layout or ""
    return not (
        layout == "replicated" or layout.startswith(("deepspeed-zero1-", "deepspeed-zero2-"))
    )


def distribute(
    run: Run, data: DataOptions, seed: int | None, loaders: Any, repeat: bool = True
) -> Any:
    """Loaders as this process iterates them: with a DistributedSampler (unless
    `use_distributed_sampler=False`) and pinned where the BatchMover pins; several alike.

    `repeat=False` (evaluation's): each sample on one rank (data/samplers.py), the ranks' batch
    counts may differ by one, and a rank that runs out first steps a shadow of its last batch only
    where the forward is collective. Validation and test take it where the forward is not
    (`forward_is_collective`: single, ddp, ZeRO-1/2), predict always (a shadow's prediction is
    dropped): their metrics then count every sample once, where torch's DistributedSampler repeats
    the first ones to even the ranks. Under FSDP, ZeRO-3 and tensor parallelism validation and
    test keep that padding, as Lightning's: a shadow step would run the user's step a second time
    on a batch, and what the step updates itself (a torchmetrics Metric) would count it twice."""
    if isinstance(loaders, list):
        return [distribute(run, data, seed, loader, repeat) for loader in loaders]
    if isinstance(loaders, CombinedLoader):  # several training loaders: each as a single one
        return loaders.map(lambda loader: distribute(run, data, seed, loader, repeat))
    if data.use_distributed_sampler:
        replicas = run.strategy.distributed_sampler_kwargs  # data-parallel size and rank
        loaders = with_distributed_sampler(loaders, replicas, seed or 0, repeat)
    return run.process.move.loader(loaders)


def load_fit_data(
    run: Run, config: Config, module: Module, train_given: Any, val_given: Any, first: bool
) -> tuple[Any, list]:
    """fit's loaders (`eval_loaders.fit_loaders`), distributed; the first time, the strategy is set
    up between the training loader and the validation ones (DeepSpeed reads the micro-batch). Later
    (`reload_dataloaders_every_n_epochs`) the loaders given to fit stay and the DataModule's or
    Module's are asked for again. Raises ConfigError on empty or uneven training data; a loader
    without an exact length has its epoch's end agreed per step instead (data/epoch_windows.py)."""
    overfit = bool(config.limits.overfit_batches)
    train, val = fit_loaders(module, run.datamodule, train_given, val_given, overfit)
    run.loaders[Stage.TRAIN] = distribute(run, config.data, config.launch.seed, train)
    if first:
        set_up_strategy(run, config, Fn.FIT, module, getattr(train, "batch_size", None))
    repeat = forward_is_collective(run.strategy)  # validation: as evaluation's (`distribute`)
    run.loaders[Stage.VALIDATE] = distribute(run, config.data, config.launch.seed, val, repeat)
    train, limits = run.loaders[Stage.TRAIN], config.limits
    n = num_batches(train, limits.limit_train_batches)
    run.train_counts_known = check_batch_counts(
        n, has_exact_length(train), limits.limit_train_batches, limits.val_check_interval
    )
    every = limits.val_check_interval
    if isinstance(every, int) and limits.check_val_every_n_epoch is not None and every > n:
        raise ConfigError(
            f"`val_check_interval` ({every}) must be less than or equal to the number of the "
            f"training batches ({n}): validation would never run. Lower it, turn validation off "
            "with limit_val_batches=0, or count batches across epochs with "
            "check_val_every_n_epoch=None."
        )
    return run.loaders[Stage.TRAIN], run.loaders[Stage.VALIDATE]


def restore(run: Run, module: Module, path: Path) -> tuple[int, dict | None]:
    """Loads a checkpoint into the set-up strategy; returns (batches to skip in this epoch, RNG
    state to restore where the save happened)."""
    saved, state, rng = run.process.checkpointer.load(path, with_optimizer=True)
    run.loop.global_step, run.loop.epoch = saved.global_step, saved.resume_epoch
    if run.datamodule is not None:  # ours, else under Lightning's key (the class name)
        dm_state = state.get("datamodule") or state.get(type(run.datamodule).__qualname__)
        if dm_state:
            timed(run, "LightningDataModule", run.datamodule.load_state_dict, dm_state)
    run.loader_restored = restore_loader(run, state, saved.batches_to_skip)
    call(run, module.on_load_checkpoint, lambda cb: cb.on_load_checkpoint, state)
    run.print0(
        f"Resumed from {path} at epoch {run.loop.epoch}, global step {run.loop.global_step}."
    )
    return saved.batches_to_skip, rng


def restore_loader(run: Run, state: dict, skip: int) -> bool:
    """Puts a stateful training loader (torchdata's StatefulDataLoader: `load_state_dict`) where
    this rank's was saved, when resuming mid-epoch on the same world size; True when it did (the
    epoch's batches are then not replayed). At an epoch's end the next epoch starts afresh."""
    states, loader = state.get(LOADER_STATES), run.loaders.get(Stage.TRAIN)
    if not skip or not states or len(states) != run.world_size:
        return False
    mine = states[run.global_rank]
    if mine is None or not callable(getattr(loader, "load_state_dict", None)):
        return False
    loader.load_state_dict(mine)
    return True


def set_up_training(run: Run, config: Config, module: Module, n: int | float) -> None:
    """Once per fit, before its hooks: unknown hooks warned of, the hparams logged, the progress
    bar, and the training step (compiled with `compile`)."""
    warn_unknown_hooks(module, run.callbacks)
    check_transfer_hooks(module, run.datamodule)
    is_zero = run.global_rank == 0
    log_hparams(module, run.datamodule, run.loggers, is_zero)
    run.takes_batch_idx = accepts(module.training_step, 2, "batch_idx")  # Lightning takes (batch)
    steps = n if n == math.inf else math.ceil(n / config.limits.accumulate_grad_batches)
    show = config.output.enable_progress_bar and is_zero
    run.progress = start_progress(show, run.callbacks, config.limits, steps, run.loop)
    run.compiled_frames, run.training_step = (
        compiled_frames(),
        compile_step(module, config.step.compile),
    )


# ================================================================== what the planner runs
def probe_batch(run: Run, module: Module, batch: Any) -> Any:
    """A drawn training batch as `training_step` will see it, on the CPU, for the planner's probes
    before any rank starts (plan/micro_batch.plan_fit): through the three transfer hooks as every
    training batch is, so a step written for what `on_after_batch_transfer` returns (uint8 images
    made floats, say) runs in the probe too. The hooks see their trainer in the TRAIN stage; what
    they return is brought back to the CPU, where the probe's copy of the model lives."""
    module.trainer = run.trainer
    if run.datamodule is not None:
        run.datamodule.trainer = run.trainer
    stage = run.stage
    run.enter(Stage.TRAIN)
    try:
        cpu = torch.device("cpu")
        return move_to_device(batch_to_device(run, module, batch, 0, cpu), cpu)
    finally:
        run.enter(stage)


# ================================================================== checkpoints
LOADER_STATES = "train_dataloader_states"  # trainer.pt: each rank's stateful loader, by rank


def save_checkpoint(run: Run, path: Path) -> Path:
    """Collective: the configured module's checkpoint at rank 0's `path`, written atomically, with
    the Module's and callbacks' `on_save_checkpoint` hooks run on its state."""
    module = run.configured
    assert module is not None and run.guard is not None and run.process is not None
    run.guard.settle()  # a non-finite verdict not yet read: under "stop" nothing is written
    at = run.loop
    position = LoopState(
        at.epoch, at.global_step, at.batches_done, at.epoch_done and run.stage is Stage.TRAIN
    )

    def on_save(state: dict) -> None:
        state[HPARAMS_KEY] = dict(module.hparams)  # load_from_checkpoint rebuilds from these
        state[HPARAMS_NAME] = module.__dict__.get("_hparams_name")
        dm = run.datamodule
        state["datamodule"] = timed(run, "LightningDataModule", dm.state_dict) if dm else {}
        if state["datamodule"]:  # also under Lightning's key, the DataModule's class name
            state[type(run.datamodule).__qualname__] = state["datamodule"]
        if run.fitting and run.train_windows is not None:  # every rank's stream position
            positions = gather_objects(run.train_windows.loader_state())
            state[LOADER_STATES] = positions if any(p is not None for p in positions) else None
        state[DATAMODULE_HPARAMS_KEY] = dict(getattr(run.datamodule, "hparams", {}) or {})
        dm_name = vars(run.datamodule).get("_hparams_name") if run.datamodule is not None else None
        state[DATAMODULE_HPARAMS_NAME] = dm_name
        module.on_save_checkpoint(state)
        for cb in run.callbacks:
            cb.on_save_checkpoint(run.trainer, module, state)

    return run.process.checkpointer.save(broadcast_from_rank0(path), position, on_save)
