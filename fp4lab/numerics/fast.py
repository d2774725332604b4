"""Whether the fused GPU quantizers (fp4lab.numerics.triton_quantize) can run here.

Torch-only on purpose: fp4lab never imports Triton at import time, so CPU runs and `fp4lab --help`
stay fast and work without it. Callers ask `triton_available()` and import the kernels lazily.
"""

from __future__ import annotations

from functools import cache

import torch


@cache
def triton_available() -> bool:
    """True when Triton imports and a CUDA device is visible."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
