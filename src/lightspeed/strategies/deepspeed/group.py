"""DeepSpeed's process group, as the strategy joins it in `connect` (`join_process_group`: torch's
group first, then DeepSpeed's comm layer adopting it) and leaves it in `teardown`
(`leave_process_group`: torch's group, and the groups DeepSpeed cached from it, so a later Trainer
of the same process can join a new one)."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from lightspeed.errors import ConfigError
from lightspeed.runtime.distributed import destroy_process_group, init_process_group
from lightspeed.runtime.launch import DistInfo
from lightspeed.strategies.deepspeed.quiet import use_current_collectives, without_build_notes


def join_process_group(
    deepspeed, dist_info: DistInfo, device: torch.device, timeout_s: float, strategy_name: str
) -> None:
    """Joins (or makes) the torch process group of `dist_info`, then DeepSpeed's comm layer on it.

    Raises:
        ConfigError: this Trainer has a group of its own inside a running DeepSpeed job, whose
            process groups DeepSpeed keeps (one set per process).
    """
    if dist_info.own_group and getattr(deepspeed.comm.comm, "cdb", None) is not None:
        raise ConfigError(
            f"strategy {strategy_name!r} cannot run in a Trainer made inside a running DeepSpeed "
            "job (devices=1 on one rank): DeepSpeed keeps one set of process groups per "
            "process, the job's. Give this Trainer the default strategy (one device), or run "
            "it in the job on every rank."
        )
    # A group of one for a single process: DeepSpeed needs a group.
    init_process_group(dist_info, device, timeout_s)
    if not dist_info.is_distributed:
        # DeepSpeed's CUDA path reads its rank from the launcher's variables; a plain one-process
        # run has none.
        os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    # DeepSpeed's comm layer adopts the torch process group that is already there.
    with without_build_notes():
        deepspeed.init_distributed(
            dist_backend=dist.get_backend(), dist_init_required=False, verbose=False
        )
    use_current_collectives(deepspeed)  # no FutureWarning on each ZeRO collective (quiet.py)
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)


def leave_process_group() -> None:
    """Leaves the default process group, if joined (`distributed.destroy_process_group`), and drops
    the groups DeepSpeed cached from it (its world and data-parallel groups), as
    `deepspeed.comm.destroy_process_group` does. Without the second step a later Trainer in the same
    process joins a new group while DeepSpeed's next engine still broadcasts on the destroyed one
    ("Group ... is not registered")."""
    joined = dist.is_initialized()
    destroy_process_group()
    if joined:
        from deepspeed.utils import groups

        # DeepSpeed 0.19's own step after destroying WORLD
        groups._release_process_group_references(group=None)
