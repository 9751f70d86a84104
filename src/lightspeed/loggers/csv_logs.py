"""CSVLogger: `<root>/<name>/version_N/metrics.csv` and `hparams.yaml`."""

from __future__ import annotations

import csv
import os
import time
from pathlib import Path
from typing import Any

from lightspeed.loggers.logger import (
    _check_status,
    _next_version,
    _on_rank_zero,
    _place_artifact,
    plain,
)


class CSVLogger:
    """Appends one row per logging step to `metrics.csv`; columns grow as new metrics appear.

    Hyper-parameters go to `hparams.yaml`, artifacts to `artifacts/`, and `finalize` writes
    `status.yaml` (the status and the UTC time it ended)."""

    NAME_HPARAMS_FILE = "hparams.yaml"
    NAME_METRICS_FILE = "metrics.csv"

    def __init__(
        self,
        save_dir: str | os.PathLike = ".",
        name: str = "lightspeed_logs",
        version: int | None = None,
    ):
        root = Path(save_dir) / name
        self.save_dir, self.name = str(save_dir), name
        self.version = _next_version(root) if version is None else version
        self.log_dir = str(root / f"version_{self.version}")
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = ["step"]
        self._hparams: dict[str, Any] = {}

    @property
    def path(self) -> Path:
        return Path(self.log_dir) / "metrics.csv"

    @property
    def experiment(self) -> Any:
        """This logger itself on rank 0 (it has `log_metrics` and `log_hyperparams`),
        DummyExperiment elsewhere."""
        return _on_rank_zero(lambda: self)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, **metrics}
        new = [k for k in row if k not in self._columns]
        self._columns += new
        self._rows.append(row)
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        if new or len(self._rows) == 1:
            self._rewrite()  # a new column: rewrite the file with the wider header
        else:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, self._columns).writerow(row)

    def _rewrite(self) -> None:
        with self.path.open("w", newline="") as f:
            writer = csv.DictWriter(f, self._columns)
            writer.writeheader()
            writer.writerows(self._rows)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Merges `params` into `hparams.yaml` (a later call adds keys or replaces them)."""
        import yaml

        self._hparams.update(plain(params))
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        with (Path(self.log_dir) / "hparams.yaml").open("w") as f:
            yaml.safe_dump(self._hparams, f, sort_keys=False)

    def save_artifact(self, path: str | os.PathLike) -> None:
        _place_artifact(path, self.log_dir)

    def finalize(self, status: str = "success") -> None:
        import yaml

        _check_status(status)
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        ended = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (Path(self.log_dir) / "status.yaml").write_text(
            yaml.safe_dump({"status": status, "ended_at": ended})
        )
