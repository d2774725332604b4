"""`fast_fake_quantize`: the fused Triton quantizer where it runs, else the torch reference, the same bits.

Its own module: `fast` (torch-only) is what the Triton kernels import to ask whether they can run, so
a function there that calls them would close an import cycle."""

from __future__ import annotations

import torch

from fp4lab.numerics.fast import triton_runs_on
from fp4lab.numerics.quantize import fake_quantize


def fast_fake_quantize(x: torch.Tensor, fmt: str, **options) -> torch.Tensor:
    """`numerics.fake_quantize(x, fmt, **options)` bit for bit (round to nearest, along the last dim):
    by the fused Triton quantizer, one amax read and one pass, where it runs on x's device, else by
    that torch reference. `options` are those both take (cta_tile, scale_mode)."""
    if triton_runs_on(x.device):
        from fp4lab.numerics.triton_quantize import quantize_fused

        return quantize_fused(x.reshape(-1, x.shape[-1]), fmt=fmt, **options).dequantize().view(x.shape)
    return fake_quantize(x, fmt, **options)
