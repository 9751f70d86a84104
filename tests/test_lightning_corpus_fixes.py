"""Behaviour Lightning's own tests (../shared/lightning-tests) check, found missing there and built
here: hooks set to None, the entry points' checks, a DataModule passed positionally, what
`on_train_batch_end` and `validate` / `test` hand back, `self.log`'s per-hook defaults, evaluation
under `inference_mode`, and the names code imports from Lightning's loop paths.

.venv/bin/python -m pytest -q tests/test_lightning_corpus_fixes.py
"""

from __future__ import annotations

import io
import warnings
from contextlib import redirect_stdout

import pytest
import torch
from torch.utils.data import DataLoader

import lightspeed as ls
from lightspeed.callbacks import Callback
from lightspeed.core.optimizer import LightningOptimizer
from test_trainer import Regress, make_trainer, regression_data


# ------------------------------------------------------------------ a hook set to None
def test_a_step_set_to_none_switches_its_loop_off(tmp_path):
    model = Regress()
    model.validation_step = None
    model.val_dataloader = lambda: regression_data(8)
    with pytest.warns(UserWarning, match="`val_dataloader` but have no `validation_step`"):
        make_trainer(tmp_path, max_steps=2).fit(model, regression_data())
    assert "validation_step" not in model.calls and model.calls.count("training_step") == 2

    model = Regress()  # a validation_step, and no validation data: skipped, with a warning
    model.val_dataloader = None
    with pytest.warns(UserWarning, match="`validation_step` but have no `val_dataloader`"):
        make_trainer(tmp_path, max_steps=2).fit(model, regression_data())
    assert "validation_step" not in model.calls


@pytest.mark.parametrize(
    "entry, hook, message",
    [
        ("fit", "training_step", r"No `training_step\(\)` method defined"),
        ("fit", "configure_optimizers", r"No `configure_optimizers\(\)` method defined"),
        ("validate", "validation_step", r"No `validation_step\(\)` method defined"),
        ("test", "test_step", r"No `test_step\(\)` method defined"),
        ("predict", "predict_step", "`predict_step` cannot be None"),
    ],
)
def test_an_entry_points_own_step_set_to_none_is_refused(tmp_path, entry, hook, message):
    model = Regress()
    setattr(model, hook, None)
    with pytest.raises(ls.ConfigError, match=message):
        getattr(make_trainer(tmp_path, max_steps=1), entry)(model, regression_data())


def test_predict_without_predict_step_needs_forward(tmp_path):
    class NoForward(ls.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

    with pytest.raises(ls.ConfigError, match="requires `forward` method to run"):
        make_trainer(tmp_path).predict(NoForward(), regression_data())


def test_removed_epoch_end_hooks_and_manual_optimization_flags_are_refused(tmp_path):
    class Legacy(Regress):
        def validation_epoch_end(self, outputs):
            pass

    with pytest.raises(NotImplementedError, match="validation_epoch_end` has been removed"):
        make_trainer(tmp_path).validate(Legacy(), regression_data())

    manual = Regress()
    manual.automatic_optimization = False
    with pytest.raises(ls.ConfigError, match="Automatic gradient clipping is not supported"):
        make_trainer(tmp_path, gradient_clip_val=1.0).fit(manual, regression_data())
    with pytest.raises(ls.ConfigError, match="Automatic gradient accumulation is not supported"):
        make_trainer(tmp_path, accumulate_grad_batches=2).fit(manual, regression_data())


# ------------------------------------------------------------------ a DataModule passed positionally
class Data(ls.LightningDataModule):
    def setup(self, stage):
        self.data = regression_data(8).dataset

    def train_dataloader(self):
        return DataLoader(self.data, batch_size=4)

    def test_dataloader(self):
        return DataLoader(self.data, batch_size=2)


def test_a_datamodule_in_the_loaders_place_is_the_datamodule(tmp_path):
    trainer = make_trainer(tmp_path, max_epochs=1)
    model = Regress()
    model.val_dataloader = None
    trainer.fit(model, Data())
    assert trainer.global_step == 2 and isinstance(trainer.datamodule, Data)
    (results,) = trainer.test(model, Data(), verbose=False)
    assert set(results) == {"test_loss", "test_const"}
    with pytest.raises(ls.ConfigError, match="two DataModules"):
        trainer.test(model, Data(), datamodule=Data())


def test_datamodule_str_and_from_datasets_passes_batch_size_to_init():
    dm = Data()
    assert str(dm).splitlines()[0] == "{Train dataloader: None}"  # setup has not run
    dm.setup("fit")
    assert str(dm).splitlines() == [
        "{Train dataloader: size=8}",
        "{Validation dataloader: None}",
        "{Test dataloader: size=8}",
        "{Predict dataloader: None}",
    ]

    class Sized(ls.LightningDataModule):
        def __init__(self, batch_size=1):
            super().__init__()
            self.batch_size = batch_size

    sized = Sized.from_datasets(regression_data(8).dataset, batch_size=4)
    assert sized.batch_size == 4 and len(sized.train_dataloader()) == 2


# ------------------------------------------------------------------ what the steps receive and return
def test_one_evaluation_loader_passes_no_dataloader_idx(tmp_path):
    seen = []

    class Args(Regress):
        def validation_step(self, *args):
            seen.append(len(args))

        def test_step(self, batch, batch_idx, dataloader_idx=None):
            seen.append(dataloader_idx)

    trainer = make_trainer(tmp_path, limit_val_batches=1, limit_test_batches=1)
    trainer.validate(Args(), regression_data(), verbose=False)
    trainer.test(Args(), regression_data(), verbose=False)
    trainer.test(Args(), [regression_data(), regression_data()], verbose=False)
    assert seen == [2, None, 0, 1]


def test_on_train_batch_end_gets_a_dict_with_the_loss_detached(tmp_path):
    got = []

    class Outputs(Regress):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return None if batch_idx == 1 else {"loss": loss, "extra": batch_idx}

        def on_train_batch_end(self, outputs, batch, batch_idx):
            got.append(outputs)

    with pytest.warns(UserWarning, match="`training_step` returned `None`"):
        make_trainer(tmp_path, max_steps=3, accumulate_grad_batches=1).fit(
            Outputs(), regression_data()
        )
    assert got[1] == {}  # the batch whose step returned None: skipped, no backward
    assert got[0]["extra"] == 0 and got[2]["extra"] == 2
    assert got[0]["loss"].grad_fn is None and got[0]["loss"].requires_grad is False


# ------------------------------------------------------------------ validate / test results
def test_results_come_one_dict_per_loader_and_print_lightnings_table(tmp_path):
    class PerLoader(Regress):
        def test_step(self, batch, batch_idx, dataloader_idx=0):
            self.log("acc", float(dataloader_idx))
            self.log(f"raw{dataloader_idx}", 5.0, add_dataloader_idx=False)

        def on_test_epoch_end(self):
            self.log("shared", 1.0)

    out = io.StringIO()
    with redirect_stdout(out):
        results = make_trainer(tmp_path).test(PerLoader(), [regression_data(), regression_data()])
    assert results == [
        {"acc/dataloader_idx_0": 0.0, "raw0": 5.0, "shared": 1.0},
        {"acc/dataloader_idx_1": 1.0, "raw1": 5.0, "shared": 1.0},
    ]
    table = out.getvalue()
    assert "Test metric" in table and "DataLoader 1" in table and "raw1" in table


def test_print_results_layout():
    from lightspeed.loops import _EvaluationLoop

    with redirect_stdout(io.StringIO()) as out:
        _EvaluationLoop._print_results([{}], "test")
    assert out.getvalue() == ""
    from lightspeed.report.results import print_results

    with redirect_stdout(io.StringIO()) as out:
        print_results([{"b/dataloader_idx_0": torch.tensor(2.5), "a": {"x": 1}}], "test", False)
    lines = [line.strip() for line in out.getvalue().splitlines()]
    assert lines[1].split() == ["Test", "metric", "DataLoader", "0"]
    assert lines[3].split() == ["a:x", "1"] and lines[4].split() == ["b", "2.5"]


# ------------------------------------------------------------------ self.log
def test_log_defaults_follow_the_hook_and_forked_names(tmp_path):
    class Logs(Regress):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.log("both", loss, on_step=True, on_epoch=True, prog_bar=True)
            return loss

        def on_train_epoch_end(self):
            self.log("at_end", 2.0)  # an epoch-level hook: on_epoch by default

        def validation_step(self, batch, batch_idx):
            self.log("v", 1.0, on_step=True, on_epoch=True)

    class CallbackLogs(Callback):
        def on_train_epoch_end(self, trainer, module):
            self.log("from_callback", 3.0)

    trainer = make_trainer(tmp_path, max_epochs=1, limit_val_batches=2, callbacks=[CallbackLogs()])
    trainer.fit(Logs(), regression_data(8), regression_data(8))
    metrics = trainer.callback_metrics
    assert float(metrics["at_end"]) == 2.0 and "at_end_step" not in metrics
    assert float(metrics["from_callback"]) == 3.0
    assert set(trainer.progress_bar_metrics) == {"both_step", "both_epoch"}
    assert "v_epoch" in metrics and "v_step" not in metrics  # evaluation step values leave
    assert "v_step" in trainer.logged_metrics  # ... after being logged per batch
    with pytest.raises(RuntimeError, match="outside a run"):
        CallbackLogs().log("x", 1.0)


def test_log_refuses_what_records_nothing_and_values_it_cannot_log(tmp_path):
    class Useless(Regress):
        def training_step(self, batch, batch_idx):
            self.log("x", 1.0, on_step=False, on_epoch=False)

    with pytest.raises(ls.ConfigError, match="is not useful"):
        make_trainer(tmp_path, max_steps=1).fit(Useless(), regression_data())

    class Text(Regress):
        def training_step(self, batch, batch_idx):
            self.log("x", "foo")

    with pytest.raises(ValueError, match=r"`self.log\(x, foo\)` was called"):
        make_trainer(tmp_path, max_steps=1).fit(Text(), regression_data())


# ------------------------------------------------------------------ evaluation's grad mode
@pytest.mark.parametrize("inference_mode", [True, False])
def test_evaluation_runs_under_inference_mode_or_no_grad(tmp_path, inference_mode):
    modes = []

    class Modes(Regress):
        def record(self):
            modes.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))

        def on_validation_start(self):
            self.record()

        def on_test_start(self):
            self.record()

        def on_predict_start(self):
            self.record()

    trainer = make_trainer(tmp_path, inference_mode=inference_mode)
    for entry in ("validate", "test", "predict"):
        getattr(trainer, entry)(Modes(), regression_data(8))
    # a gloo group (one an earlier in-process test of this worker left joined) means no_grad, as
    # in Lightning: gloo's collectives fail on inference tensors
    gloo = torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    assert modes == [(False, inference_mode and not gloo)] * 3


# ------------------------------------------------------------------ Lightning's optimizer wrapper
def test_optimizers_come_wrapped_in_lightning_optimizer(tmp_path):
    seen = []

    class Manual(Regress):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            seen.append(opt)
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            opt.step()

    model = Manual()
    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit(model, regression_data())
    assert isinstance(seen[0], LightningOptimizer) and seen[0] is seen[1]
    assert seen[0].optimizer is trainer.optimizers[0]
    assert str(seen[0]) == "Lightning" + str(trainer.optimizers[0])
    assert model.optimizers(use_pl_optimizer=False) is trainer.optimizers[0]


# ------------------------------------------------------------------ names at Lightning's loop paths
def test_loop_paths_names():
    from lightspeed.loops import _Loop
    from lightspeed.loops.optimization.automatic import Closure
    from lightspeed.loops.utilities import _no_grad_context

    class Runs(_Loop):
        def __init__(self, inference_mode):
            super().__init__(trainer=None)
            self.inference_mode = inference_mode

        @_no_grad_context
        def run(self):
            return torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    assert Runs(True).run() == (False, True) and Runs(False).run() == (False, False)

    class NotALoop:
        run = _no_grad_context(lambda self: None)

    with pytest.raises(TypeError, match="needs to be a Loop"):
        NotALoop().run()
    Closure.warning_cache.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Closure.warning_cache.warn("once")
        Closure.warning_cache.warn("once")
    assert len(caught) == 1


# ------------------------------------------------------------------ the Trainer's flags
def test_limits_of_exactly_one_are_said_and_env_vars_give_defaults(tmp_path, caplog, monkeypatch):
    import logging

    with caplog.at_level(logging.INFO):
        make_trainer(tmp_path, limit_val_batches=1, val_check_interval=1.0)
    assert "`Trainer(limit_val_batches=1)` was configured so 1 batch per epoch" in caplog.text
    assert "`Trainer(val_check_interval=1.0)` was configured so validation will run" in caplog.text

    monkeypatch.setenv("PL_TRAINER_MAX_STEPS", "3")
    monkeypatch.setenv("PL_TRAINER_LOGGER", "False")
    trainer = ls.Trainer(accelerator="cpu", enable_progress_bar=False)
    assert trainer.max_steps == 3 and trainer.logger is None
    assert ls.Trainer(accelerator="cpu", max_steps=5).max_steps == 5  # the call wins
    monkeypatch.delenv("PL_TRAINER_MAX_STEPS")
    monkeypatch.delenv("PL_TRAINER_LOGGER")

    trainer = make_trainer(tmp_path, max_steps=2)
    assert trainer.max_epochs is None and trainer.val_check_interval == 1.0  # as Lightning's
    trainer.fit(Regress(), regression_data())
    assert trainer.max_epochs == -1  # resolved when the fit started


def test_validation_interval_rules(tmp_path):
    with pytest.raises(ls.ConfigError, match="must be less than or equal to the number of"):
        make_trainer(tmp_path, val_check_interval=100).fit(
            Regress(), regression_data(), regression_data()
        )
    with pytest.raises(ls.ConfigError, match="check_val_every_n_epoch=None"):
        make_trainer(tmp_path, val_check_interval=0.5, check_val_every_n_epoch=None)


def test_none_batches_none_optimizer_and_overfit_shuffling(tmp_path):
    ends = []

    class NoneBatches(Regress):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            ends.append(outputs is None)

    data = regression_data(16)
    loader = DataLoader(
        data.dataset,
        batch_size=4,
        collate_fn=lambda items: (
            None if items[0][1] > 0 else torch.utils.data.default_collate(items)
        ),
    )
    trainer = make_trainer(tmp_path, max_epochs=1)
    with pytest.warns(UserWarning, match="train_dataloader yielded None"):
        trainer.fit(NoneBatches(), loader)
    skipped = sum(ends)
    assert 0 < skipped < 4 and trainer.global_step == 4 - skipped  # no step for a None batch

    model = Regress()
    model.configure_optimizers = lambda: None
    with pytest.warns(UserWarning, match="will run with no optimizer"):
        make_trainer(tmp_path, max_steps=2).fit(model, regression_data())
    assert model.calls.count("training_step") == 2

    with pytest.warns(UserWarning, match="requested to overfit but enabled train dataloader"):
        trainer = make_trainer(tmp_path, max_steps=1, overfit_batches=2)
        trainer.fit(Regress(), regression_data(shuffle=True))
    assert isinstance(trainer.train_dataloader.sampler, torch.utils.data.SequentialSampler)


def test_schedulers_step_where_lightning_steps_them(tmp_path):
    seen = {}

    class Scheduled(Regress):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            every_epoch = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return [opt], [
                every_epoch,
                {"scheduler": plateau, "monitor": "val_loss", "interval": "step", "strict": False},
            ]

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx == 1:  # the epoch's last batch: the epoch scheduler has stepped already
                seen["epoch_steps"] = self.lr_schedulers()[0].last_epoch
                seen["plateau_steps"] = self.lr_schedulers()[1].last_epoch

    trainer = make_trainer(tmp_path, max_epochs=1, limit_train_batches=2, num_sanity_val_steps=0)
    with pytest.warns(RuntimeWarning, match="val_loss which is not available but strict"):
        trainer.fit(Scheduled(), regression_data(), regression_data(8))  # batch 0: no val_loss
    # the plateau one steps once validation has logged val_loss: after the last batch's end hooks
    assert seen == {"epoch_steps": 1, "plateau_steps": 0}
    assert trainer.lr_scheduler_configs[1].scheduler.last_epoch == 1


def test_sanity_check_runs_validation_hooks_but_early_stopping_waits(tmp_path):
    stages = []

    class Watch(Callback):
        def on_validation_epoch_start(self, trainer, module):
            stages.append(trainer.sanity_checking)

    early = ls.callbacks.EarlyStopping(monitor="val_loss", patience=0)
    trainer = make_trainer(tmp_path, max_epochs=1, callbacks=[Watch(), early])
    trainer.fit(Regress(), regression_data(), regression_data(8))
    assert stages == [True, False] and not trainer.should_stop


def test_lightning_optimizer_passes_the_closure_by_keyword():
    calls = []

    class Records(torch.optim.SGD):
        def step(self, *args, **kwargs):  # Lightning passes closure=..., never positionally
            calls.append((args, sorted(kwargs)))

    opt = LightningOptimizer(Records([torch.nn.Parameter(torch.zeros(1))], lr=0.1))
    opt.step(lambda: None, extra=1)
    opt.step()
    assert calls == [((), ["closure", "extra"]), ((), [])]


# ------------------------------------------------------------------ dataloader_idx and predict's indices
def test_dataloader_idx_signatures_are_checked_as_lightning_does(tmp_path):
    class Required(Regress):
        def test_step(self, batch, batch_idx, dataloader_idx):
            pass

    trainer = make_trainer(tmp_path)
    with pytest.raises(RuntimeError, match="only a single `test_dataloader`.*Required.test_step"):
        trainer.test(Required(), regression_data(), verbose=False)

    class NoIdxHook(Regress):
        def predict_step(self, batch, batch_idx, dataloader_idx=0):
            return batch[0]

        def on_predict_batch_end(self, outputs, batch, batch_idx):
            pass

    with pytest.raises(RuntimeError, match="no `dataloader_idx` argument in `NoIdxHook.on_predict"):
        trainer.predict(NoIdxHook(), [regression_data(), regression_data()])
    # the default predict_step takes any loader's batches
    plain = ls.LightningModule()
    plain.forward = lambda x: x[0].sum()
    assert len(trainer.predict(plain, [regression_data(8), regression_data(4)])) == 2


def test_predict_records_each_batchs_dataset_indices_random_order_too(tmp_path):
    from lightspeed.callbacks import BasePredictionWriter
    from lightspeed.overrides.distributed import _IndexBatchSamplerWrapper

    written = []

    class Writer(BasePredictionWriter):
        def write_on_batch_end(self, trainer, module, prediction, indices, batch, batch_idx, idx):
            written.append((indices, batch[0][:, 0].tolist()))

    data = regression_data(8)
    shuffled = DataLoader(data.dataset, batch_size=4, shuffle=True)
    trainer = make_trainer(tmp_path, callbacks=[Writer("batch")])
    trainer.predict(Regress(), shuffled, return_predictions=False)
    assert isinstance(trainer.predict_dataloaders.batch_sampler, _IndexBatchSamplerWrapper)
    firsts = data.dataset.tensors[0][:, 0]
    for indices, values in written:  # each batch's indices name the samples it held
        assert firsts[indices].tolist() == values
    assert sorted(i for indices, _ in written for i in indices) == list(range(8))


def test_tensorboard_log_graph_of_a_module_outside_a_run(tmp_path):
    from lightspeed.loggers import TensorBoardLogger

    class Forward(Regress):
        def forward(self, x):
            return self.layer(x)

    logger = TensorBoardLogger(tmp_path, log_graph=True)
    model = Forward()
    logger.log_graph(model, torch.zeros(2, 4))  # torch.jit reads model.trainer: None, no error
    with pytest.raises(RuntimeError, match="not attached to a Trainer"):
        model.trainer  # noqa: B018


def test_trainer_profiler_times_the_hooks(tmp_path, capsys):
    from lightspeed.profilers import PassThroughProfiler, SimpleProfiler

    assert isinstance(make_trainer(tmp_path).profiler, PassThroughProfiler)
    trainer = make_trainer(tmp_path, max_steps=2, profiler="simple")
    trainer.fit(Regress(), datamodule=Data())
    recorded = trainer.profiler.recorded_durations
    assert isinstance(trainer.profiler, SimpleProfiler)
    for action in ("[LightningDataModule]Data.setup", "[LightningModule]Regress.on_fit_start"):
        assert len(recorded[action]) == 1
    assert len(recorded["[Strategy]SingleDevice.training_step"]) == 2
    assert "[LightningModule]Regress.on_fit_start" in capsys.readouterr().out  # the summary
    with pytest.raises(ls.ConfigError, match="profiler='fast' is not valid"):
        make_trainer(tmp_path, profiler="fast")


def test_fit_loop_is_a_read_only_view_of_where_fit_is(tmp_path):
    seen = []

    class Reads(Regress):
        def training_step(self, batch, batch_idx):
            loop = self.trainer.fit_loop
            seen.append(
                (
                    loop.epoch_progress.current.completed,
                    loop.epoch_loop.batch_idx,
                    loop.epoch_loop.batch_progress.current.completed,
                )
            )
            return super().training_step(batch, batch_idx)

    trainer = make_trainer(tmp_path, max_epochs=2, limit_train_batches=2)
    assert trainer.fit_loop.max_epochs == 2 and trainer.fit_loop.max_steps == -1
    trainer.fit(Reads(), regression_data())
    assert seen == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    assert trainer.fit_loop.epoch_progress.total.completed == 2
    with pytest.raises(AttributeError):
        trainer.fit_loop.max_epochs = 3


# ------------------------------------------------------------------ manual_backward's options
RETAIN_SCRIPT = """
import sys, torch, lightspeed as ls

class Twice(ls.LightningModule):
    # one graph, two backwards: the second needs retain_graph=True on the first; the gradients add
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.layer(batch).pow(2).mean()
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(loss)
        self.manual_backward(self.layer(batch).pow(2).mean() * 0)  # a third, from a new graph
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

torch.manual_seed(0)
model = Twice()
x = torch.randn(8, 4)
w, b = model.layer.weight.detach().clone(), model.layer.bias.detach().clone()
ref = torch.nn.Linear(4, 1)
ref.load_state_dict({"weight": w, "bias": b})
ref(x).pow(2).mean().backward()
want = w - 0.1 * 2 * ref.weight.grad
trainer = ls.Trainer(accelerator="cpu", devices=1, strategy=sys.argv[1], max_steps=1,
                     enable_progress_bar=False, enable_model_summary=False, logger=False,
                     enable_checkpointing=False, optimizer_kernels="as_written")
trainer.fit(model, torch.utils.data.DataLoader(x, batch_size=8))
with torch.no_grad():
    params = {n: p.detach().float().clone() for n, p in model.named_parameters()}
print("DIFF", float((params["layer.weight"] - want).abs().max()))
"""


@pytest.mark.parametrize("strategy", ["single", "deepspeed_stage_2"])
def test_manual_backward_passes_retain_graph_to_the_backward(tmp_path, strategy):
    # Lightning's manual_backward(loss, *args, **kwargs) hands torch's backward options on: two
    # backwards through one graph give twice the gradient, under DeepSpeed's engine too
    import subprocess
    import sys

    script = tmp_path / "retain.py"
    script.write_text(RETAIN_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), strategy],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    diff = float(run.stdout.split("DIFF")[-1])
    assert diff < 1e-6, run.stdout[-2000:]
