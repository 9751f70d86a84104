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
import json, os, sys
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

for job in json.loads(sys.argv[1]):  # one run after another, in the same ranks, each in its folder
    os.chdir(job["dir"])
    ckpt = ls.ModelCheckpoint(monitor="score", mode="min", save_top_k=1, filename="{{epoch}}-{{score:.1f}}")
    stop = ls.EarlyStopping(monitor="score", mode="min", patience=1)
    trainer = ls.Trainer(strategy=job["strategy"], devices=2, accelerator="cpu", max_epochs=job["epochs"],
                         limit_train_batches=2, limit_val_batches=1, logger=False, enable_progress_bar=False,
                         callbacks=[ckpt, stop])
    trainer.fit(PerRankScore(), regression_data(32), regression_data(8), ckpt_path=job.get("resume"))
    if trainer.is_global_zero:
        print("RESULT" + json.dumps({{"job": job["name"], "epochs": trainer.current_epoch,
                                     "best": ckpt.best_model_path, "step": trainer.global_step,
                                     "files": sorted(os.listdir("checkpoints"))}}))
"""


STRATEGIES = ["ddp", "deepspeed_stage_2", "fsdp"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple:
    """Each strategy's run of 3 epochs, then its resume from `last` to 4, each in its strategy's
    folder, one after another in one launched job (the ranks start once). Returns (the folder,
    job name -> rank 0's result)."""
    tmp = tmp_path_factory.mktemp("decisions")
    script = tmp / "decide.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests")))
    jobs = []
    for strategy in STRATEGIES:
        (tmp / strategy).mkdir()
        where = dict(dir=str(tmp / strategy), strategy=strategy)
        jobs += [dict(name=f"{strategy}-first", epochs=3, **where)]
        jobs += [dict(name=f"{strategy}-resumed", epochs=4, resume="last", **where)]
    done = launch(
        [str(script), json.dumps(jobs)],
        cwd=tmp,
        nproc=1,
        timeout=600,
        extra_env={"DS_ACCELERATOR": "cpu"},
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    assert done.returncode == 0 and len(lines) == len(jobs), (
        done.stdout[-2000:] + done.stderr[-4000:]
    )
    return tmp, {r["job"]: r for r in (json.loads(ln[len("RESULT") :]) for ln in lines)}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_and_stop_decided_on_rank0(results, strategy):
    tmp, runs = results
    first = runs[f"{strategy}-first"]
    assert first["epochs"] == 3  # rank 1's score never improves; rank 0's does, and rank 0 decides
    assert first["best"].endswith("epoch=2-score=8.0.ckpt")
    # no leftover .tmp- folder from a rank's own name (listed by rank 0 after the fit)
    assert first["files"] == ["epoch=2-score=8.0.ckpt", "last.ckpt"], first["files"]
    resumed = runs[f"{strategy}-resumed"]  # complete on both ranks: it resumes
    assert resumed["epochs"] == 4 and resumed["step"] == 8
    names = [p.name for p in (tmp / strategy / "checkpoints").iterdir()]  # after both runs
    assert all(n.endswith(".ckpt") and not n.startswith(".") for n in names), names
