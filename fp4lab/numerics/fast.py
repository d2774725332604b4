"""Whether the fused GPU quantizers (fp4lab.numerics.triton_quantize) can run here.

Torch-only on purpose: fp4lab never imports Triton at import time, so CPU runs and `fp4lab --help`
stay fast and work without it. Callers ask `triton_available()` and import the kernels lazily.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch


# A constant to torch.compile: traced instead, the cached check would run again in every graph (and warn).
@torch.compiler.assume_constant_result
def triton_available() -> bool:
    """True when Triton imports and a CUDA device is visible."""
    return _cuda_and_triton()


@cache
def _cuda_and_triton() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(device: torch.device) -> bool:
    """Whether fp4lab's Triton kernels can run on tensors on `device`: a CUDA device with Triton, or
    the CPU under Triton's interpreter (TRITON_INTERPRET=1, read when a kernel module is imported)."""
    if device.type == "cuda":
        return triton_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None
