"""Lightning's strategy classes are classes, and Lightning code written against them runs:
`isinstance(trainer.strategy, DeepSpeedStrategy)` also for a strategy given by name, the names
Lightning code reads back (`config`, `zero_stage_3`, `deepspeed_engine`, `model`, the rank names,
`barrier` / `broadcast` / `reduce`), a DeepSpeed config's scheduler in `trainer.lr_scheduler_configs`,
and `training_step(self, batch, i)` under every strategy (FSDP's registered step method used to hide
the user's signature).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_lightning_strategies.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import lightspeed as ls
from helpers import ROOT
from lightspeed.strategies import DDP, DDPStrategy, SingleDevice, ZeRO1, build_strategy


def test_lightning_classes_at_lightnings_module_paths_are_types():
    from lightspeed.strategies import DeepSpeedStrategy as FromPackage
    from lightspeed.strategies.ddp import DDPStrategy as AtDDP
    from lightspeed.strategies.deepspeed import DeepSpeed, DeepSpeedStrategy
    from lightspeed.strategies.fsdp import FSDP, FSDPStrategy

    assert FromPackage is DeepSpeedStrategy and AtDDP is DDPStrategy
    for cls, names, ours in (
        (
            DeepSpeedStrategy,
            ["deepspeed", "deepspeed_stage_1", "deepspeed_stage_3_offload"],
            DeepSpeed,
        ),
        (FSDPStrategy, ["fsdp", "fsdp_grad_op"], FSDP),
        (DDPStrategy, ["ddp", "ddp_sharded", "ddp_find_unused_parameters_true"], DDP),
    ):
        assert isinstance(cls, type)
        for name in names:  # built from a string, as Trainer(strategy=name) builds it
            assert isinstance(build_strategy(name, 2), cls), name
        assert type(cls()) is ours and isinstance(cls(), cls)  # Lightning's keywords -> ours
    assert isinstance(ZeRO1(), DDPStrategy) and not isinstance(SingleDevice(), DDPStrategy)
    assert not isinstance(DDP(), DeepSpeedStrategy)  # no strategy subclasses another
    trainer = ls.Trainer(strategy="deepspeed_stage_3", accelerator="cpu", logger=False)
    assert isinstance(trainer.strategy, DeepSpeedStrategy) and trainer.strategy.zero_stage_3


def test_the_module_and_datamodule_at_lightnings_core_path():
    # `from pytorch_lightning.core import LightningModule` (Lightning's core package exports both)
    import lightspeed as ls
    from lightspeed.core import LightningDataModule, LightningModule

    assert LightningModule is ls.LightningModule and LightningDataModule is ls.LightningDataModule
    with pytest.raises(ImportError, match="Trainer"):  # only what Lightning exports there
        from lightspeed.core import Trainer  # noqa: F401


def test_trainer_accelerator_at_lightnings_path():
    # `isinstance(trainer.accelerator, CUDAAccelerator)` and the class questions Lightning code asks
    import lightspeed as ls
    from lightspeed.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator

    trainer = ls.Trainer(accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.accelerator, CPUAccelerator)
    assert isinstance(trainer.accelerator, Accelerator)
    assert not isinstance(trainer.accelerator, CUDAAccelerator)
    stats = trainer.accelerator.get_device_stats(trainer.device)
    assert set(stats) == {"cpu_vm_percent", "cpu_percent", "cpu_swap_percent"}
    assert CUDAAccelerator.is_available() == torch.cuda.is_available()
    assert CPUAccelerator.get_parallel_devices(2) == [torch.device("cpu")] * 2
    assert CUDAAccelerator.parse_devices("0,2") == [0, 2] and CUDAAccelerator.parse_devices(0) is None
    assert CUDAAccelerator.get_parallel_devices([1]) == [torch.device("cuda", 1)]


def test_single_device_strategy_is_lightnings_and_checks_its_device(tmp_path):
    import lightspeed as ls
    from lightspeed.demos import BoringModel
    from lightspeed.errors import ConfigError
    from lightspeed.strategies import SingleDevice, SingleDeviceStrategy

    strategy = SingleDeviceStrategy(device="cpu")
    assert isinstance(strategy, SingleDevice) and isinstance(SingleDevice(), SingleDeviceStrategy)
    kw = dict(default_root_dir=tmp_path, max_steps=2, logger=False, enable_progress_bar=False)
    trainer = ls.Trainer(accelerator="cpu", strategy=strategy, **kw)
    trainer.fit(BoringModel())
    assert trainer.global_step == 2 and isinstance(trainer.strategy, SingleDeviceStrategy)
    with pytest.raises(ConfigError, match="accelerator='gpu'"):
        ls.Trainer(accelerator="cpu", strategy=SingleDeviceStrategy("cuda:0"), **kw).fit(
            BoringModel()
        )
    with pytest.raises(ConfigError, match="precision_plugin"):
        SingleDeviceStrategy("cpu", precision_plugin=object())


def test_deepspeed_config_reads_as_lightnings(tmp_path, monkeypatch):
    from lightspeed.strategies.deepspeed import DeepSpeedStrategy

    # A config given (or named by PL_DEEPSPEED_CONFIG_PATH) is `.config` unchanged; without one,
    # the ZeRO section; Lightning's keywords add their sections.
    given = {
        "optimizer": {"type": "SGD", "params": {"lr": 3e-5}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
    }
    assert DeepSpeedStrategy(config=given).config == given
    (tmp_path / "ds.json").write_text(json.dumps(given))
    monkeypatch.setenv("PL_DEEPSPEED_CONFIG_PATH", str(tmp_path / "ds.json"))
    assert DeepSpeedStrategy().config == given
    monkeypatch.delenv("PL_DEEPSPEED_CONFIG_PATH")
    assert isinstance(DeepSpeedStrategy().config["zero_optimization"], dict)
    assert ls.DeepSpeed(stage=3).config == {"zero_optimization": {"stage": 3}}
    checkpointing = DeepSpeedStrategy(partition_activations=True, cpu_checkpointing=True).config
    assert checkpointing["activation_checkpointing"] == {
        "partition_activations": True,
        "cpu_checkpointing": True,
    }
    s = DeepSpeedStrategy(stage=3)
    assert (s.zero_stage_3, s.deepspeed_engine, s.model, s.root_device) == (True, None, None, None)
    # Before the Trainer connects it, the rank names describe one process.
    assert (s.world_size, s.global_rank, s.local_rank, s.is_global_zero) == (1, 0, 0, True)
    assert s.broadcast("x") == "x" and s.reduce(torch.tensor(3.0)) == 3.0 and s.barrier() is None


SCRIPT = r"""
import json, sys
sys.path.insert(0, {tests!r})
import torch
import lightspeed as ls
from lightspeed.strategies import DeepSpeedStrategy, FSDPStrategy, DDPStrategy
from test_trainer import regression_data

outs = {{}}


class Step(ls.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def loss(self, batch):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)


class WithI(Step):
    def training_step(self, batch, i):
        assert isinstance(i, int)
        return self.loss(batch)

    def validation_step(self, batch, i):
        assert isinstance(i, int)
        self.log("val", self.loss(batch))


class BatchOnly(Step):
    def training_step(self, batch):
        return self.loss(batch)

    def validation_step(self, batch):
        self.log("val", self.loss(batch))


class BatchNb(Step):
    def training_step(self, batch, batch_nb):
        assert isinstance(batch_nb, int)
        return self.loss(batch)


def trainer(strategy, **kw):
    return ls.Trainer(strategy=strategy, devices=1, accelerator="cpu", logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, **kw)


for name in sys.argv[1:]:  # one strategy after another, in this process
    out = outs[name] = {{"steps": {{}}}}
    for cls in (WithI, BatchOnly, BatchNb):
        t = trainer(name, max_steps=3, limit_val_batches=1)
        t.fit(cls(), regression_data(16), regression_data(8))
        out["steps"][cls.__name__] = t.global_step

    if name.startswith("deepspeed"):
        seen = {{}}

        class Reads(ls.Callback):
            def on_train_start(self, trainer, module):
                s = trainer.strategy
                sched = trainer.lr_scheduler_configs[0]
                seen.update(
                    isinstance=isinstance(s, DeepSpeedStrategy) and not isinstance(s, (FSDPStrategy, DDPStrategy)),
                    zero_stage_3=s.zero_stage_3, engine=s.deepspeed_engine is s.model is trainer.model,
                    engine_type=type(s.model).__name__, micro_batch=s.config["train_micro_batch_size_per_gpu"],
                    scheduler=[type(sched.scheduler).__name__, sched.interval],
                    ranks=[s.world_size, s.global_rank, s.local_rank, s.is_global_zero, str(s.root_device)],
                    module=s.lightning_module is module, broadcast=s.broadcast(7),
                )

        config = {{"optimizer": {{"type": "SGD", "params": {{"lr": 0.1}}}},
                  "scheduler": {{"type": "WarmupLR", "params": {{"warmup_min_lr": 0, "warmup_max_lr": 0.1,
                                                                 "warmup_num_steps": 10}}}}}}
        stage = int(name[-1])
        t = trainer(DeepSpeedStrategy(stage=stage, config=config), max_steps=3, callbacks=[Reads()])
        t.fit(WithI(), regression_data(16))
        sched = t.lr_scheduler_configs[0].scheduler
        seen["after_3"] = [sched.last_batch_iteration, t.optimizers[0].param_groups[0]["lr"], sched.get_lr()[0]]
        t.save_checkpoint(f"ckpt-{{name}}")
        t = trainer(DeepSpeedStrategy(stage=stage, config=config), max_steps=5)
        t.fit(WithI(), regression_data(16), ckpt_path=f"ckpt-{{name}}")
        seen["resumed"] = t.lr_scheduler_configs[0].scheduler.last_batch_iteration
        out["deepspeed"] = seen
print("OUT" + json.dumps(outs), flush=True)
"""

STRATEGIES = [
    "single",
    "ddp",
    "ddp_sharded",
    "fsdp",
    "fsdp_grad_op",
    "deepspeed_stage_1",
    "deepspeed_stage_2",
    "deepspeed_stage_3",
]


@pytest.fixture(scope="module")
def outs(tmp_path_factory) -> dict[str, dict]:
    """SCRIPT run once for every strategy, one after another in one process: name -> its record."""
    tmp = tmp_path_factory.mktemp("lightning_code")
    script = tmp / "lightning_code.py"
    script.write_text(SCRIPT.format(tests=str(ROOT / "tests")))
    proc = subprocess.run(
        [sys.executable, str(script), *STRATEGIES],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT / "src"),
            "OMP_NUM_THREADS": "1",
            "DS_ACCELERATOR": "cpu",
        },
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("OUT")), None)
    assert proc.returncode == 0 and line, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(line[3:])


@pytest.mark.parametrize("name", STRATEGIES)
def test_lightning_code_runs_under_every_strategy(outs, name):
    """`training_step(self, batch, i)`, `(self, batch)` and `(self, batch, batch_nb)` train under
    every strategy (one process, a group of one; the strategies one after another); under
    DeepSpeed, Lightning's names read back and a config's WarmupLR is stepped by the loop once per
    optimizer step (as DeepSpeed would), listed in `lr_scheduler_configs` with interval "step", and
    resumed from a checkpoint."""
    out = outs[name]
    assert out["steps"] == {"WithI": 3, "BatchOnly": 3, "BatchNb": 3}
    if name.startswith("deepspeed"):
        seen = out["deepspeed"]
        assert {k: seen[k] for k in ("isinstance", "engine", "module", "broadcast")} == {
            "isinstance": True,
            "engine": True,
            "module": True,
            "broadcast": 7,
        }
        assert seen["zero_stage_3"] is (name == "deepspeed_stage_3")
        assert seen["engine_type"] == "DeepSpeedEngine" and seen["micro_batch"] == 4
        assert seen["scheduler"] == ["WarmupLR", "step"]
        assert seen["ranks"] == [1, 0, 0, True, "cpu"]
        steps, lr, scheduled = seen["after_3"]
        assert steps == 2 and lr == pytest.approx(scheduled)  # -1 at the start, +1 per step
        assert seen["resumed"] == 4
