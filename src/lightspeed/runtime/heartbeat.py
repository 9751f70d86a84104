"""Heartbeat: each rank says where it is, so a hang ends with a message naming the rank that stopped
answering.

    rank 1 stopped answering at step 3 (last seen in training_step (workload.py:74) 5 s ago); rank 0
    answered up to step 3 and waited in all_reduce (metrics.py:154).

The training loop only notes its step (`note_step` from `hooks.on_train_batch_start`, one attribute
write per batch, no I/O). A daemon thread in each rank wakes every second, reads where the training
thread is from its Python stack (`sys._current_frames`: in `training_step`, in `backward`, waiting
in `all_reduce`, ...) and writes that with the step to the rendezvous store (torch's TCPStore on
MASTER_ADDR:MASTER_PORT, through its own connection) under `lightspeed/heartbeat/<rank>`. Nothing on
the training thread touches the store or the device.

Who reads it:
- a rank that has waited STALL_S (30 s) in one collective, whatever the collective timeout: its
  heartbeat thread prints the report once, if no lower rank is waiting too (one rank speaks), and
  keeps waiting: a rank that is only slow (a long save on rank 0, a slow first step) may still come,
  and then a second line says the wait ended. The policy is to name, not to abort: the collective
  timeout (`Trainer(timeout=)`, 600 s by default) still ends a wait that never ends;
- a rank waiting in a collective shortly before that timeout: its thread prints the report again
  (NCCL's watchdog then aborts the process, and nothing else could speak); an uncaught timeout the
  thread did not report prints it before the traceback. Under torchrun or SLURM these are the only
  reports;
- the local launcher (`launch.start_local_ranks`): when no rank has moved for 1.5 x the timeout
  (every rank stuck outside a collective, which no collective timeout catches), it prints the
  report and ends the job.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

INTERVAL_S = 1.0  # how often a rank publishes where it is
STALE_S = 10.0  # a rank whose last heartbeat is older than this is not answering (frozen or gone)
# A rank waiting this long in one collective names the ranks it waits for, whatever the collective
# timeout: long enough for a slow step or a modest save, short enough to name a hang within a
# minute at the defaults.
STALL_S = 30.0
_KEY = "lightspeed/heartbeat/"
_STEP_FUNCTIONS = ("training_step", "validation_step", "test_step", "predict_step")


@dataclass
class Beat:
    """One rank's last published position. `since`: wall time it got there; `seen`: wall time of the
    heartbeat."""

    rank: int
    step: int | None
    phase: str  # "training_step", "backward", "all_reduce", ...
    where: str  # innermost Python line, "file.py:72"
    waiting: bool  # in a collective (or in backward, where DDP/FSDP/DeepSpeed communicate)
    since: float
    seen: float
    host: str = ""
    pid: int = 0
    left: bool = (
        False  # the rank left the process group (finished, or failed): its last position stays
    )


def locate(frame: Any) -> tuple[str, str, bool]:
    """(phase, where, waiting) of a thread whose innermost frame is `frame`.

    Walking outwards from the innermost frame, the first of these names the phase: a
    torch.distributed function (the outermost of the innermost run of them: `broadcast_object_list`,
    not the `broadcast` inside it), the autograd backward, a `*_step` hook of the Module; otherwise
    the innermost function. `where` is the innermost Python line outside torch (the user's or
    lightspeed's call that is running).
    """
    if frame is None:
        return "unknown", "?", False
    here = (
        frame  # the innermost line outside torch: the user's or lightspeed's call that is running
    )
    while here.f_back is not None and "/torch/" in here.f_code.co_filename.replace("\\", "/"):
        here = here.f_back
    where = f"{os.path.basename(here.f_code.co_filename)}:{here.f_lineno}"
    collective = None
    f = frame
    while f is not None:
        path, name = f.f_code.co_filename.replace("\\", "/"), f.f_code.co_name
        if "/torch/distributed/" in path:
            collective = (
                collective
                if name in ("wrapper", "_fn") or name.startswith("_") and collective
                else name
            )
        elif collective:
            return collective, where, True
        elif "/torch/autograd/" in path and "backward" in name:
            return "backward", where, True
        elif name in _STEP_FUNCTIONS:
            return name, where, False
        f = f.f_back
    return collective or frame.f_code.co_name, where, bool(collective)


class _Heart:
    """This process's publisher: the step the loop noted, a thread that writes where the loop is."""

    def __init__(self) -> None:
        self.hooked = False  # the excepthook is installed
        self.group: tuple = ()  # (world size, store host, store port)
        self.reset()

    def reset(self) -> None:
        self.step: int | None = None
        self.rank = 0
        self.store: Any = None
        self.thread: threading.Thread | None = None
        self.target: int | None = None  # the training thread's id
        self.stop_event = threading.Event()
        self.last: tuple = ()
        self.latest: Beat | None = None  # the last beat the thread published
        self.timeout_s = 600.0  # the collective timeout
        self.warned = False  # the current wait was reported near the timeout
        self.named: Beat | None = None  # the wait reported after STALL_S (this rank spoke)
        self.since = time.time()

    def sample(self) -> Beat:
        frames = sys._current_frames()
        frame = frames.get(self.target) if self.target is not None else None
        phase, where, waiting = locate(frame)
        if (self.step, phase, where) != self.last:
            self.last, self.since = (self.step, phase, where), time.time()
        return Beat(
            self.rank,
            self.step,
            phase,
            where,
            waiting,
            self.since,
            time.time(),
            socket.gethostname(),
            os.getpid(),
        )

    def publish(self, beat: Beat) -> None:
        self.store.set(f"{_KEY}{self.rank}", json.dumps(beat.__dict__))

    def run(self) -> None:
        while not self.stop_event.wait(INTERVAL_S):
            try:
                self.latest = beat = self.sample()
                self.publish(beat)
                self.watch(beat)
                self.warn(beat)
            # the store's host (rank 0) is gone: the launcher or the timeout reports that
            except Exception:
                return

    def watch(self, beat: Beat) -> None:
        """After STALL_S in one collective, says once whom this rank waits for (if no lower rank
        waits too: they would say the same); when that wait ends, says so."""
        self.note_end(beat)
        waited = beat.seen - beat.since
        if not beat.waiting or waited < STALL_S or self.named is not None:
            return
        # The lowest waiting rank speaks: one read when rank 0 waits too (the usual case).
        lower = (_read_ranks(self.store, range(r, r + 1))[0] for r in range(self.rank))
        if any(b is not None and b.waiting for b in lower):
            return
        self.named = beat
        _say(
            f"[lightspeed] rank {self.rank} has waited {waited:.0f} s in {beat.phase}: "
            f"{describe(read(self.store, self.group[0]))} Still waiting: a slow rank may yet come; "
            f"a hung one ends the job at the {self.timeout_s:g} s collective timeout "
            "(Trainer(timeout=))."
        )

    def note_end(self, beat: Beat) -> None:
        if self.named is not None and beat.since != self.named.since:  # it moved on
            took, phase, self.named = beat.seen - self.named.since, self.named.phase, None
            _say(f"[lightspeed] rank {self.rank}: the wait in {phase} ended after {took:.0f} s.")

    def warn(self, beat: Beat) -> None:
        # Said shortly before the collective timeout ends the wait, because NCCL's watchdog then
        # aborts the
        # process (SIGABRT) and no excepthook runs; gloo raises, and the excepthook stays quiet
        # after this.
        waited = beat.seen - beat.since
        if beat.waiting and waited >= max(self.timeout_s - 3 * INTERVAL_S, self.timeout_s / 2):
            if not self.warned:
                self.warned = True
                print(
                    f"[lightspeed] rank {self.rank}: waited {waited:.0f} s in {beat.phase} "
                    f"({beat.where}) of the "
                    f"{self.timeout_s:g} s collective timeout. "
                    f"{describe(read(self.store, self.group[0]))}",
                    file=sys.__stderr__,
                    flush=True,
                )
        else:
            self.warned = False


_heart = _Heart()


def note_step(step: int) -> None:
    """Called at each training batch's start (hooks.on_train_batch_start): the step the heartbeat
    reports. No I/O."""
    _heart.step = step


def connect(host: str, port: int, timeout_s: float = 10.0) -> Any:
    """A new client connection to the rendezvous store on host:port."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def start(rank: int, world_size: int, host: str, port: int, timeout_s: float = 600.0) -> None:
    """Starts this rank's heartbeat thread (once per process group). When the training thread has
    waited in a collective for nearly `timeout_s` (the collective timeout), the thread prints
    `describe` of every rank's last heartbeat; an uncaught collective timeout prints it before its
    traceback if the thread did not. Call on the training thread, after the process group is
    joined."""
    if _heart.thread is not None:
        return
    _heart.reset()
    _heart.rank, _heart.target, _heart.store = rank, threading.get_ident(), connect(host, port)
    _heart.group, _heart.timeout_s = (world_size, host, port), timeout_s
    _heart.publish(_heart.sample())
    _heart.thread = threading.Thread(target=_heart.run, name="lightspeed-heartbeat", daemon=True)
    _heart.thread.start()
    if not _heart.hooked:  # once per process, however many groups it joins
        _heart.hooked = True
        previous = sys.excepthook

        def on_uncaught(kind, exc, tb) -> None:
            if is_timeout(exc) and not _heart.warned:
                print(
                    f"[lightspeed] rank {_heart.rank}: a collective timed out. {_report()}",
                    file=sys.__stderr__,
                    flush=True,
                )
            previous(kind, exc, tb)

        sys.excepthook = on_uncaught


def _report() -> str:
    world_size, host, port = _heart.group
    try:  # a connection of its own: the heartbeat thread may still be using the other one
        return describe(read(connect(host, port), world_size))
    except Exception as e:  # the store went with rank 0
        return f"no heartbeat could be read ({e})"


def stop() -> None:
    """Stops the thread and publishes that this rank left the process group, with the last position
    it published (where it was before the teardown: after a timeout, the collective it waited
    in)."""
    if _heart.thread is None:
        return
    _heart.stop_event.set()
    _heart.thread.join(timeout=2 * INTERVAL_S)
    _heart.thread = None  # a later process group starts a new one
    _heart.note_end(_heart.sample())  # a reported wait that ended since the last tick
    try:
        beat = _heart.latest or _heart.sample()
        beat.left = True
        _heart.publish(beat)
    except Exception:
        pass


def is_timeout(exc: BaseException) -> bool:
    """Whether `exc` is (or was caused by) a collective's timeout (gloo: "Timed out waiting", nccl:
    "timeout")."""
    cur: BaseException | None = exc
    while cur is not None:
        text = str(cur).lower()
        if "timed out" in text or "timeout" in text:
            return True
        cur = cur.__cause__ or cur.__context__
    return False


def read(store: Any, world_size: int) -> list[Beat | None]:
    """Every rank's last heartbeat from `store` (None for a rank that never published). Does not
    wait."""
    return _read_ranks(store, range(world_size))


def _read_ranks(store: Any, ranks: range) -> list[Beat | None]:
    beats: list[Beat | None] = []
    for r in ranks:
        key = f"{_KEY}{r}"
        beats.append(Beat(**json.loads(store.get(key))) if store.check([key]) else None)
    return beats


def _say(line: str) -> None:
    # sys.__stderr__: torch's excepthook may have swapped sys.stderr for a buffer
    print(line, file=sys.__stderr__, flush=True)


def describe(beats: list[Beat | None], now: float | None = None) -> str:
    """The report: which ranks stopped answering, at which step and where; what the others were
    doing.

    A rank stopped answering when its heartbeat is older than STALE_S, or when it is the furthest
    behind (lowest step, then not waiting in a collective while others wait). A rank that left the
    group shows where it was.
    """
    now = time.time() if now is None else now
    silent = [r for r, b in enumerate(beats) if b is None]
    live = [b for b in beats if b is not None]
    stale = [b for b in live if now - b.seen > STALE_S and not b.left]
    fresh = [b for b in live if b not in stale]
    stuck = stale + _behind(fresh)
    parts = [f"rank {r} never sent a heartbeat (it did not join, or died before)" for r in silent]
    for b in stuck:
        quiet = f"; no heartbeat for {now - b.seen:.0f} s" if b in stale else ""
        parts.append(
            f"rank {b.rank} stopped answering {_at(b)} (last seen in {b.phase} ({b.where}) "
            f"{now - b.since:.0f} s ago{quiet})"
        )
    groups: dict[tuple, list[int]] = {}
    for b in fresh:
        if b not in stuck:
            groups.setdefault((_upto(b), b.phase, b.where, b.waiting), []).append(b.rank)
    for (step, phase, where, waiting), ranks in groups.items():
        who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
        verb = "waited in" if waiting else "was in"
        parts.append(f"{who} answered {step} and {verb} {phase} ({where})")
    if not stuck and not silent:
        parts.insert(
            0,
            "no rank is behind: every rank waits in a collective (do the ranks call the same "
            "ones?)",
        )
    return "; ".join(parts) + "."


def _behind(beats: list[Beat]) -> list[Beat]:
    # The lowest step; among its ranks, those not in a collective (the others wait for them). When
    # every rank is
    # at that step and waiting, nobody is behind: they wait for each other (mismatched collectives).
    if not beats:
        return []
    low = min(-1 if b.step is None else b.step for b in beats)
    last = [b for b in beats if (-1 if b.step is None else b.step) == low]
    working = [b for b in last if not b.waiting]
    return working or ([] if len(last) == len(beats) else last)


def _at(b: Beat) -> str:
    return f"at step {b.step}" if b.step is not None else "before the first step"


def _upto(b: Beat) -> str:
    return f"up to step {b.step}" if b.step is not None else "before the first step"
