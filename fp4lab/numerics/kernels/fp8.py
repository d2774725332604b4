"""The fused FP8 quantizer: `fp8_quantize(x, ...).factored()` of the tensor-core path, in two passes over x:
the FP8 codes themselves (float8_e4m3fn / float8_e5m2, what FP8 tensor cores read: `nn.gemm.fp8_scaled_mm`)
or their values in bf16 (for bf16 tensor cores).

`numerics.fp8` quantizes in five or six torch passes (|x|, its max, x * scale, the clamp, the cast to
float8, the cast back to float32), and its scale in five or six more tiny ones (float64 casts, clamp,
quotient, reciprocal). Here:

1. the amax pass (`fp8_amax_bits`) reads x once and folds max |x| into int32 slots with atomic maxes on
   the floats' bits (non-negative floats order as their bits do, and every NaN's bits exceed +Inf's, so
   a NaN wins as torch's max propagates it): one slot for the tensor, or one per row and/or per column,
   both orientations of a rowwise pair from the same read;
2. the quantizing kernel reads x and its amax, makes the scale as `fp8.fp8_scale` does (the float64
   quotient fp8_max / max(amax, 1e-12), rounded once to float32; pow2 clears the mantissa), and writes
   each element's FP8 value (bf16, 4 significant bits at most: exact; or the float8 code) and
   `outer` = 1 / scale (float32, correctly rounded, as torch divides):

    value = RNE of x * scale onto the FP8 grid    fp32, from bits, as `kernels.quantize._grid_round` for E2M1

`fp8_quantize` clamps x * scale to +-fp8_max first; here it cannot exceed it by more than an fp32
rounding (the scale comes from x's own amax: |x * scale| <= fp8_max (1 + 2^-24)^2), which rounds back
to fp8_max on the grid, so the clamp is left out.

The grid: with m mantissa bits (3 for E4M3, 2 for E5M2) the step in the binade [2^e, 2^(e+1)) is
2^(e-m), and 2^(emin-m) below the smallest normal 2^emin (subnormals); adding magic = 2^(23-m) *
max(2^e, 2^emin), whose ulp is that step, rounds |v| onto it, ties to even, and subtracting it is
exact. That is the float8 cast's round to nearest even, so the values equal `fp8_quantize`'s
`data.to(float32)` bit for bit (NaN as NaN), and `outer` equals `Fp8Tensor.factored`'s. transpose=True
quantizes x^T (its rows are x's columns: a per-row scale is then one per column of x) from x's own
layout.

Import lazily, after `fp4lab.numerics.kernels.runs_on(device)`.
"""

from __future__ import annotations

import os
import struct

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
_AMAX_TILE = (64, 128, 8)  # the amax pass, as the NVFP4 one (read only)
_AMAX_TILES = 4  # tiles per program of the amax pass, stacked along the rows
# fp8.AMAX_EPS as the bits of a float64: a float literal in a kernel would be a float32 first.
_EPS_BITS = struct.unpack("<q", struct.pack("<d", AMAX_EPS))[0]


@triton.jit
def _fp8_grid(v, MANT: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr):
    """v (fp32, |v| at most an ulp above fp8_max, or NaN) rounded to nearest even onto the FP8 grid, in fp32."""
    a = tl.abs(v)
    magic_bits = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, MIN_NORMAL_BITS) + ((23 - MANT) << 23)
    magic = magic_bits.to(tl.float32, bitcast=True)
    q = (a + magic) - magic  # a NaN stays NaN
    return (q.to(tl.int32, bitcast=True) | (v.to(tl.int32, bitcast=True) & SIGN_BIT)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_amax_kernel(
    x_ptr, R, C, tensor_ptr, rows_ptr, cols_ptr,
    BR: tl.constexpr, BC: tl.constexpr, TILES: tl.constexpr, TENSOR: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
):  # fmt: skip
    """max |x| as int32 bits from one read: of the whole tensor into tensor_ptr[0] (TENSOR), of each row
    into rows_ptr[r] (ROWS), of each column into cols_ptr[c] (COLS). Maxima are taken on the bits, so
    a NaN propagates (module docstring); rows and columns past x load as 0, which changes no maximum."""
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    tensor_max = tl.zeros([], tl.int32)
    col_max = tl.zeros([BC], tl.int32)
    for i in tl.static_range(TILES):
        rows = (tl.program_id(0) * TILES + i) * BR + tl.arange(0, BR)
        inside = (rows < R)[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        bits = tl.abs(x).to(tl.int32, bitcast=True)
        if TENSOR:
            tensor_max = tl.maximum(tensor_max, tl.max(tl.max(bits, axis=1), axis=0))
        if ROWS:
            tl.atomic_max(rows_ptr + rows, tl.max(bits, axis=1), mask=rows < R)
        if COLS:
            col_max = tl.maximum(col_max, tl.max(bits, axis=0))
    if TENSOR:
        tl.atomic_max(tensor_ptr, tensor_max)
    if COLS:
        tl.atomic_max(cols_ptr + cols, col_max, mask=cols < C)


@triton.jit
def _fp8_scale(amax_bits, FP8_MAX: tl.constexpr, EPS_BITS: tl.constexpr, POW2: tl.constexpr):
    """fp8.fp8_scale from an amax's int32 bits: float32(fp8_max / max(amax, eps)) with the quotient in
    float64 (a NaN amax gives a NaN scale, an Inf one 0); POW2 clears the mantissa of a number."""
    amax = amax_bits.to(tl.float32, bitcast=True).to(tl.float64)
    eps = tl.full(amax.shape, EPS_BITS, tl.int64).to(tl.float64, bitcast=True)
    amax = tl.where(amax != amax, amax, tl.maximum(amax, eps))
    # A float64 quotient is correctly rounded (div.rn.f64); div_rn takes float32 only.
    scale = (tl.full(amax.shape, FP8_MAX, tl.float64) / amax).to(tl.float32)
    if POW2:
        scale = tl.where(scale != scale, scale, (scale.to(tl.int32, bitcast=True) & ~0x7FFFFF).to(tl.float32, bitcast=True))
    return scale


@triton.jit
def _fp8_kernel(
    x_ptr, amax_ptr, outer_ptr, out_ptr, R, C,
    BR: tl.constexpr, BC: tl.constexpr, SCALE: tl.constexpr, TRANSPOSE: tl.constexpr,
    MANT: tl.constexpr, MIN_NORMAL_BITS: tl.constexpr, FP8_MAX: tl.constexpr, EPS_BITS: tl.constexpr,
    POW2: tl.constexpr,
):  # fmt: skip
    """One [BR, BC] tile of x scaled onto the FP8 grid. The scale comes from amax_ptr (int32 bits: one,
    or one per row or column of x, by SCALE); the programs of the first tile column (per row and per
    tensor) or row (per column) store outer = 1 / scale."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    inside = (rows < R)[:, None] & (cols < C)[None, :]
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if SCALE == 0:
        scale = _fp8_scale(tl.load(amax_ptr), FP8_MAX, EPS_BITS, POW2)
        if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
            tl.store(outer_ptr, tl.math.div_rn(tl.full([], 1.0, tl.float32), scale))
        tile_scale = scale
    elif SCALE == 1:
        scale = _fp8_scale(tl.load(amax_ptr + rows, mask=rows < R, other=0), FP8_MAX, EPS_BITS, POW2)
        if tl.program_id(1) == 0:
            tl.store(outer_ptr + rows, tl.math.div_rn(tl.full([BR], 1.0, tl.float32), scale), mask=rows < R)
        tile_scale = scale[:, None]
    else:
        scale = _fp8_scale(tl.load(amax_ptr + cols, mask=cols < C, other=0), FP8_MAX, EPS_BITS, POW2)
        if tl.program_id(0) == 0:
            tl.store(outer_ptr + cols, tl.math.div_rn(tl.full([BC], 1.0, tl.float32), scale), mask=cols < C)
        tile_scale = scale[None, :]
    values = _fp8_grid(x * tile_scale, MANT, MIN_NORMAL_BITS).to(out_ptr.dtype.element_ty)  # exact: on the grid
    if TRANSPOSE:  # the tile transposed in registers, so that x^T's rows are stored contiguously
        tl.store(out_ptr + cols.to(tl.int64)[:, None] * R + rows[None, :], tl.trans(values), mask=tl.trans(inside))
    else:
        tl.store(out_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], values, mask=inside)


def _check_input(x) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"fp8_quantize_fused: x must be a non-empty 2D tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not (x.is_cuda or _INTERPRETED and x.device.type == "cpu"):
        raise ValueError(f"fp8_quantize_fused: x is on {x.device}; use a CUDA tensor (or numerics.fp8.fp8_quantize)")


def fp8_amax_bits(x: torch.Tensor, tensor: bool = False, rows: bool = False, cols: bool = False) -> dict[str, torch.Tensor]:
    """max |x| of a 2D tensor as int32 bits, from one read: "tensor" (shape [1]), "rows" ([R]) and/or
    "cols" ([C]), as asked. `fp8_quantize_fused` takes one of them as its `amax_bits`."""
    _check_input(x)
    x = x.contiguous()
    R, C = x.shape
    slots = {name: torch.zeros(n, dtype=torch.int32, device=x.device)
             for name, n, wanted in (("tensor", 1, tensor), ("rows", R, rows), ("cols", C, cols)) if wanted}
    if not slots:
        raise ValueError("fp8_amax_bits: ask for at least one of tensor, rows and cols")
    unused = next(iter(slots.values()))  # a pointer for the amaxes not asked for; never written
    br, bc, warps = _AMAX_TILE
    _fp8_amax_kernel[(triton.cdiv(R, br * _AMAX_TILES), triton.cdiv(C, bc))](
        x, R, C, slots.get("tensor", unused), slots.get("rows", unused), slots.get("cols", unused),
        BR=br, BC=bc, TILES=_AMAX_TILES, TENSOR=tensor, ROWS=rows, COLS=cols, num_warps=warps,
    )  # fmt: skip
    return slots


def fp8_quantize_fused(x: torch.Tensor, element: str = "e4m3", scaling: str = "tensor", *, pow2: bool = False,
                       transpose: bool = False, codes: bool = False, amax_bits: torch.Tensor | None = None) -> FusedQuant:
    """`fp8_quantize(y, element, scaling, pow2=pow2).factored()` of y = x (or x^T), as the GEMM reads it:
    `values` [rows, cols] of y in bf16, or with `codes` in the element's float8 dtype (the same numbers:
    `fp8_quantize(...).data`), `outer` 1 / scale (0-dim, or [rows, 1] of y). x: a 2D float32, bfloat16
    or float16 tensor on a CUDA device (or the CPU under Triton's interpreter). `amax_bits`: x's amax
    from `fp8_amax_bits` (that of the tensor, or of each row of y), where an operand pair shares one read."""
    _check_input(x)
    check_arguments(x, element, scaling)
    x = x.contiguous()
    rows, cols = x.shape
    mode = _SCALAR if scaling == "tensor" else _PER_COL if transpose else _PER_ROW
    if amax_bits is None:
        amax_bits = next(iter(fp8_amax_bits(x, tensor=mode == _SCALAR, rows=mode == _PER_ROW, cols=mode == _PER_COL).values()))
    scales = 1 if mode == _SCALAR else cols if transpose else rows
    if amax_bits.dtype != torch.int32 or amax_bits.numel() != scales:
        raise ValueError(f"fp8_quantize_fused: amax_bits must be {scales} int32 values (fp8_amax_bits), got {amax_bits.dtype} {list(amax_bits.shape)}")
    mantissa, emin = _GRIDS[element]
    dtype = FP8_DTYPES[element] if codes else torch.bfloat16
    values = torch.empty((cols, rows) if transpose else (rows, cols), dtype=dtype, device=x.device)
    outer = torch.empty(() if mode == _SCALAR else (scales, 1), dtype=torch.float32, device=x.device)
    br, bc, warps = _TILE
    _fp8_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bc))](
        x, amax_bits, outer, values, rows, cols, BR=br, BC=bc, SCALE=mode, TRANSPOSE=transpose,
        MANT=mantissa, MIN_NORMAL_BITS=(127 + emin) << 23, FP8_MAX=torch.finfo(FP8_DTYPES[element]).max,
        EPS_BITS=_EPS_BITS, POW2=pow2, num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return FusedQuant(values, outer)  # Fp8Tensor.factored's outer
