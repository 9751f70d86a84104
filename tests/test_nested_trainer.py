"""A Trainer made inside a running 2-rank job (`Trainer(accelerator="cpu", devices=1)` on rank 0
after a distributed fit, as Lightning's docs advise for `test()`) runs as one process on a process
group of its own (runtime/distributed.OwnGroup): no collective with the other rank, and the job's
group is untouched afterwards.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_nested_trainer.py

The rank script is tests/nested_trainer_script.py: rank 1 waits in the job's next all_reduce while
rank 0 tests the fitted model and fits a fresh one alone; then both ranks use the job's group (that
all_reduce and a 2-rank test). Real gloo ranks; nothing in torch.distributed is mocked.
"""

from __future__ import annotations

import json
import sys

import pytest

import lightspeed as ls
from helpers import ROOT, launch
from lightspeed.errors import ConfigError

SCRIPT = ROOT / "tests" / "nested_trainer_script.py"


def _run(tmp_path, strategy: str):
    out = tmp_path / "out.json"
    run = launch([str(SCRIPT), strategy, str(out)], tmp_path, "python", nproc=1, timeout=240)
    return run, (json.loads(out.read_text()) if out.exists() else None)


def _alone_losses() -> list[float]:
    """The nested fit's twin, made in this process with no job around it."""
    sys.path.insert(0, str(SCRIPT.parent))
    import nested_trainer_script as script

    fresh = script.Regression()
    ls.seed_everything(1)
    script.single(max_steps=5, enable_checkpointing=False).fit(fresh, script.data())
    return fresh.losses


JOBS = ["ddp", "deepspeed_stage_2"]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict[str, dict]:
    """The script under each of JOBS, one job after another in one launch (the ranks start once):
    strategy -> rank 0's result."""
    tmp = tmp_path_factory.mktemp("nested")
    args = [a for strategy in JOBS for a in (strategy, str(tmp / f"{strategy}.json"))]
    run = launch([str(SCRIPT), *args], tmp, "python", nproc=1, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    return {strategy: json.loads((tmp / f"{strategy}.json").read_text()) for strategy in JOBS}


@pytest.mark.parametrize("strategy", JOBS)
def test_devices_1_inside_a_two_rank_job_runs_alone(jobs, strategy):
    res = jobs[strategy]
    assert res["nested_world"] == 1 and res["nested_fit_step"] == 5
    # The same weights, tested alone on all the data and by the job's two ranks on halves of it.
    assert res["nested_test"] == pytest.approx(res["job_test"], rel=1e-6)
    assert res["nested_fit_losses"] == _alone_losses()  # as if no job were around it
    # The job's group afterwards: both ranks' all_reduce (1 + 2), its world size unchanged.
    assert res["job_all_reduce"] == 3.0 and res["job_world_after"] == 2


def test_a_module_sharded_across_the_job_is_refused_not_hung(tmp_path):
    run, res = _run(tmp_path, "fsdp")
    assert run.returncode != 0 and res is None
    assert "ConfigError: This Module's parameters are sharded across the job's ranks" in run.stderr
    assert run.seconds < 120, run.seconds  # refused before any forward, no collective timeout


def test_devices_1_under_a_launcher_without_a_running_job_is_still_a_mismatch(monkeypatch):
    """Two processes started by torchrun for a Trainer(devices=1): a launch mistake, not a nested
    Trainer (no job's group is joined), so still the ConfigError naming both numbers."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(ConfigError, match="devices=1 × num_nodes=1 does not match the torchrun"):
        ls.Trainer(accelerator="cpu", devices=1)
