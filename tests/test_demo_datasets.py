"""lightspeed.demos' language models (LSTM, transformer on WikiText2) and MNIST, offline.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_demo_datasets.py

This machine has no internet, which is the case under test: every dataset here falls back to its
synthetic stand-in, with a warning naming the address that failed. Each test runs in its own
tmp_path (the demos read and write ./data, as Lightning's do).
"""

from __future__ import annotations

import importlib
import math
import subprocess
import sys
import textwrap
import warnings
from typing import Any

import pytest
import torch

import lightspeed
from lightspeed.demos import _download

QUIET: dict[str, Any] = dict(
    accelerator="cpu",
    devices=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)


@pytest.fixture(autouse=True)
def _fresh_data_dir(tmp_path, monkeypatch):
    """Each test in its own ./data, with no memory of earlier failed downloads."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_download, "_MISSING", set())
    monkeypatch.setattr(_download, "_FAILED", set())


@pytest.mark.parametrize(
    "module, names",
    [
        (
            "lightspeed.demos",
            "BoringModel BoringDataModule DemoModel LightningLSTM SequenceSampler SimpleLSTM "
            "LightningTransformer Transformer WikiText2",
        ),
        ("lightspeed.demos.mnist_datamodule", "MNIST MNISTDataModule"),
        ("lightspeed.demos.transformer", "LightningTransformer Transformer WikiText2"),
        ("lightspeed.demos.lstm", "LightningLSTM SequenceSampler SimpleLSTM"),
    ],
)
def test_names_import_from_lightnings_paths(module, names):
    imported = importlib.import_module(module)
    for name in names.split():
        assert hasattr(imported, name), f"{module}.{name}"


def test_mnist_offline_is_synthetic_deterministic_and_shaped(tmp_path):
    from lightspeed.demos.mnist_datamodule import MNIST, MNISTDataModule

    with pytest.warns(UserWarning, match=r"could not download https://pl-public-data.*SYNTHETIC"):
        train = MNIST(tmp_path, train=True)
    test = MNIST(tmp_path, train=False, download=False, normalize=None)
    assert (len(train), len(test)) == (60000, 10000)
    image, label = train[123]
    assert image.shape == (1, 28, 28) and image.dtype == torch.float32
    assert isinstance(label, int) and 0 <= label < 10
    assert 0.0 <= float(test[0][0].min()) and float(test[0][0].max()) <= 1.0
    # the same index gives the same item, in this dataset and in a new one
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the miss was reported once already: no second warning
        again = MNIST(tmp_path, train=True)
    assert torch.equal(again[123][0], image) and again[123][1] == label
    assert not torch.equal(train[124][0], image)
    assert sorted({train[i][1] for i in range(200)}) == list(range(10))
    # a transform is handed a PIL image, as torchvision's MNIST hands it
    pil = MNIST(tmp_path, train=True, transform=lambda img: img)[123][0]
    assert pil.size == (28, 28) and pil.mode == "L"

    datamodule = MNISTDataModule(data_dir=str(tmp_path), num_workers=0, batch_size=8)
    datamodule.prepare_data()
    datamodule.setup("fit")
    images, labels = next(iter(datamodule.train_dataloader()))
    assert images.shape == (8, 1, 28, 28) and labels.shape == (8,) and labels.dtype == torch.int64
    assert len(datamodule.dataset_train) == 55000 and len(datamodule.dataset_val) == 5000


def test_wikitext2_offline_blocks():
    from lightspeed.demos import WikiText2

    with pytest.warns(UserWarning, match=r"does not exist \(download=False\).*SYNTHETIC"):
        offline = WikiText2(download=False)
    # download=False did not stop a later download=True from trying
    with pytest.warns(UserWarning, match=r"could not download https://raw.githubusercontent.*"):
        dataset = WikiText2(block_size=35)
    inputs, target = dataset[7]
    assert inputs.shape == target.shape == (35,) and inputs.dtype == torch.int64
    assert torch.equal(inputs[1:], target[:-1])  # the target is the input one token on
    assert len(dataset) == len(dataset.data) // 35 - 1 > 4000  # Lightning's example holds 4000
    assert dataset.vocab_size == 1001 and int(dataset.data.max()) < dataset.vocab_size
    assert torch.equal(offline.data, dataset.data)


class _Losses(lightspeed.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def test_lightning_transformer_and_lstm_fit_two_steps():
    from lightspeed.demos import LightningLSTM, LightningTransformer

    for model in (LightningTransformer(), LightningLSTM()):
        torch.manual_seed(0)
        recorder = _Losses()
        trainer = lightspeed.Trainer(max_steps=2, callbacks=[recorder], **QUIET)
        trainer.fit(model)
        assert trainer.global_step == 2 and len(recorder.losses) == 2
        # a fresh model predicts about uniformly over 33278 words: loss near log(33278) = 10.4
        assert all(math.isfinite(loss) and 8 < loss < 13 for loss in recorder.losses)
    assert math.isfinite(float(trainer.callback_metrics["train_loss"]))  # LSTM logs it


SCRIPT = """
import torch
from torch.utils.data import DataLoader

import lightspeed as L
from lightspeed.demos import Transformer, WikiText2
from lightspeed.demos.mnist_datamodule import MNISTDataModule


class LanguageModel(L.LightningModule):
    def __init__(self, vocab_size):
        super().__init__()
        self.model = Transformer(vocab_size=vocab_size, ninp=32, nhid=32, nlayers=1)

    def training_step(self, batch, batch_idx):
        input, target = batch
        loss = torch.nn.functional.nll_loss(self.model(input, target), target.view(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


L.seed_everything(42)
dataset = WikiText2()
trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(LanguageModel(dataset.vocab_size), DataLoader(dataset, batch_size=20))
print("LOSS", float(trainer.callback_metrics["train_loss"]))
datamodule = MNISTDataModule(num_workers=0)
datamodule.prepare_data()
datamodule.setup("fit")
images, labels = next(iter(datamodule.train_dataloader()))
print("MNIST", tuple(images.shape), tuple(labels.shape))
"""


def test_script_written_like_lightnings_examples_runs(tmp_path):
    script = tmp_path / "example.py"
    script.write_text(textwrap.dedent(SCRIPT))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    loss = float(result.stdout.split("LOSS ")[1].split()[0])
    assert math.isfinite(loss)
    assert "MNIST (32, 1, 28, 28) (32,)" in result.stdout
    assert "SYNTHETIC WikiText2" in result.stderr and "SYNTHETIC MNIST" in result.stderr
