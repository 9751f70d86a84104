"""DeepSpeed under precision="bf16-mixed" with float inputs (issue 11's bug: "mat1 and mat2 must
have the same dtype"). DeepSpeed's bf16 engine keeps bf16 weights, so the strategy casts the batch's
float tensors to bf16 on the way in. A float-input regression model trains 16 steps on 2 CPU ranks
(tests/float_input_script.py); the test asserts it ran, the module saw bf16 inputs, and the loss
fell to under half its first value (the bf16 weights still learn). Both stages run in one launched
job.
"""

import json

import pytest

from helpers import ROOT, launch

SCRIPT = ROOT / "tests" / "float_input_script.py"


STAGES = ["deepspeed_stage_2", "deepspeed_stage_3"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, dict]:
    """Both stages' runs, one after another in one launched job (the ranks start once)."""
    tmp = tmp_path_factory.mktemp("bf16")
    args = [a for s in STAGES for a in (str(tmp / f"{s}.json"), s, "bf16-mixed")]
    run = launch([str(SCRIPT), *args], tmp)
    assert run.returncode == 0, run.stderr[-4000:]
    return {s: json.loads((tmp / f"{s}.json").read_text()) for s in STAGES}


@pytest.mark.parametrize("strategy", STAGES)
def test_bf16_mixed_casts_float_inputs(results, strategy):
    result = results[strategy]
    losses = result["losses"]
    assert len(losses) == 16 and result["input_dtype"] == "torch.bfloat16", result
    assert max(losses[-3:]) < 0.5 * losses[0], losses


def test_cast_leaves_integers_alone():
    import torch

    from lightspeed.strategies.deepspeed.config import cast_floats

    batch = {
        "ids": torch.arange(3),
        "x": [torch.ones(2)],
        "pair": (torch.zeros(1, dtype=torch.float64), 7),
    }
    cast = cast_floats(batch, torch.bfloat16)
    assert cast["ids"].dtype == torch.int64 and cast["x"][0].dtype == torch.bfloat16
    assert cast["pair"][0].dtype == torch.bfloat16 and cast["pair"][1] == 7
    assert cast_floats(batch, None) is batch
