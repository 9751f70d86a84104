"""The line `fit` ends with on rank 0: why training stopped, where its last checkpoint and the run
report are.

    fit stopped after 24 optimizer steps: max_epochs=3 reached. Last checkpoint:
    checkpoints/epoch=2-step=24.ckpt; run report: lightning_logs/version_0/report.html

The loop gathers the facts (loop.finish, once the bar has stopped and the loggers are finalised:
the last line a successful fit prints); this module only words them.
"""

from __future__ import annotations

import os
from pathlib import Path


def stop_reason(
    step: int,
    epoch: int,
    max_steps: int,
    max_epochs: int | None,
    epochs_limit: int,
    stopped_by: str | None,
) -> str:
    """Why the epochs loop ended: max_steps first (it ends fit whatever else holds), then a stop
    a callback or the Module asked for (`stopped_by`, already worded: "EarlyStopping on 'val_loss'
    at epoch 4", "the time limit max_time=...", "trainer.should_stop was set"), then the epochs."""
    if max_steps != -1 and step >= max_steps:
        return f"max_steps={max_steps} reached"
    if stopped_by:
        return f"stopped by {stopped_by}"
    if max_epochs is not None and max_epochs != -1 and epoch >= max_epochs:
        return f"max_epochs={max_epochs} reached"
    if epochs_limit == 1000 and epoch >= epochs_limit:
        return "1000 epochs reached (the limit when no max_epochs, max_steps or max_time is given)"
    return "the training loop ended"


def closing_line(reason: str, steps: int, checkpoint: str | None, report: str | None) -> str:
    """The closing line: `reason` (stop_reason's), the optimizer steps taken, the last checkpoint
    written (None: none was) and the run report (None: none was written); paths under the working
    directory are shown relative to it."""
    where = [
        f"last checkpoint: {_shown(checkpoint)}" if checkpoint else "no checkpoint written",
        *([f"run report: {_shown(report)}"] if report else []),
    ]
    said = "; ".join(where)  # no full stop after a path: it would be copied with it
    return f"fit stopped after {steps} optimizer steps: {reason}. {said[0].upper()}{said[1:]}"


def _shown(path: str) -> str:
    try:
        relative = os.path.relpath(Path(path).resolve(), Path.cwd())
    except ValueError:  # another drive (Windows)
        return str(path)
    return str(path) if relative.startswith("..") else relative
