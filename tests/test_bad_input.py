"""Every misconfiguration raises a ConfigError naming the parameter, the value and what is accepted,
and does so before any rank is spawned.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_bad_input.py

The Trainers here ask for devices=2 where it matters: if an error came late, fit would spawn a rank.
A guard replaces the spawner so such a bug fails loudly instead of re-running pytest as a rank.
"""

from __future__ import annotations

import os
import time

import psutil
import pytest
import torch

import lightspeed as ls
import lightspeed.start
from helpers import launch
from test_trainer import Regress, make_trainer, regression_data


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch):
    def refuse(n):
        raise AssertionError(f"a bad input reached the spawner (start_local_ranks({n}))")

    monkeypatch.setattr(lightspeed.start, "start_local_ranks", refuse)
    yield
    assert psutil.Process().children() == []


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (dict(accelerator="tpu"), r"accelerator='tpu' is not valid: use 'auto', 'cpu' or 'gpu'"),
        (dict(strategy="dpp"), r"strategy='dpp' is not valid: use 'auto', .*ddp"),
        (dict(strategy=42), r"strategy=42 is not valid: expected a strategy name"),
        (
            dict(precision="8-bit"),
            r"precision='8-bit' is not valid: use one of '32-true', 'bf16-mixed'",
        ),
        (dict(devices=4096), r"devices=4096 is not valid: this machine has \d+ CPU cores"),
        (dict(devices=0), r"devices=0 is not valid: expected an integer ≥ 1"),
        (
            dict(accumulate_grad_batches=0),
            r"accumulate_grad_batches=0 is not valid: expected an integer ≥ 1",
        ),
        (
            dict(max_steps=-5),
            r"max_steps=-5 is not valid: expected -1 \(no limit\) or an integer ≥ 0",
        ),
        (
            dict(gradient_clip_algorithm="l2"),
            r"gradient_clip_algorithm='l2' is not valid: use 'norm' or 'value'",
        ),
        (
            dict(gradient_clip_val=-1.0),
            r"gradient_clip_val=-1.0 is not valid: expected a number ≥ 0",
        ),
        (
            dict(limit_train_batches=1.5),
            r"limit_train_batches=1.5 is not valid: expected a fraction",
        ),
        (dict(val_check_interval=-2), r"val_check_interval=-2 is not valid"),
        (dict(log_every_n_steps=0), r"log_every_n_steps=0 is not valid"),
        (dict(num_nodes=2), r"num_nodes=2 needs a multi-node launcher"),
        (dict(max_epoch=3), r"unknown arguments \['max_epoch'\]; accepted: .*max_epochs"),
    ],
)
def test_bad_trainer_flag(tmp_path, flags, pattern):
    with pytest.raises(ls.ConfigError, match=pattern):
        make_trainer(tmp_path, **{"devices": 2, **flags})


def test_fit_without_train_data(tmp_path):
    with pytest.raises(
        ls.ConfigError,
        match="fit needs training data: pass train_dataloaders= or define train_dataloader",
    ):
        make_trainer(tmp_path, devices=2).fit(Regress())


def test_bad_ckpt_paths_before_spawn(tmp_path):
    missing = tmp_path / "no" / "such" / "ckpt"
    with pytest.raises(ls.ConfigError, match="the path does not exist") as err:
        make_trainer(tmp_path, devices=2).fit(Regress(), regression_data(), ckpt_path=missing)
    assert str(missing) in str(err.value)
    # A real checkpoint file, truncated: the file is named.
    make_trainer(tmp_path, max_steps=2, enable_checkpointing=True).fit(Regress(), regression_data())
    weights = (tmp_path / "checkpoints" / "last.ckpt").resolve()
    weights.write_bytes(weights.read_bytes()[:-7])
    with pytest.raises(ls.ConfigError, match=f"checkpoint file {weights} is truncated or corrupt"):
        make_trainer(tmp_path, devices=2).fit(Regress(), regression_data(), ckpt_path="last")
    junk = tmp_path / "junk"
    junk.mkdir()
    with pytest.raises(ls.ConfigError, match=f"ckpt_path='{junk}' is not a lightspeed checkpoint"):
        make_trainer(tmp_path, devices=2).validate(Regress(), regression_data(), ckpt_path=junk)


class Returns(Regress):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def training_step(self, batch, batch_idx):
        super().training_step(batch, batch_idx)
        return self.value


@pytest.mark.parametrize(
    "value, shown",
    [
        (torch.ones(4, requires_grad=True), r"a tensor of shape \(4,\)"),
        ({"logits": 1}, r"a dict without 'loss' \(keys \['logits'\]\)"),
    ],
)
def test_training_step_must_return_a_scalar(tmp_path, value, shown):
    with pytest.raises(ls.ConfigError, match=f"training_step returned {shown}.*scalar loss tensor"):
        make_trainer(tmp_path, max_steps=1).fit(Returns(value), regression_data())


def test_bad_configure_optimizers_return(tmp_path):
    with pytest.raises(
        ls.ConfigError,
        match=r"configure_optimizers returned str 'adam', which is not a form .*"
        r"an optimizer; a list of optimizers",
    ):
        make_trainer(tmp_path, max_steps=1).fit(Regress("bogus"), regression_data())


BOGUS_OPTIMIZERS = """
import torch
from torch.utils.data import DataLoader, TensorDataset
import lightspeed as ls

class Bogus(ls.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return {"optimiser": torch.optim.SGD(self.parameters(), lr=0.1)}

data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
ls.Trainer(devices=2, accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False).fit(Bogus(), data)
"""


def test_bad_configure_optimizers_return_on_two_ranks(tmp_path):
    # configure_optimizers needs the built model (configure_model may build it sharded), so it is
    # checked on the
    # ranks, at setup: every rank raises the same ConfigError and the launcher exits non-zero
    # promptly.
    script = tmp_path / "bogus.py"
    script.write_text(BOGUS_OPTIMIZERS)
    run = launch([str(script)], tmp_path, "python", timeout=90)
    assert run.returncode != 0 and run.seconds < 60
    assert "ConfigError: configure_optimizers returned a dict without 'optimizer'" in run.stderr


def test_stale_deepspeed_build_lock_is_named_before_spawn(tmp_path, monkeypatch):
    """A build lock left by a killed process made every later DeepSpeed run wait forever in
    silence."""
    ext = tmp_path / "ext"
    lock = ext / "py311_cpu" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    fresh = make_trainer(tmp_path, strategy="deepspeed_stage_2", devices=2, max_steps=1)
    fresh.strategy.check(
        fresh.config.run_spec(True)
    )  # a lock as young as a build in progress: no complaint
    old = time.time() - 3600
    os.utime(lock, (old, old))
    trainer = make_trainer(tmp_path, strategy="deepspeed_stage_2", devices=2, max_steps=1)
    with pytest.raises(
        ls.ConfigError, match=r"stale op build lock: .*cpu_adam/lock \(60 min old\)"
    ):
        trainer.fit(Regress(), regression_data())
    assert trainer.dist is None  # refused before any rank started
