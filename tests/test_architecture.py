"""The import contract: layers only point down, and there are no import cycles (function-level imports count).

    .venv/bin/python -m pytest -q tests/test_architecture.py

Every module of src/lightspeed is assigned a layer below. A module may import modules of its own layer or of
lower ones. A new module must be given a layer here, so the contract cannot be bypassed by adding files.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "lightspeed"

LAYERS: dict[int, set[str]] = {
    0: {"errors", "specs", "launch", "rng", "heartbeat"},  # plain data types, the launch environment, RNG, heartbeat
    1: {"distributed", "config", "data", "metrics", "memory", "checkpoint_io", "precision", "optim", "progress",
        "loggers", "report", "kernels", "plan_probe", "plan_chart", "utilities", "summary", "guard",
        "preemption"},
    # process-group helpers and small utilities; plan (below) imports strategies.host_memory
    2: {"strategies", "plan"},  # every backend (strategies.*), and the planner that chooses among them
    3: {"checkpoint", "conversion", "module", "callbacks", "run_metrics", "hparams", "hooks", "eval_loaders", "inputs",
        "lightning_names", "datamodule",
        "micro_batch"},
    # the schema owner, the user-facing Module, callbacks, hooks and what they draw; the micro-batch finder
    4: {"trainer"},  # the loop
    5: {"__init__", "commands", "examples"},  # the package's face
}


def _name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    return ".".join(rel.parts)


def _layer(module: str) -> int:
    top = module.split(".")[0]
    for layer, names in LAYERS.items():
        if top in names:
            return layer
    raise AssertionError(f"module lightspeed.{module} has no layer in tests/test_architecture.py: give it one")


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
            for name in names:  # `from . import x` imports the module x; `from .x import y` the module x
                found.add(name if _exists(name) else name.rsplit(".", 1)[0] if "." in name else name)
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
            m for m in _imports(path)}
    return graph


def test_layers_only_point_down():
    upward = [f"lightspeed.{m} (layer {_layer(m)}) imports lightspeed.{dep} (layer {_layer(dep)})"
              for m, deps in _graph().items() for dep in deps if _layer(dep) > _layer(m)]
    assert upward == [], "\n".join(upward)


def test_no_import_cycles():
    graph, cycles = _graph(), []
    state: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]) if dep in stack else f"{node}->{dep}")
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
    assert {"distributed", "precision", "specs", "checkpoint_io"} <= graph["strategies.ddp"]
    assert "rng" in graph["strategies.common"] and "checkpoint" in graph["callbacks"]
    assert "strategies" in graph["trainer"] and "trainer" in graph["__init__"]
