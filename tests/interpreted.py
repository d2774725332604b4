"""A test module's check run in a fresh Python under Triton's interpreter: TRITON_INTERPRET=1 is read
when Triton's kernels are first imported, so it cannot be switched on inside the test process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_interpreted(module: str, call: str, timeout: int = 600) -> None:
    """`call`, with every name of tests/<module>.py in scope, under TRITON_INTERPRET=1; fails with its stderr."""
    pytest.importorskip("triton")
    code = f"import sys\nsys.path.insert(0, {ROOT!r})\nfrom tests.{module} import *\n{call}\nprint('ok')\n"
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, timeout=timeout, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-4000:]
