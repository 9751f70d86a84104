"""The one helper that starts real ranks: `launch` runs a script as N ranks under a chosen launcher.

Launchers: "python" (a plain `python script.py`; with `devices > 1` the Trainer spawns the other
local ranks itself), "torchrun" (`--nproc-per-node N`), "torchrun-nodes" (N torchrun processes of
one rank each, joined with `--nnodes N --node-rank i` on 127.0.0.1: how multi-node is tested on one
machine), "slurm" (N processes carrying the variables `srun` sets; no srun binary needed) and
"deepspeed" (the `deepspeed --num_gpus N` runner). Every rank uses gloo on 127.0.0.1 with a free
port. Nothing in torch.distributed is mocked. `run_workload` runs tests/workload.py through `launch`
and returns rank 0's JSON result.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "tests" / "workload.py"
LAUNCHERS = ("python", "torchrun", "torchrun-nodes", "slurm", "deepspeed")


@dataclass
class Launched:
    """What the launched ranks left: the exit code (the first non-zero one), their joint output, the
    wall time."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float


def _commands(
    script: list[str], launcher: str, nproc: int, port: int
) -> list[tuple[list[str], dict]]:
    py = sys.executable
    if launcher == "python":
        return [([py, *script], {})]
    if launcher == "torchrun":
        return [
            (
                [
                    py,
                    "-m",
                    "torch.distributed.run",
                    "--nproc-per-node",
                    str(nproc),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(port),
                    *script,
                ],
                {},
            )
        ]
    if launcher == "torchrun-nodes":
        return [
            (
                [
                    py,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    str(nproc),
                    "--nproc-per-node",
                    "1",
                    "--node-rank",
                    str(i),
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    str(port),
                    *script,
                ],
                {},
            )
            for i in range(nproc)
        ]
    if launcher == "slurm":
        # lightspeed derives the port from the job id (15000 + id % 20000); pick an id that lands on
        # `port`.
        job_id = 20000 * 7 + (port - 15000)
        return [
            (
                [py, *script],
                dict(
                    SLURM_PROCID=str(i),
                    SLURM_LOCALID=str(i),
                    SLURM_NTASKS=str(nproc),
                    SLURM_NTASKS_PER_NODE=str(nproc),
                    SLURM_NODELIST="localhost",
                    SLURM_NODEID="0",
                    SLURM_JOB_ID=str(job_id),
                    SLURM_JOB_NAME="train",
                ),
            )
            for i in range(nproc)
        ]
    if launcher == "deepspeed":
        return [
            (
                [
                    str(Path(py).parent / "deepspeed"),
                    "--num_gpus",
                    str(nproc),
                    "--master_addr",
                    "127.0.0.1",
                    "--master_port",
                    str(port),
                    *script,
                ],
                {},
            )
        ]
    raise ValueError(f"launcher={launcher!r}: use one of {LAUNCHERS}")


def launch(
    script: list[str],
    cwd: Path,
    launcher: str = "python",
    nproc: int = 2,
    extra_env: dict | None = None,
    timeout: float = 300,
) -> Launched:
    """Starts `script` (argv after `python`) as `nproc` ranks under `launcher`; waits for every
    process.

    On timeout every process group is killed and an AssertionError raised (a hang is a failure).
    """
    port = free_port(slurm=launcher == "slurm")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
        **(extra_env or {}),
    }
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LIGHTSPEED_SPAWNED",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        *(k for k, v in (extra_env or {}).items() if v is None),
    ):  # None in extra_env: unset
        env.pop(key, None)
    start = time.monotonic()
    procs = []
    for i, (cmd, more) in enumerate(_commands(script, launcher, nproc, port)):
        out, err = (open(cwd / f".launch-{i}.{s}", "w+") for s in ("out", "err"))
        procs.append(
            (
                subprocess.Popen(
                    cmd,
                    cwd=cwd,
                    env={**env, **more},
                    stdout=out,
                    stderr=err,
                    start_new_session=True,
                ),
                out,
                err,
            )
        )
    try:
        for p, _, _ in procs:
            p.wait(timeout=max(1.0, timeout - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        for p, _, _ in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(
            f"{launcher} run of {script} hung for {timeout}s:\n{_read(procs)[1][-4000:]}"
        )
    finally:
        for p, _, _ in procs:
            _kill_group(p.pid)  # stray ranks of a failed run
    codes = [p.returncode for p, _, _ in procs]
    stdout, stderr = _read(procs)
    return Launched(next((c for c in codes if c), 0), stdout, stderr, time.monotonic() - start)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(procs) -> tuple[str, str]:
    outs, errs = [], []
    for _, out, err in procs:
        for f, acc in ((out, outs), (err, errs)):
            f.flush()
            f.seek(0)
            acc.append(f.read())
            f.close()
    return "".join(outs), "".join(errs)


def run_workload(
    tmp_path: Path,
    timeout: float = 300,
    launcher: str = "python",
    nproc: int = 2,
    extra_env: dict | None = None,
    check: bool = True,
    **opts,
) -> dict | Launched:
    """Runs tests/workload.py with `opts`; returns rank 0's JSON result (or the Launched record if
    check=False).

    `launcher="in-process"` runs a one-device workload inside the test process: no interpreter
    start-up.
    """
    out = tmp_path / f"result-{len(list(tmp_path.glob('result-*')))}.json"
    opts.setdefault("root", str(tmp_path))
    opts["out"] = str(out)
    if launcher == "in-process":
        assert opts.get("devices", 1) == 1, (
            "in-process runs are for one device; start ranks with a launcher"
        )
        import workload

        workload.main(opts)
        return json.loads(out.read_text())
    run = launch([str(WORKLOAD), json.dumps(opts)], tmp_path, launcher, nproc, extra_env, timeout)
    if not check:
        return run
    if run.returncode != 0:
        raise AssertionError(
            f"workload failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
        )
    return json.loads(out.read_text())


def run_jobs(
    tmp_path: Path,
    jobs: dict[str, dict],
    timeout: float = 600,
    launcher: str = "python",
    nproc: int = 2,
    extra_env: dict | None = None,
) -> dict[str, dict]:
    """Runs tests/workload.py once for several option sets (`jobs`: name -> options), one fit after
    another in the same ranks: one interpreter start-up and one rendezvous for them all, where each
    run of its own pays both (about 2 s of CPU per rank, more with DeepSpeed's import). Each job
    runs in tmp_path/name (its root, unless given: jobs may share one), so a later job can name an
    earlier one's checkpoint there. Returns name -> rank 0's result, with "root" and "stdout"
    (the job's part of the output: what rank 0 printed from its start to the next job's)."""
    given = []
    for name, opts in jobs.items():
        root = Path(opts.get("root", tmp_path / name))
        root.mkdir(parents=True, exist_ok=True)
        given.append({**opts, "root": str(root), "out": str(root / f"result-{name}.json")})
    run = launch(
        [str(WORKLOAD), json.dumps({"jobs": given})], tmp_path, launcher, nproc, extra_env, timeout
    )
    if run.returncode != 0:
        raise AssertionError(
            f"workload jobs failed ({run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
        )
    parts = re.split(r"\[workload job (\d+)\]\n", run.stdout)
    said = ["" for _ in given]  # parts: text, number, text, number, text, ...
    for number, text in zip(parts[1::2], parts[2::2]):
        said[int(number)] += text
    return {
        name: {**json.loads(Path(job["out"]).read_text()), "root": Path(job["root"]), "stdout": out}
        for name, job, out in zip(jobs, given, said)
    }


class SharedRuns:
    """Workload runs made once and shared: `runs(**opts)` is `run_workload(root, **opts)` for a
    folder of its own, made by the first caller with these exact options; later callers (in any
    process) read its result. The result gains "root", the run's folder (its checkpoints); a string
    option may name a file there as "{root}/name". `runs.jobs({name: opts, ...})` makes several runs
    the same way in one launched job (run_jobs), each in the folder's sub-folder `name`.

    Each run has a lock file: two processes never make the same run, and one waits only for the run
    it needs. The folder must belong to one pytest session (conftest's `shared_run`), so that every
    session runs afresh.
    """

    def __init__(self, store: Path):
        self.store = store
        store.mkdir(parents=True, exist_ok=True)

    def __call__(self, **opts) -> dict:
        return self._get(opts, wait=True)

    def jobs(self, jobs: dict[str, dict]) -> dict[str, dict]:
        """The runs of `jobs` (name -> options), made once in one launched job: name -> result,
        each with its own "root" (a sub-folder of the bundle's folder, which "{root}" names)."""
        got = self._get({"jobs": jobs}, wait=True)
        assert got is not None
        return {name: {**r, "root": Path(r["root"])} for name, r in got["jobs"].items()}

    def all(self, many: list[dict]) -> list[dict]:
        """The runs of `many`, making first those no other process is making: a process that goes
        through the same runs in another order then seldom waits for this one."""
        got: dict[int, dict] = {}
        while len(got) < len(many):
            pending = [i for i in range(len(many)) if i not in got]
            for i in pending:
                if (result := self._get(many[i], wait=False)) is not None:
                    got[i] = result
            if all(
                i not in got for i in pending
            ):  # every one is being made elsewhere: wait for the first
                got[pending[0]] = self._get(many[pending[0]], wait=True)
        return [got[i] for i in range(len(many))]

    def _get(self, opts: dict, wait: bool) -> dict | None:
        from filelock import FileLock, Timeout

        key = json.dumps(opts, sort_keys=True)
        root = self.store / hashlib.sha1(key.encode()).hexdigest()[:16]
        done = root / "shared-result.json"
        try:
            with FileLock(f"{root}.lock", timeout=-1 if wait else 0):
                if not done.exists():
                    root.mkdir(exist_ok=True)
                    (root / "shared-options.json").write_text(key)
                    given = _fill_root(opts, str(root))
                    if "jobs" in given:
                        made = run_jobs(root, given["jobs"])
                        result = {
                            "jobs": {n: {**r, "root": str(r["root"])} for n, r in made.items()}
                        }
                    else:
                        result = run_workload(root, **given)
                    (root / "shared-result.tmp").write_text(json.dumps(result))
                    (root / "shared-result.tmp").rename(done)
        except Timeout:
            return None
        return {**json.loads(done.read_text()), "root": root}


def _fill_root(value, root: str):
    """`value` with "{root}" in its strings (also those of nested dicts) replaced by `root`."""
    if isinstance(value, str):
        return value.replace("{root}", root)
    if isinstance(value, dict):
        return {k: _fill_root(v, root) for k, v in value.items()}
    return value


def free_port(slurm: bool = False) -> int:
    """A free TCP port on 127.0.0.1 (for SLURM, one in the range lightspeed derives from a job
    id)."""
    import socket

    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if slurm:
                port = 15000 + int.from_bytes(os.urandom(2), "little") % 20000
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            else:
                s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    raise RuntimeError("no free port")


def assert_close_losses(a: list[float], b: list[float], rtol: float, what: str = "") -> None:
    """Per-step losses equal within a relative tolerance; reports the worst step."""
    assert len(a) == len(b) and a, f"{what}: {len(a)} vs {len(b)} steps"
    worst = max(range(len(a)), key=lambda i: abs(a[i] - b[i]) / max(abs(b[i]), 1e-12))
    rel = abs(a[worst] - b[worst]) / max(abs(b[worst]), 1e-12)
    assert rel <= rtol, (
        f"{what}: step {worst} differs by {rel:.2e} (> {rtol:.0e}): {a[worst]} vs {b[worst]}"
    )
