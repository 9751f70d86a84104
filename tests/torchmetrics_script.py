"""torchmetrics objects logged with `self.log`, as Lightning code does:
`python tests/torchmetrics_script.py <out_dir> <devices>` (test_lightning_names.py runs it on 2
ranks, and calls `main` in its own process on one device).

Each rank writes <out_dir>/rank<r>.json: the logged epoch values, and the counts of right answers
and samples it saw itself, so the test can check that the epoch value covers every rank's samples.
"""

import json
import sys
from pathlib import Path

import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L


def data(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()), batch_size=4)


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 3)
        self.train_acc = torchmetrics.classification.MulticlassAccuracy(
            num_classes=3, average="micro"
        )
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(
            num_classes=3, average="micro"
        )
        self.seen = {
            "train": [0, 0],
            "val": [0, 0],
        }  # right answers, samples: this rank's, last epoch

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.train_acc(logits, y)  # forward: the batch's value, and the epoch's state
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self._count("train", logits, y)
        return torch.nn.functional.cross_entropy(logits, y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.val_acc.update(logits, y)  # update only: logged per epoch
        self.log("val_acc", self.val_acc)
        self._count("val", logits, y)

    def _count(self, stage, logits, y):
        self.seen[stage][0] += int((logits.argmax(1) == y).sum())
        self.seen[stage][1] += len(y)

    def on_train_epoch_start(self):
        self.seen = {"train": [0, 0], "val": [0, 0]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main(out: Path, devices: int) -> None:
    model = Classifier()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=2,
        default_root_dir=str(out),
        enable_progress_bar=False,
        logger=False,
        seed=0,
        num_sanity_val_steps=2,
        enable_checkpointing=False,
    )
    trainer.fit(model, data(64, 0), data(24, 1))
    logged = {k: float(v) for k, v in trainer.callback_metrics.items() if "acc" in k}
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(dict(logged=logged, seen=model.seen))
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]))
