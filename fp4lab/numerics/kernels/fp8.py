"""The fused FP8 quantizer: `fp8_quantize(x, ...).factored()` of the tensor-core path, in one pass over x:
the FP8 codes themselves (float8_e4m3fn / float8_e5m2, what FP8 tensor cores read: `nn.gemm.fp8_scaled_mm`)
or their values in bf16 (for bf16 tensor cores).

`numerics.fp8` quantizes in five or six torch passes (|x|, its max, x * scale, the clamp, the cast to
float8, the cast back to float32), then the GEMM path casts the values to bf16: on an H200 that made
the fp8 recipes the slowest but the CTA-local ones (0.23x of bf16). Here the amax is one reduction
(`torch.linalg.vector_norm` with ord=inf: max |x|, NaN propagated, no |x| written), the scale comes
from `fp8.fp8_scale` given that amax (its float64 quotient, one rounding), and one kernel reads x and
writes what the GEMM reads, each element's FP8 value in bf16 (4 significant bits at most: exact):

    value = RNE of x * scale onto the FP8 grid    fp32, from bits, as `kernels.quantize._grid_round` for E2M1

`fp8_quantize` clamps x * scale to +-fp8_max first; here it cannot exceed it by more than an fp32
rounding (the scale comes from x's own amax: |x * scale| <= fp8_max (1 + 2^-24)^2), which rounds back
to fp8_max on the grid, so the clamp is left out.

The grid: with m mantissa bits (3 for E4M3, 2 for E5M2) the step in the binade [2^e, 2^(e+1)) is
2^(e-m), and 2^(emin-m) below the smallest normal 2^emin (subnormals); adding magic = 2^(23-m) *
max(2^e, 2^emin), whose ulp is that step, rounds |v| onto it, ties to even, and subtracting it is
exact. That is the float8 cast's round to nearest even, so the values equal `fp8_quantize`'s
`data.to(float32)` bit for bit (NaN as NaN), and `outer` (1 / scale, as `Fp8Tensor.factored`) equals
its outer. transpose=True quantizes x^T (its rows are x's columns: a per-row scale is then one per
column of x) from x's own layout.

Import lazily, after `fp4lab.numerics.kernels.runs_on(device)`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fp4lab.numerics.fp8 import FP8_DTYPES, fp8_scale
from fp4lab.numerics.kernels.quantize import SIGN_BIT, FusedQuant

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# (mantissa bits, exponent of the smallest normal) of each element format
_GRIDS = {"e4m3": (3, -6), "e5m2": (2, -14)}
_TILE = (32, 128, 4)  # [rows, cols] of x per program, warps: copy-like; not yet swept on a GPU
_SCALAR, _PER_ROW, _PER_COL = 0, 1, 2


@triton.jit
def _fp8_grid(v, MANT: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr):
    """v (fp32, |v| at most an ulp above fp8_max, or NaN) rounded to nearest even onto the FP8 grid, in fp32."""
    a = tl.abs(v)
    magic_bits = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, MIN_NORMAL_BITS) + ((23 - MANT) << 23)
    magic = magic_bits.to(tl.float32, bitcast=True)
    q = (a + magic) - magic  # a NaN stays NaN
    return (q.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & SIGN_BIT)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_kernel(
    x_ptr, scale_ptr, out_ptr, R, C,
    BR: tl.constexpr, BC: tl.constexpr, SCALE: tl.constexpr, TRANSPOSE: tl.constexpr,
    MANT: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if SCALE == 0:
        scale = tl.load(scale_ptr)
    elif SCALE == 1:
        scale = tl.load(scale_ptr + rows, mask=rows < R, other=0.0)[:, None]
    else:
        scale = tl.load(scale_ptr + cols, mask=cols < C, other=0.0)[None, :]
    values = _fp8_grid(x * scale, MANT, MIN_NORMAL_BITS).to(out_ptr.dtype.element_ty)  # exact: on the grid
    if TRANSPOSE:  # the tile transposed in registers, so that x^T's rows are stored contiguously
        tl.store(out_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], tl.trans(values), mask=tl.trans(inside))
    else:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], values, mask=inside)


def fp8_quantize_fused(x: torch.Tensor, element: str = "e4m3", scaling: str = "tensor", *, pow2: bool = False,
                       transpose: bool = False, codes: bool = False) -> FusedQuant:
    """`fp8_quantize(y, element, scaling, pow2=pow2).factored()` of y = x (or x^T), as the GEMM reads it:
    `values` [rows, cols] of y in bf16, or with `codes` in the element's float8 dtype (the same numbers:
    `fp8_quantize(...).data`), `outer` 1 / scale (0-dim, or [rows, 1] of y). x: a 2D float32, bfloat16
    or float16 tensor on a CUDA device (or the CPU under Triton's interpreter)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"fp8_quantize_fused: x must be a non-empty 2D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not (x.is_cuda or _INTERPRETED and x.device.type == "cpu"):
        raise ValueError(f"fp8_quantize_fused: x is on {x.device}; use a CUDA tensor (or numerics.fp8.fp8_quantize)")
    x = x.contiguous()
    rows, cols = x.shape
    inf = float("inf")
    if scaling == "tensor":
        amax, mode = torch.linalg.vector_norm(x, inf), _SCALAR
    elif transpose:  # a row of x^T is a column of x
        amax, mode = torch.linalg.vector_norm(x, inf, dim=0).reshape(cols, 1), _PER_COL
    else:
        amax, mode = torch.linalg.vector_norm(x, inf, dim=1, keepdim=True), _PER_ROW
    scale = fp8_scale(x.T if transpose else x, element, scaling, pow2=pow2, amax=amax)  # checks the arguments
    mantissa, emin = _GRIDS[element]
    dtype = FP8_DTYPES[element] if codes else torch.bfloat16
    values = torch.empty((cols, rows) if transpose else (rows, cols), dtype=dtype, device=x.device)
    br, bc, warps = _TILE
    _fp8_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bc))](
        x, scale.reshape(-1).contiguous(), values, rows, cols, BR=br, BC=bc, SCALE=mode, TRANSPOSE=transpose,
        MANT=mantissa, MIN_NORMAL_BITS=(127 + emin) << 23,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return FusedQuant(values, 1.0 / scale)  # Fp8Tensor.factored's outer
