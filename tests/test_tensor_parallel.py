"""Tensor parallelism (strategies/tensor_parallel.py): `FSDP(tp=2)` / "fsdp_tp2" on real gloo ranks.

    .venv/bin/python -m pytest -q -n 1 tests/test_tensor_parallel.py    # -m slow: the bigger cells

Every run is tests/tp_script.py: 12 AdamW steps of 2 accumulated micro-batches, clipped at norm
1.0, on lightspeed's GPT (fused qkv, tied head: the default plan), a Hugging Face Llama (GQA,
rotary: its own tp_plan, vocabulary-parallel embedding and head) and a Hugging Face GPT-2 (Conv1D,
fused c_attn, no tp_plan: the default plan), each against one device on the same global batch.

Tolerance: relative 1e-5 per step in fp32 (observed at most 3e-7). A split matmul sums half of the
features on each rank and all-reduces the halves, so only the rounding order differs from one
device; everything else (data, initial weights, RNG, optimizer) is the same.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from helpers import ROOT, assert_close_losses, launch
from lightspeed.errors import ConfigError

pytest.importorskip("transformers")

SCRIPT = ROOT / "tests" / "tp_script.py"
RTOL = 1e-5
TRAIN = dict(steps=12, accumulate=2, clip=1.0)
HALF = 6  # the GPT tp=2 run saves a checkpoint here; resumes continue from it


def _run(root, nproc: int = 1, launcher: str = "python", **opts) -> dict:
    """tests/tp_script.py in its own folder; rank 0's result, with "root"."""
    root.mkdir(parents=True, exist_ok=True)
    opts = {**TRAIN, "root": str(root), "out": str(root / "out.json"), **opts}
    if opts.get("devices", 1) == 1 and not str(opts.get("strategy", "")).startswith("deepspeed"):
        import tp_script  # one device: in this process, no interpreter start-up

        tp_script.main(opts)
        return {**json.loads((root / "out.json").read_text()), "root": root}
    run = launch([str(SCRIPT), json.dumps(opts)], root, launcher, nproc, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-5000:]
    return {**json.loads((root / "out.json").read_text()), "root": root, "stdout": run.stdout}


def _launched(tmp, jobs: dict[str, dict]) -> dict[str, dict]:
    """The 2-rank runs of `jobs` (name -> tp_script options), one after another in one launched job
    (the ranks start once); each result's "stdout" is its own part of the job's output."""
    given = []
    for name, opts in jobs.items():
        (tmp / name).mkdir(parents=True, exist_ok=True)
        given.append(
            {**TRAIN, "root": str(tmp / name), "out": str(tmp / name / "out.json"), **opts}
        )
    run = launch([str(SCRIPT), json.dumps({"jobs": given})], tmp, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-5000:]
    parts = re.split(r"\[tp_script job (\d+)\]\n", run.stdout)
    said = ["" for _ in given]  # parts: text, number, text, number, text, ...
    for number, text in zip(parts[1::2], parts[2::2]):
        said[int(number)] += text
    return {
        name: {
            **json.loads((tmp / name / "out.json").read_text()),
            "root": tmp / name,
            "stdout": out,
        }
        for name, out in zip(jobs, said)
    }


# The 2-rank runs of the default tests: one launched job (`runs` makes any other run on first use).
ON_TWO_RANKS = {
    "gpt-tp2": dict(model="gpt", strategy="fsdp_tp2", devices=2, ckpt_every=HALF),
    "llama-tp2": dict(model="llama", strategy="fsdp_tp2", devices=2),
    "gpt2-tp2": dict(model="gpt2", strategy="fsdp_tp2", devices=2),
    "gpt-hook": dict(model="gpt", hook=True, strategy="fsdp_tp2", devices=2),
    "gpt-tp2-again": dict(
        model="gpt", strategy="fsdp_tp2", devices=2, resume=f"gpt-tp2/ckpt/step={HALF}.ckpt"
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Runs made once per module, by name."""
    tmp = tmp_path_factory.mktemp("tp")
    jobs = {
        k: {**v, "resume": str(tmp / v["resume"])} if "resume" in v else v
        for k, v in ON_TWO_RANKS.items()
    }
    made = _launched(tmp, jobs)

    def get(name: str, **opts) -> dict:
        if name not in made:
            made[name] = _run(tmp / name, **opts)
        return made[name]

    return get


def single(runs, model: str, batch: int = 4) -> dict:
    extra = {"ckpt_every": 2 * HALF} if (model, batch) == ("gpt", 4) else {}
    return runs(f"{model}-single-{batch}", model=model, batch=batch, **extra)


def tp2(runs, model: str) -> dict:
    extra = {"ckpt_every": HALF} if model == "gpt" else {}
    return runs(f"{model}-tp2", model=model, strategy="fsdp_tp2", devices=2, **extra)


# --------------------------------------------------------------------------------------------------
# parity, and the bytes each rank holds
@pytest.mark.parametrize("model", ["gpt", "llama", "gpt2"])
def test_tp2_losses_equal_one_device(runs, model):
    ref, out = single(runs, model), tp2(runs, model)
    assert out["strategy"] == "fsdp_tp2"
    assert_close_losses(out["losses"], ref["losses"], RTOL, f"{model} tp=2 vs one device")
    origin = "Hugging Face tp_plan" if model == "llama" else "default plan"
    assert f"tensor parallel: tp=2, the {origin}" in out["stdout"]


@pytest.mark.parametrize("model", ["gpt", "llama", "gpt2"])
def test_tp2_splits_the_planned_layers_in_half(runs, model):
    # Per rank: the parameters TP split hold half their bytes (exactly: every size divides by 2),
    # and each rank holds the replicated rest whole, all of it sharded over a data-parallel group of
    # one: measure()'s bytes are the replicated bytes plus half the split ones.
    ref, out = single(runs, model), tp2(runs, model)
    whole = ref["ranks"][0]["measure"]["params"]
    for rank in out["ranks"]:
        assert rank["split_whole"] > 0.8 * whole  # the projections are most of these models
        assert abs(rank["split_local"] / rank["split_whole"] - 0.5) <= 0.02
        expected = whole - rank["split_whole"] / 2
        assert abs(rank["measure"]["params"] / expected - 1) <= 0.02
        # The first forward's saved activations, same micro-batch: below one device's (and so
        # below a data-parallel rank's, which holds what one device holds for its batch).
        assert rank["activations"] < ref["ranks"][0]["activations"]


def test_fsdp_x_tp_2x2_on_4_ranks(runs):
    # 2 data-parallel groups of 2 TP ranks (torchrun: the Trainer refuses 4 local ranks on 2 cores);
    # the global batch is 2 x 4, one device's is 8.
    out = runs(
        "gpt-2x2", model="gpt", strategy="fsdp_tp2", devices="auto", nproc=4, launcher="torchrun"
    )
    assert_close_losses(out["losses"], single(runs, "gpt", 8)["losses"], RTOL, "gpt 2x2")
    for rank in out["ranks"]:  # FSDP halves the split halves again, and the replicated rest
        whole = rank["all_whole"]
        assert abs(rank["measure"]["params"] / (whole / 2 - rank["split_whole"] / 4) - 1) <= 0.02


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_fsdp_x_tp_2x2_hf(runs, model):
    out = runs(
        f"{model}-2x2",
        model=model,
        strategy="fsdp_tp2",
        devices="auto",
        nproc=4,
        launcher="torchrun",
    )
    assert_close_losses(out["losses"], single(runs, model, 8)["losses"], RTOL, f"{model} 2x2")


def test_the_users_own_plan_in_configure_tensor_parallel(runs):
    out = runs("gpt-hook")
    assert "plan from ByHand.configure_tensor_parallel" in out["stdout"]
    assert_close_losses(out["losses"], single(runs, "gpt")["losses"], RTOL, "hook vs one device")
    assert out["ranks"][0]["split_local"] * 2 == out["ranks"][0]["split_whole"] > 0


# --------------------------------------------------------------------------------------------------
# checkpoints
def test_resume_under_the_same_tp_degree_and_on_one_device(runs, tmp_path):
    straight = tp2(runs, "gpt")
    ckpt = straight["root"] / "ckpt" / f"step={HALF}.ckpt"
    again = runs("gpt-tp2-again")  # from ckpt
    assert again["losses"] == straight["losses"][2 * HALF :]  # exact: same layout, same ranks
    one = _run(tmp_path / "one", model="gpt", resume=str(ckpt))  # tp 2 -> 1: the neutral form
    assert_close_losses(one["losses"], straight["losses"][2 * HALF :], RTOL, "tp2 -> single")


def test_consolidated_weights_load_into_the_plain_module(runs, tmp_path):
    # The tp=2 run's last checkpoint and one device's, each consolidated to one safetensors file:
    # both load strictly into the plain module (tied head included) and give the same logits.
    import lightspeed as ls
    from tp_script import CausalLM

    plain = {}
    for name, run in (("tp2", tp2(runs, "gpt")), ("one", single(runs, "gpt"))):
        ls.consolidate(run["root"] / "ckpt" / "last.ckpt", tmp_path / f"{name}.safetensors")
        plain[name] = CausalLM("gpt")
        plain[name].configure_model()
        state = load_file(str(tmp_path / f"{name}.safetensors"))
        plain[name].load_state_dict(state, strict=True)
        assert torch.equal(state["model.lm_head.weight"], state["model.wte.weight"])
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(plain["tp2"].model(ids), plain["one"].model(ids), rtol=0, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("target, devices, batch", [("fsdp", 2, 2), ("deepspeed_stage_3", 2, 2)])
def test_a_tp2_checkpoint_resumes_under_another_strategy(runs, tmp_path, target, devices, batch):
    straight = tp2(runs, "gpt")
    ckpt = straight["root"] / "ckpt" / f"step={HALF}.ckpt"
    out = _run(
        tmp_path / target,
        model="gpt",
        strategy=target,
        devices=devices,
        batch=batch,
        resume=str(ckpt),
    )
    assert_close_losses(out["losses"], straight["losses"][2 * HALF :], RTOL, f"tp2 -> {target}")


@pytest.mark.slow
@pytest.mark.parametrize("source, devices, batch", [("single", 1, 4), ("deepspeed_stage_3", 2, 2)])
def test_a_checkpoint_resumes_under_tp2(runs, tmp_path, source, devices, batch):
    first = _run(
        tmp_path / "first",
        model="gpt",
        strategy=source,
        devices=devices,
        batch=batch,
        steps=HALF,
        ckpt_every=HALF,
    )
    ckpt = first["root"] / "ckpt" / f"step={HALF}.ckpt"
    out = _run(tmp_path / "tp2", model="gpt", strategy="fsdp_tp2", devices=2, resume=str(ckpt))
    straight = tp2(runs, "gpt")["losses"][2 * HALF :]
    assert_close_losses(out["losses"], straight, RTOL, f"{source} -> tp2")


# --------------------------------------------------------------------------------------------------
# bad input: before any rank starts, or on every rank alike at setup
def test_a_world_size_tp_does_not_divide_is_refused_before_launch():
    import lightspeed as ls
    from lightspeed.strategies.fsdp import FSDP

    with pytest.raises(ConfigError, match=r"FSDP\(tp=2\) needs a world size divisible by 2.*is 1"):
        ls.Trainer(strategy="fsdp_tp2", devices=1, accelerator="cpu")
    with pytest.raises(ConfigError, match=r"FSDP\(tp=4\).*world size is 2.*\[1, 2\]"):
        ls.Trainer(strategy=FSDP(tp=4), devices=2, accelerator="cpu")
    with pytest.raises(ConfigError, match=r"FSDP\(tp=0\) is not valid: use a positive int"):
        FSDP(tp=0)
    # DeepSpeed's AutoTP: the config's degree is DeepSpeed(tp=)'s; ZeRO-3 with it is not offered
    with pytest.raises(ConfigError, match=r"DeepSpeed\(stage=3, tp=2\) is not offered"):
        ls.DeepSpeed(stage=3, config={"tensor_parallel": {"autotp_size": 2}})


def _gpt():
    from tp_script import build

    return build("gpt")


def test_plans_name_the_common_shapes():
    from lightspeed.strategies.tensor_parallel import default_plan, hf_plan
    from tp_script import build

    assert default_plan(_gpt()) == {
        **{f"blocks.{i}.attn.qkv": "fused_colwise" for i in range(2)},
        **{f"blocks.{i}.attn.proj": "rowwise" for i in range(2)},
        **{f"blocks.{i}.mlp.0": "colwise" for i in range(2)},
        **{f"blocks.{i}.mlp.2": "rowwise" for i in range(2)},
    }
    gpt2 = default_plan(build("gpt2"))
    assert gpt2["transformer.h.0.attn.c_attn"] == "fused_colwise"
    assert gpt2["transformer.h.1.mlp.c_fc"] == "colwise"
    assert {gpt2["transformer.h.0.attn.c_proj"], gpt2["transformer.h.0.mlp.c_proj"]} == {"rowwise"}
    plan, owner = hf_plan(build("llama"))
    assert owner == "LlamaForCausalLM" and plan["model.layers.*.self_attn.k_proj"] == "colwise"
    assert plan["lm_head"] == "colwise_gather_output"
    assert hf_plan(build("gpt2")) is None  # GPT-2 carries no plan: the default one applies


def test_bad_plans_are_config_errors():
    from lightspeed.strategies.tensor_parallel import check_plan, expand, hf_plan
    from tp_script import build

    gpt = _gpt()
    with pytest.raises(
        ConfigError,
        match=r"'blocks\.\*\.attn\.q_proj' names no module of GPT.*"
        r"blocks\.\*\.attn\.qkv",
    ):
        expand(gpt, {"blocks.*.attn.q_proj": "colwise"}, "FSDP(tp_plan=...)", strict=True)
    with pytest.raises(ConfigError, match=r"'diagonal' is not a tensor-parallel style"):
        expand(gpt, {"blocks.*.attn.qkv": "diagonal"}, "FSDP(tp_plan=...)", strict=True)
    with pytest.raises(ConfigError, match=r"tp=8 does not divide blocks\.0\.attn's n_head=4"):
        check_plan(gpt, {"blocks.0.attn.qkv": "fused_colwise"}, 8, "default")
    llama = build("llama", kv_heads=1)
    plan = expand(llama, hf_plan(llama)[0], "hf", strict=False)
    with pytest.raises(ConfigError, match=r"tp=2 does not divide .*num_key_value_heads=1"):
        check_plan(llama, plan, 2, "hf")
    odd = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 9), torch.nn.Linear(9, 8))])
    with pytest.raises(ConfigError, match=r"tp=2 does not divide 0\.0's 9 output features"):
        check_plan(odd, {"0.0": "colwise"}, 2, "default")
    with pytest.raises(ConfigError, match=r"'ln1' is a LayerNorm"):
        check_plan(gpt.blocks[0], {"ln1": "colwise"}, 2, "tp_plan=")


@pytest.mark.slow
def test_a_plan_error_stops_every_rank(tmp_path):
    opts = dict(model="llama", kv_heads=1, strategy="fsdp_tp2", devices=2, steps=1)
    (tmp_path / "r").mkdir()
    opts = {**opts, "root": str(tmp_path / "r"), "out": str(tmp_path / "r" / "out.json")}
    run = launch([str(SCRIPT), json.dumps(opts)], tmp_path / "r", "python", 1, timeout=200)
    assert run.returncode != 0 and "num_key_value_heads=1" in run.stderr
