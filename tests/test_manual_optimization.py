"""Manual optimization (`automatic_optimization = False`) under FSDP2: the user's `manual_backward` reduce-scatters
the gradients on every backward and `opt.step()` updates the local shards, plain torch. The same module
(tests/workload.py's `manual` option: zero_grad, manual_backward, step in training_step) must give DDP's losses:
relative 1e-5 per step, fp32 on 2 CPU ranks (only the reduction order differs). The FSDP checkpoint written by the
manual run holds every optimizer's state: with two optimizers, a resume replays the same losses. examples/gan.py
(toggle_optimizer, self(z) then self.discriminator inside training_step) gives DDP's g_loss and d_loss within 1e-5
under fsdp, and its resume from step 4 replays steps 5-8 exactly.
Under DeepSpeed stages 2 and 3, one engine holds the one optimizer (opt.step() is engine.step()), with the same
1e-5 against DDP. Several optimizers get one engine each (stages 1 and 2): examples/gan.py gives DDP's g_loss and
d_loss per step within 1e-5 relative under deepspeed_stage_2, and a resume from its step-4 checkpoint (one tag per
engine) replays steps 5-8 within 1e-6; one loss reaching both engines' parameters (the workload's two optimizers)
matches DDP and resumes too (slow). Stage 3 with several optimizers is refused at setup. About 3 min in all.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from helpers import ROOT, assert_close_losses, launch, run_workload

RUN = dict(devices=2, batch_size=2, max_steps=6, manual=True)


@pytest.fixture(scope="module")
def ddp(tmp_path_factory):
    return run_workload(tmp_path_factory.mktemp("ddp"), strategy="ddp", **RUN)


def test_fsdp_manual_matches_ddp_and_resumes(tmp_path, ddp):
    fsdp = run_workload(tmp_path, strategy="fsdp", ckpt_every=3, **RUN)
    assert fsdp["global_step"] == 6 == ddp["global_step"]
    assert_close_losses(fsdp["losses"], ddp["losses"], 1e-5, "fsdp vs ddp, manual optimization")


def test_fsdp_manual_two_optimizers_checkpoint_holds_both(tmp_path):
    # Two SGD optimizers with momentum over disjoint parameters (a GAN's shape), stepped by hand. The resume from
    # step 3 replays the straight run only if the checkpoint restored both optimizers' momentum buffers.
    two = dict(RUN, two_optimizers=True)
    (tmp_path / "ddp").mkdir()
    ddp = run_workload(tmp_path / "ddp", strategy="ddp", **two)
    fsdp = run_workload(tmp_path, strategy="fsdp", ckpt_every=3, **two)
    assert_close_losses(fsdp["losses"], ddp["losses"], 1e-5, "fsdp vs ddp, manual, two optimizers")
    step3 = sorted(tmp_path.glob("checkpoints/*step=3*"))
    assert len(step3) == 1, list(tmp_path.glob("checkpoints/*"))
    resumed = run_workload(tmp_path, strategy="fsdp", resume=str(step3[0]), **two)
    assert_close_losses(resumed["losses"], fsdp["losses"][3:], 1e-6, "fsdp manual, resumed at step 3")


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", pytest.param("deepspeed_stage_3", marks=pytest.mark.slow)])
def test_deepspeed_manual_matches_ddp(tmp_path, ddp, strategy):
    # One engine, one optimizer: the module's opt.step() is engine.step(), manual_backward is engine.backward.
    out = run_workload(tmp_path, strategy=strategy, **RUN)
    assert out["global_step"] == 6 == out["deepspeed"]["global_steps"]
    assert_close_losses(out["losses"], ddp["losses"], 1e-5, f"{strategy} vs ddp, manual optimization")


def _gan(cwd: Path, strategy: str, *more: str) -> list[tuple[float, float]]:
    """Runs examples/gan.py on 2 ranks in `cwd`; returns the (g_loss, d_loss) of each step its run logged."""
    run = launch([str(ROOT / "examples" / "gan.py"), "--devices", "2", "--strategy", strategy, *more], cwd)
    assert run.returncode == 0, f"gan under {strategy} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    log = sorted(cwd.glob("lightspeed_logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:]))[-1]
    return [(float(r["g_loss"]), float(r["d_loss"])) for r in csv.DictReader(log.open()) if r["g_loss"]]


@pytest.fixture(scope="module")
def gan_ddp(tmp_path_factory):
    # examples/gan.py: two Adam optimizers, toggle_optimizer around each backward, 8 steps. Under DDP a GAN needs
    # ddp_find_unused_parameters_true (the toggled-off half gets no gradient), as under Lightning.
    return _gan(tmp_path_factory.mktemp("gan_ddp"), "ddp_find_unused_parameters_true")


def test_gan_one_engine_per_optimizer_matches_ddp_and_resumes(tmp_path, gan_ddp):
    ddp = gan_ddp
    ds = _gan(tmp_path, "deepspeed_stage_2")
    assert len(ds) == len(ddp) == 8
    for name, i in (("g_loss", 0), ("d_loss", 1)):
        assert_close_losses([s[i] for s in ds], [s[i] for s in ddp], 1e-5, f"gan {name}, deepspeed_stage_2 vs ddp")
    step4 = tmp_path / "checkpoints" / "epoch=0-step=4"
    assert (step4 / "deepspeed").is_dir() and (step4 / "deepspeed_1").is_dir()  # one tag per engine
    resumed = _gan(tmp_path, "deepspeed_stage_2", "--ckpt_path", str(step4))
    assert len(resumed) == 4  # steps 5 to 8
    for name, i in (("g_loss", 0), ("d_loss", 1)):
        assert_close_losses([s[i] for s in resumed], [s[i] for s in ds[4:]], 1e-6, f"gan {name}, resumed at step 4")


def test_gan_under_fsdp_matches_ddp_and_resumes(tmp_path, gan_ddp):
    # The generator and discriminator are FSDP units of their own (strategies/fsdp.py, find_child_units), so
    # toggle_optimizer sees the optimizers' shards and self(z) inside training_step gathers only the generator.
    fsdp = _gan(tmp_path, "fsdp")
    assert len(fsdp) == len(gan_ddp) == 8
    for name, i in (("g_loss", 0), ("d_loss", 1)):
        assert_close_losses([s[i] for s in fsdp], [s[i] for s in gan_ddp], 1e-5, f"gan {name}, fsdp vs ddp")
    # Both Adams' moments are in the step-4 checkpoint: the resume replays steps 5-8 bit for bit.
    resumed = _gan(tmp_path, "fsdp", "--ckpt_path", str(tmp_path / "checkpoints" / "epoch=0-step=4"))
    assert resumed == fsdp[4:]


def test_gan_under_plain_ddp_names_the_strategy_to_use(tmp_path):
    # The discriminator gets no gradient in the generator's backward, which plain DDP cannot reduce; torch's own
    # message names a DistributedDataParallel keyword the user never sees.
    run = launch([str(ROOT / "examples" / "gan.py"), "--devices", "2", "--strategy", "ddp", "--max_steps", "2"],
                 tmp_path)
    assert run.returncode != 0 and "strategy='ddp_find_unused_parameters_true'" in run.stderr, run.stderr[-3000:]


@pytest.mark.slow
def test_deepspeed_two_optimizers_one_engine_each_and_resume(tmp_path):
    # One loss reaching both optimizers' parameters: one backward feeds both engines. Each engine saves under its
    # own tag; the resume from step 3 replays the straight run only if both engines' momentum came back.
    two = dict(RUN, two_optimizers=True)
    (tmp_path / "ddp").mkdir()
    ddp = run_workload(tmp_path / "ddp", strategy="ddp", **two)
    ds = run_workload(tmp_path, strategy="deepspeed_stage_2", ckpt_every=3, **two)
    assert ds["deepspeed"]["optimizers"] == 2
    assert_close_losses(ds["losses"], ddp["losses"], 1e-5, "deepspeed_stage_2 vs ddp, manual, two optimizers")
    step3 = sorted(tmp_path.glob("checkpoints/*step=3*"))
    assert (step3[0] / "deepspeed").is_dir() and (step3[0] / "deepspeed_1").is_dir()
    resumed = run_workload(tmp_path, strategy="deepspeed_stage_2", resume=str(step3[0]), **two)
    assert_close_losses(resumed["losses"], ds["losses"][3:], 1e-6, "deepspeed_stage_2 manual, resumed at step 3")


def test_deepspeed_engine_group_refusals():
    # Checked on every rank at setup, before any engine: no process group needed.
    from lightspeed.errors import ConfigError
    from lightspeed.strategies.deepspeed_multi import check_group

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    two = [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)]
    check_group(2, "32-true", two, "deepspeed_stage_2")  # disjoint parameters: accepted
    with pytest.raises(ConfigError, match="'deepspeed_stage_3'.*stages 1 and 2 only"):
        check_group(3, "32-true", two, "deepspeed_stage_3")
    with pytest.raises(ConfigError, match="16-mixed"):
        check_group(2, "16-mixed", two, "deepspeed_stage_2")
    shared = [two[0], torch.optim.SGD([a.weight, *b.parameters()], lr=0.1)]
    with pytest.raises(ConfigError, match="optimizer 1 .* shares parameters"):
        check_group(2, "32-true", shared, "deepspeed_stage_2")


def test_toggle_optimizer_refuses_an_optimizer_of_none_of_its_parameters():
    # Freezing every parameter would make the backward silently train nothing (FSDP inside a forward shows
    # gathered copies, not the optimizer's shards): an error says so instead.
    from lightspeed import Module

    module = Module()
    module.net = torch.nn.Linear(2, 2)
    own = torch.optim.SGD(module.parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    module.toggle_optimizer(own)
    assert all(p.requires_grad for p in module.parameters())
    module.untoggle_optimizer(own)
    with pytest.raises(RuntimeError, match="none of the optimizer's 2 parameters is a parameter of Module"):
        module.toggle_optimizer(other)


def test_fsdp_manual_units_are_the_called_children():
    # No process group needed: which modules become FSDP units under manual optimization.
    from torch import nn

    from lightspeed.errors import ConfigError
    from lightspeed.strategies.fsdp import find_child_units

    root = nn.Module()
    root.generator, root.discriminator = nn.Linear(2, 2), nn.Linear(2, 2)
    root.heads = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])  # never called itself: its children are
    root.embed, root.unembed = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    root.unembed.weight = root.embed.weight  # tied: one unit of two modules
    units = find_child_units(root, [root.heads[1]])  # heads[1] is a block unit already
    assert units == [root.generator, root.discriminator, root.heads[0], [root.embed, root.unembed]]
    root.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ConfigError, match=r"holds parameters of its own \(scale\).*child module"):
        find_child_units(root, [])
