"""No function in fp4lab is longer than MAX_LINES without a reason written here: a long function is
usually several jobs, and each should have a name (issue 36)."""

from __future__ import annotations

import ast
from pathlib import Path

import fp4lab

ROOT = Path(fp4lab.__file__).parent
MAX_LINES = 80
# "path:function" -> why it stays long. Empty today: keep it short, each entry with its reason.
ALLOWED: dict[str, str] = {}


def long_functions() -> dict[str, int]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    found[f"{path.relative_to(ROOT.parent).as_posix()}:{node.name}"] = lines
    return found


def test_no_function_is_longer_than_the_limit_without_a_reason():
    unexplained = {name: lines for name, lines in long_functions().items() if name not in ALLOWED}
    assert not unexplained, f"functions over {MAX_LINES} lines: {unexplained}; split them, or add each to ALLOWED with its reason"
    assert all(reason.strip() for reason in ALLOWED.values())
    stale = set(ALLOWED) - set(long_functions())
    assert not stale, f"ALLOWED names functions that are no longer long: {stale}"
