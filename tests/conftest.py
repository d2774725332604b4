"""Shared test fixtures."""

import sys
from types import SimpleNamespace

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need an NVIDIA GPU: without one they are reported as skipped."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (an NVIDIA GPU)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """Run the real console entry point in-process; return (exit code, stdout, stderr)."""
    from fp4lab.cli import main

    def run(*args: str) -> SimpleNamespace:
        monkeypatch.setattr(sys, "argv", ["fp4lab", *args])
        with pytest.raises(SystemExit) as exited:
            main()
        captured = capsys.readouterr()
        return SimpleNamespace(returncode=exited.value.code, stdout=captured.out, stderr=captured.err)

    return run


@pytest.fixture(scope="module")
def one_thread():
    """For modules of tiny tensors: a second intra-op thread only adds synchronisation, and on a
    loaded 2-core machine spinning OpenMP threads made such modules several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
