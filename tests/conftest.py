import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts from the same environment variables. An in-process DeepSpeed run sets RANK, WORLD_SIZE and
    LOCAL_RANK (DeepSpeed's engine writes them itself), which a later Trainer in the process would read as a
    launcher's."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
