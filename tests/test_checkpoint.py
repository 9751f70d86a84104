"""Checkpoints: atomic saves (a crash mid-save never becomes `last.ckpt`), clear errors for broken
ones, Lightning's dict in the file, precision.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_checkpoint.py

Exact resume (per-step losses) is in test_trainer.py; these run one device in this process.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import lightspeed as ls
from helpers import run_workload
from test_trainer import Regress, make_trainer, regression_data


class CrashOnSecondSave(ls.SingleDevice):
    """A strategy that dies half-way through its second save, as a killed process would."""

    def save(self, path: Path) -> None:
        self.saves = getattr(self, "saves", 0) + 1
        super().save(path)
        if self.saves == 2:
            (path / "model.safetensors").write_bytes(b"\0" * 10)  # half-written
            raise KeyboardInterrupt("simulated crash mid-save")


@pytest.fixture
def saved(tmp_path) -> Path:
    """A complete checkpoint file from a short single-device run, and `last.ckpt` beside it."""
    trainer = make_trainer(tmp_path, max_steps=3, enable_checkpointing=True)
    trainer.fit(Regress(), regression_data())
    return tmp_path / "checkpoints"


def test_crash_mid_save_never_becomes_last(tmp_path):
    ckpt = ls.ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)
    trainer = make_trainer(tmp_path, strategy=CrashOnSecondSave(), max_steps=6, callbacks=[ckpt])
    with pytest.raises(SystemExit):  # a KeyboardInterrupt ends fit as Lightning's does: exit 1
        trainer.fit(Regress(), regression_data())
    d = tmp_path / "checkpoints"
    parts = d / ".parts-epoch=0-step=4.ckpt"  # what the strategy wrote before the file is made
    assert parts.is_dir() and not (d / ".tmp-epoch=0-step=4.ckpt").exists()
    assert not (d / "epoch=0-step=4.ckpt").exists()
    assert (d / "last.ckpt").resolve() == (d / "epoch=0-step=2.ckpt").resolve()
    with pytest.raises(
        ls.ConfigError, match=r"\.parts-epoch=0-step=4.*not a lightspeed checkpoint"
    ):
        make_trainer(tmp_path, max_steps=6).fit(Regress(), regression_data(), ckpt_path=parts)
    # Resuming from `last` takes the complete step-2 checkpoint; the next save clears the debris.
    resumed = make_trainer(
        tmp_path, max_steps=6, callbacks=[ls.ModelCheckpoint(every_n_train_steps=2, save_top_k=-1)]
    )
    model = Regress()
    resumed.fit(model, regression_data(), ckpt_path="last")
    assert model.calls.count("training_step") == 4 and resumed.global_step == 6
    assert sorted(p.name for p in d.iterdir()) == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=0-step=6.ckpt",
        "last.ckpt",
    ]


def test_truncated_file_is_named(saved, tmp_path):
    file = (saved / "last.ckpt").resolve()
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    with pytest.raises(ls.ConfigError, match=f"checkpoint file {file} is truncated or corrupt"):
        make_trainer(tmp_path, max_steps=4).fit(Regress(), regression_data(), ckpt_path=file)


def test_not_a_checkpoint(saved, tmp_path):
    plain = tmp_path / "weights.pt"
    torch.save({"w": torch.ones(1)}, plain)
    text = tmp_path / "notes.ckpt"
    text.write_text("not a checkpoint")
    other = tmp_path / "other"  # a directory whose meta.json is another program's
    other.mkdir()
    (other / "meta.json").write_text(json.dumps({"format": "something-else"}))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "meta.json").write_text("{ not json")
    for path, why in [
        (plain, "is not a lightspeed or Lightning checkpoint: torch.load reads it, but it holds "),
        (text, "truncated or corrupt, or not a torch.save file"),
        (other, "format='something-else'"),
        (broken, "meta.json is not valid JSON"),
        (tmp_path / "nope", "does not exist"),
    ]:
        with pytest.raises(ls.ConfigError, match=why) as err:
            make_trainer(tmp_path, max_steps=4).fit(Regress(), regression_data(), ckpt_path=path)
        assert str(path) in str(err.value)
    # A requeued job killed before its first save: "last" warns and starts fresh (a missing path
    # stays an error).
    trainer = make_trainer(tmp_path / "empty", max_steps=4)
    with pytest.warns(UserWarning, match="nothing saved .* No checkpoint will be loaded"):
        trainer.fit(Regress(), regression_data(), ckpt_path="last")
    assert trainer.global_step == 4


def test_checkpoint_contents(saved):
    ckpt = torch.load(saved / "last.ckpt", weights_only=True)  # Lightning's dict, as torch reads it
    assert (ckpt["global_step"], ckpt["epoch"], ckpt["pytorch-lightning_version"]) == (
        3,
        0,
        "2.6.6",
    )
    assert list(ckpt["state_dict"]) == ["layer.weight", "layer.bias"]
    own = ckpt["lightspeed"]
    assert (own["strategy"], own["world_size"]) == ("single", 1)
    assert own["loop"] == {"epoch": 0, "global_step": 3, "batches_done": 3, "epoch_done": False}
    assert own["param_names"] == [["layer.weight", "layer.bias"]]
    assert set(own["rng"][0]) >= {"python", "numpy", "torch"}
    fit = ckpt["loops"]["fit_loop"]  # Lightning's counters for the same place: mid-epoch, 3 batches
    assert fit["epoch_loop.batch_progress"]["current"]["processed"] == 3
    assert fit["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]["step"][
        "total"
    ] == {
        "ready": 3,
        "completed": 3,
    }


@pytest.fixture(scope="module")
def precision_runs(tmp_path_factory):
    runs = {}
    for precision in ("bf16-mixed", "16-mixed", "bf16-true"):
        tmp = tmp_path_factory.mktemp(precision)
        runs[precision] = run_workload(
            tmp,
            launcher="in-process",
            precision=precision,
            max_steps=20,
            batch_size=8,
            limit_train_batches=4,
            lr=1e-2,
            save_to=str(tmp / "final"),
        )
        runs[precision]["dir"] = tmp / "final"
    return runs


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16-true"])
def test_precision_trains(precision_runs, precision):
    losses = precision_runs[precision]["losses"]
    assert len(losses) == 20 and all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.2, losses


def test_grad_scaler_state_in_checkpoint(precision_runs):
    fp16 = torch.load(precision_runs["16-mixed"]["dir"], weights_only=True)
    scaler = fp16["lightspeed"]["precision"]["scaler"]
    assert scaler["scale"] > 0 and scaler["_growth_tracker"] >= 0
    assert fp16["MixedPrecision"] == scaler  # Lightning's key for it
    bf16 = torch.load(precision_runs["bf16-mixed"]["dir"], weights_only=True)
    assert bf16["lightspeed"]["precision"] == {} and "MixedPrecision" not in bf16
    weights = torch.load(precision_runs["bf16-true"]["dir"], weights_only=True)["state_dict"]
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
