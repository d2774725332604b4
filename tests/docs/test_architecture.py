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


KERNELS = "fp4lab.numerics.kernels"
# The one place the Triton kernels are asked whether they can run (kernels.runs_on, which checks CUDA and
# that Triton imports) and the one place a run's paths are chosen (train.paths); nowhere else imports
# Triton or asks whether it is installed.
TRITON_CHECKS = {"fp4lab/numerics/kernels", "fp4lab/train/paths.py"}


def module_level_imports(path: Path, modules: set[str]) -> set[str]:
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fp4lab"):
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names}
    return found & modules


def test_references_never_import_their_kernels():
    # A torch reference stands on its own beside its kernel (torchao's mx_formats layout): the kernel
    # imports the reference it must equal, never the other way round.
    wrong = [f"{a} imports {b}" for a, targets in import_graph().items() for b in targets
             if a.startswith("fp4lab.numerics") and not a.startswith(KERNELS) and b.startswith(KERNELS)]
    assert not wrong, wrong


def test_kernel_modules_are_imported_lazily_outside_the_kernel_layer():
    # They import Triton at module level: a CPU run and `fp4lab --help` must never load it.
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    kernel_modules = {name for name in files if name.startswith(KERNELS + ".")}
    wrong = [f"{name} imports {target} at module level" for name, path in files.items() if not name.startswith(KERNELS)
             for target in module_level_imports(path, set(files)) & kernel_modules]
    assert not wrong, wrong
    assert kernel_modules >= {f"{KERNELS}.{k}" for k in ("quantize", "fp8", "fusion", "mx_gemm", "tile_gemm", "epilogue", "attention")}


def test_each_kernel_has_its_torch_reference_beside_it():
    for kernel in (ROOT / "numerics" / "kernels").glob("*.py"):
        if kernel.stem != "__init__":
            assert (ROOT / "numerics" / kernel.name).is_file(), f"numerics/kernels/{kernel.name} has no numerics/{kernel.name}"


def test_only_the_kernel_layer_and_the_path_module_check_for_triton():
    wrong = []
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT.parent).as_posix()
        if any(relative.startswith(place) for place in TRITON_CHECKS):
            continue
        text = path.read_text()
        if any(needle in text for needle in ("import triton", 'find_spec("triton")', "torch.cuda.is_available() and")):
            wrong.append(relative)
    assert not wrong, wrong
