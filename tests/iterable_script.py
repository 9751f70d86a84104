"""Loaders without an exact length on 2 ranks: `python tests/iterable_script.py '<json options>'`
(tests/test_iterable_loaders.py).

Each rank streams its own batches from an IterableDataset (the user's sharding, as Lightning
expects): rank r yields `lengths[r]` batches of 4 samples, drawn from a generator seeded by (rank,
batch), so every strategy sees the same data. Options: out (a folder), strategy, lengths, claimed
(the dataset's `__len__` in batches, the same on every rank: an estimate; absent: no `__len__`),
stateful (torchdata's StatefulDataLoader), max_epochs, max_steps, accumulate, val_check_interval,
ckpt_every (a checkpoint every N steps in <out>/ckpt), resume (a checkpoint path); jobs (a list of
these: each in turn, in the same ranks, its output after a line "[iterable_script job <i>]").

Each rank writes <out>/rank<r>.json: the loss and the batch ids of each step, global_step, the
epochs run, validation batches run, `trainer.is_last_batch` per step, the training loader's
sampler class and `estimated_stepping_batches` as configure_optimizers saw it.

With `"eval": true`, evaluation over streams of uneven length per rank, in one job (`evaluate`):
fit (2 steps, a sanity check of 2 batches, then validation at the epoch's end over two loaders,
limit_val_batches=4: loader 0 yields 5 batches on rank 0 and 2 on rank 1 behind a `__len__` that
claims 20, loader 1 none on rank 0 and 3 on rank 1), then `validate` on the same loaders, `test`
(2 and 11 batches: two windows of agreement) and `predict` (3 and 1). Each step logs its batch's
mean feature with sync_dist and runs the model (a collective forward under ZeRO-3 and FSDP).
<out>/rank<r>.json: per stage the batch ids the batch hooks saw and how many times the step ran,
the epoch values logged, and `predict`'s outputs.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset

import lightspeed as L

BATCH = 4


class Stream(IterableDataset):
    """`lengths[rank]` batches of (id, features) on each rank, without a `__len__`. Its position
    (samples given) is its state, which a StatefulDataLoader saves and restores: `restored` records
    where a load put it."""

    restored: list = []

    def __init__(self, lengths: list[int], offset: int = 0):
        self.lengths, self.given, self.start, self.offset = lengths, 0, 0, offset

    def __iter__(self):
        rank = dist.get_rank() if dist.is_initialized() else 0
        start, self.start = self.start, 0
        self.given = start
        for b in range(start // BATCH, self.lengths[rank]):
            at = self.offset + 1000 * rank + b  # the batch's id, and its data's seed
            g = torch.Generator().manual_seed(at)
            for i in range(BATCH):
                self.given += 1
                yield torch.tensor(at), torch.randn(8, generator=g) + i

    def state_dict(self) -> dict:
        return {"given": self.given}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["given"]
        Stream.restored.append(state["given"])


class Estimated(Stream):
    """A `__len__` of `claimed` batches that every rank reports alike, whatever it yields."""

    def __init__(self, lengths: list[int], claimed: int, offset: int = 0):
        super().__init__(lengths, offset)
        self.claimed = claimed

    def __len__(self):
        return self.claimed * BATCH


class Recorder(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.steps: list = []  # per micro-batch: [global_step, epoch, batch id, loss, is_last]
        self.val_batches = 0
        self.estimated = None

    def training_step(self, batch, batch_idx):
        ids, x = batch
        loss = self.net(x).pow(2).mean()
        last = self.trainer.is_last_batch
        self.steps.append([self.global_step, self.current_epoch, int(ids[0]), loss.item(), last])
        return loss

    def validation_step(self, batch, batch_idx):
        self.val_batches += 1

    def configure_optimizers(self):
        self.estimated = self.trainer.estimated_stepping_batches
        return torch.optim.SGD(self.parameters(), lr=0.05)


class EvalRecorder(Recorder):
    """Records what each evaluation stage saw: the batch ids its batch hooks got (real batches
    only) and its step's calls (a shadow step counts too)."""

    def __init__(self):
        super().__init__()
        self.seen: dict = {}  # "<stage>/<dataloader_idx>": [batch ids]
        self.calls: dict = {}  # "<stage>": step calls

    def _step(self, stage: str, batch) -> torch.Tensor:
        ids, x = batch
        self.calls[stage] = self.calls.get(stage, 0) + 1
        self.log(f"{stage}_x", x.mean(), sync_dist=True)
        return self.net(x).sum() * 0 + ids[0]

    def validation_step(self, batch, batch_idx, dataloader_idx=0):
        stage = "sanity" if self.trainer.sanity_checking else "val"
        return self._step(stage, batch)

    def test_step(self, batch, batch_idx):
        return self._step("test", batch)

    def predict_step(self, batch, batch_idx):
        return self._step("predict", batch)

    def _saw(self, stage: str, batch, dataloader_idx: int) -> None:
        self.seen.setdefault(f"{stage}/{dataloader_idx}", []).append(int(batch[0][0]))

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self._saw("sanity" if self.trainer.sanity_checking else "val", batch, dataloader_idx)

    def on_test_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self._saw("test", batch, dataloader_idx)

    def on_predict_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self._saw("predict", batch, dataloader_idx)


def evaluate(opts: dict) -> None:
    """fit, validate, test and predict over streams of uneven length per rank (module docstring)."""
    L.seed_everything(0)
    out = Path(opts["out"])
    model = EvalRecorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=opts["strategy"],
        max_epochs=1,
        limit_val_batches=4,
        num_sanity_val_steps=2,
        enable_checkpointing=False,
        logger=False,
        default_root_dir=str(out),
    )

    def val():
        loader = DataLoader(Estimated([5, 2], claimed=20, offset=0), batch_size=BATCH)
        return [loader, DataLoader(Stream([0, 3], offset=100), batch_size=BATCH)]

    train = DataLoader(Stream([2, 2], offset=50), batch_size=BATCH)
    trainer.fit(model, train, val())
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    validated = trainer.validate(model, val())
    tested = trainer.test(model, DataLoader(Stream([2, 11], offset=200), batch_size=BATCH))
    predicted = trainer.predict(model, DataLoader(Stream([3, 1], offset=300), batch_size=BATCH))
    result = {
        "fit": fit_metrics,
        "validate": validated,
        "test": tested,
        "predict": [int(p) for p in predicted],
        "seen": model.seen,
        "calls": model.calls,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main(opts: dict) -> None:
    if opts.get("eval"):
        return evaluate(opts)
    L.seed_everything(0)
    out = Path(opts["out"])
    claimed = opts.get("claimed")
    data = Estimated(opts["lengths"], claimed) if claimed else Stream(opts["lengths"])
    loader_cls = DataLoader
    if opts.get("stateful"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader_cls = StatefulDataLoader
    val = DataLoader(Stream([3, 3]), batch_size=BATCH)
    callbacks = []
    if opts.get("ckpt_every"):
        every = opts["ckpt_every"]
        callbacks.append(
            L.ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=every, save_top_k=-1)
        )
    model = Recorder()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=opts["strategy"],
        max_epochs=opts.get("max_epochs"),
        max_steps=opts.get("max_steps", -1),
        accumulate_grad_batches=opts.get("accumulate", 1),
        val_check_interval=opts.get("val_check_interval"),
        num_sanity_val_steps=0,
        callbacks=callbacks,
        enable_checkpointing=bool(callbacks),
        logger=False,
        default_root_dir=str(out),
    )
    trainer.fit(model, loader_cls(data, batch_size=BATCH), val, ckpt_path=opts.get("resume"))
    result = {
        "global_step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "steps": model.steps,
        "val_batches": model.val_batches,
        "sampler": type(trainer.train_dataloader.sampler).__name__,
        "estimated": str(model.estimated),
        "restored": Stream.restored,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    given = json.loads(sys.argv[1])
    for i, job in enumerate(given.get("jobs", [given])):  # several runs, in the same ranks
        if int(os.environ.get("RANK", "0")) == 0:  # where the job's output starts (rank 0's)
            print(f"[iterable_script job {i}]", flush=True)
        Stream.restored = []
        main(job)
