"""Every byte a resume reads is checked: a changed byte in any file a rank reads (a DDP .ckpt's
records, DeepSpeed ZeRO shards, DCP shards) stops the resume on every rank with a ConfigError
naming the file (and record), the recorded and the found checksum (a .ckpt record's CRC-32, a
directory file's xxh3_64), and the newest intact checkpoint beside it. What engines parse is
checked before the load; tensor bytes beside it, and then the resumed run stops before its first
save (no checkpoint is written) or the end of fit.
Without the check, flips in optimizer state resumed silently (the losses parted at steps 12-14).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_checksummed_resume.py

Each strategy trains once on 2 CPU ranks (gloo), saving at steps 2 and 4 (the four runs in one
launched job); each test flips one byte of a copy of the step-4 checkpoint and resumes from it.
"""

from __future__ import annotations

import json
import shutil
import zipfile
import zlib
from pathlib import Path

import pytest
import xxhash

from helpers import run_jobs, run_workload
from lightspeed.checkpoint.integrity import files_read, rank_of

STEPS = 4
RUN = dict(devices=2, batch_size=2, max_steps=STEPS, ckpt_every=2)


STRATEGIES = ["ddp", "deepspeed_stage_2", "deepspeed_stage_3", "fsdp"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """strategy -> the checkpoints folder of its run; the four runs in one launched job
    (helpers.run_jobs: the ranks start once)."""
    tmp = tmp_path_factory.mktemp("trained")
    runs = run_jobs(tmp, {strategy: dict(strategy=strategy, **RUN) for strategy in STRATEGIES})
    return lambda strategy: runs[strategy]["root"] / "checkpoints"


def beside_the_load(tmp_path: Path) -> dict:
    """The environment for ranks that check every file beside the load (integrity.SMALL below any
    size), as they do a large file: the tests' checkpoints are small, checked whole before it."""
    site = tmp_path / "site-beside"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import lightspeed.checkpoint.integrity as integrity\nintegrity.SMALL = -1\n"
    )
    return {"PYTHONPATH": f"{site}:{Path(__file__).resolve().parent.parent / 'src'}"}


def _flip(file: Path, at: float = 0.6) -> None:
    """One bit of the byte at `at` of the file flipped: same size, same headers, other values."""
    data = bytearray(file.read_bytes())
    data[int(len(data) * at)] ^= 0x10
    file.write_bytes(bytes(data))


def _flip_record(file: Path, record: str) -> tuple[int, int]:
    """One bit of one zip record's bytes flipped; returns (its recorded CRC-32, the new one)."""
    with zipfile.ZipFile(file) as z:
        info = z.getinfo(record)
    data = bytearray(file.read_bytes())
    head = info.header_offset
    start = head + 30 + int.from_bytes(data[head + 26 : head + 28], "little")
    start += int.from_bytes(data[head + 28 : head + 30], "little")
    data[start + info.file_size // 2] ^= 0x10
    file.write_bytes(bytes(data))
    return info.CRC, zlib.crc32(data[start : start + info.file_size])


@pytest.mark.parametrize("record", ["archive/data.pkl", "archive/data/0"])
def test_flipped_byte_of_a_ddp_file_stops_the_resume(tmp_path, trained, record):
    # DDP writes Lightning's one .ckpt: its zip records carry their CRC-32s, checked on every rank.
    folder = tmp_path / "checkpoints"
    shutil.copytree(trained("ddp"), folder, symlinks=True)
    ckpt = folder / f"epoch=0-step={STEPS}.ckpt"
    recorded, found = _flip_record(ckpt, record)
    run = run_workload(
        tmp_path, strategy="ddp", **{**RUN, "max_steps": STEPS + 2}, resume=str(ckpt), check=False
    )
    assert run.returncode != 0, run.stdout[-2000:]
    assert f"checkpoint file {ckpt} is corrupt: the CRC-32 of its record {record!r}" in run.stderr
    assert f"(recorded {recorded:08x}, found {found:08x} on rank 0)" in run.stderr, run.stderr[
        -3000:
    ]
    intact = f"The newest intact checkpoint in {folder} is epoch=0-step=2.ckpt"
    assert intact in run.stderr, run.stderr[-3000:]
    # A tensor record is checked beside the load: the run trained on, but saved nothing.
    assert not (folder / f"epoch=0-step={STEPS + 2}.ckpt").exists()


@pytest.mark.parametrize(
    "strategy, victim, beside",
    [
        pytest.param(  # ZeRO-3's optimizer shard below goes through the same check
            "deepspeed_stage_2",
            "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt",
            True,
            marks=pytest.mark.slow,
        ),
        # the model-states file is checked by the same code as the optimizer shard: a slow cell
        pytest.param(
            "deepspeed_stage_2",
            "deepspeed/mp_rank_00_model_states.pt",
            False,
            marks=pytest.mark.slow,
        ),
        ("deepspeed_stage_3", "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt", True),
        ("fsdp", "dcp/__1_0.distcp", False),
    ],
)
def test_flipped_byte_stops_the_resume_naming_the_file(tmp_path, trained, strategy, victim, beside):
    # `beside`: the file is checked beside the load, as a large one is (else whole, before it).
    folder = tmp_path / "checkpoints"
    shutil.copytree(trained(strategy), folder, symlinks=True)
    ckpt = folder / f"epoch=0-step={STEPS}.ckpt"
    file = ckpt / victim
    recorded = json.loads((ckpt / "meta.json").read_text())["files"][victim]["xxh3_64"]
    _flip(file)
    found = xxhash.xxh3_64_intdigest(file.read_bytes())
    run = run_workload(
        tmp_path,
        strategy=strategy,
        **{**RUN, "max_steps": STEPS + 2},
        resume=str(ckpt),
        check=False,
        extra_env=beside_the_load(tmp_path) if beside else None,
    )
    assert run.returncode != 0, run.stdout[-2000:]
    assert f"checkpoint file {file} is corrupt: its xxh3_64 differs" in run.stderr, run.stderr[
        -3000:
    ]
    assert f"(recorded {recorded}, found {found:016x}" in run.stderr, run.stderr[-3000:]
    intact = f"The newest intact checkpoint in {folder} is epoch=0-step=2.ckpt"
    assert intact in run.stderr, run.stderr[-3000:]
    assert not (folder / f"epoch=0-step={STEPS + 2}.ckpt").exists()  # nothing saved after it


def test_files_read_cover_every_rank_share():
    meta = {
        "world_size": 2,
        "files": dict.fromkeys(
            [
                "trainer.pt",
                "rng-rank0.pt",
                "rng-rank1.pt",
                "deepspeed/mp_rank_00_model_states.pt",
                "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                "deepspeed/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                "dcp/.metadata",
                "dcp/__3_0.distcp",
            ],
            {},
        ),
    }
    assert [rank_of(n) for n in meta["files"]] == [None, 0, 1, None, 0, 1, None, 3]
    rank1 = files_read(meta, 1, 2, native=True, with_optimizer=True, loop_state=True)
    assert rank1 == [
        "trainer.pt",
        "rng-rank1.pt",
        "deepspeed/mp_rank_00_model_states.pt",
        "deepspeed/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "dcp/.metadata",
        "dcp/__3_0.distcp",  # 3 % 2: a shard of a 4-rank save, checked on 2 ranks
    ]
    # Another layout: rank 0 reads the whole checkpoint into the neutral form, the others none.
    assert files_read(meta, 1, 2, native=False, with_optimizer=False, loop_state=False) == []
    assert len(files_read(meta, 0, 3, native=False, with_optimizer=True, loop_state=True)) == 6


_AUDIT = """
import os, sys
def _hook(event, args, _log=os.environ["LIGHTSPEED_TEST_OPENED"]):
    if event == "open" and isinstance(args[0], str) and "/checkpoints/" in args[0] and (
        args[1] is None or "r" in str(args[1])
    ):
        with open(f"{_log}.{os.environ.get('RANK', 'launch')}", "a") as f:
            f.write(args[0] + "\\n")
sys.addaudithook(_hook)
"""


AUDITED = ["deepspeed_stage_2", "deepspeed_stage_3", "fsdp"]


@pytest.fixture(scope="module")
def audited(tmp_path_factory, trained) -> Path:
    """A clean resume of each of AUDITED's step-4 checkpoints, one after another in one launched job,
    with an audit hook recording each rank's Python-level opens (torch.load, DCP's reader,
    DeepSpeed) of files in a checkpoints folder. Returns the folder of the logs ("opened.<rank>")."""
    tmp = tmp_path_factory.mktemp("audited")
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_AUDIT)
    root = Path(__file__).resolve().parent.parent
    jobs = {
        strategy: dict(
            strategy=strategy,
            **{**RUN, "max_steps": STEPS + 1, "ckpt_every": 0},
            resume=str(trained(strategy) / f"epoch=0-step={STEPS}.ckpt"),
        )
        for strategy in AUDITED
    }
    env = {"PYTHONPATH": f"{site}:{root / 'src'}", "LIGHTSPEED_TEST_OPENED": str(tmp / "opened")}
    run_jobs(tmp, jobs, extra_env=env)
    return tmp


@pytest.mark.parametrize("strategy", AUDITED)
def test_every_file_a_resume_opens_is_checked(audited, trained, strategy):
    # Every file of the checkpoint opened by any rank during its clean resume must be checked by
    # some rank.
    ckpt = trained(strategy) / f"epoch=0-step={STEPS}.ckpt"
    meta = json.loads((ckpt / "meta.json").read_text())
    checked = {
        n
        for rank in range(2)
        for n in files_read(meta, rank, 2, native=True, with_optimizer=True, loop_state=True)
    }
    opened = {
        str(Path(p).relative_to(ckpt))
        for f in audited.glob("opened.[0-9]")
        for p in f.read_text().split()
        if Path(p).is_relative_to(ckpt)
    }
    assert opened and opened - {"meta.json"} <= checked, (opened, checked)
