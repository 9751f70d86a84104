"""The logger protocol every logger honours (metrics at a step, hyper-parameters, an artifact,
`finalize(status)` with "success", "failed" or "interrupted"), and the helpers they share. Rank 0
writes."""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from lightspeed.errors import ConfigError
from lightspeed.utilities.rank_zero import rank_zero_only

STATUSES = ("success", "failed", "interrupted")


@runtime_checkable
class Logger(Protocol):
    log_dir: str | None  # a local folder holding this logger's files, if it keeps any

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def log_hyperparams(self, params: dict[str, Any]) -> None: ...
    def save_artifact(self, path: str | os.PathLike) -> None: ...
    def finalize(self, status: str = "success") -> None: ...


def plain(value: Any) -> Any:
    """`value` made of dicts, lists, str, int, float, bool and None only (what YAML, MLflow and W&B
    all take): paths, dtypes and classes become their names or strings."""
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
    # The Trainer passes one of STATUSES; a user may pass another word (Lightning's tests call
    # finalize("finished")): any string is recorded as it is.
    if not isinstance(status, str):
        raise ConfigError(f"finalize(status={status!r}) is not valid: expected a string.")


def _place_artifact(path: str | os.PathLike, log_dir: str) -> Path:
    """Puts a file into `<log_dir>/artifacts/`: a hard link where the file system allows (no second
    copy of gigabytes of weights), a copy otherwise. Raises ConfigError if `path` is not a file."""
    src = Path(path)
    if not src.is_file():
        raise ConfigError(
            f"save_artifact(path={str(path)!r}) is not valid: expected an existing file."
        )
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


class DummyExperiment:
    """What `logger.experiment` is on ranks other than 0, as in Lightning: every method call does
    nothing, so `self.logger.experiment.add_image(...)` in a step run by every rank writes once."""

    def nop(self, *args: Any, **kwargs: Any) -> None: ...

    def __getattr__(self, name: str) -> Any:
        return self.nop

    def __getitem__(self, key: Any) -> DummyExperiment:
        return self

    def __setitem__(self, key: Any, value: Any) -> None: ...  # stateless


class DummyLogger:
    """A logger that logs nothing and accepts any call (Lightning's, e.g. for `fast_dev_run`):
    `logger.log_text(...)` of any tracker is a no-op."""

    log_dir = None

    @property
    def experiment(self) -> DummyExperiment:
        return DummyExperiment()

    def log_metrics(self, *args: Any, **kwargs: Any) -> None: ...

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None: ...

    def finalize(self, *args: Any, **kwargs: Any) -> None: ...

    @property
    def name(self) -> str:
        return ""

    @property
    def version(self) -> str:
        return ""

    def __getitem__(self, index: int) -> DummyLogger:
        return self  # `trainer.logger[0]` where a list of loggers was expected

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _on_rank_zero(make: Any) -> Any:
    """`make()` (the logger's experiment object) on global rank 0, DummyExperiment elsewhere."""
    return make() if rank_zero_only.rank == 0 else DummyExperiment()


def _next_version(root: Path) -> int:
    existing = [
        int(p.name.split("_", 1)[1])
        for p in root.glob("version_*")
        if p.name.split("_", 1)[1].isdigit()
    ]
    return max(existing, default=-1) + 1


def _require(module: str, pip_name: str, logger: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(
            f"{logger} needs the `{module}` package, which is not installed: "
            f"pip install {pip_name}  (or pip install 'lightspeed[trackers]')."
        )
