"""What a run ran on, for its summary.json and its trackers' config: two runs compared are only
comparable when these agree (another torch or Triton release, another GPU or driver, can change a
step's bits and its speed).

    environment(device) -> {"torch", "cuda", "triton", "gpu", "gpu_count", "driver", "python",
                            "fp4lab", "fp4lab_commit", "hostname"}

Each value is None where it does not apply (a CPU build, no GPU, no git checkout) or cannot be learned quickly.
"""

from __future__ import annotations

import functools
import platform
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# The keys that make two environments different for a comparison of results (the report's); hostname is not one.
COMPARED = ("torch", "cuda", "triton", "gpu", "gpu_count", "driver", "python", "fp4lab", "fp4lab_commit")


def environment(device) -> dict[str, Any]:
    """The software and hardware of this process (`device`: the run's torch.device). Torch is imported
    here, so COMPARED can be read without it."""
    import torch

    on_gpu = device.type == "cuda"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,  # the CUDA torch was built with (None: a CPU build)
        "triton": _version("triton"),
        "gpu": torch.cuda.get_device_name(device) if on_gpu else None,
        "gpu_count": torch.cuda.device_count() if on_gpu else 0,
        "driver": _driver() if on_gpu else None,
        "python": platform.python_version(),
        "fp4lab": _version("fp4lab"),
        "fp4lab_commit": _commit(),
        "hostname": socket.gethostname(),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def _driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi; torch does not report it)."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


@functools.cache
def _commit() -> str | None:
    """The git commit of the fp4lab checkout this code runs from, "+dirty" when it has changes; None
    for an installed (not editable) fp4lab."""
    try:
        head = subprocess.run(["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(PACKAGE_DIR), "status", "--porcelain", "--untracked-files=no", "--", "."],
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
