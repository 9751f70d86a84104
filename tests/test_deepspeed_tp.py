"""DeepSpeed's AutoTP beside ZeRO 1/2 (`DeepSpeed(stage=2, tp=2)`, "deepspeed_stage_2_tp2";
strategies/deepspeed/autotp.py) on 2 real gloo CPU ranks.

    .venv/bin/python -m pytest -q tests/test_deepspeed_tp.py     # -m slow: the repeats

Every run is tests/tp_script.py, as in tests/test_tensor_parallel.py: 30 AdamW steps of 2
accumulated micro-batches, clipped at norm 1.0, against one device on the same global batch. The
default cells share one launched job whose two ranks run, one fit after another: lightspeed's GPT
(fused qkv, tied head: the default plan) under deepspeed_stage_2_tp2 with a checkpoint at step 15,
a Hugging Face Llama (GQA, rotary: its own tp_plan) under deepspeed_stage_1_tp2, the GPT under
deepspeed_stage_2_tp2 resumed from one device's step-15 checkpoint and from its own, and validated
from its own. Its step-15 checkpoint also resumes, validates and consolidates on one device.

Tolerance: relative 1e-5 per step in fp32, test_tensor_parallel.py's (observed: GPT 1.1e-7, Llama
2.6e-6): a split matmul sums half the features on each rank and all-reduces the halves, so only the
rounding order differs from one device. HF GPT-2 (Conv1D) is refused: DeepSpeed's AutoTP training
splits nn.Linear only.
"""

from __future__ import annotations

import json

import pytest

from helpers import ROOT, assert_close_losses, launch
from lightspeed.errors import ConfigError

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

SCRIPT = ROOT / "tests" / "tp_script.py"
RTOL = 1e-5
TRAIN = dict(steps=30, accumulate=2, clip=1.0)
HALF = 15
# the parameters each model's plan splits (weights; these models have no biases)
GPT_SPLIT = {f"model.blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj")}
GPT_SPLIT |= {f"model.blocks.{i}.mlp.{j}.weight" for i in range(2) for j in (0, 2)}
LLAMA_SPLIT = {"model.lm_head.weight"} | {
    f"model.model.layers.{i}.{m}.weight"
    for i in range(2)
    for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
    + ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
}


def _opts(root, **opts) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    return {**TRAIN, "root": str(root), "out": str(root / "out.json"), **opts}


def _one_device(root, **opts) -> dict:
    import tp_script  # in this process: no interpreter start-up

    tp_script.main(_opts(root, **opts))
    return {**json.loads((root / "out.json").read_text()), "root": root}


def _launched(tmp, jobs: dict[str, dict], timeout: float = 400, ranks: int = 2) -> dict[str, dict]:
    """The `jobs` (name -> tp_script options) as one launched job of 2 ranks (the Trainer starts
    the second), or of `ranks` under torchrun."""
    devices, launcher, nproc = (2, "python", 1) if ranks == 2 else ("auto", "torchrun", ranks)
    given = [_opts(tmp / name, devices=devices, **opts) for name, opts in jobs.items()]
    run = launch([str(SCRIPT), json.dumps({"jobs": given})], tmp, launcher, nproc, timeout=timeout)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-5000:]
    outs = {name: json.loads((tmp / name / "out.json").read_text()) for name in jobs}
    return {name: {**out, "root": tmp / name, "stdout": run.stdout} for name, out in outs.items()}


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ds-tp-one")
    return {
        "gpt": _one_device(tmp / "gpt", model="gpt", ckpt_every=HALF),
        "llama": _one_device(tmp / "llama", model="llama"),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory, ref):
    tmp = tmp_path_factory.mktemp("ds-tp")
    own = str(tmp / "gpt-ds2" / "ckpt" / f"step={HALF}.ckpt")
    return _launched(
        tmp,
        {
            "gpt-ds2": dict(model="gpt", strategy="deepspeed_stage_2_tp2", ckpt_every=HALF),
            "llama-ds1": dict(model="llama", strategy="deepspeed_stage_1_tp2"),
            "gpt-from-one": dict(
                model="gpt",
                strategy="deepspeed_stage_2_tp2",
                resume=str(ref["gpt"]["root"] / "ckpt" / f"step={HALF}.ckpt"),
            ),
            "gpt-from-own": dict(model="gpt", strategy="deepspeed_stage_2_tp2", resume=own),
            "gpt-validate": dict(model="gpt", strategy="deepspeed_stage_2_tp2", validate=own),
        },
    )


# --------------------------------------------------------------------------------------------------
# parity, and the bytes each rank holds
@pytest.mark.parametrize("name", ["gpt-ds2", "llama-ds1"])
def test_tp2_losses_equal_one_device(runs, ref, name):
    model, out = name.split("-")[0], runs[name]
    assert out["strategy"] == f"deepspeed_stage_{name[-1]}_tp2"
    assert_close_losses(out["losses"], ref[model]["losses"], RTOL, f"{name} vs one device")
    origin = "Hugging Face tp_plan" if model == "llama" else "default plan"
    assert f"tensor parallel (DeepSpeed AutoTP): tp=2, the {origin}" in out["stdout"]


@pytest.mark.parametrize("name", ["gpt-ds2", "llama-ds1"])
def test_tp2_ranks_hold_half_of_each_split_layer(runs, ref, name):
    # Each TP rank holds exactly half the elements of every parameter the plan splits and every
    # other parameter whole (Llama's embedding too: vocabulary-parallel embeddings stay replicated
    # under DeepSpeed); with one data-parallel rank, measure()'s parameter bytes are those.
    model = name.split("-")[0]
    whole = ref[model]["ranks"][0]["numels"]
    split = GPT_SPLIT if model == "gpt" else LLAMA_SPLIT
    for rank in runs[name]["ranks"]:
        local = rank["numels"]
        assert local.keys() == whole.keys()
        assert {n for n in whole if local[n] != whole[n]} == split
        assert all(2 * local[n] == whole[n] for n in split)
        assert rank["measure"]["params"] == 4 * sum(local.values())  # fp32


# --------------------------------------------------------------------------------------------------
# checkpoints: the same layout natively, another one through the neutral form
def test_resume_tp2_natively_and_from_one_device(runs):
    straight = runs["gpt-ds2"]["losses"][2 * HALF :]
    assert runs["gpt-from-own"]["losses"] == straight  # exact: same layout, same ranks
    assert_close_losses(runs["gpt-from-one"]["losses"], straight, RTOL, "single -> tp2")


def test_validate_from_a_tp2_checkpoint_under_tp2_and_on_one_device(runs, tmp_path):
    # an evaluation-only engine (no optimizer) loads its TP rank's cut of the merged weights
    ckpt = str(runs["gpt-ds2"]["root"] / "ckpt" / f"step={HALF}.ckpt")
    one = _one_device(tmp_path, model="gpt", validate=ckpt)["val_loss"]
    assert abs(runs["gpt-validate"]["val_loss"] / one - 1) <= RTOL


def test_resume_a_tp2_checkpoint_on_one_device(runs, tmp_path):
    ckpt = runs["gpt-ds2"]["root"] / "ckpt" / f"step={HALF}.ckpt"
    out = _one_device(tmp_path, model="gpt", resume=str(ckpt))  # DeepSpeed's ds_to_universal
    assert_close_losses(out["losses"], runs["gpt-ds2"]["losses"][2 * HALF :], RTOL, "tp2 -> 1")


def test_a_tp2_checkpoint_consolidates_into_the_plain_module(runs, ref, tmp_path):
    # ds_to_universal joins the TP cuts: the file loads strictly into the plain GPT (tied head
    # included) and gives one device's step-15 logits.
    import torch
    from safetensors.torch import load_file

    import lightspeed as ls
    from tp_script import CausalLM

    logits = {}
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for name, root in (("tp2", runs["gpt-ds2"]["root"]), ("one", ref["gpt"]["root"])):
        ls.consolidate(root / "ckpt" / f"step={HALF}.ckpt", tmp_path / f"{name}.safetensors")
        plain = CausalLM("gpt")
        plain.configure_model()
        plain.load_state_dict(load_file(str(tmp_path / f"{name}.safetensors")), strict=True)
        logits[name] = plain.model(ids)
    torch.testing.assert_close(logits["tp2"], logits["one"], rtol=0, atol=1e-4)


@pytest.mark.slow
def test_the_other_stages_and_a_zero3_checkpoint_resumed_under_tp2(runs, ref, tmp_path):
    offload = {"deepspeed": {"stage": 2, "tp": 2, "offload_optimizer": "cpu"}}
    first = _launched(
        tmp_path,
        {
            "ds3": dict(model="gpt", strategy="deepspeed_stage_3", batch=2, ckpt_every=HALF),
            "gpt-ds1": dict(model="gpt", strategy="deepspeed_stage_1_tp2"),
            "llama-ds2": dict(model="llama", strategy="deepspeed_stage_2_tp2"),
            "gpt-offload": dict(model="gpt", strategy=offload),  # DeepSpeedCPUAdam's steps
        },
    )
    assert_close_losses(first["gpt-ds1"]["losses"], ref["gpt"]["losses"], RTOL, "gpt ds1 tp2")
    assert_close_losses(first["llama-ds2"]["losses"], ref["llama"]["losses"], RTOL, "llama ds2")
    assert_close_losses(first["gpt-offload"]["losses"], ref["gpt"]["losses"], RTOL, "offload")
    ckpt = first["ds3"]["root"] / "ckpt" / f"step={HALF}.ckpt"
    out = _launched(
        tmp_path / "then",
        {"from-ds3": dict(model="gpt", strategy="deepspeed_stage_2_tp2", resume=str(ckpt))},
    )
    straight = runs["gpt-ds2"]["losses"][2 * HALF :]
    assert_close_losses(out["from-ds3"]["losses"], straight, RTOL, "deepspeed_stage_3 -> tp2")


# --------------------------------------------------------------------------------------------------
# bad input: in the constructors, before any rank starts
def test_bad_input_is_refused_before_launch():
    import lightspeed as ls

    with pytest.raises(ConfigError, match=r"DeepSpeed\(tp=2\) needs a world size divisible by 2"):
        ls.Trainer(strategy="deepspeed_stage_2_tp2", devices=1, accelerator="cpu")
    with pytest.raises(ConfigError, match=r"DeepSpeed\(tp=4\).*world size is 2.*\[1, 2\]"):
        ls.Trainer(strategy=ls.DeepSpeed(stage=1, tp=4), devices=2, accelerator="cpu")
    with pytest.raises(ConfigError, match=r"DeepSpeed\(stage=3, tp=2\) is not offered.*FSDP"):
        ls.DeepSpeed(stage=3, tp=2)
    with pytest.raises(ConfigError, match=r"offload_optimizer='nvme' with tp=2 is not offered"):
        ls.DeepSpeed(stage=2, tp=2, offload_optimizer="nvme", nvme_path="/tmp")
    with pytest.raises(ConfigError, match=r"DeepSpeed\(tp=0\) is not valid: use a positive int"):
        ls.DeepSpeed(tp=0)
    with pytest.raises(ConfigError, match=r"tp=2\) contradicts .*autotp_size=4"):
        ls.DeepSpeed(tp=2, config={"tensor_parallel": {"autotp_size": 4}})
    with pytest.raises(ConfigError, match=r"tensor_parallel\.partition_config is not read"):
        ls.DeepSpeed(tp=2, config={"tensor_parallel": {"partition_config": {}}})
    # manual optimization: refused by the strategy's check, in fit before the ranks start
    import torch

    from tp_script import CausalLM

    class Manual(CausalLM):
        def __init__(self):
            super().__init__("gpt")
            self.automatic_optimization = False

    loader = torch.utils.data.DataLoader(torch.zeros(8, 4, dtype=torch.long), batch_size=4)
    trainer = ls.Trainer(
        strategy="deepspeed_stage_2_tp2", devices=2, accelerator="cpu", logger=False
    )
    with pytest.raises(ConfigError, match=r"automatic_optimization=False is not offered with"):
        trainer.fit(Manual(), loader)
    # the config's degree alone turns AutoTP on, under the same name as DeepSpeed(tp=2)
    assert ls.DeepSpeed(config={"tensor_parallel": {"autotp_size": 2}}).name == (
        "deepspeed_stage_2_tp2"
    )


def test_plans_deepspeed_cannot_take_are_config_errors():
    from lightspeed.strategies.deepspeed.autotp import build_plan, config_section
    from tp_script import ByHand, build

    with pytest.raises(
        ConfigError, match=r"transformer\.h\.0\.attn\.c_attn' is a Hugging Face Conv1D"
    ):
        build_plan(build("gpt2"), 2, None)
    by_hand = ByHand("gpt")
    by_hand.configure_model()
    with pytest.raises(ConfigError, match=r"ByHand\.configure_tensor_parallel\(mesh\) is FSDP"):
        build_plan(by_hand, 2, None)
    with pytest.raises(ConfigError, match=r"tp=8 does not divide blocks\.0\.attn's n_head=4"):
        build_plan(build("gpt"), 8, None)
    with pytest.raises(ConfigError, match=r"'rowwise_split_input' is not offered under DeepSpeed"):
        build_plan(build("gpt"), 2, {"blocks.*.attn.qkv": "rowwise_split_input"})
    plan, lines = build_plan(build("gpt"), 2, {"blocks.*.mlp.0": "colwise"})
    assert plan == {"blocks.0.mlp.0": "colwise", "blocks.1.mlp.0": "colwise"}
    assert lines[0].startswith("tensor parallel (DeepSpeed AutoTP): tp=2, tp_plan=")
    # the patterns DeepSpeed matches: exact paths inside its StepRunner, checkpoint wrappers allowed
    (spec, _) = config_section(plan, 2)["partition_config"]["layer_specs"]
    assert spec == {
        "patterns": [
            r"^module\.(?:_checkpoint_wrapped_module\.)?blocks\.(?:_checkpoint_wrapped_module\.)?"
            r"0\.(?:_checkpoint_wrapped_module\.)?mlp\.(?:_checkpoint_wrapped_module\.)?0\.weight$"
        ],
        "partition_type": "column",
    }


@pytest.mark.slow
def test_zero2_x_tp_2x2_on_4_ranks(tmp_path):
    # 2 data-parallel groups of 2 TP ranks (torchrun: the Trainer refuses 4 local ranks on 2 cores):
    # the data-parallel ranks read different batches (rank // tp), ZeRO-2 halves the optimizer state
    # and master weights over them; the global batch is 2 x 4, one device's is 8.
    one = _one_device(tmp_path / "one", model="gpt", batch=8)
    out = _launched(tmp_path, {"2x2": dict(model="gpt", strategy="deepspeed_stage_2_tp2")}, ranks=4)
    assert_close_losses(out["2x2"]["losses"], one["losses"], RTOL, "gpt 2x2 vs one device")
    for rank in out["2x2"]["ranks"]:
        assert 2 * rank["measure"]["master"] == rank["measure"]["params"]  # fp32 master: half
