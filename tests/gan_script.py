"""examples/gan.py's own `main`, run for several jobs in the same 2 ranks (one interpreter start-up
and one rendezvous for them all): `python tests/gan_script.py '<json list of jobs>'`.

A job is a dict: dir (the folder the example runs in, as its user would: checkpoints/ and
lightning_logs/ land there), strategy, and optionally ckpt_path and max_steps, the example's own
flags (its defaults otherwise: 8 steps, a checkpoint every 4). A job with "validate_then_fit": true
runs `validate_then_fit` instead, which writes dir/losses.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
from gan import GAN, images_and_noise, main  # noqa: E402

import lightspeed as L  # noqa: E402
from lightspeed.strategies.deepspeed.strategy import DeepSpeed  # noqa: E402


class Checked(GAN):
    def validation_step(self, batch, batch_idx):
        self.log("val_fake", self.discriminator(self(batch[1])).mean(), sync_dist=True)


def validate_then_fit() -> None:
    """ZeRO-3: one evaluation-only engine over the whole module, then one engine per optimizer over
    the same submodules (each network's nn.Sequential a ZeRO-3 leaf module: one gather per
    network, not one per Linear)."""
    L.seed_everything(7)
    model = Checked()
    strategy = DeepSpeed(stage=3, leaf_modules=[torch.nn.Sequential])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(model, images_and_noise(32, 32))
    trainer.fit(model, images_and_noise(256, 32))
    if trainer.is_global_zero:
        losses = [float(trainer.callback_metrics[k]) for k in ("g_loss", "d_loss")]
        Path("losses.json").write_text(json.dumps(losses))


def run(job: dict) -> None:
    os.chdir(job["dir"])
    if job.get("validate_then_fit"):
        validate_then_fit()
        return
    flags = dict(accelerator="cpu", devices=2, max_steps=8, save_every=4, ckpt_path=None)
    main(argparse.Namespace(**{**flags, **{k: v for k, v in job.items() if k != "dir"}}))


if __name__ == "__main__":
    for job in json.loads(sys.argv[1]):
        run(job)
