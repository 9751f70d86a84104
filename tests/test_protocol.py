"""The Strategy protocol is the whole contract: nothing outside strategies/ reads a strategy member
the protocol does not declare, and docs/architecture.md says truly where each method is called.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/test_protocol.py

- Conformance: each strategy runs a fit (validation, an LR scheduler, a checkpoint every 2 steps),
  a test and a resumed fit behind a proxy that raises on any member not in
  `strategies.base.METHODS + READABLE` read by code outside strategies/, and records it (a
  `getattr(s, "x", None)` that swallows the error is still recorded). Distributed strategies run on 2 gloo ranks; the single-device run also
  finds its micro-batch (`micro_batch="power"`), so the planner's trial strategies (`fork()`) are
  proxied too.
- Static: an AST scan of src/ outside strategies/ finds every attribute read on a strategy
  (`strategy.x`, `<anything>.strategy.x`, a name bound to `<strategy>.fork()`, `getattr`/`vars`/
  `dataclasses.fields` of one) and checks it against the same list.
- The table "where each protocol method is called" in docs/architecture.md matches the call sites
  the scan finds, file by file.
"""

from __future__ import annotations

import ast
import json
import re

import pytest

from helpers import ROOT, launch
from lightspeed.strategies.base import METHODS, READABLE

SRC = ROOT / "src" / "lightspeed"

PROXY_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
from torch.utils.data import DataLoader
import lightspeed as ls
from lightspeed.strategies.base import METHODS, READABLE
from test_trainer import Regress, regression_data

undeclared = []


class UndeclaredMember(AssertionError):
    pass


def inside_strategies():
    # The caller of the caller: the code that reads the member (strategies/ may read anything).
    return "/lightspeed/strategies/" in sys._getframe(2).f_code.co_filename.replace("\\", "/")


class Proxy:
    '''A strategy as the rest of lightspeed may see it: the protocol's members, nothing else.'''

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name):
        if name.startswith("__"):  # Python's own probes (copy, pickle): not a read of the strategy
            raise AttributeError(name)
        if name == "fork":  # the planner's trial strategy is held to the protocol too
            return lambda: Proxy(self._inner.fork())
        if name in METHODS or name in READABLE or inside_strategies():
            return getattr(self._inner, name)
        undeclared.append(name)
        raise UndeclaredMember(f"strategy.{{name}} is not declared by the Strategy protocol")

    def __setattr__(self, name, value):
        if name not in ("optimizers", "schedulers") and not inside_strategies():
            undeclared.append(name + "=")
        setattr(self._inner, name, value)


class Model(Regress):
    def __init__(self, batch_size=4):
        super().__init__()
        self.batch_size = batch_size

    def train_dataloader(self):
        return regression_data(32, self.batch_size)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=2)]


devices = int(sys.argv[1])


def trainer(name, **kw):
    return ls.Trainer(strategy=Proxy(ls.build_strategy(name, devices)), devices=devices,
                      accelerator="cpu", logger=ls.CSVLogger("logs"), enable_progress_bar=False,
                      callbacks=[ls.ModelCheckpoint(dirpath="ckpt", every_n_train_steps=2),
                                 ls.LearningRateMonitor()], seed=0, **kw)


top = os.path.dirname(os.path.abspath(__file__))  # rank 1 starts in the folder of the first job
for name in sys.argv[2:]:  # one strategy after another, in the same ranks, each in its folder
    os.makedirs(os.path.join(top, name), exist_ok=True)
    os.chdir(os.path.join(top, name))
    undeclared.clear()
    t = trainer(name, max_steps=4, limit_val_batches=2, val_check_interval=2)
    model = Model()
    t.fit(model, val_dataloaders=regression_data(8))
    assert t.model is not None and t.lr_scheduler_configs
    t.test(model, regression_data(8))
    t = trainer(name, max_steps=6)
    t.fit(Model(), ckpt_path="last")
    assert t.global_step == 6
    if devices == 1:
        t = trainer(name, max_steps=2, micro_batch="power", memory_budget=2e8)
        t.fit(Model())
    # One write per line: rank 1's output reaches the test through rank 0's stdout.
    sys.stdout.write(f"DONE UNDECLARED {{name}} " + json.dumps(sorted(set(undeclared))) + "\n")
    sys.stdout.flush()
"""

# (strategy, ranks): every backend, distributed ones on 2 gloo ranks
CONFORMANCE = [
    ("single", 1),
    ("ddp", 2),
    # ZeRO's two other flavours read through the same strategy files as ddp and ZeRO-3: slow cells
    pytest.param("ddp_sharded", 2, marks=pytest.mark.slow),
    pytest.param("deepspeed_stage_2", 2, marks=pytest.mark.slow),
    ("deepspeed_stage_3", 2),
    ("fsdp", 2),
]
DEFAULT_TWO = ["ddp", "deepspeed_stage_3", "fsdp"]


def _proxied(tmp_path, ranks: int, names: list[str]) -> dict[str, list[list[str]]]:
    """PROXY_SCRIPT for `names` on `ranks` ranks, one after another in one launched job: name ->
    each rank's undeclared reads."""
    script = tmp_path / "proxied.py"
    script.write_text(PROXY_SCRIPT.format(tests=str(ROOT / "tests")))
    run = launch(
        [str(script), str(ranks), *names],
        tmp_path,
        "python",
        ranks,
        extra_env={"DS_ACCELERATOR": "cpu"},
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    said: dict[str, list[list[str]]] = {name: [] for name in names}
    for line in run.stdout.splitlines():
        if line.startswith("DONE UNDECLARED "):
            name, found = line[len("DONE UNDECLARED ") :].split(" ", 1)
            said[name].append(json.loads(found))
    return said


@pytest.fixture(scope="module")
def on_two_ranks(tmp_path_factory) -> dict[str, list[list[str]]]:
    """The default 2-rank cells, in one launched job (the ranks start once)."""
    return _proxied(tmp_path_factory.mktemp("proxied"), 2, DEFAULT_TWO)


@pytest.mark.parametrize("name, ranks", CONFORMANCE)
def test_a_fit_reads_only_declared_members(tmp_path, on_two_ranks, name, ranks):
    said = on_two_ranks[name] if name in on_two_ranks else _proxied(tmp_path, ranks, [name])[name]
    assert said == [[]] * ranks, said


# --------------------------------------------------------------------------------------------------
# the static scan


def _strategy_reads(path) -> list[tuple[int, str, str]]:
    """(line, member, how) for every read of a strategy member in the file at `path`. A strategy is
    a name `strategy`, any `<x>.strategy`, or a name bound to `<strategy>.fork()`; names and
    attributes annotated `str` (a strategy's *name*, as in plan/candidates.py) are not strategies."""
    tree = ast.parse(path.read_text())
    strings = {
        node.target.attr if isinstance(node.target, ast.Attribute) else node.target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign)
        and isinstance(node.target, (ast.Name, ast.Attribute))
        and ast.unparse(node.annotation) == "str"
    } | {
        arg.arg
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for arg in node.args.args + node.args.kwonlyargs
        if arg.annotation is not None and ast.unparse(arg.annotation) == "str"
    }
    forks = set()  # names bound to `<x>.fork()`, also in a tuple assignment
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], (ast.Name, ast.Tuple)):
            target, value = node.targets[0], node.value
            pairs = (
                zip(target.elts, value.elts)
                if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
                else [(target, value)]
            )
            forks |= {
                t.id
                for t, v in pairs
                if isinstance(t, ast.Name)
                and isinstance(v, ast.Call)
                and isinstance(v.func, ast.Attribute)
                and v.func.attr == "fork"
            }

    def is_strategy(node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return (node.id == "strategy" and "strategy" not in strings) or node.id in forks
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "strategy"
            and "strategy" not in strings
        )

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_strategy(node.value):
            found.append((node.lineno, node.attr, "attribute"))
        elif isinstance(node, ast.Call) and node.args and is_strategy(node.args[0]):
            fn = ast.unparse(node.func)
            if fn in ("getattr", "hasattr", "setattr") and isinstance(node.args[1], ast.Constant):
                found.append((node.lineno, node.args[1].value, fn))
            elif fn in ("vars", "dataclasses.fields", "dataclasses.asdict", "fields", "copy.copy"):
                found.append((node.lineno, f"{fn}(...)", fn))
            elif fn == "copy.deepcopy":
                found.append((node.lineno, "deepcopy(...)", fn))
    return found


def _scan() -> dict[str, list[tuple[int, str, str]]]:
    return {
        str(p.relative_to(SRC)): reads
        for p in sorted(SRC.rglob("*.py"))
        if not p.is_relative_to(SRC / "strategies") and (reads := _strategy_reads(p))
    }


def test_no_undeclared_strategy_member_is_read_outside_strategies():
    declared = set(METHODS) | set(READABLE)
    bad = [
        f"{file}:{line}: strategy.{member} ({how})"
        for file, reads in _scan().items()
        for line, member, how in reads
        if member not in declared
    ]
    assert bad == [], "\n".join(bad)


def test_the_scan_sees_strategy_reads(tmp_path):
    # A self-check, so that a parser slip cannot make the test above pass vacuously.
    scan = _scan()
    members = {m for reads in scan.values() for _, m, _ in reads}
    assert {"forward", "backward", "step", "setup", "save", "load", "teardown"} <= members
    assert {"model", "settings", "fork", "name", "optimizers"} <= members
    fake = tmp_path / "fake.py"
    fake.write_text(
        "def f(trainer, strategy):\n"
        "    trial = strategy.fork()\n"
        "    return trainer.strategy.engine, trial.wrapped, getattr(strategy, 'cpu_offload'),"
        " vars(trainer.strategy)\n"
    )
    assert {m for _, m, _ in _strategy_reads(fake)} == {
        "fork",
        "engine",
        "wrapped",
        "cpu_offload",
        "vars(...)",
    }


# --------------------------------------------------------------------------------------------------
# docs/architecture.md's table of call sites


def _documented_call_sites() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The Strategy protocol", 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        files = set(re.findall(r"`([\w/]+\.py)`", cells[1]))
        for method in re.findall(r"`(\w+)\(", cells[0]):
            table[method] = files
    return table


def test_the_docs_say_where_each_method_is_called():
    code: dict[str, set[str]] = {m: set() for m in METHODS}
    for file, reads in _scan().items():
        for _, member, _ in reads:
            if member in code:
                code[member].add(file)
    assert _documented_call_sites() == code
