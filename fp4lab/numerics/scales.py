"""Block-scale arithmetic: E8M0 exponents for MXFP4, E4M3 block scales and FP32 outer scales for NVFP4.

Every rule here is computed from float32 bit patterns or with single, correctly rounded float32
operations, so the CPU reference and GPU kernels can agree bit for bit.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E4M3_NAN_BITS = 0x7F
E8M0_BIAS = 127
E8M0_NAN_BITS = 0xFF
FLT_MAX = torch.finfo(torch.float32).max
NVFP4_AMAX_TO_ENCODE = 448.0 * 6.0  # S_enc = 2688 / amax maps the tensor amax to E4M3_MAX * E2M1_MAX

MX_SCALE_MODES = ("floor", "ceil", "even", "rceil")

# The MXFP4 adaptive finer scale (Format-Aware Fusion, section 2.2.1): halve the upward scale when the
# block amax uses less than this fraction of the range it grants.
ADAPTIVE_RATIO = 0.87

_F32_MANTISSA_BITS = 23
_F32_MANTISSA_MASK = (1 << _F32_MANTISSA_BITS) - 1


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2**exponent as float32, exact for integer exponents in [-149, 127] (built from bits)."""
    e = exponent.to(torch.int32)
    normal = ((e.clamp(min=-126) + 127) << _F32_MANTISSA_BITS).view(torch.float32)
    subnormal = (torch.ones_like(e) << (e.clamp(-149, -127) + 149)).view(torch.float32)
    return torch.where(e >= -126, normal, subnormal)


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) for positive finite float32 x (int32); zero gives a very negative value.

    Unlike `torch.ceil(torch.log2(x))`, this never mis-rounds a value a few ulps above a power of
    two, which is what the hardware's round-up conversion (cvt.rp ... ue8m0) computes.
    """
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2**exponent, mantissa in [0.5, 1)
    result = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.where(x > 0, result, torch.full_like(result, -1000))


def mx_exponent(amax: torch.Tensor, mode: str, *, adaptive: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block MXFP4 scale from the block amax (float32, finite or NaN).

    Returns (biased E8M0 byte as uint8, float32 multiplier that takes a block value to E2M1 units).
    floor/ceil/even follow torchao's ScaleCalculationMode bit for bit, including its encode scale
    floor of 2**-126 for byte 0; rceil is ceil(log2(amax / 6)) with the division rounded in float32,
    and byte 0 encodes with multiplier 1 (TE and torchao flush such blocks to zero).
    """
    bits = amax.view(torch.int32)
    if mode == "rceil":
        exponent = ceil_log2(amax / 6.0).clamp(-E8M0_BIAS, E8M0_BIAS)
        if adaptive:
            unused_range = amax / (6.0 * pow2(exponent)) < ADAPTIVE_RATIO
            exponent = torch.where(unused_range & (exponent > 1 - E8M0_BIAS), exponent - 1, exponent)
        biased = (exponent + E8M0_BIAS).to(torch.uint8)
        multiplier = torch.where(biased == 0, 1.0, pow2(-exponent))
    else:
        if mode == "even":
            # Add half an E2M1 mantissa step below the float32 mantissa: carries into the exponent
            # iff the significand is >= 1.75, i.e. iff amax would round up to the next binade.
            bits = (bits + (1 << (_F32_MANTISSA_BITS - 2))) & ~_F32_MANTISSA_MASK
        floor_log2 = ((bits >> _F32_MANTISSA_BITS) & 0xFF) - E8M0_BIAS
        if mode == "ceil":
            floor_log2 = floor_log2 + ((bits & _F32_MANTISSA_MASK) > 0).to(torch.int32)
        exponent = (floor_log2 - 2).clamp(-E8M0_BIAS, E8M0_BIAS + 1)  # emax of E2M1 is 2
        biased = (exponent + E8M0_BIAS).to(torch.uint8)
        multiplier = 1.0 / pow2(exponent).clamp(min=2.0**-126)
    nan = torch.isnan(amax)
    biased = torch.where(nan, E8M0_NAN_BITS, biased).to(torch.uint8)
    return biased, torch.where(nan, 0.0, multiplier)


def e8m0_decode(biased: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes to float32 scales: 2**(byte - 127); 0xFF is NaN."""
    scale = pow2(biased.to(torch.int32) - E8M0_BIAS)
    return torch.where(biased == E8M0_NAN_BITS, float("nan"), scale)


def e4m3_encode(x: torch.Tensor) -> torch.Tensor:
    """float32 to E4M3 bits: round to nearest even, saturating at 448, subnormals kept, NaN -> 0x7F."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_decode(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float8_e4m3fn).to(torch.float32)


def nvfp4_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """TE's global encode scale S_enc = min(2688 / amax, FLT_MAX), and 1 where amax or S_enc is 0."""
    # Divide tensor by tensor: `python_scalar / tensor` is computed by torch as reciprocal(amax) * 2688,
    # two roundings that give a 1-ulp different S_enc for about a quarter of all amax values.
    s_enc = torch.clamp(torch.full_like(amax, NVFP4_AMAX_TO_ENCODE) / amax, max=FLT_MAX)
    return torch.where((amax == 0) | (s_enc == 0), 1.0, s_enc)
