"""CSVLogger: `<save_dir>/<name>/version_N/metrics.csv` and `hparams.yaml`, as Lightning's.

    logger = CSVLogger("logs")                 # logs/lightning_logs/version_0/metrics.csv

Rows are kept in memory and written every `flush_logs_every_n_steps` steps and when the run ends
(`save()`, `finalize()`); a column that appears later rewrites the file with the wider header.
"""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path
from typing import Any

import torch

from lightspeed.loggers.logger import (
    _check_status,
    _next_version,
    _on_rank_zero,
    _place_artifact,
    plain,
)
from lightspeed.utilities.rank_zero import rank_zero_warn


class ExperimentWriter:
    """Keeps the rows of `metrics.csv` in `log_dir` and writes them on `save()`; a folder that
    already holds a metrics file is warned of, and that file replaced."""

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.metrics: list[dict[str, Any]] = []
        self.metrics_keys: list[str] = []
        self.hparams: dict[str, Any] = {}
        self.metrics_file_path = os.path.join(log_dir, self.NAME_METRICS_FILE)
        self._check_log_dir_exists()
        os.makedirs(log_dir, exist_ok=True)

    def _check_log_dir_exists(self) -> None:
        # Only a metrics file is replaced: the run's other loggers (TensorBoard's events, the run's
        # settings) write into the same folder, which is no reason to warn.
        if os.path.isfile(self.metrics_file_path):
            rank_zero_warn(
                f"Experiment logs directory {self.log_dir} exists and is not empty. Previous log "
                "files in this directory will be deleted when the new ones are saved!"
            )
            if os.path.isfile(self.metrics_file_path):
                os.remove(self.metrics_file_path)

    def log_metrics(self, metrics_dict: dict[str, Any], step: int | None = None) -> None:
        """Records one row (tensors become numbers); `step` defaults to the row's index."""
        row = {k: v.item() if isinstance(v, torch.Tensor) else v for k, v in metrics_dict.items()}
        row["step"] = len(self.metrics) if step is None else step
        self.metrics.append(row)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """Merges `params` into `hparams.yaml` (a later call adds keys or replaces them)."""
        import yaml

        self.hparams.update(plain(params))
        with open(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), "w") as f:
            yaml.safe_dump(self.hparams, f, sort_keys=False)

    def save(self) -> None:
        """Appends the recorded rows to the file (rewritten when new columns appeared)."""
        if not self.metrics:
            return
        new = sorted({k for row in self.metrics for k in row} - set(self.metrics_keys))
        self.metrics_keys = sorted(self.metrics_keys + new)
        exists = os.path.isfile(self.metrics_file_path)
        if new and exists:
            with open(self.metrics_file_path, newline="") as f:
                old = list(csv.DictReader(f))
            with open(self.metrics_file_path, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
                writer.writeheader()
                writer.writerows(old)
        with open(self.metrics_file_path, "a" if exists else "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.metrics_keys)
            if not exists:
                writer.writeheader()
            writer.writerows(self.metrics)
        self.metrics = []


class CSVLogger:
    """Lightning's CSVLogger: `name` None or "" puts the versions straight in `save_dir`; `version`
    an int (folder `version_<n>`), a string (the folder's name) or None (the next free number).

    Hyper-parameters go to `hparams.yaml`, artifacts to `artifacts/`, and `finalize` writes
    `status.yaml` (the status and the UTC time it ended)."""

    LOGGER_JOIN_CHAR = "-"
    NAME_HPARAMS_FILE = "hparams.yaml"
    NAME_METRICS_FILE = "metrics.csv"

    def __init__(
        self,
        save_dir: str | os.PathLike = ".",
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ):
        self._save_dir, self._name = os.fspath(save_dir), name or ""
        self._version = _next_version(Path(self.root_dir)) if version is None else version
        self._prefix, self._flush_every = prefix, flush_logs_every_n_steps
        self._experiment: ExperimentWriter | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def version(self) -> int | str:
        return self._version

    @version.setter
    def version(self, value: int | str) -> None:  # agree_log_dirs: rank 0's version
        self._version = value

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        return os.path.join(self._save_dir, self._name)

    @property
    def log_dir(self) -> str:
        folder = self._version if isinstance(self._version, str) else f"version_{self._version}"
        return os.path.join(self.root_dir, folder)

    @property
    def path(self) -> Path:
        return Path(self.log_dir) / self.NAME_METRICS_FILE

    @property
    def experiment(self) -> Any:
        """The ExperimentWriter on rank 0 (it has `log_metrics`, `log_hparams`, `save`),
        DummyExperiment elsewhere."""
        return _on_rank_zero(self._writer)

    def _writer(self) -> ExperimentWriter:
        if self._experiment is None:
            self._experiment = ExperimentWriter(self.log_dir)
        return self._experiment

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        if self._prefix:
            metrics = {f"{self._prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        if step is None:  # the row's index, as Lightning's
            rows = getattr(self.experiment, "metrics", None)
            step = len(rows) if isinstance(rows, list) else 0
        self.experiment.log_metrics(metrics, step)
        if (step + 1) % self._flush_every == 0:
            self.save()

    def log_hyperparams(self, params: Any = None) -> None:
        """Merges `params` (a dict or argparse.Namespace) into `hparams.yaml`."""
        if params is not None and not isinstance(params, dict):
            params = vars(params)
        self.experiment.log_hparams(dict(params or {}))

    def save(self) -> None:
        self.experiment.save()

    def save_artifact(self, path: str | os.PathLike) -> None:
        _place_artifact(path, self.log_dir)

    def finalize(self, status: str = "success") -> None:
        import yaml

        _check_status(status)
        if self._experiment is None:
            return  # nothing was logged: no folder is made (as Lightning)
        self.save()
        ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (Path(self.log_dir) / "status.yaml").write_text(
            yaml.safe_dump({"status": status, "ended_at": ended})
        )
