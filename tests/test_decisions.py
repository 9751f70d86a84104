"""Decisions every rank must share are taken once (rank 0) and broadcast, under ddp,
deepspeed_stage_2 and fsdp.

    .venv/bin/python -m pytest -q tests/test_decisions.py

The metric `score` is logged without sync_dist and differs between the 2 ranks: it improves every
epoch on rank 0 and never on rank 1. `ModelCheckpoint(monitor="score", save_top_k=1)` names its
checkpoints after the metric, `EarlyStopping(monitor="score", patience=1)` watches it. Decided per
rank, the names differ (a rank-1 shard lands in a leftover folder), the save happens on one rank
only (a hang) and one rank stops alone (a crash). Decided on rank 0: every epoch runs on both ranks,
every checkpoint is complete and resumes on 2 ranks.
"""

from __future__ import annotations

import json

import pytest

from helpers import ROOT, launch

SCRIPT = r"""
import json, sys
sys.path.insert(0, {tests!r})
import torch
import lightspeed as ls
from test_trainer import Regress, regression_data

class PerRankScore(Regress):
    def validation_step(self, batch, batch_idx):
        epoch = self.current_epoch
        self.log("score", float(10 - epoch) if self.global_rank == 0 else float(epoch))  # no sync_dist
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)

strategy, epochs, resume = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
ckpt = ls.ModelCheckpoint(monitor="score", mode="min", save_top_k=1, filename="{{epoch}}-{{score:.1f}}")
stop = ls.EarlyStopping(monitor="score", mode="min", patience=1)
trainer = ls.Trainer(strategy=strategy, devices=2, accelerator="cpu", max_epochs=epochs, limit_train_batches=2,
                     limit_val_batches=1, logger=False, enable_progress_bar=False, callbacks=[ckpt, stop])
trainer.fit(PerRankScore(), regression_data(32), regression_data(8), ckpt_path=resume)
if trainer.is_global_zero:
    print("RESULT" + json.dumps({{"epochs": trainer.current_epoch, "best": ckpt.best_model_path,
                                 "step": trainer.global_step}}))
"""


@pytest.mark.parametrize("strategy", ["ddp", "deepspeed_stage_2", "fsdp"])
def test_checkpoint_and_stop_decided_on_rank0(tmp_path, strategy):
    script = tmp_path / "decide.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests")))

    def run(*args: str) -> dict:
        done = launch(
            [str(script), strategy, *args],
            cwd=tmp_path,
            nproc=1,
            timeout=240,
            extra_env={"DS_ACCELERATOR": "cpu"},
        )
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")), None)
        assert done.returncode == 0 and line, done.stdout[-2000:] + done.stderr[-4000:]
        return json.loads(line[len("RESULT") :])

    first = run("3")
    assert first["epochs"] == 3  # rank 1's score never improves; rank 0's does, and rank 0 decides
    assert first["best"].endswith("epoch=2-score=8.0.ckpt")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["epoch=2-score=8.0.ckpt", "last.ckpt"], (
        names
    )  # no leftover .tmp- folder from a rank's own name
    resumed = run("4", "last")  # complete on both ranks: it resumes
    assert resumed["epochs"] == 4 and resumed["step"] == 8
