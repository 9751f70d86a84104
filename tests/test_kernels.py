"""Fused optimizer kernels and regional compilation change speed, not results: proven by per-step
losses.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_kernels.py

On CPU: torch's fused Adam/AdamW/SGD kernels, DeepSpeed's FusedAdam (its CPU build of the same op;
`make test` builds it first) and torch.compile with inductor (C++ via gcc; the compile test takes
~30 s on 2 cores).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

import lightspeed as ls
from helpers import assert_close_losses, run_jobs
from lightspeed.demos.gpt import GPT, SIZES, ByteWindows, GPTModule, stdlib_corpus
from lightspeed.errors import ConfigError
from lightspeed.perf.kernels import (
    RECOMPILE_CALLS,
    CompiledStep,
    apply_compile,
    apply_fused_optimizers,
    compiled_frames,
    compiled_ran,
    skip_alignment_asserts,
)
from lightspeed.strategies.base import SchedulerConfig
from lightspeed.strategies.deepspeed.ops import fused_adam

CFG = dataclasses.replace(SIZES["tiny"], bias=False)
STEPS = 30
RTOL = 1e-5  # fp32, 30 AdamW steps: the fused kernel reorders the same arithmetic


def _batches(n: int = STEPS):
    data = ByteWindows(stdlib_corpus(60_000), CFG.block_size)
    return [b for b, _ in zip(DataLoader(data, batch_size=8), range(n))]


def _user_optimizer(model: torch.nn.Module):
    """What GPTModule.configure_optimizers writes: two groups (decay / no decay), a warmup
    LambdaLR."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
    )
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


def _run(
    fuse: bool, backend: str = "torch", device_type: str = "cpu"
) -> tuple[list[float], object, object]:
    torch.manual_seed(0)
    model = GPT(CFG)
    opt, sched = _user_optimizer(model)
    if fuse:
        [opt], note = apply_fused_optimizers(
            [opt],
            [SchedulerConfig(sched, "step")],
            backend=backend,
            fused_adam=fused_adam,
            device_type=device_type,
            offload=False,
        )
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
    # Every group keeps its own options, and the schedule kept stepping the new optimizer (warmup
    # over at 10).
    assert [(g["weight_decay"], g["initial_lr"], g["lr"]) for g in opt.param_groups] == [
        (0.1, 3e-3, 3e-3),
        (0.0, 1e-3, 1e-3),
    ]
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in ref_opt.param_groups]
    assert_close_losses(losses, ref, rtol=RTOL, what="fused AdamW vs AdamW as written")
    assert ref[-1] < ref[0] - 0.5  # it trains: the comparison is not between two flat lines


def test_deepspeed_fused_adam_same_losses(as_written):
    # backend="deepspeed" picks FusedAdam for CUDA; its CPU build runs the same replacement code
    # here.
    pytest.importorskip("deepspeed")
    losses, opt, sched = _run(fuse=True, backend="deepspeed", device_type="cuda")
    assert type(opt).__name__ == "FusedAdam" and opt.adam_w_mode == 1 and sched.optimizer is opt
    assert [(g["weight_decay"], g["initial_lr"]) for g in opt.param_groups] == [
        (0.1, 3e-3),
        (0.0, 1e-3),
    ]
    assert_close_losses(
        losses, as_written[0], rtol=RTOL, what="DeepSpeed FusedAdam vs AdamW as written"
    )


def test_what_stays_as_written():
    p = [torch.nn.Parameter(torch.ones(3))]

    class MyAdam(torch.optim.Adam):
        pass

    kept = [
        torch.optim.AdamW(p, fused=False),
        torch.optim.Adam(p, foreach=True),
        MyAdam(p),
        torch.optim.RMSprop(p),
        torch.optim.AdamW([torch.nn.Parameter(torch.empty(3, device="meta"))]),
    ]
    out, note = apply_fused_optimizers(kept, [], backend="torch", device_type="cpu", offload=False)
    assert note is None and all(a is b for a, b in zip(out, kept))
    adam = torch.optim.Adam(p)
    out, note = apply_fused_optimizers(
        [adam], [], backend="deepspeed", device_type="cuda", offload=True, fused_adam=fused_adam
    )
    assert out == [adam] and note is None  # offload: DeepSpeedCPUAdam is chosen by the strategy
    p[0].grad = torch.ones(3)
    adam.step()  # an optimizer that has stepped keeps its state and its kernel
    assert (
        apply_fused_optimizers([adam], [], backend="torch", device_type="cpu", offload=False)[1]
        is None
    )
    sgd = torch.optim.SGD(p, lr=0.1, momentum=0.9)
    [new], note = apply_fused_optimizers(
        [sgd], [], backend="torch", device_type="cpu", offload=False
    )
    assert (
        type(new) is torch.optim.SGD and new.defaults["fused"] and new.defaults["momentum"] == 0.9
    )
    assert "SGD(fused=True)" in note


def test_optimizer_kernels_flag_is_validated():
    with pytest.raises(ConfigError, match="optimizer_kernels='fast'"):
        ls.Trainer(optimizer_kernels="fast")
    assert (
        ls.Trainer(optimizer_kernels="as_written", logger=False).config.step.optimizer_kernels
        == "as_written"
    )


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
        trainer = ls.Trainer(
            devices=1,
            accelerator="cpu",
            max_steps=12,
            seed=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            default_root_dir=str(tmp_path),
            optimizer_kernels="fused" if fuse else "as_written",
        )
        trainer.fit(
            module, DataLoader(ByteWindows(stdlib_corpus(60_000), CFG.block_size), batch_size=8)
        )
        runs[fuse] = module.losses
        assert trainer.strategy.schedulers[0].scheduler.optimizer is trainer.strategy.optimizers[0]
        assert trainer.strategy.optimizers[0].defaults["fused"] is (True if fuse else None)
    assert_close_losses(runs[True], runs[False], rtol=RTOL, what="Trainer: fused vs as written")


# ----------------------------------------------------------------------------------------------
# compile
def test_apply_compile_regional_same_losses_and_names():
    """Inductor on CPU (~30 s here): the compiled blocks give the eager losses and keep every
    state_dict key."""
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
    from lightspeed.demos.gpt import Block
    from lightspeed.strategies.common import apply_activation_checkpointing

    model = GPT(CFG)
    apply_activation_checkpointing(model, [Block])
    # A checkpointed block is compiled with its wrapper, recomputation inside the graph.
    assert apply_compile(model, block_classes=[Block]) == ["blocks.0", "blocks.1"]
    assert model.blocks[0]._compiled_call_impl is not None
    assert model.blocks[0]._checkpoint_wrapped_module._compiled_call_impl is None
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    assert apply_compile(net) == ["0", "2"]  # no ModuleList: the children that hold parameters
    # The silent no-op: compiled modules that the step never calls. Nothing compiles, so
    # nothing ran.
    before = compiled_frames()
    eager = GPT(CFG)
    eager(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    assert not compiled_ran(before)


# ----------------------------------------------------------------------------------------------
# compiled step
class StepModule(GPTModule):
    """The loss written in `training_step` around `self.model(...)`, as the GPU suite's user module
    does."""

    def __init__(self, log: bool = True):
        super().__init__(CFG, lr=3e-3, warmup_steps=5)
        self.with_log, self.losses = log, []

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        if self.with_log:  # runs eagerly, a graph break (Module.log is torch.compiler.disable'd)
            self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"])  # detached, as Lightning hands it over


class AppendingStepModule(StepModule):
    """A step that changes Python state of its own: torch.compile guards on the list's length, so
    each call would compile again."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.model(x).float().view(-1, CFG.vocab_size), y.view(-1))
        self.appended.append(loss.detach())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.losses = self.appended


class GraphRecorder:
    """A torch.compile backend that runs each graph as captured and keeps what it calls and its
    input names."""

    def __init__(self):
        self.graphs: list[tuple[set[str], list[str]]] = []

    def __call__(self, gm, example_inputs):
        inputs = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        self.graphs.append(({str(n.target) for n in gm.graph.nodes}, inputs))
        return gm.forward

    def calls(self, name: str) -> bool:
        """Whether some captured graph calls an op whose name contains `name`."""
        return any(name in t for targets, _ in self.graphs for t in targets)


def _tokens():
    return DataLoader(ByteWindows(stdlib_corpus(60_000), CFG.block_size), batch_size=8)


def test_compiled_step_fuses_the_loss_and_leaves_the_modules_as_they_were():
    """The step's graphs hold the cross-entropy and read no parameter (the model ran outside them,
    its blocks in their own compiled code); after each call no module keeps what made it opaque."""
    recording = GraphRecorder()
    torch.manual_seed(0)
    module = StepModule(log=False)  # self.log needs a Trainer
    module.configure_model()
    assert apply_compile(module) == ["model.blocks.0", "model.blocks.1"]
    step = CompiledStep(module, backend=recording)
    before = compiled_frames()
    for batch_idx, batch in enumerate(_batches(3)):
        step(batch, batch_idx).backward()
    assert compiled_ran(before) and step.failed is None
    assert recording.calls("cross_entropy"), recording.graphs
    assert not any("parameters" in name for _, names in recording.graphs for name in names), (
        recording.graphs
    )
    assert all("forward" not in m.__dict__ for m in module.modules())
    assert not {"log", "log_dict", "print"} & set(module.__dict__)  # made opaque for the call only
    assert [n for n, m in module.named_modules() if m._compiled_call_impl is not None] == [
        "model.blocks.0",
        "model.blocks.1",
    ]
    copy.deepcopy(module)(_batches(1)[0][0])  # a deep copy runs as written


def test_whole_compile_on_one_device_traces_the_model_inside_the_step():
    """`apply_compile(whole=True)`, the single strategy's: the modules the step calls are compiled
    as units (a ModuleList in their place gives its items; a plain Sequential its children with
    parameters), and the compiled step traces the model inside its own graph: the cross-entropy and
    the blocks' parameters in one graph."""
    assert apply_compile(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)),
        whole=True,
    ) == ["0", "2"]
    stack = torch.nn.Module()
    stack.layers, stack.scale = (
        torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)]),
        torch.nn.ReLU(),
    )
    assert apply_compile(stack, whole=True) == ["layers.0", "layers.1"]
    recording = GraphRecorder()
    torch.manual_seed(0)
    module = StepModule(log=False)
    module.configure_model()
    assert apply_compile(module, whole=True, options={"backend": recording}) == ["model"]
    step = CompiledStep(module, backend=recording)
    for batch_idx, batch in enumerate(_batches(2)):
        step(batch, batch_idx).backward()
    assert step.failed is None
    weight = "model_modules_blocks_modules_0_modules_attn_modules_qkv_parameters_weight"
    assert any(
        any("cross_entropy" in t for t in targets) and any(weight in n for n in names)
        for targets, names in recording.graphs
    ), recording.graphs
    assert [n for n, m in module.named_modules() if m._compiled_call_impl is not None] == ["model"]


def _fit_step_module(
    tmp_path, compile: bool, appending: bool = False
) -> tuple[list[float], object]:
    module = AppendingStepModule() if appending else StepModule()
    module.appended = []
    trainer = ls.Trainer(
        devices=1,
        accelerator="cpu",
        max_steps=8,
        seed=0,
        logger=False,
        compile=compile,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(module, _tokens())
    return [float(v) for v in module.losses], trainer


def test_trainer_compile_same_losses_and_a_step_that_recompiles_runs_as_written(tmp_path):
    """compile=True on one device: the model compiled whole, inside the compiled step, gives the
    eager losses (fp32, 8 steps, rtol 1e-5). A step that changes Python state of its own (a list it
    appends to) would recompile at every call: after RECOMPILE_CALLS calls in a row it runs as
    written, with a warning, and the losses stay."""
    eager, _ = _fit_step_module(tmp_path, compile=False)
    compiled, trainer = _fit_step_module(tmp_path, compile=True)
    assert trainer._run.training_step.failed is None and trainer._run.training_step.calls == 8
    assert_close_losses(compiled, eager, rtol=1e-5, what="compile=True vs eager")
    with pytest.warns(
        UserWarning, match="training_step runs as written from now on, it compiled again"
    ):
        appending, trainer = _fit_step_module(tmp_path, compile=True, appending=True)
    assert (
        trainer._run.training_step.calls == RECOMPILE_CALLS + 1
    )  # the first call compiles; then 3 in a row
    assert_close_losses(appending, eager, rtol=1e-5, what="step given up vs eager")


COMPILED = ["ddp", "fsdp", "deepspeed_stage_3"]


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory) -> dict[str, dict]:
    """Eager DDP, then each of COMPILED with compile on, one after another in one launched job
    (helpers.run_jobs: the ranks start once)."""
    run = dict(devices=2, max_steps=6)
    jobs = {"ddp_eager": dict(strategy="ddp", **run)}
    for strategy in COMPILED:
        jobs[strategy] = dict(strategy=strategy, compile={"backend": "aot_eager"}, **run)
    return run_jobs(tmp_path_factory.mktemp("compiled"), jobs)


@pytest.mark.parametrize("strategy", COMPILED)
def test_compile_under_each_sharding_strategy_gives_ddps_losses(on_two_ranks, strategy):
    """compile on 2 gloo ranks: blocks compiled before DDP / FSDP2 / DeepSpeed wrap the model, the
    step around it compiled with their hooks outside its graph; per-step losses equal eager DDP's
    (rtol 1e-5). The graphs are captured as with inductor (dynamo, AOT autograd) but run by the
    "aot_eager" backend: inductor's C++ build on 2 ranks would cost a minute, and the tests above
    check its code on one device."""
    res = on_two_ranks[strategy]
    assert res["step_fallback"] is None
    assert_close_losses(
        res["losses"],
        on_two_ranks["ddp_eager"]["losses"],
        rtol=1e-5,
        what=f"{strategy} compile=True vs ddp eager",
    )


def test_lightnings_torch_compile_of_the_module_is_trained_compiled_and_saved_with_plain_keys(
    tmp_path,
):
    """Lightning's documented way, `trainer.fit(torch.compile(model, ...))`: the module inside the
    wrapper is trained compiled (blocks, then the step) with the wrapper's backend, and its
    checkpoint loads into a plain module (no `_orig_mod.`)."""
    recording = GraphRecorder()
    eager, _ = _fit_step_module(tmp_path, compile=False)
    inner = StepModule()
    trainer = ls.Trainer(
        devices=1,
        accelerator="cpu",
        max_steps=8,
        seed=0,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(torch.compile(inner, backend=recording), _tokens())
    assert set(trainer.config.step.compile) == {"backend"} and isinstance(
        trainer._run.training_step, CompiledStep
    )
    assert recording.calls("cross_entropy"), recording.graphs
    assert trainer._run.training_step.failed is None
    assert_close_losses(
        [float(v) for v in inner.losses], eager, rtol=1e-5, what="fit(torch.compile(m)) vs eager"
    )
    trainer.save_checkpoint(tmp_path / "ckpt")
    loaded = StepModule.load_from_checkpoint(tmp_path / "ckpt")
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), inner.state_dict().values())
    )


def test_compile_options_reach_the_blocks_and_the_step_and_bad_ones_fail_before_start(tmp_path):
    """Trainer(compile={...}): torch.compile's options (here a recording backend) apply to the
    blocks and to the step; an unknown key or mode is a ConfigError naming `compile` before anything
    runs."""
    recording = GraphRecorder()
    trainer = ls.Trainer(
        devices=1,
        accelerator="cpu",
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        compile={"backend": recording},
    )
    trainer.fit(StepModule(), _tokens())
    assert recording.calls("cross_entropy"), recording.graphs  # the step
    assert recording.calls("scaled_dot_product_attention"), recording.graphs  # a block
    for bad, words in (
        ({"mode": "fastest"}, "torch.compile's modes"),
        ({"fulgraph": True}, "unknown keys"),
        ("yes", "expected True, False or a dict"),
    ):
        with pytest.raises(ConfigError, match=f"compile=.*{words}"):
            ls.Trainer(compile=bad)


def test_compiling_turns_inductors_alignment_asserts_off_unless_the_user_chose(monkeypatch):
    """Inductor's alignment check fails on an output a fallback op leaves undefined (cuDNN attention
    without grad: validation through compiled blocks or DeepCompile's engine crashed on an H200;
    docs/benchmarks.md, ninth session), so lightspeed's compile paths turn it off, except where
    TORCHINDUCTOR_ALIGNMENT_ASSERTS says."""
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor, "alignment_asserts", True)
    monkeypatch.setenv("TORCHINDUCTOR_ALIGNMENT_ASSERTS", "1")
    skip_alignment_asserts()
    assert inductor.alignment_asserts is True  # the user's choice stands
    monkeypatch.delenv("TORCHINDUCTOR_ALIGNMENT_ASSERTS")
    apply_compile(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    assert inductor.alignment_asserts is False
    monkeypatch.setattr(inductor, "alignment_asserts", True)
    CompiledStep(StepModule(log=False))
    assert inductor.alignment_asserts is False


def test_matmul_precision_hint_only_where_fp32_matmuls_could_use_tensor_cores():
    """Off CUDA, and under mixed precision, there is nothing to say (Lightning prints its hint in
    every precision)."""
    from lightspeed.perf.kernels import matmul_precision_hint
    from lightspeed.specs import RunSpec

    assert matmul_precision_hint(RunSpec(device_type="cpu", precision="32-true")) is None
    assert matmul_precision_hint(RunSpec(device_type="cuda", precision="bf16-mixed")) is None


@pytest.mark.gpu
def test_matmul_precision_hint_on_a_gpu_in_fp32():
    """On an Ampere-or-later GPU in 32-true, the hint names the call that turns TF32 on; once
    called, no hint."""
    from lightspeed.perf.kernels import matmul_precision_hint
    from lightspeed.specs import RunSpec

    spec = RunSpec(device_type="cuda", precision="32-true")
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        hint = matmul_precision_hint(spec)
        if torch.cuda.get_device_capability()[0] >= 8:
            assert (
                "torch.set_float32_matmul_precision('high')" in hint
                and "precision='bf16-mixed'" in hint
            )
        torch.set_float32_matmul_precision("high")
        assert matmul_precision_hint(spec) is None
    finally:
        torch.set_float32_matmul_precision(before)
