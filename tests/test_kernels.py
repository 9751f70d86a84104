"""Fused optimizer kernels and regional compilation change speed, not results: proven by per-step losses.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_kernels.py

On CPU: torch's fused Adam/AdamW/SGD kernels, DeepSpeed's FusedAdam (its CPU build of the same op; `make test`
builds it first) and torch.compile with inductor (C++ via gcc; the compile test takes ~30 s on 2 cores).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightspeed as ls
from helpers import assert_close_losses
from lightspeed.errors import ConfigError
from lightspeed.examples.gpt import GPT, SIZES, ByteWindows, GPTModule, stdlib_corpus
from lightspeed.kernels import apply_compile, apply_fused_optimizers, compiled_frames, compiled_ran
from lightspeed.strategies.base import SchedulerConfig

CFG = dataclasses.replace(SIZES["tiny"], bias=False)
STEPS = 30
RTOL = 1e-5  # fp32, 30 AdamW steps: the fused kernel reorders the same arithmetic


def _batches(n: int = STEPS):
    data = ByteWindows(stdlib_corpus(60_000), CFG.block_size)
    return [b for b, _ in zip(DataLoader(data, batch_size=8), range(n))]


def _user_optimizer(model: torch.nn.Module):
    """What GPTModule.configure_optimizers writes: two groups (decay / no decay), a warmup LambdaLR."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0,
                                                                       "lr": 1e-3}], lr=3e-3, betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))


def _train(model, opt, sched, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x).view(-1, CFG.vocab_size), y.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def _run(fuse: bool, backend: str = "torch", device_type: str = "cpu") -> tuple[list[float], object, object]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt, sched = _user_optimizer(model)
    if fuse:
        [opt], note = apply_fused_optimizers([opt], [SchedulerConfig(sched, "step")], backend=backend,
                                             device_type=device_type, offload=False)
        assert note and "LR schedulers rebound" in note
    return _train(model, opt, sched, _batches()), opt, sched


@pytest.fixture(scope="module")
def as_written():
    return _run(fuse=False)


def test_fused_adamw_same_losses_groups_and_schedule(as_written):
    ref, ref_opt, _ = as_written
    losses, opt, sched = _run(fuse=True)
    assert type(opt) is torch.optim.AdamW and all(g["fused"] for g in opt.param_groups)
    assert sched.optimizer is opt
    # Every group keeps its own options, and the schedule kept stepping the new optimizer (warmup over at 10).
    assert [(g["weight_decay"], g["initial_lr"], g["lr"]) for g in opt.param_groups] == [
        (0.1, 3e-3, 3e-3), (0.0, 1e-3, 1e-3)]
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert_close_losses(losses, ref, rtol=RTOL, what="fused AdamW vs AdamW as written")
    assert ref[-1] < ref[0] - 0.5  # it trains: the comparison is not between two flat lines


def test_deepspeed_fused_adam_same_losses(as_written):
    # backend="deepspeed" picks FusedAdam for CUDA; its CPU build runs the same replacement code here.
    pytest.importorskip("deepspeed")
    losses, opt, sched = _run(fuse=True, backend="deepspeed", device_type="cuda")
    assert type(opt).__name__ == "FusedAdam" and opt.adam_w_mode == 1 and sched.optimizer is opt
    assert [(g["weight_decay"], g["initial_lr"]) for g in opt.param_groups] == [(0.1, 3e-3), (0.0, 1e-3)]
    assert_close_losses(losses, as_written[0], rtol=RTOL, what="DeepSpeed FusedAdam vs AdamW as written")


def test_what_stays_as_written():
    p = [torch.nn.Parameter(torch.ones(3))]

    class MyAdam(torch.optim.Adam):
        pass

    kept = [torch.optim.AdamW(p, fused=False), torch.optim.Adam(p, foreach=True), MyAdam(p),
            torch.optim.RMSprop(p), torch.optim.AdamW([torch.nn.Parameter(torch.empty(3, device="meta"))])]
    out, note = apply_fused_optimizers(kept, [], backend="torch", device_type="cpu", offload=False)
    assert note is None and all(a is b for a, b in zip(out, kept))
    adam = torch.optim.Adam(p)
    out, note = apply_fused_optimizers([adam], [], backend="deepspeed", device_type="cuda", offload=True)
    assert out == [adam] and note is None  # offload: DeepSpeedCPUAdam is chosen by the strategy
    p[0].grad = torch.ones(3)
    adam.step()  # an optimizer that has stepped keeps its state and its kernel
    assert apply_fused_optimizers([adam], [], backend="torch", device_type="cpu", offload=False)[1] is None
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9)
    [new], note = apply_fused_optimizers([sgd], [], backend="torch", device_type="cpu", offload=False)
    assert type(new) is torch.optim.SGD and new.defaults["fused"] and new.defaults["momentum"] == 0.9
    assert "SGD(fused=True)" in note


def test_optimizer_kernels_flag_is_validated():
    with pytest.raises(ConfigError, match="optimizer_kernels='fast'"):
        ls.Trainer(optimizer_kernels="fast")
    assert ls.Trainer(optimizer_kernels="as_written", logger=False).cfg.optimizer_kernels == "as_written"


class UserAdamW(GPTModule):
    """The GPT as a user writes it: torch AdamW with fused and foreach unset, an LR schedule."""

    def __init__(self, fuse: bool):
        super().__init__(CFG, lr=3e-3, warmup_steps=5)
        self.fuse, self.losses = fuse, []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.item())
        return loss


def test_trainer_single_device_fused_same_losses(tmp_path):
    runs = {}
    for fuse in (False, True):
        module = UserAdamW(fuse)
        # The user's plain AdamW: the Trainer fuses it by default; "as_written" keeps it.
        trainer = ls.Trainer(devices=1, accelerator="cpu", max_steps=12, seed=0, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, default_root_dir=str(tmp_path),
                             optimizer_kernels="fused" if fuse else "as_written")
        trainer.fit(module, DataLoader(ByteWindows(stdlib_corpus(60_000), CFG.block_size), batch_size=8))
        runs[fuse] = module.losses
        assert trainer.strategy.schedulers[0].scheduler.optimizer is trainer.strategy.optimizers[0]
        assert trainer.strategy.optimizers[0].defaults["fused"] is (True if fuse else None)
    assert_close_losses(runs[True], runs[False], rtol=RTOL, what="Trainer: fused vs as written")


# ---------------------------------------------------------------------------------------------- compile
def test_apply_compile_regional_same_losses_and_names():
    """Inductor on CPU (~30 s here): the compiled blocks give the eager losses and keep every state_dict key."""
    batches = _batches(4)
    runs = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = GPT(CFG)
        keys = list(model.state_dict())
        before = compiled_frames()
        if compiled:
            assert apply_compile(model) == ["blocks.0", "blocks.1"]
            assert list(model.state_dict()) == keys
        opt, sched = _user_optimizer(model)
        runs[compiled] = _train(model, opt, sched, batches)
        assert compiled_ran(before) is compiled
    assert_close_losses(runs[True], runs[False], rtol=1e-5, what="regionally compiled vs eager")


def test_apply_compile_picks_blocks_and_detects_nothing_ran():
    from lightspeed.examples.gpt import Block
    from lightspeed.strategies.common import apply_activation_checkpointing

    model = GPT(CFG)
    apply_activation_checkpointing(model, [Block])
    # A checkpointed block is compiled with its wrapper, recomputation inside the graph.
    assert apply_compile(model, block_classes=[Block]) == ["blocks.0", "blocks.1"]
    assert model.blocks[0]._compiled_call_impl is not None
    assert model.blocks[0]._checkpoint_wrapped_module._compiled_call_impl is None
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    assert apply_compile(net) == ["0", "2"]  # no ModuleList: the children that hold parameters
    # The silent no-op: compiled modules that the step never calls. Nothing compiles, so nothing ran.
    before = compiled_frames()
    eager = GPT(CFG)
    eager(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    assert not compiled_ran(before)
