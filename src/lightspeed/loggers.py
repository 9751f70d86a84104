"""Loggers: CSV (`<root>/<name>/version_N/metrics.csv` + `hparams.yaml`), TensorBoard, MLflow and W&B. Rank 0 writes.

Every logger honours the same small protocol: metrics at a step, hyper-parameters, an artifact (a file such as
the consolidated weights), and `finalize(status)` with "success", "failed" or "interrupted". MLflow and W&B are
imported on first use; without them installed, constructing their logger raises ConfigError with the pip line.
"""

from __future__ import annotations

import csv
import importlib.util
import os
import shutil
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .distributed import broadcast_from_rank0
from .utilities.rank_zero import rank_zero_only
from .errors import ConfigError

STATUSES = ("success", "failed", "interrupted")


@runtime_checkable
class Logger(Protocol):
    log_dir: str | None  # a local folder holding this logger's files, if it keeps any

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_hyperparams(self, params: dict[str, Any]) -> None: ...
    def save_artifact(self, path: str | os.PathLike) -> None: ...
    def finalize(self, status: str = "success") -> None: ...


def plain(value: Any) -> Any:
    """`value` made of dicts, lists, str, int, float, bool and None only (what YAML, MLflow and W&B all take):
    paths, dtypes and classes become their names or strings."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, type):
        return value.__name__
    return str(value)


def flatten(params: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level with `/`-joined keys: {"a": {"b": 1}} -> {"a/b": 1}."""
    out: dict[str, Any] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{key}/"))
        else:
            out[key] = v
    return out


def _check_status(status: str) -> None:
    if status not in STATUSES:
        raise ConfigError(f"finalize(status={status!r}) is not valid: use one of {', '.join(STATUSES)}.")


def _place_artifact(path: str | os.PathLike, log_dir: str) -> Path:
    """Puts a file into `<log_dir>/artifacts/`: a hard link where the file system allows (no second copy of
    gigabytes of weights), a copy otherwise. Raises ConfigError if `path` is not a file."""
    src = Path(path)
    if not src.is_file():
        raise ConfigError(f"save_artifact(path={str(path)!r}) is not valid: expected an existing file.")
    dest = Path(log_dir) / "artifacts" / src.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".tmp-{src.name}")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dest)
    return dest


class NoExperiment:
    """What `logger.experiment` is on ranks other than 0, as in Lightning: every method call does nothing, so
    `self.logger.experiment.add_image(...)` in a step run by every rank writes once."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self

    def __getitem__(self, key: Any) -> NoExperiment:
        return self


def _on_rank_zero(make: Any) -> Any:
    """`make()` (the logger's experiment object) on global rank 0, NoExperiment elsewhere."""
    return make() if rank_zero_only.rank == 0 else NoExperiment()


def _next_version(root: Path) -> int:
    existing = [int(p.name.split("_", 1)[1]) for p in root.glob("version_*") if p.name.split("_", 1)[1].isdigit()]
    return max(existing, default=-1) + 1


class CSVLogger:
    """Appends one row per logging step to `metrics.csv`; columns grow as new metrics appear.

    Hyper-parameters go to `hparams.yaml`, artifacts to `artifacts/`, and `finalize` writes `status.yaml`
    (the status and the UTC time it ended)."""

    def __init__(self, save_dir: str | os.PathLike = ".", name: str = "lightspeed_logs", version: int | None = None):
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
        """This logger itself on rank 0 (it has `log_metrics` and `log_hyperparams`), NoExperiment elsewhere."""
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
        (Path(self.log_dir) / "status.yaml").write_text(yaml.safe_dump({"status": status, "ended_at": ended}))


class TensorBoardLogger:
    """Writes scalars with tensorboard's SummaryWriter (via torch.utils.tensorboard); hyper-parameters and the
    final status as text; artifacts are placed in `<log_dir>/artifacts/`."""

    def __init__(self, save_dir: str | os.PathLike = ".", name: str = "lightspeed_logs", version: int | None = None):
        root = Path(save_dir) / name
        self.save_dir, self.name = str(save_dir), name
        self.version = _next_version(root) if version is None else version
        self.log_dir = str(root / f"version_{self.version}")
        self._writer = None

    @property
    def experiment(self) -> Any:
        """The SummaryWriter on rank 0 (`self.logger.experiment.add_image(...)`), NoExperiment elsewhere."""
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

        # Indented four spaces: TensorBoard renders text as Markdown, and this keeps the YAML a code block.
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


def _require(module: str, pip_name: str, logger: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{logger} needs the `{module}` package, which is not installed: "
                          f"pip install {pip_name}  (or pip install 'lightspeed[trackers]').")


class MLflowLogger:
    """Logs to an MLflow tracking store: params (nested keys joined with `/`), per-step metrics, artifacts, and
    the run's status (FINISHED, FAILED or KILLED).

    Args:
        experiment_name: created in the store if missing.
        run_name: the run's display name (MLflow picks one if None).
        tracking_uri: e.g. "sqlite:///mlflow.db" or "http://host:5000"; None uses MLflow's default
            (MLFLOW_TRACKING_URI).
        tags: run tags.
        artifact_location: where a newly created experiment stores artifacts (MLflow's default otherwise:
            `./mlartifacts` beside a database store).
    Raises:
        ConfigError: mlflow is not installed.

    The run is created on first use, so only rank 0 (the one that logs) creates it."""

    _STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}

    def __init__(self, experiment_name: str = "lightspeed", run_name: str | None = None,
                 tracking_uri: str | None = None, tags: dict[str, str] | None = None,
                 artifact_location: str | os.PathLike | None = None):
        _require("mlflow", "mlflow-skinny", "MLflowLogger")
        self.artifact_location = str(artifact_location) if artifact_location is not None else None
        self.experiment_name, self.run_name, self.tracking_uri = experiment_name, run_name, tracking_uri
        self.tags = dict(tags or {})
        self.log_dir = None
        self._client = None
        self._run_id: str | None = None

    @property
    def experiment(self) -> Any:
        """The MlflowClient on rank 0 (as Lightning's MLFlowLogger gives), NoExperiment elsewhere."""
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
            exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                self.experiment_name, artifact_location=self.artifact_location)
            self._run_id = self.client.create_run(exp_id, run_name=self.run_name, tags=self.tags).info.run_id
        return self._run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)) for k, v in flatten(plain(params)).items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def save_artifact(self, path: str | os.PathLike) -> None:
        if not Path(path).is_file():
            raise ConfigError(f"save_artifact(path={str(path)!r}) is not valid: expected an existing file.")
        self.client.log_artifact(self.run_id, str(path))

    def finalize(self, status: str = "success") -> None:
        _check_status(status)
        if self._run_id is not None or status != "success":
            self.client.set_terminated(self.run_id, status=self._STATUS[status])


class WandbLogger:
    """Logs to Weights & Biases: config, per-step history, artifacts (as a "model" artifact), exit status.

    Args:
        project: the W&B project. name: the run's name.
        save_dir: where W&B writes its local run files (`<save_dir>/wandb/...`).
        mode: "online", "offline" or "disabled"; None follows W&B's own setting (WANDB_MODE).
        **init_kwargs: passed to `wandb.init` (entity, tags, group, ...).
    Raises:
        ConfigError: wandb is not installed.

    The run starts on first use, so only rank 0 (the one that logs) starts it."""

    def __init__(self, project: str = "lightspeed", name: str | None = None, save_dir: str | os.PathLike = ".",
                 mode: str | None = None, **init_kwargs: Any):
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
            self._run = wandb.init(project=self.project, name=self.name, dir=self.save_dir, mode=self.mode,
                                   **self.init_kwargs)
        return self._run

    @property
    def log_dir(self) -> str | None:
        return self._run.dir if self._run is not None else None

    @property
    def experiment(self) -> Any:
        """The wandb Run on rank 0 (`self.logger.experiment.log({...})`), NoExperiment elsewhere."""
        return _on_rank_zero(lambda: self.run)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(dict(metrics), step=step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.run.config.update(plain(params), allow_val_change=True)

    def save_artifact(self, path: str | os.PathLike) -> None:
        import wandb

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"save_artifact(path={str(path)!r}) is not valid: expected an existing file.")
        artifact = wandb.Artifact(f"{self.run.id}-{path.stem}".replace("=", "-"), type="model")
        artifact.add_file(str(path))
        self.run.log_artifact(artifact)

    def finalize(self, status: str = "success") -> None:
        _check_status(status)
        if self._run is not None:
            self._run.finish(exit_code={"success": 0, "failed": 1, "interrupted": 130}[status])
            self._run = None


MLFlowLogger = MLflowLogger  # Lightning's spelling


def agree_log_dirs(loggers: list) -> None:
    """Collective, once at launch: each rank's loggers take rank 0's version and folder. Every rank builds its
    own loggers, and a rank that starts after rank 0 has made `version_N` would otherwise count `version_N+1`;
    `trainer.log_dir` must name the same folder on every rank. Only rank 0's loggers write."""
    found = [(getattr(lg, "version", None), getattr(lg, "log_dir", None)) for lg in loggers]
    agreed = broadcast_from_rank0(found)
    if len(agreed) != len(found):
        return  # different loggers per rank: the user's choice, left as it is
    for lg, values in zip(loggers, agreed):
        for name, value in zip(("version", "log_dir"), values):
            if value is not None and name in vars(lg):  # plain attributes only (W&B derives its folder)
                setattr(lg, name, value)


def build_loggers(logger: Any, root: str) -> list:
    """The loggers of `Trainer(logger=...)`: True gives a TensorBoardLogger and a CSVLogger (same version) under
    `root`, False/None none, a logger or a list of them themselves."""
    if logger is True:  # TensorBoard first: Lightning's default logger, so `self.logger.experiment` is a writer
        tb_logger = TensorBoardLogger(root)
        return [tb_logger, CSVLogger(root, version=tb_logger.version)]
    if not logger:
        return []
    return list(logger) if isinstance(logger, (list, tuple)) else [logger]
