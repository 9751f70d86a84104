"""What `Module.log` records: step values, epoch aggregates, and the latest value of everything.

Values stay tensors until someone reads them (a logger at its interval, the progress bar, a
callback), so logging a loss every step costs no host-device synchronisation.

A torchmetrics `Metric` may be logged itself, as in Lightning: its step value is what its last
forward call (`metric(preds, target)`) returned, its epoch value `metric.compute()` at the epoch's
end (torchmetrics gathers the ranks' states there), after which it is reset.

`sync_dist=True` reduces over the ranks where Lightning does: a step value when it is logged, an
epoch value once, at the epoch's end (every rank's sum and batch sizes: the mean over all ranks'
batches, however many each rank had), so a value logged per epoch only costs no collective per
batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from lightspeed.errors import ConfigError

_REDUCE = {"mean", "sum", "max", "min"}


@dataclass
class _EpochAccumulator:
    reduce_fx: str
    stage: str
    # `loss` for `loss_epoch`: after the epoch, `loss` means the epoch value (as in Lightning)
    plain_name: str
    total: torch.Tensor | None = None
    count: int = 0
    weight: float = (
        0.0  # the batch sizes seen, for a mean weighted by batch size (as Lightning's on_epoch)
    )
    # a torchmetrics Metric logged itself: it keeps its own state, compute() gives the value
    metric: Any = None
    dataloader_idx: int | None = None  # the evaluation loader it was logged under (None: outside)
    sync: bool = False  # sync_dist: reduced over the ranks at the epoch's end (`synced`)

    def add(self, value: torch.Tensor | None, batch_size: int = 1) -> None:
        # `value` is None only for a Metric logged without on_step: the Metric holds the state.
        if self.metric is not None:
            self.count += 1
            return
        value = value.detach().float()
        if self.reduce_fx == "mean":
            value = value * batch_size
            self.weight += batch_size
        if self.total is None:
            self.total = value.clone()
        elif self.reduce_fx in ("mean", "sum"):
            self.total = self.total + value
        elif self.reduce_fx == "max":
            self.total = torch.maximum(self.total, value)
        else:
            self.total = torch.minimum(self.total, value)
        self.count += 1

    def compute(self) -> torch.Tensor:
        if (
            self.metric is not None
        ):  # collective under a process group: torchmetrics syncs the ranks' states
            value = self.metric.compute()
            self.metric.reset()
            return _as_tensor(self.plain_name, value, torch.device("cpu"))
        assert self.total is not None
        return self.total / self.weight if self.reduce_fx == "mean" else self.total

    def synced(self, device: torch.device) -> torch.Tensor | None:
        """Collective: the epoch value over every rank's batches (None when no rank logged one: a
        rank may hold the accumulator with nothing added, see `MetricStore.discarding`)."""
        neutral = {"max": -math.inf, "min": math.inf}.get(self.reduce_fx, 0.0)
        total = self.total if self.total is not None else torch.tensor(neutral)
        parts = torch.stack([total.to(device).float(), torch.tensor(self.weight, device=device)])
        count = torch.tensor(float(self.count), device=device)
        if self.reduce_fx in ("mean", "sum"):
            parts = torch.cat([parts, count.reshape(1)])
            dist.all_reduce(parts, op=dist.ReduceOp.SUM)
            count = parts[2]
        else:
            op = dist.ReduceOp.MAX if self.reduce_fx == "max" else dist.ReduceOp.MIN
            dist.all_reduce(parts, op=op)
            dist.all_reduce(count, op=dist.ReduceOp.SUM)
        if not count.item():
            return None
        return parts[0] / parts[1] if self.reduce_fx == "mean" else parts[0]


@dataclass
class MetricStore:
    """Owned by the Trainer; `Module.log` writes here. `stage` is "train", "validate", "test" or
    "predict"."""

    device: torch.device = torch.device("cpu")
    stage: str = "train"
    step_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    epoch_metrics: dict[str, _EpochAccumulator] = field(default_factory=dict)
    latest: dict[str, torch.Tensor] = field(default_factory=dict)
    prog_bar: set[str] = field(default_factory=set)
    hidden_from_logger: set[str] = field(default_factory=set)
    logged: dict[str, torch.Tensor] = field(
        default_factory=dict
    )  # the last values sent to the loggers
    batch_size: int = (
        1  # the current batch's size (set by the loop), the default weight of an epoch mean
    )
    dataloader_idx: int | None = None  # set by the evaluation loop when there are several loaders
    in_batch: bool = False  # the loop is inside a training batch's hooks (training_step, ...)
    to_reset: dict[str, dict[int, Any]] = field(
        default_factory=dict
    )  # Metric objects logged per step only
    # the evaluation loader each of the last pop_epoch's values was logged under (per_loader)
    epoch_loaders: dict[str, int | None] = field(default_factory=dict)
    # per evaluation stage, the `name_step` values it logged (dropped from `latest` at its end)
    eval_step_names: dict[str, set[str]] = field(default_factory=dict)
    # A shadow step runs (loop.py: a rank whose evaluation stream ended steps with the others):
    # `log` still makes its collectives, so the ranks' calls match, and keeps nothing; a sync_dist
    # epoch value gets its accumulator, empty, so the epoch's end reduces the same names everywhere.
    discarding: bool = False
    reductions: int = 0  # sync_dist step values reduced when logged (collectives made by `log`)

    def log(
        self,
        name,
        value,
        prog_bar=False,
        on_step=None,
        on_epoch=None,
        sync_dist=False,
        reduce_fx: str | Callable = "mean",
        logger=True,
        batch_size: int | None = None,
        rank_zero_only: bool = False,
        add_dataloader_idx: bool = True,
    ) -> None:
        """Records one value (Lightning's `self.log`). `batch_size` weights the epoch mean (default:
        the current batch's size); `rank_zero_only` means only rank 0 logs it, so it is never
        synchronised; with several evaluation loaders the name gets `/dataloader_idx_N` unless
        `add_dataloader_idx=False`."""
        fx = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "mean")
        fx = {"avg": "mean", "add": "sum"}.get(fx.lower(), fx.lower())  # Lightning's spellings
        if fx not in _REDUCE:
            raise ConfigError(
                f"reduce_fx={reduce_fx!r} is not valid for {name!r}: use one of {sorted(_REDUCE)}. "
                "Only `self.log(..., reduce_fx={min,max,mean,sum})` are supported; for another "
                "reduction, log a `torchmetrics.Metric`."
            )
        if add_dataloader_idx and "/dataloader_idx_" in name:  # the suffix is the loop's to add
            raise ConfigError(
                f"You called `self.log` with the key `{name}` but it should not contain "
                "information about `dataloader_idx` when `add_dataloader_idx=True`."
            )
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ConfigError(
                f"self.log({name!r}, batch_size={batch_size!r}) is not valid: expected an int ≥ 1."
            )
        # several evaluation loaders: Lightning's suffix, after the _step / _epoch fork
        suffix = (
            f"/dataloader_idx_{self.dataloader_idx}"
            if add_dataloader_idx and self.dataloader_idx is not None
            else ""
        )
        # Lightning's defaults by hook: per step inside a training batch's hooks, else per epoch
        per_step = self.stage == "train" and self.in_batch
        on_step = per_step if on_step is None else on_step
        on_epoch = (not per_step) if on_epoch is None else on_epoch
        if not on_step and not on_epoch:
            raise ConfigError(
                f"self.log({name!r}, ..., on_step=False, on_epoch=False) is not useful: it would "
                "record nothing. Set on_step=True, on_epoch=True or both."
            )
        training = self.stage == "train"
        metric = value if is_metric(value) else None
        if metric is not None:
            tensor = _metric_step_value(name, metric, on_step)
        else:
            tensor = _as_tensor(name, value, self.device)
        synced = (
            metric is None
            and sync_dist
            and not rank_zero_only
            and dist.is_initialized()
            and dist.get_world_size() > 1
        )
        step_tensor = tensor
        if synced and on_step:  # the epoch value is reduced at the epoch's end (`pop_epoch`)
            assert tensor is not None  # _as_tensor's, as metric is None
            step_tensor = _all_reduce(tensor, fx)
            self.reductions += 1
        # Lightning's naming: a metric logged both per step and per epoch appears as name_step and
        # name_epoch.
        forked = on_step and on_epoch
        step_name = f"{name}_step{suffix}" if forked else f"{name}{suffix}"
        epoch_name = f"{name}_epoch{suffix}" if forked else f"{name}{suffix}"
        name = f"{name}{suffix}"
        if self.discarding:
            if synced and on_epoch:
                self._accumulator(epoch_name, fx, name, metric, True)
            return
        if forked and not training:  # an evaluation's step values leave callback_metrics after it
            self.eval_step_names.setdefault(self.stage, set()).add(step_name)
        if on_step and step_tensor is not None:
            self.step_metrics[step_name] = step_tensor
            self.latest[step_name] = step_tensor
            if on_epoch:
                self.latest[name] = step_tensor
        if on_epoch:
            acc = self._accumulator(epoch_name, fx, name, metric, bool(synced))
            acc.add(tensor, batch_size or self.batch_size)
        elif (
            metric is not None
        ):  # logged per step only: still reset at the epoch's end, as in Lightning
            self.to_reset.setdefault(self.stage, {})[id(metric)] = metric
        if prog_bar:  # the forked names only, as Lightning's bar shows them
            self.prog_bar |= {step_name, epoch_name}
        if not logger:
            self.hidden_from_logger |= {step_name, epoch_name, name}

    def _accumulator(
        self, epoch_name: str, fx: str, name: str, metric: Any, sync: bool
    ) -> _EpochAccumulator:
        return self.epoch_metrics.setdefault(
            epoch_name,
            _EpochAccumulator(
                fx, self.stage, name, metric=metric, dataloader_idx=self.dataloader_idx, sync=sync
            ),
        )

    def pop_step(self) -> dict[str, torch.Tensor]:
        """The values logged during this step (for loggers); clears them."""
        out, self.step_metrics = self.step_metrics, {}
        out = {k: v for k, v in out.items() if k not in self.hidden_from_logger}
        self.logged.update(out)
        return out

    def pop_epoch(self, to_loggers: bool = True) -> dict[str, torch.Tensor]:
        """This stage's epoch aggregates (for loggers and callbacks); clears their accumulators.
        Another stage's stay: a validation run in the middle of a training epoch must not cut the
        training averages short. `to_loggers=False` (the sanity check): not `logged`."""
        mine = {name: acc for name, acc in self.epoch_metrics.items() if acc.stage == self.stage}
        for metric in self.to_reset.pop(self.stage, {}).values():
            metric.reset()
        # collective: the sync_dist values, reduced in one order on every rank
        synced = {name: mine[name].synced(self.device) for name in sorted(mine) if mine[name].sync}
        out: dict[str, torch.Tensor] = {}
        for name, acc in mine.items():
            value = synced[name] if acc.sync else acc.compute() if acc.count else None
            if value is not None:
                out[name] = value
        self.epoch_loaders.update({name: mine[name].dataloader_idx for name in out})
        for name in self.eval_step_names.pop(self.stage, set()):
            self.latest.pop(name, None)
        self.epoch_metrics = {k: v for k, v in self.epoch_metrics.items() if k not in mine}
        self.latest.update(out)
        self.latest.update({mine[name].plain_name: value for name, value in out.items()})
        out = {k: v for k, v in out.items() if k not in self.hidden_from_logger}
        if to_loggers:
            self.logged.update(out)
        return out

    def per_loader(self, results: dict[str, float], loaders: int) -> list[dict[str, float]]:
        """`results` (the last `pop_epoch`'s, as numbers) split as Lightning returns them from
        validate / test: one dict per loader, holding what was logged while that loader ran, plus
        what was logged outside any (an epoch-end hook) in every one."""
        split: list[dict[str, float]] = [{} for _ in range(loaders)]
        for name, value in results.items():
            idx = self.epoch_loaders.get(name)
            for i in range(loaders) if idx is None or idx >= loaders else (idx,):
                split[i][name] = value
        return split

    def discard(self, stage: str, latest: dict[str, torch.Tensor]) -> None:
        """Forgets what `stage` logged since `latest` was copied (the sanity check's values are
        never used)."""
        for acc in self.epoch_metrics.values():
            if acc.stage == stage and acc.metric is not None:
                acc.metric.reset()
        for metric in self.to_reset.pop(stage, {}).values():
            metric.reset()
        self.epoch_metrics = {k: v for k, v in self.epoch_metrics.items() if v.stage != stage}
        self.step_metrics = {}
        self.eval_step_names.pop(stage, None)
        self.latest = latest

    def prog_bar_values(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.latest.items() if k in self.prog_bar}


def infer_batch_size(batch: Any) -> int:
    """The length of the first tensor found in a batch (tensors, lists, tuples, dicts), else 1."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    items = (
        batch.values()
        if isinstance(batch, dict)
        else batch
        if isinstance(batch, (list, tuple))
        else ()
    )
    for item in items:
        if isinstance(item, (torch.Tensor, list, tuple, dict)):
            return infer_batch_size(item)
    return 1


def is_metric(value: Any) -> bool:
    """A torchmetrics Metric (recognised by its methods, so torchmetrics need not be installed)."""
    return all(
        callable(getattr(value, m, None)) for m in ("update", "compute", "reset")
    ) and hasattr(value, "_forward_cache")


def _metric_step_value(name: str, metric: Any, on_step: bool) -> torch.Tensor | None:
    """The step value of a Metric logged itself: what its last forward call returned (None when not
    on_step)."""
    if not on_step:
        return None
    cached = metric._forward_cache
    if cached is None:
        raise ConfigError(
            f"self.log({name!r}, <{type(metric).__name__}>, on_step=True) needs the metric's "
            "forward: "
            "call metric(preds, target) in the step (metric.update() keeps no step value), or log "
            "with on_step=False."
        )
    return _as_tensor(name, cached, torch.device("cpu"))


def _as_tensor(name: str, value: Any, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ConfigError(
                f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}: the tensor "
                f"must have a single element (log scalars, e.g. `self.log({name!r}, t.mean())`)."
            )
        return value.detach().reshape(())
    if isinstance(value, (int, float, bool)):
        return torch.tensor(float(value), device=device)
    raise ConfigError(  # Lightning's wording first: code matches on it
        f"`self.log({name}, {value})` was called, but `{type(value).__name__}` values cannot be "
        "logged: log a number or a one-element tensor."
    )


def _all_reduce(tensor: torch.Tensor, fx: str) -> torch.Tensor:
    t = tensor.float().clone()
    op = {
        "mean": dist.ReduceOp.SUM,
        "sum": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
    }[fx]
    dist.all_reduce(t, op=op)
    return t / dist.get_world_size() if fx == "mean" else t
