"""Loggers: CSV (`<root>/<name>/version_N/metrics.csv`) and TensorBoard event files. Rank 0 writes."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Logger(Protocol):
    log_dir: str

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_hyperparams(self, params: dict[str, Any]) -> None: ...
    def finalize(self, status: str) -> None: ...


def _next_version(root: Path) -> int:
    existing = [int(p.name.split("_", 1)[1]) for p in root.glob("version_*") if p.name.split("_", 1)[1].isdigit()]
    return max(existing, default=-1) + 1


class CSVLogger:
    """Appends one row per logging step to `metrics.csv`; columns grow as new metrics appear."""

    def __init__(self, save_dir: str | os.PathLike = ".", name: str = "lightspeed_logs", version: int | None = None):
        root = Path(save_dir) / name
        self.version = _next_version(root) if version is None else version
        self.log_dir = str(root / f"version_{self.version}")
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = ["step"]

    @property
    def path(self) -> Path:
        return Path(self.log_dir) / "metrics.csv"

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
        Path(self.log_dir).mkdir(parents=True, exist_ok=True)
        with (Path(self.log_dir) / "hparams.yaml").open("w") as f:
            for k, v in params.items():
                f.write(f"{k}: {v!r}\n")

    def finalize(self, status: str = "success") -> None:
        pass


class TensorBoardLogger:
    """Writes scalars with tensorboard's SummaryWriter (via torch.utils.tensorboard)."""

    def __init__(self, save_dir: str | os.PathLike = ".", name: str = "lightspeed_logs", version: int | None = None):
        root = Path(save_dir) / name
        self.version = _next_version(root) if version is None else version
        self.log_dir = str(root / f"version_{self.version}")
        self._writer = None

    @property
    def writer(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=self.log_dir)
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, global_step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.writer.add_text("hparams", "\n".join(f"{k}: {v!r}" for k, v in params.items()))

    def finalize(self, status: str = "success") -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None
