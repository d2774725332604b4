"""scripts/mutate.py's deliberate breaks still apply to the code as it is: each edit's old text occurs
exactly once in its file, the edited file still parses, and each named test exists. A refactor that moves a wire must move its
break too, or `python scripts/mutate.py` would report an error instead of checking the wire."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def load_mutations():
    return load_script("mutate").MUTATIONS


def test_every_break_applies_once_parses_and_names_existing_tests():
    mutations = load_mutations()
    assert len({m.name for m in mutations}) == len(mutations), "two breaks share a name"
    for mutation in mutations:
        edited: dict[str, str] = {}
        for path, old, new in mutation.edits:
            text = edited.get(path, (ROOT / path).read_text())
            count = text.count(old)
            assert count == 1, f"{mutation.name}: its old text occurs {count} times in {path}"
            edited[path] = text.replace(old, new)
        for path, text in edited.items():  # a break that no longer parses (an indent from before a refactor) is an error, not a catch
            if path.endswith(".sh"):
                checked = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
                assert checked.returncode == 0, f"{mutation.name}: {path} no longer parses once edited: {checked.stderr}"
                continue
            try:
                ast.parse(text, filename=path)
            except SyntaxError as exc:
                raise AssertionError(f"{mutation.name}: {path} no longer parses once edited: {exc}") from None
        for node in mutation.tests:
            file, _, name = node.partition("::")
            assert (ROOT / file).is_file(), f"{mutation.name}: no test file {file}"
            function = name.split("[")[0]
            source = (ROOT / file).read_text()
            assert not function or f"def {function}(" in source, f"{mutation.name}: no test {node}"
            if "[" in name:  # a parameter's id: the test must still take parameters (a merged test has none)
                decorators = source[:source.index(f"def {function}(")].rsplit("\n\n", 1)[-1]
                assert "parametrize" in decorators, f"{mutation.name}: {node} names a parameter, but {function} takes none"
