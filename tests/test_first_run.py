"""What a new user sees on the first run of the README's example (`devices=2`,
`deepspeed_stage_3`, CPU): the model summary, the bar, and a closing line saying why fit stopped and
where the last checkpoint and the run report are; nothing from DeepSpeed's internals (its
accelerator line, its op build note, torch's FutureWarnings on its collectives), and no warning
about a folder the run itself filled. A user's own warnings still show.

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_first_run.py
"""

from __future__ import annotations

import re
from pathlib import Path

from helpers import ROOT, launch

# The README's `train_loader`, which its example leaves to the reader.
LOADER = """import torch
from torch.utils.data import DataLoader, TensorDataset
_x = torch.randn(256, 32, generator=torch.Generator().manual_seed(0))
train_loader = DataLoader(TensorDataset(_x, _x.sum(1, keepdim=True)), batch_size=16)
"""


def _readme_example() -> str:
    readme = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", readme, re.S)
    assert code and 'strategy="deepspeed_stage_3"' in code.group(1) and "devices=2" in code.group(1)
    return LOADER + code.group(1)


def test_readme_example_first_run_output(tmp_path):
    (tmp_path / "train.py").write_text(_readme_example())
    run = launch(["train.py"], tmp_path, "python", nproc=1, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    for noise in (
        "FutureWarning",
        "UserWarning",
        "Setting accelerator to CPU",
        "built successfully",
    ):
        assert noise not in run.stdout + run.stderr, (noise, run.stdout[-2000:], run.stderr[-2000:])
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    # The summary table's block ends with its FLOPs row, then the bar's last state, then the line.
    summary_end = next(i for i, line in enumerate(lines) if line.endswith("Total Flops"))
    assert lines[summary_end - 6].endswith("Trainable params"), lines
    assert set(lines[summary_end - 7]) == {"-"}, lines  # nothing between the table and its totals
    said = lines[-1]
    assert said == (
        "fit stopped after 24 optimizer steps: max_epochs=3 reached. Last checkpoint: "
        "checkpoints/epoch=2-step=24.ckpt; run report: lightning_logs/version_0/report.html"
    ), lines[-3:]
    assert (tmp_path / "lightning_logs" / "version_0" / "report.html").is_file()
    assert (tmp_path / "checkpoints" / "epoch=2-step=24.ckpt").exists()
    assert said not in run.stderr and run.stdout.count("fit stopped after") == 1  # rank 0 only


USER_CODE = """
import warnings

import torch
import torch.distributed as dist
import lightspeed as ls


class Model(ls.LightningModule):
    def configure_model(self):
        self.net = torch.nn.Linear(32, 1)

    def training_step(self, batch, batch_idx):
        if batch_idx == 0:  # the user's own call of the deprecated name, and a warning of theirs
            dist.all_gather_into_tensor(torch.empty(2), torch.ones(1))
            warnings.warn("the user's own warning", UserWarning)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


trainer = ls.Trainer(devices=2, strategy="deepspeed_stage_2", max_steps=3, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Model(), train_loader)
"""


def test_the_users_own_warnings_still_show(tmp_path):
    (tmp_path / "train.py").write_text(LOADER + USER_CODE)
    run = launch(["train.py"], tmp_path, "python", nproc=1, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "`torch.distributed.all_gather_into_tensor` is deprecated" in run.stderr, run.stderr
    assert "UserWarning: the user's own warning" in run.stderr
    assert "reduce_scatter_tensor` is deprecated" not in run.stderr  # DeepSpeed's, gone
    assert (
        run.stdout.strip()
        .splitlines()[-1]
        .startswith(
            "fit stopped after 3 optimizer steps: max_steps=3 reached. No checkpoint written"
        )
    ), run.stdout[-1500:]


def test_closing_line_words():
    from lightspeed.report.closing import closing_line, stop_reason

    assert stop_reason(10, 0, 10, 5, 5, "EarlyStopping(monitor='val_loss') at epoch 0") == (
        "max_steps=10 reached"
    )
    assert stop_reason(7, 2, -1, 5, 5, "EarlyStopping(monitor='val_loss') at epoch 1") == (
        "stopped by EarlyStopping(monitor='val_loss') at epoch 1"
    )
    assert stop_reason(40, 1000, -1, None, 1000, None).startswith("1000 epochs reached")
    outside = str(Path("/") / "elsewhere" / "last.ckpt")
    assert closing_line("max_epochs=2 reached", 8, outside, None) == (
        f"fit stopped after 8 optimizer steps: max_epochs=2 reached. Last checkpoint: {outside}"
    )
