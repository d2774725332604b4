"""Fused Triton quantizers: MXFP4 / NVFP4 fake quantization of a 2D CUDA tensor in one pass, and
the fused decode of packed codes back to the GEMM's bf16 values.

Each kernel reproduces the torch reference bit for bit:

    quantize_fused(x, fmt=f, signs=s, transpose=t, ...).values
        == fake_quantize_factored(hadamard(y, len(s), s), f, ...).values.bfloat16()
    with y = x.float() (or x.float().T for transpose=True)
    quantize_fused(w, fmt=f, tile=(th, tw), ...).values
        == fake_quantize_factored(w.float(), f, tile=(th, tw), ...).values.bfloat16()

and `.outer`, `.codes`, `.scales` equal the reference's outer scale, `quantize(...).data` and
`.scales` (with emit_values=False only the last three are written: codes only). The decode closes
the loop:

    decode_fused(q.codes, q.scales, fmt=f, shape=s, tile=t)
        == QTensor(q.codes, q.scales, q.outer, f, s, block, tile=t).factored().values.bfloat16()
        == q.values    for q = quantize_fused(..., emit_codes=True)

The order of every float32 operation follows `quantize._encode`, `scales.mx_exponent`,
`e2m1.round_to_nearest` / `round_stochastic` and `hadamard.hadamard` (docs/NUMERICS.md). Three rules
keep the kernels exact where Triton's defaults would not be:

- every scale is built from integer exponent bits: Triton flushes the subnormal results of
  `exp2`, and E8M0 scales reach 2^-127;
- divisions use `tl.math.div_rn` (plain `/` is the approximate `div.full.f32`);
- kernels are compiled with `enable_fp_fusion=False`, so no multiply-add is contracted into an FMA
  with a different rounding.

nvfp4_cta (CTA-local outer scales, one per 128 rows by default) is covered with 1D blocks, whose amax
pass folds each row's amax into its CTA tile's slot, and with 2D tiles, whose amax pass folds each
tile's amax into the slot of its 128 x 128 square (`outer` then holds one scale per square).

Not supported (ValueError naming the argument; callers fall back to the reference): tensor_amax with a format other than nvfp4, transforms other than 16 and 32, 2D tiles with a
transform or transpose=True, a blocked dim that is not a multiple of the block and transform, tile
dims that are not powers of two, dtypes other than bf16/fp32, non-CUDA or non-contiguous tensors. This module imports Triton: import it lazily, after
`fp4lab.numerics.kernels.runs_on(device)`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4lab.numerics.quantize import BLOCK_SIZE, DEFAULT_CTA_TILE

FORMATS = ("mxfp4", "nvfp4", "nvfp4_cta")
_MX_MODES = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3}
_MX_ADAPTIVE = 4  # rceil with the adaptive finer scale (scales.mx_exponent)
_TRANSFORM_SIZES = (16, 32)
_OPTION_NAMES = ("fmt", "scale_mode", "adaptive", "cta_tile", "rounding", "signs", "seed", "uniforms", "tensor_amax", "emit_codes", "emit_values", "stats")

# Tile shapes (rows, cols of x, warps), chosen by a sweep on an H200 (8192 x 8192 bf16; fraction of
# copy bandwidth): row-wise mxfp4 0.935 with (32, 128, 4), no better with 16-64 rows, 128-256 cols,
# 4-8 warps; x^T 0.934 and both orientations 0.844 with (32, 64, 2), against 0.35-0.62 and 0.50-0.78
# with 64-128 rows or 4-8 warps (the in-register transpose goes through shared memory).
_TILE_ROW = (32, 128, 4)  # quantized along the last dim
_TILE_COL = (32, 64, 2)  # quantized along the rows (output x^T), and both orientations
_TILE_AMAX = (64, 128, 8)  # the NVFP4 amax pass: 0.95 of copy (read only)
_AMAX_TILES = 4  # tiles per program of the amax pass: one atomic per program
# 2D weight tiles: regions of whole tiles (a larger tile is its own region, with more warps); 0.96-0.98
# of copy on an H200 for 16x16 nvfp4 and 32x32 mxfp4 from fp32 (8192 x 8192, amax pass included).
_REGION_2D = (32, 128, 4)
# decode_fused: [rows, cols] of output per program (more for larger 2D tiles), warps. A copy-like shape,
# 16-byte bf16 stores per thread; not yet swept on a GPU.
_TILE_DECODE = (32, 256, 4)
# Triton's CPU interpreter (TRITON_INTERPRET=1) runs these kernels on CPU tensors: the tests use it.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

FLT_MAX = tl.constexpr(3.4028234663852886e38)
SIGN_BIT = tl.constexpr(-0x80000000)  # 0x80000000 as an int32
INV_SQRT32 = tl.constexpr(1.0 / math.sqrt(32))  # hadamard's scale, rounded to float32 where used
PHILOX_ROUNDS = tl.constexpr(10)  # Triton's and cuRAND's default
ADAPTIVE_RATIO = tl.constexpr(0.87)  # scales.ADAPTIVE_RATIO


@dataclass(frozen=True)
class FusedQuant:
    """One quantized operand in the output layout ([R, C], or [C, R] for transpose=True).

    values: bf16 E2M1 values times their block scale (the reference's `values`, exact in bf16);
            None with emit_values=False (codes only: `decode_fused` recovers them bit for bit).
    outer:  nvfp4: the decode scale 1 / S_enc as a 0-dim fp32 tensor; nvfp4_cta: one per output row
            ([rows, 1], that of the row's CTA tile, as the reference's factored outer), or with 2D
            tiles one per CTA square ([ceil(R / T), ceil(C / T)], the reference's tensor_scale);
            mxfp4: None.
    codes:  with emit_codes: packed E2M1 codes (uint8, element 2i in the low nibble), else None.
    scales: with emit_codes: the E8M0 / E4M3 scale bytes, one per block, else None.
    """

    values: torch.Tensor | None
    outer: torch.Tensor | None
    codes: torch.Tensor | None = None
    scales: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        """The decoded operand in fp32, values x outer: bit for bit the reference's
        `quantize(...).dequantize()` (values are exact in bf16, and the product is the reference's one
        rounding of value x outer scale). 1D blocks only: a 2D-tile nvfp4_cta `outer` is per square."""
        if self.values is None:
            raise ValueError("FusedQuant.dequantize: no values (quantized with emit_values=False; decode_fused the codes)")
        values = self.values.float()
        return values if self.outer is None else values.mul_(self.outer)


# ----------------------------------------------------------------------------------------------
# Kernel building blocks. A tile t is [M, N] float32 and is quantized along N (its last axis); the
# column-wise orientation passes tl.trans of the loaded tile.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _butterfly(t, M: tl.constexpr, N: tl.constexpr, h: tl.constexpr):
    """One Walsh-Hadamard stage along N: each pair (a, b) at distance h inside a group of 2h becomes
    (a + b, a - b)."""
    a, b = tl.split(tl.permute(tl.reshape(t, [M, N // (2 * h), 2, h]), [0, 1, 3, 2]))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [M, N])


@triton.jit
def _hadamard(t, signs_ptr, M: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """hadamard.hadamard along N in blocks of H (16 or 32): signs, the stages in order, one scale."""
    t = t * tl.load(signs_ptr + tl.arange(0, N) % H)[None, :]
    t = _butterfly(t, M, N, 1)
    t = _butterfly(t, M, N, 2)
    t = _butterfly(t, M, N, 4)
    t = _butterfly(t, M, N, 8)
    if H == 32:
        t = _butterfly(t, M, N, 16)
    return t * (0.25 if H == 16 else INV_SQRT32)


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _block_amax(t, M: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    """Per-block max |x| as [M, N // BLOCK], NaN or Inf for a block holding NaN or Inf (it poisons
    only itself), so `bmax <= FLT_MAX` says the block is finite."""
    return tl.reduce(tl.abs(tl.reshape(t, [M, N // BLOCK, BLOCK])), 2, _max_nan)


@triton.jit
def _fp32(x):
    """A float argument in fp32: Triton's launcher passes a Python float as fp32, torch.compile's as fp64
    (which would widen the running sums and fail the loop's type check)."""
    return tl.cast(x, tl.float32)


@triton.jit
def _mx_scale(bmax, MODE: tl.constexpr):
    """scales.mx_exponent from the bits of a finite block amax: (E8M0 byte, encode multiplier)."""
    if MODE >= 3:  # rceil: ceil(log2(amax / 6)), the quotient rounded once in float32
        qbits = tl.math.div_rn(bmax, 6.0).to(tl.int32, bitcast=True)
        biased = qbits >> 23
        mantissa = qbits & 0x7FFFFF
        # A subnormal quotient m * 2^-149 has ceil(log2) -126 when m > 2^22, else -127 or less.
        subnormal = tl.where(mantissa > 0x400000, -126, -127)
        exponent = tl.where(biased > 0, biased - 127 + (mantissa != 0).to(tl.int32), subnormal)
        exponent = tl.minimum(exponent, 127)
        if MODE == 4:  # adaptive: halve the scale when amax / (6 * 2^e) < 0.87, unless e is -126 or less
            # 6 * 2^126 overflows to Inf (ratio 0: finer) in the reference too
            grant = 6.0 * ((tl.maximum(exponent, -126) + 127) << 23).to(tl.float32, bitcast=True)
            finer = (tl.math.div_rn(bmax, grant) < ADAPTIVE_RATIO) & (exponent > -126)
            exponent = tl.where(finer, exponent - 1, exponent)
        # Byte 0 encodes with multiplier 1 (TE and torchao flush such blocks to zero); 2^-e is normal.
        multiplier = tl.where(exponent == -127, 1.0, ((127 - exponent) << 23).to(tl.float32, bitcast=True))
    else:
        bits = bmax.to(tl.int32, bitcast=True)
        if MODE == 2:  # even: half an E2M1 mantissa step carries into the exponent iff >= 1.75
            bits = (bits + (1 << 21)) & ~0x7FFFFF
        exponent = ((bits >> 23) & 0xFF) - 127
        if MODE == 1:  # ceil
            exponent += ((bits & 0x7FFFFF) > 0).to(tl.int32)
        exponent = tl.minimum(tl.maximum(exponent - 2, -127), 128)
        # torchao's encode scale floor of 2^-126: byte 0 encodes at 2^126 and decodes at 2^-127.
        multiplier = ((127 - tl.maximum(exponent, -126)) << 23).to(tl.float32, bitcast=True)
    return exponent + 127, multiplier


@triton.jit
def _e8m0_decode(byte):
    """2^(byte - 127) from bits; byte 0 is the subnormal 2^-127 (0x00400000), 0xFF is NaN."""
    bits = tl.where(byte == 0, 0x400000, byte << 23)
    return tl.where(byte == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_encode(s):
    """float32 in [0, 448] to E4M3 bits, round to nearest even, with integer arithmetic (the
    interpreter's float8 cast does not round to nearest even)."""
    bits = s.to(tl.int32, bitcast=True)
    # Normal E4M3 (s >= 2^-6): keep 3 mantissa bits, ties to even; a carry moves into the exponent.
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal E4M3: multiples of 2^-9. Adding 2^23 rounds s * 2^9 (< 8, exact) to an integer, ties
    # to even; 8 is byte 0x08, the smallest normal, as it should be.
    subnormal = (s * 512.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    return tl.where(s >= 0.015625, normal, subnormal)


@triton.jit
def _e4m3_decode(byte):
    normal = ((byte << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    return tl.where(byte >= 8, normal, byte.to(tl.float32) * 0.001953125)


@triton.jit
def _e4m3_decode_byte(byte):
    """Any E4M3 byte to float32, as float8_e4m3fn decodes it: sign bit, subnormals, NaN 0x7F / 0xFF."""
    magnitude = byte & 0x7F
    value = tl.where(magnitude == 0x7F, float("nan"), _e4m3_decode(magnitude))
    # The sign as a bit: Triton negates as 0 - x, which turns byte 0x80 (-0.0) into +0.0.
    return (value.to(tl.int32, bitcast=True) | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_decode(code):
    """E2M1 codes (int32, 0..15) to float32 from bits. For magnitude codes 2..7 (exponent field >= 1)
    the 3 code bits e e m, plus 252, are a float's exponent (e - 1 + 127) and top mantissa bit: code
    + 252 shifted by 22; code 1 is 0.5 and code 0 is 0. Bit 3 is the sign (code 8 is -0.0)."""
    magnitude = code & 7
    bits = tl.where(magnitude >= 2, (magnitude + 252) << 22, tl.where(magnitude == 1, 126 << 23, 0))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _nvfp4_scales(amax):
    """scales.nvfp4_encode_scale of an amax (float >= 0; a scalar or one per row): (S_enc, 1 / S_enc)."""
    s_enc = tl.minimum(tl.math.div_rn(2688.0, amax), FLT_MAX)
    s_enc = tl.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
    return s_enc, tl.math.div_rn(1.0, s_enc)


@triton.jit
def _uniforms(seed_ptr, rows, col0, n_cols, M: tl.constexpr, N: tl.constexpr):
    """[M, N] float32 uniforms in [0, 1) on a 2^-16 grid. One Philox call (tl.randint4x) yields four
    32-bit words, i.e. eight 16-bit uniforms for eight neighbouring output elements (the low half of
    word k serves element 2k, the high half element 2k + 1); the call's offset is the linear output
    index of the first of them divided by 8. Philox costs about 20 instructions per call and element
    of four: eight elements per call halve that. 16 bits bound the bias of SR to 2^-16 of a grid step
    (TE's hardware-less path uses 8 bits). The seed is read on the device."""
    seed = tl.load(seed_ptr)
    groups = rows.to(tl.int64)[:, None] * (n_cols // 8) + (col0 // 8 + tl.arange(0, N // 8))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, groups, PHILOX_ROUNDS)
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))  # [M, N // 8, 2, 2]: r0 r1 r2 r3 in order
    halves = tl.reshape(tl.join(words << 16, words), [M, N])  # each word's low half first
    # 1.m with the 16 random bits on top of the mantissa, minus 1: exact.
    return (((halves >> 9) & 0x7FFF80) | 0x3F800000).to(tl.float32, bitcast=True) - 1.0


@triton.jit
def _sr_uniforms(u_ptr, seed_ptr, rows, cols, col0, n_rows, n_cols, M: tl.constexpr, N: tl.constexpr,
                 GIVEN_U: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """The [M, N] uniforms of SR for output elements [rows, cols]: given at u_ptr, else Philox's."""
    # if/else, not an early return: Triton compiles the statements after a taken constexpr `if` that
    # returns, and _uniforms would load from seed_ptr None
    if GIVEN_U:
        u = _load(u_ptr, rows, cols, n_rows, n_cols, EVEN)
    else:
        u = _uniforms(seed_ptr, rows, col0, n_cols, M, N)
    return u


@triton.jit
def _round_stochastic(q, a, magic_bits, u):
    """e2m1.round_stochastic of the saturated magnitudes a, from their nearest grid values q and
    magic_bits (`_grid_round`) and one uniform per element (u, in a's shape): its `u < steps - low`,
    scaled by the step (a power of two), so exact."""
    step = (magic_bits - (23 << 23)).to(tl.float32, bitcast=True)
    low = tl.where(q > a, q - step, q)
    return tl.where(u * step < a - low, low + step, low)


@triton.jit
def _nvfp4_block_scale(bmax, s_enc, outer):
    """NVFP4's (scale byte, decode scale, encode multiplier) of a block (or tile) amax under outer
    scales S_enc and 1 / S_enc; a poisoned block gets the NaN byte and a NaN decode scale."""
    finite = bmax <= FLT_MAX
    # One float32 rounding of amax * (S_enc * (1/6)), as TE and quantize._encode compute it.
    byte = _e4m3_encode(tl.minimum(bmax * (s_enc * (1.0 / 6.0)), 448.0))
    byte = tl.where(finite, byte, 0x7F)
    decode = tl.where(finite, _e4m3_decode(byte), float("nan"))
    return byte, decode, tl.minimum(tl.math.div_rn(1.0, decode * outer), FLT_MAX)


@triton.jit
def _square_slots(r0, c0, R, C, BR: tl.constexpr, BC: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, SQUARE: tl.constexpr):
    """For the TH x TW tiles of the region at (r0, c0): the offset of each tile's SQUARE x SQUARE slot
    in a row-major [ceil(R / SQUARE), ceil(C / SQUARE)] grid, and whether the tile lies inside x."""
    tile_rows = (r0 // TH + tl.arange(0, BR // TH)) * TH
    tile_cols = (c0 // TW + tl.arange(0, BC // TW)) * TW
    slots = (tile_rows // SQUARE)[:, None] * tl.cdiv(C, SQUARE) + (tile_cols // SQUARE)[None, :]
    return slots, (tile_rows < R)[:, None] & (tile_cols < C)[None, :]


@triton.jit
def _block_scale(bmax, amax_ptr, outer_ptr, rows, n_rows, first_row, first_col, NV: tl.constexpr, MODE: tl.constexpr):
    """From a block's (or 2D tile's) amax: (scale byte, decode scale, encode multiplier); a poisoned
    block gets the NaN byte and a NaN decode scale. NVFP4 (NV = 1) reads the tensor amax (int32 bits)
    for its outer scale, which the first program stores; CTA-local NVFP4 (NV = the CTA tile, > 1) reads
    one amax per NV rows, and the first column of programs stores the outer scale of each of its rows
    (bmax is then [rows, blocks]). Also the outer decode scale (a scalar, or [rows, 1]; 1.0 for
    MXFP4), which probes multiply in as `QTensor.dequantize` does."""
    if NV:
        if NV == 1:
            s_enc, outer = _nvfp4_scales(tl.load(amax_ptr).to(tl.float32, bitcast=True))
            if first_row & first_col:
                tl.store(outer_ptr, outer)
        else:
            inside = rows < n_rows
            s_enc, outer = _nvfp4_scales(tl.load(amax_ptr + rows // NV, mask=inside, other=0).to(tl.float32, bitcast=True))
            if first_col:
                tl.store(outer_ptr + rows, outer, mask=inside)
            s_enc, outer = s_enc[:, None], outer[:, None]
        byte, decode, multiplier = _nvfp4_block_scale(bmax, s_enc, outer)
    else:
        byte, decode, multiplier = _mx_block_scale(bmax, MODE)
        outer = 1.0
    return byte, decode, multiplier, outer


@triton.jit
def _mx_block_scale(bmax, MODE: tl.constexpr):
    """MXFP4's (E8M0 byte, decode scale, encode multiplier) of a block amax; a poisoned block gets the
    NaN byte 0xFF."""
    byte, multiplier = _mx_scale(bmax, MODE)
    byte = tl.where(bmax <= FLT_MAX, byte, 0xFF)
    return byte, _e8m0_decode(byte), multiplier


@triton.jit
def _grid_round(a):
    """E2M1 round to nearest, ties to even, of a >= 0 (unsaturated): (q, magic, magic_bits).

    E2M1 has 1 mantissa bit: its grid step in the binade [2^e, 2^(e+1)) is 2^(e-1), and 0.5 below 1
    (e2m1._grid_exponent). Adding magic = 2^22 * max(2^e, 1), whose ulp is that step, rounds a onto the
    grid, ties to even; subtracting it again is exact. Cheaper than selecting the step per element."""
    magic_bits = tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, 0x3F800000) + (22 << 23)
    magic = magic_bits.to(tl.float32, bitcast=True)
    return (a + magic) - magic, magic, magic_bits


@triton.jit
def _codes(q, magic, magic_bits, sign, finite):
    """E2M1 codes of the rounded magnitudes q (int32, one per element); a poisoned block's are 0."""
    # q in grid steps (exact: q < 2 * magic), plus 2 codes per binade above [1, 2), saturating at 7
    steps = (q + magic).to(tl.int32, bitcast=True) - magic_bits
    codes = tl.minimum(steps + 2 * ((magic_bits >> 23) - 149), 7) | ((sign >> 28) & 8)
    return tl.where(finite, codes, 0)


@triton.jit
def _pack(codes, M: tl.constexpr, N: tl.constexpr):
    """[M, N] codes to [M, N // 2] bytes, element 2i in the low nibble."""
    lo, hi = tl.split(tl.reshape(codes, [M, N // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def _count_clip_flush(x, q, sign, decode, outer, finite, stats_ptr):
    """Add this tile's [saturated, flushed] element counts to the int64 pair at stats_ptr, as
    `survey.clip_flush_counts` counts them: x the (transformed) input, q the rounded magnitudes, and
    decode, outer and finite broadcast to x's shape. Padding loads as 0 and counts as neither."""
    decoded = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * decode * outer
    clipped = finite & (q == 6.0) & (tl.abs(decoded) < tl.abs(x)) & (decoded != 0)
    flushed = (decoded == 0) & (x != 0)
    tl.atomic_add(stats_ptr, tl.sum(tl.ravel(clipped.to(tl.int64))))
    tl.atomic_add(stats_ptr + 1, tl.sum(tl.ravel(flushed.to(tl.int64))))


@triton.jit
def _quantize_store(
    t, row0, col0, n_rows, n_cols,
    val_ptr, codes_ptr, scales_ptr, signs_ptr, seed_ptr, u_ptr, amax_ptr, outer_ptr,
    M: tl.constexpr, N: tl.constexpr, NV: tl.constexpr, MODE: tl.constexpr, H: tl.constexpr,
    SR: tl.constexpr, GIVEN_U: tl.constexpr, CODES: tl.constexpr, VALUES: tl.constexpr, EVEN: tl.constexpr,
    stats_ptr=None, STATS: tl.constexpr = False,
):  # fmt: skip
    """Quantize tile t (rows row0.., blocked cols col0..) of an [n_rows, n_cols] output and store it;
    with STATS, count its saturated and flushed elements into stats_ptr."""
    BLOCK: tl.constexpr = 16 if NV else 32
    NB: tl.constexpr = N // BLOCK
    rows = row0 + tl.arange(0, M)
    cols = col0 + tl.arange(0, N)
    if H > 0:
        t = _hadamard(t, signs_ptr, M, N, H)
    bmax = _block_amax(t, M, N, BLOCK)
    byte, decode, multiplier, outer = _block_scale(bmax, amax_ptr, outer_ptr, rows, n_rows, row0 == 0, col0 == 0, NV, MODE)

    if SR:
        u = _sr_uniforms(u_ptr, seed_ptr, rows, cols, col0, n_rows, n_cols, M, N, GIVEN_U, EVEN)
    else:
        u = t  # unread
    q, magic, magic_bits, sign = _encode_blocks(t, multiplier, u, M, N, BLOCK, NV, SR)
    if VALUES:
        _store(val_ptr, rows, cols, n_rows, n_cols, _block_values(q, sign, decode, M, N), EVEN)

    if CODES:
        codes = _codes(q, magic, magic_bits, sign, (bmax <= FLT_MAX)[:, :, None])
        packed = _pack(tl.reshape(codes, [M, N]), M, N)
        _store(codes_ptr, rows, col0 // 2 + tl.arange(0, N // 2), n_rows, n_cols // 2, packed, EVEN)
        _store(scales_ptr, rows, col0 // BLOCK + tl.arange(0, NB), n_rows, n_cols // BLOCK, byte.to(tl.uint8), EVEN)
    if STATS:
        per_row = outer[:, :, None] if NV > 1 else outer  # [M, 1] per row for CTA-local scales
        _count_clip_flush(tl.reshape(t, [M, NB, BLOCK]), q, sign, decode[:, :, None], per_row,
                          (bmax <= FLT_MAX)[:, :, None], stats_ptr)


@triton.jit
def _encode_blocks(t, multiplier, u, M: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, NV: tl.constexpr, SR: tl.constexpr):
    """The E2M1 rounding of tile t [M, N] in blocks along N under their encode multipliers [M, N // BLOCK]
    (u: SR's uniforms in t's shape, unread for RTN): (q, magic, magic_bits, sign), q the rounded
    magnitudes and sign the sign bits, [M, N // BLOCK, BLOCK]."""
    NB: tl.constexpr = N // BLOCK
    v = tl.reshape(t, [M, NB, BLOCK]) * multiplier[:, :, None]
    a = tl.abs(v)
    if NV or SR:  # nvfp4 clamps to +-6 before rounding; SR saturates first (e2m1.round_stochastic)
        a = tl.minimum(a, 6.0)
    q, magic, magic_bits = _grid_round(a)
    if SR:
        q = _round_stochastic(q, a, magic_bits, tl.reshape(u, [M, NB, BLOCK]))
    else:
        q = tl.minimum(q, 6.0)  # a is unclamped for mxfp4 RTN (up to 8 with floor scales)
    return q, magic, magic_bits, v.to(tl.int32, bitcast=True) & SIGN_BIT


@triton.jit
def _block_values(q, sign, decode, M: tl.constexpr, N: tl.constexpr):
    """[M, N] bf16 block values, E2M1 x block scale (exact in bf16), of `_encode_blocks`' q and sign
    under the blocks' decode scales [M, N // BLOCK]. A poisoned block decodes to NaN through its NaN
    `decode`, whatever q is."""
    values = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * decode[:, :, None]
    return tl.reshape(values, [M, N]).to(tl.bfloat16)


@triton.jit
def _tile_block_values(t, amax_bits, seed_ptr, rows, col0, n_cols, M: tl.constexpr, N: tl.constexpr,
                       NV: tl.constexpr, SR: tl.constexpr):  # fmt: skip
    """Tile t [M, N] quantized along N as `quantize_fused` quantizes it (NVFP4 under the tensor scale
    of the amax whose int32 bits are `amax_bits`, or MXFP4 with floor scales; SR from Philox at the
    output elements [rows, col0..] of an n_cols-wide output), as its bf16 block values: for a kernel
    that feeds them to a GEMM, the outer scale (`_nvfp4_scales(amax)[1]`) applied to the GEMM's result."""
    BLOCK: tl.constexpr = 16 if NV else 32
    bmax = _block_amax(t, M, N, BLOCK)
    if NV:
        s_enc, outer = _nvfp4_scales(amax_bits.to(tl.float32, bitcast=True))
        _, decode, multiplier = _nvfp4_block_scale(bmax, s_enc, outer)
    else:
        _, decode, multiplier = _mx_block_scale(bmax, 0)
    if SR:
        u = _uniforms(seed_ptr, rows, col0, n_cols, M, N)
    else:
        u = t  # unread
    q, _, _, sign = _encode_blocks(t, multiplier, u, M, N, BLOCK, NV, SR)
    return _block_values(q, sign, decode, M, N)


@triton.jit
def _gather(ptr, rows, cols, n_rows, n_cols, EVEN: tl.constexpr):
    """Elements [rows, cols] of a row-major [n_rows, n_cols] array in its dtype (0 outside it)."""
    ptrs = ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :], other=0)


@triton.jit
def _load(ptr, rows, cols, n_rows, n_cols, EVEN: tl.constexpr):
    """Elements [rows, cols] of a row-major [n_rows, n_cols] array as float32 (0 outside it)."""
    return _gather(ptr, rows, cols, n_rows, n_cols, EVEN).to(tl.float32)


@triton.jit
def _store(ptr, rows, cols, n_rows, n_cols, value, EVEN: tl.constexpr):
    """Store value into elements [rows, cols] of a row-major [n_rows, n_cols] array."""
    ptrs = ptr + rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
    if EVEN:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=(rows < n_rows)[:, None] & (cols < n_cols)[None, :])


@triton.jit
def _load_tile(x_ptr, R, C, r0, c0, BR: tl.constexpr, BC: tl.constexpr, EVEN: tl.constexpr):
    return _load(x_ptr, r0 + tl.arange(0, BR), c0 + tl.arange(0, BC), R, C, EVEN)


@triton.jit
def _quantize_kernel(
    x_ptr, R, C,
    r_val, r_codes, r_scales, r_signs, r_seed, r_u, r_amax, r_outer,
    c_val, c_codes, c_scales, c_signs, c_seed, c_u, c_amax, c_outer,
    BR: tl.constexpr, BC: tl.constexpr, EVEN: tl.constexpr,
    ROW: tl.constexpr, R_NV: tl.constexpr, R_MODE: tl.constexpr, R_H: tl.constexpr,
    R_SR: tl.constexpr, R_GIVEN_U: tl.constexpr, R_CODES: tl.constexpr, R_VALUES: tl.constexpr,
    COL: tl.constexpr, C_NV: tl.constexpr, C_MODE: tl.constexpr, C_H: tl.constexpr,
    C_SR: tl.constexpr, C_GIVEN_U: tl.constexpr, C_CODES: tl.constexpr, C_VALUES: tl.constexpr,
    r_stats, c_stats, R_STATS: tl.constexpr, C_STATS: tl.constexpr,
):  # fmt: skip
    """One [BR, BC] tile of x, read once: quantized along its rows into the [R, C] outputs (ROW)
    and, transposed in registers, along its columns into the [C, R] outputs (COL); with *_STATS,
    each orientation's saturated and flushed elements counted into its stats pair."""
    r0 = tl.program_id(0) * BR
    c0 = tl.program_id(1) * BC
    x = _load_tile(x_ptr, R, C, r0, c0, BR, BC, EVEN)
    if ROW:
        _quantize_store(
            x, r0, c0, R, C, r_val, r_codes, r_scales, r_signs, r_seed, r_u, r_amax, r_outer,
            BR, BC, R_NV, R_MODE, R_H, R_SR, R_GIVEN_U, R_CODES, R_VALUES, EVEN, r_stats, R_STATS,
        )  # fmt: skip
    if COL:
        _quantize_store(
            tl.trans(x), c0, r0, C, R, c_val, c_codes, c_scales, c_signs, c_seed, c_u, c_amax, c_outer,
            BC, BR, C_NV, C_MODE, C_H, C_SR, C_GIVEN_U, C_CODES, C_VALUES, EVEN, c_stats, C_STATS,
        )  # fmt: skip


@triton.jit
def _tile_kernel(
    x_ptr, R, C, val_ptr, codes_ptr, scales_ptr, amax_ptr, outer_ptr, stats_ptr, seed_ptr, u_ptr,
    BR: tl.constexpr, BC: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, EVEN: tl.constexpr,
    NV: tl.constexpr, MODE: tl.constexpr, CODES: tl.constexpr, VALUES: tl.constexpr, SQUARE: tl.constexpr,
    STATS: tl.constexpr, SR: tl.constexpr, GIVEN_U: tl.constexpr,
):  # fmt: skip
    """2D weight tiles: one [BR, BC] region of x holding whole TH x TW tiles, each with one scale
    from its amax (quantize._group's [R/th, th, C/tw, tw] view), rounded to nearest or (SR)
    stochastically with one uniform per element of x, at its [row, col] (given, or Philox's stream of
    the 1D kernel, whose draws depend on the element's position only). SQUARE > 0 (CTA-local NVFP4):
    each tile's outer scale is that of its SQUARE x SQUARE square, from the square's amax slot, and
    stored there. STATS: the saturated and flushed elements counted into stats_ptr."""
    r0 = tl.program_id(0) * BR
    c0 = tl.program_id(1) * BC
    rows = r0 + tl.arange(0, BR)
    cols = c0 + tl.arange(0, BC)
    t = tl.reshape(_load(x_ptr, rows, cols, R, C, EVEN), [BR // TH, TH, BC // TW, TW])
    tmax = tl.reduce(tl.reduce(tl.abs(t), 3, _max_nan), 1, _max_nan)  # NaN or Inf: poisoned tile
    if SQUARE:
        slots, inside = _square_slots(r0, c0, R, C, BR, BC, TH, TW, SQUARE)
        s_enc, outer = _nvfp4_scales(tl.load(amax_ptr + slots, mask=inside, other=0).to(tl.float32, bitcast=True))
        tl.store(outer_ptr + slots, outer, mask=inside)  # every tile of a square stores the same scale
        byte, decode, multiplier = _nvfp4_block_scale(tmax, s_enc, outer)
    else:
        byte, decode, multiplier, outer = _block_scale(tmax, amax_ptr, outer_ptr, rows, R, r0 == 0, c0 == 0, NV, MODE)
    v = t * multiplier[:, None, :, None]
    a = tl.abs(v)
    if NV or SR:  # as _quantize_store: nvfp4 clamps before rounding, SR saturates first
        a = tl.minimum(a, 6.0)
    q, magic, magic_bits = _grid_round(a)
    if SR:
        u = _sr_uniforms(u_ptr, seed_ptr, rows, cols, c0, R, C, BR, BC, GIVEN_U, EVEN)
        q = _round_stochastic(q, a, magic_bits, tl.reshape(u, [BR // TH, TH, BC // TW, TW]))
    else:
        q = tl.minimum(q, 6.0)
    sign = v.to(tl.int32, bitcast=True) & SIGN_BIT
    if VALUES:
        values = (q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * decode[:, None, :, None]
        _store(val_ptr, rows, cols, R, C, tl.reshape(values, [BR, BC]).to(tl.bfloat16), EVEN)
    if CODES:
        codes = _codes(q, magic, magic_bits, sign, (tmax <= FLT_MAX)[:, None, :, None])
        packed = _pack(tl.reshape(codes, [BR, BC]), BR, BC)
        _store(codes_ptr, rows, c0 // 2 + tl.arange(0, BC // 2), R, C // 2, packed, EVEN)
        tile_rows = r0 // TH + tl.arange(0, BR // TH)
        tile_cols = c0 // TW + tl.arange(0, BC // TW)
        _store(scales_ptr, tile_rows, tile_cols, R // TH, C // TW, byte.to(tl.uint8), EVEN)
    if STATS:
        per_tile = outer[:, None, :, None] if SQUARE else outer
        _count_clip_flush(t, q, sign, decode[:, None, :, None], per_tile, (tmax <= FLT_MAX)[:, None, :, None], stats_ptr)


@triton.jit
def _finite_row_amax(t, signs_ptr, M: tl.constexpr, N: tl.constexpr, H: tl.constexpr):
    """Per row of the transformed tile, the max of |t| over its finite NVFP4 blocks (1x16 along N): [M]."""
    if H > 0:
        t = _hadamard(t, signs_ptr, M, N, H)
    bmax = _block_amax(t, M, N, 16)
    return tl.max(tl.where(bmax <= FLT_MAX, bmax, 0.0), axis=1)


@triton.jit
def _finite_tile_amax(t, M: tl.constexpr, N: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """Per TH x TW tile of t, max |t|, or 0 where the tile holds a NaN or Inf: [M // TH, N // TW]."""
    tmax = tl.reduce(tl.reduce(tl.abs(tl.reshape(t, [M // TH, TH, N // TW, TW])), 3, _max_nan), 1, _max_nan)
    return tl.where(tmax <= FLT_MAX, tmax, 0.0)


@triton.jit
def _finite_amax(t, signs_ptr, M: tl.constexpr, N: tl.constexpr, H: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr):
    """Max of |t| over the finite NVFP4 blocks (1x16 along N) of the transformed tile, or over its
    finite 2D tiles (TH x TW; no transform)."""
    if TH == 1:
        amax = tl.max(_finite_row_amax(t, signs_ptr, M, N, H), axis=0)
    else:
        amax = tl.max(tl.max(_finite_tile_amax(t, M, N, TH, TW), axis=1), axis=0)
    return amax


@triton.jit
def _amax_kernel(
    x_ptr, R, C, r_amax, r_signs, c_amax, c_signs,
    BR: tl.constexpr, BC: tl.constexpr, TILES: tl.constexpr, EVEN: tl.constexpr,
    ROW: tl.constexpr, R_H: tl.constexpr, COL: tl.constexpr, C_H: tl.constexpr,
    TH: tl.constexpr, TW: tl.constexpr, R_CTA: tl.constexpr, C_CTA: tl.constexpr, SQUARE: tl.constexpr,
):  # fmt: skip
    """NVFP4 tensor amaxes (row-wise and/or of x^T; or over TH x TW tiles) from one read of x: each
    program reduces TILES tiles stacked along the rows, then folds its maximum into the int32 bits
    at *_amax with one atomic (non-negative floats order as their bits do). CTA-local amaxes (R_CTA,
    C_CTA > 0: one per that many rows of the output) are folded per row, tile by tile, into the slot
    of the row's CTA tile: x's row r into r_amax[r // R_CTA], x's column c (a row of x^T) into
    c_amax[c // C_CTA]. SQUARE > 0 (2D tiles of CTA-local NVFP4): each finite tile's amax into the slot of
    its SQUARE x SQUARE square, r_amax a row-major [ceil(R / SQUARE), ceil(C / SQUARE)] grid."""
    row_max = tl.zeros([], tl.float32)
    col_max = tl.zeros([], tl.float32)
    c0 = tl.program_id(1) * BC
    for i in tl.static_range(TILES):
        r0 = (tl.program_id(0) * TILES + i) * BR
        x = _load_tile(x_ptr, R, C, r0, c0, BR, BC, EVEN)  # rows past R load as 0: no effect
        if ROW:
            if R_CTA:
                rows = r0 + tl.arange(0, BR)
                row_amax = _finite_row_amax(x, r_signs, BR, BC, R_H).to(tl.int32, bitcast=True)
                tl.atomic_max(r_amax + rows // R_CTA, row_amax, mask=rows < R)
            elif SQUARE:
                slots, inside = _square_slots(r0, c0, R, C, BR, BC, TH, TW, SQUARE)
                tile_amax = _finite_tile_amax(x, BR, BC, TH, TW).to(tl.int32, bitcast=True)
                tl.atomic_max(r_amax + slots, tile_amax, mask=inside)
            else:
                row_max = tl.maximum(row_max, _finite_amax(x, r_signs, BR, BC, R_H, TH, TW))
        if COL:
            if C_CTA:
                cols = c0 + tl.arange(0, BC)
                col_amax = _finite_row_amax(tl.trans(x), c_signs, BC, BR, C_H).to(tl.int32, bitcast=True)
                tl.atomic_max(c_amax + cols // C_CTA, col_amax, mask=cols < C)
            else:
                col_max = tl.maximum(col_max, _finite_amax(tl.trans(x), c_signs, BC, BR, C_H, 1, 16))
    if ROW:
        if not (R_CTA or SQUARE):
            tl.atomic_max(r_amax, row_max.to(tl.int32, bitcast=True))
    if COL:
        if not C_CTA:
            tl.atomic_max(c_amax, col_max.to(tl.int32, bitcast=True))


@triton.jit
def _decode_kernel(
    codes_ptr, scales_ptr, out_ptr, R, C,
    BR: tl.constexpr, BC: tl.constexpr, TH: tl.constexpr, TW: tl.constexpr, NV: tl.constexpr,
    EVEN: tl.constexpr,
):  # fmt: skip
    """One [BR, BC] region of the [R, C] output: E2M1(code) x the decoded scale of its TH x TW tile
    (TH = 1, TW = the block for 1D blocks, whose scale grid is then [R, C // TW])."""
    r0 = tl.program_id(0) * BR
    c0 = tl.program_id(1) * BC
    rows = r0 + tl.arange(0, BR)
    # uint8 widened before the shifts: zero-extended, so the high nibble is a plain >> 4
    packed = _gather(codes_ptr, rows, c0 // 2 + tl.arange(0, BC // 2), R, C // 2, EVEN).to(tl.int32)
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [BR, BC])  # element 2i: the low nibble
    scale_rows = r0 // TH + tl.arange(0, BR // TH)
    scale_cols = c0 // TW + tl.arange(0, BC // TW)
    byte = _gather(scales_ptr, scale_rows, scale_cols, R // TH, C // TW, EVEN).to(tl.int32)
    scale = _e4m3_decode_byte(byte) if NV else _e8m0_decode(byte)
    # QTensor.factored's float32 product. Its at most 6 significant bits fit in bf16, whose exponent
    # range is float32's: the bf16 output rounds nothing (subnormals included).
    if TH == 1:  # the quantize kernel's [M, blocks, block] view
        values = tl.reshape(_e2m1_decode(codes), [BR, BC // TW, TW]) * scale[:, :, None]
    else:
        values = tl.reshape(_e2m1_decode(codes), [BR // TH, TH, BC // TW, TW]) * scale[:, None, :, None]
    out = tl.reshape(values, [BR, BC]).to(out_ptr.dtype.element_ty)
    _store(out_ptr, rows, c0 + tl.arange(0, BC), R, C, out, EVEN)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Orientation:
    """Validated options of one output orientation."""

    nv: bool
    cta: int  # nvfp4_cta: rows per outer-scale tile; 0 for one tensor scale (nvfp4) or none (mxfp4)
    mode: int
    transform: int
    signs: torch.Tensor | None
    sr: bool
    seed: torch.Tensor | None
    uniforms: torch.Tensor | None
    amax: torch.Tensor | None  # a given tensor amax as int32 bits [1] (nvfp4), else None: the kernel takes it
    codes: bool
    values: bool
    stats: torch.Tensor | None = None  # int64 [2]: saturated and flushed elements are added to it


def quantize_fused(
    x: torch.Tensor,
    *,
    fmt: str,
    scale_mode: str | None = None,
    rounding: str = "rtn",
    signs: torch.Tensor | None = None,
    seed: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    tensor_amax: torch.Tensor | None = None,
    transpose: bool = False,
    emit_codes: bool = False,
    emit_values: bool = True,
    tile: tuple[int, int] | None = None,
    adaptive: bool = False,
    cta_tile: int | None = None,
    stats: torch.Tensor | None = None,
    **unsupported,
) -> FusedQuant:
    """Quantize a 2D CUDA tensor along its last dim (or x^T's, with transpose=True) in one kernel.

    fmt "mxfp4" (scale_mode floor, ceil, even or rceil) or "nvfp4" (an extra read for the tensor
    amax, on the device: no host sync). rounding "rtn" or "sr"; SR takes its float32 uniforms from
    `uniforms` (the output's shape: tests pass the reference's draws) or draws them with Philox from
    `seed` (an int64 CUDA tensor of one element, read in the kernel). signs: a float32 +-1 vector of
    16 or 32 for a Hadamard transform along the blocked dim before quantizing. adaptive=True (mxfp4
    with scale_mode "rceil"): the adaptive finer scale of scales.mx_exponent.

    tensor_amax (nvfp4, 1D blocks): the amax behind the tensor scale, a float32 tensor of one element
    on x's device, instead of the kernel's own amax pass, as the reference's `tensor_amax` (e.g.
    `quantize.finite_amax` of the whole tensor, to quantize a part of it exactly as the whole). It
    must be finite and >= 0; unlike the reference this is not checked (that would sync the host).

    emit_codes=True also writes the packed codes and scale bytes; emit_values=False (with
    emit_codes=True) writes only those (and `outer`): the operand a backward GEMM reads later, kept at
    0.5 + 1 / block bytes per element instead of 2, and decoded by `decode_fused` when needed.

    fmt "nvfp4_cta": NVFP4 with CTA-local outer scales, one per `cta_tile` rows of the output
    (default quantize.DEFAULT_CTA_TILE), from the amaxes of those rows (taken in the extra read, one
    atomic per row into its tile's slot); `outer` then holds each row's. 1D blocks only.

    tile=(th, tw): 2D weight tiles, one scale per th x tw tile (multiples of the block; x's shape a
    multiple of the tile), either rounding (SR's uniforms, given or drawn, indexed as x's elements),
    no transform, transpose=False (the tiled encoding of x^T is the transpose of x's: transpose the
    values); `scales` then has shape [R // th, C // tw]. For
    nvfp4 the tensor amax is taken over the finite tiles; for nvfp4_cta over the finite tiles of each
    cta_tile x cta_tile square (a multiple of the tile), and `outer` holds one scale per square,
    [ceil(R / cta_tile), ceil(C / cta_tile)]: the GEMM scales each chunk of its sum by it
    (`numerics.tile_gemm`). tensor_amax with tiles, or the reference's generator, raises ValueError.

    stats: an int64 tensor of two elements on x's device, to which the kernel adds the number of
    saturated and of flushed elements of this quantization (`survey.clip_flush_counts` of the
    transformed input and the encoding, exactly): a probe's statistics from the quantizing pass
    itself, with no second read and no host sync. The caller zeroes it; None counts nothing.
    """
    _check_x(x)
    _reject_unsupported(unsupported)
    if not isinstance(transpose, bool):
        raise ValueError(f"quantize_fused: transpose must be a bool, got {transpose!r}")
    options = {"fmt": fmt, "scale_mode": scale_mode, "adaptive": adaptive, "cta_tile": cta_tile, "rounding": rounding, "signs": signs, "seed": seed, "uniforms": uniforms, "tensor_amax": tensor_amax, "emit_codes": emit_codes, "emit_values": emit_values, "stats": stats}
    spec = _orientation(x, options, transpose)
    if tile is not None:
        if spec.amax is not None:
            raise ValueError("quantize_fused: tensor_amax applies to 1D blocks only; pass tensor_amax=None with tile")
        return _launch_tiles(x, spec, _check_tile(x, tile, spec, transpose))
    row, col = (None, spec) if transpose else (spec, None)
    out_row, out_col = _launch(x, row, col, _TILE_COL if transpose else _TILE_ROW)
    return out_col if transpose else out_row


def quantize_fused_both(x: torch.Tensor, row: dict, col: dict) -> tuple[FusedQuant, FusedQuant]:
    """Both orientations from one read of x: (quantized along the last dim, quantized x^T).

    `row` and `col` hold quantize_fused's options for each (fmt, scale_mode, adaptive, cta_tile, rounding,
    signs, seed, uniforms, tensor_amax, emit_codes, emit_values, stats), e.g. values for the forward GEMM and codes only for the
    backward's x^T. NVFP4 orientations first take their tensor amaxes in one more read.
    """
    _check_x(x)
    for name, options in (("row", row), ("col", col)):
        if not isinstance(options, dict):
            raise ValueError(f"quantize_fused_both: {name} must be a dict of quantize_fused options")
        unknown = sorted(set(options) - set(_OPTION_NAMES))
        if unknown:
            raise ValueError(f"quantize_fused_both: {name} option {unknown[0]!r} is not supported; allowed: {', '.join(_OPTION_NAMES)}")
    row_spec = _orientation(x, {"rounding": "rtn", **row}, transpose=False)
    col_spec = _orientation(x, {"rounding": "rtn", **col}, transpose=True)
    return _launch(x, row_spec, col_spec, _TILE_COL)


def decode_fused(
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    fmt: str,
    shape: tuple[int, int],
    tile: tuple[int, int] | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The block values of packed FP4 codes, E2M1(code) x block scale, in one kernel:
    `QTensor(codes, scales, outer, fmt, shape, block, tile=tile).factored().values.to(out_dtype)` bit
    for bit. The outer scale is not applied (the GEMM's epilogue applies it), so
    `decode_fused(q.codes, q.scales, fmt=f, shape=q.values.shape)` equals q.values for
    q = quantize_fused(x, fmt=f, emit_codes=True), whichever orientation q holds.

    codes:  uint8 [rows, cols // 2], two per byte along the last dim (element 2i in the low nibble).
    scales: uint8 E8M0 (mxfp4, blocks of 32) or E4M3 (nvfp4, blocks of 16) bytes, [rows, cols // block],
            or [rows // th, cols // tw] with tile=(th, tw) (powers of two, multiples of the block).
    out_dtype: torch.bfloat16 (a GEMM operand: exact) or torch.float32. Both inputs contiguous, on CUDA.
    """
    rows, cols, tile = _check_decode(codes, scales, fmt, shape, tile, out_dtype)
    out = torch.empty((rows, cols), dtype=out_dtype, device=codes.device)
    th, tw = tile or (1, BLOCK_SIZE[fmt])
    br, bc = max(_TILE_DECODE[0], th), max(_TILE_DECODE[1], tw)
    warps = min(8, _TILE_DECODE[2] * max(1, br * bc // (_TILE_DECODE[0] * _TILE_DECODE[1])))
    _decode_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bc))](
        codes, scales, out, rows, cols,
        BR=br, BC=bc, TH=th, TW=tw, NV=fmt != "mxfp4", EVEN=rows % br == 0 and cols % bc == 0,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return out


def _launch(x, row: _Orientation | None, col: _Orientation | None, tile) -> tuple[FusedQuant | None, FusedQuant | None]:
    rows, cols = x.shape
    br, bc, warps = tile
    amax = _tensor_amaxes(x, row, col)
    outs, args = [], []
    for spec, shape, slot in ((row, (rows, cols), 0), (col, (cols, rows), 1)):
        if spec is None:
            outs.append(None)
            args += [None] * 8
            continue
        out = _allocate(x.device, shape, spec)
        outs.append(out)
        args += [out.values, out.codes, out.scales, spec.signs, spec.seed, spec.uniforms, amax[slot], out.outer]
    stats = [spec.stats if spec is not None else None for spec in (row, col)]
    grid = (triton.cdiv(rows, br), triton.cdiv(cols, bc))
    _quantize_kernel[grid](
        x, rows, cols, *args, r_stats=stats[0], c_stats=stats[1], R_STATS=stats[0] is not None, C_STATS=stats[1] is not None,
        BR=br, BC=bc, EVEN=rows % br == 0 and cols % bc == 0,
        **_constexprs("R_", row), **_constexprs("C_", col), ROW=row is not None, COL=col is not None,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return outs[0], outs[1]


def _tensor_amaxes(x, row: _Orientation | None, col: _Orientation | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(row, col): int32 bits of each NVFP4 orientation's amax (None for the others), the given
    tensor_amax or computed on the device: one for the tensor, or one per CTA tile (nvfp4_cta: per
    `cta` rows of that orientation's output, so per `cta` columns of x for x^T)."""
    given_row, given_col = (row.amax if row is not None else None), (col.amax if col is not None else None)
    need_row = row is not None and row.nv and given_row is None
    need_col = col is not None and col.nv and given_col is None
    if not (need_row or need_col):
        return given_row, given_col
    rows, cols = x.shape
    row_slots = (triton.cdiv(rows, row.cta) if row.cta else 1) if need_row else 0
    col_slots = (triton.cdiv(cols, col.cta) if col.cta else 1) if need_col else 0
    amax = torch.zeros(row_slots + col_slots, dtype=torch.int32, device=x.device)
    row_amax, col_amax = (amax[:row_slots] if need_row else None), (amax[row_slots:] if need_col else None)
    br, bc, warps = _TILE_AMAX if not need_col else _TILE_COL
    _amax_kernel[(triton.cdiv(rows, br * _AMAX_TILES), triton.cdiv(cols, bc))](
        x, rows, cols, row_amax, row.signs if need_row else None, col_amax, col.signs if need_col else None,
        BR=br, BC=bc, TILES=_AMAX_TILES, EVEN=rows % (br * _AMAX_TILES) == 0 and cols % bc == 0,
        ROW=need_row, R_H=row.transform if need_row else 0, COL=need_col, C_H=col.transform if need_col else 0,
        TH=1, TW=16, R_CTA=row.cta if need_row else 0, C_CTA=col.cta if need_col else 0, SQUARE=0,
        num_warps=warps, enable_fp_fusion=False,
    )  # fmt: skip
    return (given_row if row_amax is None else row_amax), (given_col if col_amax is None else col_amax)


def _launch_tiles(x, spec: _Orientation, tile: tuple[int, int]) -> FusedQuant:
    rows, cols = x.shape
    th, tw = tile
    out = _allocate(x.device, x.shape, spec, tile)
    amax = None
    if spec.nv:  # one tensor amax, or one per CTA square (nvfp4_cta)
        slots = triton.cdiv(rows, spec.cta) * triton.cdiv(cols, spec.cta) if spec.cta else 1
        amax = torch.zeros(slots, dtype=torch.int32, device=x.device)
        br, bc, warps = max(_TILE_AMAX[0], th), max(_TILE_AMAX[1], tw), _TILE_AMAX[2]
        _amax_kernel[(triton.cdiv(rows, br * _AMAX_TILES), triton.cdiv(cols, bc))](
            x, rows, cols, amax, None, None, None,
            BR=br, BC=bc, TILES=_AMAX_TILES, EVEN=rows % (br * _AMAX_TILES) == 0 and cols % bc == 0,
            ROW=True, R_H=0, COL=False, C_H=0, TH=th, TW=tw, R_CTA=0, C_CTA=0, SQUARE=spec.cta,
            num_warps=warps, enable_fp_fusion=False,
        )  # fmt: skip
    br, bc = max(_REGION_2D[0], th), max(_REGION_2D[1], tw)
    warps = _REGION_2D[2] * max(1, br * bc // (_REGION_2D[0] * _REGION_2D[1]))
    _tile_kernel[(triton.cdiv(rows, br), triton.cdiv(cols, bc))](
        x, rows, cols, out.values, out.codes, out.scales, amax, out.outer, spec.stats, spec.seed, spec.uniforms,
        BR=br, BC=bc, TH=th, TW=tw, EVEN=rows % br == 0 and cols % bc == 0,
        NV=spec.nv, MODE=spec.mode, CODES=spec.codes, VALUES=spec.values, SQUARE=spec.cta, STATS=spec.stats is not None,
        SR=spec.sr, GIVEN_U=spec.uniforms is not None,
        num_warps=min(warps, 8), enable_fp_fusion=False,
    )  # fmt: skip
    return out


def _constexprs(prefix: str, spec: _Orientation | None) -> dict:
    if spec is None:
        return {f"{prefix}{k}": 0 for k in ("NV", "MODE", "H", "SR", "GIVEN_U", "CODES", "VALUES")}
    return {
        f"{prefix}NV": spec.cta or int(spec.nv),  # the kernels' NV: 0 MXFP4, 1 NVFP4, > 1 CTA-local NVFP4's tile
        f"{prefix}MODE": spec.mode,
        f"{prefix}H": spec.transform,
        f"{prefix}SR": spec.sr,
        f"{prefix}GIVEN_U": spec.uniforms is not None,
        f"{prefix}CODES": spec.codes,
        f"{prefix}VALUES": spec.values,
    }


def _outer_shape(shape, spec: _Orientation, tile) -> tuple:
    """nvfp4: 0-dim; nvfp4_cta: one per row ([rows, 1]), or with 2D tiles one per CTA square."""
    if not spec.cta:
        return ()
    rows, cols = shape
    return (triton.cdiv(rows, spec.cta), triton.cdiv(cols, spec.cta)) if tile else (rows, 1)


def _allocate(device, shape, spec: _Orientation, tile: tuple[int, int] | None = None) -> FusedQuant:
    rows, cols = shape
    block = 16 if spec.nv else 32
    scales_shape = (rows // tile[0], cols // tile[1]) if tile else (rows, cols // block)
    return FusedQuant(
        values=torch.empty(shape, dtype=torch.bfloat16, device=device) if spec.values else None,
        outer=torch.empty(_outer_shape(shape, spec, tile), dtype=torch.float32, device=device) if spec.nv else None,
        codes=torch.empty((rows, cols // 2), dtype=torch.uint8, device=device) if spec.codes else None,
        scales=torch.empty(scales_shape, dtype=torch.uint8, device=device) if spec.codes else None,
    )



# ----------------------------------------------------------------------------------------------
# Validation: one-line ValueErrors that name the argument
# ----------------------------------------------------------------------------------------------


def _check_x(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"quantize_fused: x must be a torch.Tensor, got {type(x).__name__}")
    if not (x.is_cuda or _INTERPRETED and x.device.type == "cpu"):
        raise ValueError(f"quantize_fused: x is on {x.device}; the fused kernels need a CUDA tensor")
    if x.dim() != 2 or x.numel() == 0:
        raise ValueError(f"quantize_fused: x must be a non-empty 2D tensor, got shape {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"quantize_fused: x has dtype {x.dtype}; allowed: torch.bfloat16, torch.float32")
    if not x.is_contiguous():
        raise ValueError("quantize_fused: x must be contiguous (call .contiguous() first)")


_REFERENCE_DEFAULTS = {"generator": None}


def _reject_unsupported(options: dict) -> None:
    """The reference's other options are accepted at their defaults only, so callers can pass their
    `quantize` options through; anything else means: use the reference."""
    for name, value in options.items():
        if name not in _REFERENCE_DEFAULTS or value is not _REFERENCE_DEFAULTS[name]:
            raise ValueError(f"quantize_fused: {name}={value!r} is not supported by the fused kernels; use the torch reference")


def _orientation(x: torch.Tensor, options: dict, transpose: bool) -> _Orientation:
    fmt = options.get("fmt")
    if fmt not in FORMATS:
        raise ValueError(f"quantize_fused: fmt={fmt!r} is not supported; allowed: {', '.join(map(repr, FORMATS))}")
    scale_mode = options.get("scale_mode")
    if fmt == "mxfp4" and scale_mode is not None and scale_mode not in _MX_MODES:
        raise ValueError(f"quantize_fused: scale_mode={scale_mode!r} is not supported; allowed: {', '.join(map(repr, _MX_MODES))}")
    if fmt != "mxfp4" and scale_mode is not None:
        raise ValueError(f"quantize_fused: scale_mode applies to fmt='mxfp4' only; pass scale_mode=None for {fmt}")
    cta_tile = options.get("cta_tile")
    if cta_tile is not None and fmt != "nvfp4_cta":
        raise ValueError(f"quantize_fused: cta_tile applies to fmt='nvfp4_cta' only; pass cta_tile=None for {fmt}")
    if cta_tile is not None and not (isinstance(cta_tile, int) and not isinstance(cta_tile, bool) and cta_tile > 0 and cta_tile % 16 == 0):
        raise ValueError(f"quantize_fused: cta_tile={cta_tile!r} must be a positive multiple of 16")
    adaptive = options.get("adaptive", False)
    if adaptive not in (False, True):
        raise ValueError(f"quantize_fused: adaptive must be a bool, got {adaptive!r}")
    if adaptive and (fmt != "mxfp4" or scale_mode != "rceil"):
        raise ValueError("quantize_fused: adaptive=True applies to fmt='mxfp4' with scale_mode='rceil' only")
    rounding = options.get("rounding", "rtn")
    if rounding not in ("rtn", "sr"):
        raise ValueError(f"quantize_fused: rounding={rounding!r} is not supported; allowed: 'rtn', 'sr'")
    out_shape = (x.shape[1], x.shape[0]) if transpose else tuple(x.shape)
    seed, uniforms = options.get("seed"), options.get("uniforms")
    if rounding == "rtn" and (seed is not None or uniforms is not None):
        raise ValueError("quantize_fused: seed and uniforms apply to rounding='sr' only")
    if rounding == "sr" and (seed is None) == (uniforms is None):
        raise ValueError("quantize_fused: rounding='sr' needs exactly one of seed (int64 CUDA tensor) or uniforms")
    if seed is not None and not _on_device(seed, x, torch.int64, (1,), ()):
        raise ValueError("quantize_fused: seed must be an int64 tensor of one element on x's device")
    if uniforms is not None and not (_on_device(uniforms, x, torch.float32, out_shape) and uniforms.is_contiguous()):
        raise ValueError(f"quantize_fused: uniforms must be a contiguous float32 tensor of shape {list(out_shape)} on x's device")
    amax = options.get("tensor_amax")
    if amax is not None:
        if fmt != "nvfp4":
            raise ValueError(f"quantize_fused: tensor_amax applies to fmt='nvfp4' only; pass tensor_amax=None for {fmt}")
        if not _on_device(amax, x, torch.float32, (), (1,)):
            raise ValueError("quantize_fused: tensor_amax must be a float32 tensor of one element on x's device")
        amax = amax.reshape(1).view(torch.int32)
    signs = options.get("signs")
    transform = 0
    if signs is not None:
        if not (isinstance(signs, torch.Tensor) and signs.dim() == 1 and signs.numel() in _TRANSFORM_SIZES and _on_device(signs, x, torch.float32, tuple(signs.shape))):
            raise ValueError("quantize_fused: signs must be a float32 vector of 16 or 32 values +-1 on x's device (hadamard_signs(...).to(x.device))")
        transform = signs.numel()
    emit_codes = options.get("emit_codes", False)
    if not isinstance(emit_codes, bool):
        raise ValueError(f"quantize_fused: emit_codes must be a bool, got {emit_codes!r}")
    emit_values = options.get("emit_values", True)
    if not isinstance(emit_values, bool):
        raise ValueError(f"quantize_fused: emit_values must be a bool, got {emit_values!r}")
    if not (emit_values or emit_codes):
        raise ValueError("quantize_fused: emit_values=False writes codes only; pass emit_codes=True with it")
    stats = options.get("stats")
    if stats is not None and not (_on_device(stats, x, torch.int64, (2,)) and stats.is_contiguous()):
        raise ValueError("quantize_fused: stats must be a contiguous int64 tensor of two elements on x's device (torch.zeros(2, dtype=torch.int64))")
    blocked = out_shape[1]
    multiple = max(BLOCK_SIZE[fmt], transform)
    if blocked % multiple:
        what = "rows" if transpose else "last dim"
        raise ValueError(f"quantize_fused: the {what} of x (shape {list(x.shape)}) must be a multiple of {multiple} ({fmt} block, transform)")
    return _Orientation(
        nv=fmt != "mxfp4",
        cta=(cta_tile or DEFAULT_CTA_TILE) if fmt == "nvfp4_cta" else 0,
        mode=(_MX_ADAPTIVE if adaptive else _MX_MODES[scale_mode or "floor"]) if fmt == "mxfp4" else 0,
        transform=transform,
        signs=signs.contiguous() if signs is not None else None,
        sr=rounding == "sr",
        seed=seed,
        uniforms=uniforms,
        amax=amax,
        codes=emit_codes,
        values=emit_values,
        stats=stats,
    )


def _check_tile(x: torch.Tensor, tile, spec: _Orientation, transpose: bool) -> tuple[int, int]:
    block = 16 if spec.nv else 32
    if not (isinstance(tile, (tuple, list)) and len(tile) == 2 and all(_is_tile_dim(t, block) for t in tile)):
        raise ValueError(f"quantize_fused: tile={tile!r} must be (th, tw) with powers of two that are multiples of {block}")
    if spec.cta and (spec.cta % tile[0] or spec.cta % tile[1]):
        raise ValueError(f"quantize_fused: cta_tile={spec.cta} must be a multiple of both tile dims {tuple(tile)}")
    if spec.transform or transpose:
        raise ValueError("quantize_fused: tile supports no signs and transpose=False only (transpose the values for x^T)")
    if x.shape[0] % tile[0] or x.shape[1] % tile[1]:
        raise ValueError(f"quantize_fused: x shape {list(x.shape)} is not divisible into {tuple(tile)} tiles")
    return tuple(tile)


def _check_decode(codes, scales, fmt, shape, tile, out_dtype) -> tuple[int, int, tuple[int, int] | None]:
    if fmt not in FORMATS:
        raise ValueError(f"decode_fused: fmt={fmt!r} is not supported; allowed: {', '.join(map(repr, FORMATS))}")
    block = BLOCK_SIZE[fmt]
    if not (isinstance(shape, (tuple, list, torch.Size)) and len(shape) == 2 and all(isinstance(n, int) and n > 0 for n in shape)):
        raise ValueError(f"decode_fused: shape={shape!r} must be (rows, cols) of positive ints")
    rows, cols = shape
    if tile is not None:
        if not (isinstance(tile, (tuple, list)) and len(tile) == 2 and all(_is_tile_dim(t, block) for t in tile)):
            raise ValueError(f"decode_fused: tile={tile!r} must be (th, tw) with powers of two that are multiples of {block}")
        tile = tuple(tile)
    grid = tile or (1, block)
    if rows % grid[0] or cols % grid[1]:
        what = f"{tile} tiles" if tile else f"1x{block} blocks"
        raise ValueError(f"decode_fused: shape {[rows, cols]} is not divisible into {what}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"decode_fused: out_dtype={out_dtype} is not supported; allowed: torch.bfloat16, torch.float32")
    for name, t, want in (("codes", codes, (rows, cols // 2)), ("scales", scales, (rows // grid[0], cols // grid[1]))):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != want:
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"decode_fused: {name} must be a uint8 tensor of shape {list(want)}, got {got}")
        if not (t.is_cuda or _INTERPRETED and t.device.type == "cpu") or t.device != codes.device:
            raise ValueError(f"decode_fused: {name} is on {t.device}; codes and scales must be on one CUDA device")
        if not t.is_contiguous():
            raise ValueError(f"decode_fused: {name} must be contiguous (call .contiguous() first)")
    return rows, cols, tile


def _is_tile_dim(t, block: int) -> bool:
    """A tile dim the kernels take: Triton's block shapes are powers of two."""
    return isinstance(t, int) and t > 0 and t % block == 0 and t & (t - 1) == 0


def _on_device(t, x: torch.Tensor, dtype: torch.dtype, *shapes: tuple) -> bool:
    return isinstance(t, torch.Tensor) and t.device == x.device and t.dtype == dtype and tuple(t.shape) in shapes
