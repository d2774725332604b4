"""Shared test fixtures, and the markers that skip tests needing what this machine may lack:

- `cuda`: an NVIDIA GPU;
- `slurm`: the local single-node Slurm cluster (`sudo scripts/local-slurm.sh start`; CI starts it);
- `tmux`: the tmux terminal multiplexer (Debian package tmux; CI installs it);
- `browser`: headless Chromium (Debian package chromium; CI installs it), for pages checked as a reader sees them.

Each is decided once per session and applied to each marked test, so `pytest -rs` lists every
skipped test on its own line and the summary counts them all (a module-level skip would count a whole
module as one). With FP4LAB_REQUIRE_TOOLS=1 (CI sets it) a missing Slurm, tmux or Chromium fails those
tests instead of skipping them: CI always runs them."""

import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tests.browser import chromium_unavailable

SLURM_UP_STATES = {"idle", "mixed", "allocated", "completing"}  # node states in which jobs can run
SLURM_COMMANDS = ("sinfo", "sbatch", "squeue", "scontrol", "scancel")


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: needs the local Slurm cluster (scripts/local-slurm.sh); skipped without it")
    config.addinivalue_line("markers", "tmux: needs tmux (a real terminal for the CLI); skipped without it")
    config.addinivalue_line("markers", "browser: needs Chromium (pages checked in a real browser); skipped without it")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        # `pytest -n N`: each worker gets its share of the cores; N workers of all-core OpenMP pools
        # oversubscribe the machine and slow every test down. The processes a test starts (Triton's
        # interpreter, the CLI, torchrun) get the same share: on 2 busy cores a 2-thread pool waits on
        # its descheduled thread at every op (measured: a fullstack step on the tiny model 28 s, on one
        # thread 1.8 s).
        threads = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # Started in the background by a non-interactive shell, which ignores SIGINT: the CLI processes
        # the tests start would inherit that and never see the Ctrl-C the tests send them. A handler
        # here is not inherited (exec resets it), so they start with the default disposition.
        signal.signal(signal.SIGINT, signal.default_int_handler)


def slurm_node_state() -> str | None:
    """The local node's state as sinfo reports it ("idle", "down*", ...), None when sinfo has no answer."""
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return out.stdout.split()[0]


def slurm_unavailable() -> str | None:
    """Why the local Slurm cluster cannot run this session's jobs; None when it can."""
    missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
    if missing:
        return f"Slurm is not installed (no {', '.join(missing)} on PATH)"
    state = slurm_node_state()
    if state not in SLURM_UP_STATES:
        return f"the local Slurm node is not up (sinfo state: {state or 'no answer'})"
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need an NVIDIA GPU, tests marked with a tool of TOOLS (`slurm`, `tmux`, `browser`)
    that tool: without it each such test is reported as skipped, with the reason. Tests marked `slow` run
    first: under xdist the longest start early instead of leaving one worker busy after the rest are done."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order otherwise
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (an NVIDIA GPU)")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)
    for marker, (needs, why, hint) in TOOLS.items():
        needing = [item for item in items if item.get_closest_marker(marker) is not None]
        reason = why() if needing else None
        if reason is None:
            continue
        if os.environ.get("FP4LAB_REQUIRE_TOOLS") == "1":  # CI: what it installed must be there
            for item in needing:
                item.missing_tool = reason
            continue
        skip = pytest.mark.skip(reason=f"needs {needs}: {reason}; {hint}")
        for item in needing:
            item.add_marker(skip)


def tmux_unavailable() -> str | None:
    return None if shutil.which("tmux") else "tmux is not installed (no tmux on PATH)"


TOOLS = {  # marker -> (what its tests need, why this machine lacks it (None: it has it), how to get it)
    "slurm": ("the local Slurm cluster", slurm_unavailable, "run `sudo scripts/local-slurm.sh start`"),
    "tmux": ("tmux", tmux_unavailable, "install tmux (apt-get install tmux)"),
    "browser": ("Chromium", chromium_unavailable, "install Chromium (apt-get install chromium)"),
}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """FP4LAB_REQUIRE_TOOLS=1 and a tool this test needs is missing: a failure, not a skip, before any of the
    test's fixtures (a module's fixture may start the very tool) runs."""
    missing = getattr(item, "missing_tool", None)
    if missing is not None:
        pytest.fail(f"FP4LAB_REQUIRE_TOOLS=1 but {missing}")


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
