"""What DeepSpeed prints that a user cannot act on, kept out of a run's output. Everything else it
says, and every warning of the user's own code, stays.

- "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
  (each rank, at import): lightspeed chose the device itself and its summary shows it.
- "OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated." (fp32 and bf16:
  no step, no rank): the non-finite guard reports the same event with its step and the policy
  applied (runtime/guard.py). The fp16 loss scaler's overflow lines are worded otherwise and stay.
- "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" (a print, each rank, at
  `deepspeed.init_distributed`).
- torch's FutureWarnings "`torch.distributed.all_gather_into_tensor` is deprecated" and
  "`reduce_scatter_tensor` is deprecated", raised on DeepSpeed's ZeRO collectives (dozens a run).
  torch attributes them to its own wrapper (torch/distributed/c10d_logger.py) whoever calls, so a
  warnings filter (by message or `module=`) cannot tell DeepSpeed's calls from the user's own.
  Instead DeepSpeed's communication backend is given torch's current names for the same two
  collectives (`all_gather_single`, `reduce_scatter_single`: the old names only warn and call
  them), so nothing is raised, and a user's own call of the old names still warns.

`import_deepspeed` is the package's one import of DeepSpeed: the logger quieted first, and
DeepSpeed's own import of mlflow (0.7 s a rank) skipped.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from collections.abc import Iterator

import torch.distributed as dist

from lightspeed.errors import ConfigError

_DROPPED = (
    "Setting accelerator to CPU. If you have GPU or other accelerator",
    "OVERFLOW! Skipping step. Gradients are non-finite",
)
_BUILT = "built successfully"  # DeepSpeed's print after loading an op it compiled (or found built)


class _Drop(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in _DROPPED)


def quiet_logger() -> None:
    """Drops the lines above from DeepSpeed's logger. Call before DeepSpeed is first imported: its
    import logs the accelerator line (it sets the logger's level and handler then; a filter on the
    named logger stays). Idempotent."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _Drop) for f in logger.filters):
        logger.addFilter(_Drop())


@contextlib.contextmanager
def without_build_notes() -> Iterator[None]:
    """Runs the block with DeepSpeed's "... built successfully" prints held back; anything else it
    printed is printed after it, as it was. (A compilation's own output comes from the compiler's
    process and is not held.)"""
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    finally:
        kept = [line for line in held.getvalue().splitlines() if _BUILT not in line]
        if kept:
            print("\n".join(kept), file=sys.stdout, flush=True)


def use_current_collectives(deepspeed) -> None:
    """Points the communication backend DeepSpeed made in `init_distributed` at torch's current
    all-gather and reduce-scatter (module docstring). A backend or torch without them is left as
    it is."""
    backend = getattr(deepspeed.comm.comm, "cdb", None)
    for attr, name in (
        ("all_gather_function", "all_gather_single"),
        ("reduce_scatter_function", "reduce_scatter_single"),
    ):
        current = getattr(dist, name, None)
        if current is not None and getattr(backend, attr, None) is not None:
            setattr(backend, attr, current)


def import_deepspeed():
    """The `deepspeed` module, imported with its logger quieted (`quiet_logger`).

    Raises:
        ConfigError: DeepSpeed is not importable, with the command that installs it.
    """
    quiet_logger()  # before DeepSpeed's import logs its accelerator line
    # DeepSpeed's autotuner imports mlflow whenever it is installed (0.7 s of every rank's start
    # here), for autotuning runs lightspeed never starts: hidden during the first import only (a
    # user's own `import mlflow`, before or after, is untouched).
    hide = "deepspeed" not in sys.modules and "mlflow" not in sys.modules
    if hide:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # import mlflow -> ImportError
    try:
        import deepspeed
    except ImportError as e:
        raise ConfigError(
            f"strategy DeepSpeed needs the deepspeed package, which is not importable ({e}). "
            "Install it with `pip install 'deepspeed>=0.16,<0.20'`."
        ) from None
    finally:
        if hide and "mlflow" in sys.modules and sys.modules["mlflow"] is None:
            del sys.modules["mlflow"]
    return deepspeed
