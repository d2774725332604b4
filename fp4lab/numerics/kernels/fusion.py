"""Fused Triton producers: the FP4 quantizer of triton_quantize fused with the op that makes its
input, bit for bit equal to fp4lab.numerics.fusion (the torch reference; its docstring says why these
boundaries). Imports Triton: import it lazily, after `fp4lab.numerics.kernels.runs_on(device)`.

    swiglu_quantize_fused(gate, up, fmt=f, col=c, ...)       == swiglu_quantize_reference(...)
    residual_rmsnorm_quantize_fused(x, r, w, eps, fmt=f, ...) == residual_rmsnorm_quantize_reference(...)
    swiglu_backward_fused(grad_h, gate, up, row=..., col=...)  == swiglu_backward_reference(...)

(`values`, `outer`, `codes`, `scales` of each encoding, and the bf16/fp32 tensors). The block
quantization is triton_quantize's `_quantize_store` and `_finite_amax`, called on the produced tile in
registers instead of a tile loaded from HBM; options and their validation are quantize_fused's.

Passes and HBM traffic, in units of one [tokens, features] activation (a bf16 h is one unit; codes
and scale bytes, about a quarter of a bf16 unit per orientation, are left out of both columns):

    producer               unfused (torch ops, then quantize_fused)      fused
    swiglu, mxfp4          silu r1 w1, mul r2 w1, quantize r1 = 6        r2 = 2
    swiglu, nvfp4          as mxfp4 + the amax pass r1 = 7               amax pass r2, quantize r2 = 4
    add + rmsnorm, mxfp4   add r2 w1, rmsnorm r1 w1, quantize r1 = 6     r2 w1 = 3 (one pass)
    add + rmsnorm, nvfp4   as mxfp4 + amax r1 = 7                        stats r2 w1, quantize r1 = 4
    (either, with n^T)     the same (quantize_fused_both: one read)      4; nvfp4 + a tile amax r1 = 5
    swiglu backward        mul r2 w1, mul r2 w1, silu' r2 w1 = 9         r3 w2 = 5 (encodings too)
      (quantized, nvfp4)   + per gradient an amax r1 and a read r1 = 13  + an amax pass r3 = 8

(torch's rms_norm may itself take more than one pass; the swiglu backward needs no saved silu(gate),
which autograd keeps from the forward for the unfused product: one activation of memory per layer.)

NVFP4's tensor scale needs the amax of the whole produced tensor before any block is quantized, so
its producers run twice: an amax pass that computes the tile and folds its finite block amax into one
int32 with an atomic max (no host sync, as quantize_fused), then the quantize pass, which recomputes
the tile from the inputs (cheaper than writing and reading it back: h is never stored). RMSNorm
writes s anyway (the residual stream), so its quantize pass reads s and the row's rstd.

Exactness: every float32 operation is the reference's, in its order, compiled without FMA
contraction (the one fma, in silu's derivative on CUDA, is written out: nvcc contracts torch's);
divisions are `div_rn` and the square root `sqrt_rn`; roundings to bf16 are done on
the bits (round to nearest even), since the interpreter's float casts truncate. The one function
outside that control is exp (in silu and its derivative): on CUDA the kernels call libdevice's expf,
the function torch's CUDA silu calls (Triton links libdevice with flush-to-zero on, so an exp whose
result is subnormal gives 0; 1 + that is 1 either way, so silu and its derivative do not change),
and under Triton's CPU interpreter numpy's exp, which differs
from torch's CPU exp in the last bit of a fraction of fp32 results (after rounding to bf16 that
almost never shows; the tests say how it is checked).

Status (2026-12-02): checked against the references under Triton's CPU interpreter, and compiled
for sm_90 without a GPU (the PTX has no flushed add/mul/div/sqrt, correctly rounded div and sqrt,
and fma only in libdevice's expf and the written-out one). On the H200 the benchmark ran and the
CUDA reference checks of tests/kernels/test_triton_fusion.py passed, but its kernel-exactness tests did not
finish compiling inside a device call (docs/BENCHMARKS.md): that libdevice's expf and nvcc's fma
give torch's CUDA bits is shown on the CPU only so far.

Not supported (ValueError): inputs other than 2D contiguous bf16/fp32 CUDA tensors (CPU under the
interpreter), the quantize options quantize_fused rejects, and for RMSNorm a last dim above 16384.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fp4lab.numerics.fusion import RMSNORM_MAX_WIDTH, RMSNORM_SUM_LANES
from fp4lab.numerics.kernels.quantize import (
    _AMAX_TILES,
    _INTERPRETED,
    _OPTION_NAMES,
    _TILE_AMAX,
    _TILE_COL,
    _TILE_ROW,
    FusedQuant,
    _allocate,
    _constexprs,
    _finite_amax,
    _fp32,
    _load,
    _Orientation,
    _orientation,
    _quantize_store,
    _store,
)

# Producers of the generic tile kernels (constexpr P)
_SWIGLU = tl.constexpr(0)  # a = gate, b = up: h
_NORM_APPLY = tl.constexpr(1)  # a = s, rstd, w: n = (s * rstd) * w
_NORM_ELEMENTS = 8192  # rows per RMSNorm program: this many elements (not yet swept on a GPU)
_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class FusedSwiglu:
    h: torch.Tensor | None  # with emit_h
    row: FusedQuant
    col: FusedQuant | None


@dataclass(frozen=True)
class FusedRmsnorm:
    residual: torch.Tensor
    rstd: torch.Tensor
    normed: torch.Tensor | None  # with emit_normed
    row: FusedQuant
    col: FusedQuant | None


@dataclass(frozen=True)
class FusedSwigluGrads:
    d_gate: torch.Tensor
    d_up: torch.Tensor
    gate_row: FusedQuant | None = None
    up_row: FusedQuant | None = None
    gate_col: FusedQuant | None = None
    up_col: FusedQuant | None = None


# ----------------------------------------------------------------------------------------------
# Producer building blocks: [M, N] float32 tiles
# ----------------------------------------------------------------------------------------------


@triton.jit
def _round_bf16(x):
    """x rounded to the nearest bf16 (ties to even), as float32, from its bits (the interpreter's
    float cast truncates). Overflow rounds to Inf as torch's cast does; NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x != x, x, rounded)


@triton.jit
def _exp(x, ACCURATE: tl.constexpr):
    """expf as torch's CUDA kernels call it (libdevice); numpy's exp under the interpreter."""
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _silu(g, ACCURATE: tl.constexpr):
    """torch's silu in float32: x / (1 + exp(-x))."""
    return tl.math.div_rn(g, 1.0 + _exp(-g, ACCURATE))


@triton.jit
def _produce(
    P: tl.constexpr, a_ptr, b_ptr, rstd_ptr, w_ptr, rows, cols, R, C,
    EVEN: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr, ACCURATE: tl.constexpr,
):  # fmt: skip
    """The produced tile at [rows, cols] as float32 (0 outside [R, C]): the reference's expression,
    each rounding to the activation dtype where torch rounds (IN_BF16: the inputs' dtype is bf16;
    OUT_BF16: the produced tensor's). Padding elements produce 0 (silu(0) * 0, 0 * rstd * 0)."""
    a = _load(a_ptr, rows, cols, R, C, EVEN)
    if P == _SWIGLU:
        s = _silu(a, ACCURATE)
        if IN_BF16:
            s = _round_bf16(s)
        out = s * _load(b_ptr, rows, cols, R, C, EVEN)
    else:  # _NORM_APPLY
        rstd = tl.load(rstd_ptr + rows, mask=rows < R, other=0.0)
        t = a * rstd[:, None]
        if IN_BF16:  # .type_as(s)
            t = _round_bf16(t)
        out = t * tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)[None, :]
    if OUT_BF16:
        out = _round_bf16(out)
    return out


@triton.jit
def _silu_backward(t, g, ACCURATE: tl.constexpr):
    """aten.silu_backward in float32: t * sig * (1 + g * (1 - sig)), sig = 1 / (1 + exp(-g)). On CUDA
    nvcc contracts `1 + g * (1 - sig)` into one fma (its default --fmad=true), so the kernel does too;
    the CPU build of torch does not (checked by the tests on each)."""
    sig = tl.math.div_rn(1.0, 1.0 + _exp(-g, ACCURATE))
    if ACCURATE:
        inner = tl.fma(g, 1.0 - sig, 1.0)
    else:
        inner = 1.0 + g * (1.0 - sig)
    return t * sig * inner


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _producer_quantize_kernel(
    a_ptr, b_ptr, rstd_ptr, w_ptr, out_ptr, R, C,
    r_val, r_codes, r_scales, r_signs, r_seed, r_u, r_amax, r_outer,
    c_val, c_codes, c_scales, c_signs, c_seed, c_u, c_amax, c_outer,
    P: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr, ACCURATE: tl.constexpr, STORE: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, EVEN: tl.constexpr,
    ROW: tl.constexpr, R_NV: tl.constexpr, R_MODE: tl.constexpr, R_H: tl.constexpr,
    R_SR: tl.constexpr, R_GIVEN_U: tl.constexpr, R_CODES: tl.constexpr, R_VALUES: tl.constexpr,
    COL: tl.constexpr, C_NV: tl.constexpr, C_MODE: tl.constexpr, C_H: tl.constexpr,
    C_SR: tl.constexpr, C_GIVEN_U: tl.constexpr, C_CODES: tl.constexpr, C_VALUES: tl.constexpr,
):  # fmt: skip
    """triton_quantize._quantize_kernel with the tile produced in registers from the producer's inputs
    (and stored in the activation dtype with STORE) instead of loaded."""
    r0 = tl.program_id(0) * BR
    c0 = tl.program_id(1) * BC
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BC)
    x = _produce(P, a_ptr, b_ptr, rstd_ptr, w_ptr, rows, cols, R, C, EVEN, IN_BF16, OUT_BF16, ACCURATE)
    if STORE:
        _store(out_ptr, rows, cols, R, C, x.to(out_ptr.dtype.element_ty), EVEN)  # exact: x is rounded already
    if ROW:
        _quantize_store(
            x, r0, c0, R, C, r_val, r_codes, r_scales, r_signs, r_seed, r_u, r_amax, r_outer,
            BR, BC, R_NV, R_MODE, R_H, R_SR, R_GIVEN_U, R_CODES, R_VALUES, EVEN,
        )  # fmt: skip
    if COL:
        _quantize_store(
            tl.trans(x), c0, r0, C, R, c_val, c_codes, c_scales, c_signs, c_seed, c_u, c_amax, c_outer,
            BC, BR, C_NV, C_MODE, C_H, C_SR, C_GIVEN_U, C_CODES, C_VALUES, EVEN,
        )  # fmt: skip


@triton.jit
def _producer_amax_kernel(
    a_ptr, b_ptr, rstd_ptr, w_ptr, R, C, r_amax, r_signs, c_amax, c_signs,
    P: tl.constexpr, IN_BF16: tl.constexpr, OUT_BF16: tl.constexpr, ACCURATE: tl.constexpr,
    BR: tl.constexpr, BC: tl.constexpr, TILES: tl.constexpr, EVEN: tl.constexpr,
    ROW: tl.constexpr, R_H: tl.constexpr, COL: tl.constexpr, C_H: tl.constexpr,
):  # fmt: skip
    """triton_quantize._amax_kernel over the produced tiles: NVFP4 tensor amaxes, one atomic each per
    program of TILES tiles."""
    row_max = tl.zeros([], tl.float32)
    col_max = tl.zeros([], tl.float32)
    c0 = tl.program_id(1) * BC
    cols = c0 + tl.arange(0, BC)
    for i in tl.static_range(TILES):
        rows = (tl.program_id(0) * TILES + i) * BR + tl.arange(0, BR)
        x = _produce(P, a_ptr, b_ptr, rstd_ptr, w_ptr, rows, cols, R, C, EVEN, IN_BF16, OUT_BF16, ACCURATE)
        if ROW:
            row_max = tl.maximum(row_max, _finite_amax(x, r_signs, BR, BC, R_H, 1, 16))
        if COL:
            col_max = tl.maximum(col_max, _finite_amax(tl.trans(x), c_signs, BC, BR, C_H, 1, 16))
    if ROW:
        tl.atomic_max(r_amax, row_max.to(tl.int32, bitcast=True))
    if COL:
        tl.atomic_max(c_amax, col_max.to(tl.int32, bitcast=True))


@triton.jit
def _halve(t, M: tl.constexpr, W: tl.constexpr):
    """[M, W] -> [M, W / 2]: element i plus element i + W / 2 (the reference's halving step)."""
    first, second = tl.split(tl.permute(tl.reshape(t, [M, 2, W // 2]), [0, 2, 1]))
    return first + second


@triton.jit
def _lane_sum(t, M: tl.constexpr, LANES: tl.constexpr):
    """Row sums of [M, LANES] (LANES = RMSNORM_SUM_LANES = 32) by halving, in rmsnorm_reference's order."""
    tl.static_assert(LANES == 32)
    t = _halve(t, M, 32)
    t = _halve(t, M, 16)
    t = _halve(t, M, 8)
    t = _halve(t, M, 4)
    t = _halve(t, M, 2)
    return tl.reshape(t, [M])


@triton.jit
def _sum_of_squares(x_ptr, res_ptr, rows, R, D, M: tl.constexpr, PW: tl.constexpr, LANES: tl.constexpr, S_BF16: tl.constexpr):
    """Row sums of s * s for s = x + residual (rounded to bf16 with S_BF16), in rmsnorm_reference's
    order: the row streamed in LANES-wide chunks, lane j adding columns j, j + LANES, ... by elementwise
    adds, then `_lane_sum`. The order before, a halving tree over the whole row, shuffles the layout of
    the [M, 1024] tile once per level; the kernel with it took 0.68 ms per 16384 x 768 call on an H200,
    27x the compiled nn.RMSNorm (docs/BENCHMARKS.md)."""
    lanes = tl.arange(0, LANES)
    acc = tl.zeros([M, LANES], tl.float32)
    for c0 in range(0, PW, LANES):  # a constexpr bound (Triton's interpreter cannot loop to a runtime D); chunks past D load zeros
        s = _load(x_ptr, rows, c0 + lanes, R, D, False) + _load(res_ptr, rows, c0 + lanes, R, D, False)
        if S_BF16:
            s = _round_bf16(s)
        acc += s * s
    return _lane_sum(acc, M, LANES)


@triton.jit
def _rmsnorm_rows_kernel(
    x_ptr, res_ptr, w_ptr, s_ptr, rstd_ptr, n_ptr, R, D, eps,
    val_ptr, codes_ptr, scales_ptr, signs_ptr, seed_ptr, u_ptr, amax_ptr, outer_ptr,
    M: tl.constexpr, PW: tl.constexpr, LANES: tl.constexpr, S_BF16: tl.constexpr, N_BF16: tl.constexpr, STORE_N: tl.constexpr,
    QUANTIZE: tl.constexpr, AMAX: tl.constexpr, NV: tl.constexpr, MODE: tl.constexpr, H: tl.constexpr,
    SR: tl.constexpr, GIVEN_U: tl.constexpr, CODES: tl.constexpr, VALUES: tl.constexpr,
):  # fmt: skip
    """M whole rows (padded to PW): s = x + residual and rstd stored; n = (s * rstd) * w, stored with
    STORE_N; then either quantized along the row at once (QUANTIZE: MXFP4 needs nothing beyond the
    row), or its finite NVFP4 block amax folded into amax_ptr (AMAX) for a later quantize pass."""
    r0 = tl.program_id(0) * M
    rows = r0 + tl.arange(0, M)
    cols = tl.arange(0, PW)
    s = _load(x_ptr, rows, cols, R, D, False) + _load(res_ptr, rows, cols, R, D, False)
    if S_BF16:
        s = _round_bf16(s)
    _store(s_ptr, rows, cols, R, D, s.to(s_ptr.dtype.element_ty), False)
    mean = tl.math.div_rn(_sum_of_squares(x_ptr, res_ptr, rows, R, D, M, PW, LANES, S_BF16), D.to(tl.float32))
    rstd = tl.math.div_rn(1.0, tl.sqrt_rn(mean + _fp32(eps)))
    tl.store(rstd_ptr + rows, rstd, mask=rows < R)
    t = s * rstd[:, None]
    if S_BF16:
        t = _round_bf16(t)
    n = t * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if N_BF16:
        n = _round_bf16(n)
    if STORE_N:
        _store(n_ptr, rows, cols, R, D, n.to(n_ptr.dtype.element_ty), False)
    if QUANTIZE:
        _quantize_store(
            n, r0, 0, R, D, val_ptr, codes_ptr, scales_ptr, signs_ptr, seed_ptr, u_ptr, amax_ptr, outer_ptr,
            M, PW, NV, MODE, H, SR, GIVEN_U, CODES, VALUES, False,
        )  # fmt: skip
    if AMAX:
        tl.atomic_max(amax_ptr, _finite_amax(n, signs_ptr, M, PW, H, 1, 16).to(tl.int32, bitcast=True))


@triton.jit
def _swiglu_grads(grad_ptr, gate_ptr, up_ptr, rows, cols, R, C, EVEN: tl.constexpr, BF16: tl.constexpr, ACCURATE: tl.constexpr):
    """(d_gate, d_up) at [rows, cols] as float32, rounded as autograd rounds them (0 outside [R, C])."""
    grad = _load(grad_ptr, rows, cols, R, C, EVEN)
    g = _load(gate_ptr, rows, cols, R, C, EVEN)
    t = grad * _load(up_ptr, rows, cols, R, C, EVEN)  # MulBackward's gradient of silu(gate)
    s = _silu(g, ACCURATE)  # the silu(gate) autograd saved
    if BF16:
        t = _round_bf16(t)
        s = _round_bf16(s)
    d_gate = _silu_backward(t, g, ACCURATE)
    d_up = grad * s
    if BF16:
        d_gate = _round_bf16(d_gate)
        d_up = _round_bf16(d_up)
    return d_gate, d_up


@triton.jit
def _swiglu_backward_kernel(
    grad_ptr, gate_ptr, up_ptr, dg_ptr, du_ptr, R, C,
    gr_val, gr_codes, gr_scales, gr_u, gr_amax, gr_outer, ur_val, ur_codes, ur_scales, ur_u, ur_amax, ur_outer,
    gc_val, gc_codes, gc_scales, gc_u, gc_amax, gc_outer, uc_val, uc_codes, uc_scales, uc_u, uc_amax, uc_outer,
    r_signs, r_seed, c_signs, c_seed,
    BR: tl.constexpr, BC: tl.constexpr, EVEN: tl.constexpr, BF16: tl.constexpr, ACCURATE: tl.constexpr,
    ROW: tl.constexpr, R_NV: tl.constexpr, R_MODE: tl.constexpr, R_H: tl.constexpr,
    R_SR: tl.constexpr, R_GIVEN_U: tl.constexpr, R_CODES: tl.constexpr, R_VALUES: tl.constexpr,
    COL: tl.constexpr, C_NV: tl.constexpr, C_MODE: tl.constexpr, C_H: tl.constexpr,
    C_SR: tl.constexpr, C_GIVEN_U: tl.constexpr, C_CODES: tl.constexpr, C_VALUES: tl.constexpr,
):  # fmt: skip
    """d_gate and d_up from one read of grad_h, gate and up, stored, and with ROW / COL each quantized
    along the hidden dim / the tokens (one set of options per orientation, one output set per
    gradient; a Philox seed draws the same bits for both gradients, as two quantize_fused calls with
    that seed would)."""
    r0 = tl.program_id(0) * BR
    c0 = tl.program_id(1) * BC
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BC)
    d_gate, d_up = _swiglu_grads(grad_ptr, gate_ptr, up_ptr, rows, cols, R, C, EVEN, BF16, ACCURATE)
    _store(dg_ptr, rows, cols, R, C, d_gate.to(dg_ptr.dtype.element_ty), EVEN)  # exact: rounded already
    _store(du_ptr, rows, cols, R, C, d_up.to(du_ptr.dtype.element_ty), EVEN)
    if ROW:
        _quantize_store(
            d_gate, r0, c0, R, C, gr_val, gr_codes, gr_scales, r_signs, r_seed, gr_u, gr_amax, gr_outer,
            BR, BC, R_NV, R_MODE, R_H, R_SR, R_GIVEN_U, R_CODES, R_VALUES, EVEN,
        )  # fmt: skip
        _quantize_store(
            d_up, r0, c0, R, C, ur_val, ur_codes, ur_scales, r_signs, r_seed, ur_u, ur_amax, ur_outer,
            BR, BC, R_NV, R_MODE, R_H, R_SR, R_GIVEN_U, R_CODES, R_VALUES, EVEN,
        )  # fmt: skip
    if COL:
        _quantize_store(
            tl.trans(d_gate), c0, r0, C, R, gc_val, gc_codes, gc_scales, c_signs, c_seed, gc_u, gc_amax, gc_outer,
            BC, BR, C_NV, C_MODE, C_H, C_SR, C_GIVEN_U, C_CODES, C_VALUES, EVEN,
        )  # fmt: skip
        _quantize_store(
            tl.trans(d_up), c0, r0, C, R, uc_val, uc_codes, uc_scales, c_signs, c_seed, uc_u, uc_amax, uc_outer,
            BC, BR, C_NV, C_MODE, C_H, C_SR, C_GIVEN_U, C_CODES, C_VALUES, EVEN,
        )  # fmt: skip


@triton.jit
def _swiglu_backward_amax_kernel(
    grad_ptr, gate_ptr, up_ptr, R, C, amax_ptr, r_signs, c_signs,
    BR: tl.constexpr, BC: tl.constexpr, TILES: tl.constexpr, EVEN: tl.constexpr, BF16: tl.constexpr,
    ACCURATE: tl.constexpr, ROW: tl.constexpr, R_H: tl.constexpr, COL: tl.constexpr, C_H: tl.constexpr,
):  # fmt: skip
    """The NVFP4 tensor amaxes of d_gate and d_up, row-wise and/or transposed, from one read of the
    inputs: int32 slots [d_gate row, d_up row, d_gate col, d_up col]."""
    gate_row = tl.zeros([], tl.float32)
    up_row = tl.zeros([], tl.float32)
    gate_col = tl.zeros([], tl.float32)
    up_col = tl.zeros([], tl.float32)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    for i in tl.static_range(TILES):
        rows = (tl.program_id(0) * TILES + i) * BR + tl.arange(0, BR)
        d_gate, d_up = _swiglu_grads(grad_ptr, gate_ptr, up_ptr, rows, cols, R, C, EVEN, BF16, ACCURATE)
        if ROW:
            gate_row = tl.maximum(gate_row, _finite_amax(d_gate, r_signs, BR, BC, R_H, 1, 16))
            up_row = tl.maximum(up_row, _finite_amax(d_up, r_signs, BR, BC, R_H, 1, 16))
        if COL:
            gate_col = tl.maximum(gate_col, _finite_amax(tl.trans(d_gate), c_signs, BC, BR, C_H, 1, 16))
            up_col = tl.maximum(up_col, _finite_amax(tl.trans(d_up), c_signs, BC, BR, C_H, 1, 16))
    if ROW:
        tl.atomic_max(amax_ptr, gate_row.to(tl.int32, bitcast=True))
        tl.atomic_max(amax_ptr + 1, up_row.to(tl.int32, bitcast=True))
    if COL:
        tl.atomic_max(amax_ptr + 2, gate_col.to(tl.int32, bitcast=True))
        tl.atomic_max(amax_ptr + 3, up_col.to(tl.int32, bitcast=True))


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def swiglu_quantize_fused(
    gate: torch.Tensor, up: torch.Tensor, *, col: dict | None = None, emit_h: bool = False, **row
) -> FusedSwiglu:
    """h = silu(gate) * up quantized along its last dim (W2's Fprop x) with quantize_fused's options
    `row` (fmt, scale_mode, adaptive, rounding, signs, seed, uniforms, emit_codes, emit_values), and
    with `col` (a dict of the same options) h^T along the tokens (W2's Wgrad x), from one read of
    gate and up (two for NVFP4). emit_h=True also writes h in the inputs' dtype (not needed by the
    GEMMs: only for probes or a recipe that keeps h). gate, up: 2D, contiguous, both bf16 or fp32."""
    _check_inputs("swiglu_quantize_fused", gate=gate, up=up)
    if not isinstance(emit_h, bool):
        raise ValueError(f"swiglu_quantize_fused: emit_h must be a bool, got {emit_h!r}")
    row_spec, col_spec = _specs("swiglu_quantize_fused", gate, row, col)
    bf16 = gate.dtype == torch.bfloat16
    h = torch.empty_like(gate) if emit_h else None
    outs = _launch_producer(_SWIGLU.value, (gate, up, None, None), gate.shape, gate.device, bf16, bf16, h, row_spec, col_spec)
    return FusedSwiglu(h, outs[0], outs[1])


def residual_rmsnorm_quantize_fused(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    col: dict | None = None,
    emit_normed: bool = False,
    **row,
) -> FusedRmsnorm:
    """s = x + residual, rstd, n = rmsnorm(s) * weight quantized along the last dim with quantize_fused's
    options `row`, and with `col` n^T along the tokens. One pass for MXFP4 rows; NVFP4 or `col` add a
    quantize pass over s (and an amax pass for an NVFP4 n^T). emit_normed=True also writes n.
    x, residual: [tokens, dim] bf16 or fp32, contiguous; weight: [dim]; dim <= 16384."""
    _check_inputs("residual_rmsnorm_quantize_fused", x=x, residual=residual)
    if weight.shape != (x.shape[1],) or weight.dtype not in _DTYPES or weight.device != x.device or not weight.is_contiguous():
        raise ValueError(f"residual_rmsnorm_quantize_fused: weight must be a contiguous bf16/fp32 [{x.shape[1]}] tensor on x's device")
    if x.shape[1] > RMSNORM_MAX_WIDTH:
        raise ValueError(f"residual_rmsnorm_quantize_fused: dim {x.shape[1]} > {RMSNORM_MAX_WIDTH} (the row is held in registers)")
    if not isinstance(emit_normed, bool):
        raise ValueError(f"residual_rmsnorm_quantize_fused: emit_normed must be a bool, got {emit_normed!r}")
    row_spec, col_spec = _specs("residual_rmsnorm_quantize_fused", x, row, col)
    rows, dim = x.shape
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    n_dtype = torch.promote_types(s_dtype, weight.dtype)
    s = torch.empty((rows, dim), dtype=s_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    n = torch.empty((rows, dim), dtype=n_dtype, device=x.device) if emit_normed else None
    width = triton.next_power_of_2(dim)
    m = max(1, min(16, _NORM_ELEMENTS // width))
    one_pass = col_spec is None and not row_spec.nv  # MXFP4 rows: the whole row is all a scale needs
    row_out = _allocate(x.device, (rows, dim), row_spec)
    amax = _amax_slots(row_spec, col_spec, x.device)
    row_amax_done = row_spec.nv and col_spec is None  # folded by the row pass (n^T's needs 16-row blocks)
    if rows:
        _rmsnorm_rows_kernel[(triton.cdiv(rows, m),)](
            x, residual, weight, s, rstd, n, rows, dim, eps,
            row_out.values, row_out.codes, row_out.scales, row_spec.signs, row_spec.seed, row_spec.uniforms, amax, row_out.outer,
            M=m, PW=width, LANES=RMSNORM_SUM_LANES, S_BF16=s_dtype == torch.bfloat16, N_BF16=n_dtype == torch.bfloat16, STORE_N=emit_normed,
            QUANTIZE=one_pass, AMAX=row_amax_done, **_orientation_constexprs(row_spec),
            num_warps=4 if width * m <= 4096 else 8, enable_fp_fusion=False,
        )  # fmt: skip
    if one_pass:
        return FusedRmsnorm(s, rstd, n, row_out, None)
    n_bf16 = n_dtype == torch.bfloat16
    outs = _launch_producer(
        _NORM_APPLY.value, (s, None, rstd, weight), (rows, dim), x.device, s_dtype == torch.bfloat16, n_bf16,
        None, row_spec, col_spec, row_out=row_out, amax=amax, row_amax_done=row_amax_done,
    )  # fmt: skip
    return FusedRmsnorm(s, rstd, n, outs[0], outs[1])


def swiglu_backward_fused(
    grad_h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, *, row: dict | None = None, col: dict | None = None
) -> FusedSwigluGrads:
    """d_gate, d_up of h = silu(gate) * up (swiglu_backward_reference) from one read of grad_h, gate
    and up. With `row` / `col` (quantize_fused options, fmt included, one set for both gradients) each
    gradient is also quantized along the hidden dim / the tokens in the same pass; NVFP4 first reads
    the inputs once more for the four tensor amaxes. SR's seed or uniforms serve both gradients: the
    same draws for d_gate and d_up, each unbiased on its own, as two quantize_fused calls with one seed."""
    _check_inputs("swiglu_backward_fused", grad_h=grad_h, gate=gate, up=up)
    name = "swiglu_backward_fused"
    row_spec = _orientation(gate, {"rounding": "rtn", **_known(name, "row", row)}, False) if row is not None else None
    col_spec = _orientation(gate, {"rounding": "rtn", **_known(name, "col", col)}, True) if col is not None else None
    return _swiglu_backward(grad_h, gate, up, row_spec, col_spec)


def _swiglu_backward(grad_h, gate, up, row: _Orientation | None, col: _Orientation | None) -> FusedSwigluGrads:
    rows, cols = gate.shape
    device, bf16, accurate = gate.device, gate.dtype == torch.bfloat16, not _INTERPRETED
    d_gate, d_up = torch.empty_like(gate), torch.empty_like(gate)
    outs = {}
    for suffix, spec, shape in (("row", row, (rows, cols)), ("col", col, (cols, rows))):
        for which in ("gate", "up"):
            outs[f"{which}_{suffix}"] = _allocate(device, shape, spec) if spec is not None else None
    nv_row, nv_col = row is not None and row.nv, col is not None and col.nv
    amax = torch.zeros(4, dtype=torch.int32, device=device) if nv_row or nv_col else None
    if rows and amax is not None:
        br, bc, warps = _TILE_AMAX if not nv_col else _TILE_COL
        _swiglu_backward_amax_kernel[(triton.cdiv(rows, br * _AMAX_TILES), triton.cdiv(cols, bc))](
            grad_h, gate, up, rows, cols, amax, row.signs if nv_row else None, col.signs if nv_col else None,
            BR=br, BC=bc, TILES=_AMAX_TILES, EVEN=rows % (br * _AMAX_TILES) == 0 and cols % bc == 0, BF16=bf16,
            ACCURATE=accurate, ROW=nv_row, R_H=row.transform if nv_row else 0, COL=nv_col, C_H=col.transform if nv_col else 0,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    args = []
    for slot, key in enumerate(("gate_row", "up_row", "gate_col", "up_col")):
        spec, out = (row, outs[key]) if key.endswith("row") else (col, outs[key])
        if spec is None:
            args += [None] * 6
            continue
        args += [out.values, out.codes, out.scales, spec.uniforms, amax[slot:] if spec.nv else None, out.outer]
        if spec.nv and not rows:  # nothing was quantized: the reference's outer scale of an empty tensor
            out.outer.fill_(1.0)
    args += [row.signs if row else None, row.seed if row else None, col.signs if col else None, col.seed if col else None]
    br, bc, warps = _TILE_COL if col is not None else _TILE_ROW
    if rows:
        _swiglu_backward_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bc))](
            grad_h, gate, up, d_gate, d_up, rows, cols, *args,
            BR=br, BC=bc, EVEN=rows % br == 0 and cols % bc == 0, BF16=bf16, ACCURATE=accurate,
            **_constexprs("R_", row), **_constexprs("C_", col), ROW=row is not None, COL=col is not None,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    return FusedSwigluGrads(d_gate, d_up, **outs)


def _launch_producer(producer, inputs, shape, device, in_bf16, out_bf16, store, row, col, row_out=None, amax=None, row_amax_done=False):
    """The NVFP4 amax pass where needed, then the quantize pass, over the produced [R, C] tensor.
    `amax`: the int32 [row, col] amax slots when the caller made them, its row slot already folded
    with row_amax_done (RMSNorm's row pass)."""
    rows, cols = shape
    accurate = not _INTERPRETED
    outs = [row_out if row_out is not None else (_allocate(device, (rows, cols), row) if row else None)]
    outs.append(_allocate(device, (cols, rows), col) if col else None)
    need_row = row is not None and row.nv and not row_amax_done
    need_col = col is not None and col.nv
    if amax is None:
        amax = _amax_slots(row, col, device)
    if rows and (need_row or need_col):
        br, bc, warps = _TILE_AMAX if not need_col else _TILE_COL
        _producer_amax_kernel[(triton.cdiv(rows, br * _AMAX_TILES), triton.cdiv(cols, bc))](
            *inputs, rows, cols, amax[0:], row.signs if need_row else None, amax[1:], col.signs if need_col else None,
            P=producer, IN_BF16=in_bf16, OUT_BF16=out_bf16, ACCURATE=accurate,
            BR=br, BC=bc, TILES=_AMAX_TILES, EVEN=rows % (br * _AMAX_TILES) == 0 and cols % bc == 0,
            ROW=need_row, R_H=row.transform if need_row else 0, COL=need_col, C_H=col.transform if need_col else 0,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    args = []
    for spec, out, slot in ((row, outs[0], 0), (col, outs[1], 1)):
        if spec is None:
            args += [None] * 8
            continue
        args += [out.values, out.codes, out.scales, spec.signs, spec.seed, spec.uniforms, amax[slot:] if spec.nv else None, out.outer]
        if spec.nv and not rows:  # nothing was quantized: the reference's outer scale of an empty tensor
            out.outer.fill_(1.0)
    br, bc, warps = _TILE_COL if col is not None else _TILE_ROW
    if rows:
        _producer_quantize_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bc))](
            *inputs, store, rows, cols, *args,
            P=producer, IN_BF16=in_bf16, OUT_BF16=out_bf16, ACCURATE=accurate, STORE=store is not None,
            BR=br, BC=bc, EVEN=rows % br == 0 and cols % bc == 0,
            **_constexprs("R_", row), **_constexprs("C_", col), ROW=row is not None, COL=col is not None,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    return outs


def _amax_slots(row: _Orientation | None, col: _Orientation | None, device) -> torch.Tensor | None:
    """int32 bits of the NVFP4 tensor amax of each orientation, [row, col], zeroed; None for MXFP4."""
    if (row is not None and row.nv) or (col is not None and col.nv):
        return torch.zeros(2, dtype=torch.int32, device=device)
    return None


def _orientation_constexprs(spec: _Orientation) -> dict:
    return {k[2:]: v for k, v in _constexprs("R_", spec).items()}


def _known(name: str, which: str, options: dict) -> dict:
    if not isinstance(options, dict):
        raise ValueError(f"{name}: {which} must be a dict of quantize_fused options")
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise ValueError(f"{name}: {which} option {unknown[0]!r} is not supported; allowed: {', '.join(_OPTION_NAMES)}")
    if options.get("fmt") == "nvfp4_cta":  # the producers take one tensor amax per orientation
        raise ValueError(f"{name}: {which} fmt 'nvfp4_cta' is not supported by the fused producers; quantize with quantize_fused")
    if options.get("stats") is not None:  # probe steps quantize with quantize_fused, which counts
        raise ValueError(f"{name}: {which} option 'stats' is not supported by the fused producers; quantize with quantize_fused")
    return options


def _specs(name: str, x: torch.Tensor, row: dict, col: dict | None) -> tuple[_Orientation, _Orientation | None]:
    row_spec = _orientation(x, {"rounding": "rtn", **_known(name, "row", row)}, transpose=False)
    col_spec = _orientation(x, {"rounding": "rtn", **_known(name, "col", col)}, transpose=True) if col is not None else None
    return row_spec, col_spec


def _check_inputs(name: str, **tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values()))
    for arg, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if not (t.is_cuda or _INTERPRETED and t.device.type == "cpu"):
            raise ValueError(f"{name}: {arg} is on {t.device}; the fused kernels need CUDA tensors")
        if t.dim() != 2 or t.shape != first.shape or t.device != first.device:
            raise ValueError(f"{name}: {', '.join(tensors)} must be 2D tensors of one shape on one device, got {arg} {list(t.shape)}")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name}: {arg} has dtype {t.dtype}; allowed: torch.bfloat16, torch.float32")
        if not t.is_contiguous():
            raise ValueError(f"{name}: {arg} must be contiguous (call .contiguous() first)")
    if name.startswith("swiglu") and len({t.dtype for t in tensors.values()}) != 1:
        raise ValueError(f"{name}: {', '.join(tensors)} must share one dtype")
