"""The benchmark scripts and the demo, run at tiny sizes on CPU so they cannot rot (no timing asserts)."""

from __future__ import annotations

import pytest
import json
import re
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _run(args: list[str], cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_gpu_suite_tiny_runs_every_kind_of_setup(tmp_path):
    names = "plain_pytorch,plain_deepspeed_zero2,single,deepspeed_stage_2,fsdp+ac"
    out = tmp_path / "r.json"
    proc = _run([str(ROOT / "benchmarks" / "gpu_suite.py"), "--tiny", "--only", names, "--steps", "3",
                 "--warmup", "1", "--json", str(out)], tmp_path)
    results = {r["name"]: r for r in json.loads(out.read_text())}
    assert set(results) == set(names.split(","))
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["tok_s"] > 0 and r["timed_steps"] == 3
    assert "× plain PyTorch" in proc.stdout and "deepspeed_stage_2" in proc.stdout


def test_overhead_benchmark_prints_ratio(tmp_path):
    proc = _run([str(ROOT / "benchmarks" / "overhead.py"), "--size", "tiny", "--steps", "8", "--repeats", "1"],
                tmp_path)
    assert "ratio to plain loop" in proc.stdout and "lightspeed Trainer" in proc.stdout


@pytest.mark.slow  # tests/test_cli.py runs the demo (and inspect, report) by default
def test_demo_trains_and_shows_summary(tmp_path):
    proc = _run(["-m", "lightspeed.cli", "demo", "--size", "tiny", "--max-steps", "12", "--root", str(tmp_path / "d")],
                tmp_path)
    out = proc.stdout
    for row in ("strategy", "deepspeed_stage_2", "tokens/s", "peak memory", "first loss", "last loss", "checkpoint"):
        assert row in out, f"summary lacks {row!r}:\n{out[-3000:]}"
    def row_value(label: str) -> float:
        line = next(ln for ln in out.splitlines() if label in ln)
        return float(re.findall(r"\d+\.\d+", line)[-1])

    first, last = row_value("first loss"), row_value("last loss")
    assert last < first
    assert (tmp_path / "d" / "demo-gpt.safetensors").exists()
    assert (tmp_path / "d" / "checkpoints" / "last" / "meta.json").exists()


def test_multi_gpu_script_parity_section_on_cpu_ranks(tmp_path):
    """benchmarks/multi_gpu.py on 2 gloo ranks with the tiny GPT: every strategy reports the same losses."""
    out = tmp_path / "m.json"
    _run([str(ROOT / "benchmarks" / "multi_gpu.py"), "--cpu", "--tiny", "--devices", "2", "--sections", "parity",
          "--strategies", "ddp,fsdp,deepspeed_stage_3", "--steps", "3", "--warmup", "1", "--parity-rtol", "1e-5",
          "--json", str(out)], tmp_path, timeout=600)
    results = list(json.loads(out.read_text()).values())  # every run, in the order it was made
    assert [r["strategy"] for r in results] == ["ddp", "fsdp", "deepspeed_stage_3"]
    ref = results[0]["losses"]
    for r in results:
        assert "error" not in r, r
        assert len(r["losses"]) == 4
        assert max(abs(a - b) / b for a, b in zip(r["losses"], ref)) <= 1e-5, r["strategy"]
