"""Lightning's surface on 2 ranks: `python tests/lightning_api_script.py <out_dir> <strategy>`
(test_lightning_ranks.py runs it under ddp, deepspeed_stage_3 and fsdp).

Each rank writes <out_dir>/rank<r>.json: what rank_zero_only returned, the DataModule's setup calls,
the model summary's counts, the validation metric names with two loaders, and its predictions.
prepare_data appends the rank to <out_dir>/prepared.txt (it must run once on this node). The fit
saves checkpoints under <out_dir>.
"""

import json
import os
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightspeed import Callback, CSVLogger, LightningDataModule, LightningModule, Trainer
from lightspeed.report.summary import summarize
from lightspeed.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from lightspeed.utilities import rank_zero_only

OUT = Path(sys.argv[1]) if __name__ == "__main__" else Path(".")  # the test imports Net from here


def predict_inputs() -> torch.Tensor:
    return data(2, 3).tensors[0]


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


class Data(LightningDataModule):
    def __init__(self):
        self.stages: list[str] = []
        self.transfers: list[str] = []

    def prepare_data(self):
        with open(OUT / "prepared.txt", "a") as f:
            f.write(f"{rank_zero_only.rank}\n")

    def setup(self, stage):
        self.stages.append(stage)

    def on_before_batch_transfer(
        self, batch, dataloader_idx
    ):  # every batch of every loop, on each rank
        t = self.trainer
        state = (
            "train"
            if t.training
            else "sanity"
            if t.sanity_checking
            else "validate"
            if t.validating
            else "predict"
            if t.predicting
            else "?"
        )
        self.transfers.append(f"{state}/{dataloader_idx}")
        return batch

    def train_dataloader(self):
        return DataLoader(data(32, 0), batch_size=4)

    def val_dataloader(self):
        return [DataLoader(data(8, 1), batch_size=2), DataLoader(data(8, 2), batch_size=2)]

    def predict_dataloader(self):
        return DataLoader(data(2, 3), batch_size=1)


class Net(LightningModule):
    def __init__(self, hidden: int = 16, lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self):
        if not hasattr(self, "body"):
            self.body = torch.nn.Sequential(
                torch.nn.Linear(8, self.hparams.hidden), torch.nn.Tanh()
            )
            self.head = torch.nn.Linear(self.hparams.hidden, 1)

    def forward(self, x):
        return self.head(self.body(x))

    def training_step(self, batch, batch_idx):
        return torch.nn.functional.mse_loss(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        self.log("val_loss", torch.nn.functional.mse_loss(self(batch[0]), batch[1]), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).tolist()

    @rank_zero_only
    def on_fit_start(
        self,
    ):  # log_dir read on rank 0 alone: in Lightning a collective, so DDP froze (#18148)
        self.log_dir_at_start = self.trainer.log_dir

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Steps(Callback):
    def __init__(self):
        self.counts = {"before_optimizer_step": 0, "before_zero_grad": 0, "after_backward": 0}
        self.names: dict = {}  # Lightning's Trainer names, read inside fit on every rank

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.is_last_batch:
            self.names = dict(
                model=type(trainer.model).__name__,
                module=trainer.lightning_module is module,
                train_batches=trainer.num_training_batches,
                val_batches=trainer.num_val_batches,
                val_loaders=len(trainer.val_dataloaders),
                node_rank=trainer.node_rank,
                local_rank=trainer.local_rank,
                state=[trainer.state.fn, trainer.state.stage],
                last_batch_idx=batch_idx,
                log_dir=trainer.log_dir,
                experiment=type(trainer.logger.experiment).__name__,  # CSVLogger on rank 0 only
                gathered=module.all_gather({"rank": torch.tensor([trainer.global_rank + 0.5])})[
                    "rank"
                ].tolist(),
                gathered_with_grads=module.all_gather(
                    torch.ones(2) * trainer.global_rank, sync_grads=True
                )
                .sum(1)
                .tolist(),
            )

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.counts["before_optimizer_step"] += 1

    def on_before_zero_grad(self, trainer, module, optimizer):
        self.counts["before_zero_grad"] += 1

    def on_after_backward(self, trainer, module):
        self.counts["after_backward"] += 1


# Lightning's strategy classes, as a Lightning script builds them
STRATEGIES = {
    "ddp": lambda: DDPStrategy(find_unused_parameters=False),
    "deepspeed_stage_3": lambda: DeepSpeedStrategy(stage=3, logging_batch_size_per_gpu=4),
    "fsdp": lambda: FSDPStrategy(sharding_strategy="FULL_SHARD"),
}


@rank_zero_only
def on_rank_zero():
    return "ran"


if __name__ == "__main__":
    dm, model, steps = Data(), Net(), Steps()
    if (
        os.environ.get("RANK") == "1"
    ):  # rank 1 starts after rank 0 made version_0: alone, it would count version_1
        (OUT / "logs" / "lightning_logs" / "version_0").mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        accelerator="cpu",
        devices=2,
        strategy=STRATEGIES[sys.argv[2]](),
        max_epochs=1,
        default_root_dir=str(OUT),
        enable_progress_bar=False,
        logger=CSVLogger(OUT / "logs"),
        seed=0,
        num_sanity_val_steps=1,
        callbacks=[steps],
    )
    trainer.fit(model, datamodule=dm)
    summary = summarize(model)
    preds = trainer.predict(datamodule=dm)
    result = dict(
        rank=trainer.global_rank,
        zero_only=on_rank_zero(),
        stages=dm.stages,
        summary=summary,
        metrics=sorted(trainer.callback_metrics),
        preds=preds,
        step=trainer.global_step,
        hooks=steps.counts,
        strategy=trainer.strategy.name,
        names=steps.names,
        transfers={k: dm.transfers.count(k) for k in sorted(set(dm.transfers))},
    )
    (OUT / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
