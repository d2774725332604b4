"""Fixtures shared by the lab's test modules."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_sweep import SPEC

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def real_sweep(tmp_path_factory) -> Path:
    """A real 6-step bf16 + nvfp4 sweep (fp4lab sweep, local executor); returns the catalog path. Run once
    per session for the report's tests and its page's; read only."""
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "mini.toml").write_text(SPEC)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["OMP_NUM_THREADS"] = "1"  # two workers of tiny tensors: spinning OpenMP threads made it several times slower
    done = subprocess.run(
        [sys.executable, "-m", "fp4lab.cli", "sweep", "mini.toml", "--workers", "2"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return folder / "sweep_catalog.json"
