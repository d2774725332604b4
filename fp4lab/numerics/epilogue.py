"""The epilogue of an emulated NVFP4 (or FP8) GEMM: the fp32 accumulator times the outer scales,
rounded once. `kernels.epilogue.scale_result` is this in one pass, bit for bit. And the bf16 GEMM with
an fp32 result that such an epilogue follows (`bf16_matmul_fp32`)."""

from __future__ import annotations

import torch


def outer_scale_product(a_outer: torch.Tensor | None, b_outer: torch.Tensor | None) -> torch.Tensor | None:
    """The epilogue scale: a 0-dim product of two tensor scales, or per-row a [M, 1] by per-row b [1, N]."""
    if b_outer is not None and b_outer.dim():
        b_outer = b_outer.reshape(1, -1)
    if a_outer is None or b_outer is None:
        return b_outer if a_outer is None else a_outer
    return a_outer * b_outer


def scale_result_reference(acc: torch.Tensor, a_outer: torch.Tensor | None, b_outer: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """acc [M, N] (fp32) times alpha = a_outer * b_outer (each None, 0-dim, or one per row of its
    operand), then one rounding to `out_dtype`: two float32 roundings in this order."""
    alpha = outer_scale_product(a_outer, b_outer)
    return (acc if alpha is None else acc * alpha).to(out_dtype)


def bf16_matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 tensors ([..., m, k] @ [..., k, n]) with fp32 accumulation and an fp32 result: on
    CUDA bf16 tensor cores (`torch.bmm(..., out_dtype=torch.float32)`); elsewhere (the Triton
    interpreter's tests) an fp32 GEMM of the same exact products (bf16 x bf16 is exact in fp32)."""
    if not a.is_cuda:
        return a.float() @ b.float()
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
    return out.view(*a.shape[:-1], b.shape[-1])
