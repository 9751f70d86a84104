"""ModelCheckpoint, EarlyStopping and LearningRateMonitor, checked by what they leave behind.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_callbacks.py
"""

from __future__ import annotations

import csv

import pytest
import torch

import lightspeed as ls
from test_trainer import Regress, make_trainer, regression_data


class Scripted(Regress):
    """Logs a scripted `score` per validation epoch, so which checkpoints survive is known in advance."""

    def __init__(self, scores):
        super().__init__()
        self.scores = list(scores)

    def validation_step(self, batch, batch_idx):
        self.log("score", self.scores[self.current_epoch])


def _dirs(root) -> list[str]:
    return sorted(p.name for p in (root / "checkpoints").iterdir())


def fit_scripted(tmp_path, scores, *callbacks, epochs=None, **kw):
    trainer = make_trainer(tmp_path, max_epochs=epochs or len(scores), limit_train_batches=2, limit_val_batches=1,
                           callbacks=list(callbacks), **kw)
    trainer.fit(Scripted(scores), regression_data(), regression_data())
    return trainer


def test_checkpoint_top_k_by_monitor(tmp_path):
    ckpt = ls.ModelCheckpoint(monitor="score", mode="min", save_top_k=2)
    fit_scripted(tmp_path, [5.0, 3.0, 4.0, 1.0, 6.0], ckpt)
    # Steps are 2 per epoch; the two lowest scores are epochs 3 (1.0) and 1 (3.0).
    assert _dirs(tmp_path) == ["epoch=1-step=4", "epoch=3-step=8", "last"]
    assert ckpt.best_model_path.endswith("epoch=3-step=8") and ckpt.best_model_score == 1.0
    assert (tmp_path / "checkpoints" / "last").resolve().name == "epoch=3-step=8"


def test_checkpoint_mode_max_with_save_last(tmp_path):
    ckpt = ls.ModelCheckpoint(monitor="score", mode="max", save_top_k=1, save_last=True)
    fit_scripted(tmp_path, [5.0, 3.0, 4.0, 1.0, 6.0, 2.0], ckpt)
    # Best is epoch 4 (6.0); the newest (epoch 5) is kept as `last` only; nothing else survives.
    assert _dirs(tmp_path) == ["epoch=4-step=10", "epoch=5-step=12", "last"]
    assert (tmp_path / "checkpoints" / "last").resolve().name == "epoch=5-step=12"
    assert ckpt.best_model_path.endswith("epoch=4-step=10")
    # A newer best replaces both the old best and the directory kept only as `last`.
    fit_scripted(tmp_path / "again", [5.0, 3.0, 6.0], ls.ModelCheckpoint(monitor="score", mode="max", save_last=True))
    assert _dirs(tmp_path / "again") == ["epoch=2-step=6", "last"]


def test_checkpoint_every_n_steps_and_epochs(tmp_path):
    fit_scripted(tmp_path / "steps", [0.0] * 2, ls.ModelCheckpoint(every_n_train_steps=3, save_top_k=-1))
    assert _dirs(tmp_path / "steps") == ["epoch=1-step=3", "last"]
    fit_scripted(tmp_path / "epochs", [0.0] * 4, ls.ModelCheckpoint(every_n_epochs=2, save_top_k=-1))
    assert _dirs(tmp_path / "epochs") == ["epoch=1-step=4", "epoch=3-step=8", "last"]
    fit_scripted(tmp_path / "recent", [0.0] * 3, ls.ModelCheckpoint(save_top_k=1))
    assert _dirs(tmp_path / "recent") == ["epoch=2-step=6", "last"]


@pytest.mark.parametrize("scores, kw, stopped", [
    ([5, 4, 4, 4, 4, 4, 4, 4], dict(patience=2), 3),  # no improvement after epoch 1: stops after epoch 3
    ([5, 4, 3.95, 3.9, 3.85, 3.8, 3.7, 3.6], dict(patience=2, min_delta=0.1), 3),
    ([1, 2, 3, 4, 5, 6, 7, 8], dict(patience=1, mode="max"), 7),  # always improving: runs every epoch
    ([1, 2, 3, 4, 5, 6, 7, 8], dict(patience=1, mode="min"), 1),
])
def test_early_stopping(tmp_path, scores, kw, stopped):
    es = ls.EarlyStopping(monitor="score", **kw)
    trainer = fit_scripted(tmp_path, scores, es)
    assert trainer.current_epoch == stopped + 1
    assert es.stopped_epoch == (stopped if stopped < len(scores) - 1 else -1)


class Sched(Regress):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_learning_rate_monitor_matches_scheduler(tmp_path):
    logger = ls.CSVLogger(tmp_path)
    trainer = make_trainer(tmp_path, max_steps=5, log_every_n_steps=1, logger=logger,
                           callbacks=[ls.LearningRateMonitor(logging_interval="step")])
    trainer.fit(Sched(), regression_data())
    rows = [r for r in csv.DictReader(logger.path.open()) if r.get("lr-SGD")]
    # At step s the logged rate is the one the next update uses: the scheduler's lambda after s steps.
    assert [(int(r["step"]), float(r["lr-SGD"])) for r in rows] == [(s, 1.0 / (s + 1)) for s in range(1, 6)]
    assert trainer.strategy.schedulers[0].scheduler.get_last_lr() == [1.0 / 6]


class SaveRecorder(ls.Callback):
    """Notes the global step of every checkpoint written (the Trainer calls on_save_checkpoint on each)."""

    def __init__(self):
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        self.steps.append(trainer.global_step)


def test_checkpoint_resume_keeps_its_last_saved_step(tmp_path):
    # 4 steps an epoch; step 4 is saved by the step trigger at the epoch's last batch, so the epoch-end
    # trigger must skip it. Resumed from that checkpoint, the epoch ends at once: it must skip it again.
    def fit(ckpt_path=None):
        ckpt = ls.ModelCheckpoint(every_n_train_steps=4, every_n_epochs=1, save_top_k=-1)
        recorder = SaveRecorder()
        trainer = make_trainer(tmp_path, max_epochs=3, limit_train_batches=4, callbacks=[ckpt, recorder])
        trainer.fit(Regress(), regression_data(), ckpt_path=ckpt_path)
        return recorder.steps

    assert fit() == [4, 8, 12]
    assert fit(tmp_path / "checkpoints" / "epoch=0-step=4") == [8, 12]
    assert _dirs(tmp_path) == ["epoch=0-step=4", "epoch=1-step=8", "epoch=2-step=12", "last"]
