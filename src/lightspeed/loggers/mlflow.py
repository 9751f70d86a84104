"""MLflowLogger (and Lightning's spelling MLFlowLogger): imported on first use; without mlflow
installed, constructing it raises ConfigError with the pip line."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lightspeed.errors import ConfigError
from lightspeed.loggers.logger import _check_status, _on_rank_zero, _require, flatten, plain


class MLflowLogger:
    """Logs to an MLflow tracking store: params (nested keys joined with `/`), per-step metrics,
    artifacts, and the run's status (FINISHED, FAILED or KILLED).

    Args:
        experiment_name: created in the store if missing.
        run_name: the run's display name (MLflow picks one if None).
        tracking_uri: e.g. "sqlite:///mlflow.db" or "http://host:5000"; None uses MLflow's default
            (MLFLOW_TRACKING_URI).
        tags: run tags.
        artifact_location: where a newly created experiment stores artifacts (MLflow's default
        otherwise:
            `./mlartifacts` beside a database store).
    Raises:
        ConfigError: mlflow is not installed.

    The run is created on first use, so only rank 0 (the one that logs) creates it."""

    _STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}

    def __init__(
        self,
        experiment_name: str = "lightspeed",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, str] | None = None,
        artifact_location: str | os.PathLike | None = None,
    ):
        _require("mlflow", "mlflow-skinny", "MLflowLogger")
        self.artifact_location = str(artifact_location) if artifact_location is not None else None
        self.experiment_name, self.run_name, self.tracking_uri = (
            experiment_name,
            run_name,
            tracking_uri,
        )
        self.tags = dict(tags or {})
        self.log_dir = None
        self._client = None
        self._run_id: str | None = None

    @property
    def experiment(self) -> Any:
        """The MlflowClient on rank 0 (as Lightning's MLFlowLogger gives), DummyExperiment
        elsewhere."""
        return _on_rank_zero(lambda: self.client)

    @property
    def client(self):
        if self._client is None:
            from mlflow import MlflowClient

            self._client = MlflowClient(self.tracking_uri)
        return self._client

    @property
    def run_id(self) -> str:
        """The MLflow run's id (the run is created on the first call)."""
        if self._run_id is None:
            exp = self.client.get_experiment_by_name(self.experiment_name)
            exp_id = (
                exp.experiment_id
                if exp is not None
                else self.client.create_experiment(
                    self.experiment_name, artifact_location=self.artifact_location
                )
            )
            self._run_id = self.client.create_run(
                exp_id, run_name=self.run_name, tags=self.tags
            ).info.run_id
        return self._run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()]
        )

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)) for k, v in flatten(plain(params)).items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def save_artifact(self, path: str | os.PathLike) -> None:
        if not Path(path).is_file():
            raise ConfigError(
                f"save_artifact(path={str(path)!r}) is not valid: expected an existing file."
            )
        self.client.log_artifact(self.run_id, str(path))

    def finalize(self, status: str = "success") -> None:
        _check_status(status)
        if self._run_id is not None or status != "success":
            self.client.set_terminated(self.run_id, status=self._STATUS[status])


MLFlowLogger = MLflowLogger  # Lightning's spelling
