"""Evaluation on 2 ranks sees each sample once: `python tests/eval_once_script.py <out_dir>
<strategy>` (test_eval_once.py runs it). 5 samples at batch 2: rank 0 holds 3 (2 batches), rank 1
holds 2 (1 batch). validate, test and predict each record the dataset indices every step saw;
rank r writes <out_dir>/rank<r>.json with them and the metrics rank 0 got back."""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

import lightspeed as ls
from lightspeed.callbacks import BasePredictionWriter


class Indexed(Dataset):
    """Sample i is the float i: a step knows which samples it got."""

    def __len__(self):
        return 5

    def __getitem__(self, i):
        return torch.tensor([float(i)])


class Net(ls.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: dict[str, list[int]] = {"validate": [], "test": []}

    def _eval(self, batch, stage):
        self.layer(batch)  # a forward: a collective under fsdp and ZeRO-3
        self.seen[stage] += [int(v) for v in batch.flatten().tolist()]
        self.log(f"{stage}_count", float(batch.shape[0]), reduce_fx="sum", sync_dist=True)
        self.log(f"{stage}_sum", batch.sum(), reduce_fx="sum", sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._eval(batch, "validate")

    def test_step(self, batch, batch_idx):
        self._eval(batch, "test")

    def predict_step(self, batch, batch_idx):
        return self.layer(batch)


class Indices(BasePredictionWriter):
    def __init__(self):
        super().__init__(write_interval="epoch")
        self.indices: list[int] = []

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices):
        self.indices = [i for batch in batch_indices[0] for i in batch]


def main(out: Path, strategy: str) -> None:
    writer, net = Indices(), Net()
    trainer = ls.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[writer],
    )
    loader = DataLoader(Indexed(), batch_size=2)
    metrics = {}
    metrics.update(trainer.validate(net, loader)[0])
    metrics.update(trainer.test(net, loader)[0])
    predictions = trainer.predict(net, loader)
    result = {
        **net.seen,
        "predict": writer.indices,
        "predictions": sum(len(p) for p in predictions),
        "metrics": metrics,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
