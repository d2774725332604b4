"""The README's API example must run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks, "README lost its API example"
    for block in blocks:
        exec(compile(block, str(README), "exec"), {})


def test_readme_setup_commands_are_what_ci_runs():
    ci = (README.parent / ".ci" / "run").read_text()
    commands = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1).strip().splitlines()
    assert len(commands) == 2
    for command in commands:
        assert command in ci, f".ci/run does not run the README command {command!r}"
