"""Manual optimization (`automatic_optimization = False`) under FSDP2: the user's `manual_backward`
reduce-scatters the gradients on every backward and `opt.step()` updates the local shards, plain
torch. The same module
(tests/workload.py's `manual` option: zero_grad, manual_backward, step in training_step) must give
DDP's losses: relative 1e-5 per step, fp32 on 2 CPU ranks (only the reduction order differs). The
FSDP checkpoint written by the manual run holds every optimizer's state: with two optimizers, a
resume replays the same losses. examples/gan.py (toggle_optimizer, self(z) then self.discriminator
inside training_step) gives DDP's g_loss and d_loss within 1e-5 under fsdp, and its resume from step
4 replays steps 5-8 exactly. Under DeepSpeed stages 2 and 3, one engine holds the one optimizer
(opt.step() is engine.step()), with the same 1e-5 against DDP. Several optimizers get one engine
each (stages 1 and 2): examples/gan.py gives DDP's g_loss and d_loss per step within 1e-5 relative
under deepspeed_stage_2, and a resume from its step-4 checkpoint (one tag per engine) replays steps
5-8 within 1e-6; one loss reaching both engines' parameters (the workload's two optimizers) matches
DDP and resumes too (slow). Under deepspeed_stage_3 each engine partitions only its optimizer's
submodules (the generator, the discriminator): the GAN gives DDP's losses within 1e-5 and resumes
within 1e-6 too, and load_from_checkpoint merges both engines' shards into DDP's weights. The
default tests' fits run in two launched jobs (fixtures `runs` and `gans`: the ranks start once for
each) and one failing run; about 25 s in all on 2 cores.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from helpers import ROOT, assert_close_losses, launch, run_jobs, run_workload

RUN = dict(devices=2, batch_size=2, max_steps=6, manual=True)
TWO = dict(RUN, two_optimizers=True)
CLIPPED = dict(TWO, manual_clip=0.05)
STEP3 = "checkpoints/epoch=0-step=3.ckpt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """The workload runs of the default tests below, in one launched job (helpers.run_jobs): one
    start-up of the 2 ranks for ten fits. Name -> rank 0's result."""
    tmp = tmp_path_factory.mktemp("manual")
    return run_jobs(
        tmp,
        {
            "ddp": dict(strategy="ddp", **RUN),
            "fsdp": dict(strategy="fsdp", ckpt_every=3, **RUN),
            # Two SGD optimizers with momentum over disjoint parameters (a GAN's shape).
            "ddp_two": dict(strategy="ddp", **TWO),
            "fsdp_two": dict(strategy="fsdp", ckpt_every=3, **TWO),
            "fsdp_two_resumed": dict(strategy="fsdp", resume=str(tmp / "fsdp_two" / STEP3), **TWO),
            "ddp_clip": dict(strategy="ddp", **CLIPPED),
            "fsdp_clip": dict(strategy="fsdp", **CLIPPED),
            "deepspeed_stage_2": dict(strategy="deepspeed_stage_2", **RUN),
            # ZeRO-3 with one optimizer: its engine group's split holds the whole module
            "deepspeed_stage_3": dict(strategy="deepspeed_stage_3", **RUN),
            "deepspeed_stage_2_clip": dict(strategy="deepspeed_stage_2", **CLIPPED),
        },
    )


def test_fsdp_manual_matches_ddp_and_resumes(runs):
    fsdp, ddp = runs["fsdp"], runs["ddp"]
    assert fsdp["global_step"] == 6 == ddp["global_step"]
    assert_close_losses(fsdp["losses"], ddp["losses"], 1e-5, "fsdp vs ddp, manual optimization")


def test_fsdp_manual_two_optimizers_checkpoint_holds_both(runs):
    # Two SGD optimizers with momentum over disjoint parameters (a GAN's shape), stepped by hand.
    # The resume from step 3 replays the straight run only if the checkpoint restored both
    # optimizers' momentum buffers.
    fsdp = runs["fsdp_two"]
    assert_close_losses(
        fsdp["losses"], runs["ddp_two"]["losses"], 1e-5, "fsdp vs ddp, manual, two optimizers"
    )
    step3 = sorted(fsdp["root"].glob("checkpoints/*step=3*"))
    assert step3 == [fsdp["root"] / STEP3], list(fsdp["root"].glob("checkpoints/*"))
    assert_close_losses(
        runs["fsdp_two_resumed"]["losses"],
        fsdp["losses"][3:],
        1e-6,
        "fsdp manual, resumed at step 3",
    )


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_deepspeed_manual_matches_ddp(tmp_path, runs, strategy):
    # One engine, one optimizer: the module's opt.step() is engine.step(), manual_backward is
    # engine.backward.
    out = runs.get(strategy) or run_workload(tmp_path, strategy=strategy, **RUN)
    assert out["global_step"] == 6 == out["deepspeed"]["global_steps"]
    assert_close_losses(
        out["losses"], runs["ddp"]["losses"], 1e-5, f"{strategy} vs ddp, manual optimization"
    )


def _gan(cwd: Path, strategy: str, *more: str) -> list[tuple[float, float]]:
    """Runs examples/gan.py on 2 ranks in `cwd`; returns the (g_loss, d_loss) of each step its run
    logged."""
    run = launch(
        [str(ROOT / "examples" / "gan.py"), "--devices", "2", "--strategy", strategy, *more], cwd
    )
    assert run.returncode == 0, (
        f"gan under {strategy} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    )
    return _logged(cwd)


def _logged(cwd: Path) -> list[tuple[float, float]]:
    """The (g_loss, d_loss) per step of the newest run of examples/gan.py in `cwd`."""
    log = sorted(
        cwd.glob("lightning_logs/version_*/metrics.csv"), key=lambda p: int(p.parent.name[8:])
    )[-1]
    return [
        (float(r["g_loss"]), float(r["d_loss"])) for r in csv.DictReader(log.open()) if r["g_loss"]
    ]


STEP4 = "checkpoints/epoch=0-step=4.ckpt"


@pytest.fixture(scope="module")
def gans(tmp_path_factory) -> dict[str, tuple[Path, list]]:
    """examples/gan.py's runs for the default GAN tests below, in one launched job of 2 ranks
    (tests/gan_script.py runs the example's own `main` for each): two Adam optimizers,
    toggle_optimizer around each backward, 8 steps, a checkpoint every 4. Under DDP a GAN needs
    ddp_find_unused_parameters_true (the toggled-off half gets no gradient), as under Lightning.
    Each resume (from the step-4 checkpoint) runs in a folder of its own. Name -> (the run's folder,
    its (g_loss, d_loss) per step)."""
    tmp = tmp_path_factory.mktemp("gan")
    jobs = {
        "ddp": dict(strategy="ddp_find_unused_parameters_true"),
        "fsdp": dict(strategy="fsdp"),
        "fsdp_resumed": dict(strategy="fsdp", ckpt_path=str(tmp / "fsdp" / STEP4)),
        "zero3": dict(strategy="deepspeed_stage_3"),
        "zero3_resumed": dict(strategy="deepspeed_stage_3", ckpt_path=str(tmp / "zero3" / STEP4)),
        "validate_then_fit": dict(validate_then_fit=True),
    }
    for name, job in jobs.items():
        (tmp / name).mkdir()
        job["dir"] = str(tmp / name)
    script = ROOT / "tests" / "gan_script.py"
    run = launch([str(script), json.dumps(list(jobs.values()))], tmp, timeout=600)
    assert run.returncode == 0, f"gan jobs failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    out = {name: (tmp / name, _logged(tmp / name)) for name in jobs if name != "validate_then_fit"}
    losses = json.loads((tmp / "validate_then_fit" / "losses.json").read_text())
    return {**out, "validate_then_fit": (tmp / "validate_then_fit", losses)}


@pytest.fixture(scope="module")
def gan_ddp(gans) -> list[tuple[float, float]]:
    return gans["ddp"][1]


# the engine group under ZeRO-2; ZeRO-3's GAN below and the one-optimizer manual cells cover it
@pytest.mark.slow
def test_gan_one_engine_per_optimizer_matches_ddp_and_resumes(tmp_path, gan_ddp):
    ddp = gan_ddp
    ds = _gan(tmp_path, "deepspeed_stage_2")
    assert len(ds) == len(ddp) == 8
    for name, i in (("g_loss", 0), ("d_loss", 1)):
        assert_close_losses(
            [s[i] for s in ds], [s[i] for s in ddp], 1e-5, f"gan {name}, deepspeed_stage_2 vs ddp"
        )
    step4 = tmp_path / "checkpoints" / "epoch=0-step=4.ckpt"
    assert (step4 / "deepspeed").is_dir() and (step4 / "deepspeed_1").is_dir()  # one tag per engine
    resumed = _gan(tmp_path, "deepspeed_stage_2", "--ckpt_path", str(step4))
    assert len(resumed) == 4  # steps 5 to 8
    for name, i in (("g_loss", 0), ("d_loss", 1)):
        assert_close_losses(
            [s[i] for s in resumed], [s[i] for s in ds[4:]], 1e-6, f"gan {name}, resumed at step 4"
        )


def test_gan_under_fsdp_matches_ddp_and_resumes(gans, gan_ddp):
    # The generator and discriminator are FSDP units of their own (strategies/fsdp_sharding.py,
    # find_child_units), so toggle_optimizer sees the optimizers' shards and self(z) inside
    # training_step gathers only the generator.
    fsdp = gans["fsdp"][1]
    assert len(fsdp) == len(gan_ddp) == 8
    for name, i in (("g_loss", 0), ("d_loss", 1)):
        assert_close_losses(
            [s[i] for s in fsdp], [s[i] for s in gan_ddp], 1e-5, f"gan {name}, fsdp vs ddp"
        )
    # Both Adams' moments are in the step-4 checkpoint: the resume replays steps 5-8 bit for bit.
    assert gans["fsdp_resumed"][1] == fsdp[4:]


def test_gan_under_plain_ddp_names_the_strategy_to_use(tmp_path):
    # The discriminator gets no gradient in the generator's backward, which plain DDP cannot reduce;
    # torch's own
    # message names a DistributedDataParallel keyword the user never sees.
    run = launch(
        [
            str(ROOT / "examples" / "gan.py"),
            "--devices",
            "2",
            "--strategy",
            "ddp",
            "--max_steps",
            "2",
        ],
        tmp_path,
    )
    assert run.returncode != 0 and "strategy='ddp_find_unused_parameters_true'" in run.stderr, (
        run.stderr[-3000:]
    )


@pytest.mark.slow
def test_deepspeed_two_optimizers_one_engine_each_and_resume(tmp_path):
    # One loss reaching both optimizers' parameters: one backward feeds both engines. Each engine
    # saves under its
    # own tag; the resume from step 3 replays the straight run only if both engines' momentum came
    # back.
    two = dict(RUN, two_optimizers=True)
    (tmp_path / "ddp").mkdir()
    ddp = run_workload(tmp_path / "ddp", strategy="ddp", **two)
    ds = run_workload(tmp_path, strategy="deepspeed_stage_2", ckpt_every=3, **two)
    assert ds["deepspeed"]["optimizers"] == 2
    assert_close_losses(
        ds["losses"], ddp["losses"], 1e-5, "deepspeed_stage_2 vs ddp, manual, two optimizers"
    )
    step3 = sorted(tmp_path.glob("checkpoints/*step=3*"))
    assert (step3[0] / "deepspeed").is_dir() and (step3[0] / "deepspeed_1").is_dir()
    resumed = run_workload(tmp_path, strategy="deepspeed_stage_2", resume=str(step3[0]), **two)
    assert_close_losses(
        resumed["losses"], ds["losses"][3:], 1e-6, "deepspeed_stage_2 manual, resumed at step 3"
    )


def test_deepspeed_engine_group_refusals():
    # Checked on every rank at setup, before any engine: no process group needed.
    from lightspeed.errors import ConfigError
    from lightspeed.strategies.deepspeed.multi import check_group, split_module

    a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    two = [torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)]
    check_group("32-true", two, "deepspeed_stage_2")  # disjoint parameters: accepted
    with pytest.raises(ConfigError, match="16-mixed"):
        check_group("16-mixed", two, "deepspeed_stage_2")
    shared = [two[0], torch.optim.SGD([a.weight, *b.parameters()], lr=0.1)]
    with pytest.raises(ConfigError, match="optimizer 1 .* shares parameters"):
        check_group("32-true", shared, "deepspeed_stage_2")

    # ZeRO-3: each engine wraps the fewest submodules holding exactly its optimizer's parameters, at
    # their paths.
    net = torch.nn.Module()
    net.gen = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    net.disc = torch.nn.ModuleDict(dict(body=torch.nn.Linear(2, 2), head=torch.nn.Linear(2, 1)))
    opts = [
        torch.optim.SGD([*net.gen.parameters(), *net.disc.head.parameters()], lr=0.1),
        torch.optim.SGD(net.disc.body.parameters(), lr=0.1),
    ]
    parts = split_module(net, opts, "deepspeed_stage_3")
    assert [sorted(dict(h.named_parameters())) for h in parts] == [
        [
            "module.disc.head.bias",
            "module.disc.head.weight",
            "module.gen.0.bias",
            "module.gen.0.weight",
            "module.gen.1.bias",
            "module.gen.1.weight",
        ],
        ["module.disc.body.bias", "module.disc.body.weight"],
    ]
    assert (
        parts[0].module.gen is net.gen and parts[1].module.disc.body is net.disc.body
    )  # the user's modules
    mixed = [
        torch.optim.SGD([net.gen[0].weight], lr=0.1),
        torch.optim.SGD(
            [net.gen[0].bias, *net.gen[1].parameters(), *net.disc.parameters()], lr=0.1
        ),
    ]
    with pytest.raises(
        ConfigError,
        match=r"optimizer 0 .* trains 'gen.0.weight', held directly by a module "
        r"\(Linear\).*'deepspeed_stage_3'",
    ):
        split_module(net, mixed, "deepspeed_stage_3")
    with pytest.raises(
        ConfigError, match="parameter 'disc.head.weight' is trained by no optimizer"
    ):
        split_module(
            net, [opts[1], torch.optim.SGD(net.gen.parameters(), lr=0.1)], "deepspeed_stage_3"
        )
    net.register_buffer("scale", torch.ones(1))
    with pytest.raises(
        ConfigError, match="buffer 'scale' sits outside every optimizer's submodules"
    ):
        split_module(net, opts, "deepspeed_stage_3")


def test_toggle_optimizer_refuses_an_optimizer_of_none_of_its_parameters():
    # Freezing every parameter would make the backward silently train nothing (FSDP inside a forward
    # shows
    # gathered copies, not the optimizer's shards): an error says so instead.
    from lightspeed import Module

    module = Module()
    module.net = torch.nn.Linear(2, 2)
    own = torch.optim.SGD(module.parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    module.toggle_optimizer(own)
    assert all(p.requires_grad for p in module.parameters())
    module.untoggle_optimizer(own)
    with pytest.raises(
        RuntimeError, match="none of the optimizer's 2 parameters is a parameter of Module"
    ):
        module.toggle_optimizer(other)


def test_fsdp_manual_units_are_the_called_children():
    # No process group needed: which modules become FSDP units under manual optimization.
    from torch import nn

    from lightspeed.errors import ConfigError
    from lightspeed.strategies.fsdp_sharding import find_child_units

    root = nn.Module()
    root.generator, root.discriminator = nn.Linear(2, 2), nn.Linear(2, 2)
    root.heads = nn.ModuleList(
        [nn.Linear(2, 2), nn.Linear(2, 2)]
    )  # never called itself: its children are
    root.embed, root.unembed = nn.Embedding(4, 2), nn.Linear(2, 4, bias=False)
    root.unembed.weight = root.embed.weight  # tied: one unit of two modules
    units = find_child_units(root, [root.heads[1]])  # heads[1] is a block unit already
    assert units == [root.generator, root.discriminator, root.heads[0], [root.embed, root.unembed]]
    root.scale = nn.Parameter(torch.ones(1))
    with pytest.raises(ConfigError, match=r"holds parameters of its own \(scale\).*child module"):
        find_child_units(root, [])


def test_gan_zero3_one_engine_per_submodule_matches_ddp_and_resumes(gans):
    # examples/gan.py under deepspeed_stage_3: the generator's engine and the discriminator's each
    # partition their
    # own network; self.discriminator(self(z)) gathers through both engines' hooks. Same losses as
    # DDP per step.
    import importlib.util

    import lightspeed

    (ddp_dir, ddp), (ds_dir, ds) = gans["ddp"], gans["zero3"]
    assert len(ds) == len(ddp) == 8
    for name, i in (("g_loss", 0), ("d_loss", 1)):
        assert_close_losses(
            [s[i] for s in ds], [s[i] for s in ddp], 1e-5, f"gan {name}, deepspeed_stage_3 vs ddp"
        )
    # load_from_checkpoint merges both engines' shards into the whole module, equal to DDP's after
    # the same 8 steps.
    spec = importlib.util.spec_from_file_location("gan_example", ROOT / "examples" / "gan.py")
    gan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gan)
    mine = gan.GAN.load_from_checkpoint(ds_dir / "checkpoints" / "epoch=0-step=8.ckpt").state_dict()
    theirs = lightspeed.full_state_dict(ddp_dir / "checkpoints" / "epoch=0-step=8.ckpt")
    assert sorted(mine) == sorted(theirs) and any(k.startswith("discriminator.") for k in mine)
    for key, value in theirs.items():
        torch.testing.assert_close(mine[key], value, rtol=1e-5, atol=1e-6, msg=key)
    step4 = ds_dir / STEP4
    assert (step4 / "deepspeed").is_dir() and (step4 / "deepspeed_1").is_dir()  # one tag per engine
    resumed = gans["zero3_resumed"][1]
    assert len(resumed) == 4  # steps 5 to 8
    for name, i in (("g_loss", 0), ("d_loss", 1)):
        assert_close_losses(
            [s[i] for s in resumed], [s[i] for s in ds[4:]], 1e-6, f"gan {name}, zero3 resumed"
        )


def test_deepspeed_clip_gradients_per_engine_matches_ddp(runs):
    # Lightning's self.clip_gradients(opt, gradient_clip_val=..., gradient_clip_algorithm="norm")
    # before each
    # opt.step(), two SGD optimizers (one DeepSpeed engine each): each engine clips its own reduced
    # gradient inside
    # its step, as clip_grad_norm_ over that optimizer's parameters does after DDP's all-reduce. A
    # clip of 0.05 is
    # below the gradient norms here, so it changes the run: the unclipped DDP run differs.
    from lightspeed.errors import ConfigError
    from lightspeed.specs import RunSpec
    from lightspeed.strategies.deepspeed.manual import EngineOptimizer
    from lightspeed.strategies.deepspeed.strategy import DeepSpeed

    with pytest.raises(ConfigError, match="gradient_clip_algorithm='value'.*global norm only"):
        EngineOptimizer(None, None).clip_gradients(1.0, "value")
    # The Trainer's flag would make every engine clip on its own: refused before launch, as in
    # Lightning.
    with pytest.raises(
        ConfigError, match="gradient_clip_val=1.0 is not valid with automatic_optimization=False"
    ):
        DeepSpeed(stage=2).check(RunSpec(gradient_clip_val=1.0, automatic_optimization=False))
    ddp, ds = runs["ddp_clip"], runs["deepspeed_stage_2_clip"]
    assert ds["deepspeed"]["optimizers"] == 2
    assert_close_losses(
        ds["losses"], ddp["losses"], 1e-5, "deepspeed_stage_2 vs ddp, clip_gradients per optimizer"
    )
    # Under FSDP2 it is torch's clip_grad_norm_ over the optimizer's sharded (DTensor) gradients:
    # the global norm.
    assert_close_losses(
        runs["fsdp_clip"]["losses"],
        ddp["losses"],
        1e-5,
        "fsdp vs ddp, clip_gradients per optimizer",
    )
    free = runs["ddp_two"]  # manual_clip=None: no clipping
    assert max(abs(a - b) for a, b in zip(free["losses"], ddp["losses"])) > 1e-3, (
        free["losses"],
        ddp["losses"],
    )


def test_gan_zero3_validate_then_fit(gans, gan_ddp):
    # ZeRO-3 caches its backward hooks' functions on each submodule, bound to the engine that
    # wrapped it first: after an evaluation engine, the generator's and discriminator's engines
    # must bind their own (else the first layer's parameters stay gathered: "Cannot free a ZeRO-3
    # parameter while it is still active"). The leaf modules the evaluation engine used are unmarked
    # for the engine group (a leaf module's gradients are reduced from its backward hook, which the
    # group's per-engine backward never runs). tests/gan_script.py's validate_then_fit: same step-4
    # losses as DDP's run.
    g_loss, d_loss = gans["validate_then_fit"][1]
    assert_close_losses(
        [g_loss, d_loss], list(gan_ddp[3]), 1e-5, "gan under deepspeed_stage_3 after validate"
    )
