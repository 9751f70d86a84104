"""What every run records (RunMetrics, on 2 real gloo ranks) and the run report: PNGs opened with
Pillow, the HTML rendered by headless Chromium (skipped, with the reason, where /usr/bin/chromium is
absent).

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_report.py
"""

from __future__ import annotations

import csv
import re
import shutil
import subprocess
import tempfile
import textwrap
from pathlib import Path

import pytest
import yaml

from helpers import launch
from lightspeed.callbacks.run_metrics import RunMetrics
from lightspeed.loggers import CSVLogger
from lightspeed.report.run_report import write_report
from test_trainer import Regress, make_trainer, regression_data

CHROMIUM = Path("/usr/bin/chromium")
BLUE, ORANGE = (31, 119, 180), (255, 127, 14)  # matplotlib's first two line colours (C0, C1)
BATCH, BLOCK = 4, 32  # the tiny GPT's block size

# 2 DDP ranks, the tiny GPT (integer token batches), AdamW with two param groups, validation every 4
# batches.
SCRIPT = textwrap.dedent(
    """
    import sys
    from torch.utils.data import DataLoader
    import lightspeed as ls
    from lightspeed.loggers import CSVLogger
    from lightspeed.callbacks.run_metrics import RunMetrics
    from lightspeed.demos.gpt import SIZES, ByteWindows, GPTModule, stdlib_corpus

    cfg = SIZES["tiny"]
    data = ByteWindows(stdlib_corpus(200_000), cfg.block_size)
    trainer = ls.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=8, log_every_n_steps=2, seed=0,
                         val_check_interval=4, limit_val_batches=2, enable_progress_bar=False,
                         enable_checkpointing=False, default_root_dir=sys.argv[1],
                         logger=[CSVLogger(sys.argv[1])], callbacks=[RunMetrics()])
    trainer.fit(GPTModule(cfg, lr=1e-3), DataLoader(data, batch_size=%d, shuffle=True, drop_last=True),
                DataLoader(data, batch_size=%d))
"""
    % (BATCH, BATCH)
)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("run")
    (tmp / "train.py").write_text(SCRIPT)
    run = launch([str(tmp / "train.py"), str(tmp)], tmp, "python", nproc=1)
    assert run.returncode == 0, run.stderr[-4000:]
    return tmp / "lightning_logs" / "version_0"


def _rows(run_dir: Path) -> list[dict]:
    with (run_dir / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


def test_every_run_records_lr_throughput_memory_per_rank_and_settings(run_dir):
    rows = [r for r in _rows(run_dir) if r["samples_per_s"]]
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    for r in rows:
        assert float(r["lr-AdamW/pg1"]) == float(r["lr-AdamW/pg2"]) == 1e-3 and r["epoch"] == "0"
        # Samples per step = micro-batch × world size; tokens per sample = the block size.
        assert float(r["samples_per_s"]) * float(r["step_time_s"]) == pytest.approx(
            BATCH * 2, rel=1e-9
        )
        assert float(r["tokens_per_s"]) == pytest.approx(
            float(r["samples_per_s"]) * BLOCK, rel=1e-9
        )
        assert (
            0.1 < float(r["peak_memory_gib/rank0"]) < 8
            and 0.1 < float(r["peak_memory_gib/rank1"]) < 8
        )
    all_rows = _rows(run_dir)
    # The loop logs the grad norm that strategy.step() returned, at the same log steps.
    norms = [(int(r["step"]), float(r["grad_norm"])) for r in all_rows if r.get("grad_norm")]
    assert [s for s, _ in norms] == [2, 4, 6, 8] and all(0 < n < 1e3 for _, n in norms)
    assert sum(1 for r in all_rows if r["val_loss"]) == 2 and any(r["fit_time_s"] for r in all_rows)
    settings = yaml.safe_load((run_dir / "run.yaml").read_text())
    assert (settings["strategy"], settings["world_size"], settings["device"]) == ("ddp", 2, "cpu")
    assert settings["trainer"]["val_check_interval"] == 4 and settings["parameters"] > 0
    assert (run_dir / "report.html").exists()  # written by RunMetrics at fit end


def test_grad_norm_comes_from_the_strategy_step(tmp_path):
    logger = CSVLogger(tmp_path)
    trainer = make_trainer(
        tmp_path,
        max_steps=4,
        log_every_n_steps=2,
        logger=[logger],
        callbacks=[RunMetrics(report=False)],
        gradient_clip_val=0.5,
    )
    trainer.fit(Regress(), regression_data())
    rows = _rows(Path(logger.log_dir))
    norms = [(r["step"], float(r["grad_norm"])) for r in rows if r.get("grad_norm")]
    # The norm before clipping, as Lightning logs it: above the clip value on this regression's
    # first steps.
    assert [s for s, _ in norms] == ["2", "4"] and all(n > 0.5 for _, n in norms), norms
    samples = [r for r in rows if r["samples_per_s"]]
    # A batch of float features has samples but no tokens: no tokens_per_s column.
    assert "tokens_per_s" not in samples[0] and float(samples[0]["samples_per_s"]) > 0


def _colour_count(image, rgb: tuple[int, int, int], tolerance: int = 12) -> int:
    return sum(
        n
        for n, c in image.getcolors(maxcolors=2**24)
        if all(abs(a - b) <= tolerance for a, b in zip(c, rgb))
    )


def test_pngs_open_and_show_their_lines(run_dir):
    from PIL import Image

    write_report(run_dir)
    for name in ("loss.png", "throughput.png", "memory.png"):
        with Image.open(run_dir / name) as im:
            im.verify()  # a complete, valid PNG
        with Image.open(run_dir / name) as im:
            rgb = im.convert("RGB")
            assert rgb.size == (700, 360) and len(rgb.getcolors(maxcolors=2**24)) > 50, name
            # Two lines each: train and val loss; samples and tokens/s; rank 0 and rank 1.
            assert _colour_count(rgb, BLUE) > 100 and _colour_count(rgb, ORANGE) > 30, name


def test_html_renders_its_images_in_chromium(run_dir, tmp_path):
    if not CHROMIUM.exists():
        pytest.skip(
            "needs /usr/bin/chromium (Debian: apt-get install -y chromium; `make test` tries to)"
        )
    from PIL import Image

    html = write_report(run_dir)
    text = html.read_text()
    assert text.count("<img") == 3 and not re.search(
        r"src=\"(?!data:image/png;base64,)", text
    )  # self-contained
    alone = tmp_path / "report.html"  # away from the PNGs: the page must not need them
    shutil.copy(html, alone)
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [
                str(CHROMIUM),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                f"--screenshot={shot}",
                "--window-size=900,2600",
                alone.as_uri(),
            ],
            capture_output=True,
            timeout=120,
            check=True,
        )
    with Image.open(shot) as im:
        page = im.convert("RGB")
    assert len(page.getcolors(maxcolors=2**24)) > 100  # not a blank page
    for name in ("loss.png", "throughput.png", "memory.png"):  # each chart drawn, pixel for pixel
        with Image.open(run_dir / name) as im:
            assert _where(page, im.convert("RGB")) is not None, (
                f"{name} is not on the rendered page"
            )


def _where(page, image) -> tuple[int, int] | None:
    """Where `image` appears in `page` (99% of its pixels within 2 levels), or None."""
    import numpy as np

    big, small = (np.asarray(i, dtype=np.int16) for i in (page, image))
    h, w, _ = small.shape
    middle = small[h // 2]
    for x in range(
        big.shape[1] - w + 1
    ):  # find the image's middle row, then compare the whole image
        rows = big[h // 2 : big.shape[0] - h + h // 2 + 1, x : x + w]  # row y + h/2 for each top y
        for y in np.nonzero((np.abs(rows - middle) <= 2).all(axis=(1, 2)))[0]:
            if (np.abs(big[y : y + h, x : x + w] - small) <= 2).mean() > 0.99:
                return x, int(y)
    return None


def test_summary_shows_the_measured_data_wait():
    """`data_wait` (logged at fit end on CUDA, data.DataWait) appears in the report's summary as a
    share."""
    from lightspeed.report.run_report import _summary

    rows = _summary({"data_wait": [(60, 0.34)], "fit_time_s": [(60, 12.5)]}, {})
    assert rows["GPU waiting for data"] == "34%" and rows["fit time"] == "12.5 s"
