"""The loops: fit, the train window, evaluation and the sanity check, read top to bottom.

    Trainer.fit(model)          ->  start.start(...)      launch (once), setup hooks (start.py)
                                    loop.fit(...)         the epochs
    fit          on_fit_start, sanity_check, on_train_start, train_epoch until a limit, on_fit_end
    train_epoch  the training loader in accumulation windows; after each window's step, after_step
    train_window each micro-batch to the device, on_train_batch_start, strategy.forward,
                 strategy.backward; then the optimizer hooks and one strategy.step()
    Trainer.validate / test / predict  ->  loop.evaluate(...) / loop.predict(...)

Every hook is called here by name, the Module's first, then each callback's (hooks.call). Under
DeepSpeed the optimizer step and `zero_grad` happen inside `engine.step()`, so
`on_before_optimizer_step` and `on_before_zero_grad` run just before `strategy.step()` for every
strategy: after the window's backward passes and before clipping, the step and zeroing (also where
the torch strategies clip). With precision "16-mixed" the gradients these hooks see are still
loss-scaled (Lightning unscales them first).

What runs before the first batch (the plan, the launch, the strategy set up, the loaders
distributed, a checkpoint restored) is in start.py, called here by name. This module and start.py
are the writers of the run state (run.py): `run.enter(stage)` is where the stage changes. Functions
here take the narrow config pieces they need (config.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from lightspeed.callbacks import Callback, EarlyStopping, ModelCheckpoint, Timer
from lightspeed.callbacks.run_metrics import RunMetrics
from lightspeed.config import Config, Limits
from lightspeed.core.metrics import infer_batch_size
from lightspeed.core.module import Module
from lightspeed.core.optimizer import step_schedulers
from lightspeed.data.epoch_windows import (
    EpochWindows,
    EvalBatches,
    has_exact_length,
)
from lightspeed.data.loaders import (
    num_batches,
    resumed_iterator,
    set_epoch,
    validation_interval,
)
from lightspeed.data.samplers import even_across_ranks
from lightspeed.errors import ConfigError
from lightspeed.eval_loaders import check_dataloader_idx, eval_loaders
from lightspeed.hooks import batch_to_device, call, is_overridden, timed
from lightspeed.loops.optimization.automatic import Closure
from lightspeed.overrides.distributed import index_batches
from lightspeed.perf.kernels import compiled_ran
from lightspeed.perf.precision import default_dtype
from lightspeed.plan.fallback import (
    StepsOutOfMemory,
)
from lightspeed.report.closing import closing_line, stop_reason
from lightspeed.run import Fn, Run, Stage
from lightspeed.runtime import heartbeat
from lightspeed.runtime.distributed import (
    AgreedMax,
    host_min_max,
)
from lightspeed.runtime.guard import NonFiniteGuard
from lightspeed.runtime.rng import rng_state, set_rng_state
from lightspeed.start import (
    distribute,
    forward_is_collective,
    load_fit_data,
    next_plan,
    restore,
    set_up_strategy,
    set_up_training,
    start,
)
from lightspeed.utilities.rank_zero import WarningCache
from lightspeed.utilities.signature import accepts

_SKIPPED = WarningCache()  # "train_dataloader yielded None", once per process


# ================================================================== an entry point's frame
def begin(run: Run, fn: Fn, module: Module, datamodule: Any) -> None:
    """`fn` starts with `module`: fit takes the datamodule given (None too), evaluation keeps the
    last one when given none."""
    run.fn, run.status, run.module = fn, "running", module
    run.fit_started = run.fit_started or fn is Fn.FIT
    if fn is Fn.FIT or datamodule is not None:
        run.datamodule = datamodule


def on_exception(run: Run, module: Module, exc: BaseException) -> None:
    call(run, module.on_exception, lambda cb: cb.on_exception, exc)


def finish(run: Run, outcome: str) -> None:
    """Whatever happened (`outcome`: "success", "failed" or "interrupted"): the bar stops, the
    loggers are finalised (rank 0) and, after a failure, the strategy is torn down."""
    run.fitting, run.status = False, "finished" if outcome == "success" else "interrupted"
    run.preemption.uninstall()
    if run.progress is not None:
        run.progress.stop(run.metrics.prog_bar_values() if outcome == "success" else None)
        run.progress = None
    for lg in run.loggers if run.global_rank == 0 else []:
        lg.finalize(outcome)
    if run.global_rank == 0 or run.profiler.filename:  # a file per rank; the screen on rank 0
        run.profiler.describe()
    run.profiler.teardown(run.fn.value if run.fn else None)
    if outcome == "success" and run.fn is Fn.FIT:
        run.print0(fit_closing_line(run, run.trainer.config.limits))
    if outcome != "success" and run.process is not None:
        run.strategy.teardown()


def fit_closing_line(run: Run, limits: Limits) -> str:
    """Why fit stopped, its last checkpoint and its run report (report/closing.py words it)."""
    by = "trainer.should_stop (a callback or the Module set it)" if run.should_stop else None
    for cb in run.callbacks if run.should_stop else []:
        if isinstance(cb, EarlyStopping) and cb.stopped_epoch >= 0:
            by = f"EarlyStopping(monitor={cb.monitor!r}) at epoch {cb.stopped_epoch}"
        if isinstance(cb, Timer) and (left := cb.time_remaining()) is not None and left <= 0:
            by = f"the time limit {cb.duration} (max_time / Timer)"
    step, epoch = run.loop.global_step, run.loop.epoch
    why = stop_reason(step, epoch, limits.max_steps, limits.max_epochs, limits.epochs_limit, by)
    ckpt = next((c for c in run.callbacks if isinstance(c, ModelCheckpoint)), None)
    saved = (ckpt.last_model_path or ckpt.best_model_path) if ckpt is not None else None
    report = next((c.report_path for c in run.callbacks if isinstance(c, RunMetrics)), None)
    return closing_line(why, step, saved or None, None if report is None else str(report))


def teardown_hooks(run: Run, module: Module, fn: Fn) -> None:
    """`teardown` on the callbacks, the DataModule and the Module, at a successful entry's end."""
    for cb in run.callbacks:
        timed(run, "Callback", cb.teardown, run.trainer, module, fn.value)
    if run.datamodule is not None:
        timed(run, "LightningDataModule", run.datamodule.teardown, fn.value)
    timed(run, "LightningModule", module.teardown, fn.value)


# ================================================================== fit
def fit(
    run: Run, config: Config, module: Module, train_given: Any, val_given: Any, resume: Any
) -> None:
    """Trains `module` once `start` ran: its loaders (given, else the DataModule's, else its own),
    the strategy set up, the checkpoint `resume` loaded, then Lightning's order of hooks around the
    epochs."""
    limits = config.limits
    train, val = load_fit_data(run, config, module, train_given, val_given, first=True)
    run.preemption.install()  # a signal only sets a flag; train_epoch acts on it at a step's end
    n = num_batches(train, limits.limit_train_batches)
    run.enter(Stage.TRAIN)
    run.fitting, run.said_uneven, run.loader_restored = True, False, False
    run.train_windows = None
    skip, rng = restore(run, module, resume) if resume else (0, None)
    set_up_training(run, config, module, n)
    run.should_stop = False  # before on_fit_start: a Timer already spent stops at once
    call(run, module.on_fit_start, lambda cb: cb.on_fit_start)
    # The flags as on_fit_start leaves them: the tuner's trial fits swap in their own there, once
    # configure_optimizers has sized its schedulers from the user's (tuner/trial.py).
    config = run.trainer.config
    limits = config.limits
    sanity_check(run, limits, module, val)
    call(run, module.on_train_start, lambda cb: cb.on_train_start)
    run.stop_held, loaded_at = False, run.loop.epoch
    while not stops(run, limits) and run.loop.epoch < limits.epochs_limit:
        every = limits.reload_dataloaders_every_n_epochs
        if every and run.loop.epoch - loaded_at >= every:
            loaded_at = run.loop.epoch
            train, val = load_fit_data(run, config, module, train_given, val_given, first=False)
        try:
            train_epoch(run, config, module, train, val, skip, rng)
        except StepsOutOfMemory as e:  # strategy="auto": the next plan trains from step 0
            next_plan(run, config, module, str(e))
            continue
        skip, rng = 0, None
    call(run, module.on_train_end, lambda cb: cb.on_train_end)
    call(run, module.on_fit_end, lambda cb: cb.on_fit_end)
    teardown_hooks(run, module, Fn.FIT)


def stops(run: Run, limits: Limits) -> bool:
    """Lightning's rule: reaching max_steps ends fit; a requested stop (`should_stop`:
    EarlyStopping, max_time) waits until min_epochs epochs and min_steps steps have run. Every rank
    decides alike: the inputs agree."""
    step, epoch = run.loop.global_step, run.loop.epoch
    if limits.max_steps != -1 and step >= limits.max_steps:
        run.should_stop = True
        return True
    held = epoch < (limits.min_epochs or 0) or step < (limits.min_steps or 0)
    if run.should_stop and held and not run.stop_held:
        run.stop_held = True
        run.print0(
            f"Stopping was requested at step {step}, epoch {epoch}, but "
            f"min_epochs={limits.min_epochs} / min_steps={limits.min_steps} are not reached "
            "yet: training continues until they are."
        )
    return run.should_stop and not held


def train_epoch(
    run: Run, config: Config, module: Module, loader: Any, val: list, skip: int, rng: dict | None
) -> None:
    """One epoch: the loader's batches (after `skip` when resuming; `rng` restored where it was
    saved) in accumulation windows, one optimizer step each; validation every `val_check_interval`
    batches; a preemption signal acted on after a step; then the epoch's end."""
    limits = config.limits
    n = num_batches(loader, limits.limit_train_batches)
    val_every = validation_interval(n, limits.val_check_interval)
    set_epoch(loader, run.loop.epoch)
    run.loop.epoch_done, run.loop.batches_done, run.skip_rest = False, skip, False
    # a -1 from on_train_batch_start on any rank ends the epoch on every rank: one vote per epoch
    run.skip_vote = AgreedMax() if is_overridden(module, "on_train_batch_start") else None
    module.train()
    call(run, module.on_train_epoch_start, lambda cb: cb.on_train_epoch_start)
    replay = not (skip and run.loader_restored)  # a stateful loader resumes where it was saved
    batches = run.process.move.timed(resumed_iterator(loader, skip, rng, replay), loader)
    # Manual optimization steps per batch, however the user accumulates; the accumulation is read
    # after on_train_epoch_start (a GradientAccumulationScheduler sets it there).
    accumulate = run.accumulate_grad_batches
    size = accumulate if module.automatic_optimization else 1
    # Counts not known before the epoch (a stream): the ranks agree before each step on how many
    # micro-batches all have, so every rank ends the epoch after the same step.
    timeout_s = config.launch.timeout
    agree = None if run.train_counts_known else lambda count: host_min_max(count, timeout_s)
    run.train_windows = windows = EpochWindows(loader, batches, skip, n, size, agree)
    ended = False
    for window, is_last in windows:
        run.is_last_batch = is_last
        step = lambda: train_window(run, window, accumulate)  # noqa: B023, E731
        first = run.first_steps  # strategy="auto": the first steps may give way to another plan
        ran, out = step() if first is None else first.guard(module, run.strategy, step)
        if not ran:  # on_train_batch_start returned -1 before this window's first micro-batch
            break
        run.loop.batches_done, ended = window[-1][0] + 1, is_last
        if is_last:  # as Lightning: epoch schedulers step before the last batch's end hooks save
            step_epoch_schedulers(run, module, plateau=False)
        after_step(run, config, module, out, batch=window[-1][1], batch_idx=window[-1][0])
        if signum := run.preemption.requested():  # collective: every rank stops after this step
            run.preemption.stop(signum, run.trainer)
        at_interval = val_every and any((i + 1) % val_every == 0 for i, _ in window)
        if val and at_interval and not is_last:  # the epoch's end validates after the last
            validate_during_fit(run, limits, module, val)
        if not is_last:  # ReduceLROnPlateau per step, on what validation logged
            step_plateau_per_step(run, module)
        if stops(run, limits) or run.skip_rest:
            break
    if windows.uneven and not run.said_uneven:  # once per fit, on every rank alike
        run.said_uneven = True
        run.print0(windows.shortfall(run.loop.epoch))
    # a stream that gave no batch this epoch ends it too (a generator spent in the first epoch)
    ended = ended or windows.ended or run.loop.batches_done >= n or run.skip_rest
    # As Lightning: the epoch's end validates when it falls on the interval (1.0: every epoch); a
    # fraction or a count that does not divide the epoch has validated within it already
    at_end = not val_every or n == math.inf or n % val_every == 0
    end_train_epoch(run, limits, module, val if at_end else [], epoch_done=ended)


def train_window(run: Run, window: list[tuple[int, Any]], accumulate: int) -> tuple[bool, Any]:
    """One optimizer step: each micro-batch of `window` ((batch_idx, batch) as the loader gave it)
    to the device, forward and backward (gradients synchronised on the last one only), then the
    optimizer hooks and `strategy.step()`. Returns (False, None) when on_train_batch_start asked to
    skip the epoch's rest before the first micro-batch (nothing ran), else (True, the last
    micro-batch's `training_step` output). Micro-batch trials run it too (`trial_step`)."""
    module, strategy, out, loss = run.module, run.strategy, None, None
    assert module is not None and run.guard is not None and run.training_step is not None
    run.guard.begin(run.loop.global_step, run.loop.epoch, [i for i, _ in window])
    run.metrics.in_batch = True  # until after_step: `self.log` defaults to on_step (Lightning's)
    # DeepSpeed counts micro-steps in its backward: a step without one cannot be skipped there
    skippable = not strategy.name.startswith("deepspeed")
    ran = False  # a micro-batch ran (the loader may give None: skipped, as Lightning does)
    for i, (batch_idx, batch) in enumerate(window):
        if batch is None:
            _SKIPPED.warn(
                "train_dataloader yielded None: that batch is skipped (no step of its own). If "
                "that is not on purpose, check the loader's collate_fn."
            )
            continue
        ran = True
        batch = batch_to_device(run, module, batch)  # the three transfer hooks around `move`
        run.metrics.batch_size = infer_batch_size(batch)
        if on_train_batch_start(run, module, batch, batch_idx) and i == 0:
            return False, None
        args = (batch, batch_idx) if run.takes_batch_idx else (batch,)
        with run.profiler.profile(f"[Strategy]{type(strategy).__name__}.training_step"):
            with default_dtype(run.input_dtype):
                out = strategy.forward(run.training_step, *args, sync_grads=i == len(window) - 1)
        if module.automatic_optimization:
            if (loss := loss_of(out, skippable)) is None:
                continue  # training_step returned None: this micro-batch has no backward
            run.guard.observe(loss, i)
            loss = loss / accumulate
            call(run, module.on_before_backward, lambda cb: cb.on_before_backward, loss)
            strategy.backward(loss)
            call(run, module.on_after_backward, lambda cb: cb.on_after_backward)
    if not ran:  # every batch of the window was None: nothing to step
        return True, None
    if module.automatic_optimization:  # under manual optimization training_step stepped
        for opt in strategy.optimizers:
            call(run, module.on_before_optimizer_step, lambda cb: cb.on_before_optimizer_step, opt)
        for opt in strategy.optimizers:
            call(run, module.on_before_zero_grad, lambda cb: cb.on_before_zero_grad, opt)
        run.step_stats = strategy.step(run.guard)  # the guard decides before any step
    run.loop.global_step += 1
    if module.automatic_optimization:
        step_schedulers(  # a ReduceLROnPlateau waits for validation (train_epoch)
            strategy.schedulers, "step", run.loop.global_step, run.metrics.latest, module, False
        )
    return True, batch_end_outputs(out, loss, module.automatic_optimization)


def batch_end_outputs(out: Any, loss: torch.Tensor | None, automatic: bool) -> dict:
    """What `on_train_batch_end` receives, as in Lightning: a dict holding the loss without its
    graph. Automatic optimization: {"loss": the last micro-batch's loss as divided for
    accumulation, **the step's other keys}, {} when it returned None; manual: the step's dict (a
    tensor as {"loss": ...}, None as {}) with its "loss" detached."""
    if automatic:
        if loss is None:
            return {}
        extra = {k: v for k, v in out.items() if k != "loss"} if isinstance(out, dict) else {}
        return {"loss": loss.detach().clone(), **extra}
    outputs = dict(out) if isinstance(out, dict) else {} if out is None else {"loss": out}
    if isinstance(outputs.get("loss"), torch.Tensor):
        outputs["loss"] = outputs["loss"].detach()
    return outputs


def on_train_batch_start(run: Run, module: Module, batch: Any, batch_idx: int) -> bool:
    """The hooks; True once the Module's returned -1 in this epoch on any rank (Lightning's way to
    skip the epoch's rest): `run.skip_rest`. The ranks agree through one MAX reduction per call,
    made only when the Module overrides the hook (`run.skip_vote`); under NCCL it answers one call
    late (distributed.AgreedMax), so the host never waits for the GPU."""
    heartbeat.note_step(run.loop.global_step)  # no I/O: the heartbeat thread publishes it
    asked = call(
        run, module.on_train_batch_start, lambda cb: cb.on_train_batch_start, batch, batch_idx
    )
    if run.skip_vote is not None:
        mine = isinstance(asked, int) and not isinstance(asked, bool) and asked == -1
        if run.skip_vote(int(mine)):
            run.skip_rest = True  # the epoch ends: before this window, or after it when inside
    return run.skip_rest


def loss_of(out: Any, skippable: bool = False) -> torch.Tensor | None:
    """The scalar loss of a `training_step` output (a tensor or a dict with 'loss'). None when the
    step returned None and `skippable`: as in Lightning, that batch gets no backward (said once per
    `Closure.warning_cache`); ConfigError otherwise."""
    if out is None and skippable:
        Closure.warning_cache.warn(
            "`training_step` returned `None`: this batch is skipped (no backward; the optimizer "
            "still steps on what the window's other batches accumulated). If that is not on "
            "purpose, return the loss."
        )
        return None
    loss = out.get("loss") if isinstance(out, dict) else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        if isinstance(loss, torch.Tensor):
            shape = f"a tensor of shape {tuple(loss.shape)}"
        else:
            shape = repr(loss)[:80]
        if isinstance(out, dict) and "loss" not in out:
            shape = f"a dict without 'loss' (keys {sorted(map(str, out))})"
        raise ConfigError(
            f"training_step returned {shape}: under automatic optimization it must return a "
            "scalar loss tensor or a dict with a 'loss' scalar."
        )
    return loss.reshape(())


def after_step(
    run: Run, config: Config, module: Module, out: Any, batch: Any, batch_idx: int
) -> None:
    """After each optimizer step: the step's metrics to the loggers (every `log_every_n_steps`),
    the bar, on_train_batch_end, and the compile check at step 3."""
    step_metrics = run.metrics.pop_step()
    is_log_step = run.loop.global_step % config.output.log_every_n_steps == 0
    if is_log_step:
        norm = run.step_stats.get("grad_norm")
        log_metrics(
            run,
            {
                **({"grad_norm": float(norm)} if norm is not None else {}),
                **run.guard.log_values(),
                **{k: float(v) for k, v in step_metrics.items()},
            },
        )
    if run.progress is not None:
        run.progress.advance(f"epoch {run.loop.epoch}", run.metrics.prog_bar_values, is_log_step)
    call(run, module.on_train_batch_end, lambda cb: cb.on_train_batch_end, out, batch, batch_idx)
    run.metrics.in_batch = False
    if config.step.compile and run.loop.global_step == 3 and not compiled_ran(run.compiled_frames):
        run.print0(
            "Warning: compile=True, but nothing compiled ran in 3 steps (see "
            "kernels.apply_compile)."
        )


def end_train_epoch(run: Run, limits: Limits, module: Module, val: list, epoch_done: bool) -> None:
    """Lightning's order: validation first, so on_train_epoch_end and epoch schedulers
    (ReduceLROnPlateau on val_loss) see this epoch's validation metrics; then the checkpoint
    callbacks save the result."""
    run.guard.settle()  # the last step's non-finite verdict, if the host has not read it yet
    epoch, every = run.loop.epoch, limits.check_val_every_n_epoch
    if val and every and (epoch + 1) % every == 0 and epoch_done:
        validate_during_fit(run, limits, module, val)
    if run.is_last_batch:  # the last batch's ReduceLROnPlateau per step, after that validation
        step_plateau_per_step(run, module)
    module.on_train_epoch_end()
    epoch_metrics = run.metrics.pop_epoch()
    if epoch_metrics:
        log_metrics(run, {"epoch": epoch, **{k: float(v) for k, v in epoch_metrics.items()}})
    if epoch_done:  # ReduceLROnPlateau per epoch (the others stepped at the last batch)
        step_epoch_schedulers(run, module, plateau=True)
    run.loop.epoch_done = epoch_done
    for cb in run.callbacks:
        cb.on_train_epoch_end(run.trainer, module)
    if late := run.metrics.pop_epoch():  # what the callbacks logged in on_train_epoch_end
        log_metrics(run, {"epoch": epoch, **{k: float(v) for k, v in late.items()}})
    if epoch_done:
        # At the next epoch's start from here on: a checkpoint saved now (after fit, in
        # on_train_end) resumes there, not one epoch later.
        run.loop.epoch += 1
        run.loop.epoch_done, run.loop.batches_done = False, 0


def step_epoch_schedulers(run: Run, module: Module, plateau: bool) -> None:
    """The epoch-interval schedulers at the end of epoch `run.loop.epoch`: the ReduceLROnPlateau
    ones (`plateau`) or the others; under manual optimization the user steps them."""
    if module.automatic_optimization:
        epochs, metrics = run.loop.epoch + 1, run.metrics.latest
        step_schedulers(run.strategy.schedulers, "epoch", epochs, metrics, module, plateau)


def step_plateau_per_step(run: Run, module: Module) -> None:
    """The step-interval ReduceLROnPlateau schedulers, once the step's validation logged."""
    if module.automatic_optimization:
        step, metrics = run.loop.global_step, run.metrics.latest
        step_schedulers(run.strategy.schedulers, "step", step, metrics, module, True)


def validate_during_fit(run: Run, limits: Limits, module: Module, loaders: list) -> None:
    """A validation epoch inside fit. It must not move the training RNG (its loader draws a seed):
    training then gives the same losses whatever val_check_interval is, and a checkpoint saved just
    before a validation resumes exactly."""
    if num_batches(loaders[0], limits.limit_val_batches) == 0:
        return  # limit_val_batches=0 turns validation off, hooks included (as in Lightning)
    rng = rng_state()
    evaluation_epoch(run, limits, module, loaders, Stage.VALIDATE)  # ends in train() again
    set_rng_state(rng)
    run.enter(Stage.TRAIN)


def log_metrics(run: Run, metrics: dict[str, float], step: int | None = None) -> None:
    """Sends metrics to every logger (rank 0 only), at `step` (default: the global step)."""
    if run.global_rank == 0 and metrics:
        for lg in run.loggers:
            lg.log_metrics(metrics, run.loop.global_step if step is None else step)


# ================================================================== evaluation
class EvalStage(NamedTuple):
    """One evaluation stage's step and batch hooks, by name (`eval_stage`)."""

    step: Callable[..., Any]
    batch_start: Callable[..., Any]
    callback_batch_start: Callable[[Callback], Callable[..., Any]]
    batch_end: Callable[..., Any]
    callback_batch_end: Callable[[Callback], Callable[..., Any]]


def eval_stage(stage: Stage, module: Module) -> EvalStage:
    match stage:
        case Stage.VALIDATE | Stage.SANITY_CHECK:
            return EvalStage(
                module.validation_step,
                module.on_validation_batch_start,
                lambda cb: cb.on_validation_batch_start,
                module.on_validation_batch_end,
                lambda cb: cb.on_validation_batch_end,
            )
        case Stage.TEST:
            return EvalStage(
                module.test_step,
                module.on_test_batch_start,
                lambda cb: cb.on_test_batch_start,
                module.on_test_batch_end,
                lambda cb: cb.on_test_batch_end,
            )
        case _:
            return EvalStage(
                module.predict_step,
                module.on_predict_batch_start,
                lambda cb: cb.on_predict_batch_start,
                module.on_predict_batch_end,
                lambda cb: cb.on_predict_batch_end,
            )


def evaluate(
    run: Run, config: Config, fn: Fn, module: Module, given: Any, ckpt_path: Any, planned: bool
) -> list[dict[str, float]]:
    """`validate` or `test`: one evaluation epoch over the data; returns its logged metrics, one
    dict per loader (core.metrics.MetricStore.per_loader)."""
    loaders = prepare_evaluation(run, config, fn, module, given, ckpt_path, planned)
    results = evaluation_epoch(run, config.limits, module, loaders, fn.stage)
    teardown_hooks(run, module, fn)
    return run.metrics.per_loader(results, len(loaders))


def predict(
    run: Run, config: Config, module: Module, given: Any, ckpt_path: Any, planned: bool, keep: bool
) -> list[list]:
    """`predict`: this rank's `predict_step` outputs per loader (kept only with `keep`)."""
    loaders = prepare_evaluation(run, config, Fn.PREDICT, module, given, ckpt_path, planned)
    with evaluation_context(run):
        outputs = predict_epoch(run, config, module, loaders, keep)
    teardown_hooks(run, module, Fn.PREDICT)
    return outputs


def predict_epoch(run: Run, config: Config, module: Module, loaders: list, keep: bool) -> list:
    """The predict hooks around the batches (evaluation_context's inside)."""
    module.on_predict_model_eval()
    call(run, module.on_predict_start, lambda cb: cb.on_predict_start)
    call(run, module.on_predict_epoch_start, lambda cb: cb.on_predict_epoch_start)
    limit = config.limits.limit_predict_batches
    outputs = eval_batches(run, module, loaders, limit, Stage.PREDICT, keep=keep)
    call(run, module.on_predict_epoch_end, lambda cb: cb.on_predict_epoch_end)
    call(run, module.on_predict_end, lambda cb: cb.on_predict_end)
    return outputs


def prepare_evaluation(
    run: Run, config: Config, fn: Fn, module: Module, given: Any, ckpt_path: Any, planned: bool
) -> list:
    """`start`, then the stage's loaders, the strategy set up for evaluation (fit's serves), the
    checkpoint's weights loaded (any strategy's, on any world size). Returns the loaders,
    distributed."""
    path = start(run, config, fn, module, ckpt_path, planned)
    loaders = eval_loaders(fn.stage, module, run.datamodule, given)
    run.loaders[Stage.TRAIN] = None
    set_up_strategy(run, config, fn, module, None)
    if path:
        run.process.checkpointer.load_strategy(path)
    run.enter(fn.stage)
    repeat = fn is not Fn.PREDICT and forward_is_collective(run.strategy)  # (`distribute`)
    run.loaders[fn.stage] = distribute(run, config.data, config.launch.seed, loaders, repeat)
    if fn is Fn.PREDICT:  # a BasePredictionWriter reads which samples each batch held
        run.loaders[fn.stage] = [index_batches(loader) for loader in run.loaders[fn.stage]]
    return run.loaders[fn.stage]


def evaluation_epoch(
    run: Run, limits: Limits, module: Module, loaders: list, stage: Stage, cap: int | None = None
) -> dict[str, float]:
    """A validation or test epoch in Lightning's order: on_<x>_model_eval (eval mode), on_<x>_start,
    on_<x>_epoch_start, the batches, on_<x>_epoch_end (the Module's before the epoch's results are
    logged, the callbacks' after), on_<x>_end, then on_<x>_model_train (train mode again, unless
    overridden). Returns the results logged. The sanity check (stage SANITY_CHECK) runs validation's
    hooks on at most `cap` batches per loader and logs nothing."""
    with evaluation_context(run):
        return _evaluation_epoch(run, limits, module, loaders, stage, cap)


def evaluation_context(run: Run) -> Any:
    """What an evaluation runs under, hooks included, as in Lightning: `torch.inference_mode()`
    (Trainer(inference_mode=True), the default), else `torch.no_grad()`; also no_grad under a gloo
    process group (its collectives fail on inference tensors), FSDP (torch#95957) and DeepSpeed
    (ZeRO-3 gathers parameters into tensors that training reuses)."""
    gloo = torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    sharded = run.strategy.name.startswith(("fsdp", "deepspeed"))
    if run.inference_mode and not gloo and not sharded:
        return torch.inference_mode()
    return torch.no_grad()


def _evaluation_epoch(
    run: Run, limits: Limits, module: Module, loaders: list, stage: Stage, cap: int | None
) -> dict[str, float]:
    run.enter(stage)
    sanity = stage is Stage.SANITY_CHECK
    # the sanity check computes its epoch values (the bar shows them) and logs nothing
    results = epoch_results if not sanity else lambda run: run.metrics.pop_epoch(to_loggers=False)
    if stage is not Stage.TEST:
        module.on_validation_model_eval()
        call(run, module.on_validation_start, lambda cb: cb.on_validation_start)
        call(run, module.on_validation_epoch_start, lambda cb: cb.on_validation_epoch_start)
    else:
        module.on_test_model_eval()
        call(run, module.on_test_start, lambda cb: cb.on_test_start)
        call(run, module.on_test_epoch_start, lambda cb: cb.on_test_epoch_start)
    eval_batches(run, module, loaders, limits.batches(stage), stage, cap=cap)
    if stage is not Stage.TEST:
        module.on_validation_epoch_end()
        logged = results(run)
        for cb in run.callbacks:
            cb.on_validation_epoch_end(run.trainer, module)
        logged |= results(run)  # what the callbacks logged there
        call(run, module.on_validation_end, lambda cb: cb.on_validation_end)
        module.on_validation_model_train()
    else:
        module.on_test_epoch_end()
        logged = results(run)
        for cb in run.callbacks:
            cb.on_test_epoch_end(run.trainer, module)
        logged |= results(run)  # what the callbacks logged there
        call(run, module.on_test_end, lambda cb: cb.on_test_end)
        module.on_test_model_train()
    return logged


def epoch_results(run: Run) -> dict[str, float]:
    results = {k: float(v) for k, v in run.metrics.pop_epoch().items()}
    log_metrics(run, results)
    return results


@torch.no_grad()
def eval_batches(
    run: Run,
    module: Module,
    loaders: list,
    limit: Any,
    stage: Stage,
    keep: bool = False,
    cap: int | None = None,
) -> list[list]:
    """The one evaluation batch loop: the stage's step through the strategy for each batch of each
    loader (at most `cap` per loader), with its batch hooks; the outputs per loader if `keep`. The
    step gets `batch_idx` when its signature takes it and, as in Lightning, `dataloader_idx` with
    several loaders only (with one, a `*args` step gets two arguments and `dataloader_idx=None`
    keeps its default), as the hooks do (`check_dataloader_idx` refuses a signature that does not
    fit). The caller has put the module in eval mode.

    A loader without an exact length (an IterableDataset, a generator, a `len()` that estimates)
    may end at another batch on each rank: the ranks agree once per window of batches how many each
    holds (data/epoch_windows.EvalBatches), and all step until the last rank's stream ends, so no
    batch is dropped and no rank is left in a collective. A rank whose stream has ended waits at
    the next agreement, or, where the step itself is collective (`forward_is_collective`, or a
    value logged per step with sync_dist), runs `shadow_step` on its last batch; one line on rank 0
    says which ranks ran short."""
    hooks = eval_stage(stage, module)
    check_dataloader_idx(module, stage, several=len(loaders) > 1)
    outputs: list[list] = []
    short: list[str] = []
    for dl_idx, loader in enumerate(loaders):
        several = (dl_idx,) if len(loaders) > 1 else ()
        run.metrics.dataloader_idx = dl_idx if several else None
        set_epoch(loader, run.loop.epoch)  # as the training loader's (a shuffling sampler)
        n = min(num_batches(loader, limit), cap if cap is not None else float("inf"))
        # alike on every rank: counts not known, or known to differ (each sample on one rank)
        voted = run.world_size > 1 and not (has_exact_length(loader) and even_across_ranks(loader))
        batches = EvalBatches(loader, n, host_min_max if voted else None)
        outputs.append(eval_loader(run, module, hooks, batches, stage, several, keep))
        if batches.uneven:  # alike on every rank
            name = f"{_LOADER_NAMES[stage]}" + (f"[{dl_idx}]" if several else "")
            short.append(batches.shortfall(name))
    run.metrics.dataloader_idx = None
    if short:
        run.print0("; ".join(short) + " (no batch left out).")
    return outputs


def eval_loader(
    run: Run,
    module: Module,
    hooks: EvalStage,
    batches: EvalBatches,
    stage: Stage,
    several: tuple,
    keep: bool,
) -> list:
    """One loader's batches (`eval_batches`); its outputs if `keep`."""
    takes_batch_idx = accepts(hooks.step, 2, "batch_idx")
    shadows = forward_is_collective(run.strategy)
    dl_idx = several[0] if several else 0
    outputs: list = []
    last = None  # this rank's last batch on the device: what a shadow step runs on
    syncs = False  # the step logs sync_dist values per step: a collective in each step
    for batch_idx, batch, has in batches:
        if batch is not None or has:  # its own, or a peer's first (`EvalBatches`)
            batch = last = batch_to_device(run, module, batch, dl_idx)
        args = (last, batch_idx)[: 2 if takes_batch_idx else 1] + several
        reductions = run.metrics.reductions
        if not has:
            # at 0 also under DDP: its first forward syncs buffers, and names the step's
            # sync_dist values (reduced at the epoch's end on every rank)
            if shadows or syncs or batch_idx == 0:
                shadow_step(run, hooks.step, args)
                syncs = syncs or run.metrics.reductions > reductions
            continue
        run.metrics.batch_size = infer_batch_size(batch)
        call(run, hooks.batch_start, hooks.callback_batch_start, batch, batch_idx, *several)
        with default_dtype(run.input_dtype):
            out = run.strategy.forward(hooks.step, *args)
        syncs = syncs or run.metrics.reductions > reductions  # alike on every rank
        call(run, hooks.batch_end, hooks.callback_batch_end, out, batch, batch_idx, *several)
        if stage in (Stage.VALIDATE, Stage.TEST):  # step values at the loader's batch count
            values = run.metrics.pop_step()
            log_metrics(run, {k: float(v) for k, v in values.items()}, step=batch_idx + 1)
        if keep:
            outputs.append(out)
    return outputs


_LOADER_NAMES = {
    Stage.VALIDATE: "val_dataloaders",
    Stage.SANITY_CHECK: "val_dataloaders (sanity check)",
    Stage.TEST: "test_dataloaders",
    Stage.PREDICT: "predict_dataloaders",
}


def shadow_step(run: Run, step: Callable[..., Any], args: tuple) -> None:
    """The evaluation step of a rank whose stream has ended, run so that the collectives inside it
    (the forward's parameter gathers, a sync_dist value logged per step) meet the other ranks'
    (torch's `Join` idea): on its last batch, with no batch hooks, nothing it logs kept and its
    output discarded. What the step itself does besides (a counter it raises, a torchmetrics Metric
    it updates) cannot be undone."""
    run.metrics.discarding = True
    try:
        with default_dtype(run.input_dtype):
            run.strategy.forward(step, *args)
    finally:
        run.metrics.discarding = False


def sanity_check(run: Run, limits: Limits, module: Module, val: list) -> None:
    """Lightning's sanity check: `num_sanity_val_steps` validation batches per loader (-1: all)
    before training, in the SANITY_CHECK stage, with validation's hooks (code that must not act
    then reads `trainer.sanity_checking`), nothing logged, and the training RNG untouched."""
    steps = limits.num_sanity_val_steps
    if not val or steps == 0:
        return
    rng, latest = rng_state(), dict(run.metrics.latest)
    run.enter(Stage.SANITY_CHECK)
    for cb in run.callbacks:
        cb.on_sanity_check_start(run.trainer, module)
    cap = None if steps == -1 else steps
    evaluation_epoch(run, limits, module, val, Stage.SANITY_CHECK, cap)
    run.metrics.discard(Stage.SANITY_CHECK.logs_as, latest)
    for cb in run.callbacks:  # still sanity checking, as in Lightning
        cb.on_sanity_check_end(run.trainer, module)
    set_rng_state(rng)
    run.enter(Stage.TRAIN)


# ================================================================== what the planner runs
def trial_step(run: Run, twin: Module, strategy: Any, batch: Any, callbacks: list) -> None:
    """One training step of a micro-batch trial (plan/micro_batch.confirm): the loop's own
    `train_window`, run on a copy of the module (whose stand-in trainer holds its metrics) and a
    copy of the strategy, with the trial's callbacks only, on this run's device and transfer hooks.
    A non-finite loss only warns: a trial measures memory."""
    guard = NonFiniteGuard("warn", run.global_rank, run.world_size, run.print0)
    trial = Run(
        trainer=twin.trainer,
        strategy=strategy,
        callbacks=callbacks,
        loggers=[],
        metrics=twin.trainer.metrics,
        device=run.device,
        guard=guard,
        module=twin,
        datamodule=run.datamodule,
        training_step=twin.training_step,
        takes_batch_idx=accepts(twin.training_step, 2, "batch_idx"),
    )
    train_window(trial, [(0, batch)], accumulate=1)
