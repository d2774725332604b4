"""The GEMM of an operand whose outer scale varies along the contraction dim: 2D CTA-local NVFP4 tiles.

A weight quantized to nvfp4_cta in 2D tiles has one fp32 outer scale per T x T square (T the CTA
tile, `QTensor.tensor_scale` of shape [ceil(R / T), ceil(C / T)]). Fprop contracts W's columns and
Dgrad W^T's, so along the contraction dim the scale changes every T elements: it cannot leave the sum
as a per-row NVFP4 scale does (Blackwell's alpha). Folding it into the decoded values instead makes
them fp32 (no longer exact in bf16) and the GEMM an fp32 one. Here the sum is cut where the scale
changes: with `cells` the b operand's squares,

    for each chunk c = 0, 1, ..., ceil(K / T) - 1 of T columns, in order:
        partial = a[:, chunk c] @ b[:, chunk c]^T             fp32 accumulation of exact products
        acc    += partial * cells[j // T, c]                  for each row j of b; two fp32 roundings
    out = (acc * a_outer).to(out_dtype)                        a_outer: None, 0-dim or one per row of a

so the values stay exact in bf16 and every chunk runs on bf16 tensor cores
(`numerics.kernels.tile_gemm.tile_scaled_matmul`). Against the fp32 GEMM of the folded values the
result differs by fp32 summation order and the folding's one rounding per value: both within
K u sum |a b| of the exact product (u = 2^-24). Where every partial sum is exact (a and b whole
numbers of small magnitude, say), the kernel and this reference give the same bits.

Torch only: nothing here imports Triton (the kernel is `fp4lab.numerics.kernels.tile_gemm`).
"""

from __future__ import annotations

import math

import torch

OUT_DTYPES = (torch.float32, torch.bfloat16)


def tile_scaled_matmul_reference(
    a: torch.Tensor, b: torch.Tensor, cells: torch.Tensor, cell: int, a_outer: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """out [M, N] = (a [M, K] @ (b [N, K] scaled per `cell` x `cell` square by `cells`)^T) * a_outer, the
    chunked sum of the module docstring in torch, on any device; values in any float dtype, upcast."""
    m, n, k = check_tile_operands("tile_scaled_matmul_reference", a, b, cells, cell, a_outer, out_dtype)
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    per_row = cells.to(torch.float32).repeat_interleave(cell, dim=0)[:n]  # [N, chunks]
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.device)
    for chunk in range(math.ceil(k / cell)):
        cols = slice(chunk * cell, min((chunk + 1) * cell, k))
        acc = acc + (a32[:, cols] @ b32[:, cols].T) * per_row[:, chunk]
    if a_outer is not None:
        acc = acc * a_outer.to(torch.float32).reshape(-1, 1)
    return acc.to(out_dtype)


def check_tile_operands(where: str, a, b, cells, cell, a_outer, out_dtype) -> tuple[int, int, int]:
    """(M, N, K) of valid operands, else a one-line ValueError naming the argument and the fix."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
            raise ValueError(f"{where}: {name} must be a 2D float tensor [rows, K], got {_describe(t)}")
    (m, k), (n, k_b) = a.shape, b.shape
    if k != k_b:
        raise ValueError(f"{where}: a is [M, K={k}] and b is [N, K={k_b}]; both must run along the same K (out = a @ b^T)")
    if not isinstance(cell, int) or cell <= 0:
        raise ValueError(f"{where}: cell={cell!r} must be a positive whole number (the CTA tile's side)")
    want = (math.ceil(n / cell), math.ceil(k / cell))
    if not isinstance(cells, torch.Tensor) or tuple(cells.shape) != want:
        raise ValueError(f"{where}: cells must be one scale per {cell} x {cell} square of b, shape {list(want)}, got {_describe(cells)}")
    if a_outer is not None and (not isinstance(a_outer, torch.Tensor) or a_outer.numel() not in (1, m)):
        raise ValueError(f"{where}: a_outer must be None, one scale, or one per row of a ({m}), got {_describe(a_outer)}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: out_dtype={out_dtype} is not supported; allowed: torch.float32, torch.bfloat16")
    devices = {t.device for t in (a, b, cells, a_outer) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{where}: operands on {sorted(map(str, devices))}; put a, b, cells and a_outer on one device")
    return m, n, k


def _describe(t) -> str:
    return f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
