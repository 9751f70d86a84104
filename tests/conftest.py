import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The files with the longest runs go first, so that under `make test`'s two workers (`--dist
# loadfile` hands out whole files in collection order) no long file starts last while the other
# worker sits idle. The order is the one of the files' times (estimated for a full run on 2 cores
# from the last measured one, after their fits were gathered into launched jobs); the files left
# out take under 20 s each.
LONGEST_FIRST = (
    "test_launch.py",
    "test_manual_optimization.py",
    "test_deepspeed.py",
    "test_checksummed_resume.py",
    "test_strategies.py",
    "test_kernels.py",
    "test_travel.py",
    "test_deepspeed_tp.py",
    "test_lightning_ckpt.py",
    "test_tensor_parallel.py",
    "test_plan_families.py",
    "test_guard.py",
    "test_lightning_ranks.py",
    "test_lightning_names.py",
    "test_no_hangs.py",
    "test_fsdp.py",
    "test_first_run.py",
    "test_killed_rank0.py",
    "test_hf.py",
    "test_nonfinite_deepspeed.py",
)


def pytest_configure(config):
    # pytest-xdist orders --dist loadfile's files by their number of tests (most first) unless given
    # --no-loadscope-reorder; a file of many quick tests is no long run, so keep the order above
    # instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    import torch

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(
        key=lambda item: rank.get(item.path.name, len(rank))
    )  # stable: each file keeps its own order
    if (
        torch.cuda.is_available()
    ):  # a GPU test parametrized with more `devices` than there are GPUs is skipped
        have = torch.cuda.device_count()
        for item in items:
            wanted = getattr(item, "callspec", None) and item.callspec.params.get("devices")
            if "gpu" in item.keywords and isinstance(wanted, int) and wanted > have:
                item.add_marker(
                    pytest.mark.skip(reason=f"needs {wanted} GPUs; this machine has {have}")
                )
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU; this machine has none (run on the GPU machine)"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts from the same environment variables. An in-process DeepSpeed run sets RANK,
    WORLD_SIZE and LOCAL_RANK (DeepSpeed's engine writes them itself), which a later Trainer in the
    process would read as a launcher's."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """`shared_run(**opts)`: `run_workload(**opts)` once per pytest session, shared by the tests
    (and both xdist
    workers) that ask for the same options (helpers.SharedRuns). The runs live in this session's
    temporary folder: under xdist the folder the workers' own folders sit in, which no other session
    uses."""
    from helpers import SharedRuns

    base = tmp_path_factory.getbasetemp()
    return SharedRuns(
        (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "shared-runs"
    )
