"""E2M1, the 4-bit element format shared by MXFP4 and NVFP4.

A code is `s e1 e0 m` (sign bit 0x8). Magnitudes by code: 0, 0.5, 1, 1.5, 2, 3, 4, 6; there is no
Inf or NaN. Two codes share a byte: element 2i in the low nibble, element 2i+1 in the high nibble
(the layout of TransformerEngine, torchao and the hardware).

Inputs here are already divided by their block scale; callers own the scaling.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Midpoints between neighbouring grid values. At a tie RNE picks the even code (mantissa bit 0),
# so the comparison is `>=` where the upper neighbour's code is even and `>` where it is odd.
_RNE_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def _with_sign(magnitude_code: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # signbit keeps -0.0 (and tiny negatives flushed to zero) as 0x8, as torchao and the hardware do.
    return magnitude_code | (torch.signbit(x).to(torch.uint8) << 3)


def encode_rne(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to E2M1 codes, ties to even, saturating at +-6. NaN encodes as +-0."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for midpoint, ties_up in _RNE_STEPS:
        code += (a >= midpoint) if ties_up else (a > midpoint)
    return _with_sign(code, x)


def encode_stochastic(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Round float32 values to one of their two neighbouring E2M1 values, unbiased below saturation.

    A value a between grid points lo < hi rounds up with probability (a - lo) / (hi - lo), decided by
    one float32 uniform draw per element (every element draws, so the stream position depends only on
    the shape). Values beyond 6 saturate to 6; NaN encodes as +-0.
    """
    a = x.abs().clamp(max=E2M1_MAX)
    grid = torch.tensor(E2M1_GRID + (E2M1_MAX,), dtype=torch.float32, device=x.device)
    low = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
    for value in E2M1_GRID[1:]:
        low += a >= value
    lo, hi = grid[low], grid[low + 1]
    gap = hi - lo
    p_up = torch.where(gap > 0, (a - lo) / torch.where(gap > 0, gap, 1.0), 0.0)
    u = torch.rand(x.shape, generator=generator, dtype=torch.float32, device=x.device)
    code = (low + (u < p_up)).to(torch.uint8)
    return _with_sign(code, x)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element) to float32 values."""
    table = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32, device=codes.device)
    return table[codes.long() & 0xF]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim (even length): element 2i low nibble, 2i+1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., n] -> codes uint8 [..., 2n]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
