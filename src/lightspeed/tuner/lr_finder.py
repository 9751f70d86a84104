"""The learning-rate range test: Lightning's `lr_find`, as a short fit on the user's Trainer.

    finder = lr_find(trainer, model, min_lr=1e-6, max_lr=1.0, num_training=100)
    finder.suggestion()          # the LR where the smoothed loss falls fastest
    finder.plot(suggest=True)    # loss against LR (matplotlib)

The test is one `trainer.fit` (tuner/trial.py) of at most `num_training` optimizer steps. Before
step k every optimizer param group gets the k-th LR of the grid (Lightning's: `min_lr` first, then
`min_lr * (max_lr / min_lr) ** ((k + 1) / num_training)`, or linear), and after it the step's loss
is recorded, smoothed and bias-corrected as Lightning does (beta 0.98). The test stops early when
the smoothed loss exceeds `early_stop_threshold` times the best so far. On several ranks the loss is
first averaged over them (the loss of the global batch, as one device would see it), so every rank
records the same curve, stops at the same step and suggests the same LR. Afterwards the weights,
optimizer state, LR schedulers, step and epoch are restored as they were.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import broadcast_from_rank0
from lightspeed.tuner.trial import Probe, TrialRuns, find_holders, refresh_optimizer, write_attr
from lightspeed.utilities.rank_zero import rank_zero_warn

__all__ = ["lr_find", "_LRFinder"]
log = logging.getLogger(__name__)


class _LRFinder:
    """The results of a range test (`results`: {"lr": [...], "loss": [...]}) and what they suggest.

    Args:
        mode: "exponential" or "linear": how the LR grows from one step to the next.
        lr_min, lr_max: the LRs of the first and the last step.
        num_training: the number of steps (and LRs) of the test.
    """

    def __init__(self, mode: str, lr_min: float, lr_max: float, num_training: int):
        if mode not in ("linear", "exponential"):
            raise ValueError(f"mode={mode!r}: should be either `linear` or `exponential`")
        self.mode, self.lr_min, self.lr_max, self.num_training = mode, lr_min, lr_max, num_training
        self.results: dict[str, Any] = {}
        self._total_batch_idx = 0  # the index of the last batch the test ran (all epochs)
        self._optimal_idx: int | None = None

    def lr_at(self, k: int) -> float:
        """The LR of step k (0-based) of the test: Lightning's grid, `lr_max` at the last step."""
        if k == 0:
            return self.lr_min
        r = min(k + 1, self.num_training) / self.num_training
        if self.mode == "linear":
            return self.lr_min + r * (self.lr_max - self.lr_min)
        return self.lr_min * (self.lr_max / self.lr_min) ** r

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The LR at the steepest descent of the loss (the most negative d loss / d lr, non-finite
        losses left out), skipping `skip_begin` points at the start and `skip_end` at the end.
        Returns None (and logs an error) when fewer than two finite points are left."""
        lrs, losses = self.results.get("lr", []), self.results.get("loss", [])
        kept = [
            i for i in range(skip_begin, len(losses) - skip_end) if math.isfinite(float(losses[i]))
        ]
        if len(kept) < 2:
            log.error(
                "Failed to compute suggestion for learning rate because there are not enough "
                "points. Increase the loop iteration limits or the size of your dataset/"
                "dataloader."
            )
            self._optimal_idx = None
            return None
        loss = torch.tensor([float(losses[i]) for i in kept], dtype=torch.float64)
        lr = torch.tensor([float(lrs[i]) for i in kept], dtype=torch.float64)
        slope = torch.gradient(loss, spacing=[lr])[0]  # d loss / d lr on the uneven LR grid
        self._optimal_idx = kept[int(torch.argmin(slope))]
        return lrs[self._optimal_idx]

    def plot(self, suggest: bool = False, show: bool = False, ax: Any = None) -> Any:
        """Draws loss against LR (a log axis in exponential mode) on `ax` or a new figure, with the
        suggestion as a red dot (`suggest`); `show` calls plt.show(). Returns the figure."""
        import matplotlib.pyplot as plt

        fig = ax.figure if ax is not None else None
        if ax is None:
            fig, ax = plt.subplots()
        lrs, losses = self.results["lr"], self.results["loss"]
        ax.plot(lrs, losses)
        if self.mode == "exponential":
            ax.set_xscale("log")
        ax.set_xlabel("Learning rate")
        ax.set_ylabel("Loss")
        if suggest and self.suggestion() is not None and self._optimal_idx is not None:
            i = self._optimal_idx
            ax.plot(lrs[i], losses[i], markersize=10, marker="o", color="red")
        if show:
            plt.show()
        return fig


class _RangeTest(Probe):
    """Sets each step's LR on every param group and records the step's smoothed loss."""

    def __init__(self, finder: _LRFinder, early_stop_threshold: float | None, beta: float = 0.98):
        self.finder, self.early_stop_threshold, self.beta = finder, early_stop_threshold, beta
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.batches = 0
        self._avg, self._best = 0.0, 0.0

    def trial_flags(self, trainer: Any) -> dict:
        return {"max_steps": trainer.global_step + self.finder.num_training}

    def begin(self, trainer: Any, module: Any) -> None:
        if len(trainer.optimizers) != 1:
            raise ConfigError(
                f"`model.configure_optimizers()` returned {len(trainer.optimizers)}, "
                "but learning rate finder only works with single optimizer"
            )

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1  # each micro-batch; the LR is the window's (same for each)
        lr = self.finder.lr_at(len(self.lrs))
        for group in trainer.optimizers[0].param_groups:
            group["lr"] = lr

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if len(self.lrs) >= self.finder.num_training:
            return
        self.lrs.append(self.finder.lr_at(len(self.lrs)))
        loss = _mean_over_ranks(_loss_of(outputs), trainer.device)
        if math.isnan(loss):  # no loss (None from training_step): left out of the suggestion
            self.losses.append(float("nan"))
            return
        n = len(self.lrs)  # Lightning debiases with the global step, here counted from the test
        self._avg = self.beta * self._avg + (1 - self.beta) * loss
        smoothed = self._avg / (1 - self.beta ** (n + 1))
        limit = self.early_stop_threshold
        if limit is not None and n > 1 and smoothed > limit * self._best:
            trainer.should_stop = True  # the same on every rank: the loss was reduced
        if smoothed < self._best or n == 1:
            self._best = smoothed
        self.losses.append(smoothed)


def _loss_of(outputs: Any) -> float:
    """The loss a training_step returned (a tensor or a dict's "loss"); NaN for none."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return float(loss.detach().float()) if isinstance(loss, torch.Tensor) else float("nan")


def _mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of `value` over the ranks (collective when there are several)."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def lr_attr_name(model: Any, attr_name: str = "", datamodule: Any = None) -> str:
    """The attribute that holds the LR: `attr_name`, else `lr` or `learning_rate` on the model or
    its hparams. Raises AttributeError when there is none (before any run, as Lightning)."""
    if attr_name:
        if not find_holders(model, attr_name, datamodule):
            raise AttributeError(
                f"The attribute name for the learning rate was set to {attr_name}, "
                "but could not find this as a field in `model` or `model.hparams`."
            )
        return attr_name
    for name in ("lr", "learning_rate"):
        if find_holders(model, name, datamodule):
            return name
    raise AttributeError(
        "When using the learning rate finder, either `model` or `model.hparams` "
        "should have one of these fields: ('lr', 'learning_rate'). If your model "
        "has a different name for the learning rate, set it with "
        "`.lr_find(attr_name=...)`."
    )


def lr_find(
    trainer: Any,
    model: Any,
    train_dataloaders: Any = None,
    val_dataloaders: Any = None,
    datamodule: Any = None,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    mode: str = "exponential",
    early_stop_threshold: float | None = 4.0,
    update_attr: bool = False,
    attr_name: str = "",
) -> _LRFinder | None:
    """Runs the range test (module docstring) on `trainer` and returns its `_LRFinder`, the same
    on every rank; None under fast_dev_run (skipped, with a warning). Collective: every rank calls
    it. With `update_attr` the suggestion is written to the LR attribute (`attr_name`, else `lr`
    or `learning_rate`, on the model and its hparams) and into the optimizer (`refresh_optimizer`).

    Raises:
        AttributeError: `update_attr` and no LR attribute (before anything runs).
        ConfigError: configure_optimizers returned more than one optimizer.
    """
    if trainer.fast_dev_run:
        rank_zero_warn("Skipping learning rate finder since `fast_dev_run` is enabled.")
        return None
    if update_attr:
        attr_name = lr_attr_name(model, attr_name, datamodule)
    finder = _LRFinder(mode, min_lr, max_lr, num_training)
    probe = _RangeTest(finder, early_stop_threshold)
    trials = TrialRuns(trainer, ".lr_find")
    try:
        trials.fit(probe, model, train_dataloaders, val_dataloaders, datamodule)
        trials.restore()
    finally:
        trials.clean_up()
    if len(probe.lrs) < num_training:
        log.info(f"LR finder stopped early after {len(probe.lrs)} steps due to diverging loss.")
    results = {"lr": probe.lrs, "loss": probe.losses, "batches": probe.batches}
    results = broadcast_from_rank0(results)  # one curve, one suggestion, on every rank
    finder.results = {"lr": results["lr"], "loss": results["loss"]}
    finder._total_batch_idx = results["batches"] - 1
    lr = finder.suggestion() if update_attr else None
    if lr is not None:
        write_attr(model, attr_name, lr, datamodule)
        refresh_optimizer(trainer, model, lr)
        log.info(f"Learning rate set to {lr}")
    return finder
