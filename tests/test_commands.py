"""The command line as a user meets it: help with defaults and choices, one-line errors with exit
status 2, the demo's output (a header row, relative uncut paths, one checkpoint per step, the
report's path), inspect, report, env.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_commands.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightspeed.commands import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
COMMANDS = ("demo", "convert", "inspect", "report", "env", "plan")


def _cli(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lightspeed.commands", *args],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _one_line_error(proc_or_err: str) -> str:
    lines = proc_or_err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("lightspeed: error: "), proc_or_err
    return lines[0]


def test_bad_strategy_is_one_line_and_exit_2(tmp_path):
    proc = _cli(["demo", "--strategy", "nope"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    line = _one_line_error(proc.stderr)
    assert "'nope'" in line and "deepspeed_stage_3" in line and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["convert", "nowhere", "out.safetensors"], "checkpoint 'nowhere' does not exist"),
        (["inspect", "nowhere"], "checkpoint 'nowhere' does not exist"),
        (["report", "."], "has no metrics.csv"),
        (["demo", "--precision", "64"], "invalid choice: '64'"),
        (["demo", "--accelerator", "tpu"], "invalid choice: 'tpu'"),
        (["demo", "--devices", "two"], "invalid int value: 'two'"),
    ],
)
def test_user_errors_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, args, words):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == ""
    assert words in _one_line_error(captured.err) and "ckpt_path" not in captured.err


def test_a_folder_that_is_not_a_checkpoint_is_named_as_such(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notckpt").mkdir()
    with pytest.raises(SystemExit):
        main(["convert", "notckpt", "out.safetensors"])
    assert "is not a lightspeed checkpoint" in _one_line_error(capsys.readouterr().err)


def test_every_flag_has_help_with_its_default_and_choices():
    parser = build_parser()
    subparsers = next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices
    assert set(subparsers) == set(COMMANDS)
    for name, sub in subparsers.items():
        text = " ".join(
            sub.format_help().split()
        )  # argparse wraps lines: compare with single spaces
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.dest} has no help"
            if action.option_strings and action.default is not None:
                assert f"(default: {action.default})" in text, (
                    f"{name} {action.dest}: default not shown"
                )
    demo = " ".join(subparsers["demo"].format_help().split())
    assert "{auto,cpu,gpu}" in demo and "(default: auto)" in demo and "bf16-mixed" in demo
    assert "fsdp_grad_op" in demo and "(default: deepspeed_stage_2)" in demo


def test_demo_then_inspect_and_report(tmp_path, monkeypatch, capsys):
    proc = _cli(
        ["demo", "--size", "tiny", "--max-steps", "10", "--root", "d", "--accelerator", "cpu"],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert "metric" in out and "value" in out  # the summary's header row
    assert "│ checkpoint" in out and "d/checkpoints/epoch=0-step=10.ckpt " in out  # relative, whole
    assert "d/demo-gpt.safetensors " in out and "…" not in out and str(tmp_path) not in out
    assert out.strip().splitlines()[-1] == "report: d/lightning_logs/version_0/report.html"
    assert (tmp_path / "d/lightning_logs/version_0/report.html").exists()
    # Each step saved once: fit's own checkpoint, which `last` points at.
    ckpts = sorted(
        p.name for p in (tmp_path / "d/checkpoints").iterdir() if not p.name.startswith(".")
    )
    assert ckpts == ["epoch=0-step=10.ckpt", "last.ckpt"]  # a directory under DeepSpeed

    monkeypatch.chdir(tmp_path)
    main(["inspect", "d/checkpoints"])
    shown = capsys.readouterr().out
    for row in (
        "deepspeed_stage_2",
        "world size",
        "│ 2 ",
        "global step",
        "│ 10 ",
        "verifies",
        "│ yes",
        "trainer.pt",
        "meta.json",
        "34,688",
    ):  # 34,688: the tiny GPT's parameters, tied weights once
        assert row in shown, f"{row!r} not in:\n{shown}"
    main(["report", "d/lightning_logs/version_0"])
    assert capsys.readouterr().out.strip() == "report: d/lightning_logs/version_0/report.html"


def test_env_lists_versions_and_deepspeed_ops(capsys):
    import torch

    main(["env"])
    out = capsys.readouterr().out
    assert (
        torch.__version__ in out
        and "deepspeed" in out
        and "cpu_adam" in out
        and "compatible" in out
    )
