"""Quantization error of one tensor under every format x scale mode x rounding x transform.

This is what `fp4lab numerics` prints: a researcher's first look at how a real tensor (an
activation, a gradient, a weight) survives each FP4 contract, beside the FP8 baselines (E4M3 / E5M2
with a per-tensor or per-row current scale, rounded to nearest only).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch

from fp4lab.numerics.fp8 import Fp8Tensor, fp8_quantize
from fp4lab.numerics.hadamard import hadamard, hadamard_full, hadamard_signs
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.quantize import quantize
from fp4lab.numerics_choices import DISTRIBUTIONS

# (label, fmt, scale_mode): every scale contract the numerics core implements.
SCALE_CONTRACTS = (
    ("nvfp4", "nvfp4", None),
    ("nvfp4_cta", "nvfp4_cta", None),
    ("mxfp4", "mxfp4", "floor"),
    ("mxfp4", "mxfp4", "ceil"),
    ("mxfp4", "mxfp4", "even"),
    ("mxfp4", "mxfp4", "rceil"),
    ("fp8", "fp8", "e4m3 tensor"),
    ("fp8", "fp8", "e4m3 row"),
    ("fp8", "fp8", "e5m2 tensor"),
    ("fp8", "fp8", "e5m2 row"),
)
ROUNDING_MODES = ("rtn", "sr")
# RHTfull: random signs over the whole last dim, zero-padded to a power of two (OptiTrain-FP4).
TRANSFORMS = ("none", "H16", "H32", "RHT16", "RHTfull")


@dataclass(frozen=True)
class ErrorStats:
    """rel_rms = ||x^ - x|| / ||x||; snr_db = -20 log10(rel_rms); bias = mean((x^ - x) sign(x)) /
    mean|x| (negative: values shrink toward zero); saturated = fraction clipped at the block's
    largest code; flushed = fraction of nonzero values decoded as 0. All fractions of elements."""

    rel_rms: float
    snr_db: float
    bias: float
    saturated: float
    flushed: float


@dataclass(frozen=True)
class SurveyRow:
    format: str
    scale_mode: str
    rounding: str
    transform: str
    stats: ErrorStats

    def as_dict(self) -> dict:
        row = {k: v for k, v in asdict(self).items() if k != "stats"}
        return row | asdict(self.stats)


def error_stats(
    x: torch.Tensor, q: QTensor | Fp8Tensor, *, original: torch.Tensor | None = None, reconstructed: torch.Tensor | None = None
) -> ErrorStats:
    """Error of `q`, a quantization of `x`. Saturation and flushing are counted where they happen
    (against x); error and bias compare `reconstructed` with `original` (default: q.dequantize()
    with x), so a caller that transformed x first passes the untransformed pair."""
    x = x.to(torch.float32)
    decoded = q.dequantize()
    original = x if original is None else original.to(torch.float32)
    reconstructed = decoded if reconstructed is None else reconstructed.to(torch.float32)
    err = reconstructed - original
    norm = original.norm().item()
    rel = err.norm().item() / norm if norm > 0 else 0.0
    mean_abs = original.abs().mean().item()
    saturated, flushed = clip_flush_fractions(x, q, decoded).tolist()
    return ErrorStats(
        rel_rms=rel,
        snr_db=-20.0 * math.log10(rel) if rel > 0 else math.inf,
        bias=(err * torch.sign(original)).mean().item() / mean_abs if mean_abs > 0 else 0.0,
        saturated=saturated,
        flushed=flushed,
    )


def clip_flush_fractions(x: torch.Tensor, q: QTensor | Fp8Tensor, decoded: torch.Tensor | None = None) -> torch.Tensor:
    """[saturated, flushed] of `q`, a quantization of `x` (ErrorStats' two fractions), as a float32
    tensor on x's device: no host sync, since a probe step of a training run records hundreds of
    operands and reads them back at once. `decoded`: q.dequantize(), where the caller has it."""
    return count_fractions(clip_flush_counts(x, q, decoded), x.numel())


def clip_flush_counts(x: torch.Tensor, q: QTensor | Fp8Tensor, decoded: torch.Tensor | None = None) -> torch.Tensor:
    """The int64 numbers of saturated and of flushed elements of `q`, a quantization of `x`: an
    element is saturated where its code is the format's largest magnitude and decodes below |x|,
    flushed where it decodes to 0 from a nonzero x. The fused quantizers count the same (`stats`)."""
    x = x.to(torch.float32)
    decoded = q.dequantize() if decoded is None else decoded
    if isinstance(q, Fp8Tensor):  # the largest FP8 magnitude, where the clamp before the cast lands
        top = q.data.to(torch.float32).abs() == q.max_value
    else:
        top = (q.codes() & 0x7) == 0x7
    clipped = top & (decoded.abs() < x.abs()) & (decoded != 0)
    flushed = (decoded == 0) & (x != 0)
    return torch.stack((clipped.sum(), flushed.sum()))


def count_fractions(counts: torch.Tensor, numel: int) -> torch.Tensor:
    """Counts of `numel` elements as float32 fractions, each the one rounding of the exact quotient
    (counts are exact in float64 below 2^53), on the counts' device."""
    return (counts.to(torch.float64) / max(numel, 1)).to(torch.float32)


def synthesize(dist: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """A synthetic tensor: "normal"; "student-t" (3 degrees of freedom, heavy tails); "outlier"
    (normal with 1% of the channels, i.e. columns, scaled by 30, as in LLM activations)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g)
    if dist == "normal":
        return x
    if dist == "student-t":
        chi2 = torch.randn(rows, cols, 3, generator=g).pow(2).sum(-1)
        return x / torch.sqrt(chi2 / 3.0)
    if dist == "outlier":
        n_outliers = max(1, cols // 100)
        channels = torch.randperm(cols, generator=g)[:n_outliers]
        x[:, channels] *= 30.0
        return x
    raise ValueError(f"synthesize: dist={dist!r} is not supported; allowed: {', '.join(DISTRIBUTIONS)}")


def survey_cases() -> list[tuple[str, str, str | None, str, str]]:
    return [
        (label, fmt, mode, rounding, transform)
        for label, fmt, mode in SCALE_CONTRACTS
        for rounding in ROUNDING_MODES
        for transform in TRANSFORMS
        if fmt != "fp8" or rounding == "rtn"  # FP8 casts round to nearest even only
    ]


def survey(x: torch.Tensor, *, seed: int = 0, on_case: Callable[[], None] | None = None) -> Iterator[SurveyRow]:
    """Quantize x (viewed as 2D along its last dim) under every survey case; yield one row each.

    Stochastic rounding and random Hadamard signs draw from generators seeded with `seed`, so two
    surveys of the same tensor agree exactly.
    """
    x2d = x.to(torch.float32).reshape(-1, x.shape[-1])
    for label, fmt, mode, rounding, transform in survey_cases():
        g = torch.Generator().manual_seed(seed)
        size, signs = _transform(transform, g, x2d.shape[-1])
        if transform == "RHTfull":
            xt = hadamard_full(x2d, signs)
        else:
            xt = hadamard(x2d, size, signs) if size else x2d
        if fmt == "fp8":
            element, scaling = mode.split()
            q = fp8_quantize(xt, element, scaling)
        else:
            q = quantize(xt, fmt, rounding=rounding, scale_mode=mode, generator=g)
        back = None
        if transform == "RHTfull":  # undo U and drop the zero padding
            back = hadamard_full(q.dequantize(), signs, inverse=True)[:, : x2d.shape[-1]]
        elif size:
            back = hadamard(q.dequantize(), size, signs, inverse=True)
        stats = error_stats(xt, q, original=x2d, reconstructed=back)
        yield SurveyRow(label, mode or "-", rounding, transform, stats)
        if on_case is not None:
            on_case()


def _transform(name: str, g: torch.Generator, length: int) -> tuple[int, torch.Tensor | str]:
    if name == "none":
        return 0, "none"
    if name == "RHTfull":
        size = 1 << (length - 1).bit_length()
        return size, hadamard_signs(size, "random", g)
    if name.startswith("RHT"):
        size = int(name[3:])
        return size, hadamard_signs(size, "random", g)
    return int(name[1:]), "fixed"
