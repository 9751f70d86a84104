"""Preemption: a SIGTERM/SIGUSR1 (what SLURM and Kubernetes send before they stop a job) ends the
run cleanly.

    Trainer(preemption_signals=("SIGTERM", "SIGUSR1"))   # the default; () leaves the signals alone

The handler only notes the signal. At each step boundary the loop asks `requested()`, one all_reduce
(MAX) of the noted signal numbers, so the signal may reach one rank or all: every rank sees it at
the same step (under NCCL one step later, so the host never waits for the GPU there), finishes that
step, and the job writes a checkpoint (collective, through `trainer.save_checkpoint`, which moves
`last`), says why, requeues itself under SLURM (`scontrol requeue $SLURM_JOB_ID`, when both exist;
not with `Trainer(requeue=False)` or `plugins=[SLURMEnvironment(auto_requeue=False)]`) and exits
with 128 + the signal number (143 for SIGTERM), the status schedulers read as "terminated by the
signal". The next `fit(ckpt_path="last")` continues with the losses of an uninterrupted run.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import AgreedMax


def check_signals(value: Any) -> tuple[str, ...]:
    """The signal names as a tuple; ConfigError for anything that is not a list of known signal
    names."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ConfigError(
            f"preemption_signals={value!r} is not valid: expected a list of signal names such as "
            "('SIGTERM', 'SIGUSR1'), or () for none."
        )
    for name in value:
        if (
            not isinstance(name, str)
            or not hasattr(signal, name)
            or not name.startswith("SIG")
            or name in ("SIGKILL", "SIGSTOP")
            or "_" in name
        ):
            raise ConfigError(
                f"preemption_signals contains {name!r}, which is not valid: use catchable signal "
                "names such as 'SIGTERM', 'SIGUSR1', 'SIGUSR2', 'SIGINT'."
            )
    return tuple(value)


class Preemption:
    """Notes preemption signals in this process and turns them into one collective decision per
    step."""

    def __init__(self, signals: tuple[str, ...], requeue: bool = True):
        self.signals = [getattr(signal, name) for name in signals]
        self.requeue = requeue  # False: SLURMEnvironment(auto_requeue=False)
        self.received = 0
        self._previous: dict[int, Any] = {}
        self._agreed = AgreedMax()

    def install(self) -> None:
        """Replaces the handlers of the configured signals (main thread only; elsewhere it does
        nothing)."""
        self._agreed.reset()  # a reduction left from an earlier fit is not this fit's
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._note)

    def uninstall(self) -> None:
        """Puts the previous handlers back."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _note(self, signum: int, frame: Any) -> None:
        self.received = signum

    def requested(self) -> int:
        """Collective: the signal number any rank received (0 for none). Every rank gets the same
        answer, at the same step; under NCCL one step after the signal, without the host waiting for
        the GPU (distributed.AgreedMax)."""
        return self._agreed(self.received) if self.signals else 0

    def stop(self, signum: int, trainer: Any) -> None:
        """Collective: saves `<checkpoint_dir>/preempted-step=N.ckpt` through
        `trainer.save_checkpoint` (which points `last.ckpt` at it), says why, requeues under SLURM
        (rank 0) and exits the process with 128 + signum. A rank that lightspeed itself spawned
        exits 0, so rank 0, which waits for it, is the one that reports."""
        name = signal.Signals(signum).name
        path = trainer.save_checkpoint(
            Path(trainer.checkpoint_dir) / f"preempted-step={trainer.global_step}.ckpt"
        )
        trainer.print0(
            f"[lightspeed] received {name}: saved {path} after step {trainer.global_step}; resume "
            "with fit(..., ckpt_path='last'). Exiting with status "
            f"{128 + signum}."
        )
        job = os.environ.get("SLURM_JOB_ID")
        if self.requeue and trainer.global_rank == 0 and job and shutil.which("scontrol"):
            done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            trainer.print0(
                f"[lightspeed] scontrol requeue {job}: "
                + ("done." if done.returncode == 0 else f"failed ({done.stderr.strip()}).")
            )
        self.uninstall()
        spawned_child = (
            trainer.dist is not None
            and trainer.dist.launcher == "lightspeed"
            and trainer.global_rank
        )
        sys.exit(0 if spawned_child else 128 + signum)
