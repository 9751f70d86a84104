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
from pathlib import Path

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


def _opts(tmp_path, model: str, strategy: str, devices: int = 2) -> dict:
    root = tmp_path / f"{model}-{strategy}"
    root.mkdir()
    export = dict(gpt2="deepspeed_stage_3", llama="fsdp").get(model) == strategy
    return {
        "model": model,
        "strategy": strategy,
        "devices": devices,
        "root": str(root),
        "out": str(root / "out.json"),
        **({"export": str(root / "hf")} if export else {}),
    }


def _launched(tmp_path, jobs: list[dict]) -> list[dict]:
    """The 2-rank runs of `jobs` (hf_script options), one after another in one launched job."""
    run = launch(
        [str(SCRIPT), json.dumps({"jobs": jobs})],
        cwd=tmp_path,
        nproc=1,
        timeout=600,
        extra_env={"DS_ACCELERATOR": "cpu"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return [{**json.loads(Path(job["out"]).read_text()), "root": Path(job["root"])} for job in jobs]


# The default cells' 2-rank runs.
DEFAULT = [("gpt2", "ddp"), ("gpt2", "fsdp"), ("gpt2", "deepspeed_stage_2")]
DEFAULT += [("gpt2", "deepspeed_stage_3"), ("llama", "fsdp"), ("llama", "deepspeed_stage_3")]
DEFAULT += [("bert", "deepspeed_stage_3")]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One device's runs, in this process (no interpreter to start)."""
    import hf_script

    tmp = tmp_path_factory.mktemp("hf-single")
    out = {}
    for model in ("gpt2", "llama", "bert"):
        opts = _opts(tmp, model, "single", devices=1)
        hf_script.main(opts)
        out[model] = json.loads(Path(opts["out"]).read_text())
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[tuple[str, str], dict]:
    """The default cells' runs on 2 ranks, in one launched job: the ranks (and transformers'
    import) start once for six fits."""
    tmp = tmp_path_factory.mktemp("hf")
    return dict(zip(DEFAULT, _launched(tmp, [_opts(tmp, m, s) for m, s in DEFAULT])))


def _train(tmp_path, runs, model: str, strategy: str) -> dict:
    if (model, strategy) in DEFAULT:
        return runs[model, strategy]
    return _launched(tmp_path, [_opts(tmp_path, model, strategy)])[0]  # a slow cell


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gpt2_parity(tmp_path, reference, runs, strategy):
    out = _train(tmp_path, runs, "gpt2", strategy)
    assert_close_losses(
        out["losses"], reference["gpt2"]["losses"], 1e-5, f"gpt2 {strategy} vs single"
    )
    if strategy == "deepspeed_stage_3":
        _check_from_pretrained(out["root"] / "hf", "gpt2")


@pytest.mark.parametrize(
    "strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp", "deepspeed_stage_3"]
)
def test_llama_parity(tmp_path, reference, runs, strategy):
    out = _train(tmp_path, runs, "llama", strategy)
    assert_close_losses(
        out["losses"], reference["llama"]["losses"], 1e-5, f"llama {strategy} vs single"
    )
    if strategy == "fsdp":
        _check_from_pretrained(out["root"] / "hf", "llama")


def test_bert_built_in_configure_model_under_zero3(tmp_path, reference, runs):
    # zero.Init partitions each child as it is built, so transformers' parent-applied init found
    # BERT's embedding weights empty and `weight[padding_idx]` raised IndexError at setup
    out = _train(tmp_path, runs, "bert", "deepspeed_stage_3")
    assert_close_losses(
        out["losses"], reference["bert"]["losses"], 1e-5, "bert deepspeed_stage_3 vs single"
    )


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
