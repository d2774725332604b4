"""The package's shape, as docs/ARCHITECTURE.md states it: layers import one way only (the input
checking kit `fp4lab.validation` below them all), and no module
imports itself back through others (lazy imports inside functions count: they are cycles all the same)."""

from __future__ import annotations

import ast
from pathlib import Path

import fp4lab

ROOT = Path(fp4lab.__file__).parent
LAYERS = {"validation": -1, "numerics": 0, "nn": 1, "optim": 2, "train": 3, "lab": 4, "bench": 4, "cli": 5}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The fp4lab modules a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("fp4lab"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("fp4lab"))
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    modules = set(files)
    return {name: imports_of(path, modules) - {name} for name, path in files.items()}


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_layers_import_one_way_only():
    wrong = [f"{a} imports {b}" for a, targets in import_graph().items() for b in targets
             if layer_of(a) is not None and layer_of(b) is not None and layer_of(b) > layer_of(a)]
    assert not wrong, wrong


def test_no_import_cycles():
    graph = import_graph()
    # Package __init__ files only hold docstrings here; a cycle through one would still be a cycle.
    cycles, state = [], {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles
    assert "fp4lab.lab.runs.executors" in graph and "fp4lab.lab.runs.slurm" in graph["fp4lab.lab.runs.executors"]
