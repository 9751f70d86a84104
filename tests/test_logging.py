"""Loggers (CSV, TensorBoard read back with EventAccumulator), `self.log` naming and intervals,
progress output.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_logging.py

`self.log(..., sync_dist=True)` across 2 real ranks is checked in test_trainer.py
(test_ddp_sync_dist_and_ranks).
"""

from __future__ import annotations

import csv
import os
import pty
import sys
import threading

import lightspeed as ls
from helpers import run_workload
from test_trainer import Regress, make_trainer, regression_data


class Logged(Regress):
    """Logs known values: `a` = the batch index (step and epoch), `b` = 10 × batch index (epoch
    only)."""

    def training_step(self, batch, batch_idx):
        self.log("a", float(batch_idx), on_step=True, on_epoch=True, prog_bar=True)
        self.log("b", 10.0 * batch_idx, on_step=False, on_epoch=True)
        self.log_dict({"c": 1.0, "d": 2.0})
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.log("val_x", 3.0)


def _rows(path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_csv_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = make_trainer(
        tmp_path,
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=1,
        logger=True,
        log_every_n_steps=2,
        val_check_interval=0.5,
    )
    trainer.fit(Logged(), regression_data(), regression_data())
    # After the epoch, the plain name holds the epoch mean (what ModelCheckpoint/EarlyStopping
    # monitor).
    metrics = trainer.callback_metrics
    assert (float(metrics["a"]), float(metrics["a_step"]), float(metrics["a_epoch"])) == (
        1.5,
        3.0,
        1.5,
    )
    version = tmp_path / "lightning_logs" / "version_0"
    rows = _rows(version / "metrics.csv")
    step_rows = [r for r in rows if r["a_step"]]
    # log_every_n_steps=2: step values at steps 2, 4, 6, 8; `a` logged on step and epoch is split in
    # two names.
    assert [(int(r["step"]), float(r["a_step"])) for r in step_rows] == [
        (2, 1.0),
        (4, 3.0),
        (6, 1.0),
        (8, 3.0),
    ]
    assert all(r["c"] == "1.0" and r["d"] == "2.0" for r in step_rows)
    epoch_rows = [r for r in rows if r["a_epoch"]]
    # Epoch means over all 4 batches (0..3), although validation ran mid-epoch in between.
    assert [(r["epoch"], float(r["a_epoch"]), float(r["b"])) for r in epoch_rows] == [
        ("0", 1.5, 15.0),
        ("1", 1.5, 15.0),
    ]
    assert sum(1 for r in rows if r["val_x"]) == 4  # twice per epoch
    events = EventAccumulator(str(version))
    events.Reload()
    assert {"a_step", "a_epoch", "b", "c", "val_x"} <= set(events.Tags()["scalars"])
    assert [(e.step, e.value) for e in events.Scalars("a_step")] == [
        (2, 1.0),
        (4, 3.0),
        (6, 1.0),
        (8, 3.0),
    ]
    assert [e.value for e in events.Scalars("b")] == [15.0, 15.0]
    # A second run under the same root gets the next version.
    make_trainer(tmp_path, max_steps=1, logger=True).fit(Logged(), regression_data())
    assert (tmp_path / "lightning_logs" / "version_1" / "metrics.csv").exists()


def test_logger_false_and_custom_name(tmp_path):
    make_trainer(tmp_path, max_steps=2, logger=False).fit(Logged(), regression_data())
    assert not (tmp_path / "lightning_logs").exists()
    logger = ls.CSVLogger(tmp_path, name="exp")
    make_trainer(tmp_path, max_steps=2, logger=logger, log_every_n_steps=1).fit(
        Logged(), regression_data()
    )
    assert (
        logger.path == tmp_path / "exp" / "version_0" / "metrics.csv"
        and len(_rows(logger.path)) >= 2
    )


def test_progress_plain_when_not_a_terminal(tmp_path, capsys):
    make_trainer(tmp_path, max_steps=6, enable_progress_bar=True, enable_model_summary=False).fit(
        Logged(), regression_data()
    )
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\r" not in out
    lines = [line for line in out.splitlines() if line.strip()]
    *lines, closing = lines  # fit's closing line (report/closing.py) comes after the bar
    assert closing.startswith("fit stopped after 6 optimizer steps: max_steps=6 reached.")
    assert (
        1 <= len(lines) <= 5
        and "step 6/6" in lines[-1]
        and "it/s" in lines[-1]
        and "a_step=" in lines[-1]  # logged on_step and on_epoch: the bar shows both, as Lightning's
        and "a_epoch=" in lines[-1]
    )


def test_progress_bar_on_a_terminal(tmp_path, monkeypatch):
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    tty = os.fdopen(slave, "w")
    monkeypatch.setattr(sys, "stdout", tty)
    monkeypatch.setenv("TERM", "xterm-256color")
    make_trainer(tmp_path, max_steps=6, enable_progress_bar=True).fit(Logged(), regression_data())
    tty.flush()
    tty.close()
    reader.join(timeout=5)
    os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert "\x1b[" in out  # a live, redrawn bar
    assert "6/6" in out and "it/s" in out and "━" in out and "epoch 0" in out


def test_progress_on_rank_zero_only(tmp_path):
    run = run_workload(tmp_path, check=False, devices=2, max_steps=4, batch_size=4, progress=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "\x1b" not in run.stdout
    bar_lines = [line for line in run.stdout.splitlines() if "it/s" in line]
    assert len(bar_lines) == 1 and "step 4/4" in bar_lines[0], run.stdout
