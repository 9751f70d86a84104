"""Process-group helpers on the ground floor: join, leave, barrier, broadcast. Strategies and the
Checkpointer use these; none of them reads the launch environment (that is `launch.DistInfo`, read
once)."""

from __future__ import annotations

import atexit
import contextlib
import gc
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _set_global_rank

from lightspeed.errors import ConfigError
from lightspeed.runtime import heartbeat
from lightspeed.runtime.launch import DistInfo, rendezvous_server

JOIN_TIMEOUT_S = 600.0  # how long the ranks may take to meet when the process group forms


def init_process_group(info: DistInfo, device: torch.device, timeout_s: float = 600) -> None:
    """Joins the default process group: gloo on CPU, nccl on CUDA. A single process joins a group of
    one, so every strategy that needs a group also runs with devices=1. Does nothing when a group
    exists.

    `timeout_s` bounds every collective. Joining may take longer (at least JOIN_TIMEOUT_S): ranks
    start at different speeds (imports on a busy host), which is not a hang."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    # With nccl, binding the device lets torch create the communicator eagerly and use the right
    # GPU.
    bind: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
    if not info.is_distributed:
        # One process still gets a group of one (DDP, ZeRO and FSDP need a group): an in-memory
        # store, no port.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **bind)
        return
    # (torch has no public setter for a group's timeout; without the private one, joining gets
    # `timeout_s` too)
    join_s = (
        max(timeout_s, JOIN_TIMEOUT_S)
        if hasattr(dist.distributed_c10d, "_set_pg_timeout")
        else timeout_s
    )
    if (
        info.launcher == "lightspeed"
    ):  # ranks we spawned meet at the store rank 0 opened before spawning them
        store = rendezvous_server() if info.rank == 0 else None
        if store is None:
            store = dist.TCPStore(
                info.master_addr,
                info.master_port,
                info.world_size,
                is_master=info.rank == 0,
                wait_for_workers=False,
                timeout=timedelta(seconds=join_s),
            )
        rendezvous: dict[str, Any] = {"store": store}
    else:
        rendezvous = {"init_method": f"tcp://{info.master_addr}:{info.master_port}"}
    dist.init_process_group(
        backend,
        **rendezvous,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timedelta(seconds=join_s),
        **bind,
    )
    if join_s != timeout_s:  # from now on, a collective waits `timeout_s`
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
    # Every rank says where it is, so a collective timeout (or the local launcher) can name the rank
    # that hangs.
    heartbeat.start(info.rank, info.world_size, info.master_addr, info.master_port, timeout_s)


def destroy_process_group() -> None:
    """Leaves the default process group, if joined. Left to interpreter shutdown, gloo's threads
    abort the process ("terminate called without an active exception"), turning a finished run into
    a failed one."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:  # a group of one has no heartbeat (a job's may be running)
            heartbeat.stop()
        dist.destroy_process_group()
        # Free what still holds the group (a DDP reducer in a trainer <-> module reference cycle)
        # now, while
        # the interpreter is alive: gloo work freed during interpreter finalization aborts the
        # process.
        gc.collect()


def is_distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


class OwnGroup:
    """The process group of one of a Trainer made inside a running multi-rank job, such as
    `Trainer(devices=1).test(...)` on rank 0 after a distributed fit (what Lightning's docs advise):
    while one of its entry points runs (`entered()`), torch's default group is this process's own
    group of one, so every collective of that run (lightspeed's, the Module's, a strategy's) stays
    in this process and no other rank has to take part; outside it the job's group is back as it
    was. The job's group is never destroyed or changed.

    torch keeps its default group and its group tables in module globals of
    `torch.distributed.distributed_c10d` (the same ones `destroy_process_group` clears), and every
    group's name in a process-wide registry; `entered()` swaps those globals for this run's own and
    back, and registers the job's group names again should this run's teardown have dropped them
    (destroying a default group drops every name). That is torch's private state: a torch that
    moves it fails tests/test_nested_trainer.py, not silently."""

    _STATE = (
        "_world",
        "_pg_map",
        "_pg_names",
        "_pg_group_ranks",
        "_pg_backend_config",
        "_group_count",
        "_tags_to_pg",
        "_pg_to_tag",
    )
    _FIRST_NAME = 1 << 20  # this run's group names count from here: no clash with the job's

    def __init__(self) -> None:
        c10d = dist.distributed_c10d
        self._own: dict[str, Any] = {name: type(getattr(c10d, name))() for name in self._STATE}
        self._own["_group_count"] = self._FIRST_NAME
        self._job: dict[str, Any] | None = None  # the job's state while this run's is torch's
        self._exit_hooked = False

    @staticmethod
    def inside_a_job() -> bool:
        """Whether this process is a rank of a running multi-rank job (its group is joined)."""
        return is_distributed()

    @staticmethod
    def check_module(module: torch.nn.Module) -> None:
        """Raises ConfigError if `module`'s parameters are sharded across the job's ranks (FSDP's
        DTensors, ZeRO-3's partitions): one process cannot run it alone (its forward would wait for
        the job's other ranks)."""
        from torch.distributed.tensor import DTensor

        sharded = next(
            (
                name
                for name, p in module.named_parameters()
                if isinstance(p, DTensor) or hasattr(p, "ds_tensor")  # FSDP2's / ZeRO-3's
            ),
            None,
        )
        if sharded is not None:
            raise ConfigError(
                f"This Module's parameters are sharded across the job's ranks ({sharded!r} among "
                "them: FSDP or DeepSpeed ZeRO-3), so a Trainer with devices=1 on one rank cannot "
                "run it: its forward would wait for the other ranks. Load the checkpoint into a "
                "fresh Module (`Module.load_from_checkpoint(path)`) for that Trainer, or test "
                "with the job's own Trainer on every rank."
            )

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """This run's group is torch's default group inside the block; the job's outside it.

        What the run leaves to the exit handlers (its strategy's teardown, registered by the loop
        inside the block) runs inside too: exit handlers run last-registered first, so one that
        puts this run's group back is registered after the block and one that puts the job's back
        before its first block."""
        if not self._exit_hooked:
            self._exit_hooked = True
            atexit.register(self._swap_out)  # runs after the handlers the blocks register
        self._swap_in()
        try:
            yield
        finally:
            self._swap_out()
            atexit.register(self._swap_in)  # runs before them

    def _swap_in(self) -> None:
        if self._job is not None:  # already in
            return
        c10d = dist.distributed_c10d
        self._job = {name: getattr(c10d, name) for name in self._STATE}
        self._job["rank"] = dist.get_rank() if dist.is_initialized() else -1
        for name, value in self._own.items():
            setattr(c10d, name, value)
        _set_global_rank(0 if dist.is_initialized() else -1)

    def _swap_out(self) -> None:
        if self._job is None:  # already out
            return
        c10d, job, self._job = dist.distributed_c10d, self._job, None
        self._own = {name: getattr(c10d, name) for name in self._STATE}
        for name in self._STATE:
            setattr(c10d, name, job[name])
        _set_global_rank(job["rank"])
        for pg, name in job["_pg_names"].items():
            with contextlib.suppress(RuntimeError):  # still registered: nothing dropped it
                _register_process_group(name, pg)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_from_rank0(value: Any) -> Any:
    """Every rank gets rank 0's `value` (any picklable object). Collective; a no-op without a
    group."""
    if not dist.is_initialized():
        return value
    dist.broadcast_object_list(box := [value], src=0)
    return box[0]


class AgreedMax:
    """A collective MAX of one small integer per call, for decisions every rank must take at the
    same step (preemption, a time limit): `agreed(local)` returns the same value on every rank.

    Off NCCL (gloo, or one process) the answer is this call's reduction. Under NCCL it is the
    previous call's, read from pinned host memory (it was queued behind the previous step, so it has
    landed), while this call's reduction is queued behind this step: every rank still gets the same
    answer at the same call, one call late, and the host never waits for the GPU (a wait would leave
    it idle while the host launches the next forward)."""

    def __init__(self) -> None:
        self._host: torch.Tensor | None = None  # pinned: the last reduction queued (NCCL)
        self._landed: Any = None  # a torch.cuda.Event: that reduction has reached `_host`

    def reset(self) -> None:
        """Forgets a reduction left from an earlier run (a new fit starts its decisions afresh)."""
        self._landed = None

    def __call__(self, local: int) -> int:
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return local
        if dist.get_backend() != "nccl":
            flag = torch.tensor([local], dtype=torch.int64)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            return int(flag.item())
        previous = 0
        if self._landed is not None:
            self._landed.synchronize()
            previous = int(self._host[0])
        elif self._host is None:
            self._host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        flag = torch.full((1,), local, dtype=torch.int64, device=torch.cuda.current_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self._host.copy_(flag, non_blocking=True)
        self._landed = torch.cuda.Event()
        self._landed.record()
        return previous


def gather_objects(value: Any) -> list:
    """Collective: every rank's `value` (any picklable object), by rank, on every rank; [value]
    without a group of more than one rank."""
    if not is_distributed():
        return [value]
    values: list = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


_host_group: tuple[Any, Any] = (None, None)  # (the default group, a gloo group made beside it)


def host_min_max(value: int, timeout_s: float = 600) -> tuple[int, int]:
    """Collective: the smallest and the largest `value` over the ranks, on every rank alike (one
    all_reduce of two integers). Reduced on the host: over the default group under gloo, over a
    gloo group made once beside an NCCL one (with `timeout_s`), so the host never waits for the
    work queued on the GPU, as a device reduction read back would. Without a group of more than one
    rank: (value, value)."""
    if not is_distributed():
        return value, value
    both = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=_gloo_group(timeout_s))
    return int(both[0]), -int(both[1])


def _gloo_group(timeout_s: float) -> Any:
    """None (the default group) when it reduces CPU tensors, else the gloo group beside it: made
    at the first call on every rank alike (new_group is collective), again after a new default
    group."""
    global _host_group
    if "gloo" in dist.get_backend():
        return None
    world = dist.group.WORLD
    if _host_group[0] is not world:
        _host_group = (world, dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)))
    return _host_group[1]


def gather_all(data: Any, group: Any = None, sync_grads: bool = False, device: Any = None) -> Any:
    """Lightning's `all_gather`: each tensor (or number, made a tensor on `device`) in `data`, from
    every rank of `group`, stacked along a new first dimension. Collective. `sync_grads` uses
    torch.distributed.nn's autograd-aware gather. Without a group of more than one rank, the tensors
    are returned as they are."""
    from torch.utils._pytree import tree_map

    def gather(x: Any) -> Any:
        if isinstance(x, bool) or not isinstance(x, (torch.Tensor, int, float)):
            return x
        t = x if isinstance(x, torch.Tensor) else torch.as_tensor(x, device=device)
        if not (dist.is_initialized() and dist.get_world_size(group) > 1):
            return t
        if sync_grads:
            from torch.distributed.nn.functional import all_gather

            return torch.stack(
                all_gather(t, group=group if group is not None else dist.group.WORLD)
            )
        out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, t.contiguous(), group=group)
        return torch.stack(out)

    return tree_map(gather, data)
