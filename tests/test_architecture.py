"""The import contract: layers only point down, and there are no import cycles (function-level
imports count).

    .venv/bin/python -m pytest -q tests/test_architecture.py

Every module of src/lightspeed is assigned a layer below. A module may import modules of its own
layer or of lower ones. A new module must be given a layer here, so the contract cannot be bypassed
by adding files.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "lightspeed"

# The package DAG, bottom to top: a package (or top-level module) may import its own layer's and
# lower ones'.
LAYERS: dict[int, set[str]] = {
    0: {
        "errors",
        "specs",
    },  # plain data types: ConfigError, RunSpec, LoopState, StepStats, TrainerView
    1: {
        "runtime"
    },  # the launch environment (read once), process groups, RNG, heartbeat, preemption, guard
    2: {"data"},  # loaders, samplers, combined loaders, accumulation windows, batch transfer
    3: {
        "utilities",
        "overrides",
        "config",
        "profilers",
        "accelerators",
        "plugins",
    },  # Lightning's utility names and `overrides`; the Trainer's flags, checked and frozen; profilers
    4: {"perf"},  # fused optimizers, compile, mixed precision and the shared clip-then-step
    5: {"checkpoint"},  # the Checkpointer, file formats, one reader per on-disk layout
    6: {"loggers"},
    7: {"report"},  # the run report, the model summary, the progress bar
    8: {"strategies"},  # the protocol, the registry, one file per backend, strategies/deepspeed/
    9: {"core"},  # LightningModule, LightningDataModule, hparams and saving, the self.log store
    10: {"callbacks", "tuner"},  # callbacks; the tuner (its finders are callbacks, it runs trial fits)
    11: {"plan"},  # the memory forecast, probes, the micro-batch finder
    12: {"run", "hooks", "eval_loaders", "start", "loop", "loops", "trainer"},  # the loop, its run state
    13: {"__init__", "cli", "commands", "demos"},  # the package's face
}


def _name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    return ".".join(rel.parts)


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for layer, names in LAYERS.items():
        if top in names:
            return layer
    raise AssertionError(
        f"module lightspeed.{module} has no layer in tests/test_architecture.py: give it one"
    )


def _imports(path: Path) -> set[str]:
    """lightspeed modules imported anywhere in the file, as dotted names relative to the package."""
    module = _name(path)
    package = module.split(".")[:-1]  # "strategies.ddp" and "strategies.__init__" -> ["strategies"]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
                names = [f"{target}.{a.name}" if target else a.name for a in node.names]
            elif node.module and node.module.split(".")[0] == "lightspeed":
                target = node.module.removeprefix("lightspeed").lstrip(".")
                names = [f"{target}.{a.name}" if target else a.name for a in node.names]
            else:
                continue
            for (
                name
            ) in names:  # `from . import x` imports the module x; `from .x import y` the module x
                found.add(
                    name if _exists(name) else name.rsplit(".", 1)[0] if "." in name else name
                )
            if target and _exists(target):
                found.add(target)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "lightspeed":
                    found.add(a.name.removeprefix("lightspeed").lstrip(".") or "__init__")
    return {m for m in found if m and _exists(m) and m != module}


def _exists(dotted: str) -> bool:
    p = SRC.joinpath(*dotted.split("."))
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(SRC.rglob("*.py")):
        name = _name(path)
        graph[name.removesuffix(".__init__") if name.endswith(".__init__") else name] = {
            m for m in _imports(path)
        }
    return graph


def test_layers_only_point_down():
    upward = [
        f"lightspeed.{m} (layer {_layer(m)}) imports lightspeed.{dep} (layer {_layer(dep)})"
        for m, deps in _graph().items()
        for dep in deps
        if _layer(dep) > _layer(m)
    ]
    assert upward == [], "\n".join(upward)


def test_no_import_cycles():
    graph, cycles = _graph(), []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(
                    " -> ".join(stack[stack.index(dep) :] + [dep])
                    if dep in stack
                    else f"{node}->{dep}"
                )
            elif dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], "\n".join(cycles)


def test_the_contract_sees_imports():
    # A self-check, so that a parser bug cannot make the two tests above pass vacuously.
    graph = _graph()
    assert {"runtime.distributed", "perf.precision", "specs", "checkpoint.io"} <= graph[
        "strategies.ddp"
    ]
    assert (
        "runtime.rng" in graph["strategies.common"]
        and "checkpoint.checkpointer" in graph["callbacks.model_checkpoint"]
    )
    assert "strategies" in graph["trainer.trainer"] and "trainer" in graph["__init__"]


def test_only_the_deepspeed_package_imports_deepspeed():
    # DeepSpeed's internals change between releases: one package holds every use, so one package
    # follows them.
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.is_relative_to(SRC / "strategies" / "deepspeed"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            found += [
                f"{path.relative_to(SRC)}:{node.lineno} imports {n}"
                for n in names
                if n.split(".")[0] == "deepspeed"
            ]
    assert found == [], "\n".join(found)


def test_the_architecture_page_shows_these_layers():
    # docs/architecture.md's layer table names the same packages per layer as LAYERS (the loop's modules, whose
    # names change with the loop, are summed up as "trainer and the loop's modules").
    doc = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    rows = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].isdigit():
            rows[int(cells[0])] = set(re.findall(r"`([a-z_]+)`", cells[1]))
    assert set(rows) == set(LAYERS), (sorted(rows), sorted(LAYERS))
    for layer, names in LAYERS.items():
        assert rows[layer] <= names and (rows[layer] == names or "trainer" in rows[layer]), (layer, rows[layer])
