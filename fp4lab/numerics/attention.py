"""The attention probes' math, the torch reference of `numerics.kernels.attention`'s statistics.

Over causal attention's logits s_ij = q_i.k_j / sqrt(head_dim), j <= i: `max_attention_logits`, the
per-head max logit S_max^h (the QK-Clip trigger, Kimi K2), and `attention_entropy`, the per-head mean
attention entropy (Zhai et al. 2023). Both read fp32 logits in chunks of query rows, never all
[T, T] at once; `nn.attention.Attention` computes them beside SDPA, and the Triton flash attention
computes the same statistics online.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

# A probe materialises at most this many fp32 logits at once (64 MiB), whatever the model size.
PROBE_CHUNK_ELEMENTS = 1 << 24


def _causal_logit_chunks(
    q: torch.Tensor, k: torch.Tensor, max_elements: int
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """Yield (query heads, logits, causal mask) in chunks of query rows, each row with all its keys.

    q [B, H, T, D], k [B, H_kv, T, D]. A chunk holds the logits of one KV group's query heads for some
    query rows: [B, group, rows, keys] with masked logits at -inf. Whole rows keep softmax exact.
    """
    batch, n_heads, seq, head_dim = q.shape
    group = n_heads // k.shape[1]
    rows_per_chunk = max(1, max_elements // (batch * group * seq))
    positions = torch.arange(seq, device=q.device)
    for kv_head in range(k.shape[1]):
        heads = slice(kv_head * group, (kv_head + 1) * group)
        keys = k[:, kv_head : kv_head + 1].float()
        for start in range(0, seq, rows_per_chunk):
            stop = min(start + rows_per_chunk, seq)
            logits = q[:, heads, start:stop].float() @ keys[:, :, :stop].transpose(-1, -2) / math.sqrt(head_dim)
            causal = positions[:stop] <= positions[start:stop, None]
            yield heads, logits.masked_fill(~causal, -math.inf), causal


@torch.no_grad()
def max_attention_logits(q: torch.Tensor, k: torch.Tensor, max_elements: int = PROBE_CHUNK_ELEMENTS) -> torch.Tensor:
    """S_max^h = max over batch and causal (i, j) of q_i.k_j / sqrt(head_dim): fp32 [n_heads], detached."""
    result = torch.full((q.shape[1],), -math.inf, device=q.device)
    for heads, logits, _ in _causal_logit_chunks(q.detach(), k.detach(), max_elements):
        result[heads] = torch.maximum(result[heads], logits.amax(dim=(0, 2, 3)))
    return result


@torch.no_grad()
def attention_entropy(q: torch.Tensor, k: torch.Tensor, max_elements: int = PROBE_CHUNK_ELEMENTS) -> torch.Tensor:
    """Per head, the mean over batch and query rows of -sum_j p_ij log p_ij (nats): fp32 [n_heads]."""
    batch, n_heads, seq, _ = q.shape
    total = torch.zeros(n_heads, device=q.device)
    for heads, logits, causal in _causal_logit_chunks(q.detach(), k.detach(), max_elements):
        log_p = torch.log_softmax(logits, dim=-1)
        # Masked entries have p = 0 and log p = -inf; their 0 * log 0 term is 0 by definition.
        p_log_p = torch.where(causal, log_p.exp() * log_p, 0.0)
        total[heads] -= p_log_p.sum(dim=(0, 2, 3))
    return total / (batch * seq)
