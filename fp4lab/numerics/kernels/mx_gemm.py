"""MXFP4 GEMM on FP8 tensor cores: C = A @ B^T from packed E2M1 codes and E8M0 scales, exact per block.

Hopper has no FP4 units, but every E2M1 value (0, +-0.5, ..., +-6) is exact in FP8 E4M3, and its FP8
tensor cores run at 1.83x the bf16 rate. They do not accumulate in full fp32, though: a GEMM of
decoded MXFP4 operands on them is off by up to thousands of fp32 ulps (h200_anchors.md, "Accumulation
precision of Hopper GEMMs"). This kernel therefore feeds them the raw E2M1 values of one 32-wide MX
block at a time and applies the block scales in fp32 itself:

    for each K block k = 0, 1, ..., K / 32 - 1, in order:
        partial = E2M1(A[:, k]) @ E2M1(B[:, k])^T          one FP8 tl.dot, K = 32
        acc    += partial * 2^(ea[i, k] + eb[j, k])        fp32

Why this is exact but for the fp32 additions across blocks:

- every product of two E2M1 values is a multiple of 1/4 of magnitude <= 36, so a 32-term partial sum
  is n / 4 with |n| <= 4608 < 2^13: every partial sum, in any order and in any accumulator of at
  least 13 significant bits, is exact (the measured fact behind the design: promoting every 32 of K
  is exact on an H200);
- the scaling rounds at most once: 2^(ea + eb) itself can leave fp32's range (ea + eb spans -254 to
  254), so it is split into 2^e1 * 2^e2 with e1 = clamp(ea + eb, -126, 127) and e2 = ea + eb - e1
  (floored at -126): partial * 2^e1 is exact (a multiple of 2^-128 with at most 13 significant bits)
  unless it overflows, in which case the exact result overflows as well; the second multiplication
  rounds once, to the nearest fp32 of partial * 2^(ea + eb) (subnormals kept, and +-0 where the floor
  at -126 cuts ea + eb = -253, -254: both results are below 2^-241);
- that split costs about ten integer operations per output element and block, so the kernel takes it
  only for output tiles where some A scale of the tile's rows reaches 2^118 (byte 245). Elsewhere it
  multiplies by a per-row factor 2^ea, then by a per-column factor 2^eb (two multiplications per
  element): partial * 2^ea is exact (below 2^11 * 2^117 < FLT_MAX; a multiple of 2^-129), so the
  second multiplication, by a factor that may be the subnormal 2^-127, again rounds once to the
  nearest fp32 of partial * 2^(ea + eb): the same bits as the split;
- every factor is built from integer exponent bits (never exp2, whose subnormal results Triton
  flushes), and the kernel is compiled with `enable_fp_fusion=False` (no FMA contraction of the
  multiplies and the add).

So `mxfp4_matmul` equals `mxfp4_matmul_reference` (the same steps in torch) bit for bit, and
differs from the exact product of the decoded operands by the fp32 additions only:
|C - C_exact| <= (K / 32) * 2^-24 * sum_k |scaled partial_k| (plus 2^-149 per block where a scaled
partial is subnormal). With a single block along K it equals the fp32 GEMM of the decoded operands
(`a.dequantize() @ b.dequantize().T`) exactly, as long as no product of decoded values is subnormal.
A block whose scale byte is 0xFF (NaN: the block held NaN or Inf) makes its row of C (for A) or
column (for B) NaN, as NaN * 0 does in the decoded GEMM.

Layout: both operands are quantized along K, their last dim, as each of FP4Linear's GEMMs quantizes
its two operands along its contraction dim (fp4lab/nn/fp4_linear.py):

    Fprop  y  [M, N] = mxfp4_matmul(Q(x) [M, K],    Q(W) [N, K])
    Dgrad  dx [M, K] = mxfp4_matmul(Q(dy) [M, N],   Q(W^T) [K, N])
    Wgrad  dW [N, K] = mxfp4_matmul(Q(dy^T) [N, M], Q(x^T) [K, M])

i.e. F.linear's convention, a @ b^T, on `QTensor`s from `quantize(t, "mxfp4")` (1D blocks, any scale
mode), or on the codes and scale bytes of `kernels.quantize.quantize_fused(..., emit_codes=True)`
wrapped as `QTensor(codes, scales, None, "mxfp4", torch.Size(shape), 32)`. The kernel reads each
operand's values as E4M3 bytes, converted once per operand from the packed codes by a small
elementwise kernel (`e4m3_values`: bit arithmetic, exact), and its scale bytes block-major
([K / 32, rows], so that a tile's bytes of one block are one coalesced load). Converting inside the
GEMM instead repeats the conversion for every output tile that reads a row: on an H200 that halved
the throughput (docs/BENCHMARKS.md).

Speed: a K block is one FP8 wgmma with K = 32 whose result the fp32 scaling must wait for; this
serialisation, not the tensor cores, bounds the kernel. `GemmConfig.blocks_per_step` issues several
blocks' dots before their scaled sums, so that Triton's pipeliner can overlap them.

This module imports Triton: import it lazily, after `fp4lab.numerics.kernels.runs_on(device)`.
Without a GPU, `fp4lab.numerics.mx_gemm.mxfp4_matmul_reference` (pure torch, any device, re-exported
here) computes the same bits.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fp4lab.numerics.mx_gemm import check_operands
from fp4lab.numerics.mx_gemm import (
    mxfp4_matmul_reference as mxfp4_matmul_reference,  # the kernel's bits, re-exported beside it
)
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.scales import E8M0_NAN_BITS

E8M0_NAN = tl.constexpr(E8M0_NAN_BITS)  # a kernel reads globals only as constexprs
# The largest A scale byte of a tile that takes the per-row, per-column factors: 2^117, so that
# partial * 2^ea < 2^11 * 2^117 cannot overflow.
ROW_FIRST_MAX_BYTE = tl.constexpr(127 + 117)


class GemmConfig(NamedTuple):
    """Launch shape: output tile (rows of A, rows of B) per program, warps, software-pipeline stages, and
    K blocks per loop iteration (their FP8 dots are issued before their scaled sums are added, in
    order, so the next block's wgmma runs while the previous one is scaled)."""

    tile: tuple[int, int] = (128, 64)
    warps: int = 4
    stages: int = 3
    blocks_per_step: int = 2


# The fastest of ten launch shapes swept on an H200 over the 125m model's Fprop and Dgrad GEMMs
# (docs/BENCHMARKS.md, scripts/mx_gemm_sweep.py); tests pass smaller tiles.
DEFAULT_CONFIG = GemmConfig()
# Programs that share A's rows run next to each other, GROUP_ROWS tiles at a time, so B's columns stay in L2.
GROUP_ROWS = 8
# Compile options of every launch: no FMA contraction of the scaling's multiplies into the sum.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
# Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors: the tests use it.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_E4M3_BLOCK = 1024  # packed bytes per program of the code conversion


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _e4m3_bits(codes):
    """E4M3 bits (int32) of E2M1 codes. Magnitude codes 2..7 are `e e m` with value 2^(e - 1) * (1 + m / 2);
    the E4M3 bits of that are exponent e - 1 + 7 and top mantissa bit m, i.e. (code << 2) + 48. Code 1
    (0.5) is 0x30 = 1 * 48, code 0 is 0 = 0 * 48. The sign moves from bit 3 to bit 7 (code 8 is -0.0,
    fine in a dot)."""
    magnitude = codes & 7
    return tl.where(magnitude >= 2, (magnitude << 2) + 48, magnitude * 48) | ((codes & 8) << 4)


@triton.jit
def _e4m3_from_codes_kernel(packed_ptr, out_ptr, n_packed, BLOCK: tl.constexpr):
    """Packed E2M1 codes (element 2i in the low nibble of byte i) to one E4M3 byte per element."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    packed = tl.load(packed_ptr + offsets, mask=offsets < n_packed, other=0).to(tl.int32)  # zero-extended
    pairs = tl.join(_e4m3_bits(packed & 0xF), _e4m3_bits(packed >> 4))
    out = tl.reshape(pairs, [2 * BLOCK]).to(tl.uint8)
    targets = 2 * tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, 2 * BLOCK)
    tl.store(out_ptr + targets, out, mask=targets < 2 * n_packed)


@triton.jit
def _scale_bytes(scales_ptr, rows, n_rows, kb):
    """The E8M0 bytes of K block kb for `rows` of a block-major [KB, n_rows] scale array, as int32."""
    return tl.load(scales_ptr + kb * n_rows + rows, mask=rows < n_rows, other=0).to(tl.int32)


@triton.jit
def _e8m0_factor(byte):
    """2^(byte - 127) from bits; byte 0 is the subnormal 2^-127 (0x00400000). Byte 255 gives Inf: its
    row or column is replaced by NaN at the end."""
    return tl.where(byte == 0, 0x400000, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _max_finite_byte(scales_ptr, rows, n_rows, KB: tl.constexpr, R: tl.constexpr):
    """The largest scale byte other than NaN (255) of `rows` over all K blocks (0 for rows past n_rows)."""
    top = tl.zeros([R], dtype=tl.int32)
    for kb in range(KB):
        byte = _scale_bytes(scales_ptr, rows, n_rows, kb)
        top = tl.maximum(top, tl.where(byte == E8M0_NAN, 0, byte))
    return tl.max(top, axis=0)


@triton.jit
def _block_dot(a_values, b_values, rows_a, rows_b, M, N, kb, KB: tl.constexpr):
    """The exact FP8 dot of K block kb: E4M3 A [BM, 32] times E4M3 B [BN, 32]^T, fp32 (n / 4, |n| < 2^13)."""
    cols = kb * 32 + tl.arange(0, 32)
    a = tl.load(a_values + rows_a.to(tl.int64)[:, None] * (KB * 32) + cols[None, :], mask=(rows_a < M)[:, None], other=0)
    b = tl.load(b_values + rows_b.to(tl.int64)[:, None] * (KB * 32) + cols[None, :], mask=(rows_b < N)[:, None], other=0)
    a, b = a.to(tl.float8e4nv, bitcast=True), b.to(tl.float8e4nv, bitcast=True)
    return tl.dot(a, tl.trans(b), out_dtype=tl.float32)


@triton.jit
def _add_scaled(acc, nan_a, nan_b, partial, a_scales, b_scales, rows_a, rows_b, M, N, kb, SPLIT: tl.constexpr):
    """acc + partial * 2^(ea + eb) for K block kb: with SPLIT through 2^e1 * 2^e2 (any bytes), else per
    row, then per column (A bytes <= ROW_FIRST_MAX_BYTE); and the NaN-byte flags updated."""
    ea = _scale_bytes(a_scales, rows_a, M, kb)
    eb = _scale_bytes(b_scales, rows_b, N, kb)
    if SPLIT:
        # 2^(ea + eb - 254) as 2^(b1 - 127) * 2^(b2 - 127), both normal: b1 + b2 = ea + eb except
        # where ea + eb < 2 (the result is +-0 either way). A NaN byte (255) may make b2 256 (-0.0):
        # its row or column is replaced by NaN at the end.
        biased = ea[:, None] + eb[None, :]
        b1 = tl.minimum(tl.maximum(biased - 127, 1), 254)
        b2 = tl.maximum(biased - b1, 1)
        acc += (partial * (b1 << 23).to(tl.float32, bitcast=True)) * (b2 << 23).to(tl.float32, bitcast=True)
    else:
        acc += (partial * _e8m0_factor(ea)[:, None]) * _e8m0_factor(eb)[None, :]
    return acc, nan_a | (ea == E8M0_NAN), nan_b | (eb == E8M0_NAN)


@triton.jit
def _accumulate(
    a_values, a_scales, b_values, b_scales, rows_a, rows_b, M, N,
    KB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STEP: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """The fp32 sum over the K blocks, in order, of each block's FP8 dot scaled by 2^(ea + eb), STEP
    (1, 2 or 4, dividing KB) blocks per iteration: their dots first, then their scaled sums in order.
    Also whether each row of A and each row of B has a NaN scale byte."""
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    nan_a = tl.zeros([BM], dtype=tl.int1)
    nan_b = tl.zeros([BN], dtype=tl.int1)
    for kb in range(0, KB, STEP):
        p0 = _block_dot(a_values, b_values, rows_a, rows_b, M, N, kb, KB)
        if STEP >= 2:
            p1 = _block_dot(a_values, b_values, rows_a, rows_b, M, N, kb + 1, KB)
        if STEP == 4:
            p2 = _block_dot(a_values, b_values, rows_a, rows_b, M, N, kb + 2, KB)
            p3 = _block_dot(a_values, b_values, rows_a, rows_b, M, N, kb + 3, KB)
        acc, nan_a, nan_b = _add_scaled(acc, nan_a, nan_b, p0, a_scales, b_scales, rows_a, rows_b, M, N, kb, SPLIT)
        if STEP >= 2:
            acc, nan_a, nan_b = _add_scaled(acc, nan_a, nan_b, p1, a_scales, b_scales, rows_a, rows_b, M, N, kb + 1, SPLIT)
        if STEP == 4:
            acc, nan_a, nan_b = _add_scaled(acc, nan_a, nan_b, p2, a_scales, b_scales, rows_a, rows_b, M, N, kb + 2, SPLIT)
            acc, nan_a, nan_b = _add_scaled(acc, nan_a, nan_b, p3, a_scales, b_scales, rows_a, rows_b, M, N, kb + 3, SPLIT)
    return acc, nan_a, nan_b


@triton.jit
def bf16_round(x):
    """float32 to bfloat16, round to nearest even, from bits: the same on the GPU and in the interpreter,
    whose bf16 cast truncates and flushes subnormals. Adding 0x7FFF plus the kept lowest bit carries
    into the exponent exactly when RNE rounds up (to Inf past the largest bf16); NaN stays a quiet NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = tl.where(x != x, 0x7FC0, (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)
    return rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def grouped_tile_rows(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    """The rows of A and of B of this program's [BM, BN] output tile, programs ordered so that GROUP
    tiles of A's rows run next to each other (B's columns stay in L2)."""
    pid = tl.program_id(0)
    tiles_a, tiles_b = tl.cdiv(M, BM), tl.cdiv(N, BN)
    first_a = pid // (GROUP * tiles_b) * GROUP
    group_size = min(tiles_a - first_a, GROUP)
    tile_a = first_a + (pid % (GROUP * tiles_b)) % group_size
    tile_b = (pid % (GROUP * tiles_b)) // group_size
    return tile_a * BM + tl.arange(0, BM), tile_b * BN + tl.arange(0, BN)


@triton.jit
def _mxfp4_matmul_kernel(
    a_values, a_scales, b_values, b_scales, out_ptr, M, N,
    KB: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, STEP: tl.constexpr, GROUP: tl.constexpr,
    OUT_BF16: tl.constexpr,
):  # fmt: skip
    """One [BM, BN] tile of C = A @ B^T: the K blocks in order, each an FP8 dot of E4M3 values scaled by
    2^(ea + eb) and added into an fp32 accumulator. KB (K / 32) is a constexpr: one compiled kernel per
    K, of which a model has few, and Triton's interpreter cannot loop to a runtime bound."""
    rows_a, rows_b = grouped_tile_rows(M, N, BM, BN, GROUP)
    if _max_finite_byte(a_scales, rows_a, M, KB, BM) <= ROW_FIRST_MAX_BYTE:
        acc, nan_a, nan_b = _accumulate(a_values, a_scales, b_values, b_scales, rows_a, rows_b, M, N, KB, BM, BN, STEP, False)
    else:
        acc, nan_a, nan_b = _accumulate(a_values, a_scales, b_values, b_scales, rows_a, rows_b, M, N, KB, BM, BN, STEP, True)
    acc = tl.where(nan_a[:, None] | nan_b[None, :], float("nan"), acc)
    ptrs = out_ptr + rows_a.to(tl.int64)[:, None] * N + rows_b[None, :]
    tl.store(ptrs, bf16_round(acc) if OUT_BF16 else acc, mask=(rows_a < M)[:, None] & (rows_b < N)[None, :])


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------


def e4m3_values(codes: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes [rows, K / 2] (uint8) to their values as E4M3 bytes [rows, K] (uint8), exact."""
    codes = codes.contiguous()
    out = torch.empty((*codes.shape[:-1], 2 * codes.shape[-1]), dtype=torch.uint8, device=codes.device)
    _e4m3_from_codes_kernel[(triton.cdiv(codes.numel(), _E4M3_BLOCK),)](codes, out, codes.numel(), BLOCK=_E4M3_BLOCK)
    return out


def mxfp4_matmul(
    a: QTensor, b: QTensor, out_dtype: torch.dtype = torch.float32, tile: tuple[int, int] | None = None,
    config: GemmConfig = DEFAULT_CONFIG,
) -> torch.Tensor:  # fmt: skip
    """C [M, N] = A [M, K] @ B [N, K]^T for two MXFP4 `QTensor`s quantized along K (1D blocks of 32),
    on FP8 tensor cores, bit for bit `mxfp4_matmul_reference(a, b, out_dtype)`.

    out_dtype: torch.float32, or torch.bfloat16 (the fp32 result rounded once, to nearest even).
    config: launch shape (`GemmConfig`); tile, if given, replaces its tile: (rows of A, rows of B) per
    program, powers of two >= 16. Both operands on one CUDA device.
    """
    m, n, kb = check_operands("mxfp4_matmul", a, b, out_dtype)
    tile = config.tile if tile is None else tile
    if not (isinstance(tile, (tuple, list)) and len(tile) == 2 and all(isinstance(t, int) and t >= 16 and t & (t - 1) == 0 for t in tile)):
        raise ValueError(f"mxfp4_matmul: tile={tile!r} must be (rows of A, rows of B) per program, powers of two >= 16")
    if config.blocks_per_step not in (1, 2, 4):
        raise ValueError(f"mxfp4_matmul: blocks_per_step={config.blocks_per_step!r} must be 1, 2 or 4")
    for name, q in (("a", a), ("b", b)):
        if not (q.data.is_cuda or _INTERPRETED and q.data.device.type == "cpu") or q.data.device != a.data.device:
            raise ValueError(f"mxfp4_matmul: {name} is on {q.data.device}; both operands must be on one CUDA device (or use mxfp4_matmul_reference)")
    step = config.blocks_per_step
    while kb % step:  # K / 32 blocks in whole steps
        step //= 2
    bm, bn = tile
    out = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    _mxfp4_matmul_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        e4m3_values(a.data), a.scales.T.contiguous(), e4m3_values(b.data), b.scales.T.contiguous(), out, m, n,
        KB=kb, BM=bm, BN=bn, STEP=step, GROUP=GROUP_ROWS, OUT_BF16=out_dtype == torch.bfloat16,
        num_warps=config.warps, num_stages=config.stages, **LAUNCH_OPTIONS,
    )  # fmt: skip
    return out
