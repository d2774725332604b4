"""The chunk-scaled GEMM of 2D CTA-local NVFP4 weights on bf16 tensor cores (`numerics.tile_gemm`).

out = (a @ b^T, each T-wide chunk of the sum scaled by b's square, in chunk order) * a_outer: one
program per [BM, BN] tile of out runs the chunks in order, each as tl.dot of bf16 values into a fresh
fp32 partial (T / BK dots of K = BK), then adds partial * scale (a scale per column of the tile:
b's rows may cross a square boundary) into the fp32 accumulator; a's outer scale and the one rounding
to the output dtype are its epilogue. Compiled without FMA contraction, so each chunk's scaling and
its addition round as `tile_scaled_matmul_reference` rounds them: the two give the same bits wherever
the partial sums are exact, and differ by fp32 summation order elsewhere.

Import lazily, after `fp4lab.numerics.kernels.runs_on(device)`; the torch reference computes the
same sums on any device.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fp4lab.numerics.kernels.mx_gemm import GROUP_ROWS, LAUNCH_OPTIONS, bf16_round, grouped_tile_rows
from fp4lab.numerics.tile_gemm import check_tile_operands
from fp4lab.numerics.tile_gemm import (
    tile_scaled_matmul_reference as tile_scaled_matmul_reference,  # re-exported beside the kernel
)

# Triton's CPU interpreter (the tests) multiplies bf16 operands of tl.dot as integers (their bits), so
# there the kernel upcasts them to fp32 first: the same exact products.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
_NONE, _SCALAR, _PER_ROW = 0, 1, 2


class TileGemmConfig(NamedTuple):
    """Launch shape: output tile (rows of a, rows of b) per program, K per dot (a power of two >= 16;
    the largest one dividing the square's side is taken), warps, software-pipeline stages."""

    tile: tuple[int, int] = (128, 128)
    k_step: int = 64
    warps: int = 8
    stages: int = 3


# The fastest of 14 launch shapes on the 125m and 350m GEMMs (`scripts/gpu_sweeps.py tile-configs`, docs/BENCHMARKS.md).
DEFAULT_CONFIG = TileGemmConfig()


@triton.jit
def _tile_scaled_kernel(
    a_ptr, b_ptr, cells_ptr, outer_ptr, out_ptr, M, N,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cn, stride_ck,
    K: tl.constexpr, CELL: tl.constexpr, CHUNKS: tl.constexpr, A_OUTER: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, OUT_BF16: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    rows_a, rows_b = grouped_tile_rows(M, N, BM, BN, GROUP)
    in_a, in_b = rows_a < M, rows_b < N
    a_rows = a_ptr + rows_a.to(tl.int64)[:, None] * stride_am
    b_rows = b_ptr + rows_b.to(tl.int64)[:, None] * stride_bn
    square_rows = cells_ptr + (rows_b // CELL) * stride_cn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for chunk in range(CHUNKS):
        partial = tl.zeros([BM, BN], dtype=tl.float32)
        for step in tl.static_range(CELL // BK):
            cols = chunk * CELL + step * BK + tl.arange(0, BK)
            in_k = cols < K
            a = tl.load(a_rows + cols[None, :] * stride_ak, mask=in_a[:, None] & in_k[None, :], other=0.0)
            b = tl.load(b_rows + cols[None, :] * stride_bk, mask=in_b[:, None] & in_k[None, :], other=0.0)
            if UPCAST:  # exact: bf16 values are fp32 values, and their products fit fp32
                partial = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), partial, input_precision="ieee")
            else:
                partial = tl.dot(a, tl.trans(b), partial)
        scale = tl.load(square_rows + chunk * stride_ck, mask=in_b, other=0.0)
        acc += partial * scale[None, :]
    if A_OUTER == 1:
        acc = acc * tl.load(outer_ptr)
    elif A_OUTER == 2:
        acc = acc * tl.load(outer_ptr + rows_a, mask=in_a, other=0.0)[:, None]
    ptrs = out_ptr + rows_a.to(tl.int64)[:, None] * N + rows_b[None, :]
    tl.store(ptrs, bf16_round(acc) if OUT_BF16 else acc, mask=in_a[:, None] & in_b[None, :])


def tile_scaled_matmul(
    a: torch.Tensor, b: torch.Tensor, cells: torch.Tensor, cell: int, a_outer: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32, config: TileGemmConfig = DEFAULT_CONFIG,
) -> torch.Tensor:  # fmt: skip
    """`tile_scaled_matmul_reference(a, b, cells, cell, a_outer, out_dtype)` on bf16 tensor cores: a and
    b bf16 (any strides: b may be W^T's view), cells and a_outer fp32, all on one CUDA device (or the
    CPU under Triton's interpreter)."""
    m, n, k = check_tile_operands("tile_scaled_matmul", a, b, cells, cell, a_outer, out_dtype)
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise ValueError(f"tile_scaled_matmul: a and b must be bfloat16 (exact decoded values), got {a.dtype} and {b.dtype}")
    if not (a.is_cuda or _INTERPRETED and a.device.type == "cpu"):
        raise ValueError(f"tile_scaled_matmul: operands are on {a.device}; use a CUDA device (or tile_scaled_matmul_reference)")
    bm, bn = config.tile
    k_step = math.gcd(config.k_step, cell & -cell)  # a power of two dividing the square's side
    if k_step < 16:
        raise ValueError(f"tile_scaled_matmul: cell={cell} must be a multiple of 16 (tl.dot takes K >= 16)")
    cells = cells.to(torch.float32)
    if a_outer is None:
        mode, outer = _NONE, cells
    else:
        mode, outer = (_SCALAR if a_outer.numel() == 1 else _PER_ROW), a_outer.to(torch.float32).reshape(-1).contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    _tile_scaled_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        a, b, cells, outer, out, m, n, a.stride(0), a.stride(1), b.stride(0), b.stride(1), cells.stride(0), cells.stride(1),
        K=k, CELL=cell, CHUNKS=math.ceil(k / cell), A_OUTER=mode, BM=bm, BN=bn, BK=k_step, GROUP=GROUP_ROWS,
        OUT_BF16=out_dtype == torch.bfloat16, UPCAST=_INTERPRETED, num_warps=config.warps, num_stages=config.stages, **LAUNCH_OPTIONS,
    )  # fmt: skip
    return out
