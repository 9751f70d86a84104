"""GPU checks, behind the `gpu` marker: skipped with a reason on machines without CUDA (see conftest.py).

Run on a GPU machine with `pytest -m gpu tests/test_gpu.py`. The GPU benchmark (benchmarks/gpu_suite.py) trains
the same strategies at 1.3B parameters; these are the quick correctness checks.
"""

from __future__ import annotations

import pytest
from helpers import assert_close_losses, run_workload

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("strategy", ["deepspeed_stage_2", "deepspeed_stage_3_offload", "fsdp"])
def test_strategy_matches_single_gpu_in_bf16(tmp_path, strategy):
    """One GPU: each strategy's bf16 losses track the single-device bf16 run (bf16 rounding: relative 2e-2)."""
    common = dict(devices=1, accelerator="gpu", precision="bf16-mixed", batch_size=8, max_steps=10)
    ref = run_workload(tmp_path, strategy="single", **common)
    got = run_workload(tmp_path, strategy=strategy, **common)
    assert_close_losses(got["losses"], ref["losses"], 2e-2, f"{strategy} vs single on GPU")
    assert got["losses"][-1] < got["losses"][0]
