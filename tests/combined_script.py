"""Two training loaders as a dict, on 2 ranks: `python tests/combined_script.py <out_dir>`
(test_lightning_names.py).

Each rank writes <out_dir>/rank<r>.json: the sample indices it trained on from each loader, per
epoch. In the second epoch rank 1 alone asks to skip the rest (on_train_batch_start returns -1 at
batch 2): both ranks stop.
"""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L


def indexed(n: int) -> TensorDataset:
    return TensorDataset(
        torch.arange(n), torch.randn(n, 4, generator=torch.Generator().manual_seed(n))
    )


class TwoSources(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: dict = {}

    def training_step(self, batch, batch_idx):
        for name, (idx, x) in batch.items():
            self.seen.setdefault(f"{self.current_epoch}/{name}", []).extend(idx.tolist())
        return sum(self.layer(x).pow(2).mean() for _, x in batch.values())

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if (self.global_rank, self.current_epoch, batch_idx) == (1, 1, 2) else None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    model = TwoSources()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=2,
        default_root_dir=str(out),
        enable_progress_bar=False,
        logger=False,
        enable_checkpointing=False,
        seed=0,
    )
    trainer.fit(
        model,
        {
            "a": DataLoader(indexed(32), batch_size=4, shuffle=True),
            "b": DataLoader(indexed(16), batch_size=4),
        },
    )
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(dict(step=trainer.global_step, seen=model.seen))
    )
