"""The fused FP8 quantizer: `fp8_quantize(x, ...).factored()` of the tensor-core path in two passes over x:
the FP8 codes themselves (float8_e4m3fn / float8_e5m2, what FP8 tensor cores read: `nn.gemm.fp8_scaled_mm`)
or their values in bf16 (for bf16 tensor cores), and the decode scale.

`numerics.fp8` quantizes in five or six torch passes (|x|, its max, x * scale, the clamp, the cast to
float8, the cast back to float32) and a handful of scalar ops for the scale; on the GPU's fast path,
where each operand of each linear is quantized every step, those small launches and torch's max
reduction cost more than the quantizing itself (docs/BENCHMARKS.md, the fp8 profile). Here:

1. `fp8_amax_bits`: one pass over x takes max |x| per tile and folds it into the amax (per tensor, per
   row, or per column of x) with an integer atomic max on the float's bits: |x|'s bits order as its
   values do, and a NaN's (above +inf's) wins, so NaN propagates as `fp8_amax`'s does;
2. the quantizer reads that amax and makes the scale itself, as `fp8.fp8_scale` does (fp8_max over the
   amax clamped to AMAX_EPS, one float64 quotient rounded to float32, rounded down to a power of two
   with pow2) and the decode scale 1 / scale (a float64 quotient rounded to float32: the correctly
   rounded float32 reciprocal, as torch's), writes those once, and reads x again to write each
   element's value:

    value = RNE of x * scale onto the FP8 grid    fp32, from bits, as `kernels.quantize._grid_round` for E2M1

`fp8_quantize` clamps x * scale to +-fp8_max first; here it cannot exceed it by more than an fp32
rounding (the scale comes from an amax at least x's own: |x * scale| <= fp8_max (1 + 2^-24)^2), which
rounds back to fp8_max on the grid, so the clamp is left out.

The grid: with m mantissa bits (3 for E4M3, 2 for E5M2) the step in the binade [2^e, 2^(e+1)) is
2^(e-m), and 2^(emin-m) below the smallest normal 2^emin (subnormals); adding magic = 2^(23-m) *
max(2^e, 2^emin), whose ulp is that step, rounds |v| onto it, ties to even, and subtracting it is
exact. That is the float8 cast's round to nearest even, so the values equal `fp8_quantize`'s
`data.to(float32)` bit for bit (NaN as NaN), and `outer` (1 / scale, as `Fp8Tensor.factored`) equals
its outer. transpose=True quantizes x^T (its rows are x's columns: a per-row scale is then one per
column of x) from x's own layout; a pair of operands of one tensor with per-tensor scales shares one
amax pass (`amax_bits`).

Import lazily, after `fp4lab.numerics.kernels.runs_on(device)`.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fp4lab.numerics.fp8 import AMAX_EPS, FP8_DTYPES, check_arguments
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
def _amax_kernel(x_ptr, amax_ptr, R, C, BR: tl.constexpr, BC: tl.constexpr, MODE: tl.constexpr):
    """amax_ptr (int32 bits of max |x|, zeroed first) folded with this tile's maxima: one, per row or per column."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |x|; NaN above +inf
    if MODE == 0:
        tl.atomic_max(amax_ptr, tl.max(tl.max(bits, axis=1), axis=0))
    elif MODE == 1:
        tl.atomic_max(amax_ptr + rows, tl.max(bits, axis=1), mask=rows < R)
    else:
        tl.atomic_max(amax_ptr + cols, tl.max(bits, axis=0), mask=cols < C)


@triton.jit
def _scale_from_amax(amax_bits, FP8_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr):
    """(scale, 1 / scale) in fp32 from amax's bits, as `numerics.fp8.fp8_scale` and torch's reciprocal."""
    amax = amax_bits.to(tl.float32, bitcast=True).to(tl.float64)
    clamped = tl.where(amax != amax, amax, tl.maximum(amax, tl.full([], EPS, tl.float64)))  # a NaN stays NaN
    scale = (FP8_MAX / clamped).to(tl.float32)
    if POW2:
        pow2 = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        scale = tl.where(scale != scale, scale, pow2)
    return scale, (1.0 / scale.to(tl.float64)).to(tl.float32)


@triton.jit
def _fp8_kernel(
    x_ptr, amax_ptr, out_ptr, outer_ptr, R, C,
    BR: tl.constexpr, BC: tl.constexpr, SCALE: tl.constexpr, TRANSPOSE: tl.constexpr,
    MANT: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, FP8_MAX: tl.constexpr, EPS: tl.constexpr, POW2: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if SCALE == 0:
        scale, outer = _scale_from_amax(tl.load(amax_ptr), FP8_MAX, EPS, POW2)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(outer_ptr, outer)
    elif SCALE == 1:
        scale, outer = _scale_from_amax(tl.load(amax_ptr + rows, mask=rows < R, other=0), FP8_MAX, EPS, POW2)
        tl.store(outer_ptr + rows, outer, mask=(rows < R) & (tl.program_id(1) == 0))
        scale = scale[:, None]
    else:
        scale, outer = _scale_from_amax(tl.load(amax_ptr + cols, mask=cols < C, other=0), FP8_MAX, EPS, POW2)
        tl.store(outer_ptr + cols, outer, mask=(cols < C) & (tl.program_id(0) == 0))
        scale = scale[None, :]
    values = _fp8_grid(x * scale, MANT, MIN_NORMAL_BITS).to(out_ptr.dtype.element_ty)  # exact: on the grid
    if TRANSPOSE:  # the tile transposed in registers, so that x^T's rows are stored contiguously
        tl.store(out_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], tl.trans(values), mask=tl.trans(inside))
    else:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], values, mask=inside)


def _mode(scaling: str, transpose: bool) -> int:
    return _SCALAR if scaling == "tensor" else _PER_COL if transpose else _PER_ROW


def fp8_amax_bits(x: torch.Tensor, scaling: str = "tensor", transpose: bool = False) -> torch.Tensor:
    """The int32 bits of the amax behind the scale of x (or x^T): max |x| as a 1-element tensor
    ("tensor"), or one per row of x (or of x^T: per column of x) for "row"; NaN where a NaN is inside."""
    x = x.contiguous()
    rows, cols = x.shape
    mode = _mode(scaling, transpose)
    amax = torch.zeros(1 if mode == _SCALAR else cols if mode == _PER_COL else rows, dtype=torch.int32, device=x.device)
    br, bc, warps = _TILE
    _amax_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bc))](x, amax, rows, cols, BR=br, BC=bc, MODE=mode, num_warps=warps)
    return amax


def fp8_quantize_fused(x: torch.Tensor, element: str = "e4m3", scaling: str = "tensor", *, pow2: bool = False,
                       transpose: bool = False, codes: bool = False, amax_bits: torch.Tensor | None = None) -> FusedQuant:
    """`fp8_quantize(y, element, scaling, pow2=pow2).factored()` of y = x (or x^T), as the GEMM reads it:
    `values` [rows, cols] of y in bf16, or with `codes` in the element's float8 dtype (the same numbers:
    `fp8_quantize(...).data`), `outer` 1 / scale (0-dim, or [rows, 1] of y). x: a 2D float32, bfloat16
    or float16 tensor on a CUDA device (or the CPU under Triton's interpreter). `amax_bits`: the
    `fp8_amax_bits` of this x, scaling and orientation, made once for two operands that share it."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"fp8_quantize_fused: x must be a non-empty 2D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not (x.is_cuda or _INTERPRETED and x.device.type == "cpu"):
        raise ValueError(f"fp8_quantize_fused: x is on {x.device}; use a CUDA tensor (or numerics.fp8.fp8_quantize)")
    check_arguments(x, element, scaling)
    x = x.contiguous()
    rows, cols = x.shape
    mode = _mode(scaling, transpose)
    amax = fp8_amax_bits(x, scaling, transpose) if amax_bits is None else amax_bits
    mantissa, emin = _GRIDS[element]
    dtype = FP8_DTYPES[element] if codes else torch.bfloat16
    values = torch.empty((cols, rows) if transpose else (rows, cols), dtype=dtype, device=x.device)
    outer = torch.empty(() if mode == _SCALAR else ((cols if transpose else rows), 1), dtype=torch.float32, device=x.device)
    br, bc, warps = _TILE
    _fp8_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bc))](
        x, amax, values, outer, rows, cols, BR=br, BC=bc, SCALE=mode, TRANSPOSE=transpose,
        MANT=mantissa, MIN_NORMAL_BITS=(127 + emin) << 23, FP8_MAX=torch.finfo(FP8_DTYPES[element]).max,
        EPS=AMAX_EPS, POW2=pow2, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return FusedQuant(values, outer)  # Fp8Tensor.factored's outer
