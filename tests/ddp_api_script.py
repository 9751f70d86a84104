"""Module API on 2 DDP ranks: `python tests/ddp_api_script.py <out_dir>` (test_trainer.py runs it).

With Trainer(devices=2) the script spawns its second rank itself. Each rank writes what it saw to
<out_dir>/rank<r>.json: sync_dist reductions, its sampler order, its predictions, manual
optimization results. Two Trainers run in one script, as users do (fit, then another fit).
"""

import json
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls


class Logs(ls.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.order: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.order += [int(v) for v in x[:, 0]]
        r = float(self.global_rank + 1)
        self.log("synced", r, sync_dist=True, on_step=False, on_epoch=True)
        self.log("synced_sum", r, sync_dist=True, reduce_fx="sum", on_step=False, on_epoch=True)
        self.log("unsynced", r, on_step=False, on_epoch=True)
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def predict_step(self, batch, batch_idx):
        return batch[0][:, 0].clone()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Manual(ls.Module):
    automatic_optimization = False

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(1, 1)
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        sched.step()
        self.losses.append(float(loss.detach()))

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)]


def main(out: str) -> None:
    x = torch.arange(10.0)[:, None]
    data = TensorDataset(x, 2 * x / 10)
    kw = dict(
        accelerator="cpu",
        devices=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        seed=0,
    )
    trainer = ls.Trainer(max_epochs=1, **kw)
    model = Logs()
    trainer.fit(model, DataLoader(data, batch_size=1, shuffle=False))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    preds = trainer.predict(model, DataLoader(data, batch_size=2))
    model.print(f"printed by rank {model.global_rank}")

    manual = Manual()
    trainer2 = ls.Trainer(max_steps=5, **kw)
    # Rank-dependent data: without DDP's gradient all-reduce the two ranks' weights would drift
    # apart.
    trainer2.fit(
        manual, DataLoader(TensorDataset(x / 10, (trainer.global_rank + 1) * x / 10), batch_size=1)
    )
    # shuffle=True: a DistributedSampler that reshuffles each epoch (set_epoch), the ranks splitting
    # the data.
    shuffled = Logs()
    ls.Trainer(max_epochs=2, **kw).fit(shuffled, DataLoader(data, batch_size=1, shuffle=True))
    result = dict(
        global_rank=model.global_rank,
        train_order=model.order,
        shuffled_order=shuffled.order,
        predictions=[int(v) for p in preds for v in p],
        manual_losses=manual.losses,
        manual_weights=[float(p.detach()) for p in manual.parameters()],
        manual_lr=trainer2.strategy.optimizers[0].param_groups[0]["lr"],
        **metrics,
    )
    with open(f"{out}/rank{trainer.global_rank}.json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
