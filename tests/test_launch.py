"""One unchanged script under every launcher, and a failing rank that takes every rank down without
a hang.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_launch.py

Each launcher runs tests/workload.py as 2 real gloo ranks on 127.0.0.1; all must give the same
per-step losses.
"""

from __future__ import annotations

import os

import pytest

from helpers import ROOT, launch, run_workload
from lightspeed.runtime.launch import read_dist_info

RUN = dict(max_steps=3, batch_size=4)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain `python workload.py` with Trainer(devices=2): the Trainer spawns its second rank
    itself."""
    return run_workload(tmp_path_factory.mktemp("python"), devices=2, **RUN)


@pytest.mark.parametrize(
    "launcher, opts",
    [
        ("torchrun", dict(devices=2)),
        ("torchrun-nodes", dict(devices=1, num_nodes=2)),  # 2 "nodes" of 1 rank, local rendezvous
        ("slurm", dict(devices=2)),
        ("deepspeed", dict(devices=2)),
    ],
)
def test_same_script_under_every_launcher(tmp_path, reference, launcher, opts):
    result = run_workload(tmp_path, launcher=launcher, **opts, **RUN)
    assert reference["world_size"] == result["world_size"] == 2
    assert result["strategy"] == "ddp" and result["global_step"] == 3
    assert result["losses"] == reference["losses"]


def test_read_dist_info_classifies_launch_environments():
    torchrun = read_dist_info(
        {
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "1234",
            "TORCHELASTIC_RUN_ID": "x",
        }
    )
    assert (torchrun.launcher, torchrun.rank, torchrun.local_rank, torchrun.node_rank) == (
        "torchrun",
        3,
        1,
        1,
    )
    assert (torchrun.world_size, torchrun.local_world_size, torchrun.master_port) == (4, 2, 1234)
    # What `deepspeed --num_nodes 2 --num_gpus 2` exports (see deepspeed/launcher/launch.py):
    # LOCAL_SIZE, CROSS_*.
    ds = read_dist_info(
        {
            "RANK": "2",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "4",
            "LOCAL_SIZE": "2",
            "CROSS_RANK": "1",
            "CROSS_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29500",
        }
    )
    assert (ds.launcher, ds.rank, ds.node_rank, ds.local_world_size) == ("deepspeed", 2, 1, 2)
    slurm = read_dist_info(
        {
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "8",
            "SLURM_NODEID": "2",
            "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_NODELIST": "gpu[07-10],cpu1",
            "SLURM_JOB_ID": "42",
        }
    )
    assert (slurm.launcher, slurm.rank, slurm.local_rank, slurm.world_size) == ("slurm", 5, 1, 8)
    assert (slurm.node_rank, slurm.local_world_size, slurm.master_addr) == (2, 4, "gpu07")
    assert slurm.master_port == 15042 and slurm.cpus_per_task == 0
    assert (
        read_dist_info(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_CPUS_PER_TASK": "6"}
        ).cpus_per_task
        == 6
    )
    # SLURM's "4(x2)" form of tasks per node, and an interactive allocation that is not a job step.
    assert (
        read_dist_info(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)"}
        ).local_world_size
        == 4
    )
    assert (
        read_dist_info(
            {"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "bash"}
        ).launcher
        == "none"
    )
    assert read_dist_info({}).launcher == "none"


@pytest.mark.parametrize("fail_rank", [1, 0])
def test_failing_rank_stops_every_rank(tmp_path, fail_rank):
    run = run_workload(
        tmp_path,
        devices=2,
        check=False,
        timeout=90,
        fail_rank=fail_rank,
        max_steps=20,
        batch_size=4,
    )
    assert run.returncode != 0, run.stderr[-3000:]
    assert run.seconds < 60, f"took {run.seconds:.0f}s to stop"
    assert f"deliberate failure on rank {fail_rank}" in run.stderr, run.stderr[-3000:]
    assert "Traceback" in run.stderr


def test_failing_rank_under_torchrun(tmp_path):
    run = run_workload(
        tmp_path,
        launcher="torchrun",
        devices=2,
        check=False,
        timeout=90,
        fail_rank=1,
        max_steps=20,
        batch_size=4,
    )
    assert run.returncode != 0 and run.seconds < 60
    assert "deliberate failure on rank 1" in run.stderr


# One script for the exit-time behaviour of ranks: each rank prints its thread counts when training
# starts and a
# note after the strategy's own teardown; with an argument, rank 0 then calls sys.exit with it
# (digits: an int).
RANKS_SCRIPT = """
import os, sys
sys.path.insert(0, {tests!r})
import torch
import torch.distributed as dist
from test_trainer import Regress, make_trainer, regression_data
import lightspeed as ls


class Threads(ls.Callback):
    def on_train_start(self, trainer, module):
        # one write per line: print's text and newline are two writes, which two ranks on one
        # pipe can interleave
        sys.stdout.write(f"threads: rank={{trainer.global_rank}} torch={{torch.get_num_threads()}} "
                         f"omp={{os.environ.get('OMP_NUM_THREADS')}}\\n")
        sys.stdout.flush()


strategy = ls.DDP()
torn_down = strategy.teardown

def teardown():  # the strategy's own teardown, then a note of what it left
    torn_down()
    print(f"teardown: group still initialized={{dist.is_initialized()}}", flush=True)

strategy.teardown = teardown
trainer = make_trainer(".", strategy=strategy, devices=2, max_steps=2, callbacks=[Threads()])
trainer.fit(Regress(), regression_data())
if len(sys.argv) > 1:
    code = sys.argv[1]
    sys.exit((int(code) if code.isdigit() else code) if trainer.is_global_zero else 0)
"""


def _thread_counts() -> tuple[int, int, int]:
    """The CPUs this process may use, the share of each of 2 local ranks, and a count that differs
    from it."""
    cpus = len(os.sched_getaffinity(0))
    share = cpus // 2
    return cpus, share, share + 1 if share < cpus else share - 1


def _ranks(cwd, launcher: str, omp: str | None, *exit_with: str):
    script = cwd / "ranks.py"
    script.write_text(RANKS_SCRIPT.format(tests=str(ROOT / "tests")))
    slurm = {"SLURM_CPUS_PER_TASK": str(_thread_counts()[2])} if launcher == "slurm" else {}
    return launch(
        [str(script), *exit_with],
        cwd,
        launcher,
        nproc=2,
        timeout=120,
        extra_env={"OMP_NUM_THREADS": omp, **slurm},
    )


@pytest.fixture(scope="module")
def python_ranks(tmp_path_factory) -> dict:
    """RANKS_SCRIPT under `python` (the Trainer spawns rank 1), as (OMP_NUM_THREADS, sys.exit
    argument) -> the Launched record: three runs that the teardown, exit status and thread tests
    below all read."""
    other = str(_thread_counts()[2])
    return {
        (omp, code): _ranks(tmp_path_factory.mktemp("ranks"), "python", omp, *code)
        for omp, code in ((None, ()), (other, ("3",)), (other, ("stopping: a message",)))
    }


def test_trainer_tears_the_strategy_down_once_at_exit(python_ranks):
    # The Trainer registers strategy.teardown at exit (nothing else does): each rank runs it exactly
    # once,
    # it leaves the process group, and the ranks still end through os._exit with status 0.
    assert python_ranks[None, ()].returncode == 0, python_ranks[None, ()].stderr[-3000:]
    for (omp, code), run in python_ranks.items():  # also where rank 0 ends with sys.exit
        # Counted, not split into lines: the two ranks print at the same moment into one pipe, and
        # their texts
        # and newlines may interleave ("...=False" "...=False" "\n" "\n").
        assert run.stdout.count("teardown:") == 2, (code, run.stdout[-2000:])
        assert run.stdout.count("teardown: group still initialized=False") == 2, (
            code,
            run.stdout[-2000:],
        )


def test_sys_exit_status_of_rank_zero_is_the_launchers(python_ranks):
    # Ranks end through os._exit (see launch.end_with_os_exit); the status a script asks for must
    # survive that.
    other = str(_thread_counts()[2])
    for code, want in (("3", 3), ("stopping: a message", 1)):
        run = python_ranks[other, (code,)]
        assert run.returncode == want, (code, run.returncode, run.stderr[-3000:])


# A user's OMP_NUM_THREADS stands whatever the launcher (lightspeed's one check, before any
# launcher's rule): the python cells show it; the torchrun and slurm cells of a given value repeat
# that path and are slow.
@pytest.mark.parametrize(
    "launcher, given",
    [
        ("python", None),
        ("python", "other"),
        ("torchrun", None),
        pytest.param("torchrun", "other", marks=pytest.mark.slow),
        ("slurm", None),
        pytest.param("slurm", "other", marks=pytest.mark.slow),
    ],
)
def test_local_ranks_share_the_cpus_and_a_users_omp_num_threads_stands(
    tmp_path, python_ranks, launcher, given
):
    # Two ranks on one host: each gets the CPUs it may use divided by the local ranks (Lightning's
    # rule), in torch's pool and in OMP_NUM_THREADS for what it starts; under SLURM,
    # --cpus-per-task when it is given; a user's OMP_NUM_THREADS (given="other") is left as it is.
    # (torchrun sets OMP_NUM_THREADS=1 itself when it is unset: there the rank sees a value it must
    # keep.)
    cpus, share, other = _thread_counts()
    if cpus < 2:
        pytest.skip(
            "one CPU: every share is 1 thread, so the share cannot be told from a user's value"
        )
    given = str(other) if given else None
    want = other if given else {"python": share, "torchrun": 1, "slurm": other}[launcher]
    if (
        launcher == "python"
    ):  # the runs of the fixture (one of them exits with status 3, after training)
        run = python_ranks[given, () if given is None else ("3",)]
    else:
        run = _ranks(tmp_path, launcher, given)
        assert run.returncode == 0, run.stderr[-3000:]
    lines = sorted(line for line in run.stdout.splitlines() if line.startswith("threads:"))
    assert lines == [f"threads: rank={r} torch={want} omp={want}" for r in range(2)], (
        given,
        run.stdout[-2000:],
    )
