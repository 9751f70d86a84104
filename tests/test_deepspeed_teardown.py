"""A failed DeepSpeed Trainer leaves its process clean: the next Trainer in the same process trains.

The failed Trainer's teardown destroys the process group at once (a successful one leaves it at
exit, shared), and DeepSpeed caches the groups it met (its world and data-parallel groups); the next
Trainer joined a new group while DeepSpeed's engine broadcast on the destroyed one: "Group ... is
not registered". One process, world size 1, each stage; the script runs in a process of its own, so
DeepSpeed's global state never reaches the test process.
"""

from __future__ import annotations

import pytest

from helpers import launch

SCRIPT = """
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

import lightspeed as L
from lightspeed.errors import ConfigError


class Net(L.LightningModule):
    def __init__(self, fail: bool):
        super().__init__()
        self.fail = fail
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        loss = self.lin(batch[0]).pow(2).mean()
        self.log("loss", loss)
        return None if self.fail else loss  # None: a ConfigError once the group and the engine exist

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(fail: bool):
    L.seed_everything(0)
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=sys.argv[1], max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net(fail), DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))
    return trainer


try:
    fit(fail=True)
except ConfigError as e:
    print("first:", type(e).__name__)
second = fit(fail=False)
print(f"second: global_step={second.global_step} loss={float(second.callback_metrics['loss']):.6f}")
"""


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3"])
def test_failed_trainer_leaves_the_process_clean(tmp_path, strategy):
    (tmp_path / "two_trainers.py").write_text(SCRIPT)
    run = launch([str(tmp_path / "two_trainers.py"), strategy], tmp_path, nproc=1)
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert "first: ConfigError" in run.stdout and "second: global_step=2 loss=" in run.stdout, (
        run.stdout[-2000:]
    )
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
