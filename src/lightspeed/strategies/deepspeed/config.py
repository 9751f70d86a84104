"""Reading and merging DeepSpeed configs, and casting a batch to the engine's dtype (helpers of
strategies.deepspeed)."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import torch

from lightspeed.errors import ConfigError

# ZeRO's reduce bucket (elements): a half-precision buffer every GPU keeps whole, whatever the GPU
# count. Stage 3
# takes 64M (0.12 GiB in bf16) instead of 200M (0.37 GiB): on a 1.28B GPT it left speed unchanged on
# 1 and 2
# H200s (1.02x and 1.01x the median tok/s of 200M, 8 and 6 runs) and puts ZeRO-3's memory between
# steps within
# 8% of the ZeRO paper's 16 bytes per parameter / 8 GPUs (docs/benchmarks.md, 2026-12-01).
REDUCE_BUCKET = {1: 200_000_000, 2: 200_000_000, 3: 64_000_000}


def read_config(config: dict | str | Path | None) -> dict:
    """The user's config as a new dict (None gives {}); a path must hold a JSON object.

    Raises ConfigError naming the path (and the line and column of a JSON syntax error)."""
    if config is None or isinstance(config, dict):
        return copy.deepcopy(config or {})
    path = Path(config)
    if not path.is_file():
        raise ConfigError(
            f"DeepSpeed config={str(config)!r} is not valid. You passed in a path to a DeepSpeed "
            "config but the path does not exist."
        )
    try:
        value = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"DeepSpeed config file {path} is not valid JSON: line {e.lineno}, column {e.colno}: "
            f"{e.msg}."
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            f"DeepSpeed config file {path} must hold a JSON object, not {type(value).__name__}."
        )
    return value


def merge(base: dict, over: dict) -> dict:
    """`over` merged into a copy of `base`, nested dicts key by key; `over` wins on a conflict."""
    out = dict(base)
    for k, v in over.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def engine_dtype(config: dict) -> torch.dtype | None:
    """The dtype DeepSpeed keeps the module's weights in under `config` (bf16 or fp16), or None for
    fp32."""
    if config.get("bf16", {}).get("enabled"):
        return torch.bfloat16
    if config.get("fp16", {}).get("enabled"):
        return torch.float16
    return None


def cast_floats(value, dtype: torch.dtype | None):
    """`value` with every floating-point tensor in it (through tuples, lists and dicts) cast to
    `dtype`.

    Integer tensors (token ids, labels) and everything else pass unchanged; dtype None returns
    `value` as is. DeepSpeed's bf16/fp16 engine holds low-precision weights, so float inputs must
    match them."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(cast_floats(v, dtype) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return type(value)((k, cast_floats(v, dtype)) for k, v in value.items())
    return value


STALE_LOCK_S = (
    15 * 60
)  # a DeepSpeed op build takes one to a few minutes; a lock this old has lost its builder


def check_extension_locks(now: float | None = None) -> None:
    """Refuses to start when torch's extension cache holds a stale build lock.

    DeepSpeed JIT-loads its C++ ops through torch.utils.cpp_extension, which takes a lock file in
    the op's build folder on every load and waits for as long as that file exists. A process killed
    (kill -9, a preempted job) while holding it leaves the file behind, and every later DeepSpeed
    run then waits forever, saying nothing.

    Raises:
        ConfigError: naming each lock file older than STALE_LOCK_S and what to do.
    """
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    now = time.time() if now is None else now
    stale = [
        p
        for p in [*root.glob("*/lock"), *root.glob("*/*/lock")]
        if now - p.stat().st_mtime > STALE_LOCK_S
    ]
    if stale:
        ages = ", ".join(f"{p} ({(now - p.stat().st_mtime) / 60:.0f} min old)" for p in stale)
        raise ConfigError(
            f"DeepSpeed would wait forever on a stale op build lock: {ages}. A build killed midway "
            "leaves this file; torch waits for it to vanish. If no other process is compiling "
            "DeepSpeed ops now, delete the file and run again."
        )
