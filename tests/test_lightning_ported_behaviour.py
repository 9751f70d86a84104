"""More behaviour Lightning's own tests (../shared/lightning-tests) check, built here: the
RichProgressBar's stages and metrics, ...

.venv/bin/python -m pytest -q tests/test_lightning_ported_behaviour.py
"""

from __future__ import annotations

import io
import pickle
import warnings

import pytest
import torch

import lightspeed as ls
from lightspeed.callbacks.progress.rich_progress import DefaultProgressBar, RichProgressBarTheme
from lightspeed.demos.boring_classes import BoringModel
from lightspeed.errors import ConfigError
from test_trainer import Regress, make_trainer, regression_data


# ------------------------------------------------------------------ RichProgressBar
class ShowsLoss(Regress):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("shown", loss, prog_bar=True)
        return loss


def test_rich_progress_bar_draws_a_task_per_stage_and_the_metrics_beside_training(tmp_path):
    bar = ls.RichProgressBar(
        theme=RichProgressBarTheme(metrics_format=".2e"), console_kwargs={"file": io.StringIO()}
    )
    trainer = make_trainer(
        tmp_path,
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=2,
        num_sanity_val_steps=1,
        enable_progress_bar=True,
        callbacks=[bar],
    )
    trainer.fit(ShowsLoss(), regression_data(), regression_data())
    assert trainer.progress_bar_callback is bar and bar._progress_stopped
    sanity, train, val = bar.progress.tasks  # the previous validation's task was replaced
    assert (sanity.completed, sanity.total, sanity.visible) == (1, 1, False)
    assert (train.completed, train.total, train.description) == (3, 3, "Epoch 1/1 ")
    assert (val.completed, val.total, val.visible) == (2, 2, False)  # hidden after validation
    assert train.id == bar.train_progress_bar_id and val.id == bar.val_progress_bar_id

    shown = str(bar.progress.columns[-1]._renderable_cache[train.id][1])
    assert shown == f"shown: {trainer.progress_bar_metrics['shown']:.2e}"
    assert str(bar.progress.columns[-1].render(val)) == ""  # beside the training bar only
    assert "Epoch 1/1" in bar.progress.console.file.getvalue()
    pickle.dumps(bar)  # the rich objects stay behind

    trainer.validate(Regress(), regression_data())  # a new Progress for the new stage
    (task,) = bar.progress.tasks
    assert (task.completed, task.total, task.visible) == (2, 2, True)


def test_rich_progress_bar_subclass_columns_and_descriptions():
    from rich.progress import TextColumn

    column = TextColumn("mine")

    class Mine(ls.RichProgressBar):
        def configure_columns(self, trainer):
            return [column]

    bar = Mine(console_kwargs={"file": io.StringIO()})
    bar._init_progress(trainer=None)
    assert bar.progress.columns[0] is column and len(bar.progress.columns) == 2  # + metrics
    bar.teardown(None, None, "fit")

    class Trainer:
        max_epochs = 12

    bar._trainer = Trainer()
    assert bar._get_train_description(3) == "Epoch 3/11"
    assert len(bar._get_train_description(0)) == len(bar.validation_description)


def test_the_default_bar_leaves_drawing_to_lightspeeds_own(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, enable_progress_bar=True)
    trainer.fit(Regress(), regression_data())
    bar = trainer.progress_bar_callback
    assert isinstance(bar, DefaultProgressBar) and isinstance(bar, ls.RichProgressBar)
    assert bar.progress is None and bar.train_progress_bar_id is None


def test_methods_of_lightspeeds_callbacks_are_known_hooks_to_a_subclass(tmp_path):
    from rich.progress import TextColumn

    class Mine(ls.RichProgressBar):
        def configure_columns(self, trainer):  # RichProgressBar calls it: no warning
            return [TextColumn("mine")]

        def on_train_epoch_strat(self, trainer, module):  # a typo: said
            pass

    trainer = make_trainer(tmp_path, max_steps=1, enable_progress_bar=True, callbacks=[Mine()])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Regress(), regression_data())
    said = [str(w.message) for w in caught if "is not a hook" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("Mine.on_train_epoch_strat")


# ------------------------------------------------------------------ optimizers
def test_lightning_optimizer_is_an_instance_of_the_optimizer_it_wraps():
    from lightspeed.core.optimizer import LightningOptimizer

    adam = torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    wrapped = LightningOptimizer(adam)
    assert isinstance(wrapped, (LightningOptimizer, torch.optim.Adam, torch.optim.Optimizer))
    assert not isinstance(wrapped, torch.optim.SGD) and type(wrapped) is LightningOptimizer
    again = pickle.loads(pickle.dumps(wrapped))
    assert type(again) is LightningOptimizer and again.state_dict() == adam.state_dict()


def test_the_same_optimizer_and_scheduler_objects_fit_twice(tmp_path):
    class SameObjects(Regress):
        def __init__(self):
            super().__init__()
            self.opt = torch.optim.SGD(self.parameters(), lr=1.0)
            self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=1, gamma=0.5)

        def configure_optimizers(self):
            return {
                "optimizer": self.opt,
                "lr_scheduler": {"scheduler": self.sched, "interval": "step"},
            }

    model = SameObjects()
    for fit in range(2):
        trainer = make_trainer(tmp_path, max_steps=2, optimizer_kernels="fused")
        trainer.fit(model, regression_data())
        stepped = trainer.strategy.optimizers[0]
        assert model.sched.optimizer is stepped  # the scheduler drives this fit's optimizer
        assert model.sched.last_epoch == 2 * (fit + 1)
        assert stepped.param_groups[0]["lr"] == 0.5 ** (2 * (fit + 1))


# ------------------------------------------------------------------ logging
def test_info_lines_reach_a_handler_as_lightnings_do(tmp_path, caplog):
    # lightspeed's logger is at INFO (Lightning's level): a handler set up (caplog's) gets its info
    make_trainer(tmp_path, max_time={"seconds": 5}, callbacks=[ls.Timer()])
    assert "callbacks list already contains a Timer" in caplog.text


def test_log_refuses_a_key_that_names_the_dataloader_idx(tmp_path):
    class Suffixed(Regress):
        def training_step(self, batch, batch_idx):
            self.log("foo/dataloader_idx_0", 1.0)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ls.ConfigError, match="`self.log` with the key `foo/dataloader_idx_0`"):
        make_trainer(tmp_path, max_steps=1).fit(Suffixed(), regression_data())

    class Unsuffixed(Regress):  # the loop adds no suffix: the name is the user's to choose
        def training_step(self, batch, batch_idx):
            self.log("foo/dataloader_idx_0", 1.0, add_dataloader_idx=False)
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.fit(Unsuffixed(), regression_data())
    assert "foo/dataloader_idx_0" in trainer.callback_metrics


def test_a_metric_logged_must_be_held_by_the_module(tmp_path):
    """A torchmetrics Metric made anew in the step is refused, naming the fix; one held as an
    attribute (or named with metric_attribute=) logs its value."""
    torchmetrics = pytest.importorskip("torchmetrics")

    class Fresh(BoringModel):
        def training_step(self, batch, batch_idx):
            self.log("acc", torchmetrics.MeanMetric())
            return super().training_step(batch, batch_idx)

    class Held(BoringModel):
        def __init__(self):
            super().__init__()
            self.mean = torchmetrics.MeanMetric()

        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.mean(out["loss"].detach())
            self.log("mean_loss", self.mean)
            return out

    kw = dict(default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False)
    with pytest.raises(ConfigError, match="setting an attribute for the metric"):
        ls.Trainer(**kw).fit(Fresh())

    class FreshBesideHeld(Held):
        def training_step(self, batch, batch_idx):
            self.log("acc", torchmetrics.MeanMetric())
            return super().training_step(batch, batch_idx)

    with pytest.raises(
        ConfigError, match=r"metric_attribute=name\)` where `name` is one of \['mean'\]"
    ):
        ls.Trainer(**kw).fit(FreshBesideHeld())
    trainer = ls.Trainer(**kw)
    trainer.fit(Held())
    assert "mean_loss" in trainer.callback_metrics


def test_lambda_callback_runs_its_functions_at_their_hooks(tmp_path):
    seen: list[tuple] = []
    probe = ls.callbacks.LambdaCallback(
        on_train_epoch_end=lambda trainer, module: seen.append(("epoch", trainer.current_epoch)),
        on_train_batch_end=lambda trainer, module, out, batch, i: seen.append(("batch", i)),
        setup=lambda trainer, module, stage: seen.append(("setup", stage)),
    )
    kw = dict(default_root_dir=tmp_path, max_epochs=2, limit_train_batches=2, logger=False)
    ls.Trainer(callbacks=[probe], enable_progress_bar=False, **kw).fit(BoringModel())
    assert seen == [("setup", "fit"), ("batch", 0), ("batch", 1), ("epoch", 0)] + [
        ("batch", 0),
        ("batch", 1),
        ("epoch", 1),
    ]
    with pytest.raises(TypeError, match="'on_epoch_finish', which is not a hook"):
        ls.callbacks.LambdaCallback(on_epoch_finish=print)


def test_device_stats_monitor_logs_the_hosts_statistics_on_cpu(tmp_path):
    import csv

    from lightspeed.loggers import CSVLogger

    logger = CSVLogger(tmp_path)
    trainer = ls.Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        log_every_n_steps=1,
        limit_val_batches=0,
        logger=logger,
        enable_progress_bar=False,
        callbacks=[ls.callbacks.DeviceStatsMonitor()],
    )
    trainer.fit(BoringModel())
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    key = "DeviceStatsMonitor.on_train_batch_end/cpu_percent"
    assert key in rows[0] and sum(bool(r[key]) for r in rows) == 2
    with pytest.raises(ConfigError, match="logger=False"):
        ls.Trainer(
            default_root_dir=tmp_path,
            logger=False,
            max_steps=1,
            limit_val_batches=0,
            callbacks=[ls.callbacks.DeviceStatsMonitor()],
        ).fit(BoringModel())


def test_trainer_evaluating_device_ids_and_barebones(tmp_path):
    seen: dict[str, bool] = {}
    probe = ls.callbacks.LambdaCallback(
        on_train_batch_start=lambda trainer, *a: seen.setdefault("train", trainer.evaluating),
        on_validation_batch_start=lambda trainer, *a: seen.setdefault("val", trainer.evaluating),
        on_test_batch_start=lambda trainer, *a: seen.setdefault("test", trainer.evaluating),
    )
    trainer = ls.Trainer(
        default_root_dir=tmp_path,
        max_steps=2,
        limit_val_batches=1,
        logger=False,
        enable_progress_bar=False,
        callbacks=[probe],
    )
    trainer.fit(BoringModel())
    trainer.test(BoringModel(), verbose=False)
    assert seen == {"val": True, "train": False, "test": True}
    assert trainer.device_ids == [0] and trainer.barebones is False


def test_trainer_logger_setter_as_lightnings(tmp_path):
    from lightspeed.loggers import CSVLogger

    trainer = ls.Trainer(default_root_dir=tmp_path, logger=False)
    csv_logger = CSVLogger(tmp_path)
    trainer.logger = csv_logger
    assert trainer.logger is csv_logger and trainer.loggers == [csv_logger]
    trainer.logger = None
    assert trainer.logger is None and trainer.loggers == []


def test_weights_only_keyword_of_lightning_2_6(tmp_path):
    # Lightning 2.6's keyword: None/False load as always; True (torch's weights-only unpickling,
    # which cannot read the loop's records) is refused before anything runs, not ignored.
    kw = dict(default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False)
    trainer = ls.Trainer(**kw)
    trainer.fit(BoringModel(), weights_only=False)
    assert trainer.global_step == 1
    for call in (trainer.fit, trainer.validate, trainer.test, trainer.predict):
        with pytest.raises(ConfigError, match="weights_only=True is not valid"):
            call(BoringModel(), weights_only=True)
