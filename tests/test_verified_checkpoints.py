"""Verified checkpoints: a .ckpt file's zip records carry their CRC-32s (a directory's meta.json
records each file's); `verify(path, full=True)` names a record or file whose bytes changed; a
missing optimizer state is an error; a damaged file of a DeepSpeed or DCP checkpoint is named by
its checksum before the engine reads it (every byte a resume reads is checked:
tests/test_checksummed_resume.py).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_verified_checkpoints.py
"""

from __future__ import annotations

import shutil
import zipfile
import zlib
from pathlib import Path

import pytest
import torch

import lightspeed as ls
from helpers import run_workload
from lightspeed.checkpoint.checkpointer import verify
from test_trainer import Regress, make_trainer, regression_data


def _flip(file: Path, at: float = 0.98) -> None:
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


def _flip_record(file: Path, record: str) -> None:
    """One bit flipped in the bytes of one zip record (its data, not its headers)."""
    with zipfile.ZipFile(file) as z:
        info = z.getinfo(record)
    data = bytearray(file.read_bytes())
    head = info.header_offset
    start = head + 30 + int.from_bytes(data[head + 26 : head + 28], "little")
    start += int.from_bytes(data[head + 28 : head + 30], "little")
    data[start + info.file_size // 2] ^= 0x10
    file.write_bytes(bytes(data))


@pytest.fixture
def saved(tmp_path) -> Path:
    make_trainer(tmp_path, max_steps=3, enable_checkpointing=True).fit(Regress(), regression_data())
    return (tmp_path / "checkpoints" / "last.ckpt").resolve()


def test_each_record_carries_its_crc32(saved):
    # Lightning's file is torch's zip archive: each record holds the CRC-32 of its bytes.
    with zipfile.ZipFile(saved) as z:
        infos = z.infolist()
        assert len(infos) > 4
        for info in infos:
            assert zlib.crc32(z.read(info)) == info.CRC
    verify(saved)


def test_flipped_bit_in_weights_is_named_by_full_verify(saved):
    _flip_record(saved, "archive/data/0")  # the first tensor's bytes: a weight
    verify(saved, full=False)  # the zip directory still reads: the cheap check cannot see it
    with pytest.raises(
        ls.ConfigError,
        match=r"\.ckpt is corrupt: the CRC-32 of its record 'archive/data/0' differs",
    ):
        verify(saved, full=True)


def test_flipped_bit_stops_the_resume(saved, tmp_path):
    _flip_record(saved, "archive/data.pkl")  # the pickled dict: loop state, hyper-parameters
    with pytest.raises(ls.ConfigError, match=r"record 'archive/data\.pkl' differs .* on rank 0\)"):
        make_trainer(tmp_path, max_steps=4).fit(Regress(), regression_data(), ckpt_path=saved)


def test_missing_optimizer_state_is_an_error(saved, tmp_path):
    ckpt = torch.load(saved, weights_only=True)
    del ckpt["optimizer_states"]  # as Lightning's save_weights_only writes it
    weights_only = tmp_path / "weights-only.ckpt"
    torch.save(ckpt, weights_only)
    with pytest.raises(ls.ConfigError, match=r"has no optimizer_states \(saved with weights only"):
        make_trainer(tmp_path, max_steps=4).fit(
            Regress(), regression_data(), ckpt_path=weights_only
        )
    # Evaluation needs the weights alone.
    make_trainer(tmp_path).validate(Regress(), regression_data(), ckpt_path=weights_only)


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
        / f"epoch=0-step={RESUME_AT}.ckpt"
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
