"""Checkpoints that travel, the first step: a DeepSpeed checkpoint carries the universal-checkpoint marker, so
DeepSpeed's own `ds_to_universal` converts it (the form `load_universal` reads on another world size).

    PYTHONPATH=src .venv/bin/python -m pytest -q tests/test_travel.py
"""

from __future__ import annotations

import subprocess
import sys

from helpers import run_workload


def test_deepspeed_checkpoint_converts_to_universal(tmp_path):
    run_workload(tmp_path, devices=2, strategy="deepspeed_stage_2", max_steps=2, ckpt_every=2)
    src = (tmp_path / "checkpoints" / "last").resolve() / "deepspeed"
    out = tmp_path / "universal"
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(src),
                           "--output_folder", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    params = [p.name for p in (out / "zero").iterdir() if p.is_dir()]
    assert "module.model.wpe.weight" in params and all((out / "zero" / p / "fp32.pt").exists() for p in params)
