"""ZeRO-1 ("ddp_sharded"): DDP + ZeroRedundancyOptimizer on 2 real gloo ranks.

Tolerance: relative 1e-6 on per-step losses. ZeRO-1 runs the same fp32 arithmetic as DDP (same
all-reduce, the same AdamW update on each partition), so the losses are expected bit-identical; 1e-6
leaves room for nothing else.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import assert_close_losses, run_jobs, run_workload
from lightspeed.errors import ConfigError

RTOL = 1e-6
# Gradient accumulation, norm clipping and a per-step warm-up scheduler: param groups and schedulers
# must survive
# the rebuild into a ZeroRedundancyOptimizer.
TRAIN = dict(devices=2, accumulate=2, clip=1.0, warmup=3)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """The 2-rank runs of the tests below, one after another in one launched job (helpers.run_jobs:
    the ranks start once)."""
    tmp = tmp_path_factory.mktemp("zero1")
    return run_jobs(
        tmp,
        {
            "ddp": dict(strategy="ddp", max_steps=6, **TRAIN),
            "zero": dict(strategy="ddp_sharded", max_steps=6, **TRAIN),
            "saved": dict(
                strategy="ddp_sharded",
                max_steps=3,
                save_to=str(tmp / "saved" / "ckpt"),
                consolidate=str(tmp / "saved" / "zero1.safetensors"),
                **TRAIN,
            ),
            "ddp-plain": dict(strategy="ddp", devices=2, max_steps=6),
            "manual": dict(strategy="ddp_sharded", devices=2, max_steps=6, manual=True),
        },
    )


def test_parity_resume_on_one_rank_and_consolidate(tmp_path, runs):
    ddp, zero = runs["ddp"], runs["zero"]
    assert zero["strategy"] == "ddp_sharded"
    assert_close_losses(zero["losses"], ddp["losses"], RTOL, "ddp_sharded vs ddp")

    ckpt, out = runs["saved"]["root"] / "ckpt", runs["saved"]["root"] / "zero1.safetensors"
    # The consolidated optimizer state loads on any world size: resume on one process with the same
    # global batch (one batch of 16 = two ranks' batches of 8, the same samples).
    single = run_workload(
        tmp_path,
        strategy="single",
        devices=1,
        batch_size=16,
        max_steps=6,
        resume=str(ckpt),
        launcher="in-process",
        **{k: v for k, v in TRAIN.items() if k != "devices"},
    )
    assert_close_losses(single["losses"], ddp["losses"][6:], 1e-5, "resumed on 1 rank vs straight")

    from safetensors.torch import load_file

    from lightspeed.demos.gpt import SIZES, GPTModule

    plain = GPTModule(dataclasses.replace(SIZES["tiny"], bias=False))
    plain.configure_model()
    plain.load_state_dict(load_file(str(out)), strict=True)


def test_manual_optimization_matches_automatic(runs):
    assert_close_losses(
        runs["manual"]["losses"],
        runs["ddp-plain"]["losses"],
        RTOL,
        "ddp_sharded manual vs ddp automatic",
    )


def test_optimizer_that_is_not_a_torch_optimizer_is_refused(tmp_path):
    # In this process, on a world of one: the same setup check as on 2 ranks.
    with pytest.raises(ConfigError, match="needs a torch.optim.Optimizer.*DuckSGD"):
        run_workload(
            tmp_path,
            strategy="ddp_sharded",
            devices=1,
            max_steps=1,
            duck_optimizer=True,
            launcher="in-process",
        )


def test_rebuilt_optimizer_keeps_class_groups_and_scheduler(tmp_path):
    """In one process with a world of one: the rebuild copies class, per-group options and rebinds
    schedulers."""
    import torch.distributed as dist

    from lightspeed.strategies.base import SchedulerConfig
    from lightspeed.strategies.zero1 import build_zero_optimizer, rebind_schedulers

    ours = (
        not dist.is_initialized()
    )  # an in-process Trainer of an earlier test may have joined a group of one
    if ours:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        opt = torch.optim.AdamW(
            [
                {"params": [model.weight], "weight_decay": 0.1},
                {"params": [model.bias], "weight_decay": 0.0},
            ],
            lr=0.01,
            betas=(0.9, 0.95),
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
        zero = build_zero_optimizer(opt)
        [cfg] = rebind_schedulers([SchedulerConfig(sched, "step")], [opt], [zero])
        assert type(zero.optim) is torch.optim.AdamW and zero.optim.defaults["betas"] == (0.9, 0.95)
        assert [g["weight_decay"] for g in zero.param_groups] == [0.1, 0.0]
        model(torch.randn(2, 4)).sum().backward()
        zero.step()
        cfg.scheduler.step()
        zero.step()  # the local optimizer picks up the scheduler's lr at its next step
        assert [g["lr"] for g in zero.optim.param_groups] == pytest.approx([0.005, 0.005])
        with pytest.raises(ConfigError, match="needs a torch.optim.Optimizer.*builtins.object"):
            build_zero_optimizer(object())
    finally:
        if ours:
            dist.destroy_process_group()
