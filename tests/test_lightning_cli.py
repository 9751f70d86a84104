"""LightningCLI (lightspeed.cli) as a user meets it: a training script driven by a YAML config
and command-line overrides, `--print_config` round trips, `run=False`, subclass mode, the
optimizer and scheduler groups, the saved config (and its refusal to overwrite), `--ckpt_path`
hyper-parameters, and the same script on 2 CPU ranks under DDP and DeepSpeed ZeRO-2 (gloo; the
Trainer re-runs the script for rank 1, which parses the same command line). Real runs; nothing
is mocked.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_lightning_cli.py
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
MODULE = "cli_train_script"  # the script's name: in-process tests import it, subclass mode names it

SCRIPT = '''
"""A tiny regression trained through LightningCLI; after fit, each rank writes what it ran to
$RESULT.<rank>.json."""
import json
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as ls
from lightspeed.cli import LightningCLI


class Net(ls.LightningModule):
    def __init__(self, hidden: int = 8, lr: float = 0.05, batch_size: int = 4):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Data(ls.LightningDataModule):
    def __init__(self, batch_size: int = 4, samples: int = 64):
        super().__init__()
        self.batch_size, self.samples = batch_size, samples

    def train_dataloader(self):
        x = torch.randn(self.samples, 4, generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=self.batch_size)


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser):
        parser.link_arguments("data.batch_size", "model.batch_size")

    def before_fit(self):
        self.hooks = ["before_fit"]

    def after_fit(self):
        self.hooks.append("after_fit")
        trainer, config = self.trainer, self.config.fit
        optimizer = trainer.optimizers[0]
        result = dict(
            hooks=self.hooks, global_step=trainer.global_step, world_size=trainer.world_size,
            strategy=config.trainer.strategy, hparams=dict(self.model.hparams),
            data_batch_size=self.datamodule.batch_size, seed=config.seed_everything,
            lr=optimizer.param_groups[0]["lr"], log_dir=str(trainer.log_dir),
            checksum=sum(float(p.detach().double().sum()) for p in self.model.parameters()),
        )
        with open(f"{os.environ['RESULT']}.{trainer.global_rank}.json", "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    CLI(Net, Data)
'''

CONFIG = {
    "trainer": {
        "max_steps": 100,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "accelerator": "cpu",
        "enable_checkpointing": False,
        "log_every_n_steps": 1,
    },
    "model": {"hidden": 6, "lr": 0.05},
    "data": {"batch_size": 8},
    "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.2}},
}


@pytest.fixture(scope="module")
def script_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli_script")
    (folder / f"{MODULE}.py").write_text(SCRIPT)
    (folder / "cfg.yaml").write_text(yaml.safe_dump(CONFIG))
    return folder


@pytest.fixture
def script(script_dir, monkeypatch, tmp_path):
    """The script imported in this process, in a clean cwd, with an empty command line."""
    monkeypatch.syspath_prepend(str(script_dir))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    return importlib.import_module(MODULE)


def _train(script_dir: Path, out: Path, *args: str, timeout: float = 240) -> list[dict]:
    """Runs the script with `args` in `out`; returns each rank's result."""
    proc = subprocess.run(
        [sys.executable, str(script_dir / f"{MODULE}.py"), *args],
        cwd=out,
        env={**ENV, "RESULT": str(out / "result")},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    files = sorted(out.glob("result.*.json"))
    return [json.loads(f.read_text()) for f in files]


def _printed(capsys, cli_factory) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_factory()
    assert exit_info.value.code in (0, None)
    return capsys.readouterr().out


def test_fit_from_a_config_file_with_overrides(script_dir, tmp_path):
    [r] = _train(
        script_dir,
        tmp_path,
        "fit",
        "--config",
        str(script_dir / "cfg.yaml"),
        "--trainer.max_steps=5",
        "--model.hidden=5",
        "--seed_everything=7",
    )
    # The command line wins over the file, the file over the defaults; data.batch_size is linked
    # to model.batch_size; --optimizer replaced the model's configure_optimizers (lr 0.2, not 0.05).
    assert (
        r["global_step"] == 5 and r["world_size"] == 1 and r["hooks"] == ["before_fit", "after_fit"]
    )
    assert r["hparams"] == {"hidden": 5, "lr": 0.05, "batch_size": 8} and r["data_batch_size"] == 8
    assert r["lr"] == pytest.approx(0.2) and r["seed"] == 7
    saved = yaml.safe_load((Path(tmp_path, r["log_dir"]) / "config.yaml").read_text())
    assert saved["trainer"]["max_steps"] == 5 and saved["model"]["hidden"] == 5
    assert saved["seed_everything"] == 7 and saved["optimizer"]["init_args"]["lr"] == 0.2


def test_print_config_round_trips(script, script_dir, tmp_path, capsys):
    args = [
        "fit",
        "--config",
        str(script_dir / "cfg.yaml"),
        "--trainer.max_steps=3",
        "--lr_scheduler=StepLR",
        "--lr_scheduler.step_size=2",
        "--print_config",
    ]
    first = _printed(capsys, lambda: script.CLI(script.Net, script.Data, args=args))
    printed = yaml.safe_load(first)
    assert printed["trainer"]["max_steps"] == 3 and printed["model"]["hidden"] == 6
    assert printed["lr_scheduler"]["class_path"] == "torch.optim.lr_scheduler.StepLR"
    assert printed["ckpt_path"] is None and first.startswith("# lightspeed==")
    (tmp_path / "printed.yaml").write_text(first)
    again = ["fit", "--config", str(tmp_path / "printed.yaml"), "--print_config"]
    assert _printed(capsys, lambda: script.CLI(script.Net, script.Data, args=again)) == first


@pytest.mark.filterwarnings("ignore:`Net.configure_optimizers` will be overridden")
def test_run_false_builds_without_running_then_saves_the_config_once(script, tmp_path):
    from lightspeed import Trainer
    from lightspeed.cli import LightningCLI, SaveConfigCallback

    args = [
        "--trainer.max_steps=2",
        "--trainer.logger=false",
        "--data.batch_size=16",
        "--model.hidden=5",
        "--optimizer=Adam",
        "--optimizer.lr=0.01",
        "--lr_scheduler=StepLR",
        "--lr_scheduler.step_size=3",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    defaults = {"enable_progress_bar": False, "enable_model_summary": False, "accelerator": "cpu"}
    with pytest.warns(UserWarning, match="configure_optimizers` will be overridden"):
        cli = LightningCLI(script.Net, script.Data, run=False, args=args, trainer_defaults=defaults)
    assert cli.subcommand is None and isinstance(cli.trainer, Trainer)
    assert isinstance(cli.model, script.Net) and cli.datamodule.batch_size == 16
    assert cli.trainer.max_steps == 2 and cli.trainer.global_step == 0
    [optimizer], [scheduler] = cli.model.configure_optimizers()
    assert isinstance(optimizer, torch.optim.Adam) and optimizer.param_groups[0]["lr"] == 0.01
    assert scheduler.step_size == 3
    assert not (tmp_path / "config.yaml").exists()  # nothing ran, nothing saved
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2 and isinstance(cli.trainer.optimizers[0], torch.optim.Adam)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["data"]["batch_size"] == 16
    # A second run in the same folder refuses to overwrite it, unless told to.
    again = LightningCLI(script.Net, script.Data, run=False, args=args, trainer_defaults=defaults)
    with pytest.raises(RuntimeError, match="Aborting to avoid overwriting"):
        again.trainer.fit(again.model, datamodule=again.datamodule)
    kwargs = dict(save_config_kwargs={"overwrite": True}, trainer_defaults=defaults)
    third = LightningCLI(script.Net, script.Data, run=False, args=args, **kwargs)
    third.trainer.fit(third.model, datamodule=third.datamodule)
    assert any(
        isinstance(c, SaveConfigCallback) and c.already_saved for c in third.trainer.callbacks
    )

    class Probe(LightningCLI):  # a method named like a subcommand replaces the Trainer's
        def predict(self, **kwargs):
            self.called_with = kwargs

    # --ckpt_path: the model is rebuilt with the hyper-parameters saved in the checkpoint.
    ckpt = tmp_path / "checkpoints"
    probe = Probe(script.Net, script.Data, args=["predict", f"--ckpt_path={ckpt}"])
    assert probe.model.hparams.hidden == 5 and probe.config.predict.model.hidden == 5
    assert probe.called_with["ckpt_path"] == str(ckpt) and probe.called_with["model"] is probe.model


def test_subclass_mode_picks_classes_by_path(script, capsys):
    from lightspeed.cli import LightningCLI

    args = [
        f"--model={MODULE}.Net",
        "--model.hidden=3",
        f"--data={MODULE}.Data",
        "--data.samples=32",
        "--trainer.logger=false",
        "--seed_everything=false",
    ]
    cli = LightningCLI(run=False, args=args)
    assert type(cli.model) is script.Net and cli.model.hparams.hidden == 3
    assert type(cli.datamodule) is script.Data and cli.datamodule.samples == 32
    assert cli.config.model.class_path == f"{MODULE}.Net" and cli.config.seed_everything is False
    printed = yaml.safe_load(
        _printed(capsys, lambda: LightningCLI(args=["fit", *args, "--print_config"]))
    )
    assert printed["model"] == {
        "class_path": f"{MODULE}.Net",
        "init_args": {"hidden": 3, "lr": 0.05, "batch_size": 4},
    }
    # A dict (or Namespace) instead of a command line; the datamodule is optional.
    cli = LightningCLI(
        run=False, args={"model": {"class_path": f"{MODULE}.Net"}, "trainer": {"logger": False}}
    )
    assert type(cli.model) is script.Net and cli.datamodule is None
    with pytest.raises(SystemExit):  # a model that is not a LightningModule subclass
        LightningCLI(run=False, args=["--model=torch.nn.Linear"])


# The CLI hands the strategy's name to the Trainer; the rank-1 start, the seed passed on and the
# saved config are the same under both: ddp's cell covers them (DeepSpeed's engine on 2 ranks:
# tests/test_deepspeed.py), ZeRO-2's is slow.
@pytest.mark.parametrize(
    "strategy", ["ddp", pytest.param("deepspeed_stage_2", marks=pytest.mark.slow)]
)
def test_two_cpu_ranks(script_dir, tmp_path, strategy):
    ranks = _train(
        script_dir,
        tmp_path,
        "fit",
        "--config",
        str(script_dir / "cfg.yaml"),
        f"--trainer.strategy={strategy}",
        "--trainer.devices=2",
        "--trainer.max_steps=3",
    )
    assert len(ranks) == 2 and [r["world_size"] for r in ranks] == [2, 2]
    assert [r["global_step"] for r in ranks] == [3, 3] and ranks[0]["strategy"] == strategy
    assert ranks[0]["seed"] == ranks[1]["seed"]  # a random seed, passed on to rank 1
    assert ranks[0]["checksum"] == pytest.approx(ranks[1]["checksum"], rel=1e-6)  # in sync
    saved = yaml.safe_load((Path(tmp_path, ranks[0]["log_dir"]) / "config.yaml").read_text())
    assert saved["trainer"]["strategy"] == strategy and saved["trainer"]["devices"] == 2
