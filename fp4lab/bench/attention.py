"""Attention benchmark: fp4lab's Triton flash attention, which also yields the per-head max logit and
entropy (fp4lab.numerics.kernels.attention), against PyTorch's SDPA (its flash backend on CUDA), forward and
backward of causal GQA attention on bf16 tensors of one shape.

SDPA alone computes neither probe, so the ratio is what the fused statistics cost on top of the best
attention PyTorch ships, plus whatever the Triton kernel loses to it; with the statistics computed
beside SDPA instead (the "sdpa" path of `Attention` on a probing step) every probe materialises fp32
logits chunk by chunk, which `sdpa_with_probes_ms` times for the same shape. Each time is the median
over `repeats` replays of a CUDA graph of several calls (as in `fp4lab.bench.kernels`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from fp4lab.bench.kernels import _median_ms


@dataclass(frozen=True)
class AttentionBench:
    batch: int
    heads: int
    kv_heads: int
    seq: int
    head_dim: int
    device: str
    sdpa_ms: float
    fused_ms: float
    fused_poly_ms: float
    sdpa_with_probes_ms: float

    @property
    def fused_vs_sdpa(self) -> float:
        """The issue's figure: fwd + bwd time with the fused statistics over SDPA's (goal <= 1.10)."""
        return self.fused_ms / self.sdpa_ms

    @property
    def fused_poly_vs_sdpa(self) -> float:
        return self.fused_poly_ms / self.sdpa_ms

    def as_dict(self) -> dict:
        return asdict(self) | {"fused_vs_sdpa": self.fused_vs_sdpa, "fused_poly_vs_sdpa": self.fused_poly_vs_sdpa}


# (batch, heads, kv_heads, seq, head_dim): 16k tokens per shape, head dims 64 (125m: 12 heads of 64)
# and 128, sequences 1024 to 8192.
ATTENTION_SHAPES = (
    (16, 12, 4, 1024, 64),
    (4, 12, 4, 4096, 64),
    (2, 12, 4, 8192, 64),
    (16, 8, 2, 1024, 128),
    (4, 8, 2, 4096, 128),
    (2, 8, 2, 8192, 128),
)


def bench_attention(
    batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, device: torch.device, repeats: int = 20
) -> AttentionBench | None:
    """Forward and backward of each attention on one shape; None off CUDA or without Triton."""
    from fp4lab.train.paths import gpu_kernels_run

    if not gpu_kernels_run(device):
        return None
    from fp4lab.numerics.attention import attention_entropy, max_attention_logits
    from fp4lab.numerics.kernels.attention import flash_attention

    g = torch.Generator().manual_seed(0)

    def tensor(n_heads: int) -> torch.Tensor:
        return torch.randn(batch, n_heads, seq, head_dim, generator=g).to(device, torch.bfloat16).requires_grad_()

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    grad = torch.randn(batch, heads, seq, head_dim, generator=g).to(device, torch.bfloat16)

    def sdpa() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.autograd.backward(out, grad)

    def sdpa_with_probes() -> None:
        max_attention_logits(q, k)
        attention_entropy(q[:2], k[:2])
        sdpa()

    def fused(exp2_poly: bool):
        def step() -> None:
            out = flash_attention(q, k, v, probe_batch=2, exp2_poly=exp2_poly).out
            torch.autograd.backward(out, grad)

        return step

    return AttentionBench(
        batch, heads, kv_heads, seq, head_dim, str(device),
        sdpa_ms=_median_ms(sdpa, device, repeats),
        fused_ms=_median_ms(fused(False), device, repeats),
        fused_poly_ms=_median_ms(fused(True), device, repeats),
        sdpa_with_probes_ms=_median_ms(sdpa_with_probes, device, repeats),
    )
