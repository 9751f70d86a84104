"""Random-number-generator state of this process (Python, NumPy, torch CPU and CUDA), as one
dict."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seeds Python, NumPy and torch (all devices) with the same seed and returns it, as Lightning's
    does. `seed=None` takes `PL_GLOBAL_SEED` from the environment, else 0; the seed is written
    there (and `workers` as `PL_SEED_WORKERS`) so that processes started later see it. `verbose`
    is accepted for Lightning's signature: nothing is printed."""
    if seed is None:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    seed = int(seed)
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return seed


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
