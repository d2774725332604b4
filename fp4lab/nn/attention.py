"""Causal grouped-query attention with RoPE, the two training probes, and FP4 attention.

`Attention` has these paths, picked by attributes the training loop and build_model set:

- `kernel="sdpa"` (the default): `F.scaled_dot_product_attention` (fused, no logits materialised),
  and the probes computed beside it from chunks of fp32 logits, never changing the output:
  `record_max_logits` stores the per-head max attention logit S_max^h (the QK-Clip trigger, Kimi K2),
  `probe` stores the per-head attention entropy (Zhai et al. 2023);
- `kernel="triton"` (what build_model sets on the fast path on CUDA): the Triton flash attention of
  fp4lab.numerics.kernels.attention, whose online softmax also returns both probes' statistics, so they
  cost one more multiply-add per logit instead of a pass over all logits: QK-Clip reads them every
  step. The same two flags say which of them are stored;
- `quant`: FP4 attention after Full-Stack FP4 (arXiv 2607.04422), fake-quantized, with a
  hand-written backward (`fp4_attention`): QK^T, dS K and dS^T Q in FP4, V and PV, dO V^T in BF16;
  it materialises its fp32 scores and their gradients for chunks of query rows, not all [T, T].

Tensors inside are laid out [batch, heads, seq, head_dim]; RoPE pairs dims (2i, 2i+1) as Meta's Llama
and torchtitan do, so checkpoints keep torchtitan's layout.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp4lab.numerics import BLOCK_SIZE, fake_quantize, kernels
from fp4lab.numerics.attention import attention_entropy, max_attention_logits
from fp4lab.numerics.epilogue import bf16_matmul_fp32, outer_scale_product
from fp4lab.numerics.quantize import finite_amax

ATTENTION_FORMATS = ("nvfp4", "mxfp4")
DS_ROUNDINGS = ("sr", "rtn")
# Sequence length and head_dim must hold whole blocks of every attention format.
FP4_BLOCK_MULTIPLE = max(BLOCK_SIZE[fmt] for fmt in ATTENTION_FORMATS)
# FP4 attention materialises its fp32 scores, P, dP and dS (and dS's quantizations) for chunks of query
# rows of at most this many elements each (256 MiB), not [B, H, T, T]; a chunk holds 32 rows at least.
# A chunk costs about 50 kernel launches a pass whatever its size: 64 MiB chunks made the 125m model
# at 16 x 1024 tokens (ledger shape) 32 chunks per layer, 4 at this size.
FP4_ATTENTION_CHUNK_ELEMENTS = 1 << 26

LinearFactory = Callable[[str, int, int], nn.Module]


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles pos * theta^(-2i/head_dim), each [max_seq_len, head_dim // 2]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[..., 2i], x[..., 2i+1]) of x [batch, seq, heads, head_dim] by its angle."""
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


@dataclass(frozen=True)
class AttentionQuant:
    """How FP4 attention rounds (Full-Stack FP4, arXiv 2607.04422).

    format:      "nvfp4" or "mxfp4" for the operands of the three FP4 GEMMs, S = Q K^T, dQ = dS K and
                 dK = dS^T Q, each quantized along its GEMM's contraction axis (`fp4_attention`); V
                 stays BF16, as do the PV, P^T dO and dO V^T products. None runs the same algorithm in
                 exact fp32: the reference that checks the hand-written backward.
    ds_rounding: "sr" (stochastic) or "rtn" for dS (along keys, for dQ) and dS^T (along queries, for
                 dK; its own draw); None keeps both unquantized (ablation, and the expectation SR
                 averages to). SR is unbiased only below each block's saturation: the mean dQ, dK over
                 draws keeps a relative bias of about 1.2 % with nvfp4 (E4M3 block scales rounded down)
                 and 6 % with mxfp4 (floor scales clip values above 6 x scale).
    generator:   the random stream of dS's stochastic rounding, on the tensors' device (None: torch's
                 default generator).
    tensor_cores: the fast path's (`nn.build.build_model`): where the fused quantizers run, every GEMM
                 takes bf16 operands with fp32 accumulation (on CUDA bf16 tensor cores): the BF16 ones
                 (PV, dO V^T, P^T dO) the bf16-rounded operands, the FP4 ones (S, dQ, dK) each operand's
                 block values (E2M1 x block scale, exact in bf16) with the NVFP4 outer scales applied to
                 the fp32 result. The same codes, scales and exact products as the fp32 GEMMs of decoded
                 values, summed and rounded in another order; and Q, K are saved as bf16 block values.
    """

    format: str | None = "nvfp4"
    ds_rounding: str | None = "sr"
    generator: torch.Generator | None = None
    tensor_cores: bool = False

    def __post_init__(self):
        if self.format is not None and self.format not in ATTENTION_FORMATS:
            raise ValueError(f"AttentionQuant.format={self.format!r}; allowed: 'nvfp4', 'mxfp4' or None")
        if self.ds_rounding is not None and self.ds_rounding not in DS_ROUNDINGS:
            raise ValueError(f"AttentionQuant.ds_rounding={self.ds_rounding!r}; allowed: 'sr', 'rtn' or None")


class Attention(nn.Module):
    """Causal GQA self-attention: wq, wk, wv, wo built by `make_linear(name, in_features, out_features)`.

    Attributes the training loop sets between steps:
      record_max_logits  store `last_max_logits` [n_heads]: S_max^h = max over the batch and the causal
                         positions of q.k / sqrt(head_dim), after RoPE.
      probe              store `last_entropy` [n_heads]: mean over queries of the causal softmax rows'
                         entropy (nats), over the first `probe_batch` sequences.
      quant              an AttentionQuant to run FP4 attention instead of SDPA (whatever `kernel`).
      kernel             "sdpa" (PyTorch's attention beside the chunked probes) or "triton"
                         (fp4lab.numerics.kernels.attention, the probes' statistics computed online; its
                         inputs in the autocast dtype under autocast, as SDPA's are).
    Both probes read the unquantized post-RoPE q and k, also under FP4 attention: they track the
    weights QK-Clip rescales, not the rounding noise.
    """

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, make_linear: LinearFactory | None = None):
        super().__init__()
        if dim % n_heads or n_heads % n_kv_heads:
            raise ValueError(
                f"Attention: dim={dim} must divide by n_heads={n_heads}, and n_heads by n_kv_heads={n_kv_heads}"
            )
        make_linear = make_linear or (lambda name, fan_in, fan_out: nn.Linear(fan_in, fan_out, bias=False))
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = make_linear("wq", dim, n_heads * self.head_dim)
        self.wk = make_linear("wk", dim, n_kv_heads * self.head_dim)
        self.wv = make_linear("wv", dim, n_kv_heads * self.head_dim)
        self.wo = make_linear("wo", n_heads * self.head_dim, dim)
        self.record_max_logits = False
        self.last_max_logits: torch.Tensor | None = None
        self.probe = False
        self.probe_batch = 2
        self.last_entropy: torch.Tensor | None = None
        self.quant: AttentionQuant | None = None
        self.kernel = "sdpa"

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        """x [batch, seq, dim]; rope_cos and rope_sin [seq, head_dim // 2]."""
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.n_heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.n_kv_heads, self.head_dim)
        q, k = apply_rope(q, rope_cos, rope_sin), apply_rope(k, rope_cos, rope_sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.quant is None and self.kernel == "triton":
            out = self._flash_attention(q, k, v)
            return self.wo(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))

        # Probes and FP4 attention compute their own precision (fp32 logits, bf16 PV); under autocast
        # (bf16 activations) their products would otherwise be cast down to bf16.
        with torch.autocast(x.device.type, enabled=False):
            if self.record_max_logits:
                self.last_max_logits = max_attention_logits(q, k)
            if self.probe:
                self.last_entropy = attention_entropy(q[: self.probe_batch], k[: self.probe_batch])
            if self.quant is not None:
                flash = self.kernel == "triton" and flash_fp4_covers(q, self.quant)
                out = (flash_fp4_attention if flash else fp4_attention)(q, k, v, self.quant)
        if self.quant is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.n_heads * self.head_dim))

    def _flash_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The "triton" kernel: attention whose online softmax also yields both probes' statistics, so
        they cost no extra pass over the logits and can run every step."""
        # Imported here: the module imports Triton, and only runs where build_model chose the kernel.
        from fp4lab.numerics.kernels.attention import flash_attention

        device = q.device.type
        if torch.is_autocast_enabled(device):
            # SDPA runs in the autocast dtype there; the kernel casts nothing, so it gets what SDPA would.
            dtype = torch.get_autocast_dtype(device)
            q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        result = flash_attention(q, k, v, probe_batch=self.probe_batch)
        if self.record_max_logits:
            self.last_max_logits = result.max_logits
        if self.probe:
            self.last_entropy = result.entropy
        return result.out


# --- FP4 attention ------------------------------------------------------------------------------


def fp4_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    quant: AttentionQuant,
    chunk_elements: int = FP4_ATTENTION_CHUNK_ELEMENTS,
) -> torch.Tensor:
    """Causal attention with FP4 QK^T, dS K and dS^T Q GEMMs (Full-Stack FP4), fake-quantized; [B, H, T, D].

    q [B, H, T, D], k and v [B, H_kv, T, D]. Every FP4 GEMM quantizes each of its two operands along that
    GEMM's own contraction axis, as an FP4 tensor-core GEMM requires; operands are decoded to fp32 and
    multiplied with fp32 accumulation (dQ, dK then times 1/sqrt(D) in fp32), or with
    `quant.tensor_cores` their block values multiplied on bf16 tensor cores, the outer scales after. Sequence and head_dim
    positions are both contraction axes somewhere, so both must be multiples of 32 (the mxfp4 block;
    nvfp4's is 16).

    forward   S  = Qq Kq^T / sqrt(D)   Q and K along head_dim (round to nearest); causal softmax P in fp32
              O  = P V                 BF16 GEMM: P and V rounded to bf16
    backward  dV = P^T dO              BF16 GEMM
              dP = dO V^T              BF16 GEMM; dS = P * (dP - rowsum(dP * P)) in fp32
              dQ = dS K / sqrt(D)      dS along keys (ds_rounding); K re-quantized along keys (RTN)
              dK = dS^T Q / sqrt(D)    dS^T along queries (ds_rounding, a second draw after dQ's);
                                       Q re-quantized along queries (RTN)

    V is never quantized: nothing consumes an FP4 V (the paper keeps PV and dO V^T, the paths that
    break training, in BF16), so V is only rounded to bf16 as the operand of those two GEMMs.

    The backward re-quantization starts from the saved forward FP4 values Qq, Kq, not from the exact
    Q, K ("unified tensor reuse": the backward sees the Q, K the forward computed S from, and a kernel
    keeps them packed between the passes, 4.5 bits a value against bf16's 16). The cost is a second
    rounding. Measured on `qkv_and_grad()` of tests/nn/test_attention.py (nvfp4, RTN dS, mean of 4 input
    seeds), the relative error of dQ and dK against exact attention is 0.193 when re-quantizing Qq, Kq
    and 0.167 when re-quantizing the exact Q, K (2.6 points more; mxfp4 0.224 against 0.221); their
    distance from the gradient of the forward's own function (the same dSq times Kq, Qq in fp32) is
    0.093 against 0.131: the alignment the reuse buys. P is recomputed from Qq, Kq, bit-identical to
    the forward.

    Both passes walk the query rows in chunks (`_query_chunks`): S, P, dP, dS and dS's quantizations
    exist for one chunk at a time, [B, H, rows, keys] with B * H * rows * T <= chunk_elements (rows a
    multiple of 32, at least 32), not [B, H, T, T]. Rows [start, stop) read keys [0, stop) only: the
    causal mask makes P, and so dS, zero beyond, and stop is a multiple of 32, so the keys left out are
    whole blocks that would contribute zero to O, dQ and dK. Chunking keeps the numerics of one chunk:
    - a row's scores and softmax are whole, and O, dP, dS and dQ are per query row: the same values
      (bit-equal on CPU; tests/nn/test_fp4_attention_chunked.py);
    - dS along keys (for dQ) is quantized per row; dS^T along queries (for dK) in blocks of 16 or 32
      queries, which chunk boundaries at multiples of 32 keep whole;
    - NVFP4's tensor scale is that of the whole dS: a first pass over the chunks finds its amax
      (`_ds_tensor_amaxes`), so with RTN every element is quantized exactly as in one chunk. That pass
      recomputes P and dP once more (where there is more than one chunk);
    - dK and dV add their chunks' products in fp32: the summation order changes, nothing else;
    - SR draws dS then dS^T chunk by chunk: other draws than one chunk's, of the same distribution.
    """
    seq, head_dim = q.shape[-2], q.shape[-1]
    if seq % FP4_BLOCK_MULTIPLE:
        raise ValueError(
            f"FP4 attention: sequence length {seq} must be a multiple of {FP4_BLOCK_MULTIPLE} "
            "(the dS K and dS^T Q GEMMs contract over it in FP4 blocks); pick a seq_len that is"
        )
    if head_dim % FP4_BLOCK_MULTIPLE:
        raise ValueError(f"FP4 attention: head_dim {head_dim} must be a multiple of {FP4_BLOCK_MULTIPLE}")
    return _FP4Attention.apply(q, k, v, quant, chunk_elements)


def _query_chunks(q: torch.Tensor, chunk_elements: int) -> list[slice]:
    """Query rows of q [B, H, T, D] in chunks of B * H * rows * T <= chunk_elements scores, rows a
    multiple of FP4_BLOCK_MULTIPLE (at least one block, whatever the budget): chunks then cut dS^T
    along queries at block boundaries only. The last chunk may be shorter."""
    batch, n_heads, seq, _ = q.shape
    rows = max(1, chunk_elements // (batch * n_heads * seq * FP4_BLOCK_MULTIPLE)) * FP4_BLOCK_MULTIPLE
    return [slice(start, min(start + rows, seq)) for start in range(0, seq, rows)]


class _FP4Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, quant: AttentionQuant, chunk_elements: int):
        q_q, k_q = _quant_operand(q, quant), _quant_operand(k, quant)
        group = q.shape[1] // k.shape[1]
        k_heads, v_heads = k_q.repeat_heads(group), v.repeat_interleave(group, dim=1)
        out = q.new_empty(q.shape, dtype=torch.float32)
        for rows in _query_chunks(q, chunk_elements):
            probs = _causal_softmax(q_q.rows(rows), k_heads, rows)
            out[:, :, rows] = _bf16_matmul(probs, v_heads[:, :, : rows.stop], quant)
        outers = [o for o in (q_q.outer, k_q.outer) if o is not None]  # NVFP4's, or none (decoded values, MXFP4)
        ctx.save_for_backward(q_q.values, k_q.values, v, *outers)
        ctx.quant, ctx.chunk_elements = quant, chunk_elements
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q_values, k_values, v, *outers = ctx.saved_tensors
        q_q, k_q = (_Factored(q_values, outers[0]), _Factored(k_values, outers[1])) if outers else (_Factored(q_values), _Factored(k_values))
        quant: AttentionQuant = ctx.quant
        group = q_values.shape[1] // k_values.shape[1]
        k_heads, v_heads = k_q.repeat_heads(group), v.repeat_interleave(group, dim=1)
        grad_out = grad_out.float()
        chunks = _query_chunks(q_values, ctx.chunk_elements)

        def grad_scores_by_chunk() -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
            """(rows, P, dS) per chunk, P recomputed rather than saved (it is bit-identical)."""
            for rows in chunks:
                probs = _causal_softmax(q_q.rows(rows), k_heads, rows)
                v_keys = v_heads[:, :, : rows.stop]
                grad_probs = _bf16_matmul(grad_out[:, :, rows], v_keys.transpose(-1, -2), quant)
                grad_scores = probs * (grad_probs - (grad_probs * probs).sum(dim=-1, keepdim=True))
                del grad_probs  # not held while the generator waits at its yield (dS's quantizations)
                yield rows, probs, grad_scores

        amax_keys, amax_queries = _ds_tensor_amaxes(grad_scores_by_chunk(), quant, len(chunks))
        k_keys = _quant_operand_seq(k_q, quant).repeat_heads(group)
        q_queries = _quant_operand_seq(q_q, quant)
        scale = 1.0 / math.sqrt(q_values.shape[-1])
        grad_q = torch.empty(q_values.shape, dtype=torch.float32, device=q_values.device)
        grad_k, grad_v = torch.zeros_like(grad_q), torch.zeros_like(grad_q)
        for rows, probs, grad_scores in grad_scores_by_chunk():
            keys = slice(0, rows.stop)
            grad_v[:, :, keys] += _bf16_matmul(probs.transpose(-1, -2), grad_out[:, :, rows], quant)
            ds_keys, ds_queries = _quant_ds(grad_scores, quant, amax_keys, amax_queries)
            grad_q[:, :, rows] = _fp4_matmul(ds_keys, k_keys.rows(keys)) * scale
            grad_k[:, :, keys] += _fp4_matmul(ds_queries, q_queries.rows(rows))
            # Dropped before the generator builds the next chunk: else two chunks' worth stays alive.
            del probs, grad_scores, ds_keys, ds_queries
        grad_k *= scale
        return grad_q, _sum_over_group(grad_k, group), _sum_over_group(grad_v, group), None, None


def _ds_tensor_amaxes(
    grad_scores_by_chunk: Iterator[tuple[slice, torch.Tensor, torch.Tensor]], quant: AttentionQuant, n_chunks: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The amaxes behind NVFP4's tensor scales of the whole dS along keys and dS^T along queries, from
    the chunks' own (`finite_amax`: chunks hold whole blocks in both orientations, and the keys a chunk
    leaves out are zero). Both are max |dS| unless a block holds a NaN or Inf, which is left out, and
    that block differs between the orientations. (None, None) where no tensor scale applies, or where one
    chunk is the whole dS and quantize finds the same amaxes itself."""
    if quant.format != "nvfp4" or quant.ds_rounding is None or n_chunks == 1:
        return None, None
    per_chunk = [
        (finite_amax(grad_scores, "nvfp4"), finite_amax(grad_scores.transpose(-1, -2), "nvfp4"))
        for _, _, grad_scores in grad_scores_by_chunk
    ]
    along_keys, along_queries = zip(*per_chunk)
    return torch.stack(along_keys).amax(), torch.stack(along_queries).amax()


def _fake_quant(x: torch.Tensor, fmt: str | None) -> torch.Tensor:
    """x [..., N] quantized (round to nearest) along its last dim and dequantized to fp32; fmt None
    returns x in fp32. Where Triton runs, by the fused quantizer: the reference's bits."""
    return x.float() if fmt is None else kernels.fake_quantize(x, fmt)


class _Factored:
    """An operand of FP4 attention's GEMMs: decoded fp32 values (outer None), or with tensor cores bf16
    block values and the outer scale (NVFP4's decode scale, 0-dim; None for MXFP4) that multiplies the
    GEMM's fp32 result. values x outer is the decoded operand bit for bit (`FusedQuant.dequantize`)."""

    def __init__(self, values: torch.Tensor, outer: torch.Tensor | None = None):
        self.values, self.outer = values, outer

    def decoded(self) -> torch.Tensor:
        return self.values.float() if self.outer is None else self.values.float().mul_(self.outer)

    def rows(self, rows: slice) -> _Factored:
        return _Factored(self.values[:, :, rows], self.outer)

    def repeat_heads(self, group: int) -> _Factored:
        return _Factored(self.values.repeat_interleave(group, dim=1), self.outer)

    def mT(self) -> _Factored:  # noqa: N802 (reads like tensor.mT)
        return _Factored(self.values.transpose(-1, -2), self.outer)


def _factored(quant: AttentionQuant, device: torch.device) -> bool:
    """Whether the GEMMs take block values (tensor cores) rather than decoded fp32 values."""
    return quant.tensor_cores and quant.format is not None and kernels.runs_on(device)


def _quant_operand(x: torch.Tensor, quant: AttentionQuant) -> _Factored:
    """x [B, H, T, D] quantized (round to nearest) along head_dim, as `_fake_quant` quantizes it."""
    if not _factored(quant, x.device):
        return _Factored(_fake_quant(x, quant.format))
    return _block_values_along_head_dim(x, quant.format)


def _block_values_along_head_dim(x: torch.Tensor, fmt: str) -> _Factored:
    """x [B, H, T, D] quantized along head_dim by the fused quantizer: bf16 block values and outer scale."""
    from fp4lab.numerics.kernels.quantize import quantize_fused

    q = quantize_fused(x.reshape(-1, x.shape[-1]), fmt=fmt)
    return _Factored(q.values.view(x.shape), q.outer)


def _quant_operand_seq(x: _Factored, quant: AttentionQuant) -> _Factored:
    """x [B, H, T, D] re-quantized (round to nearest) from its decoded values in blocks along the
    sequence dim T, same layout. The fused kernel quantizes the [B H T, D] view's transpose: its blocks
    of 16 or 32 rows stay within one (batch, head) as T is a multiple of 32. Its result is laid out as
    the reference's (a transposed contiguous [B, H, D, T]), so the GEMMs that read it are the same calls."""
    fmt, decoded = quant.format, x.decoded()
    if fmt is not None and kernels.runs_on(decoded.device):
        batch, n_heads, seq, head_dim = decoded.shape
        q = _quantized_along_seq(decoded, fmt)
        along_seq = lambda t: t.view(head_dim, batch, n_heads, seq).permute(1, 2, 0, 3).contiguous().transpose(-1, -2)
        return _Factored(along_seq(q.values), q.outer) if _factored(quant, decoded.device) else _Factored(along_seq(q.dequantize()))
    return _Factored(_fake_quant(decoded.transpose(-1, -2), fmt).transpose(-1, -2))


def _quantized_along_seq(decoded: torch.Tensor, fmt: str):
    """decoded [B, H, T, D] quantized along T by the fused quantizer: a FusedQuant of [D, B H T]."""
    from fp4lab.numerics.kernels.quantize import quantize_fused

    return quantize_fused(decoded.reshape(-1, decoded.shape[-1]), fmt=fmt, transpose=True)


def _quant_ds(
    grad_scores: torch.Tensor, quant: AttentionQuant, amax_keys: torch.Tensor | None, amax_queries: torch.Tensor | None
) -> tuple[_Factored, _Factored]:
    """(dS along keys, dS^T along queries) of dS [B, H, rows, keys] (or a chunk of it), each quantized
    with quant.ds_rounding, dS's draw first, and decoded to fp32; NVFP4's tensor scales from the
    whole dS's amaxes where given. ds_rounding or format None leaves both in fp32.

    Where Triton runs, one read of dS by the fused quantizer gives both (its blocks along queries stay
    within one (batch, head): rows is a multiple of 32), their SR bits drawn with Philox from two
    seeds that quant.generator draws; the torch reference draws its bits from quant.generator itself.
    RTN codes are the same bits either way, SR draws from the same distribution. Both results are
    contiguous, as the reference's are: the GEMMs that read them are the same calls on either path."""
    if quant.ds_rounding is None or quant.format is None:
        return _Factored(grad_scores), _Factored(grad_scores.transpose(-1, -2))
    fmt, rounding, generator = quant.format, quant.ds_rounding, quant.generator
    if kernels.runs_on(grad_scores.device):
        from fp4lab.numerics.kernels.quantize import quantize_fused_both

        def options(amax: torch.Tensor | None) -> dict:
            seed = torch.randint(2**62, (1,), generator=generator, device=grad_scores.device) if rounding == "sr" else None
            return {"fmt": fmt, "rounding": rounding, "seed": seed, "tensor_amax": amax}

        batch, n_heads, rows, keys = grad_scores.shape
        along_keys, along_queries = quantize_fused_both(grad_scores.reshape(-1, keys), options(amax_keys), options(amax_queries))
        as_queries = lambda t: t.view(keys, batch, n_heads, rows).permute(1, 2, 0, 3).contiguous()
        if _factored(quant, grad_scores.device):
            return (_Factored(along_keys.values.view(grad_scores.shape), along_keys.outer),
                    _Factored(as_queries(along_queries.values), along_queries.outer))
        return _Factored(along_keys.dequantize().view(grad_scores.shape)), _Factored(as_queries(along_queries.dequantize()))
    encode = lambda x, amax: fake_quantize(x, fmt, rounding=rounding, generator=generator, tensor_amax=amax)
    return _Factored(encode(grad_scores, amax_keys)), _Factored(encode(grad_scores.transpose(-1, -2), amax_queries))


def _causal_softmax(q_rows: _Factored, k: _Factored, rows: slice) -> torch.Tensor:
    """Softmax of the causal scores of query rows `rows` (q_rows [B, H, rows, D]) over keys [0, rows.stop)
    of k [B, H, T, D]: [B, H, rows, rows.stop]. The keys past the last row would all be masked."""
    keys = k.rows(slice(0, rows.stop))
    scores = _fp4_matmul(q_rows, keys.mT()) / math.sqrt(q_rows.values.shape[-1])
    positions = torch.arange(rows.stop, device=scores.device)
    future = positions > positions[rows, None]
    return torch.softmax(scores.masked_fill(future, -math.inf), dim=-1)


def _bf16_matmul(a: torch.Tensor, b: torch.Tensor, quant: AttentionQuant) -> torch.Tensor:
    """a @ b ([..., m, k] @ [..., k, n]) as a BF16 GEMM with fp32 accumulation and an fp32 result (on
    bf16 tensor cores with `quant.tensor_cores`); exact fp32 when quantization is off."""
    if quant.format is None:
        return a @ b
    a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)
    return bf16_matmul_fp32(a, b) if _factored(quant, a.device) else a.float() @ b.float()


def _fp4_matmul(a: _Factored, b: _Factored) -> torch.Tensor:
    """a @ b of two operands ([..., m, k] @ [..., k, n]) in fp32: decoded values by an fp32 GEMM, or
    block values in bf16 with fp32 accumulation times the product of their outer scales."""
    if a.values.dtype != torch.bfloat16 or b.values.dtype != torch.bfloat16:  # unquantized dS meets a bf16 operand
        return a.decoded() @ b.decoded()
    out, alpha = bf16_matmul_fp32(a.values, b.values), outer_scale_product(a.outer, b.outer)
    return out if alpha is None else out.mul_(alpha)



def _sum_over_group(grad: torch.Tensor, group: int) -> torch.Tensor:
    """[B, H, T, D] per query head to [B, H_kv, T, D]: a shared K/V head gets its group's sum."""
    batch, n_heads, seq, head_dim = grad.shape
    return grad.view(batch, n_heads // group, group, seq, head_dim).sum(dim=2)


# --- FP4 attention as flash attention ------------------------------------------------------------


def flash_fp4_covers(q: torch.Tensor, quant: AttentionQuant) -> bool:
    """Whether `flash_fp4_attention` runs this FP4 attention: quantized operands and dS, the Triton
    kernels on q's device and a head_dim they take; else `fp4_attention` (the chunked path) does."""
    if quant.format is None or quant.ds_rounding is None or not kernels.runs_on(q.device):
        return False
    from fp4lab.numerics.kernels.attention import HEAD_DIMS

    return q.shape[-1] in HEAD_DIMS


def flash_fp4_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, quant: AttentionQuant) -> torch.Tensor:
    """`fp4_attention`'s algorithm as flash attention (numerics.kernels.attention): the same quantized
    operands, never the [T, T] scores. q [B, H, T, D], k and v [B, H_kv, T, D]; where
    `flash_fp4_covers(q, quant)`.

    Q and K are quantized along head_dim (round to nearest) by the fused quantizer, and K, Q again along
    the sequence for the backward from those values, exactly as the chunked path on tensor cores
    quantizes them: the same codes and scales, bit for bit. The kernels take their block values (bf16)
    and apply the outer scales to the GEMMs' fp32 results. dS is quantized inside the backward kernels
    as the fused quantizer quantizes it (NVFP4's tensor scales of the whole dS from a first pass over
    the tiles; SR from Philox, seeds drawn from quant.generator, dS along keys first as in the chunked
    path). What differs is the order of the arithmetic: the online softmax, P rounded to bf16 before its
    normalisation, delta = rowsum(dO O) in place of rowsum(dP P), and GEMMs summed tile by tile, so O,
    dQ, dK, dV are held to bounds (tests/nn/test_fp4_attention_flash.py), not to the chunked path's bits;
    a dS element on a rounding boundary can take the neighbouring code."""
    seq, head_dim = q.shape[-2], q.shape[-1]
    if seq % FP4_BLOCK_MULTIPLE or head_dim % FP4_BLOCK_MULTIPLE:
        return fp4_attention(q, k, v, quant)  # its one-line error names the dimension
    return _FlashFP4Attention.apply(q, k, v, quant)


class _FlashFP4Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, quant: AttentionQuant):
        from fp4lab.numerics.kernels.attention import flash_fp4_forward

        q_q, k_q = _block_values_along_head_dim(q, quant.format), _block_values_along_head_dim(k, quant.format)
        logit_scale = outer_scale_product(q_q.outer, k_q.outer)
        v = v.to(torch.bfloat16).contiguous()
        out, lse2 = flash_fp4_forward(q_q.values, k_q.values, v, logit_scale)
        outers = [o for o in (q_q.outer, k_q.outer) if o is not None]  # NVFP4's, or none (MXFP4)
        ctx.save_for_backward(q_q.values, k_q.values, v, out, lse2, *outers)
        ctx.quant = quant
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        from fp4lab.numerics.kernels.attention import flash_fp4_backward

        q_values, k_values, v, out, lse2, *outers = ctx.saved_tensors
        quant: AttentionQuant = ctx.quant
        q_q, k_q = (_Factored(q_values, outers[0]), _Factored(k_values, outers[1])) if outers else (_Factored(q_values), _Factored(k_values))
        seeds = (None, None)
        if quant.ds_rounding == "sr":  # dS along keys first, then along queries: the chunked path's order
            draw = lambda: torch.randint(2**62, (1,), generator=quant.generator, device=q_values.device)
            seeds = (draw(), draw())
        logit_scale = outer_scale_product(q_q.outer, k_q.outer)
        q_seq, k_seq = (_quantized_along_seq(x.decoded(), quant.format) for x in (q_q, k_q))
        grad_q, grad_k, grad_v = flash_fp4_backward(
            grad_out, q_values, k_values, v, out, lse2, logit_scale, q_seq.values, q_seq.outer, k_seq.values, k_seq.outer,
            quant.format, *seeds,
        )
        return grad_q, grad_k, grad_v, None
