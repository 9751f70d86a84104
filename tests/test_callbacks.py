"""ModelCheckpoint, EarlyStopping and LearningRateMonitor, checked by what they leave behind.

OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_callbacks.py
"""

from __future__ import annotations

import csv
import time

import pytest
import torch

import lightspeed as ls
from test_trainer import Regress, make_trainer, regression_data


class Scripted(Regress):
    """Logs a scripted `score` per validation epoch, so which checkpoints survive is known in
    advance."""

    def __init__(self, scores):
        super().__init__()
        self.scores = list(scores)

    def validation_step(self, batch, batch_idx):
        self.log("score", self.scores[self.current_epoch])


def _dirs(root) -> list[str]:
    return sorted(p.name for p in (root / "checkpoints").iterdir())


def fit_scripted(tmp_path, scores, *callbacks, epochs=None, **kw):
    trainer = make_trainer(
        tmp_path,
        callbacks=list(callbacks),
        **{
            "max_epochs": epochs or len(scores),
            "limit_train_batches": 2,
            "limit_val_batches": 1,
            **kw,
        },
    )
    trainer.fit(Scripted(scores), regression_data(), regression_data())
    return trainer


def test_checkpoint_top_k_by_monitor(tmp_path):
    ckpt = ls.ModelCheckpoint(monitor="score", mode="min", save_top_k=2)
    fit_scripted(tmp_path, [5.0, 3.0, 4.0, 1.0, 6.0], ckpt)
    # Steps are 2 per epoch; the two lowest scores are epochs 3 (1.0) and 1 (3.0).
    assert _dirs(tmp_path) == ["epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
    assert ckpt.best_model_path.endswith("epoch=3-step=8.ckpt") and ckpt.best_model_score == 1.0
    assert (tmp_path / "checkpoints" / "last.ckpt").resolve().name == "epoch=3-step=8.ckpt"


def test_checkpoint_mode_max_with_save_last(tmp_path):
    ckpt = ls.ModelCheckpoint(monitor="score", mode="max", save_top_k=1, save_last=True)
    fit_scripted(tmp_path, [5.0, 3.0, 4.0, 1.0, 6.0, 2.0], ckpt)
    # Best is epoch 4 (6.0); the newest (epoch 5) is kept as Lightning's `last.ckpt` only (the file
    # itself, not a link); nothing else survives.
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert _dirs(tmp_path) == ["epoch=4-step=10.ckpt", "last.ckpt"]
    assert not last.is_symlink() and torch.load(last, weights_only=True)["global_step"] == 12
    assert ckpt.best_model_path.endswith("epoch=4-step=10.ckpt")
    assert ckpt.last_model_path == str(last)
    # A newer best replaces both the old best and the checkpoint kept only as `last.ckpt`.
    fit_scripted(
        tmp_path / "again",
        [5.0, 3.0, 6.0],
        ls.ModelCheckpoint(monitor="score", mode="max", save_last=True),
    )
    assert _dirs(tmp_path / "again") == ["epoch=2-step=6.ckpt", "last.ckpt"]
    assert (tmp_path / "again/checkpoints/last.ckpt").resolve().name == "epoch=2-step=6.ckpt"


def test_checkpoint_every_n_steps_and_epochs(tmp_path):
    fit_scripted(
        tmp_path / "steps", [0.0] * 2, ls.ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)
    )
    assert _dirs(tmp_path / "steps") == ["epoch=1-step=3.ckpt", "last.ckpt"]
    fit_scripted(
        tmp_path / "epochs", [0.0] * 4, ls.ModelCheckpoint(every_n_epochs=2, save_top_k=-1)
    )
    assert _dirs(tmp_path / "epochs") == ["epoch=1-step=4.ckpt", "epoch=3-step=8.ckpt", "last.ckpt"]
    fit_scripted(tmp_path / "recent", [0.0] * 3, ls.ModelCheckpoint(save_top_k=1))
    assert _dirs(tmp_path / "recent") == ["epoch=2-step=6.ckpt", "last.ckpt"]


@pytest.mark.parametrize(
    "scores, kw, stopped",
    [
        (
            [5, 4, 4, 4, 4, 4, 4, 4],
            dict(patience=2),
            3,
        ),  # no improvement after epoch 1: stops after epoch 3
        ([5, 4, 3.95, 3.9, 3.85, 3.8, 3.7, 3.6], dict(patience=2, min_delta=0.1), 3),
        (
            [1, 2, 3, 4, 5, 6, 7, 8],
            dict(patience=1, mode="max"),
            7,
        ),  # always improving: runs every epoch
        ([1, 2, 3, 4, 5, 6, 7, 8], dict(patience=1, mode="min"), 1),
    ],
)
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
    trainer = make_trainer(
        tmp_path,
        max_steps=5,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[ls.LearningRateMonitor(logging_interval="step")],
    )
    trainer.fit(Sched(), regression_data())
    rows = [r for r in csv.DictReader(logger.path.open()) if r.get("lr-SGD")]
    # Logged before each step, as Lightning: at step s the rate that update uses, the scheduler's
    # lambda after s steps.
    assert [(int(r["step"]), float(r["lr-SGD"])) for r in rows] == [
        (s, 1.0 / (s + 1)) for s in range(0, 5)
    ]
    assert trainer.strategy.schedulers[0].scheduler.get_last_lr() == [1.0 / 6]


class SaveRecorder(ls.Callback):
    """Notes the global step of every checkpoint written (the Trainer calls on_save_checkpoint on
    each)."""

    def __init__(self):
        self.steps: list[int] = []

    def on_save_checkpoint(self, trainer, module, checkpoint) -> None:
        self.steps.append(trainer.global_step)


def test_checkpoint_resume_keeps_its_last_saved_step(tmp_path):
    # 4 steps an epoch; step 4 is saved by the step trigger at the epoch's last batch, so the
    # epoch-end
    # trigger must skip it. Resumed from that checkpoint, the epoch ends at once: it must skip it
    # again.
    def fit(ckpt_path=None):
        ckpt = ls.ModelCheckpoint(every_n_train_steps=4, every_n_epochs=1, save_top_k=-1)
        recorder = SaveRecorder()
        trainer = make_trainer(
            tmp_path, max_epochs=3, limit_train_batches=4, callbacks=[ckpt, recorder]
        )
        trainer.fit(Regress(), regression_data(), ckpt_path=ckpt_path)
        return recorder.steps

    assert fit() == [4, 8, 12]
    assert fit(tmp_path / "checkpoints" / "epoch=0-step=4.ckpt") == [8, 12]
    assert _dirs(tmp_path) == [
        "epoch=0-step=4.ckpt",
        "epoch=1-step=8.ckpt",
        "epoch=2-step=12.ckpt",
        "last.ckpt",
    ]


@pytest.mark.parametrize(
    "scores, kw, stopped, said",
    [
        # Lightning's positional order: monitor, min_delta, patience
        ([5.0, 4.95, 4.9, 4.85, 4.8], dict(args=(0.1, 2)), 2, "did not improve for 2 checks"),
        ([5.0, float("nan"), 4.0], dict(), 1, "score = nan is not finite (best 5.0)"),
        (
            [5.0, float("nan"), 4.0, 3.0],
            dict(check_finite=False, patience=3),
            3,
            None,
        ),  # NaN counts as no improvement
        ([5.0, 3.0, 0.5, 0.1], dict(stopping_threshold=1.0), 2, "reached stopping_threshold=1.0"),
        (
            [5.0, 30.0, 4.0],
            dict(divergence_threshold=10.0, patience=5),
            1,
            "passed divergence_threshold=10.0",
        ),
        (
            [1.0, 2.0, 3.0],
            dict(mode="max", stopping_threshold=2.5),
            2,
            "reached stopping_threshold=2.5",
        ),
    ],
)
def test_early_stopping_thresholds_and_lightnings_argument_order(
    tmp_path, capsys, scores, kw, stopped, said
):
    es = ls.EarlyStopping("score", *kw.pop("args", ()), **kw)
    trainer = fit_scripted(tmp_path, scores, es)
    assert trainer.current_epoch == stopped + 1
    out = capsys.readouterr().out
    assert (said in out) if said else "EarlyStopping:" not in out


def test_early_stopping_strict_verbose_and_without_validation(tmp_path, capsys):
    loose = ls.EarlyStopping("never_logged", strict=False, verbose=True)
    fit_scripted(tmp_path / "a", [3.0, 2.0, 1.0], loose, ls.EarlyStopping("score", verbose=True))
    out = capsys.readouterr().out
    assert out.count("was not logged") == 1 and "strict=False, so it is not checked" in out
    assert "EarlyStopping: score improved to 1." in out
    # Without validation, check_on_train_epoch_end=None checks at the epoch's end (Lightning's
    # default)
    trainer = make_trainer(
        tmp_path / "b",
        max_epochs=10,
        limit_train_batches=2,
        callbacks=[ls.EarlyStopping("train_loss", patience=0, stopping_threshold=1e9)],
    )
    trainer.fit(Regress(), regression_data())
    assert trainer.current_epoch == 1


def test_checkpoint_lightning_arguments(tmp_path, capsys):
    ckpt = ls.ModelCheckpoint(
        tmp_path / "ck", None, "score", True, save_weights_only=True
    )  # Lightning's order
    trainer = fit_scripted(tmp_path, [5.0, 3.0, 4.0], ckpt)
    out = capsys.readouterr().out
    assert (
        "ModelCheckpoint(save_weights_only=True): lightspeed checkpoints keep the optimizer state "
        "too" in out
    )
    assert (
        "'score' reached 3 (best 3), saved" in out
        and "'score' was not in the top 1, saved" not in out
    )
    assert ckpt.best_model_path.endswith("epoch=1-step=4.ckpt") and trainer.global_step == 6
    # mid-epoch validations (val_check_interval=0.5) each save when save_on_train_epoch_end=False
    mid = ls.ModelCheckpoint(save_on_train_epoch_end=False, save_top_k=-1)
    fit_scripted(tmp_path / "mid", [1.0, 1.0], mid, val_check_interval=0.5, limit_train_batches=4)
    assert _dirs(tmp_path / "mid") == [
        "epoch=0-step=2.ckpt",
        "epoch=0-step=4.ckpt",
        "epoch=1-step=6.ckpt",
        "epoch=1-step=8.ckpt",
        "last.ckpt",
    ]
    # a new run in the same folder overwrites a same-named checkpoint only with
    # enable_version_counter=False
    fit_scripted(
        tmp_path / "mid",
        [1.0],
        ls.ModelCheckpoint(enable_version_counter=False),
        limit_train_batches=4,
    )
    fit_scripted(tmp_path / "mid", [1.0], ls.ModelCheckpoint(), limit_train_batches=4)
    assert "epoch=0-step=4-v1.ckpt" in _dirs(tmp_path / "mid")
    assert "epoch=0-step=4-v2.ckpt" not in _dirs(tmp_path / "mid")


def test_checkpoint_every_train_time_interval(tmp_path):
    class Slow(Scripted):
        def training_step(self, batch, batch_idx):
            time.sleep(0.06)
            return super().training_step(batch, batch_idx)

    ckpt = ls.ModelCheckpoint(train_time_interval={"seconds": 0.25}, save_top_k=-1)
    trainer = make_trainer(
        tmp_path, max_epochs=1, limit_train_batches=20, limit_val_batches=1, callbacks=[ckpt]
    )
    trainer.fit(Slow([1.0]), regression_data(n=80), regression_data())
    steps = sorted(
        int(d.removesuffix(".ckpt").split("=")[-1]) for d in _dirs(tmp_path) if d != "last.ckpt"
    )
    assert 2 <= len(steps) <= 6 and steps == sorted(set(steps)), (
        steps
    )  # ≈ every 4 steps of 0.06 s, no epoch save
    assert all(b - a >= 3 for a, b in zip(steps, steps[1:])), steps


def test_learning_rate_monitor_logs_weight_decay(tmp_path):
    logger = ls.CSVLogger(tmp_path)
    trainer = make_trainer(
        tmp_path,
        max_steps=2,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[ls.LearningRateMonitor(logging_interval="step", log_weight_decay=True)],
    )
    trainer.fit(Sched(), regression_data())
    rows = [r for r in csv.DictReader(logger.path.open()) if r.get("lr-SGD-weight_decay")]
    assert [float(r["lr-SGD-weight_decay"]) for r in rows] == [0.0, 0.0]
