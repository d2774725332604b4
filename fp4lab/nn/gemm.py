"""The GEMM backends of FP4Linear's tensor-core path: a @ b^T of two `nn.operands` operands.

`tensor_core_mm`: bf16 tensor cores with fp32 accumulation and the outer scales in the epilogue
(`numerics.epilogue`, on CUDA one fused kernel); `tile_scaled_mm`: the chunk-scaled GEMM of a weight in
2D CTA-local tiles (`numerics.tile_gemm`); `fp8_tensor_core_mm`: MXFP4 x MXFP4 on FP8 tensor cores
(`numerics.mx_gemm`), for operands `fp8_gemm_operands` finds in MXFP4 encodings along K; `fp8_scaled_mm`:
FP8 x FP8 on FP8 tensor cores (`torch._scaled_mm`, cuBLAS), for FP8 recipes whose operands the quantizers
made as float8 codes (`fp8_codes_fit`). Each runs its kernel where it runs, else the torch reference of the
same sums.
"""

from __future__ import annotations

import functools

import torch

from fp4lab.nn.operands import FP8_CODES, GemmOperand, PackedOperand, packed_form
from fp4lab.numerics.epilogue import scale_result_reference
from fp4lab.numerics.kernels import runs_on
from fp4lab.numerics.mx_gemm import OUT_DTYPES
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.tile_gemm import OUT_DTYPES as TILE_GEMM_OUT_DTYPES
from fp4lab.numerics.tile_gemm import tile_scaled_matmul_reference


def fp8_scaled_mm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, fast_accum: bool) -> torch.Tensor:
    """a @ b^T of two float8-coded operands on FP8 tensor cores, their outer scales (1 / scale: 0-dim or
    one per row) applied as torchao's float8 training applies them (torchao.float8.float8_ops
    `addmm_float8_unwrapped`, 0.18), so the same operands give its bits:

    - per-tensor scales, or per-row scales with `fast_accum`: one `torch._scaled_mm` whose epilogue
      scales the fp32 accumulator, then one rounding to `out_dtype` (per-row: to bf16, as cuBLAS's
      row-scaled kernel writes only bf16);
    - per-row scales without `fast_accum` (torchao finds the row-scaled kernel too slow without it):
      the per-tensor kernel with scales of 1, then times the fp32 outer product of the scales, in
      bf16 (two roundings, torchao's order) where bf16 is asked for, in fp32 (one) where fp32 is.

    `fast_accum`: cuBLAS's FP8 fast accumulation, which TransformerEngine and torchao use for Fprop
    and not for Dgrad and Wgrad (`FP4Linear.mm`). A GEMM of two E5M2 operands, which cuBLAS has no
    kernel for, runs on bf16 tensor cores instead (the values are exact in bf16)."""
    if a.values.dtype == b.values.dtype == torch.float8_e5m2:
        return tensor_core_mm(_as_bf16(a), _as_bf16(b), out_dtype)
    one = functools.partial(torch.ones, (), dtype=torch.float32, device=a.values.device)  # made only where needed
    sa = one() if a.outer is None else a.outer.reshape(()) if a.outer.numel() == 1 else a.outer.reshape(-1, 1)
    sb = one() if b.outer is None else b.outer.reshape(()) if b.outer.numel() == 1 else b.outer.reshape(1, -1)
    m, n = a.values.shape[0], b.values.shape[0]
    rowwise = sa.numel() > 1 or sb.numel() > 1
    if rowwise:  # both per row (cuBLAS takes no mix)
        sa, sb = sa.expand(m, 1).contiguous(), sb.expand(1, n).contiguous()
    a_codes, b_codes = a.values.contiguous(), b.values.contiguous().T  # row-major x column-major
    if not rowwise or (fast_accum and out_dtype == torch.bfloat16):
        written = out_dtype if not rowwise and out_dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
        out = torch._scaled_mm(a_codes, b_codes, scale_a=sa, scale_b=sb, out_dtype=written, use_fast_accum=fast_accum)
        return out.to(out_dtype)
    written = torch.float32 if out_dtype == torch.float32 else torch.bfloat16
    out = torch._scaled_mm(a_codes, b_codes, scale_a=one(), scale_b=one(), out_dtype=written, use_fast_accum=fast_accum)
    out *= sa * sb
    return out.to(out_dtype)


def _as_bf16(operand: GemmOperand) -> GemmOperand:
    """An operand of float8 codes as the bf16 values they are (exact), for bf16 tensor cores."""
    if operand.values.dtype not in FP8_CODES:
        return operand
    return GemmOperand(operand.values.to(torch.bfloat16), operand.outer, operand.packed, operand.outer_cell)


def fp8_gemm_operands(a: GemmOperand | PackedOperand, b: GemmOperand | PackedOperand) -> tuple[QTensor, QTensor] | None:
    """(A, B) for `mxfp4_matmul` when both operands carry MXFP4 encodings along K (the contraction
    dim, then a multiple of 32: whole blocks) that the kernel takes on their device, else None: the
    GEMM falls back to bf16 tensor cores."""
    packed_a, packed_b = packed_form(a), packed_form(b)
    if packed_a is None or packed_b is None:
        return None
    qa, qb = packed_a.along_k(), packed_b.along_k()
    if qa is None or qb is None:
        return None
    return (qa, qb) if runs_on(qa.data.device) and qa.data.device == qb.data.device else None


def fp8_tensor_core_mm(a: QTensor, b: QTensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T on FP8 tensor cores (`numerics.kernels.mx_gemm.mxfp4_matmul`): exact per 32-block, so
    the fp32 GEMM of the decoded operands up to fp32 summation order; one rounding to `out_dtype`
    (in the kernel for fp32 and bf16)."""
    from fp4lab.numerics.kernels import mx_gemm as triton_mx_gemm

    out = triton_mx_gemm.mxfp4_matmul(a, b, out_dtype if out_dtype in OUT_DTYPES else torch.float32)
    return out.to(out_dtype)


def tensor_core_mm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, fast_accum: bool = False) -> torch.Tensor:
    """a.values @ b.values^T with fp32 accumulation, times the outer scales, in `out_dtype`.

    bf16 x bf16 runs on bf16 tensor cores. Without outer scales the GEMM writes `out_dtype` itself
    (one rounding of the fp32 accumulator, as a bf16 linear does); with them it writes fp32
    (`torch.mm(..., out_dtype=torch.float32)`) and the result is multiplied by alpha = the product of
    the outer scales before its one rounding, as Blackwell's FP4 GEMMs apply alpha (on CUDA one fused
    pass, `numerics.kernels.epilogue`). Anything else, and every CPU GEMM, runs in fp32 on the upcast
    values, which computes the same exact products. A b whose outer scale is per square (a weight in
    2D CTA-local tiles) takes the chunk-scaled GEMM (`tile_scaled_mm`). Two operands of float8 codes
    take FP8 tensor cores (`fp8_scaled_mm`, with `fast_accum`); one meeting any other operand is used
    as its bf16 values."""
    if a.values.dtype in FP8_CODES and b.values.dtype in FP8_CODES:
        return fp8_scaled_mm(a, b, out_dtype, fast_accum)
    a, b = _as_bf16(a), _as_bf16(b)
    if b.outer_cell is not None:
        return tile_scaled_mm(a, b, out_dtype)
    if a.values.dtype == b.values.dtype == torch.bfloat16 and a.values.is_cuda:
        if a.outer is None and b.outer is None and out_dtype == torch.bfloat16:
            return torch.mm(a.values, b.values.T)
        out = torch.mm(a.values, b.values.T, out_dtype=torch.float32)
        if (a.outer is not None or b.outer is not None) and runs_on(a.values.device):
            from fp4lab.numerics.kernels.epilogue import scale_result

            return scale_result(out, a.outer, b.outer, out_dtype)
    else:
        out = a.values.to(torch.float32) @ b.values.to(torch.float32).T
    return scale_result_reference(out, a.outer, b.outer, out_dtype)


def tile_scaled_mm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b^T for b with one outer scale per square: each chunk of K between square boundaries summed
    on its own and scaled, then a's outer scale (`numerics.tile_gemm`); on bf16 tensor cores where
    Triton runs (`numerics.kernels.tile_gemm`), else the torch reference of the same sums."""
    if a.outer_cell is not None:
        raise ValueError("tile_scaled_mm: only b (the weight) may carry per-square outer scales; a is the activation or gradient")
    if a.outer is not None and a.outer.numel() not in (1, a.values.shape[0]):
        raise ValueError(f"tile_scaled_mm: a's outer scale must be one scale or one per row, got {list(a.outer.shape)}")
    kernel_dtype = out_dtype if out_dtype in TILE_GEMM_OUT_DTYPES else torch.float32
    args = (a.values, b.values, b.outer, b.outer_cell, a.outer, kernel_dtype)
    if a.values.dtype == b.values.dtype == torch.bfloat16 and runs_on(a.values.device):
        from fp4lab.numerics.kernels.tile_gemm import tile_scaled_matmul

        return tile_scaled_matmul(*args).to(out_dtype)
    return tile_scaled_matmul_reference(*args).to(out_dtype)
