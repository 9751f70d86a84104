"""Lightning's checkpoint file, both ways, against real Lightning 2.6.6 (installed beside the venv
in .venv/lightning-ref by `make test`, never importable from the venv itself).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_lightning_ckpt.py

One model (tests/lightning_ckpt_script.py: Adam, an epoch StepLR, fixed data) trains for 4 epochs
under Lightning on one device and on 2 CPU ranks (ddp), saving a .ckpt at each epoch's end and every
few steps. Resumed here with `fit(ckpt_path=...)` from Lightning's end-of-epoch checkpoint, the
per-step losses equal Lightning's own resume within ATOL (measured: 0 on one device, 1.5e-8 under
ddp, where lightspeed's fused Adam rounds differently from torch's for-each one; the same under fsdp
and deepspeed_stage_3 from Lightning's ddp checkpoint). From a mid-epoch
checkpoint lightspeed skips the batches the epoch already ran, so its losses equal Lightning's
uninterrupted run; Lightning's own resume replays the epoch's loader from its start (it warns so),
and differs. The other way, Lightning's `load_from_checkpoint` and `fit(ckpt_path=...)` read the
.ckpt lightspeed wrote, the latter with lightspeed's own losses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lightning_ckpt_script as script
from helpers import ROOT, launch

ATOL = 1e-6  # per-step losses (fp32; lightspeed's fused Adam against torch's for-each Adam)
REF = ROOT / ".venv" / "lightning-ref"  # real Lightning, outside the venv's import path
SCRIPT = str(Path(script.__file__))
EPOCHS, MID_ONE, MID_DDP = 4, 12, 6  # one device: 8 steps an epoch; 2 ranks: 4


def _lightning_env() -> dict:
    return {"PYTHONPATH": f"{REF}:{ROOT / 'src'}"}


def _run(framework: str, jobs: list[dict], tmp: Path, name: str) -> list[dict]:
    (tmp / f"{name}.json").write_text(json.dumps(jobs))
    out = tmp / f"{name}-out.json"
    env = _lightning_env() if framework == "lightning" else {"DS_ACCELERATOR": "cpu"}
    run = launch([SCRIPT, framework, str(tmp / f"{name}.json"), str(out)], tmp, extra_env=env)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def lightning(tmp_path_factory) -> Path:
    """Where real Lightning is importable, or a skip naming why not (`make test` installs it)."""
    probe = subprocess.run(
        [sys.executable, "-c", "import lightning.pytorch as pl; print(pl.__version__)"],
        env={**os.environ, **_lightning_env()},
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(
            f"real Lightning is not installed in {REF} (make test installs it with pip; "
            f"without a package index it cannot): {probe.stderr.strip().splitlines()[-1:]}"
        )
    assert probe.stdout.strip() == "2.6.6", probe.stdout
    return tmp_path_factory.mktemp("lightning")


@pytest.fixture(scope="module")
def one_device(lightning) -> dict:
    """lightspeed trains and saves (in this process); then Lightning, in one process, trains and
    saves, resumes its own checkpoints, and loads and resumes lightspeed's."""
    tmp = lightning / "one"
    tmp.mkdir()
    ours = script.run([dict(kind="fit", epochs=EPOCHS, save=str(tmp / "ls"), mid=MID_ONE)])[0]
    after = tmp / "after-fit.ckpt"  # trainer.save_checkpoint once fit has run 2 epochs
    script.run([dict(kind="fit", epochs=2, save_to=str(after))])
    epoch_end, mid = tmp / "pl/epochs/epoch=1-step=16.ckpt", tmp / "pl/mid/epoch=1-step=12.ckpt"
    mine = tmp / "ls/epochs/epoch=1-step=16.ckpt"
    theirs = _run(
        "lightning",
        [
            dict(kind="fit", epochs=EPOCHS, save=str(tmp / "pl"), mid=MID_ONE),
            dict(kind="fit", epochs=EPOCHS, resume=str(epoch_end)),
            dict(kind="fit", epochs=EPOCHS, resume=str(mid)),
            dict(kind="load", path=str(mine)),
            dict(kind="fit", epochs=EPOCHS, resume=str(mine)),
            dict(kind="fit", epochs=EPOCHS, resume=str(after)),
        ],
        tmp,
        "lightning",
    )
    return dict(ours=ours, theirs=theirs, epoch_end=epoch_end, mid=mid, mine=mine, after=after)


def _assert_losses(got: list[float], want: list[float], what: str) -> float:
    assert len(got) == len(want), (what, len(got), len(want))
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst <= ATOL, f"{what}: per-step losses differ by up to {worst:.3g}\n{got}\n{want}"
    print(f"{what}: {len(got)} steps, max |loss difference| {worst:.3g}")  # the figure (-s)
    return worst


def test_lightning_checkpoint_resumes_with_lightnings_losses(one_device):
    full, own_resume, own_mid_resume = one_device["theirs"][:3]
    assert full["global_step"] == EPOCHS * 8
    # Lightning's own resume from its end-of-epoch checkpoint is its uninterrupted run.
    _assert_losses(own_resume["losses"], full["losses"][16:], "Lightning's own resume")
    resumed = script.run([dict(kind="fit", epochs=EPOCHS, resume=str(one_device["epoch_end"]))])
    _assert_losses(resumed[0]["losses"], own_resume["losses"], "lightspeed from Lightning's ckpt")
    assert resumed[0]["global_step"] == full["global_step"]
    # Mid-epoch (step 12 of 8-step epochs): lightspeed continues at the epoch's fifth batch, as the
    # uninterrupted run did; Lightning's own resume restarts that epoch's loader and parts.
    mid = script.run([dict(kind="fit", epochs=EPOCHS, resume=str(one_device["mid"]))])[0]
    _assert_losses(mid["losses"], full["losses"][MID_ONE:], "lightspeed mid-epoch")
    assert own_mid_resume["losses"][:4] != full["losses"][MID_ONE:16]


def test_load_from_checkpoint_of_a_lightning_file(one_device):
    path = one_device["epoch_end"]
    saved = torch.load(path, weights_only=True)  # Lightning's file, as torch reads it
    model = script.Model.load_from_checkpoint(path)
    assert dict(model.hparams) == {"hidden": 16, "lr": 0.05} == saved["hyper_parameters"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved["state_dict"][name]), name
    assert list(model.state_dict()) == list(saved["state_dict"])


def test_lightspeed_file_is_lightnings_dict(one_device):
    ckpt = torch.load(one_device["mine"], weights_only=True)  # Lightning's default load
    assert {
        "state_dict",
        "optimizer_states",
        "lr_schedulers",
        "epoch",
        "global_step",
        "hyper_parameters",
        "callbacks",
        "loops",
        "pytorch-lightning_version",
    } <= set(ckpt)
    assert (ckpt["epoch"], ckpt["global_step"]) == (1, 16)
    assert list(ckpt["state_dict"]) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert ckpt["lr_schedulers"][0]["last_epoch"] == 2 and len(ckpt["optimizer_states"]) == 1
    assert ckpt["optimizer_states"][0]["state"][0]["exp_avg"].shape == (16, 4)
    epochs = sorted(p.name for p in (one_device["mine"].parent).iterdir())
    assert epochs == [f"epoch={e}-step={8 * (e + 1)}.ckpt" for e in range(EPOCHS)] + ["last.ckpt"]


def test_lightning_reads_and_resumes_lightspeeds_file(one_device):
    loaded, resumed, after_fit = one_device["theirs"][3:]
    saved = torch.load(one_device["mine"], weights_only=True)
    assert loaded["hparams"] == {"hidden": 16, "lr": 0.05}
    for name, values in loaded["weights"].items():
        assert values == saved["state_dict"][name].flatten().tolist(), name
    _assert_losses(resumed["losses"], one_device["ours"]["losses"][16:], "Lightning from ours")
    # Saved after fit ended at an epoch's end: both resume at the next epoch.
    _assert_losses(after_fit["losses"], one_device["ours"]["losses"][16:], "Lightning, after fit")
    ours = script.run([dict(kind="fit", epochs=EPOCHS, resume=str(one_device["after"]))])[0]
    _assert_losses(ours["losses"], one_device["ours"]["losses"][16:], "lightspeed, after fit")


def test_lightning_ddp_checkpoint_resumes_under_ddp(lightning):
    tmp = lightning / "ddp"
    tmp.mkdir()
    ckpt = tmp / "pl/epochs/epoch=1-step=8.ckpt"
    full, own_resume = _run(
        "lightning",
        [
            dict(kind="fit", devices=2, epochs=EPOCHS, save=str(tmp / "pl"), mid=MID_DDP),
            dict(kind="fit", devices=2, epochs=EPOCHS, resume=str(ckpt)),
        ],
        tmp,
        "lightning",
    )
    _assert_losses(own_resume["losses"], full["losses"][8:], "Lightning's own ddp resume")
    # Under ddp natively; under FSDP and ZeRO-3 through the neutral form (the optimizer state's
    # indices named by the running optimizers' parameters).
    # The three in one launched job: the ranks start once.
    strategies = ("ddp", "fsdp", "deepspeed_stage_3")
    jobs = [
        dict(kind="fit", devices=2, strategy=strategy, epochs=EPOCHS, resume=str(ckpt))
        for strategy in strategies
    ]
    for strategy, ours in zip(strategies, _run("lightspeed", jobs, tmp, "ls")):
        _assert_losses(
            ours["losses"], own_resume["losses"], f"{strategy} from Lightning's ddp ckpt"
        )
        assert ours["global_step"] == full["global_step"] == EPOCHS * 4
