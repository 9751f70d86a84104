"""Short trial runs on the user's own Trainer that leave no trace: what the LR finder and the batch
size finder are built on.

    trials = TrialRuns(trainer, ".lr_find")
    trials.fit(probe, model, train_dataloaders, val_dataloaders, datamodule)   # one or more
    trials.restore()      # weights, optimizer state, LR schedulers, step, epoch, RNG: as before
    trials.clean_up()

Each trial is a plain `trainer.fit` with `probe` (a `Probe`) as the only callback. At the first
trial's `on_fit_start`, when the strategy is set up on every rank, the state is saved with
`trainer.save_checkpoint` into a temporary folder under `default_root_dir`; `restore` loads it
back, so the weights end bitwise as they were and the next `trainer.fit` starts where the user's
would have (step 0, epoch 0 on a fresh Trainer). During a trial the user's callbacks, loggers and LR
schedulers are set aside, the progress bar, the model summary and the sanity check are off, and the
non-finite guard only warns (a range test drives the loss to Inf on purpose).

The Trainer's flags are swapped in `trainer.config` (a frozen config.Config, replaced whole) at
`on_fit_start`, after `configure_optimizers` ran: an optimizer or scheduler sized from
`trainer.max_steps` or `trainer.estimated_stepping_batches` is sized for the user's run, not the
trial's.
"""

from __future__ import annotations

import copy
import logging
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

from lightspeed.callbacks.callback import Callback
from lightspeed.core.optimizer import parse_optimizers
from lightspeed.runtime.distributed import barrier
from lightspeed.runtime.rng import rng_state, set_rng_state

__all__ = ["Probe", "TrialRuns", "find_holders", "read_attr", "refresh_optimizer", "write_attr"]
log = logging.getLogger(__name__)


class Probe(Callback):
    """The callback a trial runs with. `TrialRuns` calls `begin` at the trial's `on_fit_start`
    (after its own bookkeeping); subclasses record what they measure in the other hooks."""

    trials: TrialRuns | None = None

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        assert self.trials is not None, "a Probe runs inside TrialRuns.fit"
        self.trials.on_trial_setup()

    def on_fit_start(self, trainer: Any, module: Any) -> None:
        assert self.trials is not None, "a Probe runs inside TrialRuns.fit"
        self.trials.on_trial_start(self)
        self.begin(trainer, module)

    def begin(self, trainer: Any, module: Any) -> None:
        """The trial's flags are in place and the state is saved; the first step comes next."""

    def trial_flags(self, trainer: Any) -> dict:
        """The Trainer flags this trial changes at fit start (e.g. max_steps)."""
        return {}


class TrialRuns:
    """Trial fits on `trainer` and the state to come back to (module docstring).

    Args:
        trainer: the user's Trainer; trials share its strategy, process group and loaders' sources.
        name: prefix of the temporary checkpoint folder under `default_root_dir` (".lr_find").
    """

    def __init__(self, trainer: Any, name: str):
        self.trainer, self.name = trainer, name
        self.user_cfg = trainer.config
        self.saved: Path | None = None  # the checkpoint written at the first trial's fit start
        self._at: dict[str, Any] = {}  # RNG, step, epoch and a DeepSpeed config scheduler's state
        self._set_aside: dict[str, Any] = {}

    # ------------------------------------------------------------------ one trial
    def fit(
        self, probe: Probe, model: Any, train: Any = None, val: Any = None, datamodule: Any = None
    ) -> None:
        """One `trainer.fit` with `probe` as the only callback. Raises what the fit raised (the
        Trainer has then torn its strategy down: `restore` is no longer possible)."""
        t = self.trainer
        probe.trials = self
        callbacks = list(t.callbacks)
        # In place: the Trainer's Checkpointer holds this list.
        t.callbacks[:] = [probe]
        t.config = self.user_cfg.replace(enable_progress_bar=False, enable_model_summary=False)
        try:
            t.fit(model, train, val, datamodule)
        finally:
            t.callbacks[:] = callbacks
            t.config = self.user_cfg
            self._put_back()

    def evaluate(
        self, method: str, model: Any, dataloaders: Any, datamodule: Any, **flags: Any
    ) -> None:
        """One `trainer.validate/test/predict` with no callbacks, no loggers and `flags` (e.g.
        limit_val_batches) swapped in; evaluation changes no weights, so nothing is saved."""
        t = self.trainer
        callbacks, loggers = list(t.callbacks), t.loggers
        t.callbacks[:], t.loggers = [], []
        t.config = self.user_cfg.replace(enable_progress_bar=False, **flags)
        try:
            run = getattr(t, method)
            if method == "predict":
                run(model, dataloaders, datamodule=datamodule, return_predictions=False)
            else:
                run(model, dataloaders, datamodule=datamodule, verbose=False)
        finally:
            t.callbacks[:], t.loggers, t.config = callbacks, loggers, self.user_cfg

    def on_trial_setup(self) -> None:
        """At the first trial's `setup`, once the ranks run (and the Trainer's seed is applied) and
        before the loaders are built: the RNG state to come back to. Loaders that draw random data
        then draw the same on each call (as Lightning's), and the next fit sees what a first
        would."""
        if "rng" not in self._at:
            self._at["rng"] = rng_state()

    def on_trial_start(self, probe: Probe) -> None:
        """At a trial's `on_fit_start`: the first time, saves the state (collective); then sets the
        user's callbacks (configure_callbacks' too), loggers and LR schedulers aside."""
        t = self.trainer
        if self.saved is None:
            folder = Path(t.default_root_dir) / f"{self.name}_{uuid.uuid4().hex[:12]}"
            self.saved = t.save_checkpoint(folder / "state")  # rank 0's path, on every rank
            engine_scheduler = _config_scheduler(t)
            self._at.update(
                step=t.global_step,
                epoch=t.current_epoch,
                scheduler=engine_scheduler,
                scheduler_state=copy.deepcopy(engine_scheduler.state_dict())
                if engine_scheduler
                else None,
            )
        t.callbacks[:] = [probe]
        self._set_aside = dict(
            loggers=t.loggers, schedulers=t.strategy.schedulers, policy=t.guard.policy
        )
        t.loggers, t.strategy.schedulers, t.guard.policy = [], [], "warn"
        t.config = t.config.replace(
            num_sanity_val_steps=0, min_steps=None, min_epochs=None, **probe.trial_flags(t)
        )

    def _put_back(self) -> None:
        if self._set_aside:
            t, aside = self.trainer, self._set_aside
            t.loggers, t.strategy.schedulers, t.guard.policy = (
                aside["loggers"],
                aside["schedulers"],
                aside["policy"],
            )
            self._set_aside = {}

    # ------------------------------------------------------------------ after the trials
    def restore(self) -> None:
        """Loads the saved state back (collective): weights, optimizer state and LR schedulers from
        the checkpoint; step, epoch, RNG and a DeepSpeed config scheduler as they were."""
        if self.saved is None:
            return
        t = self.trainer
        run = t._run  # the Trainer's run state (run.py): the trials moved its loop position
        _, state, _ = run.process.checkpointer.load(self.saved, with_optimizer=True)
        # The checksum pass the load left beside it, settled before clean_up deletes the files
        run.process.checkpointer.settle()
        run.loop.global_step, run.loop.epoch = self._at["step"], self._at["epoch"]
        t.should_stop = False
        if t.datamodule is not None and state.get("datamodule"):
            t.datamodule.load_state_dict(state["datamodule"])
        set_rng_state(self._at["rng"])
        # A DeepSpeed config's scheduler: the engine's checkpoint load leaves it as it is.
        if self._at["scheduler"] is not None:
            self._at["scheduler"].load_state_dict(self._at["scheduler_state"])

    def clean_up(self) -> None:
        """Removes the temporary checkpoint folder (rank 0, once every rank is past its load)."""
        if self.saved is None:
            return
        try:
            barrier()
        finally:
            if self.trainer.is_global_zero:
                shutil.rmtree(self.saved.parent, ignore_errors=True)
            self.saved = None


def _config_scheduler(trainer: Any) -> Any:
    """The LR scheduler a DeepSpeed config's `scheduler` section made (WarmupLR, OneCycle,
    LRRangeTest): the engine steps it and lightspeed's checkpoints leave it out. None otherwise."""
    engine = trainer.model  # the DeepSpeed engine under DeepSpeed
    if engine is trainer.lightning_module:
        return None
    scheduler = getattr(engine, "lr_scheduler", None)
    return scheduler if hasattr(scheduler, "state_dict") else None


def refresh_optimizer(trainer: Any, model: Any, lr: float | None = None) -> None:
    """Updates the set-up optimizer as if configure_optimizers ran again (after a tuned LR or batch
    size was written to the model).

    Lightning's next fit calls configure_optimizers again; lightspeed's keeps the optimizer it set
    up (DeepSpeed and FSDP own theirs). So configure_optimizers runs once more on the model (whose
    LR attribute now holds `lr`), and its param groups' numeric settings (lr, initial_lr, betas...)
    and its LR schedulers' states (base_lrs, OneCycleLR's max_lr...) are copied into the set-up
    ones. Where the two do not match (another number of groups or schedulers), every param group
    gets `lr` (when given) and each scheduler's base_lrs too. A DeepSpeed config's scheduler keeps
    its own settings."""
    opts = trainer.optimizers
    try:
        fresh_opts, fresh_scheds = parse_optimizers(model.configure_optimizers())
    except Exception as e:  # noqa: BLE001 - fall back to setting the LR alone
        log.info(f"configure_optimizers could not run again ({e}); only lr is set.")
        fresh_opts, fresh_scheds = [], []
    groups = [g for o in opts for g in o.param_groups]
    fresh = [g for o in fresh_opts for g in o.param_groups]
    scheds = [s.scheduler for s in trainer.strategy.schedulers]
    if len(fresh) != len(groups) or len(fresh_scheds) != len(scheds):
        if lr is None:
            return
        for group in groups:
            group.update({k: lr for k in ("lr", "initial_lr") if k in group or k == "lr"})
        for scheduler in scheds:
            if hasattr(scheduler, "base_lrs"):
                scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
        return
    for group, new in zip(groups, fresh):
        group.update(
            {k: v for k, v in new.items() if k in group and k != "params" and _is_setting(v)}
        )
    for scheduler, new in zip(scheds, fresh_scheds):
        scheduler.load_state_dict(new.scheduler.state_dict())


def _is_setting(value: Any) -> bool:
    """A numeric hyper-parameter (lr, betas, eps...), not a flag (fused, foreach) or a tensor."""
    if isinstance(value, bool):
        return False
    if isinstance(value, tuple):
        return all(_is_setting(v) for v in value)
    return isinstance(value, (int, float))


# ---------------------------------------------------------------------- attributes
def find_holders(model: Any, name: str, datamodule: Any = None) -> list[Any]:
    """Where Lightning looks for a tuned attribute (an LR, a batch size), in its order: the model,
    `model.hparams`, then the DataModule or its `hparams`. Returns each object that has `name`."""
    holders = []
    if _has(model, name):
        holders.append(model)
    if name in _hparams(model):
        holders.append(model.hparams)
    if datamodule is not None:
        if _has(datamodule, name):
            holders.append(datamodule)
        elif name in _hparams(datamodule):
            holders.append(datamodule.hparams)
    return holders


def read_attr(model: Any, name: str, datamodule: Any = None) -> Any:
    """The value of `name` where it counts: the DataModule's over the model's (the last holder).
    Raises AttributeError when nothing holds it."""
    holders = find_holders(model, name, datamodule)
    if not holders:
        raise AttributeError(
            f"{name} is neither stored in the model namespace nor the `hparams` "
            "namespace/dict, nor the datamodule."
        )
    holder = holders[-1]
    return holder[name] if isinstance(holder, dict) else getattr(holder, name)


def write_attr(model: Any, name: str, value: Any, datamodule: Any = None) -> None:
    """Sets `name` on every holder (the model and its hparams alike). AttributeError if none."""
    holders = find_holders(model, name, datamodule)
    if not holders:
        raise AttributeError(
            f"{name} is neither stored in the model namespace nor the `hparams` "
            "namespace/dict, nor the datamodule."
        )
    for holder in holders:
        if isinstance(holder, dict):
            holder[name] = value
        else:
            setattr(holder, name, value)


def _has(obj: Any, name: str) -> bool:
    with warnings.catch_warnings():  # a property may warn (or fail) when read this early
        warnings.simplefilter("ignore")
        try:
            return hasattr(obj, name)
        except Exception:  # noqa: BLE001 - a property that fails is not a holder
            return False


def _hparams(obj: Any) -> Any:
    hparams = getattr(obj, "hparams", None)
    return hparams if isinstance(hparams, dict) else {}
