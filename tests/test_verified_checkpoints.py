"""Verified checkpoints: a .ckpt file's zip records carry their CRC-32s (a directory's meta.json
records each file's xxh3_64, or the CRC-32 of a checkpoint written before); `verify(path,
full=True)` names a record or file whose bytes changed; a changed tensor byte, checked beside the
load, stops the resumed fit before it saves a checkpoint or ends; a missing optimizer state is an
error; a damaged file of a DeepSpeed or DCP checkpoint is named by its checksum, before the engine
reads it or, where the engine fails on bytes checked beside the load, instead of the engine's error
(every byte a resume reads is checked: tests/test_checksummed_resume.py).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_verified_checkpoints.py
"""

from __future__ import annotations

import json
import shutil
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
import xxhash
from safetensors.torch import save_file

import lightspeed as ls
from helpers import run_workload
from lightspeed.checkpoint.checkpointer import verify
from lightspeed.checkpoint.locate import FORMAT
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


@pytest.mark.parametrize("enable_checkpointing", [True, False])
def test_flipped_tensor_byte_stops_the_fit_before_it_saves_or_ends(
    saved, tmp_path, enable_checkpointing
):
    # A tensor record is checked beside the load: the resumed fit trains on the changed weight,
    # then stops at its first save (ModelCheckpoint's, at the end) or, saving nothing, at fit's end.
    _flip_record(saved, "archive/data/0")
    out = tmp_path / "resumed"
    trainer = make_trainer(out, max_steps=5, enable_checkpointing=enable_checkpointing)
    with pytest.raises(
        ls.ConfigError,
        match=r"record 'archive/data/0' differs .* on rank 0\)\. No other checkpoint",
    ):
        trainer.fit(Regress(), regression_data(), ckpt_path=saved)
    assert not list(out.rglob("*.ckpt")), list(out.rglob("*"))


@pytest.mark.parametrize("algorithm", ["xxh3_64", "crc32"])
def test_directory_sums_of_either_algorithm_verify(tmp_path, algorithm):
    # meta.json names each file's sum by its algorithm: xxh3_64 (hex) now, CRC-32 (a number) in
    # checkpoints written before; both are checked, each with its own.
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    torch.save({"global_step": 3}, ckpt / "trainer.pt")
    save_file({"w": torch.arange(1000.0)}, str(ckpt / "model.safetensors"))

    def entry(file: Path) -> dict:
        data = file.read_bytes()
        if algorithm == "crc32":
            return {"size": len(data), "crc32": zlib.crc32(data)}
        return {"size": len(data), "xxh3_64": f"{xxhash.xxh3_64_intdigest(data):016x}"}

    files = {n: entry(ckpt / n) for n in ("trainer.pt", "model.safetensors")}
    (ckpt / "meta.json").write_text(json.dumps({"format": FORMAT, "files": files}))
    verify(ckpt, full=True)
    _flip(ckpt / "model.safetensors")
    name = "CRC-32" if algorithm == "crc32" else "xxh3_64"
    with pytest.raises(ls.ConfigError, match=rf"model\.safetensors is corrupt: its {name} differs"):
        verify(ckpt, full=True)


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
    "strategy, victim, beside",
    [("deepspeed_stage_2", "mp_rank_00_model_states.pt", False), ("fsdp", ".metadata", True)],
)
def test_damage_engines_would_fail_on_is_named_first(
    tmp_path, shared_run, strategy, victim, beside
):
    # A copy of the step-15 checkpoint of tests/test_strategies.py's 2-rank run (made once per
    # session).
    from test_checksummed_resume import beside_the_load
    from test_strategies import CKPT, RESUME_AT, strategy_run

    saved = strategy_run(shared_run, strategy)["root"] / CKPT
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    file = next(p for p in ckpt.rglob(victim))
    # Same size, damaged content: passes the cheap pre-launch check; the checksums catch it before
    # the engine (which would fail on it) reads it, or, checked beside the load (`beside`, as a
    # large file is), the engine's failure waits for their verdict, which is reported instead.
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
        extra_env=beside_the_load(tmp_path) if beside else None,
    )
    assert run.returncode != 0
    assert f"ConfigError: checkpoint file {file} is corrupt: its xxh3_64 differs" in run.stderr, (
        run.stderr[-3000:]
    )
