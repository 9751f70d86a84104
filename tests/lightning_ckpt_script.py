"""One model trained by real Lightning or by lightspeed, for tests/test_lightning_ckpt.py: the
checkpoint files travel between the two.

    PYTHONPATH=.venv/lightning-ref python tests/lightning_ckpt_script.py lightning JOBS.json OUT.json
    PYTHONPATH=src python tests/lightning_ckpt_script.py lightspeed JOBS.json OUT.json

Imported (the test's own process), it is the lightspeed side: `run(jobs)` returns the results.

JOBS.json is a list of jobs run in order, each a dict: "fit" (a Trainer.fit: "devices", "strategy"
(default: ddp on 2 devices), "epochs", "save_to" (a checkpoint saved after fit),
"resume" (a checkpoint or None), "save" (a folder: a checkpoint at each epoch's end and one every
"mid" steps, under `epochs/` and `mid/`)), or "load" (`Model.load_from_checkpoint(path)`: its
weights and hyper-parameters). Rank 0 writes each job's result (a fit's per-step losses, rank 0's
own batches) to OUT.json. The data is fixed, not shuffled on one device; on 2 ranks it is
shuffled by a DistributedSampler with seed 0 in both frameworks (Lightning shuffles a training
loader under DDP whatever its sampler; lightspeed keeps the loader's setting, so it is asked for),
so both see the same batches on each rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__" and sys.argv[1] == "lightning":
    import lightning.pytorch as pl
else:  # run with "lightspeed", or imported by the test
    import lightspeed as pl

N, BATCH = 32, 4  # 8 batches an epoch on one device, 4 on each of 2 ranks


class Model(pl.LightningModule):
    """A small regression with Adam (per-parameter state) and an epoch StepLR (a scheduler whose
    state must travel)."""

    def __init__(self, hidden: int = 16, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.7)}


def data(shuffle: bool) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g)
    y = torch.sin(x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]))
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=shuffle)


def fit(job: dict) -> dict:
    torch.manual_seed(0)
    callbacks = []
    if job.get("save"):
        root = Path(job["save"])
        callbacks = [
            pl.callbacks.ModelCheckpoint(root / "epochs", every_n_epochs=1, save_top_k=-1),
            pl.callbacks.ModelCheckpoint(
                root / "mid", every_n_train_steps=job["mid"], save_top_k=-1
            ),
        ]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=job.get("devices", 1),
        strategy=job.get("strategy") or ("ddp" if job.get("devices", 1) > 1 else "auto"),
        max_epochs=job["epochs"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=callbacks,
    )
    model = Model()
    trainer.fit(model, data(shuffle=job.get("devices", 1) > 1), ckpt_path=job.get("resume"))
    if job.get("save_to"):
        trainer.save_checkpoint(job["save_to"])
    return {"losses": model.losses, "global_step": trainer.global_step, "rank": trainer.global_rank}


def load(job: dict) -> dict:
    model = Model.load_from_checkpoint(job["path"])
    return {
        "hparams": dict(model.hparams),
        "weights": {k: v.flatten().tolist() for k, v in model.state_dict().items()},
    }


def run(jobs: list[dict]) -> list[dict]:
    return [fit(job) if job["kind"] == "fit" else load(job) for job in jobs]


def main() -> None:
    results = run(json.loads(Path(sys.argv[2]).read_text()))
    if all(r.get("rank", 0) == 0 for r in results):
        Path(sys.argv[3]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
