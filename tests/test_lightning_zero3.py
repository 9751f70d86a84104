"""ZeRO-3 builds the model partitioned as it is created (DeepSpeed's zero.Init). A module that
deep-copies a layer
while it is built, as torch's nn.TransformerEncoder does num_layers times, must train as under DDP:
examples/transformer_encoder.py on 2 CPU ranks, per-step train_loss within 1e-5 relative (fp32; the
reduction order differs). About 40 s.
"""

from __future__ import annotations

import csv
from pathlib import Path

from helpers import ROOT, assert_close_losses, launch


def _losses(cwd: Path, strategy: str) -> list[float]:
    run = launch(
        [
            str(ROOT / "examples" / "transformer_encoder.py"),
            "--devices",
            "2",
            "--strategy",
            strategy,
        ],
        cwd,
    )
    assert run.returncode == 0, f"{strategy} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    log = next(cwd.glob("lightning_logs/version_0/metrics.csv"))
    return [float(r["train_loss"]) for r in csv.DictReader(log.open()) if r.get("train_loss")]


def test_transformer_encoder_deep_copies_under_zero3_match_ddp(tmp_path):
    (tmp_path / "ddp").mkdir()
    (tmp_path / "ds3").mkdir()
    ddp = _losses(tmp_path / "ddp", "ddp")
    ds3 = _losses(tmp_path / "ds3", "deepspeed_stage_3")
    assert len(ds3) == len(ddp) == 8
    assert_close_losses(ds3, ddp, 1e-5, "nn.TransformerEncoder, deepspeed_stage_3 vs ddp")
