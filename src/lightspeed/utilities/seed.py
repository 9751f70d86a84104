"""Lightning's `utilities.seed`: `seed_everything`, and `isolate_rng` to draw random numbers without
moving the generators of the code around it.

    with isolate_rng():
        noise = torch.randn(3)        # the RNG state after the block is the one before it
"""

from __future__ import annotations

import random
from collections.abc import Generator
from contextlib import contextmanager

import numpy as np
import torch

from lightspeed.runtime.rng import seed_everything


@contextmanager
def isolate_rng(include_cuda: bool = True) -> Generator[None, None, None]:
    """Restores the Python, NumPy and torch generators (and, with `include_cuda`, every CUDA
    device's) on leaving the block to their state on entering it."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda = None
    if include_cuda:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


__all__ = ["isolate_rng", "seed_everything"]
