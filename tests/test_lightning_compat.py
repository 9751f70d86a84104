"""Lightning's module paths and utility behaviour, as Lightning code uses them (import changed only).

.venv/bin/python -m pytest -q tests/test_lightning_compat.py
"""

from __future__ import annotations

import importlib
import os
from argparse import Namespace

import pytest
import torch

from lightspeed import LightningDataModule, LightningModule
from lightspeed.core.mixins import HyperparametersMixin


# ------------------------------------------------------------------ save_hyperparameters (issue 37)
class OddSelf(LightningModule):
    def __init__(this, lr, *, width=3):
        super().__init__()
        this.save_hyperparameters()


class OddVarArgs(OddSelf):
    def __init__(me, *args, extra=5, **kw):
        super().__init__(*args, **kw)
        me.save_hyperparameters()


class OddNoSave(OddVarArgs):
    def __init__(obj, lr=0.1, extra=7, depth=1):
        super().__init__(lr, extra=extra)


def test_save_hyperparameters_finds_init_by_class_not_spelling():
    assert OddSelf(0.5).hparams == {"lr": 0.5, "width": 3}
    assert OddVarArgs(0.2, width=9).hparams == {"lr": 0.2, "width": 9, "extra": 5}
    # a subclass that does not call it still adds its own arguments (as in Lightning)
    assert OddNoSave().hparams == {"lr": 0.1, "width": 3, "extra": 7, "depth": 1}


def test_save_hyperparameters_odd_names_on_datamodule_and_containers():
    class Data(LightningDataModule):
        def __init__(dm, config):
            super().__init__()
            dm.save_hyperparameters(config)

    data = Data(Namespace(a=1))
    assert data.hparams == {"a": 1} and data._hparams_name == "config"
    assert data.hparams_initial == {"a": 1}

    class Primitive(LightningModule):
        def __init__(self_, value):
            super().__init__()
            self_.save_hyperparameters(value)

    with pytest.raises(ValueError, match="Primitives"):
        Primitive(3.0)


def test_save_hyperparameters_composition_and_ignore():
    class Child(HyperparametersMixin):
        def __init__(self, dropout, init):
            super().__init__()
            self.save_hyperparameters(ignore=["dropout"])

    class Parent(LightningModule):
        def __init__(self, batch_size):
            super().__init__()
            self.child = Child(0.1, "xavier")

    class Plain:  # not a Lightning class: its arguments are not collected
        def __init__(self, run_id="abc"):
            self.parent = Parent(64)

    assert Plain().parent.child.hparams == {"init": "xavier", "batch_size": 64}

    class Base(LightningModule):
        def __init__(self, a, b):
            super().__init__()
            self.save_hyperparameters(ignore="a")

    class Sub(Base):
        def __init__(self, a, b):
            super().__init__(a, b)
            self.save_hyperparameters(ignore="b")  # drops what the base class kept too

    assert Sub(1, 2).hparams == {"a": 1}


def test_save_hyperparameters_outside_init_is_a_config_error():
    from lightspeed.errors import ConfigError

    model = LightningModule()
    with pytest.raises(ConfigError, match="must be called from the module's __init__"):
        model.save_hyperparameters()


def test_hparams_yaml_and_csv_round_trip(tmp_path):
    from lightspeed.core.saving import (
        load_hparams_from_tags_csv,
        load_hparams_from_yaml,
        save_hparams_to_tags_csv,
        save_hparams_to_yaml,
    )

    params = {"lr": 0.1, "nested": {"a": 1}, "name": "x"}
    save_hparams_to_yaml(tmp_path / "h.yaml", Namespace(**params))
    assert load_hparams_from_yaml(tmp_path / "h.yaml", use_omegaconf=False) == params
    with pytest.warns(UserWarning, match="Skipping 'dtype'"):
        save_hparams_to_yaml(tmp_path / "h.yaml", {"dtype": torch.float32})
    save_hparams_to_tags_csv(tmp_path / "t.csv", {"lr": 0.1, "name": "x"})
    assert load_hparams_from_tags_csv(tmp_path / "t.csv") == {"lr": 0.1, "name": "x"}
    with pytest.warns(RuntimeWarning, match="Missing Tags"):
        assert load_hparams_from_yaml(tmp_path / "none.yaml") == {}


# ------------------------------------------------------------------ Lightning's module paths
PATHS = {
    "lightspeed.core.mixins": ["HyperparametersMixin"],
    "lightspeed.core.saving": ["load_hparams_from_yaml", "save_hparams_to_yaml"],
    "lightspeed.utilities": ["AttributeDict", "is_picklable"],
    "lightspeed.utilities.parsing": ["AttributeDict", "is_picklable", "clean_namespace"],
    "lightspeed.utilities.combined_loader": ["CombinedLoader"],
    "lightspeed.overrides.distributed": ["_IndexBatchSamplerWrapper"],
    "lightspeed.trainer.configuration_validator": ["verify_loop_configuration"],
    "lightspeed.loops": ["_EvaluationLoop", "_Loop"],
}


@pytest.mark.parametrize("module", sorted(PATHS))
def test_lightning_module_paths_import(module):
    imported = importlib.import_module(module)
    missing = [name for name in PATHS[module] if not hasattr(imported, name)]
    assert missing == []


# ------------------------------------------------------------------ finetuning callbacks
def test_backbone_finetuning_unfreezes_into_a_new_param_group(tmp_path):
    from torch.utils.data import DataLoader

    from lightspeed import Trainer
    from lightspeed.callbacks.finetuning import BackboneFinetuning, BaseFinetuning
    from lightspeed.demos.boring_classes import BoringModel, RandomDataset

    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))

        def forward(self, x):
            return self.layer(self.backbone(x))

        def configure_optimizers(self):
            return torch.optim.SGD(self.layer.parameters(), lr=0.1)

        def train_dataloader(self):
            return DataLoader(RandomDataset(32, 16), batch_size=4)

    model = Model()
    BaseFinetuning.freeze(model.backbone, train_bn=False)
    assert not any(p.requires_grad for p in model.backbone.parameters())
    assert not model.backbone[1].track_running_stats
    callback = BackboneFinetuning(unfreeze_backbone_at_epoch=1)
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=3,
        limit_train_batches=2,
        callbacks=callback,  # one callback, not a list: Lightning accepts it
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        optimizer_kernels="as_written",
    )
    trainer.fit(model)
    groups = trainer.optimizers[0].param_groups
    assert len(groups) == 2 and all(p.requires_grad for p in model.backbone.parameters())
    assert callback._internal_optimizer_metadata[0][1]["params"] == [
        "backbone.0.weight",
        "backbone.0.bias",
        "backbone.1.weight",
        "backbone.1.bias",
    ]
    assert groups[1]["lr"] == pytest.approx(0.1 * 0.1 * 2)  # initial ratio, then doubled once
    assert callback.state_dict()["previous_backbone_lr"] == groups[1]["lr"]


# ------------------------------------------------------------------ model summary
def test_model_summary_utility_and_callback(tmp_path, capsys):
    from lightspeed import Trainer
    from lightspeed.callbacks import ModelSummary, RichModelSummary, RichProgressBar
    from lightspeed.demos.boring_classes import BoringModel
    from lightspeed.utilities.model_summary import get_human_readable_count, summarize

    class Model(BoringModel):
        def __init__(self):
            super().__init__()
            self.example_input_array = torch.zeros(4, 32)
            self.extra = torch.nn.Parameter(torch.ones(3))

    summary = summarize(Model(), max_depth=1)
    assert (summary.layer_names, summary.in_sizes, summary.out_sizes) == (
        ["layer"],
        [[4, 32]],
        [[4, 2]],
    )
    assert summary.total_parameters == 69 and summary.total_flops == 512
    data = dict(summary._get_summary_data())
    assert data["Name"] == ["layer", "other params"] and data["Params"] == ["66  ", "3  "]
    assert get_human_readable_count(1234) == "1.2 K" and get_human_readable_count(5e15) == "5,000 T"
    with pytest.raises(ValueError, match="`max_depth` can be -1, 0 or > 0, got -2"):
        summarize(Model(), max_depth=-2)

    # The Trainer adds the callback (RichModelSummary beside a RichProgressBar), as Lightning.
    assert any(type(cb) is ModelSummary for cb in Trainer(logger=False).callbacks)
    assert not any(
        isinstance(cb, ModelSummary) for cb in Trainer(enable_model_summary=False).callbacks
    )
    rich = Trainer(logger=False, callbacks=[RichProgressBar()])
    assert any(isinstance(cb, RichModelSummary) for cb in rich.callbacks)
    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=1, logger=False, enable_checkpointing=False
    )
    trainer.fit(Model())
    out = capsys.readouterr().out
    assert "| Type   | Params | Mode  | FLOPs | In sizes | Out sizes" in out
    assert "69        Total params" in out


# ------------------------------------------------------------------ utilities, loggers, optimizers
def test_utilities_at_lightning_paths():
    import random

    from lightspeed.loggers.logger import DummyExperiment, DummyLogger
    from lightspeed.utilities import find_shared_parameters, set_shared_parameters
    from lightspeed.utilities.enums import GradClipAlgorithmType
    from lightspeed.utilities.exceptions import _augment_message
    from lightspeed.utilities.seed import isolate_rng, seed_everything

    assert seed_everything(7) == 7
    random.random()
    with isolate_rng():
        drawn = random.random()
    assert random.random() == drawn
    assert GradClipAlgorithmType.supported_types() == ["value", "norm"]
    assert GradClipAlgorithmType.NORM == "norm"
    error = ValueError("Hello. Test message.", 3)
    _augment_message(error, ".*Test.*", "new")
    assert error.args == ("new", 3)

    model = torch.nn.Sequential(
        torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
    )
    model[1].weight = model[0].weight
    assert find_shared_parameters(model) == [["0.weight", "1.weight"]]
    model[1].weight = torch.nn.Parameter(torch.zeros(2, 2))
    set_shared_parameters(model, [["0.weight", "1.weight"]])
    assert model[1].weight is model[0].weight

    from lightspeed.utilities.rank_zero import WarningCache, rank_prefixed_message

    cache = WarningCache()
    with pytest.warns(UserWarning, match="once"):
        cache.warn("once")
        cache.warn("once")  # not again
    assert rank_prefixed_message("hi", 1) == "[rank: 1] hi"
    DummyLogger().log_text("anything", step=1)  # any call is a no-op
    experiment = DummyExperiment()
    experiment["key"] = 1
    assert experiment["key"] is experiment


def test_configure_optimizers_forms_and_lightning_messages():
    from lightspeed.core.optimizer import _configure_optimizers, parse_optimizers
    from lightspeed.errors import ConfigError
    from lightspeed.utilities.types import LRSchedulerConfig

    layer = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    # `monitor` beside `lr_scheduler` (Lightning's documented dict form)
    _, configs = parse_optimizers({"optimizer": opt, "lr_scheduler": plateau, "monitor": "val"})
    assert configs == [LRSchedulerConfig(plateau, reduce_on_plateau=True, monitor="val")]
    # under manual optimization the user steps it: no monitor needed
    _, configs = parse_optimizers({"optimizer": opt, "lr_scheduler": plateau}, automatic=False)
    assert configs[0].scheduler is plateau
    with pytest.raises(ConfigError, match="must include a monitor when a `ReduceLROnPlateau`"):
        parse_optimizers({"optimizer": opt, "lr_scheduler": plateau})
    with pytest.raises(ConfigError, match="Unknown configuration for model optimizers"):
        _configure_optimizers("adam")
    step = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ConfigError, match='"interval" key in lr scheduler dict must be "step"'):
        parse_optimizers({"optimizer": opt, "lr_scheduler": {"scheduler": step, "interval": "x"}})


# ------------------------------------------------------------------ callbacks at Lightning's paths
def _fit_boring(tmp_path, model=None, **kw):
    from lightspeed import Trainer
    from lightspeed.demos.boring_classes import BoringModel

    flags = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer = Trainer(default_root_dir=tmp_path, **{**flags, **kw})
    trainer.fit(model or BoringModel())
    return trainer


def test_gradient_accumulation_scheduler_sets_steps_per_epoch(tmp_path):
    from lightspeed.callbacks import GradientAccumulationScheduler
    from lightspeed.errors import ConfigError

    with pytest.raises(ConfigError, match="Epoch should be an int"):
        GradientAccumulationScheduler({-1: 2})
    with pytest.raises(ConfigError, match="Accumulation factor should be an int"):
        GradientAccumulationScheduler({0: 0})
    schedule = GradientAccumulationScheduler({1: 2, 2: 5})
    trainer = _fit_boring(
        tmp_path, max_epochs=3, limit_train_batches=10, limit_val_batches=0, callbacks=schedule
    )
    assert trainer.global_step == 10 + 5 + 2  # 1, then 2, then 5 batches per optimizer step
    with pytest.raises(ValueError, match="`accumulate_grad_batches` and are using the"):
        _fit_boring(tmp_path, max_steps=1, accumulate_grad_batches=2, callbacks=schedule)


def test_prediction_writer_gets_batch_indices(tmp_path):
    from torch.utils.data import DataLoader

    from lightspeed import Trainer
    from lightspeed.callbacks import BasePredictionWriter
    from lightspeed.demos.boring_classes import BoringModel, RandomDataset

    class Writer(BasePredictionWriter):
        def __init__(self):
            super().__init__("batch_and_epoch")
            self.batches, self.epochs = [], []

        def write_on_batch_end(self, trainer, module, prediction, indices, batch, idx, dl_idx):
            self.batches.append((indices, idx, dl_idx, tuple(prediction.shape)))

        def write_on_epoch_end(self, trainer, module, predictions, batch_indices):
            self.epochs.append((len(predictions), batch_indices))

    writer = Writer()
    trainer = Trainer(default_root_dir=tmp_path, logger=False, callbacks=writer)
    trainer.predict(BoringModel(), DataLoader(RandomDataset(32, 6), batch_size=4))
    assert writer.batches == [([0, 1, 2, 3], 0, 0, (4, 2)), ([4, 5], 1, 0, (2, 2))]
    assert writer.epochs == [(2, [[[0, 1, 2, 3], [4, 5]]])]


def test_profilers_time_actions(tmp_path, capsys):
    from lightspeed.profilers import AdvancedProfiler, PassThroughProfiler, SimpleProfiler

    profiler = SimpleProfiler()
    for _ in range(3):
        with profiler.profile("step"):
            sum(range(1000))
    assert len(profiler.recorded_durations["step"]) == 3
    profiler.describe()
    assert "step" in capsys.readouterr().out
    advanced = AdvancedProfiler(dirpath=tmp_path, filename="prof")
    with advanced.profile("work"):
        sorted(range(100))
    advanced.describe()
    assert "Profile stats for: work" in (tmp_path / "prof.txt").read_text()
    with PassThroughProfiler().profile("nothing"):
        pass


def test_on_exception_checkpoint_saves_when_fit_raises(tmp_path):
    from lightspeed.callbacks import OnExceptionCheckpoint
    from lightspeed.demos.boring_classes import BoringModel

    class Fails(BoringModel):
        def training_step(self, batch, batch_idx):
            if self.global_step == 2:
                raise RuntimeError("boom")
            return super().training_step(batch, batch_idx)

    callback = OnExceptionCheckpoint(tmp_path / "ckpts")
    with pytest.raises(RuntimeError, match="boom"):
        _fit_boring(tmp_path, Fails(), max_steps=5, callbacks=[callback])
    assert callback.ckpt_path.endswith("on_exception.ckpt")
    assert any((tmp_path / "ckpts").iterdir())


def test_learning_rate_monitor_names_as_lightning(tmp_path):
    from lightspeed import CSVLogger
    from lightspeed.callbacks import LearningRateMonitor
    from lightspeed.demos.boring_classes import BoringModel
    from lightspeed.errors import ConfigError

    class TwoAdams(BoringModel):
        def configure_optimizers(self):
            first = torch.optim.Adam(self.layer.parameters(), lr=0.1)
            second = torch.optim.Adam(
                [{"params": [self.layer.weight]}, {"params": [self.layer.bias], "name": "bias"}],
                lr=0.2,
            )
            return [first, second]

        def training_step(self, batch, batch_idx):
            return None  # manual optimization below is not needed: nothing to step

    monitor = LearningRateMonitor(log_momentum=True)
    model = TwoAdams()
    model.automatic_optimization = False
    _fit_boring(tmp_path, model, max_steps=2, callbacks=[monitor], logger=CSVLogger(tmp_path))
    assert list(monitor.lrs) == ["lr-Adam", "lr-Adam-1/pg1", "lr-Adam-1/bias"]
    assert monitor.last_momentum_values["lr-Adam-momentum"] == 0.9
    with pytest.raises(ConfigError, match="has no logger"):
        _fit_boring(tmp_path, max_steps=1, callbacks=[LearningRateMonitor()])


def test_timer_zero_duration_and_stages(tmp_path):
    from datetime import timedelta

    from lightspeed.callbacks import Timer
    from lightspeed.demos.boring_classes import BoringModel
    from lightspeed.errors import ConfigError

    with pytest.raises(ConfigError, match="format DD:HH:MM:SS"):
        Timer("6:00:00")
    with pytest.raises(ConfigError, match="Unsupported parameter value"):
        Timer(interval="batch")
    timer = Timer(timedelta(0))  # spent before the first step: fit stops at once
    trainer = _fit_boring(tmp_path, max_epochs=2, callbacks=[timer])
    assert trainer.global_step == 0 and timer._duration == 0
    timer = Timer()
    trainer = _fit_boring(tmp_path, max_steps=2, callbacks=[timer])
    trainer.test(BoringModel(), verbose=False)
    assert timer.time_elapsed("train") > 0 and timer.time_elapsed("test") > 0
    assert timer.state_dict()["time_elapsed"]["predict"] == 0


# ------------------------------------------------------------------ progress bars
def test_tqdm_progress_bar_draws_and_reports_metrics(tmp_path, capsys):
    import pickle

    from lightspeed import Trainer
    from lightspeed.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
    from lightspeed.callbacks.progress.tqdm_progress import Tqdm
    from lightspeed.demos.boring_classes import BoringModel
    from lightspeed.errors import ConfigError

    assert [Tqdm.format_num(x) for x in (1, 1.0, 1e-5, "abc")] == ["1", "1.000", "1e-5", "abc"]
    with pytest.raises(ConfigError, match="multiple progress bar callbacks"):
        Trainer(callbacks=[TQDMProgressBar(), RichProgressBar()])
    assert isinstance(Trainer(logger=False).progress_bar_callback, RichProgressBar)

    class Logs(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("shown", 0.5, prog_bar=True)
            return out

    bar = TQDMProgressBar()
    trainer = Trainer(
        default_root_dir=tmp_path,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=2,
        callbacks=[bar],
        enable_checkpointing=False,
    )
    trainer.fit(Logs())
    assert isinstance(bar, ProgressBar) and trainer.progress_bar_callback is bar
    assert (bar.train_progress_bar.n, bar.train_progress_bar.total) == (3, 3)
    assert bar.val_progress_bar.total == 2 and bar.total_train_batches == 3
    metrics = bar.get_metrics(trainer, trainer.lightning_module)
    assert metrics["v_num"] == 0 and metrics["shown"] == 0.5
    assert "Epoch 0: 100%" in capsys.readouterr().out  # tqdm drew it, not lightspeed's bar
    pickle.dumps(bar)


# ------------------------------------------------------------------ loggers
def test_csv_and_tensorboard_loggers_as_lightning(tmp_path):
    from lightspeed.loggers import CSVLogger, TensorBoardLogger
    from lightspeed.loggers.csv_logs import ExperimentWriter

    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)
    csv_logger = CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    assert csv_logger.version == 1 and csv_logger.log_dir.endswith("lightning_logs/version_1")
    csv_logger.log_metrics({"a": torch.tensor(0.5)}, step=0)
    assert not os.path.exists(csv_logger.experiment.metrics_file_path)  # kept until a flush
    csv_logger.log_metrics({"a": 1, "b": 2}, step=1)  # the second step flushes, header widened
    lines = open(os.path.join(csv_logger.log_dir, ExperimentWriter.NAME_METRICS_FILE)).readlines()
    assert lines[0].strip() == "a,b,step" and len(lines) == 3
    csv_logger.log_hyperparams(Namespace(lr=0.1))
    assert os.path.isfile(os.path.join(csv_logger.log_dir, CSVLogger.NAME_HPARAMS_FILE))
    assert CSVLogger(tmp_path, name="", version="named").log_dir == str(tmp_path / "named")

    tb = TensorBoardLogger(tmp_path, name="tb", sub_dir="sub", default_hp_metric=False)
    assert tb.log_dir == str(tmp_path / "tb" / "version_0" / "sub")
    tb.log_hyperparams({"lr": 0.1})
    tb.log_metrics({"loss": torch.tensor(1.0)}, step=1)
    tb.finalize("success")
    assert (tmp_path / "tb" / "version_0" / "sub" / "hparams.yaml").exists()
    with pytest.warns(UserWarning, match="Could not log computational graph"):
        TensorBoardLogger(tmp_path, log_graph=True).log_graph(torch.nn.Linear(2, 2))


def test_loggers_get_the_users_hparams_only(tmp_path):
    from lightspeed import CSVLogger
    from lightspeed.demos.boring_classes import BoringModel

    class Model(BoringModel):
        def __init__(self, width=3):
            super().__init__()
            self.save_hyperparameters()

    logger = CSVLogger(tmp_path)
    _fit_boring(tmp_path, Model(), max_steps=2, logger=logger)
    import yaml

    assert yaml.safe_load(open(os.path.join(logger.log_dir, "hparams.yaml"))) == {"width": 3}


def test_datamodule_load_from_checkpoint(tmp_path):
    from lightspeed import Trainer
    from lightspeed.demos.boring_classes import BoringDataModule, BoringModel

    class Data(BoringDataModule):
        def __init__(this, batch_size=4):
            super().__init__()
            this.save_hyperparameters()

    trainer = Trainer(
        default_root_dir=tmp_path, max_steps=1, logger=False, enable_progress_bar=False
    )
    trainer.fit(BoringModel(), datamodule=Data(batch_size=8))
    trainer.save_checkpoint(tmp_path / "ckpt")
    assert Data.load_from_checkpoint(tmp_path / "ckpt").hparams.batch_size == 8


def test_issue37_names_in_log_checkpoint_and_all_gather(tmp_path):
    import numpy as np

    from lightspeed.callbacks import ModelCheckpoint
    from lightspeed.demos.boring_classes import BoringModel

    class Logs(BoringModel):
        def training_step(self, batch, batch_idx):
            out = super().training_step(batch, batch_idx)
            self.log("avg_loss", out["loss"], reduce_fx="avg", on_epoch=True)
            self.log("summed", 1.0, reduce_fx="SUM", on_step=False, on_epoch=True)
            return out

    model = Logs()
    gathered = model.all_gather(np.ones(3))  # one process: the array made a tensor
    assert isinstance(gathered, torch.Tensor) and gathered.tolist() == [1.0, 1.0, 1.0]
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="epoch", mode="max", save_top_k=1)
    trainer = _fit_boring(
        tmp_path,
        model,
        max_epochs=2,
        limit_train_batches=3,
        limit_val_batches=0,
        callbacks=[checkpoint],
        enable_checkpointing=True,
    )
    assert float(trainer.callback_metrics["summed"]) == 3.0
    assert list(checkpoint.best_k_models.values()) == [1.0]  # the last epoch's, by "epoch"
