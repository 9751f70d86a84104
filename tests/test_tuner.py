"""Lightning's tuner: the LR range test (`Tuner.lr_find`, `LearningRateFinder`) on every strategy,
and the batch size search (`Tuner.scale_batch_size`, `BatchSizeFinder`) on one device.

The range test runs on one device in-process and on 2 real gloo ranks under ddp, deepspeed_stage_2
(with a DeepSpeed config's OneCycle scheduler), deepspeed_stage_3 and fsdp: each rank's batch is
half the one-device batch, so the global batches are the same and so must the suggestion be. After
it the weights equal the initial ones bitwise, the step and epoch are 0, and the fit that follows
gives the losses of a fit without the range test.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_tuner.py
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
from helpers import ROOT, assert_close_losses, launch
from lightspeed.callbacks import BatchSizeFinder, LearningRateFinder
from lightspeed.errors import ConfigError
from lightspeed.tuner import Tuner
from lightspeed.tuner.lr_finder import _LRFinder
from tuner_script import Losses, Net, data, make_trainer, run

SCRIPT = ROOT / "tests" / "tuner_script.py"
ONE_CYCLE = {
    "scheduler": {
        "type": "OneCycle",
        "params": {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 3,
            "cycle_momentum": False,
        },
    }
}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The range test and the fit after it on one device (batch 16), and a plain fit's losses."""
    record = run(tmp_path_factory.mktemp("single"), "auto", 1, 16)
    ls.seed_everything(0)
    losses = Losses()
    trainer = make_trainer(tmp_path_factory.mktemp("plain"), "auto", 1, [losses])
    trainer.fit(Net(), data(16))
    return record, losses.losses


def test_lr_find_on_one_device_restores_everything(one_device):
    record, plain = one_device
    assert 20 < len(record["lrs"]) < 60  # the loss diverged: stopped early
    assert record["lrs"][0] == 1e-4 and record["lrs"] == sorted(record["lrs"])
    assert record["suggestion"] in record["lrs"][10:]
    assert record["weights_kept"] and record["leftovers"] == []
    assert (record["step"], record["epoch"], record["model_lr"]) == (0, 0, 0.01)  # update_attr off
    assert record["fit_losses"] == plain and record["fit_steps"] == 5  # bitwise: a fresh fit


TWO_RANKS = ["ddp", "deepspeed_stage_2", "deepspeed_stage_3", "fsdp"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Each strategy's range test and fit on 2 ranks (batch 8 each), one after another in one
    launched job (the ranks start once), each in the folder named after it."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    jobs = []
    for strategy in TWO_RANKS:
        (tmp / strategy).mkdir()
        config = ONE_CYCLE if strategy == "deepspeed_stage_2" else None
        jobs.append(dict(out=str(tmp / strategy), strategy=strategy, devices=2, batch_size=8))
        jobs[-1].update(config=config)
    ran = launch([str(SCRIPT), json.dumps(jobs)], tmp, "python", timeout=600)
    assert ran.returncode == 0, ran.stderr[-5000:]
    return tmp


@pytest.mark.parametrize("strategy", TWO_RANKS)
def test_lr_find_on_two_ranks_agrees_with_one_device(two_ranks, one_device, strategy):
    config = ONE_CYCLE if strategy == "deepspeed_stage_2" else None
    single, plain = one_device
    r0, r1 = (json.loads((two_ranks / strategy / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["lrs"] == r1["lrs"] and r0["losses"] == r1["losses"]  # one curve on every rank
    grid = single["lrs"]
    step = abs(grid.index(r0["suggestion"]) - grid.index(single["suggestion"]))
    print(f"{strategy}: suggestion {r0['suggestion']:.3g} (one device {single['suggestion']:.3g})")
    assert r0["suggestion"] == r1["suggestion"] and step <= 1
    assert r0["weights_kept"] and r0["leftovers"] == r1["leftovers"] == []
    assert (r0["step"], r0["epoch"], r0["fit_steps"]) == (0, 0, 5)
    if config:  # the config's OneCycle is back where DeepSpeed built it; the fit steps it 5 times
        assert r0["ds_scheduler"] == {"last_batch_iteration": -1} and r0["group_lr"] == 0.001
        assert r0["ds_scheduler_after_fit"] == {"last_batch_iteration": 4}
        assert_close_losses(r0["fit_losses"][:1], plain[:1], 1e-5, strategy)
    else:
        assert_close_losses(r0["fit_losses"], plain, 1e-4, strategy)


class Scheduled(Net):
    """The LR in hparams and a StepLR over it: after update_attr both follow the suggestion."""

    def __init__(self, lr: float = 0.01):
        super().__init__(lr)
        del self.lr
        self.save_hyperparameters()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 100)}


def test_update_attr_writes_the_suggestion_into_the_model_and_optimizer(tmp_path):
    ls.seed_everything(0)
    model = Scheduled()
    trainer = make_trainer(tmp_path, "auto", 1)
    callbacks, loggers = list(trainer.callbacks), trainer.loggers
    finder = Tuner(trainer).lr_find(model, data(16), min_lr=1e-4, max_lr=10.0, num_training=60)
    lr = finder.suggestion()
    assert lr is not None and model.hparams.lr == lr
    group = trainer.optimizers[0].param_groups[0]
    assert group["lr"] == group["initial_lr"] == lr and group["momentum"] == 0.9
    assert trainer.lr_scheduler_configs[0].scheduler.base_lrs == [lr]
    assert trainer.callbacks == callbacks and trainer.loggers == loggers
    trainer.fit(model, data(16))
    assert trainer.global_step == 5


def test_learning_rate_finder_callback_runs_before_the_fit(tmp_path):
    ls.seed_everything(0)
    finder, losses = LearningRateFinder(min_lr=1e-4, max_lr=10.0, num_training_steps=60), Losses()
    trainer = make_trainer(tmp_path, "auto", 1, [finder, losses])
    model = Net()
    x, y = data(16).dataset.tensors
    with torch.no_grad():
        first_loss = float(torch.nn.functional.mse_loss(model.net(x[:16]), y[:16]))
    trainer.fit(model, data(16))
    lr = finder.optimal_lr.suggestion()
    assert lr is not None and model.lr == lr != 0.01
    assert trainer.optimizers[0].param_groups[0]["lr"] == lr
    # the fit started from the initial weights at step 0 and ran its own 5 steps
    assert trainer.global_step == 5 and len(losses.losses) == 5
    assert math.isclose(losses.losses[0], first_loss, rel_tol=1e-6)


def test_lr_find_refuses_what_lightning_refuses(tmp_path, caplog):
    trainer = make_trainer(tmp_path, "auto", 1)
    with pytest.raises(AttributeError, match="should have one of these fields"):
        Tuner(trainer).lr_find(Plain(), data(16), update_attr=True)
    with pytest.raises(ConfigError, match="only valid configuration"):
        Tuner(trainer).lr_find(Net(), method="validate")
    with pytest.raises(ConfigError, match="consider setting `train_dataloaders`"):
        Tuner(trainer).lr_find(Net(), dataloaders=data(16))
    with pytest.raises(ValueError, match="already configured with a `LearningRateFinder`"):
        Tuner(make_trainer(tmp_path, "auto", 1, [LearningRateFinder()])).lr_find(Net())
    with pytest.raises(ConfigError, match="only works with single optimizer"):
        Tuner(trainer).lr_find(TwoOptimizers(), data(16))
    with pytest.warns(UserWarning, match="fast_dev_run"):
        assert Tuner(make_trainer(tmp_path, "auto", 1, fast_dev_run=True)).lr_find(Net()) is None
    finder = _LRFinder("exponential", 1e-8, 1.0, 100)
    finder.results = {"lr": [1e-3, 1e-2, 1e-1], "loss": [1.0, 0.5, 0.6]}
    with caplog.at_level(logging.ERROR):
        assert finder.suggestion() is None  # 10 points skipped at the start: none left
    assert "Failed to compute suggestion" in caplog.text
    lrs = torch.linspace(0, 2 * math.pi, 1000)
    losses = torch.sin(lrs).tolist()
    losses[100] = math.nan  # left out
    finder.results = {"lr": lrs.tolist(), "loss": losses}
    assert abs(finder.suggestion(skip_begin=2, skip_end=2) - math.pi) < 1e-2  # steepest descent


class Plain(Net):
    def __init__(self):
        super().__init__()
        del self.lr


class TwoOptimizers(Net):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return [
            torch.optim.SGD(self.net[0].parameters(), lr=0.1),
            torch.optim.SGD(self.net[2].parameters(), lr=0.1),
        ]


class Sized(Net):
    """Reads self.batch_size in train_dataloader (64 samples); "runs out of memory" from `oom_at`."""

    def __init__(self, batch_size: int = 2, oom_at: int = 10**9):
        super().__init__()
        self.batch_size, self.oom_at = batch_size, oom_at

    def training_step(self, batch, batch_idx):
        if self.batch_size >= self.oom_at:
            raise RuntimeError("CUDA error: out of memory")
        return super().training_step(batch, batch_idx)

    def train_dataloader(self):
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)


@pytest.mark.parametrize(
    ("mode", "oom_at", "found"), [("power", None, 16), ("power", 16, 8), ("binsearch", 12, 10)]
)
def test_scale_batch_size_finds_and_sets_the_batch_size(tmp_path, mode, oom_at, found):
    ls.seed_everything(0)
    model = Sized(oom_at=oom_at or 10**9)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = make_trainer(tmp_path, "auto", 1)
    size = Tuner(trainer).scale_batch_size(
        model, mode=mode, steps_per_trial=1, max_trials=4, margin=0.0
    )
    assert size == model.batch_size == found == trainer.train_dataloader.batch_size
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (trainer.global_step, trainer.current_epoch) == (0, 0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".scale_batch_size")]
    with pytest.raises(ValueError, match="not supported with distributed strategies"):
        Tuner(ls.Trainer(strategy="ddp", accelerator="cpu", devices=2)).scale_batch_size(model)
    with pytest.raises(ConfigError, match="dataloaders passed directly"):
        Tuner(trainer).scale_batch_size(model, train_dataloaders=model.train_dataloader())


def test_batch_size_finder_callback_runs_before_the_fit(tmp_path):
    model, finder = Sized(), BatchSizeFinder(steps_per_trial=1, max_trials=3)
    trainer = make_trainer(tmp_path, "auto", 1, [finder], max_steps=-1, max_epochs=1)
    trainer.fit(model)
    assert model.batch_size == finder.optimal_batch_size == 8
    assert trainer.global_step == 64 // 8  # one epoch at the size found, from step 0
