"""The bad-input catalogue: each case is one misconfiguration a user can make, and each must raise
ConfigError naming the parameter and the value, before any rank starts where the input is known
then.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_bad_input_catalogue.py

Cases known at construction run the constructor; cases known only once the model runs (self.log
values, configure_optimizers' schedulers, a monitored key never logged) run a one-device fit in this
process.
"""

from __future__ import annotations

import json

import pytest
import torch

import lightspeed as ls
import lightspeed.start
from lightspeed.core.optimizer import parse_optimizers
from test_trainer import Regress, make_trainer, regression_data


def _opt():
    return torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)


def _with_scheduler(**entry):
    opt = _opt()
    return lambda: parse_optimizers(
        {
            "optimizer": opt,
            "lr_scheduler": {
                **(
                    {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}
                    if "no_scheduler" not in entry
                    else {}
                ),
                **{k: v for k, v in entry.items() if k != "no_scheduler"},
            },
        }
    )


def _plateau_without_monitor():
    opt = _opt()
    return parse_optimizers(
        {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}
    )


class LogsBadly(Regress):
    def __init__(self, value):
        super().__init__()
        self.value = value

    def training_step(self, batch, batch_idx):
        self.log("bad", self.value)
        return super().training_step(batch, batch_idx)


def _fit(tmp_path, model=None, ckpt_path=None, **flags):
    make_trainer(tmp_path, max_steps=2, **flags).fit(
        model or Regress(), regression_data(), ckpt_path=ckpt_path
    )


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch):
    """A case that failed to raise before launch would re-run pytest as a rank: refuse instead."""

    def refuse(n):
        raise AssertionError(f"a bad input reached the spawner (start_local_ranks({n}))")

    monkeypatch.setattr(lightspeed.start, "start_local_ranks", refuse)


def _trainer(**flags):
    return lambda tmp_path: make_trainer(tmp_path, **{"devices": 2, **flags})


def _json_file(tmp_path, text):
    path = tmp_path / "ds.json"
    path.write_text(text)
    return str(path)


CASES = [
    # Trainer flags
    ("accelerator", _trainer(accelerator="tpu"), "accelerator='tpu'"),
    ("precision", _trainer(precision="64-true"), "precision='64-true'"),
    ("devices", _trainer(devices=0), "devices=0"),
    ("devices-str", _trainer(devices="two"), "devices='two'"),
    ("devices-all-cpu", _trainer(devices=-1, accelerator="cpu"), "devices=-1 is not valid on CPU"),
    (
        "devices-indices-cpu",
        _trainer(devices=[0, 1], accelerator="cpu"),
        r"devices=\[0, 1\] is not valid: GPU indices",
    ),
    ("devices-str-zero", _trainer(devices="0", accelerator="cpu"), "devices='0' is not valid"),
    ("num_nodes", _trainer(num_nodes=0), "num_nodes=0"),
    ("max_epochs", _trainer(max_epochs=-2), "max_epochs=-2"),
    ("min_epochs", _trainer(min_epochs=-1), "min_epochs=-1"),
    (
        "min_epochs-above-max",
        _trainer(min_epochs=5, max_epochs=2),
        "min_epochs=5 is not valid with max_epochs=2",
    ),
    ("min_steps", _trainer(min_steps=1.5), "min_steps=1.5"),
    (
        "min_steps-above-max",
        _trainer(min_steps=9, max_steps=3),
        "min_steps=9 is not valid with max_steps=3",
    ),
    ("max_time-form", _trainer(max_time="12:00"), "max_time='12:00'.*DD:HH:MM:SS"),
    ("max_time-keys", _trainer(max_time={"hour": 1}), r"max_time=\{'hour': 1\}"),
    ("max_time-zero", _trainer(max_time="00:00:00:00"), "max_time='00:00:00:00'"),
    ("benchmark", _trainer(benchmark="yes"), "benchmark='yes'"),
    ("detect_anomaly", _trainer(detect_anomaly=1), "detect_anomaly=1"),
    (
        "use_distributed_sampler",
        _trainer(use_distributed_sampler=None),
        "use_distributed_sampler=None",
    ),
    (
        "sync_batchnorm-cpu",
        _trainer(sync_batchnorm=True, accelerator="cpu", devices=2),
        "sync_batchnorm=True is not valid on 2 CPU ranks",
    ),
    (
        "profiler",
        _trainer(profiler="fastest"),
        r"profiler='fastest' is not valid: use one of \['advanced', 'passthrough'",
    ),
    (
        "barebones",
        _trainer(barebones=True, enable_model_summary=True),
        "barebones=True with enable_model_summary=True: barebones switches the model summary off",
    ),
    ("max_steps", _trainer(max_steps=-2), "max_steps=-2"),
    ("accumulate", _trainer(accumulate_grad_batches=0), "accumulate_grad_batches=0"),
    ("clip_val", _trainer(gradient_clip_val=-0.5), "gradient_clip_val=-0.5"),
    ("clip_algo", _trainer(gradient_clip_algorithm="l1"), "gradient_clip_algorithm='l1'"),
    ("val_check_interval", _trainer(val_check_interval=1.5), "val_check_interval=1.5"),
    ("check_val_every", _trainer(check_val_every_n_epoch=0), "check_val_every_n_epoch=0"),
    ("limit_train", _trainer(limit_train_batches=-1), "limit_train_batches=-1"),
    ("limit_val", _trainer(limit_val_batches=2.5), "limit_val_batches=2.5"),
    ("log_every", _trainer(log_every_n_steps=0), "log_every_n_steps=0"),
    ("seed", _trainer(seed="42"), "seed='42'"),
    ("on_nonfinite", _trainer(on_nonfinite="ignore"), "on_nonfinite='ignore'"),
    ("pin_memory", _trainer(pin_memory="yes"), "pin_memory='yes'"),
    (
        "preemption_signals-str",
        _trainer(preemption_signals="SIGTERM"),
        "preemption_signals='SIGTERM'",
    ),
    (
        "preemption_signals-name",
        _trainer(preemption_signals=("SIGFOO",)),
        "preemption_signals contains 'SIGFOO'",
    ),
    (
        "preemption_signals-kill",
        _trainer(preemption_signals=("SIGKILL",)),
        "preemption_signals contains 'SIGKILL'",
    ),
    ("timeout", _trainer(timeout=0), "timeout=0"),
    ("unknown-flag", _trainer(detect_anomally=True), r"unknown arguments \['detect_anomally'\]"),
    ("strategy-name", _trainer(strategy="ddpp"), "strategy='ddpp'"),
    ("strategy-type", _trainer(strategy=3.5), "strategy=3.5"),
    # Callbacks
    ("callback-type", _trainer(callbacks=[object()]), r"callbacks\[0\]=<object object"),
    (
        "callback-not-list",  # one Callback is accepted, as in Lightning; a string is not
        _trainer(callbacks="checkpoint"),
        "callbacks='checkpoint' is not valid",
    ),
    (
        "ckpt-mode",
        lambda p: ls.ModelCheckpoint(monitor="val_loss", mode="maximum"),
        "mode='maximum'",
    ),
    ("ckpt-top-k", lambda p: ls.ModelCheckpoint(save_top_k=-2), "save_top_k=-2"),
    ("ckpt-every", lambda p: ls.ModelCheckpoint(every_n_train_steps=-3), "every_n_train_steps=-3"),
    ("early-mode", lambda p: ls.EarlyStopping(monitor="val_loss", mode="up"), "mode='up'"),
    ("early-patience", lambda p: ls.EarlyStopping(monitor="val_loss", patience=-1), "patience=-1"),
    (
        "ckpt-monitor-never-logged",
        lambda p: _fit(
            p, callbacks=[ls.ModelCheckpoint(monitor="val_acc")], enable_checkpointing=True
        ),
        "monitor='val_acc'",
    ),
    (
        "early-monitor-never-logged",
        lambda p: _fit(
            p,
            callbacks=[ls.EarlyStopping(monitor="val_acc", check_on_train_epoch_end=True)],
            max_epochs=1,
        ),
        "monitor='val_acc'",
    ),
    # Schedulers
    ("sched-interval", lambda p: _with_scheduler(interval="minute")(), "interval='minute'"),
    ("sched-frequency", lambda p: _with_scheduler(frequency=0)(), "frequency=0"),
    (
        "sched-dict-without-scheduler",
        lambda p: _with_scheduler(no_scheduler=True, interval="step")(),
        "lr_scheduler dict without 'scheduler'",
    ),
    (
        "sched-plateau-without-monitor",
        lambda p: _plateau_without_monitor(),
        "ReduceLROnPlateau .*monitor=None",
    ),
    (
        "optimizers-dict-without-optimizer",
        lambda p: parse_optimizers({"lr_scheduler": None}),
        "a dict without 'optimizer'",
    ),
    # self.log values
    (
        "log-string",
        lambda p: _fit(p, LogsBadly("high")),
        r"`self.log\(bad, high\)` was called, but `str` values cannot be logged",
    ),
    (
        "log-vector",
        lambda p: _fit(p, LogsBadly(torch.ones(3))),
        r"self.log\('bad', ...\) got a tensor of shape \(3,\)",
    ),
    (
        "log-list",
        lambda p: _fit(p, LogsBadly([1.0, 2.0])),
        r"`self.log\(bad, \[1.0, 2.0\]\)` was called, but `list` values",
    ),
    (
        "log-none",
        lambda p: _fit(p, LogsBadly(None)),
        r"`self.log\(bad, None\)` was called, but `NoneType` values",
    ),
    # Checkpoints
    (
        "ckpt_path-missing",
        lambda p: _fit(p, ckpt_path=str(p / "nope")),
        "ckpt_path='.*nope' is not valid",
    ),
    (
        "ckpt_path-file",
        lambda p: (p / "w.pt").write_bytes(b"x") and _fit(p, ckpt_path=str(p / "w.pt")),
        "ckpt_path='.*w.pt' is not a lightspeed checkpoint",
    ),
    (
        "ckpt_path-best-unknown",
        lambda p: _fit(p, ckpt_path="best"),
        "ckpt_path='best' is not valid",
    ),
    # DeepSpeed and FSDP configs
    ("ds-stage", lambda p: ls.DeepSpeed(stage=4), "stage=4"),
    ("ds-offload", lambda p: ls.DeepSpeed(offload_optimizer="gpu"), "offload_optimizer='gpu'"),
    (
        "ds-offload-params-stage",
        lambda p: ls.DeepSpeed(stage=2, offload_params="cpu"),
        "offload_params='cpu'",
    ),
    ("ds-nvme-path", lambda p: ls.DeepSpeed(offload_optimizer="nvme"), "nvme_path"),
    (
        "ds-pin",
        lambda p: ls.DeepSpeed(offload_optimizer="cpu", pin_memory="yes"),
        "pin_memory='yes'",
    ),
    (
        "ds-config-missing",
        lambda p: ls.DeepSpeed(config=str(p / "none.json")),
        "config='.*none.json'",
    ),
    (
        "ds-config-json",
        lambda p: ls.DeepSpeed(config=_json_file(p, "{ oops")),
        "ds.json is not valid JSON",
    ),
    (
        "ds-config-list",
        lambda p: ls.DeepSpeed(config=_json_file(p, json.dumps([1]))),
        "must hold a JSON object",
    ),
    (
        "ds-clip-value",
        lambda p: _fit(
            p,
            strategy="deepspeed_stage_2",
            devices=2,
            gradient_clip_val=1.0,
            gradient_clip_algorithm="value",
        ),
        "gradient_clip_algorithm='value'",
    ),
    (
        "ds-deepcompile-value",
        lambda p: ls.DeepSpeed(stage=3, deepcompile="yes"),
        "deepcompile='yes'",
    ),
    (
        "ds-deepcompile-stage",
        lambda p: ls.DeepSpeed(stage=2, deepcompile=True),
        "deepcompile=True needs stage=3",
    ),
    (
        "ds-deepcompile-offload",
        lambda p: ls.DeepSpeed(stage=3, offload_optimizer="cpu", deepcompile=True),
        "without offload",
    ),
    (
        "ds-deepcompile-leaf",
        lambda p: ls.DeepSpeed(stage=3, deepcompile=True, leaf_modules=[torch.nn.Linear]),
        "leaf_modules=.*Linear.* cannot be combined with deepcompile=True",
    ),
    (
        "ds-deepcompile-contradiction",
        lambda p: ls.DeepSpeed(
            stage=3, deepcompile=True, config={"compile": {"deepcompile": False}}
        ),
        "compile.deepcompile=False contradicts",
    ),
    (
        "ds-deepcompile-config-stage",
        lambda p: ls.DeepSpeed(stage=1, config={"compile": {"deepcompile": True}}),
        "deepcompile=True needs stage=3 .*got stage=1",
    ),
    (
        "ds-deepcompile-cpu",
        lambda p: _fit(p, strategy=ls.DeepSpeed(stage=3, deepcompile=True), devices=2),
        "deepcompile=True needs CUDA GPUs.*accelerator is 'cpu'",
    ),
    (
        "ds-deepcompile-and-compile",
        lambda p: _fit(
            p, strategy=ls.DeepSpeed(stage=3, deepcompile=True), devices=2, compile=True
        ),
        r"Trainer\(compile=True\) is not valid with",
    ),
    (
        "fsdp-shard-classes",
        lambda p: ls.FSDP(shard_classes=["Block"]),
        r"shard_classes=\['Block'\]",
    ),
    ("fsdp-reshard", lambda p: ls.FSDP(reshard_after_forward="yes"), "reshard_after_forward='yes'"),
]


@pytest.mark.parametrize("make, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_config_error(tmp_path, make, pattern):
    with pytest.raises(ls.ConfigError, match=pattern):
        make(tmp_path)


def test_catalogue_size():
    assert len(CASES) >= 40
