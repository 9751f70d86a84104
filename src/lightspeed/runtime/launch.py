"""Where ranks come from: plain `python`, our own local spawner, torchrun, SLURM or the deepspeed
launcher.

The launch environment is read exactly once, by `read_dist_info()`, into a frozen `DistInfo`.
Nothing else in lightspeed reads rank variables. `start_local_ranks(n)` turns a plain `python
train.py` into n local ranks by re-running the same command with the rank environment set, as
torchrun would; the calling process becomes rank 0.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from lightspeed.runtime import heartbeat

Launcher = Literal["none", "lightspeed", "torchrun", "slurm", "deepspeed"]

# Set on the ranks that lightspeed itself started, so they never spawn again.
_SPAWNED_FLAG = "LIGHTSPEED_SPAWNED"


@dataclass(frozen=True)
class DistInfo:
    """Rank, world size and placement of this process; read once, never mutated."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: Launcher = "none"
    cpus_per_task: int = (
        0  # CPUs the scheduler gave each rank (SLURM's --cpus-per-task); 0: not said
    )
    # one process inside a running multi-rank job, on a process group of its own (a Trainer with
    # devices=1 made on one of the job's ranks: distributed.OwnGroup)
    own_group: bool = False

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


def _int(env: dict, key: str, default: int | None = None) -> int:
    value = env.get(key)
    return default if value in (None, "") else int(value)  # type: ignore[return-value]


def _slurm_master(nodelist: str) -> str:
    # "node[01-04],gpu7" -> "node01": the first host of SLURM's compact node list.
    first = nodelist.split(",")[0]
    if "[" in first:
        prefix, rest = first.split("[", 1)
        first = prefix + rest.split("-")[0].split(",")[0].rstrip("]")
    return first


def read_dist_info(env: dict | None = None) -> DistInfo:
    """Reads the launch environment once. Precedence: torchrun/deepspeed/lightspeed variables, then
    SLURM.

    torchrun, the deepspeed launcher and lightspeed's own spawner all export
    RANK/LOCAL_RANK/WORLD_SIZE/ MASTER_ADDR/MASTER_PORT; SLURM exports
    SLURM_PROCID/SLURM_LOCALID/SLURM_NTASKS/SLURM_NODELIST.
    """
    env = dict(os.environ if env is None else env)
    if "RANK" in env and "WORLD_SIZE" in env:
        if env.get(_SPAWNED_FLAG):
            launcher: Launcher = "lightspeed"
        elif "TORCHELASTIC_RUN_ID" in env:
            launcher = "torchrun"
        elif "CROSS_RANK" in env or "CROSS_SIZE" in env or "DS_ACCELERATOR" in env:
            launcher = "deepspeed"
        else:
            launcher = "torchrun"
        # torchrun says LOCAL_WORLD_SIZE; the deepspeed launcher says LOCAL_SIZE.
        local_world = _int(
            env, "LOCAL_WORLD_SIZE", _int(env, "LOCAL_SIZE", _int(env, "WORLD_SIZE"))
        )
        return DistInfo(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=_int(env, "WORLD_SIZE"),
            local_world_size=local_world,
            node_rank=_int(env, "GROUP_RANK", _int(env, "NODE_RANK", _int(env, "CROSS_RANK", 0))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
            launcher=launcher,
        )
    if (
        "SLURM_NTASKS" in env
        and "SLURM_PROCID" in env
        and env.get("SLURM_JOB_NAME") not in ("bash", "interactive")
    ):
        job_id = _int(env, "SLURM_JOB_ID", 0)
        return DistInfo(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            world_size=_int(env, "SLURM_NTASKS"),
            # SLURM writes "4" or, for several nodes, "4(x2)".
            local_world_size=int(
                env.get("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS"]).split("(")[0]
            ),
            node_rank=_int(env, "SLURM_NODEID", 0),
            master_addr=env.get("MASTER_ADDR")
            or _slurm_master(env.get("SLURM_NODELIST", "127.0.0.1")),
            # A port derived from the job id, so every task of the job agrees without talking.
            master_port=_int(env, "MASTER_PORT", 15000 + job_id % 20000),
            launcher="slurm",
            cpus_per_task=_int(env, "SLURM_CPUS_PER_TASK", 0),
        )
    return DistInfo()


def export_env(info: DistInfo) -> None:
    """Writes the rank variables torchrun would set, for libraries that read them (DeepSpeed's CUDA
    path asserts LOCAL_RANK). Variables already present are left alone: the launcher's word stands.
    A plain one-process run gets LOCAL_RANK only, so a later Trainer in the same script does not
    mistake it for torchrun. Several local ranks also get their share of the CPUs (`share_cpus`), as
    torchrun gives its ranks one thread.
    """
    values: dict = dict(LOCAL_RANK=info.local_rank)
    if info.launcher != "none":
        values.update(
            RANK=info.rank,
            WORLD_SIZE=info.world_size,
            LOCAL_WORLD_SIZE=info.local_world_size,
            MASTER_ADDR=info.master_addr,
            MASTER_PORT=info.master_port,
        )
    for key, value in values.items():
        os.environ.setdefault(key, str(value))
    share_cpus(info)


def share_cpus(info: DistInfo) -> int | None:
    """Gives this rank its share of the CPUs when several ranks run on one host, as Lightning does
    (torchrun gives each rank one thread): torch's thread pool, and through OMP_NUM_THREADS the
    processes this rank starts, get the CPUs it may run on divided by the local ranks, so two CPU
    ranks do not each spin a thread per core (2.5-3.4x faster steps on 2 CPU ranks:
    benchmarks/cpu_rank_threads.py). Under SLURM with --cpus-per-task, that count is the share:
    SLURM may already have bound each task to its own CPUs, which dividing again would undercount
    (Lightning divides them). A user's OMP_NUM_THREADS stands. Returns the threads set, or None when
    nothing was changed."""
    if info.local_world_size < 2 or os.environ.get("OMP_NUM_THREADS"):
        return None
    import torch

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = info.cpus_per_task or max(1, cpus // info.local_world_size)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


_exit_state: dict[str, Any] = {"installed": False, "failed": False}
# rank 0's time to fail by itself after another local rank died (start_local_ranks)
PEER_FAILURE_GRACE_S = 5.0
# a spawned rank's wait, on a lost connection, for its parent's exit to show (watch_parent)
PARENT_EXIT_S = 2.0


def end_with_os_exit() -> None:
    """Makes this rank end with `os._exit` once Python's own exit handlers have run.

    Interpreter finalisation destroys native communication objects (gloo connections, DeepSpeed's
    shared-memory communicator) whose threads can still be joinable; the C++ runtime then calls
    std::terminate and a rank that finished its work dies with SIGABRT ("terminate called without an
    active exception"), failing the whole run at random. Every atexit handler (loggers,
    process-group teardown, waiting for the other ranks) still runs; only the native finalisers are
    skipped. The exit status is what Python's would have been: 1 after an uncaught exception, n
    after `sys.exit(n)` (1 for a message), else 0. (A `raise SystemExit(n)` that bypasses `sys.exit`
    reads as 0.)
    """
    if _exit_state["installed"]:
        return
    _exit_state["installed"] = True
    previous_hook, previous_exit = sys.excepthook, sys.exit

    def note_failure(*exc_info) -> None:
        _exit_state["failed"] = True
        previous_hook(*exc_info)

    def note_exit(status=None):
        _exit_state["status"] = status
        previous_exit(status)

    sys.excepthook, sys.exit = note_failure, note_exit
    atexit.register(_os_exit)  # registered first, so it runs last


def _os_exit() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    status = _exit_state.get("status")
    if _exit_state["failed"]:
        os._exit(1)
    os._exit(status if isinstance(status, int) else 0 if status is None else 1)


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child_env(rank: int, world: int, port: int) -> dict:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **{_SPAWNED_FLAG: "1"},
        LIGHTSPEED_PARENT_PID=str(os.getpid()),
    )
    return env


_rendezvous_server: list = []  # rank 0's store, made by start_local_ranks


def rendezvous_server():
    """The rendezvous store that `start_local_ranks` opened in this process (rank 0), or None."""
    return _rendezvous_server[0] if _rendezvous_server else None


def start_local_ranks(n: int, timeout_s: float = 600.0) -> DistInfo:
    """Re-runs this script as ranks 1..n-1 and returns rank 0's DistInfo for the calling process.

    Rank 0 opens the rendezvous store (torch's TCPStore) on a port the OS picks before any child
    starts, and keeps it: a port that was only probed free could be taken by another program before
    rank 0 listened on it (seen on a GPU host: EADDRINUSE, and a lost run).

    A watchdog thread in rank 0 polls the children: if one exits non-zero, rank 0 gets
    PEER_FAILURE_GRACE_S to fail by itself (its next collective with the dead rank raises, and the
    Trainer runs `on_exception` and finalizes the loggers "failed"); if it has not, the watchdog
    kills the others and exits with that code (the child's traceback is already on stderr). Children
    stop themselves if rank 0 dies. The same thread reads the ranks' heartbeats (heartbeat.py): when
    no rank has moved for 1.5 x `timeout_s` (the collective timeout; every rank stuck outside a
    collective, which no collective timeout ends), it says which rank is where and ends the job with
    status 1.
    """
    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, n, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=600)
    )
    _rendezvous_server[:] = [server]
    port = server.port
    argv = [sys.executable, *(_script_argv())]
    children = [subprocess.Popen(argv, env=_child_env(r, n, port)) for r in range(1, n)]
    # For libraries (DeepSpeed) that read these themselves. Not the parent pid: rank 0 has no parent
    # rank to
    # watch, and a later Trainer in this process must not mistake its own launcher for one.
    os.environ.update(
        {k: v for k, v in _child_env(0, n, port).items() if k != "LIGHTSPEED_PARENT_PID"}
    )

    def kill_children(grace_s: float = 3.0) -> None:
        # A rank that is failing too may still be writing its traceback: let it finish before
        # SIGTERM.
        deadline = time.time() + grace_s
        while time.time() < deadline and any(c.poll() is None for c in children):
            time.sleep(0.05)
        for c in children:
            if c.poll() is None:
                # not SIGTERM: a rank treats that as a preemption notice and would save first
                c.kill()
        deadline = time.time() + 10
        for c in children:
            try:
                c.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                c.kill()

    beats = _Heartbeats(n, port, 1.5 * timeout_s)

    def watch() -> None:
        while True:
            if not failed and (
                report := beats.stalled()
            ):  # (a rank 0 that failed reports and stops by itself)
                print(
                    f"[lightspeed] no rank has moved for {1.5 * timeout_s:.0f} s (1.5 x "
                    "Trainer(timeout=)): "
                    f"{report} Stopping every rank.",
                    file=sys.__stderr__,
                    flush=True,
                )
                kill_children(grace_s=0)
                os._exit(1)
            for c in children:
                code = c.poll()
                if code not in (None, 0):
                    # sys.__stderr__: torch's excepthook may have swapped sys.stderr for a buffer
                    # just now.
                    # Killed by a signal (SIGKILL of the OOM killer, NCCL's watchdog abort): no
                    # traceback says
                    # where the ranks were, the heartbeats do.
                    where = beats.report() if code < 0 else ""
                    print(
                        f"[lightspeed] rank {children.index(c) + 1} failed ({_status(code)}); "
                        f"stopping every rank.{where}",
                        file=sys.__stderr__,
                        flush=True,
                    )
                    # Rank 0 meets the dead rank in its next collective (gloo at once, NCCL at its
                    # timeout) and
                    # fails through the Trainer's own path: on_exception, loggers finalized
                    # "failed". Give it
                    # that time; its exit handler then ends every rank. Past it, end the job from
                    # here.
                    deadline = time.time() + PEER_FAILURE_GRACE_S
                    while time.time() < deadline and not failed:
                        time.sleep(0.05)
                    if failed:
                        return
                    kill_children()
                    os._exit(code if code > 0 else 1)
            if all(c.poll() is not None for c in children):
                return
            time.sleep(0.2)

    failed: list[bool] = []
    previous_hook = sys.excepthook

    def on_uncaught(*exc_info) -> None:
        # Rank 0 itself failed. Only note it here: torch's excepthook, which wraps this one, writes
        # the traceback
        # after we return; the exit handler then takes the other ranks down.
        failed.append(True)
        previous_hook(*exc_info)

    sys.excepthook = on_uncaught
    atexit.register(_wait_then_kill, children, kill_children, failed)
    threading.Thread(target=watch, name="lightspeed-rank-watchdog", daemon=True).start()
    return DistInfo(
        rank=0,
        local_rank=0,
        world_size=n,
        local_world_size=n,
        master_port=port,
        launcher="lightspeed",
    )


class _Heartbeats:
    """Rank 0's view of every rank's heartbeat (heartbeat.py), read through its own store
    connection."""

    def __init__(self, n: int, port: int, limit_s: float):
        self.n, self.port, self.limit_s = n, port, limit_s
        self.store, self.next = None, 0.0

    def read(self) -> list[heartbeat.Beat | None] | None:
        try:
            self.store = self.store or heartbeat.connect("127.0.0.1", self.port)
            return heartbeat.read(self.store, self.n)
        except Exception:  # the store is not up yet, or going down with the job
            return None

    def stalled(self) -> str | None:
        """The report once no rank still in the group has moved for `limit_s`, else None (reads once
        a second)."""
        now = time.time()
        if now < self.next:
            return None
        self.next = now + heartbeat.INTERVAL_S
        beats = self.read()
        live = [b for b in beats or () if b is not None and not b.left]
        if not (live and all(now - b.since > self.limit_s for b in live)):
            return None
        assert beats is not None  # `live` is non-empty only when beats were read
        return heartbeat.describe(beats, now)

    def report(self) -> str:
        """Where every rank was last seen, when one of them had not moved for a third of the stall
        limit (half the collective timeout: a hang came first), else ''. A rank that just died
        mid-step is better named by its exit than by heartbeats up to a second old."""
        now, beats = time.time(), self.read()
        live = [b for b in beats or () if b is not None and not b.left]
        if not any(now - b.since >= self.limit_s / 3 for b in live):
            return ""
        assert beats is not None  # `live` is non-empty only when beats were read
        return f" Last heartbeats: {heartbeat.describe(beats, now)}"


def _status(code: int) -> str:
    return (
        f"killed by {signal.Signals(-code).name}"
        if code < 0 and -code in signal.valid_signals()
        else f"exit code {code}"
    )


def _wait_then_kill(children, kill_children, failed: list) -> None:
    # Rank 0 finished its script: if it succeeded, give the others time to finish theirs; otherwise
    # kill them.
    if not failed:
        for c in children:
            try:
                c.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pass
    # rank 0 failed, often because a peer died under it ("Connection closed by peer"): name that
    # peer
    else:
        time.sleep(0.3)
        for r, c in enumerate(children, start=1):
            if c.poll() not in (None, 0):
                print(
                    f"[lightspeed] rank {r} had already ended ({_status(c.returncode)}).",
                    file=sys.__stderr__,
                    flush=True,
                )
    kill_children()
    codes = [c.returncode for c in children if c.returncode not in (None, 0)]
    if codes and not failed:
        print(f"[lightspeed] a rank exited with code {codes[0]}", file=sys.__stderr__, flush=True)
        os._exit(codes[0] if codes[0] > 0 else 1)


def _script_argv() -> list[str]:
    # `python -m pkg.mod args` shows up as sys.argv[0] == path of mod; re-run it as a module when we
    # can.
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        name = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return ["-m", name, *sys.argv[1:]]
    return list(sys.argv)


def watch_parent() -> None:
    """On a rank lightspeed spawned: exit if rank 0 (our parent) disappears, so no rank is left
    hanging, and name it. Rank 0 started the job, so when it is killed (SIGKILL, the OOM killer)
    no launcher is left to say so: its ranks do. A rank in a collective with it fails at once
    ("Connection reset by peer"), often before the watch below looks, so an uncaught error names
    rank 0 first when rank 0 is gone (waiting up to PARENT_EXIT_S for its exit to show: a killed
    process's sockets close before its children are handed to a new parent)."""
    parent = os.environ.get("LIGHTSPEED_PARENT_PID")
    if not parent:
        return
    parent_pid, rank, said = int(parent), os.environ.get("RANK"), threading.Lock()

    def gone(wait_s: float = 0.0) -> bool:
        deadline = time.monotonic() + wait_s
        while os.getppid() == parent_pid:  # an orphan is adopted by init or a subreaper
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def say() -> None:
        if said.acquire(blocking=False):  # once, from this thread or the excepthook
            print(
                f"[lightspeed] rank 0 (pid {parent_pid}) is gone (killed, or it ended without its "
                f"ranks); rank {rank} stops too.",
                file=sys.__stderr__,
                flush=True,
            )

    def watch() -> None:
        while True:
            if gone():
                say()
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.5)

    previous_hook = sys.excepthook

    def on_uncaught(kind, exc, tb) -> None:
        if gone(PARENT_EXIT_S if _lost_peer(exc) else 0.0):
            say()
        previous_hook(kind, exc, tb)

    sys.excepthook = on_uncaught
    threading.Thread(target=watch, name="lightspeed-parent-watchdog", daemon=True).start()


def _lost_peer(exc: BaseException | None) -> bool:
    """Whether `exc` (or its cause) is a broken connection to another rank (gloo: "Connection reset
    by peer", "Connection closed by peer"; a socket error)."""
    while exc is not None:
        text = str(exc).lower()
        if isinstance(exc, ConnectionError) or any(w in text for w in ("connection", "peer")):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
