"""Causal GQA flash attention in Triton that returns the two attention probes for free.

`flash_attention(q, k, v)` computes softmax(q k^T / sqrt(D) + causal mask) v tile by tile, never
materialising the [T, T] logits (the structure of Triton's "Fused Attention" tutorial), and while
its online softmax runs it also keeps, per query row i, the statistics that
`fp4lab.numerics.attention.max_attention_logits` and `attention_entropy` compute from chunks of fp32
logits. With s_ij = q_i.k_j / sqrt(D) over the causal keys j <= i:

    m_i  = max_j s_ij                              (kept as the running max of the raw q_i.k_j)
    l_i  = sum_j exp(s_ij - m_i)                   (the softmax denominator, rescaled as m_i grows)
    u_i  = sum_j exp(s_ij - m_i) (s_ij - m_i)      (<= 0; rescaled as u <- a (u + (m_old - m_new) l))
    LSE_i = m_i + log l_i
    H_i  = -sum_j p_ij log p_ij = log l_i - u_i / l_i     (p_ij = exp(s_ij - m_i) / l_i)

H_i is the usual m + log l - t / l with t = sum_j exp(s_ij - m_i) s_ij, written around the running
max: u = t - m l, so H needs no difference of two numbers of the size of the logits (with QK-Clip's
logits near 100, t / l and m would each carry ~1e-5 of rounding, more than the entropy's own error).
The kernel works in base 2 (exp2 of the logits times log2(e)) as the tutorial does; u and the LSE
are converted back to nats once per row.

Per head the wrapper then returns what the probes return:
    max_logits[h] = max over batch and rows of m_i      == max_attention_logits(q, k)
    entropy[h]    = mean over the first `probe_batch` sequences and all rows of H_i
                                                        ~= attention_entropy(q[:probe_batch], k[:probe_batch])
m_i is the max of the same fp32 dot products, divided once by sqrt(D) with correct rounding as the
probe's division is (fl(x / c) is monotonic in x, so the max commutes with it): the statistic equals
the probe's bit for bit whenever the two compute the dot products with the same roundings (always for
dyadic inputs whose partial sums are exact; otherwise within the summation-order error of one dot
product, about D * 2^-24 of sum_d |q_d k_d|). On CUDA the probe's `logits / sqrt(D)` is a
multiplication by the fp32 reciprocal (torch's scalar division there), one ulp away at most for D = 32
and 128 and exact for D = 16 and 64. The entropy sums in another order than the probe's log_softmax:
equal to a few fp32 ulps per row (tests/kernels/test_triton_attention.py states the tolerances).

Cost of the statistics: per logit one more multiply-add (p (s - m) into u), per tile two row sums
and per row three stores; the per-head reductions are torch ops over [B, H, T], not [B, H, T, T].

Backward: the flash-attention backward from the saved LSE (P recomputed per tile; dV = P^T dO,
dP = dO V^T, dS = P (dP - delta) with delta = rowsum(dO O), dQ = dS K / sqrt(D), dK = dS^T Q /
sqrt(D)). One program owns a block of keys of one KV head and loops over the query heads of its group,
so dK and dV are summed over the group without atomics. The statistics get no gradient.

Precision: logits, softmax, statistics and accumulators in fp32. bf16 inputs run bf16 tensor-core
GEMMs (P and dS rounded to bf16 before their GEMMs, as every flash attention does); fp32 inputs run
IEEE fp32 dots (no TF32), the reference configuration the CPU tests check.

`exp2_poly=True` replaces the MUFU ex2 (tl.exp2) of every probability (the per-row rescale factors of
the online softmax keep tl.exp2: their errors multiply once per key block) by Cody-Waite range reduction (x = n + f, n =
floor(x)) and a degree-3 minimax polynomial for 2^f on [0, 1) evaluated on the FMA units, the exponent
n added to the result's bits (FlashAttention-4 offloads part of its exponentials the same way). Its
relative error, measured over [-126, 0] in tests, is at most EXP2_POLY_MAX_REL_ERROR (8.6e-5): 45x
below bf16's half ulp (2^-9), so it is meant for bf16 inputs; arguments below -126 give 0 (as ex2.ftz
flushes). Default off: the default path keeps tl.exp2.

Wired into `fp4lab.nn.attention.Attention.forward` (`kernel="triton"`, unquantized attention), which
stores `max_logits` and `entropy` as the probes' `last_max_logits` and `last_entropy`.

Tile shapes on a GPU (`_GPU_TILES`) come from a sweep on an H200; under TRITON_INTERPRET=1 small tiles with BLOCK_M != BLOCK_N keep the CPU tests fast and cover
the diagonal tiles' masks. This module imports Triton: import it lazily, after
`fp4lab.numerics.kernels.runs_on(device)`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp4lab.numerics.kernels.quantize import _finite_row_amax, _fp32, _nvfp4_scales, _tile_block_values

HEAD_DIMS = (16, 32, 64, 128)
DTYPES = (torch.bfloat16, torch.float32)
# Measured in tests/kernels/test_triton_attention.py over [-126, 0] (8.57e-5 in fp32 Horner evaluation).
EXP2_POLY_MAX_REL_ERROR = 8.6e-5
# Triton's CPU interpreter runs these kernels on CPU tensors: the tests use it.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# (forward BLOCK_M, BLOCK_N, dK/dV BLOCK_M, BLOCK_N, dQ BLOCK_M, BLOCK_N, warps, pipeline stages)
# per head dim. Each forward / dQ BLOCK_M is a multiple of its BLOCK_N and each dK/dV BLOCK_N of its
# BLOCK_M: the diagonal region of a tile then splits into whole tiles of the other operand.
# Swept on an H200 (bf16, causal GQA, 16k tokens, sequences 1024 and 4096; docs/BENCHMARKS.md): 64 x 64
# tiles with 4 warps and 3 stages were the fastest forward at both head dims and the fastest
# backward at 64; at 128 the backward's dK/dV kernel prefers 32 query rows per step.
_GPU_TILES = {
    16: (64, 64, 64, 64, 64, 64, 4, 3),
    32: (64, 64, 64, 64, 64, 64, 4, 3),
    64: (64, 64, 64, 64, 64, 64, 4, 3),
    128: (64, 64, 32, 64, 64, 32, 4, 3),
}
_INTERPRETER_TILES = (32, 16, 16, 32, 32, 16, 4, 1)
# FP4 attention quantizes dS along keys in the dQ kernel's tiles and along queries in the dK/dV kernel's:
# both tile dims hold whole blocks of 32 (mxfp4) there. The GPU tiles already do.
_INTERPRETER_FP4_TILES = (32, 32, 32, 64, 64, 32, 4, 1)
FP4_DS_FORMATS = {"nvfp4": 1, "mxfp4": 2}

LN2 = tl.constexpr(math.log(2.0))
# The running max starts finite, so the first rescale multiplies l = 0 by a finite shift (not -inf).
NEG_FLT_MAX = tl.constexpr(-3.4028234663852886e38)
# 2^f ~= 1 + f (C1 + f (C2 + f C3)) on [0, 1): relative minimax fit with the constant term pinned to 1,
# so exp2(0) = 1 exactly (each row's max contributes exactly 1 to l).
EXP2_C1 = tl.constexpr(0.6951168179512024)
EXP2_C2 = tl.constexpr(0.22764484584331512)
EXP2_C3 = tl.constexpr(0.07706718146800995)


@dataclass(frozen=True)
class FlashAttentionOutput:
    """out: [B, H, T, D] in the input dtype, differentiable. lse: [B, H, T] fp32, log-sum-exp of each
    row's logits (nats). row_max_logits, row_entropy: [B, H, T] fp32, m_i and H_i per query row.
    max_logits: [H], S_max^h over the batch (the QK-Clip trigger). entropy: [H], the mean H_i over the
    first `probe_batch` sequences (all of them for None). Everything but `out` is detached."""

    out: torch.Tensor
    lse: torch.Tensor
    row_max_logits: torch.Tensor
    row_entropy: torch.Tensor
    max_logits: torch.Tensor
    entropy: torch.Tensor


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, probe_batch: int | None = None, exp2_poly: bool = False
) -> FlashAttentionOutput:
    """Causal GQA attention of q [B, H, T, D] over k, v [B, H_kv, T, D] with its per-head probes.

    H a multiple of H_kv (query head h reads KV head h // (H / H_kv)); D in HEAD_DIMS; bf16 or fp32;
    CUDA tensors (CPU ones under TRITON_INTERPRET=1). probe_batch limits the entropy to the first
    sequences, as `Attention.probe_batch` does; exp2_poly picks the polynomial exp2 (module docstring).
    """
    _check_inputs(q, k, v, probe_batch)
    out, lse2, row_max_logits, row_entropy = torch.ops.fp4lab.flash_attention_forward(q, k, v, exp2_poly)
    row_max_logits, row_entropy = row_max_logits.detach(), row_entropy.detach()
    return FlashAttentionOutput(
        out=out,
        lse=lse2.detach() * math.log(2.0),
        row_max_logits=row_max_logits,
        row_entropy=row_entropy,
        max_logits=row_max_logits.amax(dim=(0, 2)),
        entropy=row_entropy[:probe_batch].mean(dim=(0, 2)),
    )


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, probe_batch: int | None) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"flash_attention: {name} has shape {tuple(x.shape)}; pass [batch, heads, seq, head_dim]")
        if x.dtype not in DTYPES:
            raise ValueError(f"flash_attention: {name} is {x.dtype}; cast q, k, v to torch.bfloat16 or torch.float32")
    if k.shape != v.shape:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} and v {tuple(v.shape)} differ; pass both as [batch, kv_heads, seq, head_dim]")
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"flash_attention: q {tuple(q.shape)} and k {tuple(k.shape)} differ in batch, seq or head_dim; only the head counts may differ"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"flash_attention: q's {q.shape[1]} heads are not a multiple of k's {k.shape[1]}; make n_heads a multiple of n_kv_heads")
    if q.shape[3] not in HEAD_DIMS:
        raise ValueError(f"flash_attention: head_dim {q.shape[3]} is not supported; use one of {HEAD_DIMS} (or SDPA)")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"flash_attention: q, k, v are {q.dtype}, {k.dtype}, {v.dtype}; give them one dtype")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v are on {q.device}, {k.device}, {v.device}; put them on one device")
    if probe_batch is not None and probe_batch < 1:
        raise ValueError(f"flash_attention: probe_batch={probe_batch}; pass a positive count of sequences or None for all")
    if not (q.is_cuda or _INTERPRETED and q.device.type == "cpu"):
        raise ValueError(f"flash_attention: q, k, v are on {q.device}; move them to CUDA (CPU runs only under TRITON_INTERPRET=1)")


def _tiles(head_dim: int) -> tuple[int, ...]:
    return _INTERPRETER_TILES if _INTERPRETED else _GPU_TILES[head_dim]


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


# --- the kernels as torch operators ---------------------------------------------------------------
# Custom operators with fake (meta) implementations and a registered backward: torch.compile traces them
# into the model's graph as opaque calls (no graph break per attention layer, where a compiler.disable'd
# autograd.Function would cut every block in two), AOTAutograd finds the backward, and a CUDA graph
# captures their launches like any other kernel. Both allocate their outputs exactly as the fakes do.


def _forward_outputs(q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """out (q's dtype and strides), and the base-2 LSE, m_i / sqrt(D), H_i: fp32 [B, H, T]."""
    batch, n_heads, seq, _ = q.shape
    statistics = (torch.empty(batch, n_heads, seq, device=q.device, dtype=torch.float32) for _ in range(3))
    return torch.empty_like(q), *statistics


@torch.library.custom_op("fp4lab::flash_attention_forward", mutates_args=())
def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, exp2_poly: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """O, the base-2 LSE (what the backward reads), and the per-row max logit and entropy."""
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    batch, n_heads, seq, head_dim = q.shape
    block_m, block_n, _, _, _, _, warps, stages = _tiles(head_dim)
    out, lse2, row_max_logits, row_entropy = _forward_outputs(q)
    grid = (triton.cdiv(seq, block_m), batch * n_heads)
    _forward_kernel[grid](
        q, k, v, out, lse2, row_max_logits, row_entropy, None,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        n_heads, n_heads // k.shape[1], seq, _log2e_scale(head_dim), math.sqrt(head_dim),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q), POLY=exp2_poly, SCALED=False,
        num_warps=warps, num_stages=stages,
    )
    return out, lse2, row_max_logits, row_entropy


@_forward.register_fake
def _(q, k, v, exp2_poly):
    return _forward_outputs(_last_dim_contiguous(q))


@torch.library.custom_op("fp4lab::flash_attention_backward", mutates_args=())
def _backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse2: torch.Tensor, exp2_poly: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (in q's, k's, v's dtype and strides) from dO and the forward's O and base-2 LSE."""
    q, k, v, grad_out = (_last_dim_contiguous(x) for x in (q, k, v, grad_out))
    batch, n_heads, seq, head_dim = q.shape
    n_kv_heads = k.shape[1]
    _, _, block_m1, block_n1, block_m2, block_n2, warps, stages = _tiles(head_dim)
    delta = torch.empty_like(lse2)
    _delta_kernel[(triton.cdiv(seq, block_m2), batch * n_heads)](
        out, grad_out, delta, *out.stride()[:3], *grad_out.stride()[:3], n_heads, seq,
        HEAD_DIM=head_dim, BLOCK_M=block_m2,
    )
    grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    common = {
        "HEAD_DIM": head_dim, "PRECISION": _precision(q), "POLY": exp2_poly, "num_warps": warps, "num_stages": stages,
        "SCALED": False, "DS_FMT": 0, "DS_SR": False,
    }
    no_fp4 = (None, None, None, 0, 0, 0, 0, None, None)  # logit scale, sequence operand, dS seed and amaxes
    scales = (_log2e_scale(head_dim), 1.0 / math.sqrt(head_dim))
    _grad_kv_kernel[(triton.cdiv(seq, block_n1), batch * n_kv_heads)](
        q, k, v, grad_out, lse2, delta, grad_k, grad_v,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3],
        *grad_k.stride()[:3], *grad_v.stride()[:3],
        n_kv_heads, n_heads // n_kv_heads, seq, *scales, *no_fp4, BLOCK_M=block_m1, BLOCK_N=block_n1, **common,
    )
    _grad_q_kernel[(triton.cdiv(seq, block_m2), batch * n_heads)](
        q, k, v, grad_out, lse2, delta, grad_q,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *grad_out.stride()[:3], *grad_q.stride()[:3],
        n_heads, n_heads // n_kv_heads, seq, *scales, *no_fp4, BLOCK_M=block_m2, BLOCK_N=block_n2, **common,
    )
    return grad_q, grad_k, grad_v


@_backward.register_fake
def _(grad_out, q, k, v, out, lse2, exp2_poly):
    return tuple(torch.empty_like(_last_dim_contiguous(x)) for x in (q, k, v))


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v, exp2_poly = inputs
    out, lse2, _, _ = output
    ctx.save_for_backward(q, k, v, out, lse2)
    ctx.exp2_poly = exp2_poly


def _gradients(ctx, grad_out, _grad_lse2, _grad_row_max_logits, _grad_row_entropy):
    # The statistics are detached by flash_attention: their gradients are None or zeros, and ignored.
    q, k, v, out, lse2 = ctx.saved_tensors
    grad_q, grad_k, grad_v = torch.ops.fp4lab.flash_attention_backward(grad_out, q, k, v, out, lse2, ctx.exp2_poly)
    return grad_q, grad_k, grad_v, None


_forward.register_autograd(_gradients, setup_context=_save_for_backward)


# --- FP4 attention on the same kernels ------------------------------------------------------------
# Full-Stack FP4's attention (`fp4lab.nn.attention.fp4_attention`, whose chunked path is the reference)
# as flash attention: the forward kernel over the block values of Q and K quantized along head_dim, their
# outer scales folded into the logits' factor; the backward kernels quantize dS tile by tile, along keys
# in the dQ kernel and along queries in the dK/dV kernel, and multiply its block values by K and Q
# quantized along the sequence. The score matrix and dS never leave the chip. Custom operators, as the
# plain path's are: torch.compile keeps them opaque and Triton's own launcher runs the kernels.


@torch.library.custom_op("fp4lab::flash_fp4_forward", mutates_args=())
def flash_fp4_forward(
    q_values: torch.Tensor, k_values: torch.Tensor, v: torch.Tensor, logit_scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(O in fp32, the base-2 LSE) of causal GQA attention whose logits are (q_values . k_values)
    x logit_scale / sqrt(D): q_values [B, H, T, D], k_values [B, H_kv, T, D] the bf16 block values of
    Q and K quantized along head_dim, logit_scale the product of their NVFP4 outer scales (a 0-dim fp32
    tensor; None for MXFP4), v [B, H_kv, T, D] in bf16. P is rounded to bf16 for PV, fp32 accumulation."""
    batch, n_heads, seq, head_dim = q_values.shape
    block_m, block_n, _, _, _, _, warps, stages = _fp4_tiles(head_dim)
    out = torch.empty(q_values.shape, dtype=torch.float32, device=q_values.device)
    _, lse2, row_max_logits, row_entropy = _forward_outputs(q_values)
    _forward_kernel[(triton.cdiv(seq, block_m), batch * n_heads)](
        q_values, k_values, v, out, lse2, row_max_logits, row_entropy, logit_scale,
        *q_values.stride()[:3], *k_values.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        n_heads, n_heads // k_values.shape[1], seq, _log2e_scale(head_dim), math.sqrt(head_dim),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION="tf32", POLY=False, SCALED=logit_scale is not None,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out, lse2


@flash_fp4_forward.register_fake
def _(q_values, k_values, v, logit_scale):
    return torch.empty(q_values.shape, dtype=torch.float32, device=q_values.device), _forward_outputs(q_values)[1]


@torch.library.custom_op("fp4lab::flash_fp4_backward", mutates_args=())
def flash_fp4_backward(
    grad_out: torch.Tensor, q_values: torch.Tensor, k_values: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse2: torch.Tensor, logit_scale: torch.Tensor | None, q_seq_values: torch.Tensor, q_seq_outer: torch.Tensor | None,
    k_seq_values: torch.Tensor, k_seq_outer: torch.Tensor | None, fmt: str, seed_keys: torch.Tensor | None,
    seed_queries: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV (fp32) of `flash_fp4_forward`'s attention, Full-Stack FP4's backward: dV = P^T dO and
    dP = dO V^T in bf16 (dO rounded to bf16), dS = P (dP - delta) with delta = rowsum(dO O), then
    dQ = dS K / sqrt(D) with dS quantized along keys (fmt) times k_seq, and dK = dS^T Q / sqrt(D)
    with dS^T quantized along queries times q_seq, each GEMM's outer scales applied to its fp32
    result. q_seq, k_seq: Q and K quantized along the sequence, the values and outer scale (NVFP4's, or
    None) of the FusedQuant `quantize_fused(x.reshape(-1, D), transpose=True)` returns (bf16 block values
    [D, B H T]). seed_keys, seed_queries: SR's Philox seeds of dS along keys and along queries (int64 [1]
    tensors on the device), None for round to nearest. NVFP4 takes dS's tensor scales from a first pass
    over the tiles (`_grad_scores_amax_kernel`)."""
    batch, n_heads, seq, head_dim = q_values.shape
    n_kv_heads = k_values.shape[1]
    _, _, block_m1, block_n1, block_m2, block_n2, warps, stages = _fp4_tiles(head_dim)
    grad_out = grad_out.to(torch.bfloat16).contiguous()
    delta = torch.empty_like(lse2)
    _delta_kernel[(triton.cdiv(seq, block_m2), batch * n_heads)](
        out, grad_out, delta, *out.stride()[:3], *grad_out.stride()[:3], n_heads, seq,
        HEAD_DIM=head_dim, BLOCK_M=block_m2,
    )
    ds_fmt = FP4_DS_FORMATS[fmt]
    ds_amax = torch.zeros(2, dtype=torch.int32, device=q_values.device)  # along keys, along queries
    tensors = (q_values, k_values, v, grad_out)
    strides = [n for x in tensors[:3] for n in x.stride()[:3]] + list(grad_out.stride()[:3])
    group = n_heads // n_kv_heads
    # exact quantization of dS (no multiply-add contracted: the fused quantizer's rule) and the same dS
    # in the amax pass as in the kernels that quantize it
    launch = {"num_warps": warps, "num_stages": stages, "enable_fp_fusion": False}
    if ds_fmt == 1:
        _grad_scores_amax_kernel[(triton.cdiv(seq, block_m2), batch * n_heads)](
            *tensors[:3], grad_out, lse2, delta, logit_scale, ds_amax, *strides, n_heads, group, seq,
            _log2e_scale(head_dim), HEAD_DIM=head_dim, BLOCK_M=block_m2, BLOCK_N=block_n2, POLY=False, **launch,
        )  # fmt: skip
    grad_q = torch.empty(q_values.shape, dtype=torch.float32, device=q_values.device)
    grad_k = torch.empty(k_values.shape, dtype=torch.float32, device=q_values.device)
    grad_v = torch.empty_like(grad_k)
    fp4 = {"HEAD_DIM": head_dim, "PRECISION": "tf32", "POLY": False, "SCALED": logit_scale is not None,
           "DS_FMT": ds_fmt, "DS_SR": seed_keys is not None}  # fmt: skip
    scales = (_log2e_scale(head_dim), 1.0 / math.sqrt(head_dim))
    _grad_kv_kernel[(triton.cdiv(seq, block_n1), batch * n_kv_heads)](
        *tensors, lse2, delta, grad_k, grad_v, *strides, *grad_k.stride()[:3], *grad_v.stride()[:3],
        n_kv_heads, group, seq, *scales, logit_scale, q_seq_values, q_seq_outer,
        *_sequence_strides(batch, n_heads, seq), seed_queries, ds_amax,
        BLOCK_M=block_m1, BLOCK_N=block_n1, **fp4, **launch,
    )  # fmt: skip
    _grad_q_kernel[(triton.cdiv(seq, block_m2), batch * n_heads)](
        *tensors, lse2, delta, grad_q, *strides, *grad_q.stride()[:3],
        n_heads, group, seq, *scales, logit_scale, k_seq_values, k_seq_outer,
        *_sequence_strides(batch, n_kv_heads, seq), seed_keys, ds_amax,
        BLOCK_M=block_m2, BLOCK_N=block_n2, **fp4, **launch,
    )  # fmt: skip
    return grad_q, grad_k, grad_v


@flash_fp4_backward.register_fake
def _(grad_out, q_values, k_values, v, out, lse2, logit_scale, q_seq_values, q_seq_outer, k_seq_values, k_seq_outer,
      fmt, seed_keys, seed_queries):  # fmt: skip
    grad_k = torch.empty(k_values.shape, dtype=torch.float32, device=k_values.device)
    return torch.empty(q_values.shape, dtype=torch.float32, device=q_values.device), grad_k, torch.empty_like(grad_k)


def _sequence_strides(batch: int, n_heads: int, seq: int) -> tuple[int, int, int, int]:
    """Strides (batch, head, t, d) of a sequence-blocked operand's [D, B H T] values read as [B, H, T, D]."""
    return n_heads * seq, seq, 1, batch * n_heads * seq


def _fp4_tiles(head_dim: int) -> tuple[int, ...]:
    tiles = _INTERPRETER_FP4_TILES if _INTERPRETED else _GPU_TILES[head_dim]
    _, _, block_m1, _, _, block_n2, _, _ = tiles
    assert block_m1 % 32 == 0 and block_n2 % 32 == 0, "dS's quantized tile dims must hold whole FP4 blocks"
    return tiles


def _log2e_scale(head_dim: int) -> float:
    """The factor from raw q.k to base-2 logits: log2(e) / sqrt(D)."""
    return math.log2(math.e) / math.sqrt(head_dim)


def _precision(x: torch.Tensor) -> str:
    # fp32 dots in IEEE fp32; Triton's default for fp32 is TF32 (10-bit mantissas). bf16 ignores it.
    return "ieee" if x.dtype == torch.float32 else "tf32"


# --- kernels ------------------------------------------------------------------------------------


@triton.jit
def _exp2_poly(x):
    """2^x on the FMA units: 2^floor(x) * p(x - floor(x)), the exponent added to p's bits; 0 below -126."""
    clamped = tl.maximum(x, -127.0)
    whole = tl.floor(clamped)
    frac = clamped - whole  # exact: the fractional bits of an fp32 number
    mantissa = 1.0 + frac * (EXP2_C1 + frac * (EXP2_C2 + frac * EXP2_C3))
    bits = mantissa.to(tl.int32, bitcast=True) + (whole.to(tl.int32) << 23)
    return tl.where(x < -126.0, 0.0, bits.to(tl.float32, bitcast=True))


@triton.jit
def _exp2(x, POLY: tl.constexpr):
    if POLY:
        y = _exp2_poly(x)
    else:
        y = tl.exp2(x)
    return y


@triton.jit
def _head(ptr, batch, head, stride_b, stride_h):
    """The start of one (batch, head) slice; int64, since batch * stride_b passes 2^31 at large shapes."""
    return ptr + batch.to(tl.int64) * stride_b + head * stride_h


@triton.jit
def _rows(base, rows, stride_t, dims):
    """Pointers to the [rows, dims] block of a slice whose rows are stride_t apart."""
    return base + rows[:, None] * stride_t + dims[None, :]


@triton.jit
def _forward_tiles(
    q, m, l, u, acc, k_base, v_base, stride_kt, stride_vt, rows, key_start, key_stop, seq, log2e_scale,
    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr, POLY: tl.constexpr,
):
    """Fold keys [key_start, key_stop) into the running (m, l, u, acc) of one query tile; CAUSAL masks
    keys after their row (only the diagonal tiles need it)."""
    dims = tl.arange(0, HEAD_DIM)
    for start in range(key_start, key_stop, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        in_seq = keys < seq
        k = tl.load(_rows(k_base, keys, stride_kt, dims), mask=in_seq[:, None], other=0.0)
        v = tl.load(_rows(v_base, keys, stride_vt, dims), mask=in_seq[:, None], other=0.0)
        dots = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if CAUSAL:
            # finite: exp2 gives 0 and 0 * (s - m) stays 0 in u, where -inf would give NaN
            dots = tl.where(keys[None, :] <= rows[:, None], dots, NEG_FLT_MAX)
        m_new = tl.maximum(m, tl.max(dots, 1))
        m_new_log2 = m_new * log2e_scale
        max_shift = m * log2e_scale - m_new_log2  # <= 0, in base-2 units
        rescale = tl.exp2(max_shift)  # one per row: the polynomial's error would compound once per key block
        shifted = dots * log2e_scale - m_new_log2[:, None]
        p = _exp2(shifted, POLY)
        u = rescale * (u + max_shift * l) + tl.sum(p * shifted, 1)
        l = rescale * l + tl.sum(p, 1)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    return m, l, u, acc


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, lse2_ptr, row_max_ptr, row_entropy_ptr, logit_scale_ptr,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ob, stride_oh, stride_ot,
    n_heads, group, seq, log2e_scale, sqrt_head_dim,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, POLY: tl.constexpr,
    SCALED: tl.constexpr,
):
    """SCALED: every q.k times the fp32 scalar at logit_scale_ptr (FP4 attention's outer scales)."""
    tile = tl.program_id(0)
    batch = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    kv_head = head // group
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_in_seq = rows < seq
    q = tl.load(_rows(_head(q_ptr, batch, head, stride_qb, stride_qh), rows, stride_qt, dims), mask=row_in_seq[:, None], other=0.0)
    k_base = _head(k_ptr, batch, kv_head, stride_kb, stride_kh)
    v_base = _head(v_ptr, batch, kv_head, stride_vb, stride_vh)
    logit_scale = _logit_scale(logit_scale_ptr, SCALED)
    log2e_scale = _fp32(log2e_scale) * logit_scale

    m = tl.full([BLOCK_M], NEG_FLT_MAX, tl.float32)  # running max of the raw q.k
    l = tl.zeros([BLOCK_M], tl.float32)
    u = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    diagonal = tile * BLOCK_M
    m, l, u, acc = _forward_tiles(
        q, m, l, u, acc, k_base, v_base, stride_kt, stride_vt, rows, 0, diagonal, seq, log2e_scale,
        HEAD_DIM, BLOCK_N, False, PRECISION, POLY,
    )
    m, l, u, acc = _forward_tiles(
        q, m, l, u, acc, k_base, v_base, stride_kt, stride_vt, rows, diagonal, diagonal + BLOCK_M, seq,
        log2e_scale, HEAD_DIM, BLOCK_N, True, PRECISION, POLY,
    )

    log2_l = tl.log2(l)
    out = (acc / l[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(_rows(_head(out_ptr, batch, head, stride_ob, stride_oh), rows, stride_ot, dims), out, mask=row_in_seq[:, None])
    row_offsets = (batch.to(tl.int64) * n_heads + head) * seq + rows
    tl.store(lse2_ptr + row_offsets, m * log2e_scale + log2_l, mask=row_in_seq)
    # correctly rounded, as the probe's fp32 division by sqrt(D) is
    tl.store(row_max_ptr + row_offsets, tl.math.div_rn(m * logit_scale, _fp32(sqrt_head_dim)), mask=row_in_seq)
    tl.store(row_entropy_ptr + row_offsets, LN2 * (log2_l - u / l), mask=row_in_seq)


@triton.jit
def _delta_kernel(
    out_ptr, grad_out_ptr, delta_ptr, stride_ob, stride_oh, stride_ot, stride_gb, stride_gh, stride_gt, n_heads, seq,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """delta_i = rowsum(dO_i * O_i) in fp32: the softmax backward's per-row term."""
    batch = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_in_seq = rows < seq
    out = tl.load(_rows(_head(out_ptr, batch, head, stride_ob, stride_oh), rows, stride_ot, dims), mask=row_in_seq[:, None])
    grad_out_rows = _rows(_head(grad_out_ptr, batch, head, stride_gb, stride_gh), rows, stride_gt, dims)
    grad_out = tl.load(grad_out_rows, mask=row_in_seq[:, None])
    delta = tl.sum(out.to(tl.float32) * grad_out.to(tl.float32), 1)
    tl.store(delta_ptr + (batch.to(tl.int64) * n_heads + head) * seq + rows, delta, mask=row_in_seq)


@triton.jit
def _logit_scale(logit_scale_ptr, SCALED: tl.constexpr):
    """The fp32 factor of every q.k: read from logit_scale_ptr (FP4 attention), else 1."""
    if SCALED:
        scale = tl.load(logit_scale_ptr)
    else:
        scale = 1.0
    return scale


@triton.jit
def _ds_tensor_amax_bits(ds_amax_ptr, orientation, DS_FMT: tl.constexpr):
    """NVFP4: the int32 bits of dS's tensor amax along keys (orientation 0) or along queries (1),
    which `_grad_scores_amax_kernel` took; 0 (unread) for MXFP4 and unquantized dS."""
    if DS_FMT == 1:
        bits = tl.load(ds_amax_ptr + orientation)
    else:
        bits = 0
    return bits


@triton.jit
def _ds_outer(ds_amax_ptr, orientation):
    """NVFP4's decode scale 1 / S_enc of dS along keys (orientation 0) or queries (1): the factor
    the GEMM of its block values takes."""
    return _nvfp4_scales(tl.load(ds_amax_ptr + orientation).to(tl.float32, bitcast=True))[1]


@triton.jit
def _operand_rows(base, rows, stride_t, stride_d, seq, HEAD_DIM: tl.constexpr):
    """The [rows, HEAD_DIM] block of an operand whose rows are stride_t and dims stride_d apart (the
    sequence-blocked FP4 operands are a transposed [D, B H T] array), 0 past the sequence."""
    dims = tl.arange(0, HEAD_DIM)
    return tl.load(base + rows[:, None] * stride_t + dims[None, :] * stride_d, mask=(rows < seq)[:, None], other=0.0)


@triton.jit
def _grad_kv_tiles(
    grad_k, grad_v, k, v, q_base, grad_out_base, lse2_base, delta_base, stride_qt, stride_gt, keys,
    query_start, query_stop, seq, log2e_scale,
    q_seq_base, stride_sqt, stride_sqd, ds_seed_ptr, ds_amax_bits, ds_row0,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, POLY: tl.constexpr, DS_FMT: tl.constexpr, DS_SR: tl.constexpr,
):
    """Add the queries [query_start, query_stop) of one head to dK, dV of a key tile (transposed: keys x
    queries). DS_FMT (1 nvfp4, 2 mxfp4): dS^T is quantized along queries, rows ds_row0 + keys of a
    [.., seq] array for SR's draws, and dK takes its block values times the sequence-blocked Q."""
    dims = tl.arange(0, HEAD_DIM)
    for start in range(query_start, query_stop, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_in_seq = rows < seq
        q = tl.load(_rows(q_base, rows, stride_qt, dims), mask=row_in_seq[:, None], other=0.0)
        grad_out = tl.load(_rows(grad_out_base, rows, stride_gt, dims), mask=row_in_seq[:, None], other=0.0)
        # rows past the end load q = dO = 0 (so dS = 0): they add nothing to dK, dV
        lse2 = tl.load(lse2_base + rows, mask=row_in_seq, other=0.0)
        delta = tl.load(delta_base + rows, mask=row_in_seq, other=0.0)
        p_t = _exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * log2e_scale - lse2[None, :], POLY)
        if CAUSAL:
            p_t = tl.where(keys[:, None] <= rows[None, :], p_t, 0.0)
        grad_v += tl.dot(p_t.to(grad_out.dtype), grad_out, input_precision=PRECISION)
        grad_p_t = tl.dot(v, tl.trans(grad_out), input_precision=PRECISION)
        grad_s_t = p_t * (grad_p_t - delta[None, :])
        if DS_FMT:
            ds_t = _tile_block_values(grad_s_t, ds_amax_bits, ds_seed_ptr, ds_row0 + keys, start, seq, BLOCK_N, BLOCK_M, DS_FMT == 1, DS_SR)
            grad_k += tl.dot(ds_t, _operand_rows(q_seq_base, rows, stride_sqt, stride_sqd, seq, HEAD_DIM))
        else:
            grad_k += tl.dot(grad_s_t.to(q.dtype), q, input_precision=PRECISION)
    return grad_k, grad_v


@triton.jit
def _grad_kv_kernel(
    q_ptr, k_ptr, v_ptr, grad_out_ptr, lse2_ptr, delta_ptr, grad_k_ptr, grad_v_ptr,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_gb, stride_gh, stride_gt, stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh, stride_dvt,
    n_kv_heads, group, seq, log2e_scale, softmax_scale,
    logit_scale_ptr, q_seq_ptr, q_seq_outer_ptr, stride_sqb, stride_sqh, stride_sqt, stride_sqd, ds_seed_ptr, ds_amax_ptr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, POLY: tl.constexpr,
    SCALED: tl.constexpr, DS_FMT: tl.constexpr, DS_SR: tl.constexpr,
):
    """dK, dV of one key tile of one KV head, summed over the query heads of its group."""
    tile = tl.program_id(0)
    batch = tl.program_id(1) // n_kv_heads
    kv_head = tl.program_id(1) % n_kv_heads
    keys = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    key_in_seq = keys < seq
    k = tl.load(_rows(_head(k_ptr, batch, kv_head, stride_kb, stride_kh), keys, stride_kt, dims), mask=key_in_seq[:, None], other=0.0)
    v = tl.load(_rows(_head(v_ptr, batch, kv_head, stride_vb, stride_vh), keys, stride_vt, dims), mask=key_in_seq[:, None], other=0.0)
    log2e_scale = _fp32(log2e_scale) * _logit_scale(logit_scale_ptr, SCALED)
    ds_amax_bits = _ds_tensor_amax_bits(ds_amax_ptr, 1, DS_FMT)
    grad_k = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    grad_v = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    diagonal = tile * BLOCK_N
    diagonal_stop = diagonal + BLOCK_N
    for member in range(group):
        head = kv_head * group + member
        q_base = _head(q_ptr, batch, head, stride_qb, stride_qh)
        if DS_FMT:
            q_seq_base = _head(q_seq_ptr, batch, head, stride_sqb, stride_sqh)
        else:
            q_seq_base = q_base  # unread
        grad_out_base = _head(grad_out_ptr, batch, head, stride_gb, stride_gh)
        row_base = (batch.to(tl.int64) * n_kv_heads * group + head) * seq
        lse2_base, delta_base = lse2_ptr + row_base, delta_ptr + row_base
        grad_k, grad_v = _grad_kv_tiles(
            grad_k, grad_v, k, v, q_base, grad_out_base, lse2_base, delta_base, stride_qt, stride_gt,
            keys, diagonal, diagonal_stop, seq, log2e_scale, q_seq_base, stride_sqt, stride_sqd, ds_seed_ptr,
            ds_amax_bits, row_base, HEAD_DIM, BLOCK_M, BLOCK_N, True, PRECISION, POLY, DS_FMT, DS_SR,
        )
        grad_k, grad_v = _grad_kv_tiles(
            grad_k, grad_v, k, v, q_base, grad_out_base, lse2_base, delta_base, stride_qt, stride_gt,
            keys, diagonal_stop, seq, seq, log2e_scale, q_seq_base, stride_sqt, stride_sqd, ds_seed_ptr,
            ds_amax_bits, row_base, HEAD_DIM, BLOCK_M, BLOCK_N, False, PRECISION, POLY, DS_FMT, DS_SR,
        )
    if DS_FMT == 1:  # the GEMM's outer scales first, then 1 / sqrt(D): the chunked path's order
        grad_k = grad_k * (_ds_outer(ds_amax_ptr, 1) * tl.load(q_seq_outer_ptr))
    grad_k_rows = _rows(_head(grad_k_ptr, batch, kv_head, stride_dkb, stride_dkh), keys, stride_dkt, dims)
    tl.store(grad_k_rows, (grad_k * _fp32(softmax_scale)).to(grad_k_ptr.dtype.element_ty), mask=key_in_seq[:, None])
    grad_v_rows = _rows(_head(grad_v_ptr, batch, kv_head, stride_dvb, stride_dvh), keys, stride_dvt, dims)
    tl.store(grad_v_rows, grad_v.to(grad_v_ptr.dtype.element_ty), mask=key_in_seq[:, None])


@triton.jit
def _grad_scores(q, grad_out, lse2, delta, k, v, rows, keys, log2e_scale,
                 CAUSAL: tl.constexpr, PRECISION: tl.constexpr, POLY: tl.constexpr):  # fmt: skip
    """P and dS = P (dP - delta) of one [queries, keys] tile, P recomputed from the saved base-2 LSE."""
    p = _exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * log2e_scale - lse2[:, None], POLY)
    if CAUSAL:
        p = tl.where(keys[None, :] <= rows[:, None], p, 0.0)
    grad_p = tl.dot(grad_out, tl.trans(v), input_precision=PRECISION)
    return p, p * (grad_p - delta[:, None])


@triton.jit
def _grad_q_tiles(
    grad_q, q, grad_out, lse2, delta, k_base, v_base, stride_kt, stride_vt, rows, key_start, key_stop, seq, log2e_scale,
    k_seq_base, stride_skt, stride_skd, ds_seed_ptr, ds_amax_bits, ds_row0,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr, POLY: tl.constexpr, DS_FMT: tl.constexpr, DS_SR: tl.constexpr,
):
    """Add the keys [key_start, key_stop) to dQ of one query tile. DS_FMT: dS is quantized along keys,
    rows ds_row0 + rows of a [.., seq] array for SR's draws, and dQ takes its block values times the
    sequence-blocked K."""
    dims = tl.arange(0, HEAD_DIM)
    for start in range(key_start, key_stop, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        in_seq = keys < seq
        k = tl.load(_rows(k_base, keys, stride_kt, dims), mask=in_seq[:, None], other=0.0)
        v = tl.load(_rows(v_base, keys, stride_vt, dims), mask=in_seq[:, None], other=0.0)
        probs, grad_s = _grad_scores(q, grad_out, lse2, delta, k, v, rows, keys, log2e_scale, CAUSAL, PRECISION, POLY)
        if DS_FMT:
            ds = _tile_block_values(grad_s, ds_amax_bits, ds_seed_ptr, ds_row0 + rows, start, seq, BLOCK_M, BLOCK_N, DS_FMT == 1, DS_SR)
            grad_q += tl.dot(ds, _operand_rows(k_seq_base, keys, stride_skt, stride_skd, seq, HEAD_DIM))
        else:
            grad_q += tl.dot(grad_s.to(k.dtype), k, input_precision=PRECISION)
    return grad_q


@triton.jit
def _query_tile(
    q_ptr, grad_out_ptr, lse2_ptr, delta_ptr, stride_qb, stride_qh, stride_qt, stride_gb, stride_gh, stride_gt,
    n_heads, seq, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """A backward program's query tile: (batch, head, rows, q, dO, base-2 LSE, delta, the rows' offset
    in [B, H, T] arrays)."""
    batch = tl.program_id(1) // n_heads
    head = tl.program_id(1) % n_heads
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_in_seq = rows < seq
    q = tl.load(_rows(_head(q_ptr, batch, head, stride_qb, stride_qh), rows, stride_qt, dims), mask=row_in_seq[:, None], other=0.0)
    grad_out_rows = _rows(_head(grad_out_ptr, batch, head, stride_gb, stride_gh), rows, stride_gt, dims)
    grad_out = tl.load(grad_out_rows, mask=row_in_seq[:, None], other=0.0)
    row_base = (batch.to(tl.int64) * n_heads + head) * seq
    lse2 = tl.load(lse2_ptr + row_base + rows, mask=row_in_seq, other=0.0)
    delta = tl.load(delta_ptr + row_base + rows, mask=row_in_seq, other=0.0)
    return batch, head, rows, q, grad_out, lse2, delta, row_base


@triton.jit
def _grad_q_kernel(
    q_ptr, k_ptr, v_ptr, grad_out_ptr, lse2_ptr, delta_ptr, grad_q_ptr,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_gb, stride_gh, stride_gt, stride_dqb, stride_dqh, stride_dqt,
    n_heads, group, seq, log2e_scale, softmax_scale,
    logit_scale_ptr, k_seq_ptr, k_seq_outer_ptr, stride_skb, stride_skh, stride_skt, stride_skd, ds_seed_ptr, ds_amax_ptr,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, POLY: tl.constexpr,
    SCALED: tl.constexpr, DS_FMT: tl.constexpr, DS_SR: tl.constexpr,
):
    batch, head, rows, q, grad_out, lse2, delta, row_base = _query_tile(
        q_ptr, grad_out_ptr, lse2_ptr, delta_ptr, stride_qb, stride_qh, stride_qt, stride_gb, stride_gh, stride_gt,
        n_heads, seq, HEAD_DIM, BLOCK_M,
    )
    kv_head = head // group
    dims = tl.arange(0, HEAD_DIM)
    k_base = _head(k_ptr, batch, kv_head, stride_kb, stride_kh)
    v_base = _head(v_ptr, batch, kv_head, stride_vb, stride_vh)
    if DS_FMT:
        k_seq_base = _head(k_seq_ptr, batch, kv_head, stride_skb, stride_skh)
    else:
        k_seq_base = k_base  # unread
    log2e_scale = _fp32(log2e_scale) * _logit_scale(logit_scale_ptr, SCALED)
    ds_amax_bits = _ds_tensor_amax_bits(ds_amax_ptr, 0, DS_FMT)
    grad_q = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    diagonal = tl.program_id(0) * BLOCK_M
    grad_q = _grad_q_tiles(
        grad_q, q, grad_out, lse2, delta, k_base, v_base, stride_kt, stride_vt, rows, 0, diagonal, seq, log2e_scale,
        k_seq_base, stride_skt, stride_skd, ds_seed_ptr, ds_amax_bits, row_base,
        HEAD_DIM, BLOCK_M, BLOCK_N, False, PRECISION, POLY, DS_FMT, DS_SR,
    )
    grad_q = _grad_q_tiles(
        grad_q, q, grad_out, lse2, delta, k_base, v_base, stride_kt, stride_vt, rows, diagonal,
        diagonal + BLOCK_M, seq, log2e_scale, k_seq_base, stride_skt, stride_skd, ds_seed_ptr, ds_amax_bits, row_base,
        HEAD_DIM, BLOCK_M, BLOCK_N, True, PRECISION, POLY, DS_FMT, DS_SR,
    )
    if DS_FMT == 1:  # the GEMM's outer scales first, then 1 / sqrt(D): the chunked path's order
        grad_q = grad_q * (_ds_outer(ds_amax_ptr, 0) * tl.load(k_seq_outer_ptr))
    grad_q_rows = _rows(_head(grad_q_ptr, batch, head, stride_dqb, stride_dqh), rows, stride_dqt, dims)
    tl.store(grad_q_rows, (grad_q * _fp32(softmax_scale)).to(grad_q_ptr.dtype.element_ty), mask=(rows < seq)[:, None])


@triton.jit
def _grad_scores_amax_kernel(
    q_ptr, k_ptr, v_ptr, grad_out_ptr, lse2_ptr, delta_ptr, logit_scale_ptr, ds_amax_ptr,
    stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_gb, stride_gh, stride_gt, n_heads, group, seq, log2e_scale,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, POLY: tl.constexpr,
):
    """NVFP4's tensor amaxes of the whole dS, the first pass over the tiles: max |dS| over the finite
    blocks of 16 along keys into ds_amax_ptr[0] and along queries into [1] (int32 bits; one atomic max
    each per program), as `quantize.finite_amax` of dS and dS^T. dS is recomputed tile by tile as the
    dQ kernel computes it."""
    batch, head, rows, q, grad_out, lse2, delta, row_base = _query_tile(
        q_ptr, grad_out_ptr, lse2_ptr, delta_ptr, stride_qb, stride_qh, stride_qt, stride_gb, stride_gh, stride_gt,
        n_heads, seq, HEAD_DIM, BLOCK_M,
    )
    kv_head = head // group
    dims = tl.arange(0, HEAD_DIM)
    k_base = _head(k_ptr, batch, kv_head, stride_kb, stride_kh)
    v_base = _head(v_ptr, batch, kv_head, stride_vb, stride_vh)
    log2e_scale = _fp32(log2e_scale) * tl.load(logit_scale_ptr)
    along_keys = tl.zeros([], tl.float32)
    along_queries = tl.zeros([], tl.float32)
    # keys past the tile's last row are masked for every row: they are zero in dS
    for start in range(0, tl.program_id(0) * BLOCK_M + BLOCK_M, BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        in_seq = keys < seq
        k = tl.load(_rows(k_base, keys, stride_kt, dims), mask=in_seq[:, None], other=0.0)
        v = tl.load(_rows(v_base, keys, stride_vt, dims), mask=in_seq[:, None], other=0.0)
        probs, grad_s = _grad_scores(q, grad_out, lse2, delta, k, v, rows, keys, log2e_scale, True, "tf32", POLY)
        along_keys = tl.maximum(along_keys, tl.max(_finite_row_amax(grad_s, None, BLOCK_M, BLOCK_N, 0), axis=0))
        along_queries = tl.maximum(along_queries, tl.max(_finite_row_amax(tl.trans(grad_s), None, BLOCK_N, BLOCK_M, 0), axis=0))
    tl.atomic_max(ds_amax_ptr, along_keys.to(tl.int32, bitcast=True))
    tl.atomic_max(ds_amax_ptr + 1, along_queries.to(tl.int32, bitcast=True))
