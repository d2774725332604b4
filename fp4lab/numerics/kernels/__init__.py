"""fp4lab's Triton kernels, each in a module named as the torch reference it must equal:

    kernels.quantize   numerics.quantize     fused MXFP4 / NVFP4 quantizers, codes-only output, fused decode
    kernels.fp8        numerics.fp8          fused FP8 quantizer (current scaling)
    kernels.hadamard   numerics.hadamard     the full-dimension Hadamard transform (hadamard_full) in one pass
    kernels.fusion     numerics.fusion       SwiGLU / residual + RMSNorm producers emitting GEMM operands
    kernels.mx_gemm    numerics.mx_gemm      MXFP4 x MXFP4 GEMM on FP8 tensor cores
    kernels.tile_gemm  numerics.tile_gemm    chunk-scaled GEMM of 2D CTA-local weights
    kernels.epilogue   numerics.epilogue     one-pass NVFP4 GEMM epilogue (outer scales)
    kernels.attention  numerics.attention    flash attention that also returns each head's max logit and entropy

This package itself is torch-only: fp4lab never imports Triton at import time, so CPU runs and
`fp4lab --help` stay fast and work without it. `runs_on(device)` is the one question "can the kernels
run on tensors there"; callers import a kernel module only after it says yes. What the quantizers
take is said here, torch-only (`quantizer_covers`), so it can be asked without importing Triton;
the GEMM kernels check their operands themselves (`numerics.mx_gemm.check_operands`,
`numerics.tile_gemm.check_tile_operands`). Elsewhere the torch reference runs. `fake_quantize`,
`encode` and `decode` answer that choice in one place for callers outside the linear layers (Muon's
and AdamW's NVFP4 states): the fused kernel where it runs, else the reference, the same bits.
"""

from __future__ import annotations

import importlib.util
import os
from functools import cache

import torch

# Imported under other names: a kernel module's name here (hadamard, quantize, ...) would shadow it.
from fp4lab.numerics.hadamard import hadamard as reference_hadamard
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.quantize import BLOCK_SIZE
from fp4lab.numerics.quantize import fake_quantize as reference_fake_quantize
from fp4lab.numerics.quantize import quantize as reference_quantize


# A constant to torch.compile: traced instead, the cached check would run again in every graph (and warn).
@torch.compiler.assume_constant_result
def _cuda_with_triton() -> bool:
    return _cuda_and_triton_importable()


@cache
def _cuda_and_triton_importable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def runs_on(device: torch.device) -> bool:
    """Whether fp4lab's Triton kernels can run on tensors on `device`: a CUDA device with Triton, or
    the CPU under Triton's interpreter (TRITON_INTERPRET=1, read when a kernel module is imported)."""
    if device.type == "cuda":
        return _cuda_with_triton()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton") is not None


def quantizer_covers(spec) -> bool:
    """Whether the fused quantizer (kernels.quantize) takes an operand spec (any object with
    nn.recipe.OperandSpec's format, transform_size, tile, rounding and transform): MXFP4, NVFP4 and
    CTA-local NVFP4, no transform or a 16 / 32 blockwise one; 2D tiles with no transform and sides
    that are powers of two."""
    if spec.format not in ("mxfp4", "nvfp4", "nvfp4_cta") or spec.transform_size not in (0, 16, 32):
        return False
    if spec.tile is None:
        return True
    return spec.transform == "none" and all(side & (side - 1) == 0 for side in spec.tile)


def fake_quantize(x: torch.Tensor, fmt: str, **options) -> torch.Tensor:
    """`numerics.fake_quantize(x, fmt, **options)` bit for bit (round to nearest, along the last dim):
    by the fused quantizer, one amax read and one pass, where the kernels run on x's device, else by
    that torch reference. `options` are those both take (cta_tile, scale_mode)."""
    if runs_on(x.device):
        from fp4lab.numerics.kernels.quantize import quantize_fused

        return quantize_fused(x.reshape(-1, x.shape[-1]), fmt=fmt, **options).dequantize().view(x.shape)
    return reference_fake_quantize(x, fmt, **options)


def encode(x: torch.Tensor, fmt: str, *, signs: torch.Tensor | None = None, tensor_amax: torch.Tensor | None = None) -> QTensor:
    """`numerics.quantize(y, fmt, tensor_amax=tensor_amax)` bit for bit, y = `hadamard(x, len(signs),
    signs)` (x itself without signs), round to nearest along the last dim, fmt "mxfp4" or "nvfp4": by
    the fused quantizer where the kernels run on x's device (an amax read, then one pass writing only
    codes and scales), else by that torch reference. tensor_amax (nvfp4): a finite float32 amax >= 0
    on x's device, not checked on the fused path."""
    if runs_on(x.device) and x.numel() and fmt in ("mxfp4", "nvfp4"):
        from fp4lab.numerics.kernels.quantize import quantize_fused

        q = quantize_fused(x.reshape(-1, x.shape[-1]).contiguous(), fmt=fmt, signs=signs, tensor_amax=tensor_amax,
                           emit_codes=True, emit_values=False)
        lead = x.shape[:-1]
        return QTensor(q.codes.view(*lead, -1), q.scales.view(*lead, -1), q.outer, fmt, x.shape, BLOCK_SIZE[fmt])
    y = x if signs is None else reference_hadamard(x, signs.numel(), signs)
    return reference_quantize(y, fmt, tensor_amax=tensor_amax)


def decode(q: QTensor) -> torch.Tensor:
    """`q.dequantize()` (float32) bit for bit: by the fused decode where the kernels run on q's device
    (1D blocks of mxfp4 or nvfp4), else by QTensor itself."""
    if runs_on(q.data.device) and q.data.numel() and q.tile is None and q.fmt in ("mxfp4", "nvfp4"):
        from fp4lab.numerics.kernels.quantize import decode_fused

        cols = q.shape[-1]
        values = decode_fused(q.data.reshape(-1, cols // 2).contiguous(), q.scales.reshape(-1, cols // q.block_size).contiguous(),
                              fmt=q.fmt, shape=(q.data.numel() * 2 // cols, cols), out_dtype=torch.float32).view(q.shape)
        return values if q.fmt == "mxfp4" else values * q.tensor_scale
    return q.dequantize()
