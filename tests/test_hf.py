"""Hugging Face models built in configure_model train under every strategy with one device's losses.

    .venv/bin/python -m pytest -q tests/test_hf.py

Tiny configs (nothing is downloaded), 6 AdamW steps, global batch 8 on 2 CPU ranks against 1 device
with batch 8. Tolerance: 1e-5 relative per step (fp32; only the order of the gradient reductions
differs). GPT-2 has a tied head; the Llama-style model has RMSNorm, rotary embeddings and an untied
head. The consolidated weights of a ZeRO-3 and an FSDP checkpoint load with `from_pretrained` and
give the trained model's logits.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import ROOT, assert_close_losses, launch

pytest.importorskip("transformers")

SCRIPT = ROOT / "tests" / "hf_script.py"
# The cells marked slow repeat what the GPT parity suite covers for these strategies (`pytest -m
# slow`).
STRATEGIES = [
    "ddp",
    pytest.param("ddp_sharded", marks=pytest.mark.slow),
    "fsdp",
    pytest.param("fsdp_grad_op", marks=pytest.mark.slow),
    pytest.param("deepspeed_stage_1", marks=pytest.mark.slow),
    "deepspeed_stage_2",
    "deepspeed_stage_3",
]


def _train(tmp_path, model: str, strategy: str, devices: int = 2, export: bool = False) -> dict:
    root = tmp_path / f"{model}-{strategy}"
    root.mkdir()
    opts = {
        "model": model,
        "strategy": strategy,
        "devices": devices,
        "root": str(root),
        "out": str(root / "out.json"),
        **({"export": str(root / "hf")} if export else {}),
    }
    run = launch(
        [str(SCRIPT), json.dumps(opts)],
        cwd=root,
        nproc=1,
        timeout=240,
        extra_env={"DS_ACCELERATOR": "cpu"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads((root / "out.json").read_text())
    out["root"] = root
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-single")
    return {m: _train(tmp, m, "single", devices=1) for m in ("gpt2", "llama")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gpt2_parity(tmp_path, reference, strategy):
    out = _train(tmp_path, "gpt2", strategy, export=strategy == "deepspeed_stage_3")
    assert_close_losses(
        out["losses"], reference["gpt2"]["losses"], 1e-5, f"gpt2 {strategy} vs single"
    )
    if strategy == "deepspeed_stage_3":
        _check_from_pretrained(out["root"] / "hf", "gpt2")


@pytest.mark.parametrize(
    "strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp", "deepspeed_stage_3"]
)
def test_llama_parity(tmp_path, reference, strategy):
    out = _train(tmp_path, "llama", strategy, export=strategy == "fsdp")
    assert_close_losses(
        out["losses"], reference["llama"]["losses"], 1e-5, f"llama {strategy} vs single"
    )
    if strategy == "fsdp":
        _check_from_pretrained(out["root"] / "hf", "llama")


def _check_from_pretrained(folder, model: str) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(
        folder
    )  # the layout and key names transformers expects
    saved = load_file(str(folder / "model.safetensors"))
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items()), model
    assert (model == "gpt2") == (
        loaded.lm_head.weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    )
