"""Every script in examples/ runs on 2 CPU ranks under ddp, deepspeed_stage_2, deepspeed_stage_3 and
fsdp, as a user would start it (`python examples/x.py --devices 2 --strategy S`), and prints the
result it promises.

The full matrix is 44 runs of ~10-15 s each. By default each example runs under one strategy,
rotating (example i under STRATEGIES[i % 4]), so every strategy is covered twice; the other runs
(and every cell of the gan and transformer_encoder examples, whose own tests run their default
cells) are marked `slow` and deselected by pyproject's `addopts`. Run them with `pytest -m slow
tests/test_examples.py` (or everything with `-m ""`).

On a GPU machine (`-m gpu`) the same scripts run on one CUDA GPU (`--accelerator gpu --devices 1`):
every example under "auto" (which plans the strategy and micro-batch on CUDA) and under its rotating
strategy; the other cells are `slow`. These are where GPU-only paths meet user code: pinned batch
copies, fused optimizers by default, bf16/CUDA DeepSpeed engines, the planner's probe.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from helpers import ROOT, launch

STRATEGIES = ["ddp", "deepspeed_stage_2", "deepspeed_stage_3", "fsdp"]


def _finite_below(limit):
    return lambda value, cwd: math.isfinite(value) and value < limit


def _lr_logged(
    value, cwd: Path
) -> bool:  # warm-up over: the base lr, and LearningRateMonitor wrote a column
    header = next(cwd.glob("logs/**/metrics.csv")).read_text().splitlines()[0]
    return value == pytest.approx(0.1) and any(c.startswith("lr-") for c in header.split(","))


# Example, what its "result: name=value" line must satisfy. The order decides the default strategy
# (i % 4).
EXAMPLES = [
    ("mnist_mlp", lambda v, cwd: 0.0 <= v <= 1.0),
    ("gpt_lm", _finite_below(6.5)),  # random tokens: about ln(256) = 5.55 is the floor
    ("autoencoder", _finite_below(0.5)),
    ("datamodule", _finite_below(0.5)),  # a learnable linear target; starts near 16
    ("fast_dev_run", lambda v, cwd: v == 1 and not (cwd / "checkpoints").exists()),
    ("lr_scheduler", _lr_logged),
    ("deepspeed_zero3", _finite_below(10.0)),
    (
        "hparams_checkpoint",
        lambda v, cwd: v == 24,
    ),  # rebuilt from the checkpoint's hparams, not the default
    ("predict", lambda v, cwd: v == 20),  # 40 inputs, half on each rank
    ("gan", _finite_below(1.0)),  # BCE of a discriminator near chance: about ln 2
    ("transformer_encoder", _finite_below(2.0)),  # 4 classes: ln 4 = 1.39 at chance
]
# The GAN (two optimizers, manual): under DDP it needs ddp_find_unused_parameters_true (as under
# Lightning). Their
# own tests run the cells that matter by default (gan: tests/test_manual_optimization.py;
# transformer_encoder:
# tests/test_lightning_zero3.py), so here every cell of these two is slow.
ELSEWHERE = {"gan", "transformer_encoder"}
RENAMED = {("gan", "ddp"): "ddp_find_unused_parameters_true"}
REFUSED: dict[
    tuple[str, str], str
] = {}  # (example, strategy) -> the error a refused cell must print
CASES = [
    pytest.param(
        name,
        strategy,
        check,
        id=f"{name}-{strategy}",
        marks=() if strategy == STRATEGIES[i % 4] and name not in ELSEWHERE else [pytest.mark.slow],
    )
    for i, (name, check) in enumerate(EXAMPLES)
    for strategy in STRATEGIES
]


def test_every_example_is_listed():
    assert sorted(p.stem for p in (ROOT / "examples").glob("*.py")) == sorted(
        name for name, _ in EXAMPLES
    )


GPU_CASES = [
    pytest.param(
        name,
        strategy,
        check,
        id=f"{name}-{strategy}",
        marks=[
            pytest.mark.gpu,
            *(() if strategy in ("auto", STRATEGIES[i % 4]) else [pytest.mark.slow]),
        ],
    )
    for i, (name, check) in enumerate(EXAMPLES)
    for strategy in ["auto", *STRATEGIES]
]


DEFAULT = [
    (name, strategy)
    for i, (name, _) in enumerate(EXAMPLES)
    for strategy in STRATEGIES
    if strategy == STRATEGIES[i % 4] and name not in ELSEWHERE
]


@pytest.fixture(scope="module")
def default_runs(tmp_path_factory) -> dict[tuple[str, str], tuple[Path, str]]:
    """The default CPU cells' scripts, one after another in one launched job of 2 ranks
    (tests/examples_script.py runs each as `python examples/x.py --devices 2 --strategy S` does, in
    a folder of its own; examples/gan.py is also started directly, by test_manual_optimization).
    (name, strategy) -> (its folder, its part of the output)."""
    tmp = tmp_path_factory.mktemp("examples")
    jobs = []
    for name, strategy in DEFAULT:
        (tmp / name).mkdir()
        args = _args(name, strategy, accelerator="cpu", devices=2)
        jobs.append(dict(script=args[0], args=args[1:], dir=str(tmp / name)))
    script = str(ROOT / "tests" / "examples_script.py")
    run = launch([script, json.dumps(jobs)], tmp, timeout=600)
    assert run.returncode == 0, f"examples failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    parts = re.split(r"\[examples_script job (\d+)\]\n", run.stdout)
    said = ["" for _ in jobs]  # parts: text, number, text, number, text, ...
    for number, text in zip(parts[1::2], parts[2::2]):
        said[int(number)] += text
    return {cell: (tmp / cell[0], out) for cell, out in zip(DEFAULT, said)}


@pytest.mark.parametrize("name, strategy, check", CASES)
def test_example(tmp_path, request, name, strategy, check):
    if (name, strategy) in DEFAULT:
        cwd, stdout = request.getfixturevalue("default_runs")[name, strategy]
        _check_result(name, strategy, check, cwd, stdout)
        return
    _run_example(tmp_path, name, strategy, check, accelerator="cpu", devices=2)


@pytest.mark.parametrize("name, strategy, check", GPU_CASES)
def test_example_on_one_gpu(tmp_path, name, strategy, check):
    if name == "predict":
        check = lambda v, cwd: v == 40  # noqa: E731 -- one rank predicts all 40 inputs
    _run_example(tmp_path, name, strategy, check, accelerator="gpu", devices=1)


def _args(name: str, strategy: str, accelerator: str, devices: int) -> list[str]:
    """The command line after `python`: examples/<name>.py and its flags."""
    if name == "deepspeed_zero3" and strategy == "deepspeed_stage_3":
        strategy = "deepspeed"  # the script's own DeepSpeedStrategy(stage=3)
    strategy = RENAMED.get((name, strategy), strategy)
    script = str(ROOT / "examples" / f"{name}.py")
    return [script, "--accelerator", accelerator, "--devices", str(devices), "--strategy", strategy]


def _run_example(tmp_path, name, strategy, check, accelerator: str, devices: int):
    refusal = REFUSED.get((name, strategy))
    run = launch(_args(name, strategy, accelerator, devices), tmp_path)
    if refusal:
        assert run.returncode != 0 and refusal in run.stderr, run.stderr[-3000:]
        return
    assert run.returncode == 0, (
        f"{name} under {strategy} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    )
    _check_result(name, strategy, check, tmp_path, run.stdout)


def _check_result(name: str, strategy: str, check, cwd: Path, stdout: str) -> None:
    found = re.findall(r"^result: (\w+)=(\S+)$", stdout, re.MULTILINE)
    assert len(found) == 1, f"{name}: expected one result line from rank 0:\n{stdout[-2000:]}"
    key, value = found[0]
    assert check(float(value), cwd), f"{name} under {strategy}: {key}={value}"
