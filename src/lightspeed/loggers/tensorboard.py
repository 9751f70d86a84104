"""TensorBoardLogger: event files under `<root>/<name>/version_N/`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightspeed.loggers.logger import (
    _check_status,
    _next_version,
    _on_rank_zero,
    _place_artifact,
    plain,
)
from lightspeed.utilities.imports import _TENSORBOARD_AVAILABLE, _TENSORBOARDX_AVAILABLE


class TensorBoardLogger:
    """Writes scalars with tensorboard's SummaryWriter (via torch.utils.tensorboard);
    hyper-parameters and the final status as text; artifacts are placed in
    `<log_dir>/artifacts/`."""

    NAME_HPARAMS_FILE = "hparams.yaml"

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
        self._writer = None

    @property
    def experiment(self) -> Any:
        """The SummaryWriter on rank 0 (`self.logger.experiment.add_image(...)`), DummyExperiment
        elsewhere."""
        return _on_rank_zero(lambda: self.writer)

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
        import yaml

        # Indented four spaces: TensorBoard renders text as Markdown, and this keeps the YAML a code
        # block.
        text = yaml.safe_dump(plain(params), sort_keys=False)
        self.writer.add_text("hparams", "\n".join(f"    {line}" for line in text.splitlines()))

    def save_artifact(self, path: str | os.PathLike) -> None:
        _place_artifact(path, self.log_dir)

    def finalize(self, status: str = "success") -> None:
        _check_status(status)
        if self._writer is not None or status != "success":
            self.writer.add_text("status", status)
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


__all__ = ["TensorBoardLogger", "_TENSORBOARD_AVAILABLE", "_TENSORBOARDX_AVAILABLE"]
