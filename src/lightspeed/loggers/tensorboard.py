"""TensorBoardLogger: event files under `<save_dir>/<name>/version_N[/<sub_dir>]`, as Lightning's.

    logger = TensorBoardLogger("logs", log_graph=True)      # logs/lightning_logs/version_0/

Scalars go through torch's SummaryWriter; hyper-parameters to TensorBoard's HParams tab (with
`hp_metric`, -1 until the user logs it, unless `default_hp_metric=False`) and to `hparams.yaml`;
artifacts to `<log_dir>/artifacts/`.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch

from lightspeed.loggers.logger import (
    _check_status,
    _next_version,
    _on_rank_zero,
    _place_artifact,
    flatten,
    plain,
)
from lightspeed.utilities.imports import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE
from lightspeed.utilities.rank_zero import rank_zero_warn


class TensorBoardLogger:
    """Lightning's TensorBoardLogger: `name` None or "" puts the versions straight in `save_dir`
    (`~` and `$VARS` expanded); `version` an int, a string (the folder's name) or None (the next
    free number); `sub_dir` a folder inside the version's; `log_graph` adds the model's graph (from
    `example_input_array`); other keywords go to SummaryWriter."""

    NAME_HPARAMS_FILE = "hparams.yaml"
    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        save_dir: str | os.PathLike = ".",
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        log_graph: bool = False,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | os.PathLike | None = None,
        **kwargs: Any,
    ):
        self._save_dir = os.path.expandvars(os.path.expanduser(os.fspath(save_dir)))
        self._name, self._version = name or "", version
        self._log_graph, self._default_hp_metric = log_graph, default_hp_metric
        self._prefix, self._sub_dir = prefix, None if sub_dir is None else os.fspath(sub_dir)
        self._kwargs = kwargs
        self._experiment: Any = None
        self.hparams: dict[str, Any] = {}

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = _next_version(Path(self.root_dir))
        return self._version

    @version.setter
    def version(self, value: int | str) -> None:  # agree_log_dirs: rank 0's version
        self._version = value

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        return os.path.join(self.save_dir, self.name)

    @property
    def log_dir(self) -> str:
        version = self.version
        folder = version if isinstance(version, str) else f"version_{version}"
        path = os.path.join(self.root_dir, folder)
        if self._sub_dir:
            path = os.path.join(path, os.path.expandvars(os.path.expanduser(self._sub_dir)))
        return path

    @property
    def sub_dir(self) -> str | None:
        return self._sub_dir

    @property
    def experiment(self) -> Any:
        """The SummaryWriter on rank 0 (`self.logger.experiment.add_image(...)`), DummyExperiment
        elsewhere."""
        return _on_rank_zero(self._writer)

    def _writer(self) -> Any:
        if self._experiment is None:
            if _TENSORBOARD_AVAILABLE:
                from torch.utils.tensorboard import SummaryWriter
            elif _TENSORBOARDX_AVAILABLE:
                from tensorboardX import SummaryWriter  # type: ignore[no-redef]
            else:
                raise ModuleNotFoundError(
                    "TensorBoardLogger needs `tensorboard` or `tensorboardX`: "
                    "pip install tensorboard"
                )
            os.makedirs(self.log_dir, exist_ok=True)
            self._experiment = SummaryWriter(log_dir=self.log_dir, **self._kwargs)
        return self._experiment

    @property
    def writer(self) -> Any:
        return self._writer()

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for key, value in metrics.items():
            key = f"{self._prefix}{self.LOGGER_JOIN_CHAR}{key}" if self._prefix else key
            value = value.item() if isinstance(value, torch.Tensor) else value
            if isinstance(value, dict):
                self.experiment.add_scalars(key, value, step)
            else:
                self.experiment.add_scalar(key, value, step)

    def log_hyperparams(self, params: Any = None, metrics: dict[str, Any] | None = None) -> None:
        """Records `params` (a dict or argparse.Namespace) for `hparams.yaml` and TensorBoard's
        HParams tab, with `metrics` (default: `hp_metric` = -1; none with
        `default_hp_metric=False`)."""
        if params is not None and not isinstance(params, dict):
            params = vars(params)
        self.hparams.update(params or {})
        if metrics is None and self._default_hp_metric:
            metrics = {"hp_metric": -1}
        if metrics:
            self.log_metrics(metrics, 0)
        flat = {
            k: v if isinstance(v, (int, float, str, bool)) else str(v)
            for k, v in flatten(plain(self.hparams)).items()
        }
        if _TENSORBOARD_AVAILABLE and metrics:
            from torch.utils.tensorboard.summary import hparams

            exp, ssi, sei = hparams(flat, {k: float(v) for k, v in metrics.items()})
            writer = self.experiment._get_file_writer()
            for summary in (exp, ssi, sei):
                writer.add_summary(summary)

    def log_graph(self, model: torch.nn.Module, input_array: Any = None) -> None:
        """Adds the model's graph, traced with `input_array` (default: `model.example_input_array`);
        a warning when there is no input or it cannot be traced."""
        if not self._log_graph:
            return
        if input_array is None:
            input_array = getattr(model, "example_input_array", None)
        if input_array is None:
            rank_zero_warn(
                "Could not log computational graph to TensorBoard: The `model.example_input_array` "
                "attribute is not set or `input_array` was not given."
            )
        elif not isinstance(input_array, (torch.Tensor, tuple)):
            rank_zero_warn(
                "Could not log computational graph to TensorBoard: The `input_array` or "
                "`model.example_input_array` has type "
                f"{type(input_array).__name__} which can't be traced by TensorBoard. Make the "
                "input array a tuple representing the positional arguments to the model's "
                "`forward()` implementation."
            )
        else:
            # a lightspeed Module outside a run: its `trainer` reads None while the tracer looks
            traced = getattr(model, "_traced", None)
            quiet: Any = traced() if callable(traced) else contextlib.nullcontext()
            with quiet:
                self.experiment.add_graph(model, input_array)

    def save(self) -> None:
        """Writes `hparams.yaml` into the run's folder (once the folder exists and has none)."""
        import yaml

        path = Path(self.log_dir) / self.NAME_HPARAMS_FILE
        if self._experiment is not None and Path(self.log_dir).is_dir() and not path.exists():
            path.write_text(yaml.safe_dump(plain(self.hparams), sort_keys=False))

    def save_artifact(self, path: str | os.PathLike) -> None:
        _place_artifact(path, self.log_dir)

    def finalize(self, status: str = "success") -> None:
        _check_status(status)
        if self._experiment is not None:
            self._experiment.add_text("status", status)  # how the run ended, beside its scalars
            self._experiment.flush()
            self._experiment.close()
        self.save()

    def __getstate__(self) -> dict:
        return {**vars(self), "_experiment": None}  # the writer holds open files


__all__ = ["TensorBoardLogger", "_TENSORBOARD_AVAILABLE", "_TENSORBOARDX_AVAILABLE"]
