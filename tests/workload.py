"""The script every multi-rank test runs: `python tests/workload.py '<json options>'`.

It trains the tiny GPT with the Trainer (which starts its own ranks for devices > 1, or joins torchrun's),
records the per-step global-mean losses, and rank 0 writes them with other facts to the JSON file `out`.
Options (all optional except out): strategy, devices, max_steps, max_epochs, accumulate, clip, clip_algo,
precision, batch_size, ckpt_every, resume ("last" or a path), root, seed, limit_train_batches, shuffle,
predict, validate, test, consolidate (a path), fail_rank (raise on that rank at step 3), dropout, num_nodes,
progress (show the progress bar).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import lightspeed as ls  # noqa: E402
from lightspeed.examples.gpt import SIZES, ByteWindows, GPTModule, stdlib_corpus  # noqa: E402


class Workload(GPTModule):
    def __init__(self, opts: dict):
        # Bias-free: a key bias has a zero gradient (softmax ignores shifts), and Adam turns the fp32 noise
        # in that gradient into full-size updates, which would make weight comparisons meaningless.
        cfg = dataclasses.replace(SIZES["tiny"], bias=False, dropout=opts.get("dropout", 0.0))
        super().__init__(cfg, lr=opts.get("lr", 3e-3), warmup_steps=opts.get("warmup", 0))
        self.opts = opts
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        if self.opts.get("fail_rank") == self.global_rank and self.global_step == 3:
            raise RuntimeError(f"deliberate failure on rank {self.global_rank}")
        loss = self._loss(batch)
        self.log("loss", loss, prog_bar=True, sync_dist=True)
        self.losses.append(float(self.trainer.callback_metrics["loss"]))
        return loss


def main(opts: dict) -> None:
    ls.seed_everything(opts.get("seed", 0))
    data = ByteWindows(stdlib_corpus(60_000), SIZES["tiny"].block_size)
    bs = opts.get("batch_size", 8)
    train = DataLoader(data, batch_size=bs, shuffle=opts.get("shuffle", False))
    val = DataLoader(data, batch_size=bs)
    module = Workload(opts)
    callbacks = []
    if opts.get("ckpt_every"):
        callbacks.append(ls.ModelCheckpoint(every_n_train_steps=opts["ckpt_every"], save_top_k=-1))
    trainer = ls.Trainer(
        strategy=opts.get("strategy", "auto"), devices=opts.get("devices", 1), num_nodes=opts.get("num_nodes", 1),
        max_steps=opts.get("max_steps", -1),
        max_epochs=opts.get("max_epochs"), accumulate_grad_batches=opts.get("accumulate", 1),
        gradient_clip_val=opts.get("clip"), gradient_clip_algorithm=opts.get("clip_algo", "norm"),
        precision=opts.get("precision", "32-true"), default_root_dir=opts.get("root", "."),
        limit_train_batches=opts.get("limit_train_batches"), limit_val_batches=4, limit_test_batches=4,
        limit_predict_batches=opts.get("limit_predict_batches"), seed=opts.get("seed", 0),
        enable_progress_bar=bool(opts.get("progress")), enable_checkpointing=bool(opts.get("ckpt_every") or opts.get("checkpointing")),
        callbacks=callbacks, logger=False, accelerator="cpu",
    )
    result: dict = {"world_size": trainer.world_size}
    trainer.fit(module, train, val if opts.get("val") else None, ckpt_path=opts.get("resume"))
    result.update(losses=module.losses, global_step=trainer.global_step, epoch=trainer.current_epoch,
                  strategy=trainer.strategy.name)
    if opts.get("validate"):
        result["validate"] = trainer.validate(module, val)
    if opts.get("test"):
        result["test"] = trainer.test(module, val)
    if opts.get("predict"):
        preds = trainer.predict(module, DataLoader(data, batch_size=bs))
        result["predict_batches"] = len(preds)
    if opts.get("save_to"):
        trainer.save_checkpoint(opts["save_to"])
        if trainer.is_global_zero and opts.get("consolidate"):
            ls.consolidate(opts["save_to"], opts["consolidate"])
    if trainer.is_global_zero:
        with open(opts["out"], "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    # The deepspeed launcher appends --local_rank=N to the script's arguments; the options are the other one.
    main(json.loads(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
