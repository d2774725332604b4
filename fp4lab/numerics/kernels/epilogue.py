"""The epilogue of an emulated NVFP4 GEMM as one kernel: the fp32 accumulator times alpha, rounded once.

Reference (`fp4lab.numerics.epilogue.scale_result_reference`, what `nn.gemm.tensor_core_mm` runs off the GPU):

    alpha = a_outer * b_outer            # fp32; either may be absent, 0-dim, or one per row / column
    out = (acc * alpha).to(out_dtype)

Torch runs that as two passes (a broadcast multiply that writes fp32, then a cast): 14 bytes moved per
element, and the multiply by a 0-dim CUDA tensor is not vectorised. This kernel reads the accumulator
once and writes `out_dtype` once (6 bytes for bf16; in place for fp32), with the same two float32
roundings in the same order (compiled without FMA contraction), so its output equals the reference's
bit for bit. Import lazily, after `fp4lab.numerics.kernels.runs_on(device)`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NONE, _SCALAR, _VECTOR = 0, 1, 2
# [rows, cols] of the accumulator per program, warps: copy-like, 16-byte fp32 loads per thread.
_TILE = (16, 256, 4)
_OUT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _scale_kernel(
    acc_ptr, out_ptr, a_ptr, b_ptr, M, N,
    A_MODE: tl.constexpr, B_MODE: tl.constexpr, OUT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    acc = tl.load(acc_ptr + offsets, mask=mask, other=0.0)
    if A_MODE == 1:
        a = tl.load(a_ptr)
    elif A_MODE == 2:
        a = tl.load(a_ptr + rows, mask=rows < M, other=0.0)[:, None]
    if B_MODE == 1:
        b = tl.load(b_ptr)
    elif B_MODE == 2:
        b = tl.load(b_ptr + cols, mask=cols < N, other=0.0)[None, :]
    if A_MODE == 0:
        alpha = b
    elif B_MODE == 0:
        alpha = a
    else:
        alpha = a * b
    tl.store(out_ptr + offsets, (acc * alpha).to(OUT), mask=mask)


def _mode(outer: torch.Tensor | None, length: int, what: str) -> int:
    if outer is None:
        return _NONE
    if outer.numel() == 1:  # 0-dim, or one row or column: the same product either way
        return _SCALAR
    if outer.numel() != length:
        raise ValueError(f"scale_result: {what} holds {outer.numel()} scales where 1 or {length} were expected")
    return _VECTOR


def scale_result(acc: torch.Tensor, a_outer: torch.Tensor | None, b_outer: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """`(acc * (a_outer * b_outer)).to(out_dtype)` in one pass over the [M, N] fp32 accumulator.

    a_outer: None, 0-dim, or one fp32 scale per row of acc ([M] or [M, 1]); b_outer: None, 0-dim, or
    one per column ([N] or [1, N]); at least one is given. With out_dtype=float32 the result is
    written into acc."""
    if acc.dtype != torch.float32 or acc.dim() != 2 or not acc.is_contiguous():
        raise ValueError(f"scale_result: acc must be a contiguous 2D float32 tensor, got {acc.dtype} {tuple(acc.shape)}")
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"scale_result: out_dtype {out_dtype} is not one of {sorted(map(str, _OUT_DTYPES))}")
    m, n = acc.shape
    a_mode, b_mode = _mode(a_outer, m, "a_outer"), _mode(b_outer, n, "b_outer")
    if a_mode == b_mode == _NONE:
        raise ValueError("scale_result: give a_outer, b_outer or both (nothing to scale by)")
    out = acc if out_dtype == torch.float32 else torch.empty_like(acc, dtype=out_dtype)
    a = a_outer.reshape(-1).to(torch.float32).contiguous() if a_outer is not None else acc
    b = b_outer.reshape(-1).to(torch.float32).contiguous() if b_outer is not None else acc
    bm, bn, warps = _TILE
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _scale_kernel[grid](acc, out, a, b, m, n, a_mode, b_mode, _OUT_DTYPES[out_dtype], bm, bn,
                        num_warps=warps, enable_fp_fusion=False)
    return out
