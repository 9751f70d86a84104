"""DeepSpeed strategy on 2 CPU ranks (gloo, DeepSpeed's CPU accelerator): parity, checkpoints,
stage-3 sharding, the configure_deepspeed hook, and every bad input (precision="16-mixed" among
them: DeepSpeed has no fp16 on CPU). Real ranks via tests/workload.py; nothing is mocked.

The training runs share one shape: 5 batches per epoch, 2 epochs, accumulation 2 (so each epoch ends
with a partial window of one batch), clipping at 1.0, 6 optimizer steps, global batch 8.

Tolerances (fp32, relative, per micro-batch loss):
  - DDP vs ZeRO 1/2/3 (2 and 3 also with activation checkpointing) and stage-3 optimizer offload:
  1e-5.
    Observed on this machine: 0 (bit-identical) for stages 1, 2, 3; offload (DeepSpeedCPUAdam
    instead of torch AdamW) ≤1e-6. Only reduction order and the CPU Adam kernel's arithmetic can
    differ.
  - Resume: 1e-6 (the same computation replayed from saved state). Consolidated weights: exact
  outputs.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

import lightspeed as ls
from helpers import ROOT, assert_close_losses, run_jobs, run_workload
from lightspeed.errors import ConfigError

RUN = dict(devices=2, batch_size=2, accumulate=2, clip=1.0, max_epochs=2, limit_train_batches=5)
PARITY_RTOL, RESUME_RTOL = 1e-5, 1e-6
PARITY_DEFAULT = ("deepspeed_stage_1", "ac_stage_3", "unpinned_stage_3_offload")


STEP2 = "checkpoints/epoch=0-step=2.ckpt"
HOOK = {
    "zero_optimization": {"reduce_bucket_size": 12345, "allgather_bucket_size": 23456},
    "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
}


def parity_opts(strategy: str) -> dict:
    # ac_stage_N goes through the object form with activation checkpointing.
    # unpinned_stage_3_offload is how the largest model was trained on one H200
    # (docs/benchmarks.md): ZeRO-3, optimizer offloaded, pageable host buffers.
    if strategy.startswith("ac_"):
        return dict(ds={"stage": int(strategy[-1]), "ac": True}, **RUN)
    if strategy == "unpinned_stage_3_offload":
        return dict(ds={"stage": 3, "offload_optimizer": "cpu", "pin_memory": False}, **RUN)
    return dict(strategy=strategy, **RUN)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """The 2-rank runs of the default tests below, in one launched job (helpers.run_jobs): the
    ranks start once for eight fits. The stage-3 run doubles as the checkpoint run: saves at steps
    2, 4, 6, validates, probes the outputs; a fit resumes from its step 2 and an evaluation-only
    run validates its last checkpoint. Name -> rank 0's result, with "root"."""
    tmp = tmp_path_factory.mktemp("deepspeed")
    stage3 = tmp / "stage3"
    return run_jobs(
        tmp,
        {
            "ddp": dict(strategy="ddp", **RUN),
            "stage3": dict(
                strategy="deepspeed_stage_3",
                ckpt_every=2,
                validate=True,
                probe=str(stage3 / "probe.pt"),
                **RUN,
            ),
            "resumed": dict(strategy="deepspeed_stage_3", resume=str(stage3 / STEP2), **RUN),
            "evaluated": dict(
                strategy="deepspeed_stage_3", fit=False, resume=str(stage3 / "checkpoints"), **RUN
            ),
            **{name: parity_opts(name) for name in PARITY_DEFAULT},
            "hook": dict(strategy="deepspeed_stage_2", devices=2, max_steps=2, ds_hook=HOOK),
        },
    )


@pytest.fixture(scope="module")
def ddp(runs):
    return runs["ddp"]


@pytest.fixture(scope="module")
def stage3(runs):
    return runs["stage3"]["root"], runs["stage3"]


def test_stage3_parity_sharding_and_steps(ddp, stage3):
    root, out = stage3
    assert out["strategy"] == "deepspeed_stage_3"
    assert len(out["losses"]) == 10 and out["global_step"] == 6 == out["deepspeed"]["global_steps"]
    assert_close_losses(out["losses"], ddp["losses"], PARITY_RTOL, "deepspeed_stage_3 vs ddp")
    shares, total = out["deepspeed"]["local_params"], out["deepspeed"]["total_params"]
    assert len(shares) == 2 and all(abs(s - total / 2) <= 0.01 * total for s in shares), (
        shares,
        total,
    )


@pytest.mark.parametrize(
    "strategy",
    [
        # ZeRO-1's one default cell (test_strategies' ZeRO-1 cells are slow); activation
        # checkpointing under ZeRO-2 repeats ZeRO-3's recomputation path
        "deepspeed_stage_1",
        pytest.param("ac_stage_2", marks=pytest.mark.slow),
        "ac_stage_3",
        "unpinned_stage_3_offload",
    ],
)
def test_parity_with_ddp(tmp_path, runs, ddp, strategy):
    # ac_stage_N: recomputation must not change losses, also under stage 3, where the recomputed
    # forward gathers the partitioned parameters again. (The string form
    # "deepspeed_stage_2_offload" is in test_strategies.)
    out = runs.get(strategy) or run_workload(tmp_path, **parity_opts(strategy))
    assert out["global_step"] == 6 == out["deepspeed"]["global_steps"]
    assert_close_losses(out["losses"], ddp["losses"], PARITY_RTOL, f"{strategy} vs ddp")
    if strategy.endswith("offload"):
        assert out["deepspeed"]["optimizer"] == "DeepSpeedCPUAdam"
        assert (
            out["deepspeed"]["config"]["zero_optimization"]["offload_optimizer"]["pin_memory"]
            is False
        )


def test_consolidate_loads_into_plain_gpt(stage3, tmp_path):
    from lightspeed.demos.gpt import GPT, SIZES

    root, _ = stage3
    sd = ls.full_state_dict(root / "checkpoints")  # the folder: its `last`, step 6
    out = ls.consolidate(root / "checkpoints", tmp_path / "gpt.safetensors")
    from safetensors.torch import load_file

    assert set(load_file(out)) == set(sd)
    assert "model.lm_head.weight" in sd and torch.equal(
        sd["model.lm_head.weight"], sd["model.wte.weight"]
    )
    model = GPT(dataclasses.replace(SIZES["tiny"], bias=False))  # the workload's model
    model.load_state_dict(
        {k.removeprefix("model."): v for k, v in load_file(out).items()}, strict=True
    )
    probe = torch.load(root / "probe.pt")
    with torch.no_grad():
        assert torch.equal(model.eval()(probe["x"]), probe["logits"])


def test_resume_is_exact_and_evaluation_only_engine(runs, stage3):
    root, straight = stage3
    assert sorted((root / "checkpoints").glob("*step=2.ckpt")) == [root / STEP2]
    resumed = runs["resumed"]
    assert resumed["global_step"] == 6 == resumed["deepspeed"]["global_steps"]
    assert_close_losses(
        resumed["losses"], straight["losses"][4:], RESUME_RTOL, "resumed vs straight"
    )
    # validate without fit: an engine without an optimizer, weights merged from the ZeRO shards
    evaluated = runs["evaluated"]
    assert evaluated["deepspeed"]["optimizers"] == 0
    got, want = evaluated["validate"][0]["val_loss"], straight["validate"][0]["val_loss"]
    assert abs(got - want) <= 1e-6 * abs(want), (got, want)


def test_configure_deepspeed_hook_changes_buckets_and_optimizer(runs):
    out = runs["hook"]
    zero = out["deepspeed"]["config"]["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["allgather_bucket_size"]) == (12345, 23456)
    assert out["deepspeed"]["optimizer"] == "SGD" and out["deepspeed"]["lr"] == [0.05]
    assert out["global_step"] == 2


# ---------------------------------------------------------------------- bad input
def test_errors_raised_at_construction(tmp_path):
    with pytest.raises(ConfigError, match="nvme_path"):
        ls.DeepSpeed(stage=3, offload_optimizer="nvme")
    with pytest.raises(ConfigError, match="nvme_path"):
        ls.Trainer(
            strategy="deepspeed_stage_3_offload_nvme", devices=2, accelerator="cpu", logger=False
        )
    with pytest.raises(ConfigError, match="does not exist"):
        ls.DeepSpeed(config=str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text(
        '{\n  "train_micro_batch_size_per_gpu": 2,\n  "zero_optimization": {stage: 2}\n}\n'
    )
    with pytest.raises(ConfigError, match=r"bad\.json.*line 3"):
        ls.DeepSpeed(config=bad)
    with pytest.raises(ConfigError, match="deepspeed_stage_4.*deepspeed_stage_3_offload"):
        ls.Trainer(strategy="deepspeed_stage_4", devices=2, accelerator="cpu", logger=False)
    with pytest.raises(ConfigError, match="offload_params.*stage=3"):
        ls.DeepSpeed(stage=2, offload_params="cpu")
    with pytest.raises(
        ConfigError, match="pin_memory=False needs offload_optimizer or offload_params"
    ):
        ls.DeepSpeed(stage=3, pin_memory=False)
    with pytest.raises(
        ConfigError, match="pin_memory='no' is not valid: use None .pinned on CUDA., True or False"
    ):
        ls.DeepSpeed(stage=3, offload_optimizer="cpu", pin_memory="no")


def test_deepspeed_missing_gives_install_hint():
    # `import deepspeed` fails in this subprocess as it would without the package.
    script = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "import lightspeed as ls\n"
        "try:\n    ls.Trainer(strategy='deepspeed_stage_2', devices=2, accelerator='cpu', "
        "logger=False)\n"
        "except ls.ConfigError as e:\n    print('ERR', e)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert "ERR" in proc.stdout and "pip install" in proc.stdout, proc.stdout + proc.stderr


def test_errors_at_setup(tmp_path):
    """Errors that need the Trainer's flags or the model: one process, one Trainer per case, one
    message each."""
    script = f"""
import json, sys
sys.path.insert(0, {str(ROOT / "tests")!r})
import torch
from torch.utils.data import DataLoader
import lightspeed as ls
from workload import Workload
from lightspeed.demos.gpt import SIZES, ByteWindows, stdlib_corpus

data = DataLoader(ByteWindows(stdlib_corpus(20_000), SIZES["tiny"].block_size), batch_size=4)
cases = [
    ("two_optimizers", dict(strategy="deepspeed_stage_2"), {{"two_optimizers": True}}),
    ("clip_value", dict(strategy="deepspeed_stage_2", gradient_clip_val=1.0, gradient_clip_algorithm="value"), {{}}),
    ("contradiction", dict(strategy=ls.DeepSpeed(config={{"gradient_accumulation_steps": 4}}),
                           accumulate_grad_batches=2), {{}}),
    ("no_optimizer", dict(strategy="deepspeed_stage_2"), {{"no_optimizer": True}}),
    ("fp16_cpu", dict(strategy="deepspeed_stage_2", precision="16-mixed"), {{}}),
]
messages = {{}}
for name, flags, opts in cases:
    module = Workload(opts)
    if opts.get("no_optimizer"):
        module.configure_optimizers = lambda: None
    try:  # clip_value fails at construction (before any rank starts), the others at fit
        trainer = ls.Trainer(devices=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, max_steps=1, **flags)
        trainer.fit(module, data)
        messages[name] = "no error"
    except ls.ConfigError as e:
        messages[name] = str(e)
print("RESULT" + json.dumps(messages))
"""
    proc = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    messages = json.loads(line[len("RESULT") :])
    assert (
        "2 optimizers" in messages["two_optimizers"]
        and "one optimizer" in messages["two_optimizers"]
    )
    assert "gradient_clip_algorithm='value'" in messages["clip_value"]
    assert (
        "gradient_accumulation_steps=4" in messages["contradiction"]
        and "accumulate_grad_batches=2" in messages["contradiction"]
    )
    assert "'optimizer' section" in messages["no_optimizer"]
    # DeepSpeed's CPU accelerator has no fp16: refused at connect, before the engine, naming what
    # works.
    assert "precision='16-mixed' is not valid with DeepSpeed on cpu" in messages["fp16_cpu"]
    assert "'bf16-mixed'" in messages["fp16_cpu"]


def test_host_memory_warning_matches_the_h200_runs():
    # The three offloaded ZeRO-3 runs of docs/benchmarks.md on the one-GPU host (125 GiB): what
    # trained gets no
    # warning, what the OS killed does. The estimate is the docstring's bytes per parameter; no
    # DeepSpeed needed.
    from lightspeed.strategies.deepspeed.host_memory import host_memory_warning

    host = 125 * 2**30
    one_gpu = dict(stage=3, node_share=1.0, host_bytes=host)
    # 5.91B, optimizer offloaded to pageable memory: trained, host peak 102.7 GiB.
    assert (
        host_memory_warning(
            5_906_581_504, offload_optimizer="cpu", offload_params=None, pinned=False, **one_gpu
        )
        is None
    )
    # 4.09B, optimizer and parameters offloaded, pinned: trained.
    assert (
        host_memory_warning(
            4_094_494_720, offload_optimizer="cpu", offload_params="cpu", pinned=True, **one_gpu
        )
        is None
    )
    # 5.77B, the same configuration: killed without a traceback. The warning names the way out.
    warning = host_memory_warning(
        5_771_000_000, offload_optimizer="cpu", offload_params="cpu", pinned=True, **one_gpu
    )
    assert (
        warning is not None
        and "5.77B" in warning
        and "pin_memory=False" in warning
        and "125 GiB" in warning
    )
    # Past what the host holds even unpinned, the advice changes; 8 ranks on 2 nodes hold half each.
    too_big = host_memory_warning(
        8_000_000_000, offload_optimizer="cpu", offload_params="cpu", pinned=False, **one_gpu
    )
    assert too_big is not None and "may kill the ranks" in too_big and "nvme" in too_big
    assert (
        host_memory_warning(
            8_000_000_000,
            offload_optimizer="cpu",
            offload_params="cpu",
            pinned=False,
            stage=3,
            node_share=0.5,
            host_bytes=host,
        )
        is None
    )


def test_zero3_leaf_modules_are_the_repeated_blocks_and_bad_values_are_refused():
    """Under stage 3 each repeated block is one ZeRO-3 leaf module (its parameters fetched at once,
    one hook per block: docs/benchmarks.md measures 1.4x DeepSpeed's default loop on one H200); the
    stage-3 parity test above runs with them. `leaf_modules=[]` marks nothing; a class that is not
    in the model, or a non-class, is a ConfigError."""
    import deepspeed

    from lightspeed.demos.gpt import GPT, SIZES, Block
    from lightspeed.strategies.deepspeed.zero3 import (
        DS_PREFETCH_BUCKET,
        mark_leaf_modules,
        prefetch_bucket,
    )

    model = GPT(dataclasses.replace(SIZES["tiny"], vocab_size=64))
    largest = mark_leaf_modules(deepspeed, model, None)
    leaves = [m for m in model.modules() if getattr(m, "_z3_leaf", False)]
    assert leaves and all(isinstance(m, Block) for m in leaves) and len(leaves) == model.cfg.n_layer
    assert largest == sum(p.numel() for p in leaves[0].parameters())
    # The prefetch bucket (GPUs): two blocks ahead, never below DeepSpeed's default; a d=2048 GPT
    # block is 12·d².
    assert prefetch_bucket(largest) == DS_PREFETCH_BUCKET and prefetch_bucket(
        12 * 2048**2 + 6 * 2048
    ) == 2 * (12 * 2048**2 + 6 * 2048)
    plain = GPT(dataclasses.replace(SIZES["tiny"], vocab_size=64))
    assert mark_leaf_modules(deepspeed, plain, []) == 0
    assert not any(getattr(m, "_z3_leaf", False) for m in plain.modules())
    with pytest.raises(ConfigError, match=r"leaf_modules names \['GRU'\].*GPT does not contain"):
        mark_leaf_modules(deepspeed, plain, [torch.nn.GRU])
    with pytest.raises(ConfigError, match="leaf_modules='Block' is not valid: use None"):
        ls.DeepSpeed(stage=3, leaf_modules="Block")


def test_deepcompile_is_the_flag_or_deepspeeds_own_config_key():
    """DeepSpeed's DeepCompile is on with `DeepSpeed(deepcompile=True)` or with the config key
    DeepSpeed users already write, `compile.deepcompile` (DeepSpeed acts on it only once
    `engine.compile()` is called, which the strategy does); off otherwise. The measured run and the
    GPU parity test are on CUDA (DeepCompile runs there only; tests/test_gpu.py); the refusals are
    in test_bad_input_catalogue.py."""
    assert ls.DeepSpeed(stage=3, deepcompile=True).deepcompile is True
    assert ls.DeepSpeed(stage=3, config={"compile": {"deepcompile": True}}).deepcompile is True
    assert ls.DeepSpeed(stage=3, config={"compile": {"deepcompile": False}}).deepcompile is False
    assert ls.DeepSpeed(stage=3).deepcompile is False and ls.DeepSpeed(stage=2).deepcompile is False


def test_deepcompile_schedule_is_deepspeeds_default_from_the_engines_step():
    """The pass schedule `DeepSpeed(deepcompile=True)` hands `engine.compile()` is DeepSpeed's own
    ZeRO-3 default moved to the engine's step (a resumed engine starts at its checkpoint's step,
    where DeepSpeed's default, counted from 0, would launch no pass), and DeepSpeed's pass contracts
    accept it (checked with DeepSpeed's validator and pass registry; a prefetch without the gather
    pass before it is refused the same way)."""
    from deepspeed.compile import backend
    from deepspeed.compile.init_z3 import WARMUP
    from deepspeed.compile.passes import prefetch, selective_gather, zero3_compile
    from deepspeed.compile.passes.contract import PassContractError, validate_schedule

    from lightspeed.strategies.deepspeed.zero3 import (
        DEEPCOMPILE_WARMUP,
        PREFETCH,
        deepcompile_schedule,
        prefetch_where_gathered,
    )

    assert DEEPCOMPILE_WARMUP == WARMUP
    for mod, fn in (
        (zero3_compile, zero3_compile.add_z3_gather_release),
        (prefetch, prefetch.schedule_prefetch),
        (selective_gather, selective_gather.selective_gather),
    ):
        backend.register_compile_pass(
            mod.NAME, fn, mod.CONTRACT
        )  # what a CUDA engine registers at its start
    backend.register_compile_pass(
        PREFETCH, prefetch_where_gathered, prefetch.CONTRACT
    )  # what start_deepcompile adds
    assert deepcompile_schedule(0)[0] == (0, [zero3_compile.NAME])
    assert deepcompile_schedule(5)[1] == (
        5 + WARMUP,
        [zero3_compile.NAME, PREFETCH, selective_gather.NAME],
    )
    validate_schedule(deepcompile_schedule(5), backend.opt_passes)
    for name in (prefetch.NAME, PREFETCH):
        with pytest.raises(PassContractError, match="requires"):
            validate_schedule([(5, [name])], backend.opt_passes)


def test_deepcompile_prefetch_leaves_graphs_without_gathers_alone():
    """A graph with no inputs (what a graph break in `training_step` can leave, e.g. a constant
    built for `self.log`) fails DeepSpeed 0.19's `schedule_prefetch` with a bare AssertionError
    (seen on an H200); lightspeed's prefetch returns None for it (graph unchanged, as DeepSpeed's
    pass runner reads None) without running DeepSpeed's pass, and hands a graph that gathers
    parameters to DeepSpeed's pass."""
    from types import SimpleNamespace

    import torch.fx

    from lightspeed.strategies.deepspeed.zero3 import prefetch_where_gathered

    class Constant(torch.nn.Module):
        def forward(self):
            return torch.ones(2) * 3

    gm = torch.fx.symbolic_trace(Constant())
    assert not [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert prefetch_where_gathered(gm, 0, [], {}, None, 0.0, {}, False) is None

    # stands for torch.ops.dc.allgather_param.default (CUDA-only), which prints under this name
    class Gather:
        __name__ = "allgather_param"

        def __call__(self, x):
            return x

        def __str__(self):
            return "dc.allgather_param.default"

    graph = torch.fx.Graph()
    graph.output(graph.call_function(Gather(), (graph.placeholder("w"),)))
    with pytest.raises(
        KeyError
    ):  # a graph that gathers reaches DeepSpeed's pass, which looks up its profile
        prefetch_where_gathered(SimpleNamespace(graph=graph), 0, [], {}, None, 0.0, {}, False)


def test_zero3_with_hooks_on_several_gpus_suggests_deepcompile_where_it_could_run():
    """Rank 0 is told about `deepcompile=True` where it could replace ZeRO-3's hooks: stage 3 on
    several CUDA GPUs, nothing DeepCompile refuses (offload, manual optimization, the Trainer's
    compile, named leaf modules). Nowhere else: one GPU, CPU ranks (every test here), other stages,
    or with the flag already on."""
    from lightspeed.runtime.launch import DistInfo
    from lightspeed.specs import RunSpec
    from lightspeed.strategies.deepspeed.zero3 import deepcompile_hint

    def hint(world_size=2, device="cuda", spec=None, **strategy):
        s = ls.DeepSpeed(**{"stage": 3, **strategy})
        s.spec, s.dist = (
            spec or RunSpec(device_type=device),
            DistInfo(world_size=world_size, local_world_size=2),
        )
        s.device = torch.device(device, 0) if device == "cuda" else torch.device(device)
        return deepcompile_hint(s)

    line = hint()
    assert "2 GPUs" in line and "deepcompile=True" in line and "docs/benchmarks.md" in line
    for quiet in (
        hint(world_size=1),
        hint(device="cpu"),
        hint(stage=2),
        hint(offload_optimizer="cpu"),
        hint(deepcompile=True),
        hint(leaf_modules=[torch.nn.Linear]),
        hint(spec=RunSpec(device_type="cuda", compile=True)),
        hint(spec=RunSpec(device_type="cuda", automatic_optimization=False)),
    ):
        assert quiet is None
