"""Helpers that loggers share: which checkpoints a tracker has not uploaded yet."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _scan_checkpoints(checkpoint_callback: Any, logged_model_time: dict) -> list[tuple]:
    """(modified time, path, score, tag) of each checkpoint the ModelCheckpoint knows ("latest",
    "best", "best_k"), oldest first, leaving out those logged since they were last written
    (`logged_model_time`: path -> the time it was logged). A checkpoint is a file or a folder."""
    found: dict[str, tuple[Any, str]] = {}
    if getattr(checkpoint_callback, "last_model_path", None):
        found[checkpoint_callback.last_model_path] = (
            getattr(checkpoint_callback, "current_score", None),
            "latest",
        )
    if getattr(checkpoint_callback, "best_model_path", None):
        found[checkpoint_callback.best_model_path] = (
            getattr(checkpoint_callback, "best_model_score", None),
            "best",
        )
    for path, score in getattr(checkpoint_callback, "best_k_models", {}).items():
        found[path] = (score, "best_k")
    scanned = sorted(
        (Path(p).stat().st_mtime, p, score, tag)
        for p, (score, tag) in found.items()
        if p and Path(p).exists()
    )
    return [c for c in scanned if c[1] not in logged_model_time or logged_model_time[c[1]] < c[0]]
