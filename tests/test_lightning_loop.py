"""Lightning's loop surface, single process: Trainer flags, LightningDataModule, hyper-parameters
and load_from_checkpoint, self.log keywords, several evaluation loaders, hooks.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_lightning_loop.py
"""

from __future__ import annotations

import pytest
import torch
import yaml

import lightspeed as ls
from lightspeed.callbacks import Callback
from lightspeed.core.saving import checkpoint_state
from lightspeed.loggers.logger import DummyLogger
from test_trainer import Regress, make_trainer, regression_data


class Recorder(Callback):
    """Counts every hook call it receives."""

    def __init__(self):
        self.calls: dict[str, int] = {}

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def setup(self, trainer, module, stage):
        self._count(f"setup:{stage}")

    def teardown(self, trainer, module, stage):
        self._count(f"teardown:{stage}")

    def on_train_start(self, trainer, module):
        self._count("on_train_start")

    def on_train_end(self, trainer, module):
        self._count("on_train_end")

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self._count("on_train_batch_start")

    def on_before_backward(self, trainer, module, loss):
        self._count("on_before_backward")

    def on_after_backward(self, trainer, module):
        self._count("on_after_backward")

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self._count("on_before_optimizer_step")

    def on_before_zero_grad(self, trainer, module, optimizer):
        self._count("on_before_zero_grad")

    def on_validation_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self._count("on_validation_batch_start")

    def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self._count("on_validation_batch_end")

    def on_test_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self._count("on_test_batch_start")

    def on_test_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self._count("on_test_batch_end")

    def on_predict_batch_start(self, trainer, module, batch, batch_idx, dataloader_idx=0):
        self._count("on_predict_batch_start")

    def on_predict_batch_end(self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0):
        self._count("on_predict_batch_end")


class HookModel(Regress):
    def __init__(self):
        super().__init__()
        self.hooks: dict[str, int] = {}

    def _count(self, name):
        self.hooks[name] = self.hooks.get(name, 0) + 1

    def setup(self, stage):
        self._count(f"setup:{stage}")

    def on_train_start(self):
        self._count("on_train_start")

    def on_train_batch_start(self, batch, batch_idx):
        self._count("on_train_batch_start")

    def on_before_backward(self, loss):
        self._count("on_before_backward")

    def on_after_backward(self):
        self._count("on_after_backward")

    def on_before_optimizer_step(self, optimizer):
        self._count("on_before_optimizer_step")

    def on_before_zero_grad(self, optimizer):
        self._count("on_before_zero_grad")

    def on_validation_batch_end(self, outputs, batch, batch_idx, dataloader_idx=0):
        self._count("on_validation_batch_end")


@pytest.mark.parametrize("strategy", ["auto", "deepspeed_stage_2"])
def test_hooks_run_once_per_event(tmp_path, strategy):
    model, rec = HookModel(), Recorder()
    trainer = make_trainer(
        tmp_path,
        strategy=strategy,
        max_epochs=1,
        limit_train_batches=4,
        limit_val_batches=2,
        accumulate_grad_batches=2,
        num_sanity_val_steps=0,
        callbacks=[rec],
    )
    trainer.fit(model, regression_data(), regression_data())
    trainer.test(dataloaders=regression_data(8))
    trainer.predict(dataloaders=regression_data(8))
    assert rec.calls == {
        "setup:fit": 1,
        "teardown:fit": 1,
        "on_train_start": 1,
        "on_train_end": 1,
        "on_train_batch_start": 4,
        "on_before_backward": 4,
        "on_after_backward": 4,
        "on_before_optimizer_step": 2,
        "on_before_zero_grad": 2,
        "on_validation_batch_start": 2,
        "on_validation_batch_end": 2,
        "setup:test": 1,
        "teardown:test": 1,
        "on_test_batch_start": 2,
        "on_test_batch_end": 2,
        "setup:predict": 1,
        "teardown:predict": 1,
        "on_predict_batch_start": 2,
        "on_predict_batch_end": 2,
    }
    assert model.hooks == {
        "setup:fit": 1,
        "on_train_start": 1,
        "on_train_batch_start": 4,
        "on_before_backward": 4,
        "on_after_backward": 4,
        "on_before_optimizer_step": 2,
        "on_before_zero_grad": 2,
        "on_validation_batch_end": 2,
        "setup:test": 1,
        "setup:predict": 1,
    }


def test_unknown_hooks_are_warned_about(tmp_path):
    class Typo(Regress):
        def on_train_epoch_ends(self): ...
        def configure_gradient_clipping(self, *a): ...
        def backward(self, loss):
            loss.backward()  # Lightning's loop override: the strategy runs backward here

    class CbTypo(Callback):
        def on_validation_epoch_stop(self, trainer, module): ...

    with pytest.warns(UserWarning) as record:
        make_trainer(tmp_path, max_steps=1, callbacks=[CbTypo()]).fit(Typo(), regression_data())
    text = " ".join(str(r.message) for r in record)
    for name in (
        "Typo.on_train_epoch_ends",
        "Typo.configure_gradient_clipping",
        "Typo.backward",
        "CbTypo.on_validation_epoch_stop",
    ):
        assert name in text
    assert "Regress" not in text  # known hooks are not reported


def test_fast_dev_run(tmp_path):
    model = Regress()
    trainer = ls.Trainer(
        accelerator="cpu",
        devices=1,
        default_root_dir=str(tmp_path),
        enable_progress_bar=False,
        fast_dev_run=True,
        callbacks=[
            ls.ModelCheckpoint(dirpath=tmp_path / "ck"),
            rec := Recorder(),
            ls.EarlyStopping(monitor="nothing"),
            ls.LearningRateMonitor(),
        ],
    )
    trainer.fit(model, regression_data(), regression_data())
    assert model.calls.count("training_step") == 1 and model.calls.count("validation_step") == 1
    assert (
        trainer.global_step == 1
        and isinstance(trainer.logger, DummyLogger)  # Lightning's: a logger that logs nothing
        and isinstance(trainer.checkpoint_callback, ls.ModelCheckpoint)  # kept, as Lightning's
    )
    # EarlyStopping stays too and checks nothing: its monitor was never logged, no error
    assert rec.calls["on_train_batch_start"] == 1 and trainer.early_stopping_callback is not None
    assert not (tmp_path / "ck").exists() and not (tmp_path / "lightning_logs").exists()
    trainer = make_trainer(tmp_path, fast_dev_run=3, max_epochs=10)
    trainer.fit(model := Regress(), regression_data())
    assert trainer.global_step == 3 and trainer.current_epoch == 1
    assert len(trainer.predict(model, regression_data())) == 3


def test_overfit_batches_uses_the_same_unshuffled_batches(tmp_path):
    class Seen(Regress):
        def __init__(self):
            super().__init__()
            self.train_x, self.val_x = [], []

        def training_step(self, batch, batch_idx):
            self.train_x.append(batch[0].clone())
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            self.val_x.append(batch[0].clone())

    model = Seen()
    trainer = make_trainer(tmp_path, overfit_batches=2, max_epochs=2, num_sanity_val_steps=0)
    trainer.fit(model, regression_data(shuffle=True), regression_data(n=8))
    assert len(model.train_x) == 4 and len(model.val_x) == 4
    for a, b in zip(model.train_x, model.train_x[2:] + model.val_x):
        assert torch.equal(a, b)  # epoch 2 and validation see epoch 1's batches, in order
    assert torch.equal(model.train_x[0], regression_data().dataset.tensors[0][:4])


def test_num_sanity_val_steps_logs_nothing(tmp_path):
    for steps, expected in ((2, 2), (0, 0), (-1, 8)):
        model = Regress()
        trainer = make_trainer(
            tmp_path, max_steps=1, num_sanity_val_steps=steps, check_val_every_n_epoch=None
        )
        trainer.fit(model, regression_data(), regression_data())
        assert model.calls.count("validation_step") == expected
        assert "val_loss" not in trainer.callback_metrics and not trainer.sanity_checking
    with pytest.raises(ls.ConfigError, match="num_sanity_val_steps=-2 is not valid"):
        make_trainer(tmp_path, num_sanity_val_steps=-2)


def test_model_summary_counts(tmp_path, capsys):
    class Tied(ls.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight  # counted once
            self.frozen = torch.nn.Linear(4, 4).requires_grad_(False)
            self.scale = torch.nn.Parameter(torch.ones(1))

    from lightspeed.report.summary import summarize

    assert summarize(Tied()) == [
        ("emb", "Embedding", 40, 40),
        ("head", "Linear", 0, 0),
        ("frozen", "Linear", 0, 20),
        ("(own)", "Tied", 1, 1),
    ]
    trainer = make_trainer(tmp_path, max_steps=1)
    trainer.fit(Regress(), regression_data())
    out = capsys.readouterr().out  # the ModelSummary callback's table (Lightning's)
    assert "| Name  | Type   | Params | Mode" in out and "Total params" in out
    make_trainer(tmp_path, max_steps=1, enable_model_summary=False).fit(
        Regress(), regression_data()
    )
    assert "Total params" not in capsys.readouterr().out


@pytest.mark.parametrize("strategy", ["deepspeed_stage_3", "fsdp"])
def test_model_summary_counts_sharded_parameters(tmp_path, strategy):
    from lightspeed.report.summary import summarize

    model = Regress()
    trainer = make_trainer(tmp_path, strategy=strategy, max_steps=1)
    trainer.fit(model, regression_data())
    assert summarize(model) == [("layer", "Linear", 5, 5)]


class Data(ls.LightningDataModule):
    def __init__(self):
        self.calls: list[str] = []
        self.counter = 0

    def prepare_data(self):
        self.calls.append("prepare_data")

    def setup(self, stage):
        self.calls.append(f"setup:{stage}")

    def teardown(self, stage):
        self.calls.append(f"teardown:{stage}")

    def train_dataloader(self):
        return regression_data()

    def val_dataloader(self):
        return regression_data(8)

    def test_dataloader(self):
        return [regression_data(8), regression_data(4)]

    def state_dict(self):
        return {"counter": self.counter}

    def load_state_dict(self, state):
        self.counter = state["counter"] + 100


def test_datamodule_and_evaluation_without_a_model(tmp_path):
    dm, model = Data(), Regress()
    dm.counter = 7
    trainer = make_trainer(
        tmp_path,
        max_epochs=1,
        limit_train_batches=2,
        num_sanity_val_steps=0,
        enable_checkpointing=True,
    )
    trainer.fit(model, datamodule=dm)
    assert dm.calls == ["prepare_data", "setup:fit", "teardown:fit"]
    assert "val_loss" in trainer.callback_metrics
    (val,) = trainer.validate()
    assert set(val) == {"val_loss"}
    test0, test1 = trainer.test(datamodule=dm)  # one dict per loader, as Lightning returns them
    assert set(test0) == {"test_loss/dataloader_idx_0", "test_const/dataloader_idx_0"}
    assert set(test1) == {"test_loss/dataloader_idx_1", "test_const/dataloader_idx_1"}
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)
    assert state["datamodule"] == {"counter": 7}
    dm2 = Data()
    make_trainer(tmp_path, max_epochs=2, limit_train_batches=2).fit(
        Regress(), datamodule=dm2, ckpt_path="last"
    )
    assert dm2.counter == 107


def test_evaluation_without_model_before_fit_is_a_config_error(tmp_path):
    with pytest.raises(ls.ConfigError, match="test\\(\\) got no model and none was fitted"):
        make_trainer(tmp_path).test()


def test_fit_without_validation_step_skips_validation(tmp_path):
    class NoVal(ls.Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch):  # no batch_idx: Lightning accepts it
            return torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = make_trainer(tmp_path, max_epochs=2)
    trainer.fit(NoVal(), regression_data(), regression_data())
    assert trainer.global_step == 16


class HParamModel(Regress):
    def __init__(
        self, hidden: int = 4, lr: float = 0.1, net: torch.nn.Module | None = None, **extra
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["net"])
        self.layer = torch.nn.Linear(hidden, 1)


@pytest.mark.parametrize("strategy", ["auto", "deepspeed_stage_3", "fsdp"])
def test_hparams_in_checkpoint_and_load_from_checkpoint(tmp_path, strategy):
    model = HParamModel(hidden=4, lr=0.2, net=torch.nn.ReLU(), tag="x")
    assert model.hparams == {"hidden": 4, "lr": 0.2, "tag": "x"} and model.hparams.lr == 0.2
    logger = ls.CSVLogger(tmp_path)
    trainer = make_trainer(
        tmp_path, strategy=strategy, max_steps=2, enable_checkpointing=True, logger=logger
    )
    trainer.fit(model, regression_data())
    assert yaml.safe_load(open(f"{logger.log_dir}/hparams.yaml"))["lr"] == 0.2
    # a file (Lightning's dict) under single and ddp, a directory's trainer.pt under the others
    state = checkpoint_state(tmp_path / "checkpoints" / "last.ckpt")
    assert state["hyper_parameters"] == {"hidden": 4, "lr": 0.2, "tag": "x"}
    loaded = HParamModel.load_from_checkpoint(tmp_path / "checkpoints", lr=0.5)
    assert loaded.hparams == {"hidden": 4, "lr": 0.5, "tag": "x"} and not loaded.training
    x = torch.randn(3, 4)
    reference = ls.full_state_dict(tmp_path / "checkpoints")
    expected = x @ reference["layer.weight"].T + reference["layer.bias"]
    torch.testing.assert_close(loaded.layer(x), expected)
    assert not torch.equal(
        reference["layer.weight"], HParamModel().layer.weight
    )  # trained weights, loaded


def test_save_hyperparameters_names_and_bad_checkpoint(tmp_path):
    class Named(Regress):
        def __init__(self, a=1, b=2, c=3):
            super().__init__()
            self.save_hyperparameters("a", "c")

    assert Named().hparams == {"a": 1, "c": 3}
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ls.ConfigError, match="not a lightspeed checkpoint: expected a directory with meta.json"
    ):
        Named.load_from_checkpoint(tmp_path / "empty")


def test_log_keywords_and_trainer_properties(tmp_path):
    class Logs(Regress):
        def validation_step(self, batch, batch_idx):
            # batches of 4 and 2 samples: the epoch value is weighted by batch_size
            self.log("weighted", float(batch_idx), batch_size=len(batch[0]), prog_bar=True)
            self.log_dict({"once": 1.0}, rank_zero_only=True, logger=False)

        def training_step(self, batch, batch_idx):
            assert self.dtype == torch.float32
            opt = self.trainer.optimizers[0]
            self.toggle_optimizer(opt)
            self.untoggle_optimizer(opt)
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(
        tmp_path,
        max_epochs=1,
        limit_train_batches=2,
        num_sanity_val_steps=0,
        logger=ls.CSVLogger(tmp_path),
    )
    trainer.fit(model := Logs("dict"), regression_data(), regression_data(n=6, batch_size=4))
    assert float(trainer.callback_metrics["weighted"]) == pytest.approx((0 * 4 + 1 * 2) / 6)
    assert "weighted" in trainer.logged_metrics and "once" not in trainer.logged_metrics
    assert set(trainer.progress_bar_metrics) == {"weighted"}
    assert trainer.lr_scheduler_configs[0].interval == "epoch"
    assert all(p.requires_grad for p in model.parameters())


def test_several_loaders_and_dataloader_idx(tmp_path):
    class Multi(Regress):
        def validation_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("val_loss", float(dataloader_idx))
            self.log("plain", 1.0, add_dataloader_idx=False)

        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return dataloader_idx

    trainer = make_trainer(tmp_path, max_epochs=1, limit_train_batches=1)
    model = Multi()
    trainer.fit(model, regression_data(), {"a": regression_data(8), "b": regression_data(8)})
    metrics = trainer.callback_metrics
    assert (
        float(metrics["val_loss/dataloader_idx_0"]) == 0
        and float(metrics["val_loss/dataloader_idx_1"]) == 1
    )
    assert "plain" in metrics
    assert trainer.predict(model, [regression_data(8), regression_data(4)]) == [[0, 0], [1]]
    assert trainer.predict(model, regression_data(8)) == [0, 0]
    assert trainer.predict(model, regression_data(8), return_predictions=False) is None


def test_evaluation_verbose_false_prints_nothing(tmp_path, capsys):
    trainer = make_trainer(tmp_path, enable_model_summary=False)
    assert set(trainer.test(Regress(), regression_data(8), verbose=False)[0]) == {
        "test_loss",
        "test_const",
    }
    assert "Test metric" not in capsys.readouterr().out
    trainer.validate(Regress(), regression_data(8))
    assert "Validate metric" in capsys.readouterr().out  # Lightning's results table


class DictHParams(Regress):
    def __init__(self, config: dict):
        super().__init__()
        self.save_hyperparameters(config, logger=False)
        self.layer = torch.nn.Linear(config["hidden"], 1)


def test_hparams_given_as_one_dict(tmp_path):
    model = DictHParams({"hidden": 4, "lr": 0.3})
    assert model.hparams == {"hidden": 4, "lr": 0.3}
    logger = ls.CSVLogger(tmp_path)
    make_trainer(tmp_path, max_steps=1, enable_checkpointing=True, logger=logger).fit(
        model, regression_data()
    )
    loaded = DictHParams.load_from_checkpoint(tmp_path / "checkpoints")
    assert loaded.hparams == {"hidden": 4, "lr": 0.3}
    torch.testing.assert_close(loaded.layer.weight, model.layer.weight)
    hparams_file = tmp_path / "lightning_logs" / "version_0" / "hparams.yaml"
    assert not hparams_file.exists()  # logger=False: nothing was sent to the loggers


@pytest.mark.parametrize(
    "flags, pattern",
    [
        (
            dict(fast_dev_run=-1),
            r"fast_dev_run=-1 is not valid: expected True/False or a batch count",
        ),
        (dict(overfit_batches=1.5), r"overfit_batches=1.5 is not valid: expected a fraction"),
        (dict(num_sanity_val_steps="all"), r"num_sanity_val_steps='all' is not valid"),
    ],
)
def test_bad_lightning_flags(tmp_path, flags, pattern):
    with pytest.raises(ls.ConfigError, match=pattern):
        make_trainer(tmp_path, **flags)


def test_log_bad_batch_size(tmp_path):
    class Bad(Regress):
        def training_step(self, batch, batch_idx):
            self.log("x", 1.0, batch_size=0)

    with pytest.raises(ls.ConfigError, match=r"self.log\('x', batch_size=0\) is not valid"):
        make_trainer(tmp_path, max_steps=1).fit(Bad(), regression_data())


def test_scheduler_name_keys_learning_rate_monitor(tmp_path):
    # Lightning's lr_scheduler "name" is LearningRateMonitor's key, and `.lrs` holds every value it
    # logged.
    class Named(Regress):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            return {
                "optimizer": opt,
                "lr_scheduler": {"scheduler": sched, "name": "Sean", "interval": "step"},
            }

    monitor = ls.LearningRateMonitor(logging_interval="step")  # it needs a logger, as Lightning's
    trainer = make_trainer(
        tmp_path,
        max_steps=3,
        log_every_n_steps=1,
        callbacks=[monitor],
        logger=ls.CSVLogger(tmp_path),
    )
    trainer.fit(Named(), regression_data())
    assert trainer.lr_scheduler_configs[0].name == "Sean"
    assert monitor.lrs == {"Sean": [0.1, 0.05, 0.025]}  # before each step: the rate it uses


class OneCycle(Regress):
    """Lightning's common use of estimated_stepping_batches: OneCycleLR sized inside
    configure_optimizers (it raises when stepped past total_steps, so a count too small fails the
    fit)."""

    def configure_optimizers(self):
        self.total = self.trainer.estimated_stepping_batches
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=self.total)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@pytest.mark.parametrize(
    "flags, expected",
    [
        (
            dict(max_epochs=3, accumulate_grad_batches=3),
            3 * 3,
        ),  # 8 batches → ceil(8/3) = 3 steps per epoch
        (dict(max_epochs=2, limit_train_batches=5), 2 * 5),
        (dict(max_epochs=50, max_steps=7), 7),  # max_steps caps the epochs' count
        (dict(max_steps=11), 11),  # epochs unbounded: max_steps
    ],
)
def test_estimated_stepping_batches_sizes_one_cycle(tmp_path, flags, expected):
    model = OneCycle()
    trainer = make_trainer(tmp_path, num_sanity_val_steps=0, **flags)
    trainer.fit(model, regression_data(n=32, batch_size=4))
    assert model.total == expected
    assert (
        trainer.global_step == expected
    )  # the scheduler stepped exactly total_steps times without raising
