"""Lightning's `Trainer(plugins=...)`: each plugin is the Trainer flag it stands for, and what no
flag can say is a ConfigError naming the plugin, before any rank starts. Also `barebones=True`,
Lightning's other Trainer argument that stands for a set of flags.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_plugins.py
"""

from __future__ import annotations

import os
import signal
import stat

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
from helpers import run_workload
from lightspeed.errors import ConfigError
from lightspeed.plugins import (
    AsyncCheckpointIO,
    BitsandbytesPrecision,
    ClusterEnvironment,
    DeepSpeedPrecision,
    DoublePrecision,
    HalfPrecision,
    LightningEnvironment,
    MixedPrecision,
    MPIEnvironment,
    Precision,
    SLURMEnvironment,
    TorchCheckpointIO,
    TorchElasticEnvironment,
    TorchSyncBatchNorm,
)


class Regression(ls.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_nb):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(32, 8, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class Losses(ls.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))


def _fit(**kw) -> tuple[ls.Trainer, list[float]]:
    losses = Losses()
    trainer = ls.Trainer(
        accelerator="cpu",
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
        **kw,
    )
    ls.seed_everything(0)
    trainer.fit(Regression())
    return trainer, losses.losses


@pytest.mark.parametrize(
    "plugin, precision",
    [
        (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
        (DeepSpeedPrecision("bf16-mixed"), "bf16-mixed"),
        (HalfPrecision("bf16-true"), "bf16-true"),
        (Precision(), "32-true"),
    ],
    ids=["mixed", "deepspeed", "half", "base"],
)
def test_a_precision_plugin_runs_as_its_flag(plugin, precision):
    by_plugin, plugin_losses = _fit(plugins=[plugin])
    by_flag, flag_losses = _fit(precision=precision)
    assert by_plugin.precision == by_flag.precision == precision
    assert len(plugin_losses) == 4 and plugin_losses == flag_losses  # the same run, bit for bit


def test_the_plugins_a_flag_can_say_are_taken():
    trainer = ls.Trainer(
        accelerator="cpu",
        logger=False,
        plugins=[TorchCheckpointIO(), LightningEnvironment(), TorchSyncBatchNorm()],
    )
    assert trainer.config.launch.sync_batchnorm is True
    elastic = ls.Trainer(accelerator="cpu", logger=False, plugins=TorchElasticEnvironment())
    assert elastic.config.launch.requeue is True  # only SLURM's environment says otherwise
    slurm = ls.Trainer(
        accelerator="cpu",
        logger=False,
        plugins=SLURMEnvironment(auto_requeue=False, requeue_signal=signal.SIGHUP),
    )
    assert slurm.config.launch.requeue is False
    assert slurm.config.launch.preemption_signals == ("SIGTERM", "SIGHUP")


class OwnEnvironment(ClusterEnvironment):
    def world_size(self):
        return 1


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(plugins=[DeepSpeedPrecision("bf16-mixed")], precision="bf16-mixed"), "give one"),
        (dict(plugins=[HalfPrecision("bf16-true"), Precision()]), "two precision plugins"),
        (dict(plugins=[DoublePrecision()]), "does not run precision '64-true'"),
        (dict(plugins=[BitsandbytesPrecision("nf4")]), "does not provide it"),
        (dict(plugins=[MixedPrecision("16-mixed", "cpu", scaler=object())]), "scaler"),
        (dict(plugins=[AsyncCheckpointIO()]), "writes checkpoints itself"),
        (dict(plugins=[MPIEnvironment()]), "reads the launch environment itself"),
        (dict(plugins=[OwnEnvironment()]), "OwnEnvironment"),
        (dict(plugins=["ddp_find_unused_parameters_false"]), "plugins contains"),
        (
            dict(plugins=[SLURMEnvironment(requeue_signal=signal.SIGHUP)],
                 preemption_signals=("SIGTERM",)),
            "both set the signals",
        ),
    ],
    ids=["both", "two", "double", "bnb", "scaler", "async", "mpi", "own", "string", "signals"],
)
def test_a_plugin_no_flag_can_say_is_refused_naming_it(kw, says):
    with pytest.raises(ConfigError, match=says):
        ls.Trainer(accelerator="cpu", logger=False, **kw)


@pytest.mark.parametrize("auto_requeue", [True, False])
def test_slurm_auto_requeue_decides_whether_a_preempted_job_requeues(tmp_path, auto_requeue):
    # a stand-in for SLURM's scontrol on PATH, recording how it was called
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls"
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    run = run_workload(
        tmp_path,
        nproc=1,
        devices=1,
        max_steps=6,
        sigterm_at={"step": 2, "rank": 0, "signal": "SIGUSR1"},
        auto_requeue=auto_requeue,
        checkpointing=True,
        extra_env={"SLURM_JOB_ID": "4242", "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        check=False,
    )
    assert run.returncode == 128 + signal.SIGUSR1, run.stderr[-3000:]
    assert "received SIGUSR1" in run.stdout, run.stdout[-2000:]
    if auto_requeue:
        assert calls.read_text().split() == ["requeue", "4242"]
        assert "scontrol requeue 4242: done." in run.stdout
    else:
        assert not calls.exists() and "scontrol requeue" not in run.stdout


class SeesDtypes(Regression):
    """Records the batch's dtype and the dtype of a tensor the step makes."""

    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def training_step(self, batch, batch_nb):
        x, y = batch
        self.seen.append((x.dtype, torch.randn(1).dtype))
        return torch.nn.functional.mse_loss(self.layer(x + 0.01 * torch.randn(x.shape)), y)


def test_bf16_true_steps_see_a_bf16_batch_and_make_bf16_tensors():
    # Lightning's HalfPrecision: floating-point inputs cast to the weights' dtype, which is also
    # torch's default dtype inside the step (and only there)
    SeesDtypes.seen = []
    trainer = ls.Trainer(
        accelerator="cpu",
        plugins=HalfPrecision("bf16-true"),
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(SeesDtypes())
    assert SeesDtypes.seen == [(torch.bfloat16, torch.bfloat16)] * 3
    assert torch.get_default_dtype() == torch.float32


class Logs(Regression):
    def training_step(self, batch, batch_nb):
        loss = super().training_step(batch, batch_nb)
        self.log("train_loss", loss)
        return loss


def test_barebones_switches_off_what_costs_speed_and_refuses_what_asks_for_it(tmp_path):
    trainer = ls.Trainer(
        accelerator="cpu", barebones=True, max_steps=3, default_root_dir=str(tmp_path)
    )
    assert trainer.barebones is True
    with pytest.warns(UserWarning, match=r"self.log\(\) under Trainer\(barebones=True\)"):
        trainer.fit(Logs())
    assert trainer.global_step == 3
    assert trainer.logger is None and trainer.checkpoint_callback is None
    assert trainer.progress_bar_callback is None and trainer.callbacks == []
    assert dict(trainer.callback_metrics) == {}  # self.log recorded nothing
    assert list(tmp_path.iterdir()) == []  # no checkpoint, log or run report written
    for kw, name in [
        (dict(enable_checkpointing=True), "enable_checkpointing=True"),
        (dict(num_sanity_val_steps=2), "num_sanity_val_steps=2"),
        (dict(logger=ls.CSVLogger(str(tmp_path))), "logger=<"),
        (dict(profiler="simple"), "profiler='simple'"),
    ]:
        with pytest.raises(ConfigError, match=f"barebones=True with {name}"):
            ls.Trainer(accelerator="cpu", barebones=True, **kw)
