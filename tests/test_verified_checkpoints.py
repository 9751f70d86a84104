"""Verified checkpoints: meta.json records each file's size and CRC-32; `verify(path, full=True)`
names a file whose bytes changed; a missing optimizer state is an error; a damaged file of a
DeepSpeed or DCP checkpoint is named by its checksum before the engine reads it (every byte a resume
reads is checked: tests/test_checksummed_resume.py).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_verified_checkpoints.py
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path

import pytest

import lightspeed as ls
from helpers import run_workload
from lightspeed.checkpoint.checkpointer import verify
from test_trainer import Regress, make_trainer, regression_data


def _flip(file: Path, at: float = 0.98) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path) -> Path:
    make_trainer(tmp_path, max_steps=3, enable_checkpointing=True).fit(Regress(), regression_data())
    return (tmp_path / "checkpoints" / "last").resolve()


def test_meta_records_size_and_crc32(saved):
    files = json.loads((saved / "meta.json").read_text())["files"]
    for name, entry in files.items():
        data = (saved / name).read_bytes()
        assert entry == {"size": len(data), "crc32": zlib.crc32(data)}
    verify(saved)


def test_flipped_bit_in_weights_is_named_by_full_verify(saved):
    _flip(saved / "model.safetensors")
    verify(saved, full=False)  # sizes and headers still match: the cheap check cannot see it
    with pytest.raises(ls.ConfigError, match=r"model\.safetensors is corrupt: its CRC-32 differs"):
        verify(saved, full=True)


def test_missing_optimizer_state_is_an_error(saved, tmp_path):
    (saved / "optimizer.pt").unlink()
    with pytest.raises(ls.ConfigError, match=r"optimizer\.pt is truncated or corrupt \(missing\)"):
        make_trainer(tmp_path, max_steps=4).fit(Regress(), regression_data(), ckpt_path=saved)
    meta = json.loads((saved / "meta.json").read_text())  # even when meta.json does not list it
    del meta["files"]["optimizer.pt"]
    (saved / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        ls.ConfigError, match=r"has no optimizer\.pt: resuming needs the optimizer state"
    ):
        make_trainer(tmp_path, max_steps=4).fit(Regress(), regression_data(), ckpt_path=saved)


@pytest.mark.parametrize(
    "strategy, victim", [("deepspeed_stage_2", "mp_rank_00_model_states.pt"), ("fsdp", ".metadata")]
)
def test_damage_engines_would_fail_on_is_named_first(tmp_path, shared_run, strategy, victim):
    # A copy of the step-15 checkpoint of tests/test_strategies.py's 2-rank run (made once per
    # session).
    from test_strategies import RESUME_AT, conformance_run

    saved = (
        shared_run(**conformance_run(strategy))["root"]
        / "checkpoints"
        / f"epoch=0-step={RESUME_AT}"
    )
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    file = next(p for p in ckpt.rglob(victim))
    # Same size, damaged content: passes the cheap pre-launch check; the checksums catch it before
    # the engine (which would fail on it) reads it.
    data = bytearray(file.read_bytes())
    data[: len(data) // 2] = bytes(len(data) // 2)
    file.write_bytes(bytes(data))
    run = run_workload(
        tmp_path,
        devices=2,
        strategy=strategy,
        batch_size=2,
        accumulate=2,
        max_steps=RESUME_AT + 2,
        resume=str(ckpt),
        check=False,
    )
    assert run.returncode != 0
    assert f"ConfigError: checkpoint file {file} is corrupt: its CRC-32 differs" in run.stderr, (
        run.stderr[-3000:]
    )
