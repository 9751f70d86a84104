"""`strategy="auto"` whose first plan runs out of memory at setup: `python tests/fallback_script.py
<out.json> [honest] [steps]` (test_plan_families.py runs it; the Trainer starts the second rank).

The forecast is made wrong on purpose for ddp (it claims ddp holds nothing, as issue 38's forecast
missed DeepSpeed's flatten copy), so the plan chooses ddp under a `memory_budget` that ddp cannot
meet: its setup holds the whole weights and Adagrad's state (built at construction, a real
allocation) past the budget on both ranks. Every rank learns it, ddp is torn down, and the next plan
that fits is set up and trains. Rank 0 writes what ran and the losses. With `honest` the forecast
is left as it is, and the plan chooses directly what the fallback chose.

With `steps` the optimizer is Adam, whose state comes at the first step: ddp sets up within the
budget and runs out of it in its first step (weights and Adam's two moments held after the step),
so the fallback happens there, after ddp stepped the module's own tensors.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
import lightspeed.plan.forecast as plan

real_forecast = plan.forecast_candidate


def optimistic(c, *args, **kwargs):
    """The forecast, except that ddp is said to hold nothing."""
    f = real_forecast(c, *args, **kwargs)
    if c.name != "ddp":
        return f
    return replace(f, params=0, grads=0, optim=0, activations=0, buffers=0, save_buffers=0)


if "honest" not in sys.argv[2:]:
    plan.forecast_candidate = optimistic
STEPS = "steps" in sys.argv[2:]


class Table(ls.LightningModule):
    """Most weights outside the repeated blocks (an embedding), so a shard of them is small beside
    the whole; Adagrad allocates its state when it is built, at setup."""

    def __init__(self, batch_size: int = 2):
        super().__init__()
        self.batch_size = batch_size
        self.table = torch.nn.Embedding(8192, 64)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(4))

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        h = self.table(ids)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return h.pow(2).mean()

    def configure_optimizers(self):
        if STEPS:
            return torch.optim.Adam(self.parameters(), lr=0.1)
        return torch.optim.Adagrad(self.parameters(), lr=0.1)

    def train_dataloader(self):
        ids = torch.randint(0, 8192, (16, 4), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids), batch_size=self.batch_size)


class Losses(ls.Callback):
    def __init__(self):
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(outputs.detach() if torch.is_tensor(outputs) else outputs["loss"]))


def main(out: str) -> None:
    ls.seed_everything(0)
    model, losses = Table(), Losses()
    numel = sum(p.numel() for p in model.parameters())
    # ddp holds 8 bytes per parameter after setup (fp32 weights and Adagrad's sum); fsdp's whole
    # forecast on 2 ranks is about 6 (a half of weights, gradients and state): a budget between.
    budget = 7.5 * numel
    if STEPS:  # ddp: 4 bytes per parameter after setup, 12 after its first step; fsdp about 8
        budget = 10 * numel
    trainer = ls.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="auto",
        memory_budget=budget,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[losses],
    )
    trainer.fit(model)
    if trainer.is_global_zero:
        result = {"strategy": trainer.strategy.name, "losses": losses.losses, "budget": budget}
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
