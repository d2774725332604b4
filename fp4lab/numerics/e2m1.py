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

# Midpoints between neighbouring grid values. At a tie RNE picks the even code (mantissa bit 0): up at
# 0.75, 1.75 and 3.5, down at the others. Moving each tie-up midpoint one float32 ulp down makes
# "code = number of boundaries strictly below |x|" round every tie the right way in one search.
_RNE_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_RNE_TIES_UP = (0.75, 1.75, 3.5)


def _rne_boundaries() -> torch.Tensor:
    mid = torch.tensor(_RNE_MIDPOINTS, dtype=torch.float32)
    below = torch.nextafter(mid, torch.zeros_like(mid))
    ties_up = torch.tensor([m in _RNE_TIES_UP for m in _RNE_MIDPOINTS])
    return torch.where(ties_up, below, mid)


_CONSTANTS = {"rne_boundaries": _rne_boundaries(), "decode_table": torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32)}
_on_device: dict[tuple[str, torch.device], torch.Tensor] = {}


def _constant(name: str, device: torch.device) -> torch.Tensor:
    """A lookup table on `device`, copied there once: a copy from host memory is not allowed while a
    CUDA graph is being captured, and a probe step's graph is captured after an eager one."""
    key = (name, device)
    if key not in _on_device:
        _on_device[key] = _CONSTANTS[name].to(device)
    return _on_device[key]


def _with_sign(magnitude_code: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # signbit keeps -0.0 (and tiny negatives flushed to zero) as 0x8, as torchao and the hardware do.
    return magnitude_code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)


def encode_rne(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values to E2M1 codes, ties to even, saturating at +-6. NaN encodes as +-0."""
    a = torch.nan_to_num(x.abs(), nan=0.0)
    return _with_sign(torch.bucketize(a, _constant("rne_boundaries", x.device)), x)


def round_to_nearest(x: torch.Tensor) -> torch.Tensor:
    """The E2M1 value nearest each float32 value, ties to even, saturating at +-6 (NaN -> +-0).

    The grid is uniform within [0, 2), [2, 4) and [4, 6] (steps 0.5, 1, 2), so rounding a to a multiple
    of its step, half to even, is RNE on the grid. Adding and subtracting step * 2^23 does exactly
    that in float32 (the sum's ulp is the step); the result equals decode(encode_rne(x)) bit for bit.
    """
    a = _magnitude(x)
    magic = _grid_exponent(a).add_(23).bitwise_left_shift_(23).view(torch.float32)
    return torch.copysign(a.add(magic).sub_(magic).clamp_(max=E2M1_MAX), x)


def round_stochastic(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One of the two E2M1 values around each float32 value, unbiased below saturation.

    A value a between grid points lo < hi rounds up with probability (a - lo) / (hi - lo), decided by
    one float32 uniform draw per element (every element draws, so the stream position depends only on
    the shape). Values beyond 6 saturate to 6; NaN becomes +-0.
    """
    a = _magnitude(x).clamp_(max=E2M1_MAX)
    step = _grid_exponent(a).bitwise_left_shift_(23).view(torch.float32)
    steps = a / step  # exact: step is a power of two
    low = steps.floor()
    u = torch.rand(x.shape, generator=generator, dtype=torch.float32, device=x.device)
    return torch.copysign((low + (u < steps - low)).mul_(step), x)


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN as 0 (and Inf as the largest float, which rounds to 6 all the same)."""
    return x.abs().nan_to_num_(nan=0.0)


def _grid_exponent(a: torch.Tensor) -> torch.Tensor:
    """The biased float32 exponent of the E2M1 grid step around a >= 0, from a's own exponent bits:
    126 (step 0.5) below 2, 127 (step 1) below 4, 128 (step 2) from 4 up (int32; comparisons and
    selects would cost several passes more over the tensor)."""
    return (a.view(torch.int32) >> 23).clamp_(127, 129).sub_(1)


def encode_grid(values: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of float32 values already on the grid (what round_to_nearest / round_stochastic
    return): from the float bits, no search. From 1 up, |v| = 2^e (1 + m/2) has code 2 + 2e + m,
    which is the top 9 bits of the float (biased exponent and first mantissa bit) minus 252; 0 and
    0.5 have codes 0 and 1, i.e. 2|v|. Equal to encode_rne on grid values, several times faster."""
    a = values.abs()
    code = torch.where(a >= 1.0, (a.view(torch.int32) >> 22) - 252, (a * 2.0).to(torch.int32))
    return _with_sign(code, values)


def decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8, one per element) to float32 values."""
    return _constant("decode_table", codes.device)[codes.long() & 0xF]


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim (even length): element 2i low nibble, 2i+1 high."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack`: uint8 [..., n] -> codes uint8 [..., 2n]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
