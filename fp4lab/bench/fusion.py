"""Producer fusion benchmark: the fused FP4 producers of numerics.kernels.fusion against the ops they
replace (CUDA only).

For one [tokens, features] shape and one format, three ways to make each producer's GEMM operand:

- unfused: the model's torch ops, each a kernel writing its output to HBM, then `quantize_fused`
  (itself fused: one read, or two for NVFP4's amax);
- compiled: the same torch ops under `torch.compile` (Inductor fuses silu * up, or the add and the
  RMSNorm, into one kernel), then `quantize_fused`: what compile already gives without our kernels;
- fused: the triton_fusion kernel (no intermediate written, the quantizer reads registers).

Producers: "swiglu" (silu(gate) * up, bf16, quantized along the last dim: W2's Fprop x),
"residual_rmsnorm" (bf16 branch + fp32 residual, nn.RMSNorm's F.rms_norm with an fp32 gain, the sum
quantized: the next GEMMs' x; the fused kernel also writes s and rstd, which the unfused path writes
as s and keeps inside rms_norm), and "swiglu_backward" (d_gate, d_up from grad_h, gate, up in bf16, as
autograd computes them; no quantization). Times are medians over `repeats` replays of CUDA graphs
(fp4lab.bench.kernels' timing), so launch overhead is not counted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from fp4lab.bench.kernels import _median_ms

PRODUCERS = ("swiglu", "residual_rmsnorm", "swiglu_backward")
NORM_EPS = 1e-5


@dataclass(frozen=True)
class ProducerTiming:
    unfused_ms: float
    compiled_ms: float
    fused_ms: float

    @property
    def gain(self) -> float:
        """How many times faster the fused kernel is than the unfused ops."""
        return self.unfused_ms / self.fused_ms

    @property
    def gain_over_compiled(self) -> float:
        """How many times faster the fused kernel is than torch.compile's fusion of the same ops."""
        return self.compiled_ms / self.fused_ms

    def as_dict(self) -> dict:
        return asdict(self) | {"gain": self.gain, "gain_over_compiled": self.gain_over_compiled}


@dataclass(frozen=True)
class ProducerFusionBench:
    fmt: str
    tokens: int
    features: int
    device: str
    timings: dict[str, ProducerTiming]  # by producer name (PRODUCERS)

    def as_dict(self) -> dict:
        return {"fmt": self.fmt, "tokens": self.tokens, "features": self.features, "device": self.device} | {
            name: timing.as_dict() for name, timing in self.timings.items()
        }


def bench_producer_fusion(
    shape: tuple[int, int], fmt: str, device: torch.device, repeats: int = 20, producers: tuple[str, ...] = PRODUCERS
) -> ProducerFusionBench | None:
    """Time each of `producers` unfused, compiled and fused on a [tokens, features] shape (features a
    multiple of the format's block). None off CUDA or without Triton: the fused kernels are CUDA
    kernels, and a CPU time of Triton's interpreter would measure nothing."""
    from fp4lab.train.paths import gpu_kernels_run

    if not gpu_kernels_run(torch.device(device)):
        return None
    from fp4lab.numerics.kernels.fusion import (
        residual_rmsnorm_quantize_fused,
        swiglu_backward_fused,
        swiglu_quantize_fused,
    )
    from fp4lab.numerics.kernels.quantize import quantize_fused

    device = torch.device(device)
    tokens, features = shape
    g = torch.Generator().manual_seed(0)
    gate, up, grad_h, branch = (torch.randn(shape, generator=g).to(device, torch.bfloat16) for _ in range(4))
    residual = torch.randn(shape, generator=g).to(device)
    weight = (1 + torch.randn(features, generator=g) / 4).to(device)

    def swiglu(gate, up):
        return F.silu(gate) * up

    def residual_rmsnorm(branch, residual, weight):
        s = residual + branch
        return s, F.rms_norm(s, (features,), weight, NORM_EPS)

    def swiglu_backward(grad_h, gate, up):
        return torch.ops.aten.silu_backward(grad_h * up, gate), grad_h * F.silu(gate)

    compiled = {name: torch.compile(fn, dynamic=False) for name, fn in (("swiglu", swiglu), ("residual_rmsnorm", residual_rmsnorm), ("swiglu_backward", swiglu_backward))}  # compiled on first call: only those timed
    calls = {
        "swiglu": (
            lambda: quantize_fused(swiglu(gate, up), fmt=fmt),
            lambda: quantize_fused(compiled["swiglu"](gate, up), fmt=fmt),
            lambda: swiglu_quantize_fused(gate, up, fmt=fmt),
        ),
        "residual_rmsnorm": (
            lambda: quantize_fused(residual_rmsnorm(branch, residual, weight)[1], fmt=fmt),
            lambda: quantize_fused(compiled["residual_rmsnorm"](branch, residual, weight)[1], fmt=fmt),
            lambda: residual_rmsnorm_quantize_fused(branch, residual, weight, NORM_EPS, fmt=fmt),
        ),
        "swiglu_backward": (
            lambda: swiglu_backward(grad_h, gate, up),
            lambda: compiled["swiglu_backward"](grad_h, gate, up),
            lambda: swiglu_backward_fused(grad_h, gate, up),
        ),
    }
    unknown = set(producers) - set(PRODUCERS)
    if unknown:
        raise ValueError(f"bench_producer_fusion: unknown producers {sorted(unknown)}; known: {', '.join(PRODUCERS)}")
    timings = {
        name: ProducerTiming(*(_median_ms(fn, device, repeats) for fn in calls[name])) for name in producers
    }
    return ProducerFusionBench(fmt, tokens, features, str(device), timings)
