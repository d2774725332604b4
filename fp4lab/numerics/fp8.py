"""FP8 (E4M3 / E5M2) with current scaling, one scale per tensor or per row: the float8 training recipes
of TransformerEngine (Float8CurrentScaling) and torchao (float8 dynamic scaling, tensorwise or rowwise).

The chain, torchao's `tensor_to_scale` and `hp_tensor_and_scale_to_float8` (float8_utils.py), bit for bit:

    amax   = max |x| over the tensor ("tensor") or over each row's last dim ("row", shape [..., 1])
    scale  = float32(fp8_max / max(amax, 1e-12))   divided in float64, rounded once to float32
    pow2:    scale = 2^floor(log2(scale))          optional: rounded down to a power of two
    data   = fp8(clamp(x * scale, -fp8_max, fp8_max))   x * scale in float32, then round to nearest even
    decode = float32(data) / scale

fp8_max is 448 for E4M3 (float8_e4m3fn) and 57344 for E5M2. The power-of-two scale is torchao's
`round_scales_to_power_of_2` (its rowwise recipe's default), rounded down exactly (the float32 exponent
kept, the mantissa cleared): torchao's exp2(floor(log2(scale))) in float32 returns 2^k for a scale an
ulp below 2^k once |k| >= 4 (its float32 log2 rounds up to k), where this returns 2^(k-1). The eps
keeps an all-zero tensor (or row) finite: its scale is fp8_max * 1e12 and it decodes to zeros. A NaN
or Inf poisons its whole tensor (or row), as a NaN poisons its FP4 block: a NaN amax gives a NaN scale,
an Inf amax a zero scale, and either way every element of that tensor (row) decodes to NaN, so the loss
shows it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4lab.numerics.qtensor import FactoredValues

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_ELEMENTS = tuple(FP8_DTYPES)
FP8_SCALINGS = ("tensor", "row")
AMAX_EPS = 1e-12  # torchao.float8.float8_utils.EPS
_F32_MANTISSA = (1 << 23) - 1
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Fp8Tensor:
    """x in FP8: `data` (float8, x's shape) and the float32 `scale` that multiplied x before the cast
    (0-dim per tensor, [..., 1] per row)."""

    data: torch.Tensor
    scale: torch.Tensor
    element: str
    scaling: str

    @property
    def max_value(self) -> float:
        return torch.finfo(self.data.dtype).max

    def dequantize(self) -> torch.Tensor:
        return self.data.to(torch.float32) / self.scale

    def factored(self) -> FactoredValues:
        """The FP8 values (exact in bf16: 4 significant bits at most) and the decode scale 1 / scale,
        which varies only along the rows and so multiplies a GEMM's result in its epilogue, as a
        float8 scaled_mm applies its scales. values * outer may differ from `dequantize()` by one
        rounding (a product by the reciprocal, not a quotient)."""
        return FactoredValues(self.data.to(torch.float32), 1.0 / self.scale)


def fp8_amax(x: torch.Tensor, scaling: str = "tensor") -> torch.Tensor:
    """The amax behind x's current scale: max |x| (0-dim) for "tensor", over each row's last dim
    ([..., 1]) for "row"; NaN where a NaN is inside."""
    magnitude = x.to(torch.float32).abs()
    return magnitude.max() if scaling == "tensor" else magnitude.amax(dim=-1, keepdim=True)


def fp8_scale(
    x: torch.Tensor, element: str = "e4m3", scaling: str = "tensor", *, pow2: bool = False, amax: torch.Tensor | None = None
) -> torch.Tensor:
    """The current scale of x (module docstring): 0-dim for "tensor", [..., 1] for "row". `amax`:
    this amax (`fp8_amax`'s shape) instead of x's own, e.g. that of a whole weight for one shard of it."""
    check_arguments(x, element, scaling)
    amax = fp8_amax(x, scaling) if amax is None else amax.to(torch.float32)
    fp8_max = torch.finfo(FP8_DTYPES[element]).max
    scale = (fp8_max / amax.to(torch.float64).clamp(min=AMAX_EPS)).to(torch.float32)
    if pow2:  # clearing a NaN's mantissa would make it Inf
        scale = torch.where(torch.isnan(scale), scale, (scale.view(torch.int32) & ~_F32_MANTISSA).view(torch.float32))
    return scale


def fp8_quantize(
    x: torch.Tensor, element: str = "e4m3", scaling: str = "tensor", *, pow2: bool = False, amax: torch.Tensor | None = None
) -> Fp8Tensor:
    """x in FP8 with a current per-tensor or per-row scale (module docstring); `pow2` rounds the
    scale down to a power of two; `amax` as for `fp8_scale`."""
    scale = fp8_scale(x, element, scaling, pow2=pow2, amax=amax)
    dtype = FP8_DTYPES[element]
    fp8_max = torch.finfo(dtype).max
    # Clamp first: a cast does not saturate in every torch version; a NaN stays NaN.
    data = (x.to(torch.float32) * scale).clamp(min=-fp8_max, max=fp8_max).to(dtype)
    return Fp8Tensor(data, scale, element, scaling)


def check_arguments(x: torch.Tensor, element: str, scaling: str) -> None:
    """ValueError naming what `fp8_quantize` cannot take."""
    if not isinstance(x, torch.Tensor) or x.dtype not in INPUT_DTYPES:
        raise ValueError("fp8_quantize: x must be a float32, bfloat16 or float16 torch.Tensor")
    if element not in FP8_DTYPES:
        raise ValueError(f"fp8_quantize: element={element!r} is not supported; allowed: {', '.join(FP8_ELEMENTS)}")
    if scaling not in FP8_SCALINGS:
        raise ValueError(f"fp8_quantize: scaling={scaling!r} is not supported; allowed: {', '.join(FP8_SCALINGS)}")
    if scaling == "row" and x.dim() == 0:
        raise ValueError("fp8_quantize: scaling='row' needs x with at least one dim (rows along the last)")
    if x.numel() == 0:
        raise ValueError("fp8_quantize: x is empty; an empty tensor has no amax")
