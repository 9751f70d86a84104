"""An LR range test, then a fit, on any strategy: `python tests/tuner_script.py '<JSON list>'`, each
item {out, strategy, devices, batch_size, config (optional)} run in turn in the same ranks
(test_tuner.py runs it on 2 ranks; `run` also runs in-process on one). A DeepSpeed config makes the
strategy DeepSpeed(stage=2, config=...).

Each rank writes <out>/rank<r>.json: the range test's LRs and losses and its suggestion, the step
and epoch after it, whether the weights read back from a checkpoint saved after it equal the
initial ones bitwise (rank 0), leftover temporary folders, and the losses (mean over ranks) of the
fit that follows; with a DeepSpeed config, its scheduler's state and the LR after the range test.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
from lightspeed.tuner import Tuner

NUM_TRAINING, FIT_STEPS = 60, 5


class Net(ls.LightningModule):
    """A small regression net where the LR matters: the loss falls between 1e-3 and 1e-1 and
    diverges above 0.2 (SGD with momentum)."""

    def __init__(self, lr: float = 0.01):
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def data(batch_size: int) -> DataLoader:
    """512 samples of y = x @ w; each rank's batch_size × ranks makes the global batch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    return DataLoader(TensorDataset(x, x @ (2 * torch.randn(8, 1, generator=g))), batch_size)


class Losses(ls.Callback):
    """Each step's loss, averaged over the ranks."""

    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"].reshape(1).double().cpu()  # detached, as Lightning hands it over
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        self.losses.append(float(loss))


def make_trainer(out: Path, strategy, devices: int, callbacks=(), **flags) -> ls.Trainer:
    """A quiet CPU Trainer of FIT_STEPS steps (`flags` override)."""
    base = dict(
        accelerator="cpu",
        devices=devices,
        max_steps=FIT_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
        optimizer_kernels="as_written",
    )
    return ls.Trainer(strategy=strategy, callbacks=list(callbacks), **{**base, **flags})


def config_scheduler(trainer: ls.Trainer):
    """The DeepSpeed config's scheduler: on the engine, or among the loop's schedulers (the last)."""
    return trainer.model.lr_scheduler or trainer.lr_scheduler_configs[-1].scheduler


def run(
    out: Path, strategy: str, devices: int, batch_size: int, ds_config: dict | None = None
) -> dict:
    """The range test and the fit after it; returns (and writes) this rank's record."""
    ls.seed_everything(0)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = Losses()
    chosen = ls.DeepSpeed(stage=2, config=ds_config) if ds_config else strategy
    trainer = make_trainer(out, chosen, devices, [losses])
    finder = Tuner(trainer).lr_find(
        model,
        data(batch_size),
        min_lr=1e-4,
        max_lr=10.0,
        num_training=NUM_TRAINING,
        update_attr=False,
    )
    record = dict(
        lrs=finder.results["lr"],
        losses=finder.results["loss"],
        suggestion=finder.suggestion(),
        step=trainer.global_step,
        epoch=trainer.current_epoch,
        model_lr=model.lr,
        leftovers=sorted(p.name for p in out.iterdir() if p.name.startswith(".lr_find")),
    )
    if ds_config:  # the config's scheduler: as DeepSpeed built it, before any step
        record["ds_scheduler"] = config_scheduler(trainer).state_dict()
        record["group_lr"] = trainer.optimizers[0].param_groups[0]["lr"]
    saved = trainer.save_checkpoint(out / "after-lr-find")
    if trainer.is_global_zero:
        after = ls.full_state_dict(saved)
        record["weights_kept"] = sorted(before) == sorted(after) and all(
            torch.equal(before[k], after[k]) for k in before
        )
    trainer.fit(model, data(batch_size))
    record.update(fit_losses=losses.losses, fit_steps=trainer.global_step)
    if ds_config:
        record["ds_scheduler_after_fit"] = config_scheduler(trainer).state_dict()
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
    return record


if __name__ == "__main__":
    for job in json.loads(sys.argv[1]):  # one run after another, in the same ranks
        args = job["out"], job["strategy"], job["devices"], job["batch_size"]
        run(Path(args[0]), *args[1:], job.get("config"))
