"""Whether the fused GPU quantizers (fp4lab.numerics.triton_quantize) can run here.

Torch-only on purpose: fp4lab never imports Triton at import time, so CPU runs and `fp4lab --help`
stay fast and work without it. Callers ask `triton_available()` and import the kernels lazily.
"""

from __future__ import annotations

import importlib.util
import os
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


def triton_runs_on(device: torch.device) -> bool:
    """Whether fp4lab's Triton kernels can run on tensors on `device`: a CUDA device with Triton, or
    the CPU under Triton's interpreter (TRITON_INTERPRET=1, read when a kernel module is imported)."""
    if device.type == "cuda":
        return triton_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def fast_fake_quantize(x: torch.Tensor, fmt: str, **options) -> torch.Tensor:
    """`numerics.fake_quantize(x, fmt, **options)` bit for bit (round to nearest, along the last dim):
    by the fused Triton quantizer, one amax read and one pass, where it runs on x's device, else by
    that torch reference. `options` are those both take (cta_tile, scale_mode)."""
    if triton_runs_on(x.device):
        from fp4lab.numerics.triton_quantize import quantize_fused

        return quantize_fused(x.reshape(-1, x.shape[-1]), fmt=fmt, **options).dequantize().view(x.shape)
    from fp4lab.numerics.quantize import fake_quantize

    return fake_quantize(x, fmt, **options)
