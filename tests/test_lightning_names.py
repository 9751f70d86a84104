"""Lightning's Trainer names and arguments that ported code reaches for: run state, loaders and
batch counts, min_epochs / min_steps, max_time (Timer), detect_anomaly, benchmark,
use_distributed_sampler, and the Lightning arguments lightspeed does not take. One process each; the
names on 2 ranks are in test_lightning_ranks.py.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_lightning_names.py
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

import lightspeed as ls
from helpers import ROOT, launch
from lightspeed.callbacks import Timer
from test_trainer import Regress, make_trainer, regression_data


class Reads(ls.Callback):
    """Records Lightning's names where ported callbacks read them."""

    def __init__(self):
        self.seen: dict = {}
        self.last_batch: list[bool] = []

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking:
            self.seen["sanity_stage"] = trainer.state.stage

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.last_batch.append(trainer.is_last_batch)
        self.seen.update(
            state=trainer.state,
            module=trainer.lightning_module,
            model=trainer.model,
            train_batches=trainer.num_training_batches,
            val_batches=trainer.num_val_batches,
            sanity_batches=trainer.num_sanity_val_batches,
            train_loader=trainer.train_dataloader,
            val_loaders=trainer.val_dataloaders,
            log_dir=trainer.log_dir,
        )


ACCELERATORS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_trainer_names_follow_fit_and_test_as_lightnings_do(tmp_path, accelerator):
    model, reads = Regress(), Reads()
    early = ls.EarlyStopping("val_loss", patience=100)
    trainer = make_trainer(
        tmp_path,
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=2,
        callbacks=[reads, early],
        enable_checkpointing=True,
        logger=ls.CSVLogger(tmp_path / "logs"),
        num_sanity_val_steps=1,
        accelerator=accelerator,
    )
    assert (trainer.state.fn, trainer.state.status, trainer.lightning_module) == (
        None,
        "initializing",
        None,
    )
    assert trainer.num_training_batches == float("inf") and trainer.num_val_batches == []
    train, val = regression_data(), regression_data(n=8)
    trainer.fit(model, train, val)
    seen = reads.seen
    assert (seen["state"].fn, seen["state"].stage, seen["state"].status) == (
        "fit",
        "train",
        "running",
    )
    assert seen["sanity_stage"] == "sanity_check"
    assert seen["module"] is model and seen["model"] is model  # one device: no wrapper
    assert (seen["train_batches"], seen["val_batches"], seen["sanity_batches"]) == (3, [2], [1])
    assert (
        seen["train_loader"] is train and seen["val_loaders"] is val
    )  # one loader: the loader, not a list
    assert (
        reads.last_batch == [False, False, True] * 2
    )  # the epoch's last batch, after limit_train_batches
    assert (
        seen["log_dir"]
        == str(tmp_path / "logs" / "lightning_logs" / "version_0")
        == trainer.log_dir
    )
    assert (
        trainer.checkpoint_callbacks == [trainer.checkpoint_callback]
        and trainer.checkpoint_callback is not None
    )
    assert trainer.early_stopping_callbacks == [early] and trainer.early_stopping_callback is early
    assert (trainer.state.status, trainer.interrupted, trainer.node_rank, trainer.ckpt_path) == (
        "finished",
        False,
        0,
        None,
    )

    tests = [regression_data(n=8), regression_data(n=12)]
    trainer.test(model, tests, ckpt_path="last", verbose=False)
    assert (
        trainer.state.fn == "test"
        and trainer.test_dataloaders == tests
        and trainer.num_test_batches == [2, 3]
    )
    assert trainer.ckpt_path == str(trainer.checkpoint_dir / "last.ckpt")  # as Lightning says it
    assert make_trainer(tmp_path, logger=False).log_dir == str(
        tmp_path
    )  # no logger: default_root_dir


def test_an_exception_leaves_the_trainer_interrupted(tmp_path):
    class Fails(Regress):
        def training_step(self, batch, batch_idx):
            raise ValueError("boom")

    trainer = make_trainer(tmp_path, max_steps=1)
    with pytest.raises(ValueError, match="boom"):
        trainer.fit(Fails(), regression_data())
    assert (
        trainer.interrupted and trainer.state.status == "interrupted" and trainer.state.fn == "fit"
    )


class AsksToStop(ls.Callback):
    """Requests a stop after every step, as EarlyStopping would."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        trainer.should_stop = True


@pytest.mark.parametrize(
    "limits, step, epoch",
    [
        (dict(), 1, 0),  # no minimum: the first request stops fit
        (dict(min_epochs=2), 6, 2),  # the request waits for two whole epochs of 3 batches
        (dict(min_steps=4), 4, 1),  # ... or for the fourth step, mid-epoch
        (dict(min_epochs=3, max_epochs=2), None, None),  # refused: max_epochs would end fit first
    ],
)
def test_min_epochs_and_min_steps_hold_a_requested_stop(tmp_path, capsys, limits, step, epoch):
    if step is None:
        with pytest.raises(ls.ConfigError, match="min_epochs=3 is not valid with max_epochs=2"):
            make_trainer(tmp_path, **limits)
        return
    trainer = make_trainer(
        tmp_path, max_epochs=5, limit_train_batches=3, callbacks=[AsksToStop()], **limits
    )
    trainer.fit(Regress(), regression_data())
    assert (trainer.global_step, trainer.current_epoch, trainer.should_stop) == (step, epoch, True)
    said = capsys.readouterr().out.count("are not reached yet: training continues")
    assert said == (1 if limits else 0)  # said once, not at every step
    assert (trainer.min_epochs, trainer.min_steps) == (
        limits.get("min_epochs"),
        limits.get("min_steps"),
    )


class Slow(Regress):
    def training_step(self, batch, batch_idx):
        time.sleep(0.05)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_max_time_stops_fit_and_its_time_travels_in_the_checkpoint(tmp_path, capsys, accelerator):
    trainer = make_trainer(
        tmp_path, max_time={"seconds": 0.4}, enable_checkpointing=True, accelerator=accelerator
    )
    assert trainer.max_epochs is None and trainer.estimated_stepping_batches == float(
        "inf"
    )  # time is the limit (max_epochs: None until fit resolves it to -1, as Lightning's)
    trainer.fit(
        Slow(), regression_data(n=4000)
    )  # 1000 steps an epoch: only the time limit can stop it
    timer = next(c for c in trainer.callbacks if isinstance(c, Timer))
    # ≈ 0.4 s / 0.05 s, with room for a slow host; on a GPU the first steps also pay CUDA's start-up
    assert (4 if accelerator == "cpu" else 1) <= trainer.global_step < 40, trainer.global_step
    assert (
        timer.time_elapsed() >= 0.4 and timer.time_remaining() <= 0 and timer.end_time() is not None
    )
    assert "the time limit 0:00:00.400000 was reached" in capsys.readouterr().out

    # The elapsed time is in the checkpoint: a resumed run counts it, so with the same limit it
    # stops at once.
    again = make_trainer(
        tmp_path,
        max_time=timedelta(seconds=0.4),
        enable_checkpointing=True,
        accelerator=accelerator,
    )
    again.fit(Slow(), regression_data(n=4000), ckpt_path="last")
    assert again.global_step == trainer.global_step  # checked at fit start too, as Lightning


def test_timer_callback_by_epoch_and_with_min_epochs(tmp_path):
    timer = Timer(duration="00:00:00:01", interval="epoch")
    assert (
        timer.time_elapsed() == 0.0 and timer.start_time() is None and timer.time_remaining() == 1.0
    )
    trainer = make_trainer(
        tmp_path, max_epochs=50, limit_train_batches=30, min_epochs=2, callbacks=[timer]
    )
    trainer.fit(
        Slow(), regression_data(n=120)
    )  # 30 × 0.05 s = 1.5 s an epoch: past the limit after the first
    assert (
        trainer.current_epoch == 2 and trainer.global_step == 60
    )  # held for min_epochs, then stopped
    with pytest.raises(ls.ConfigError, match="interval='batch' is not valid"):
        Timer(duration="00:00:00:01", interval="batch")
    assert timer.time_elapsed("validate") == 0.0  # the stages Lightning's Timer measures
    with pytest.raises(ls.ConfigError, match="stage='sanity' is not valid"):
        timer.time_elapsed("sanity")


def test_detect_anomaly_names_the_backward_that_made_the_nan(tmp_path):
    class NanGrad(Regress):
        def training_step(self, batch, batch_idx):
            x, y = batch
            # d sqrt(0) = inf, times the 0: NaN, first seen in MulBackward0's output
            return ((self.layer(x) - y) ** 2).mean() + torch.sqrt(self.layer.weight.sum() * 0)

    with pytest.raises(RuntimeError, match="Function 'MulBackward0' returned nan values"):
        make_trainer(tmp_path, max_steps=1, detect_anomaly=True).fit(NanGrad(), regression_data())
    assert not torch.is_anomaly_enabled()  # restored after the run, even after an exception
    with pytest.raises(
        ls.NonFiniteError
    ):  # without it, the non-finite guard stops the run before the step
        make_trainer(tmp_path, max_steps=1).fit(NanGrad(), regression_data())


def test_benchmark_and_use_distributed_sampler(tmp_path):
    before = torch.backends.cudnn.benchmark
    try:
        trainer = make_trainer(tmp_path, max_steps=2, benchmark=True, use_distributed_sampler=False)
        shuffled = regression_data(shuffle=True)
        trainer.fit(Regress(), shuffled)
        assert torch.backends.cudnn.benchmark is True
        assert trainer.train_dataloader is shuffled and isinstance(
            trainer.train_dataloader.sampler, RandomSampler
        )
    finally:
        torch.backends.cudnn.benchmark = before
    default = make_trainer(tmp_path, max_steps=2)
    default.fit(
        Regress(), regression_data(shuffle=True)
    )  # the default: a seeded DistributedSampler (exact resume)
    assert type(default.train_dataloader.sampler).__name__ == "DistributedSampler"


def test_lightning_arguments_lightspeed_does_not_take_pass_at_their_defaults(tmp_path):
    trainer = make_trainer(
        tmp_path,
        profiler=None,
        plugins=None,
        barebones=False,
        model_registry=None,
        inference_mode=False,
        max_epochs=-1,
        max_steps=3,
    )
    trainer.fit(
        Regress(), DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=4)
    )
    assert (
        trainer.global_step == 3 and trainer.max_epochs == -1
    )  # -1: no epoch limit, as in Lightning
    with pytest.raises(ls.ConfigError, match="plugins contains 'bf16'.*precision plugin"):
        make_trainer(tmp_path, plugins=["bf16"])  # the plugins themselves: tests/test_plugins.py
    # names that ported imports and annotations reach for
    from lightspeed.utilities.types import EVAL_DATALOADERS, STEP_OUTPUT, OptimizerLRScheduler

    assert None not in (EVAL_DATALOADERS, STEP_OUTPUT, OptimizerLRScheduler)
    assert (
        ls.MLFlowLogger is ls.MLflowLogger and ls.TQDMProgressBar and ls.ModelSummary and ls.Timer
    )


class Curriculum(Regress):
    """Lightning's curriculum pattern: the training set grows with the epoch that asks for it."""

    def __init__(self):
        super().__init__()
        self.asked: list[int] = []

    def train_dataloader(self):
        epoch = self.trainer.current_epoch
        self.asked.append(epoch)
        return regression_data(n=8 * (1 + epoch // 2))  # 2 batches of 4, then 4 from epoch 2

    def val_dataloader(self):
        return regression_data(n=4)


@pytest.mark.parametrize("every, asked, steps", [(0, [0], 8), (2, [0, 2], 12)])
def test_reload_dataloaders_every_n_epochs_asks_the_module_again(tmp_path, every, asked, steps):
    model = Curriculum()
    trainer = make_trainer(tmp_path, max_epochs=4, reload_dataloaders_every_n_epochs=every)
    trainer.fit(model)
    assert (
        model.asked == asked and trainer.global_step == steps
    )  # [2, 2, 4, 4] batches with reloads, else 2 × 4
    assert trainer.num_training_batches == (4 if every else 2)
    with pytest.raises(ls.ConfigError, match="reload_dataloaders_every_n_epochs=-1"):
        make_trainer(tmp_path, reload_dataloaders_every_n_epochs=-1)


class Hooks(ls.Callback):
    """Records the run-level hooks Lightning calls on callbacks, with whether the module was
    training."""

    def __init__(self, calls: list):
        self.calls = calls

    def __getattribute__(self, name):
        if name.startswith("on_") and name.endswith(("_start", "_end")) and "batch" not in name:
            calls = object.__getattribute__(self, "calls")
            return lambda trainer, module, *a: calls.append(
                f"cb.{name}" + ("" if module.training else "(eval)")
            )
        return object.__getattribute__(self, name)


class Recorded(Regress):
    def __init__(self, calls: list):
        super().__init__()
        self.hooks = calls

    def on_validation_start(self):
        self.hooks.append("on_validation_start")

    def on_validation_end(self):
        self.hooks.append("on_validation_end")

    def on_test_start(self):
        self.hooks.append("on_test_start")

    def on_test_end(self):
        self.hooks.append("on_test_end")

    def on_predict_start(self):
        self.hooks.append("on_predict_start")

    def on_predict_epoch_start(self):
        self.hooks.append("on_predict_epoch_start")

    def on_predict_epoch_end(self):
        self.hooks.append("on_predict_epoch_end")

    def on_predict_end(self):
        self.hooks.append("on_predict_end")


def test_evaluation_and_sanity_hooks_run_in_lightnings_order(tmp_path):
    calls: list[str] = []
    model, cb = Recorded(calls), Hooks(calls)
    trainer = make_trainer(
        tmp_path, max_epochs=1, limit_train_batches=2, limit_val_batches=1, callbacks=[cb]
    )
    trainer.fit(model, regression_data(), regression_data(n=4))
    run = [c for c in calls if "train" not in c and "fit" not in c]
    # the sanity check runs validation's hooks (as Lightning's), then the epoch's validation:
    # start, epoch start, epoch end, end, in eval
    validation = [
        "on_validation_start",
        "cb.on_validation_start(eval)",
        "cb.on_validation_epoch_start(eval)",
        "cb.on_validation_epoch_end(eval)",
        "on_validation_end",
        "cb.on_validation_end(eval)",
    ]
    assert run == [
        "cb.on_sanity_check_start",
        *validation,
        "cb.on_sanity_check_end",
        "on_validation_start",
        "cb.on_validation_start(eval)",
        "cb.on_validation_epoch_start(eval)",
        "cb.on_validation_epoch_end(eval)",
        "on_validation_end",
        "cb.on_validation_end(eval)",
    ]
    assert (
        calls[-1] == "cb.on_fit_end" and model.training
    )  # on_validation_model_train: training again

    calls.clear()
    trainer.test(model, regression_data(n=4), verbose=False)
    assert (
        calls
        == [
            "on_test_start",
            "cb.on_test_start(eval)",
            "cb.on_test_epoch_start(eval)",
            "cb.on_test_epoch_end(eval)",
            "on_test_end",
            "cb.on_test_end(eval)",
        ]
        and model.training
    )
    calls.clear()
    trainer.predict(model, regression_data(n=4))
    assert (
        calls
        == [
            "on_predict_start",
            "cb.on_predict_start(eval)",
            "on_predict_epoch_start",
            "cb.on_predict_epoch_start(eval)",
            "on_predict_epoch_end",
            "cb.on_predict_epoch_end(eval)",
            "on_predict_end",
            "cb.on_predict_end(eval)",
        ]
        and not model.training
    )  # as Lightning leaves it


class MCDropout(Regress):
    """Keeps dropout on in validation by overriding the mode hook, a Lightning idiom (Monte Carlo
    dropout)."""

    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.val_modes: list[bool] = []

    def validation_step(self, batch, batch_idx):
        self.val_modes.append(self.drop.training)
        return super().validation_step(batch, batch_idx)

    def on_validation_model_eval(self):
        self.eval()
        self.drop.train()


def test_a_module_keeps_dropout_on_in_validation_through_its_mode_hook(tmp_path):
    model = MCDropout()
    make_trainer(tmp_path, max_epochs=1, limit_train_batches=2, num_sanity_val_steps=0).fit(
        model, regression_data(), regression_data(n=8)
    )
    assert model.val_modes == [True, True] and model.layer.training  # back in train mode after


class Brings(Regress):
    def __init__(self, patience: int):
        super().__init__()
        self.patience = patience

    def configure_callbacks(self):
        return [
            ls.EarlyStopping("val_loss", patience=self.patience),
            ls.ModelCheckpoint(monitor="val_loss"),
        ]


class SeesLoad(ls.Callback):
    def __init__(self):
        self.loaded: list = []

    def on_load_checkpoint(self, trainer, module, checkpoint):
        self.loaded.append(
            checkpoint["global_step"] if "global_step" in checkpoint else sorted(checkpoint)
        )


def test_configure_callbacks_replaces_the_trainers_and_callbacks_see_the_checkpoint_load(
    tmp_path, capsys
):
    mine, sees = ls.EarlyStopping("val_loss", patience=99), SeesLoad()
    trainer = make_trainer(
        tmp_path,
        max_epochs=2,
        limit_train_batches=2,
        callbacks=[mine, sees],
        enable_checkpointing=True,
    )
    model = Brings(patience=7)
    trainer.fit(model, regression_data(), regression_data(n=8))
    assert (
        "Brings.configure_callbacks replaces the Trainer's EarlyStopping" in capsys.readouterr().out
    )
    best = trainer.checkpoint_callback.best_model_path
    # "best" is resolved before test's configure_callbacks brings a fresh ModelCheckpoint, as in
    # Lightning
    trainer.test(model, regression_data(n=8), ckpt_path="best", verbose=False)
    assert best and trainer.ckpt_path == str(Path(best).resolve())
    assert (
        trainer.callbacks is trainer._run.process.checkpointer.callbacks
    )  # replaced in place: the Checkpointer sees them
    assert mine not in trainer.callbacks and trainer.early_stopping_callback.patience == 7
    assert (
        isinstance(trainer.callbacks[-1], ls.ModelCheckpoint)
        and len(trainer.checkpoint_callbacks) == 1
    )
    assert (
        trainer.checkpoint_callback.monitor == "val_loss"
    )  # the Module's, not the Trainer's default one
    assert sees.loaded == []
    again = make_trainer(
        tmp_path, max_epochs=3, limit_train_batches=2, callbacks=[sees], enable_checkpointing=True
    )
    again.fit(Brings(patience=7), regression_data(), regression_data(n=8), ckpt_path="last")
    assert (
        len(sees.loaded) == 1 and again.global_step == 6
    )  # resumed at step 4, one more epoch of 2


class ReadsItsTrainer(Regress):
    """Reads Lightning's Module names inside its own step, as ported code does."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.seen: dict = {}

    def training_step(self, batch, batch_idx):
        self.logger.experiment.add_scalar(
            "by_hand", 1.5, self.global_step
        )  # TensorBoard's SummaryWriter
        self.seen.update(
            logger=type(self.logger).__name__,
            loggers=[type(lg).__name__ for lg in self.loggers],
            local_rank=self.local_rank,
            on_gpu=self.on_gpu,
            gathered=self.all_gather({"n": 3})["n"],
        )
        return super().training_step(batch, batch_idx)


def test_module_reads_lightnings_names_and_writes_through_the_loggers_experiment(tmp_path):
    model = ReadsItsTrainer(width=4)
    assert (
        model.current_epoch,
        model.global_step,
        model.logger,
        model.loggers,
        model.local_rank,
    ) == (0, 0, None, [], 0)
    model.hparams.width = 8  # hparams may change; hparams_initial keeps what __init__ saved
    assert model.hparams_initial == {"width": 4} and model.hparams.width == 8
    assert model.example_input_array is None
    model.example_input_array = torch.zeros(2, 4)
    assert model.example_input_array.shape == (2, 4)

    trainer = make_trainer(tmp_path, max_steps=2, logger=True)
    trainer.fit(model, regression_data())
    # Lightning's default logger is TensorBoard's, alone in trainer.loggers; the run report's
    # metrics.csv (a RunRecord, same version) is written beside it, out of the user's view
    assert model.seen == dict(
        logger="TensorBoardLogger",
        loggers=["TensorBoardLogger"],
        local_rank=0,
        on_gpu=False,
        gathered=torch.tensor(3),
    )  # one process: the value itself, a tensor
    events = list((tmp_path / "lightning_logs" / "version_0").glob("events.out.tfevents.*"))
    assert (
        events
        and trainer.logger.save_dir == str(tmp_path)
        and trainer.logger.name == "lightning_logs"
    )
    assert (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").exists()  # the RunRecord's
    assert trainer.run_csv is not None and trainer.run_csv.version == trainer.logger.version

    model.freeze()
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    model.unfreeze()
    assert all(p.requires_grad for p in model.parameters()) and model.training


def test_experiment_is_a_no_op_off_rank_zero(tmp_path):
    from lightspeed.utilities import rank_zero_only

    logger = ls.TensorBoardLogger(tmp_path)
    rank_zero_only.rank = 1
    try:
        logger.experiment.add_image(
            "x", torch.zeros(3, 2, 2), 0
        )  # as a step run by every rank does
        logger.experiment["key"].log({"x": 1})
    finally:
        rank_zero_only._rank = None  # back to the launch's rank
    assert not (tmp_path / "lightning_logs").exists()  # nothing was written
    assert type(logger.experiment).__name__ == "SummaryWriter"


class Nested(Regress):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Sequential(
            torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
        )


def test_progress_bar_and_model_summary_callbacks(tmp_path, capsys):
    with pytest.raises(
        ls.ConfigError, match="enable_progress_bar=False is not valid with TQDMProgressBar"
    ):
        make_trainer(
            tmp_path, callbacks=[ls.TQDMProgressBar(refresh_rate=10)]
        )  # make_trainer turns the bar off
    with pytest.raises(ls.ConfigError, match="refresh_rate=-1 is not valid"):
        ls.RichProgressBar(refresh_rate=-1)

    def fit(*callbacks, **kw):
        trainer = make_trainer(
            tmp_path, max_steps=2, enable_progress_bar=True, callbacks=list(callbacks), **kw
        )
        trainer.fit(Nested(), regression_data())
        return trainer, capsys.readouterr().out

    bar = ls.TQDMProgressBar(refresh_rate=20)
    trainer, out = fit(bar, ls.ModelSummary(max_depth=2), enable_model_summary=False)
    assert trainer.progress_bar_callback is bar and "Epoch 0:" in out  # tqdm draws it
    assert (
        "layer.0" in out
        and "layer.2" in out
        and "49        Total params" in out  # Lightning's summary table
    )
    trainer, out = fit(ls.RichProgressBar(refresh_rate=0), ls.RichModelSummary(max_depth=0))
    assert (
        "step 2/2" not in out and "Total params" not in out
    )  # refresh_rate=0 and max_depth=0: neither
    trainer, out = fit()
    assert (
        isinstance(trainer.progress_bar_callback, ls.RichProgressBar)
        and "step 2/2" in out
        and "layer.0" not in out
    )  # the defaults: lightspeed's own bar, as a callback


@pytest.mark.parametrize("devices", [1, 2])
def test_torchmetrics_objects_logged_give_the_epochs_value_over_every_rank(tmp_path, devices):
    if devices == 1:  # in this process: no interpreter to start
        import torchmetrics_script

        torchmetrics_script.main(tmp_path, 1)
    else:
        run = launch(
            [str(ROOT / "tests" / "torchmetrics_script.py"), str(tmp_path), str(devices)],
            tmp_path,
            "python",
        )
        assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(devices)]
    assert {"train_acc_step", "train_acc_epoch", "val_acc"} <= set(ranks[0]["logged"])
    for stage, key, samples in (("train", "train_acc_epoch", 64), ("val", "val_acc", 24)):
        right, total = (sum(r["seen"][stage][i] for r in ranks) for i in (0, 1))
        assert total == samples  # the last epoch's samples, each on one rank
        for r in (
            ranks
        ):  # torchmetrics gathered every rank's state: the value over all samples, on every rank
            assert r["logged"][key] == pytest.approx(right / total, abs=1e-6), (stage, r)


def test_a_metric_logged_per_step_without_its_forward_is_a_config_error(tmp_path):
    import torchmetrics

    class UpdateOnly(Regress):
        def __init__(self):
            super().__init__()
            self.mse = torchmetrics.MeanSquaredError()

        def training_step(self, batch, batch_idx):
            self.mse.update(self.layer(batch[0]), batch[1])
            self.log("mse", self.mse)  # per step in training: needs the forward's value
            return super().training_step(batch, batch_idx)

    with pytest.raises(
        ls.ConfigError, match=r"self.log\('mse', <MeanSquaredError>, on_step=True\) needs"
    ):
        make_trainer(tmp_path, max_steps=1).fit(UpdateOnly(), regression_data())


class EpochScheduler:
    """A scheduler in timm's style: not torch's, stepped with the epoch given."""

    def __init__(self, optimizer):
        self.optimizer, self.epochs = optimizer, []

    def step(self, epoch):
        self.epochs.append(epoch)
        for group in self.optimizer.param_groups:
            group["lr"] = 0.1 / (epoch + 2)

    def state_dict(self):
        return {"epochs": list(self.epochs)}

    def load_state_dict(self, state):
        self.epochs = list(state["epochs"])


class TimmStyle(Regress):
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        self.sched = EpochScheduler(opt)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": self.sched, "interval": "epoch"}}

    def lr_scheduler_step(self, scheduler, metric):
        scheduler.step(epoch=self.current_epoch)


class SkipsAt(Regress):
    def __init__(self, at: int):
        super().__init__()
        self.at = at

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == self.at else None


def test_lr_scheduler_step_and_skipping_the_rest_of_an_epoch(tmp_path):
    model = TimmStyle()
    trainer = make_trainer(tmp_path, max_epochs=3, limit_train_batches=2)
    trainer.fit(model, regression_data())
    assert (
        model.sched.epochs == [0, 1, 2] and trainer.optimizers[0].param_groups[0]["lr"] == 0.1 / 4
    )

    skipping = make_trainer(
        tmp_path, max_epochs=2
    )  # 8 batches an epoch; -1 at batch 2 ends each epoch there
    skipping.fit(SkipsAt(2), regression_data())
    assert (skipping.global_step, skipping.current_epoch) == (4, 2)
    for at, steps in (
        (2, 1),
        (3, 2),
    ):  # windows [0, 1], [2, 3], ...: -1 at a window's start skips it; inside
        accumulating = make_trainer(
            tmp_path, max_epochs=1, accumulate_grad_batches=2
        )  # one, the window completes
        accumulating.fit(SkipsAt(at), regression_data())
        assert accumulating.global_step == steps, at


def test_devices_in_lightnings_forms(tmp_path):
    assert make_trainer(tmp_path, devices="2").world_size == 2  # a count as a string
    if not torch.cuda.is_available():
        return
    n = torch.cuda.device_count()
    for given, count in ((-1, n), ("-1", n), ([0], 1), ("0,", 1), ("1", 1)):
        assert ls.Trainer(accelerator="gpu", devices=given, logger=False).num_devices == count, (
            given
        )
    with pytest.raises(
        ls.ConfigError, match="select these GPUs with CUDA_VISIBLE_DEVICES=1 and pass devices=1"
    ):
        ls.Trainer(accelerator="gpu", devices=[1], logger=False)


@pytest.mark.parametrize(
    "mode, batches",
    [
        ("max_size_cycle", [(0, 10), (1, 11), (2, 10)]),  # the shorter loader starts over
        ("min_size", [(0, 10), (1, 11)]),
        ("max_size", [(0, 10), (1, 11), (2, None)]),  # None for the loader that ran out
    ],
)
def test_combined_loader_modes(mode, batches):
    from lightspeed.utilities import CombinedLoader

    combined = CombinedLoader({"x": [0, 1, 2], "y": [10, 11]}, mode)
    assert len(combined) == len(batches)
    assert [(b["x"], b["y"]) for b in combined] == batches
    assert [
        tuple(b) for b in CombinedLoader([[0, 1, 2], [10, 11]], mode)
    ] == batches  # a list gives lists
    with pytest.raises(
        ls.ConfigError, match=r"CombinedLoader\(mode='sequential'\) is not valid for training"
    ):
        CombinedLoader([[0]], "sequential")


def test_two_training_loaders_as_a_dict_on_two_ranks(tmp_path):
    run = launch([str(ROOT / "tests" / "combined_script.py"), str(tmp_path)], tmp_path, "python")
    assert run.returncode == 0, run.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # 32 samples of "a" / 2 ranks / batch 4 = 4 steps an epoch; the second ends after 2, on rank 1's
    # -1, on both ranks
    assert r0["step"] == r1["step"] == 6
    a0, a1 = r0["seen"]["0/a"], r1["seen"]["0/a"]
    assert sorted(a0 + a1) == list(range(32))  # each rank its own half of "a"
    b0, b1 = r0["seen"]["0/b"], r1["seen"]["0/b"]
    assert (
        b0[:8] == b0[8:] and b1[:8] == b1[8:] and sorted(b0[:8] + b1[:8]) == list(range(16))
    )  # cycled
    assert (
        len(r0["seen"]["1/a"]) == len(r1["seen"]["1/a"]) == 8
    )  # two batches each in the second epoch
    assert (
        r0["seen"]["0/a"][:8] != r0["seen"]["1/a"]
    )  # "a" shuffles anew each epoch (its sampler's set_epoch)


def test_grad_norm_logged_before_the_optimizer_step(tmp_path):
    from lightspeed.utilities import grad_norm

    class LogsNorms(Regress):
        def on_before_optimizer_step(self, optimizer):
            self.norms = grad_norm(self.layer, norm_type=2)
            self.log_dict(self.norms)

    model = LogsNorms()
    make_trainer(tmp_path, max_steps=1).fit(model, regression_data())
    weight, bias = model.layer.weight, model.layer.bias
    assert set(model.norms) == {"grad_2.0_norm/weight", "grad_2.0_norm/bias", "grad_2.0_norm_total"}
    total = torch.stack(
        [model.norms["grad_2.0_norm/weight"], model.norms["grad_2.0_norm/bias"]]
    ).norm()
    assert (
        torch.allclose(model.norms["grad_2.0_norm_total"], total)
        and weight.grad is None
        and bias.grad is None
    )
    with pytest.raises(ValueError, match="norm_type=0"):
        grad_norm(model, 0)


class WithHparams(Regress):
    def __init__(self, width: int = 4):
        super().__init__()
        self.save_hyperparameters()


class Data(ls.LightningDataModule):
    def __init__(self, batch_size: int = 4, root: str = "/data"):
        super().__init__()
        self.save_hyperparameters(ignore="root")

    def train_dataloader(self):
        return regression_data(batch_size=self.hparams.batch_size)


def test_datamodule_save_hyperparameters_from_datasets_and_prepare_data_per_node(tmp_path):
    dm = Data(batch_size=8)
    assert dm.hparams == {"batch_size": 8} and dm.hparams_initial == {"batch_size": 8}
    model = WithHparams(width=3)
    logger = ls.CSVLogger(tmp_path)
    make_trainer(tmp_path, max_steps=2, logger=logger).fit(model, datamodule=dm)
    saved = (tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text()
    assert (
        "batch_size: 8" in saved and "width: 3" in saved
    )  # the DataModule's and the Module's, together

    x = torch.randn(12, 4)
    built = ls.LightningDataModule.from_datasets(
        TensorDataset(x, x[:, :1]), val_dataset=TensorDataset(x, x[:, :1]), batch_size=4
    )
    assert len(built.train_dataloader()) == 3 and isinstance(
        built.train_dataloader().sampler, RandomSampler
    )
    assert built.test_dataloader() is None and len(built.val_dataloader()) == 3
