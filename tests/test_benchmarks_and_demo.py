"""The benchmark scripts and the demo, run at tiny sizes on CPU so they cannot rot (no timing
asserts)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


def _run(args: list[str], cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


# the benchmarks' tiny CPU runs: `pytest -m slow`; benchmarks/gpu.sh runs them for real
@pytest.mark.slow
def test_speed_single_gpu_tiny_runs_every_kind_of_setup(tmp_path):
    names = "plain_pytorch,plain_deepspeed_zero2,single,deepspeed_stage_2,fsdp+ac"
    out = tmp_path / "r.json"
    proc = _run(
        [
            str(ROOT / "benchmarks" / "speed_single_gpu.py"),
            "--tiny",
            "--only",
            names,
            "--steps",
            "3",
            "--warmup",
            "1",
            "--json",
            str(out),
        ],
        tmp_path,
    )
    results = {r["name"]: r for r in json.loads(out.read_text())}
    assert set(results) == set(names.split(","))
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert r["tok_s"] > 0 and r["timed_steps"] == 3
    assert "× plain PyTorch" in proc.stdout and "deepspeed_stage_2" in proc.stdout


@pytest.mark.slow
def test_input_pipeline_tiny_runs_the_plain_loops_and_lightspeed(tmp_path):
    """benchmarks/input_pipeline.py (float inputs from a DataLoader) at a tiny ViT on CPU: every kind of
    setup runs."""
    names = (
        "plain,plain+pin+stream,single,single+as_given,plain_deepspeed,deepspeed_stage_2,plain+pin+aug_cpu,"
        "single+aug_gpu"
    )
    out = tmp_path / "i.json"
    proc = _run(
        [
            str(ROOT / "benchmarks" / "input_pipeline.py"),
            "--tiny",
            "--only",
            names,
            "--steps",
            "3",
            "--warmup",
            "1",
            "--repeats",
            "1",
            "--workers",
            "0",
            "--json",
            str(out),
        ],
        tmp_path,
    )
    results = {r["name"]: r for r in json.loads(out.read_text())}
    assert set(results) == set(names.split(","))
    for name, r in results.items():
        assert "error" not in r, f"{name}: {r.get('error')}"
        assert (
            r["tok_s"] > 0 and r["timed_steps"] == 3 and r["data_wait"] is None
        )  # no CUDA, no wait measured
    assert (
        "× plain+pin" in proc.stdout
        and "single+as_given" in proc.stdout
        and "× plain_deepspeed" in proc.stdout
    )
    assert "× plain+pin+aug_cpu" in proc.stdout


def test_loop_overhead_benchmark_prints_ratio(tmp_path):
    proc = _run(
        [
            str(ROOT / "benchmarks" / "loop_overhead.py"),
            "--size",
            "tiny",
            "--steps",
            "8",
            "--repeats",
            "1",
        ],
        tmp_path,
    )
    assert "ratio to plain loop" in proc.stdout and "lightspeed Trainer" in proc.stdout


@pytest.mark.slow  # tests/test_commands.py runs the demo (and inspect, report) by default
def test_demo_trains_and_shows_summary(tmp_path):
    proc = _run(
        [
            "-m",
            "lightspeed.commands",
            "demo",
            "--size",
            "tiny",
            "--max-steps",
            "12",
            "--root",
            str(tmp_path / "d"),
        ],
        tmp_path,
    )
    out = proc.stdout
    for row in (
        "strategy",
        "deepspeed_stage_2",
        "tokens/s",
        "peak memory",
        "first loss",
        "last loss",
        "checkpoint",
    ):
        assert row in out, f"summary lacks {row!r}:\n{out[-3000:]}"

    def row_value(label: str) -> float:
        line = next(ln for ln in out.splitlines() if label in ln)
        return float(re.findall(r"\d+\.\d+", line)[-1])

    first, last = row_value("first loss"), row_value("last loss")
    assert last < first
    assert (tmp_path / "d" / "demo-gpt.safetensors").exists()
    assert (tmp_path / "d" / "checkpoints" / "last.ckpt" / "meta.json").exists()
    if not torch.cuda.is_available():
        assert re.search(r"devices\s*│\s*2 × cpu", out), out[
            -3000:
        ]  # the default off CUDA: 2 CPU ranks


@pytest.mark.gpu
def test_demo_runs_as_it_is_on_a_gpu_machine(tmp_path):
    """`make demo` on a GPU machine uses every GPU CUDA sees. The default was 2 devices, which
    stopped a one-GPU machine with "devices=2 is not valid"."""
    proc = _run(
        [
            "-m",
            "lightspeed.commands",
            "demo",
            "--size",
            "tiny",
            "--max-steps",
            "12",
            "--root",
            str(tmp_path / "d"),
        ],
        tmp_path,
    )
    assert re.search(rf"devices\s*│\s*{torch.cuda.device_count()} × cuda", proc.stdout), (
        proc.stdout[-3000:]
    )


# the same parity as test_strategies.py's conformance cells, through the benchmark script
@pytest.mark.slow
def test_scaling_multi_gpu_parity_section_on_cpu_ranks(tmp_path):
    """benchmarks/scaling_multi_gpu.py on 2 gloo ranks with the tiny GPT: every strategy reports the same
    losses, the ZeRO-3 fetch variant too (`+fastleaf+events9`: DeepSpeed's fast leaf fetch and 9
    queued fetch events), whose run says what every rank's parameter coordinator was built with."""
    out = tmp_path / "m.json"
    names = ["ddp", "fsdp", "deepspeed_stage_3", "deepspeed_stage_3+fastleaf+events9"]
    _run(
        [
            str(ROOT / "benchmarks" / "scaling_multi_gpu.py"),
            "--cpu",
            "--tiny",
            "--devices",
            "2",
            "--sections",
            "parity",
            "--strategies",
            ",".join(names),
            "--steps",
            "3",
            "--warmup",
            "1",
            "--parity-rtol",
            "1e-5",
            "--json",
            str(out),
        ],
        tmp_path,
        timeout=600,
    )
    results = list(json.loads(out.read_text()).values())  # every run, in the order it was made
    assert [r["strategy"] for r in results] == names
    ref = results[0]["losses"]
    for r in results:
        assert "error" not in r, r
        assert len(r["losses"]) == 4
        assert max(abs(a - b) / b for a, b in zip(r["losses"], ref)) <= 1e-5, r["strategy"]
    assert results[2]["zero3_fetch"] is None and results[3]["zero3_fetch"] == {
        "fast_leaf": True,
        "events": 9,
    }


def test_suite_table_pairs_each_figure_with_its_baseline(tmp_path):
    """Windows of one run are samples (median, spread); the table takes each ratio against the same
    run's baseline and each scaling efficiency against the suite's one-GPU run of the same
    strategy."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from speed_single_gpu import summarize, windows

    assert windows([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 3) == [1.5, 3.5, 6.0]
    s = summarize(
        "single+user", [{"name": "single+user", "tok_s": 99.0, "window_tok_s": [98.0, 99.0, 103.0]}]
    )
    assert (s["tok_s"], s["samples"], round(s["spread"], 4)) == (99.0, 3, round(5 / 99, 4))
    suite = [
        summarize(n, [{"name": n, "tok_s": t, "window_tok_s": [t, t, t], "peak_gib": 1.0}])
        for n, t in (
            ("plain_pytorch", 100.0),
            ("single+user", 99.5),
            ("ddp+user", 90.0),
            ("plain_deepspeed_zero3", 50.0),
            ("deepspeed_stage_3+user+dc", 80.0),
            ("plain_deepspeed_zero3_tuned", 60.0),
            ("deepspeed_stage_3+user", 70.0),
        )
    ]
    (tmp_path / "suite_a.json").write_text(json.dumps(suite))
    (tmp_path / "scaling.json").write_text(
        json.dumps(
            {
                "ddp 2": {
                    "strategy": "ddp",
                    "devices": 2,
                    "tok_s_per_gpu": 81.0,
                    "window_tok_s": [80.0, 81.0, 82.0],
                },
                "plain_ddp 2": {
                    "strategy": "plain_ddp",
                    "devices": 2,
                    "tok_s_per_gpu": 85.0,
                    "window_tok_s": [85.0],
                },
                "z3 2": {
                    "strategy": "plain_deepspeed_zero3",
                    "devices": 2,
                    "tok_s_per_gpu": 40.0,
                    "window_tok_s": [40.0],
                },
                "z3t 2": {
                    "strategy": "plain_deepspeed_zero3_tuned",
                    "devices": 2,
                    "tok_s_per_gpu": 45.0,
                    "window_tok_s": [45.0],
                },
                "ds3 2": {
                    "strategy": "deepspeed_stage_3",
                    "devices": 2,
                    "tok_s_per_gpu": 63.0,
                    "window_tok_s": [63.0],
                },
                "dc 2": {
                    "strategy": "deepspeed_stage_3+dc",
                    "devices": 2,
                    "tok_s_per_gpu": 84.0,
                    "window_tok_s": [84.0],
                },
            }
        )
    )
    proc = _run(
        [
            str(ROOT / "benchmarks" / "suite_table.py"),
            str(tmp_path / "suite_a.json"),
            "--scaling",
            str(tmp_path / "scaling.json"),
        ],
        tmp_path,
        timeout=60,
    )
    row = {
        ln.split("│")[1].strip(): ln.split("│")[2:-1]
        for ln in proc.stdout.splitlines()
        if ln.count("│") > 2
    }
    single = "│".join(row["single+user"])
    assert "0.995" in single and "met" in single and "NOT" not in single, proc.stdout
    # columns after the strategy: 1-GPU setup, 1 GPU, 2 GPUs, efficiency, target, verdict, × DS Z3,
    # × DS Z3 tuned,
    # × plain DDP
    ddp, plain, z3 = [
        [c.strip() for c in row[k]] for k in ("ddp", "plain_ddp", "deepspeed_stage_3")
    ]
    assert (
        ddp[0] == "ddp+user" and ddp[3] == "0.900" and ddp[5] == "NOT met" and ddp[8] == "0.953"
    ), proc.stdout
    # the hand-written DDP loop against the plain PyTorch loop on one GPU, no target of its own
    assert (
        plain[0] == "plain_pytorch" and plain[3] == "0.850" and plain[4:] == ["", "", "", "", ""]
    ), proc.stdout
    # stage 3 against both hand-written ZeRO-3 loops on two GPUs: DeepSpeed's defaults and the tuned
    # settings
    assert (z3[3], z3[6], z3[7], z3[8]) == ("0.900", "1.575", "1.400", ""), proc.stdout
    # on one GPU the last stage-3 row is the one against the tuned loop (no target); the tuned loop
    # has its row
    tuned_row = "│".join(row["deepspeed_stage_3+user"])
    assert (
        "plain_deepspeed_zero3_tuned" in tuned_row
        and "1.167" in tuned_row
        and "met" not in tuned_row
    ), proc.stdout
    tuned = [
        c.strip() for c in row["plain_deepspeed_zero3_tuned"]
    ]  # its scaling row: setup and one-GPU figure
    assert tuned[:2] == ["plain_deepspeed_zero3_tuned", "60 ±0.0% (3)"], proc.stdout
    # DeepCompile's rows, present because the files have them: against DeepSpeed's ZeRO-3 loop on
    # one GPU (the
    # moonshot's row, same peak memory), and on two GPUs against its own one-GPU setup
    one_dc = "│".join(row["deepspeed_stage_3+user+dc"])
    assert "1.600" in one_dc and "met" in one_dc and "NOT" not in one_dc, proc.stdout
    dc = [c.strip() for c in row["deepspeed_stage_3+dc"]]
    assert (dc[0], dc[3], dc[5], dc[6]) == ("deepspeed_stage_3+user+dc", "1.050", "met", "2.100"), (
        proc.stdout
    )


def test_suite_table_reads_several_gpu_counts_and_zero3_memory(tmp_path):
    """Scaling files of 2 and 4 GPUs read as one: each count has its table and its bar (0.95 at 2
    GPUs, the 8-GPU bar 0.90 beyond), and ZeRO-3's memory between steps is set against 16Ψ/N, split
    by a fit through both counts into what every GPU keeps whole and what is sharded, and projected
    to 8 GPUs."""
    params = 2**28  # 16Ψ = 4 GiB: 2 GiB per GPU on 2 GPUs, 1 GiB on 4, 0.5 GiB on 8
    (tmp_path / "suite.json").write_text(
        json.dumps(
            [
                {"name": "ddp+user", "tok_s": 90.0, "spread": 0.0},
                {"name": "deepspeed_stage_3+user", "tok_s": 50.0, "spread": 0.0},
            ]
        )
    )
    runs = {
        "ddp 2": ("ddp", 2, 84.0, None),
        "ddp 4": ("ddp", 4, 85.0, None),
        "z3 2": ("deepspeed_stage_3", 2, 45.0, 2.1),
        "z3 2 #2": ("deepspeed_stage_3", 2, 46.0, 2.1),
        "z3 4": ("deepspeed_stage_3", 4, 44.0, 1.2),
    }
    for name, part in (("a", ["ddp 2", "z3 2", "z3 2 #2"]), ("b", ["ddp 4", "z3 4"])):
        (tmp_path / f"scaling_{name}.json").write_text(
            json.dumps(
                {
                    k: {
                        "strategy": runs[k][0],
                        "devices": runs[k][1],
                        "tok_s_per_gpu": runs[k][2],
                        "params": params,
                        "resting_gib": runs[k][3] if runs[k][3] is not None else float("nan"),
                    }
                    for k in part
                }
            )
        )
    proc = _run(
        [
            str(ROOT / "benchmarks" / "suite_table.py"),
            str(tmp_path / "suite.json"),
            "--scaling",
            str(tmp_path / "scaling_a.json"),
            str(tmp_path / "scaling_b.json"),
            "--devices",
            "2,4",
            "--rows",
            "ddp,deepspeed_stage_3",
        ],
        tmp_path,
        timeout=60,
    )
    cells = [
        [c.strip() for c in ln.split("│")[1:-1]]
        for ln in proc.stdout.splitlines()
        if ln.count("│") > 2
    ]
    ddp = [
        c for c in cells if c[0] == "ddp"
    ]  # strategy, 1-GPU setup, 1 GPU, N GPUs, efficiency, target, verdict
    assert [(c[4], c[5], c[6]) for c in ddp] == [
        ("0.933", "≥0.95", "NOT met"),
        ("0.944", "≥0.9", "met"),
    ], proc.stdout
    z3 = [c for c in cells if c[0] == "deepspeed_stage_3"]
    assert [c[4] for c in z3[:2]] == ["0.910", "0.880"], proc.stdout
    # setup, GPUs, GiB between steps, 16Ψ/N GiB, ratio, verdict, fit: b = (2.1 - 1.2) / (1/2 - 1/4)
    # = 3.6 GiB
    # sharded, a = 1.2 - 3.6/4 = 0.3 GiB whole, so 0.3 + 3.6/8 = 0.75 GiB projected on 8 GPUs
    # against 0.5
    memory = z3[2:]
    assert [c[1:6] for c in memory] == [
        ["2", "2.10", "2.00", "1.050", "within 10%"],
        ["4", "1.20", "1.00", "1.200", "NOT within 10%"],
        ["8 (projected)", "0.75", "0.50", "1.500", "NOT within 10%"],
    ], proc.stdout
    assert memory[2][6] == "0.30 whole + 3.60/N sharded (0.900 × 16Ψ)", proc.stdout
    # the suite's one-GPU run joins the fit where it recorded its memory between steps: 4.25 GiB at
    # N = 1 lies
    # on 0.25 + 4.0/N, as do 2.25 (2 GPUs) and 1.25 (4 GPUs), so the least-squares fit finds exactly
    # that line
    suite = json.loads((tmp_path / "suite.json").read_text())
    suite[1] |= {"resting_gib": 4.25, "params": params}
    (tmp_path / "suite.json").write_text(json.dumps(suite))
    for name, gib in (("a", 2.25), ("b", 1.25)):
        part = json.loads((tmp_path / f"scaling_{name}.json").read_text())
        for r in part.values():
            r["resting_gib"] = gib if r["strategy"] == "deepspeed_stage_3" else r["resting_gib"]
        (tmp_path / f"scaling_{name}.json").write_text(json.dumps(part))
    proc = _run(
        [
            str(ROOT / "benchmarks" / "suite_table.py"),
            str(tmp_path / "suite.json"),
            "--scaling",
            str(tmp_path / "scaling_a.json"),
            str(tmp_path / "scaling_b.json"),
            "--devices",
            "2,4",
        ],
        tmp_path,
        timeout=60,
    )
    memory = [
        c
        for c in ([c.strip() for c in ln.split("│")[1:-1]] for ln in proc.stdout.splitlines())
        if len(c) == 7 and c[0] == "deepspeed_stage_3"
    ]  # the memory table's rows (the others have 10)
    assert [c[1:5] for c in memory] == [
        ["1", "4.25", "4.00", "1.062"],
        ["2", "2.25", "2.00", "1.125"],
        ["4", "1.25", "1.00", "1.250"],
        ["8 (projected)", "0.75", "0.50", "1.500"],
    ]
    assert memory[3][6] == "0.25 whole + 4.00/N sharded (1.000 × 16Ψ)", proc.stdout
    # an 8-GPU file (gpu.sh suite's GPUS=8 layout) joins: 8 GPUs measured, on the same line, and
    # the fit's
    # value at 8 GPUs is labelled as a fit, not a projection; ddp's 8-GPU efficiency against the
    # 0.90 bar
    (tmp_path / "scaling_c.json").write_text(
        json.dumps(
            {
                "ddp 8": {
                    "strategy": "ddp",
                    "devices": 8,
                    "tok_s_per_gpu": 80.0,
                    "params": params,
                    "resting_gib": float("nan"),
                },
                "z3 8": {
                    "strategy": "deepspeed_stage_3",
                    "devices": 8,
                    "tok_s_per_gpu": 40.0,
                    "params": params,
                    "resting_gib": 0.75,
                },
            }
        )
    )
    proc = _run(
        [
            str(ROOT / "benchmarks" / "suite_table.py"),
            str(tmp_path / "suite.json"),
            "--scaling",
            *(str(tmp_path / f"scaling_{n}.json") for n in "abc"),
            "--devices",
            "2,4,8",
        ],
        tmp_path,
        timeout=60,
    )
    cells = [
        [c.strip() for c in ln.split("│")[1:-1]]
        for ln in proc.stdout.splitlines()
        if ln.count("│") > 2
    ]
    assert [(c[4], c[5], c[6]) for c in cells if c[0] == "ddp"][-1] == (
        "0.889",
        "≥0.9",
        "NOT met",
    ), proc.stdout
    memory = [c for c in cells if len(c) == 7 and c[0] == "deepspeed_stage_3"]
    assert [c[1:5] for c in memory][-2:] == [
        ["8", "0.75", "0.50", "1.500"],
        ["8 (fit)", "0.75", "0.50", "1.500"],
    ]


def test_plain_ddp_loop_on_two_cpu_ranks_lands_in_the_suite_table(tmp_path):
    """scaling_multi_gpu.py's hand-written torch DDP loop (torchrun, 2 gloo ranks, tiny GPT) reports its
    per-GPU figures, and suite_table.py pairs them with the plain PyTorch loop's one-GPU
    figure."""
    out = tmp_path / "scaling.json"
    _run(
        [
            str(ROOT / "benchmarks" / "scaling_multi_gpu.py"),
            "--cpu",
            "--tiny",
            "--devices",
            "2",
            "--sections",
            "scaling",
            "--counts",
            "2",
            "--strategies",
            "plain_ddp",
            "--repeats",
            "1",
            "--steps",
            "3",
            "--warmup",
            "1",
            "--per-run-timeout",
            "90",
            "--json",
            str(out),
        ],
        tmp_path,
        timeout=120,
    )
    (r,) = json.loads(out.read_text()).values()
    assert "error" not in r, r
    assert (r["strategy"], r["devices"], r["window_tok_s"]) == (
        "plain_ddp",
        2,
        [r["tok_s_per_gpu"]],
    ), r
    assert r["tok_s_per_gpu"] == pytest.approx(
        4 * 32 / r["step_s"]
    )  # micro-batch 4 × seq 32 per step
    one = (
        r["tok_s_per_gpu"] * 2
    )  # a one-GPU figure twice as fast: efficiency 0.5 whatever the machine's speed
    (tmp_path / "suite.json").write_text(
        json.dumps([{"name": "plain_pytorch", "tok_s": one, "spread": 0.0}])
    )
    proc = _run(
        [
            str(ROOT / "benchmarks" / "suite_table.py"),
            str(tmp_path / "suite.json"),
            "--scaling",
            str(out),
            "--rows",
            "plain_ddp",
        ],
        tmp_path,
        timeout=60,
    )
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("│") and "plain_ddp" in ln)
    cells = [
        c.strip() for c in line.split("│")[2:-1]
    ]  # 1-GPU setup │ 1 GPU │ 2 GPUs │ efficiency │ ...
    assert cells[0] == "plain_pytorch" and cells[3] == "0.500", proc.stdout


def test_profile_step_trace_summary_splits_the_gpu_timeline(tmp_path):
    """profile_step.trace_summary on a hand-made chrome trace: busy time is the union of every
    stream's kernels, NCCL time hidden under compute is told apart from exposed NCCL time, blocking
    CUDA calls are counted, and each idle gap over 50 us is charged to the host ops that ran at its
    middle."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from profile_step import trace_summary

    def op(cat, name, ts, dur, stream=None):
        return {
            "ph": "X",
            "cat": cat,
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": {"stream": stream},
        }

    events = [
        op("kernel", "gemm", 0, 100, 7),
        op("kernel", "ncclDevKernel_AllGather", 60, 100, 17),  # 40 exposed
        op("kernel", "gemm", 300, 100, 7),  # a 140 us gap (160..300)
        op("kernel", "ncclDevKernel_ReduceScatter", 420, 30, 29),  # 20 us gap, exposed 30
        op("cpu_op", "DeepSpeedEngine.forward", 0, 460),
        op("cpu_op", "fetch", 200, 50),
        op("cuda_runtime", "cudaStreamSynchronize", 200, 40),
        op("cuda_runtime", "cudaLaunchKernel", 1, 2),
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    lines = trace_summary(str(path)).splitlines()
    # window 0..450 us; busy 0..160, 300..400, 420..450 = 290 us (64%); NCCL 130 us, 70 us of it
    # exposed
    assert lines[0].startswith("TRACE window 0.5 ms") and "GPU busy 64%" in lines[0], lines
    assert (
        "compute 0.2 ms" in lines[0] and "NCCL 0.1 ms of which not under compute 0.1 ms" in lines[0]
    ), lines
    assert "idle 0.2 ms" in lines[0], lines
    assert lines[1] == "TRACE host CUDA calls that may block: cudaStreamSynchronize x1 0.0 ms", (
        lines
    )
    assert "gaps over 50 us: 1, 0.1 ms" in lines[2], lines  # the 20 us gap is under the threshold
    assert lines[3].strip() == "0.1 ms  DeepSpeedEngine.forward > fetch", lines
    path.write_text(json.dumps({"traceEvents": [e for e in events if e["cat"] != "cuda_runtime"]}))
    assert trace_summary(str(path)).splitlines()[1] == "TRACE host CUDA calls that may block: none"


def test_deepcompile_setups_warm_up_past_the_recompile():
    """Benchmark setups under DeepCompile (`+dc`, `+dceager`) warm up for at least 8 steps
    (DeepCompile recompiles at its 6th) and get at least 420 s; other setups keep what they were
    given."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from speed_single_gpu import for_setup

    assert for_setup("deepspeed_stage_3+user+dc", 3, 150) == (8, 420)
    assert for_setup("plain_deepspeed_zero3+dceager", 10, 900) == (10, 900)
    assert for_setup("deepspeed_stage_3", 3, 150) == (3, 150)
    assert for_setup("ddp+user", 3, 150) == (3, 150)


def test_scaling_multi_gpu_variant_names_are_checked_and_set_the_environment():
    """scaling_multi_gpu.py refuses a malformed `+` option by name (a typo would measure the default), and
    NCCL_PROTO variants set the environment of every process of their run (the fetch variants run in
    the parity test)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from scaling_multi_gpu import check_name, nccl_env

    assert nccl_env("ddp+protoSimple") == {"NCCL_PROTO": "Simple"}
    for good in ("deepspeed_stage_3+events16", "deepspeed_stage_3+fastleaf", "fsdp+protoLL128"):
        check_name(good)
    for bad in (
        "deepspeed_stage_3+events",
        "ddp+fastleaf",
        "deepspeed_stage_3+events0",
        "ddp+protoFast",
    ):
        with pytest.raises(ValueError, match="unknown or malformed option"):
            check_name(bad)
