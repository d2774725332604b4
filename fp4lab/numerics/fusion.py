"""Format-aware producer fusion, the torch reference (Format-Aware Fusion, section 3).

A producer is the op that makes a GEMM's input. Fusing it with the FP4 quantizer removes the HBM
round trip of its bf16/fp32 output only when the fused kernel emits everything the next GEMMs read
(section 3.1): the block values (or packed codes and scale bytes) of every orientation they contract
along, the outer scale, and the exact values that autograd keeps. Three producers of a Llama block:

- `swiglu_quantize_reference`: h = silu(gate) * up, quantized as W2's Fprop x operand (along the
  hidden dim) and optionally as its Wgrad operand h^T (along the tokens).
- `residual_rmsnorm_quantize_reference`: s = x + residual (the new residual stream), n = rmsnorm(s)
  * weight, with the row statistic rstd (what RMSNorm's backward needs) and n quantized along the
  last dim (the x operand shared by wq/wk/wv or w1/w3), optionally n^T for their Wgrad.
- `swiglu_backward_reference`: d_gate, d_up from grad_h = dY @ W2 (the Dgrad GEMM's output), gate
  and up, optionally quantized as w1's / w3's Dgrad operands (along the hidden dim) and Wgrad
  operands (d^T, along the tokens).

Each function here is what `fp4lab.numerics.kernels.fusion` computes bit for bit, and is itself the
unfused composition of fp4lab's ops (tests/kernels/test_triton_fusion.py checks both):

    swiglu: F.silu(gate) * up in the inputs' dtype, exactly FeedForward's expression (under bf16
        autocast w1 and w3 return bf16 and neither silu nor * is an autocast op, so both round to
        bf16), then `quantize` of h.float();
    backward: what autograd computes for that expression (MulBackward, then aten.silu_backward);
    rmsnorm: nn.RMSNorm's formula `(s32 * rsqrt(mean(s32^2) + eps)).type_as(s) * weight`, with the
        mean and the rsqrt pinned down. torch leaves both to the device (a CPU cascade sum or a CUDA
        tree, a division by D or a multiplication by 1/D, 1/sqrt or the approximate rsqrtf), so no
        kernel can match nn.RMSNorm on every device. Here the squares are summed in lanes: lane j of
        RMSNORM_SUM_LANES (32) adds columns j, j + 32, j + 64, ... left to right (what a kernel
        streaming the row in 32-wide chunks does with elementwise adds), then the 32 lane sums are
        added by halving (t[:, :16] + t[:, 16:], and so on); the total is divided by D, and
        rstd = 1 / sqrt(mean + eps), each a correctly rounded float32 operation. The result is within
        a few float32 ulps of nn.RMSNorm's (tested on the CPU, and on CUDA by the cuda tests); the
        wiring that uses these kernels must use this formula for its unfused path too.

Encodings are `OperandEncoding`s: the bf16 block values a tensor-core GEMM reads (`fake_quantize_
factored(...).values`, exact in bf16), NVFP4's outer scale, and `quantize(...)`'s packed codes and
scale bytes, all from one `quantize` call (so SR draws once). Options are `quantize`'s (fmt,
scale_mode, adaptive, rounding, generator) plus `signs`, a Hadamard sign vector applied along the
quantized dim first, as the FP4 linear's transforms are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fp4lab.numerics.hadamard import hadamard
from fp4lab.numerics.quantize import quantize

ACTIVATION_DTYPES = (torch.bfloat16, torch.float32)
RMSNORM_MAX_WIDTH = 16384  # the fused kernel holds an RMSNorm row in registers, padded to a power of two
RMSNORM_SUM_LANES = 32  # the sum of squares' lanes (the module docstring: the order it pins down)


@dataclass(frozen=True)
class OperandEncoding:
    """One quantized GEMM operand (the fields of triton_quantize.FusedQuant, always all four).

    values: bf16 E2M1 values times their block scale; outer: NVFP4's decode scale 1 / S_enc (0-dim
    fp32), None for MXFP4; codes: packed E2M1 codes (uint8, element 2i in the low nibble); scales:
    E8M0 / E4M3 scale bytes, one per block."""

    values: torch.Tensor
    outer: torch.Tensor | None
    codes: torch.Tensor
    scales: torch.Tensor


@dataclass(frozen=True)
class SwigluOutput:
    h: torch.Tensor  # silu(gate) * up, the inputs' dtype
    row: OperandEncoding  # h quantized along the hidden dim: W2's Fprop x operand
    col: OperandEncoding | None  # h^T quantized along the tokens: W2's Wgrad x operand


@dataclass(frozen=True)
class RmsnormOutput:
    residual: torch.Tensor  # s = x + residual, the new residual stream
    rstd: torch.Tensor  # float32 [rows]: 1 / sqrt(mean(s^2) + eps), kept for RMSNorm's backward
    normed: torch.Tensor  # n = (s * rstd) * weight
    row: OperandEncoding  # n quantized along the last dim: the next GEMMs' Fprop x operand
    col: OperandEncoding | None  # n^T quantized along the tokens: their Wgrad x operand


@dataclass(frozen=True)
class SwigluGrads:
    d_gate: torch.Tensor  # gradient of w1's output, the inputs' dtype
    d_up: torch.Tensor  # gradient of w3's output
    # Optional encodings: [d_gate, d_up] each quantized along the hidden dim (Dgrad's dY of w1 / w3)
    # and, transposed, along the tokens (Wgrad's dY^T).
    gate_row: OperandEncoding | None = None
    up_row: OperandEncoding | None = None
    gate_col: OperandEncoding | None = None
    up_col: OperandEncoding | None = None


def encode_reference(
    t: torch.Tensor, fmt: str, *, transpose: bool = False, signs: torch.Tensor | None = None, **options
) -> OperandEncoding:
    """`t.float()` (or its transpose) quantized along its last dim, after the optional Hadamard
    transform: the encoding triton_quantize.quantize_fused writes for the same options."""
    y = t.float().T.contiguous() if transpose else t.float()
    if signs is not None:
        y = hadamard(y, signs.numel(), signs)
    q = quantize(y, fmt, **options)
    parts = q.factored()  # the bits of fake_quantize_factored(y, ...) without a second SR draw
    return OperandEncoding(parts.values.to(torch.bfloat16), parts.outer, q.data, q.scales)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """FeedForward's gated activation, as it computes it: silu(gate) rounded to the dtype, times up."""
    _check_pair("swiglu", gate, up)
    return F.silu(gate) * up


def swiglu_quantize_reference(
    gate: torch.Tensor, up: torch.Tensor, fmt: str, *, col: dict | None = None, **options
) -> SwigluOutput:
    """h = silu(gate) * up and its encoding along the last dim (W2's Fprop x operand); with `col` (a
    dict of `encode_reference` options, fmt included) also h^T's (W2's Wgrad x operand).

    gate, up: [tokens, hidden], both bf16 (the fast path: w1 / w3 under autocast) or both fp32."""
    h = swiglu(gate, up)
    row = encode_reference(h, fmt, **options)
    return SwigluOutput(h, row, encode_reference(h, transpose=True, **col) if col is not None else None)


def rmsnorm_reference(s: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, rstd): nn.RMSNorm's formula over the last dim of a 2D s with the mean of squares summed in
    a fixed order (in 32 lanes, then by halving) and every step correctly rounded (see the module
    docstring). rstd is float32 [rows]."""
    if s.dim() != 2 or s.shape[1] == 0:
        raise ValueError(f"rmsnorm_reference: s must be 2D with a non-empty last dim, got shape {list(s.shape)}")
    s32 = s.float()
    width = s32.shape[1]
    padded = width + -width % RMSNORM_SUM_LANES
    chunks = F.pad(s32 * s32, (0, padded - width)).view(s32.shape[0], padded // RMSNORM_SUM_LANES, RMSNORM_SUM_LANES)
    t = chunks[:, 0]
    for chunk in range(1, chunks.shape[1]):  # lane j: columns j, j + 32, ... left to right
        t = t + chunks[:, chunk]
    while t.shape[1] > 1:  # then the lanes by halving: lane i adds lane i + w/2, as the kernel's tree does
        half = t.shape[1] // 2
        t = t[:, :half] + t[:, half:]
    # Tensor divisors: CUDA divides by a Python scalar as a multiplication by its reciprocal.
    mean = t[:, 0] / torch.full_like(t[:, 0], width)
    # torch's float32 sqrt on the CPU is not correctly rounded (its vectorized one differs from IEEE
    # sqrt in about 1 of 5 results); the float64 root rounded to float32 is (53 >= 2 * 24 + 2 bits).
    root = torch.sqrt((mean + torch.full_like(mean, eps)).double()).float()
    rstd = torch.ones_like(root) / root
    return (s32 * rstd[:, None]).to(s.dtype) * weight, rstd


def rmsnorm_backward(
    s: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, grad_normed: torch.Tensor, grad_s: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ds, dweight) of n = rmsnorm(s) * weight (`rmsnorm_reference`) and of the residual stream s
    itself, in float32: ds = grad_s + rstd (dt - t mean(dt t)) with t = s rstd, dt = dn weight, and
    dweight = sum over rows of dn t (t rounded to s's dtype first, as the forward rounds it).

    s: [rows, dim]; rstd: float32 [rows]; grad_normed: [rows, dim]; grad_s: [rows, dim] or None (no
    gradient reached s but through n). ds is float32, dweight in weight's dtype. Pure tensor ops, so
    `torch.compile` can make one or two kernels of it (the fused norm's backward on CUDA)."""
    t = s.float() * rstd[:, None]
    grad_weight = (grad_normed.float() * t.to(s.dtype).float()).sum(0).to(weight.dtype)
    dt = (grad_normed * weight).float()
    ds = rstd[:, None] * (dt - t * (dt * t).sum(-1, keepdim=True) / s.shape[-1])
    return (ds if grad_s is None else grad_s.float() + ds), grad_weight


def residual_rmsnorm_quantize_reference(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    fmt: str,
    *,
    col: dict | None = None,
    **options,
) -> RmsnormOutput:
    """s = x + residual (as `h = x + branch(...)` adds them: fp32 + bf16 gives fp32), n = rmsnorm(s) *
    weight, and n's encoding along the last dim; with `col`, also n^T's (along the tokens).

    x, residual: [tokens, dim], bf16 or fp32 each; weight: [dim], bf16 or fp32."""
    if x.shape != residual.shape or x.dim() != 2:
        raise ValueError(f"residual_rmsnorm_quantize_reference: x {list(x.shape)} and residual {list(residual.shape)} must be one 2D shape")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"residual_rmsnorm_quantize_reference: weight must have shape [{x.shape[1]}], got {list(weight.shape)}")
    s = x + residual
    n, rstd = rmsnorm_reference(s, weight, eps)
    row = encode_reference(n, fmt, **options)
    return RmsnormOutput(s, rstd, n, row, encode_reference(n, transpose=True, **col) if col is not None else None)


def swiglu_backward_reference(
    grad_h: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    row: dict | None = None,
    col: dict | None = None,
) -> SwigluGrads:
    """The gradients of h = silu(gate) * up, as autograd computes them for FeedForward:

        d_up   = grad_h * silu(gate)                       (silu(gate) in the dtype, as saved)
        d_gate = silu_backward(grad_h * up, gate)          (grad_h * up rounded to the dtype first)

    with silu_backward(t, g) = t * sig * (1 + g * (1 - sig)), sig = 1 / (1 + exp(-g)) in float32,
    one rounding to the dtype at the end. `row` / `col`: `encode_reference` options (fmt included)
    for d_gate and d_up along the hidden dim (w1's and w3's Dgrad dY) and along the tokens (Wgrad dY^T).

    The fused boundary: the kernel reads grad_h, gate and up once and writes d_gate and d_up (and the
    encodings), where autograd's unfused ops read five tensors and write three (silu recomputed,
    grad_h * up written and read again), and each quantization reads its input once more (twice for
    NVFP4's amax). Fusing further, into the Dgrad GEMM's epilogue, would save grad_h's write and read
    too, but needs a GEMM kernel of our own; this boundary needs none.
    """
    _check_pair("swiglu_backward_reference", gate, up)
    if grad_h.shape != gate.shape or grad_h.dtype != gate.dtype:
        raise ValueError(f"swiglu_backward_reference: grad_h must match gate's shape and dtype, got {grad_h.dtype} {list(grad_h.shape)}")
    d_up = grad_h * F.silu(gate)
    d_gate = torch.ops.aten.silu_backward(grad_h * up, gate)
    encodings = {}
    for name, tensor in (("gate", d_gate), ("up", d_up)):
        if row is not None:
            encodings[f"{name}_row"] = encode_reference(tensor, **row)
        if col is not None:
            encodings[f"{name}_col"] = encode_reference(tensor, transpose=True, **col)
    return SwigluGrads(d_gate, d_up, **encodings)


def _check_pair(name: str, gate: torch.Tensor, up: torch.Tensor) -> None:
    if not (isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor)):
        raise ValueError(f"{name}: gate and up must be torch.Tensors")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2:
        raise ValueError(f"{name}: gate {gate.dtype} {list(gate.shape)} and up {up.dtype} {list(up.shape)} must be one 2D shape and dtype")
    if gate.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"{name}: dtype {gate.dtype} is not supported; allowed: torch.bfloat16, torch.float32")
