"""WandbLogger: imported on first use; without wandb installed, constructing it raises ConfigError
with the pip line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

from lightspeed.errors import ConfigError
from lightspeed.loggers.logger import _check_status, _on_rank_zero, _require, plain


class WandbLogger:
    """Logs to Weights & Biases: config, per-step history, artifacts (as a "model" artifact), exit
    status.

    Args:
        project: the W&B project. name: the run's name.
        save_dir: where W&B writes its local run files (`<save_dir>/wandb/...`).
        mode: "online", "offline" or "disabled"; None follows W&B's own setting (WANDB_MODE).
        **init_kwargs: passed to `wandb.init` (entity, tags, group, ...).
    Raises:
        ConfigError: wandb is not installed.

    The run starts on first use, so only rank 0 (the one that logs) starts it."""

    def __init__(
        self,
        project: str = "lightspeed",
        name: str | None = None,
        save_dir: str | os.PathLike = ".",
        mode: str | None = None,
        **init_kwargs: Any,
    ):
        _require("wandb", "wandb", "WandbLogger")
        self.project, self.name, self.save_dir, self.mode = project, name, str(save_dir), mode
        self.init_kwargs = init_kwargs
        self._run = None

    @property
    def run(self):
        """The wandb Run (started on the first call)."""
        if self._run is None:
            import wandb

            Path(self.save_dir).mkdir(parents=True, exist_ok=True)
            self._run = wandb.init(
                project=self.project,
                name=self.name,
                dir=self.save_dir,
                mode=cast(Any, self.mode),  # a str; wandb checks it against its Literal
                **self.init_kwargs,
            )
        return self._run

    @property
    def log_dir(self) -> str | None:
        return self._run.dir if self._run is not None else None

    @property
    def experiment(self) -> Any:
        """The wandb Run on rank 0 (`self.logger.experiment.log({...})`), DummyExperiment
        elsewhere."""
        return _on_rank_zero(lambda: self.run)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.run.config.update(plain(params), allow_val_change=True)

    def save_artifact(self, path: str | os.PathLike) -> None:
        import wandb

        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"save_artifact(path={str(path)!r}) is not valid: expected an existing file."
            )
        artifact = wandb.Artifact(f"{self.run.id}-{path.stem}".replace("=", "-"), type="model")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finalize(self, status: str = "success") -> None:
        _check_status(status)
        if self._run is not None:
            self._run.finish(exit_code={"success": 0, "failed": 1, "interrupted": 130}[status])
            self._run = None
