"""Independent references shared by the numerics tests.

Nothing here imports fp4lab: every rule is re-derived from the formulas in the FP4 numerics
reference (TE's NVFP4 chain, the OCP/torchao MX scale modes), in numpy float32 or exact Python
arithmetic, so a test that compares fp4lab against these helpers compares two implementations.
torchao 0.18 is wrapped here too, as the bitwise oracle for MXFP4 and the E2M1 cast.
"""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import torch

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, pack_uint4, unpack_uint4
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_VALUES = E2M1_GRID + tuple(-v for v in E2M1_GRID)  # decode table, code 0..15
MX_MODES = ("floor", "ceil", "even", "rceil")
TORCHAO_MODE = {
    "floor": ScaleCalculationMode.FLOOR,
    "ceil": ScaleCalculationMode.CEIL,
    "even": ScaleCalculationMode.EVEN,
    "rceil": ScaleCalculationMode.RCEIL,
}

__all__ = [
    "f32_to_f4_unpacked",
    "pack_uint4",
    "unpack_uint4",
]


# ----------------------------------------------------------------------------------------------
# E2M1
# ----------------------------------------------------------------------------------------------


def e2m1_rne(x) -> np.ndarray:
    """E2M1 codes of float32 values: nearest grid value, ties to the even code, saturate at 6.

    Works on exact float64 copies of the float32 inputs (every float32 and every midpoint is exact
    in float64). The sign bit comes from signbit, so -0.0 and tiny negatives give 0x8.
    """
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    grid = np.array(E2M1_GRID)
    lo = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, 7)  # largest grid index <= a
    hi = np.minimum(lo + 1, 7)
    mid = (grid[lo] + grid[hi]) / 2
    up = (lo < 7) & ((a > mid) | ((a == mid) & (hi % 2 == 0)))
    code = np.where(up, hi, lo).astype(np.uint8)
    return code | (np.signbit(x).astype(np.uint8) << 3)


def e2m1_decode(codes) -> np.ndarray:
    return np.array(E2M1_VALUES, dtype=np.float32)[np.asarray(codes).astype(np.int64) & 0xF]


def grid_neighbours(v) -> tuple[np.ndarray, np.ndarray]:
    """The E2M1 magnitudes lo <= |v| <= hi bracketing |v| (|v| clamped to 6); lo == hi on the grid."""
    a = np.minimum(np.abs(np.asarray(v, dtype=np.float64)), 6.0)
    grid = np.array(E2M1_GRID)
    lo_i = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, 7)
    hi_i = np.clip(np.searchsorted(grid, a, side="left"), 0, 7)
    return grid[lo_i], grid[hi_i]


def grid_step(scaled_magnitude) -> np.ndarray:
    """Spacing of the E2M1 grid around a magnitude in [0, 6]: 0.5 below 2, 1 in [2, 4), 2 above."""
    a = np.asarray(scaled_magnitude, dtype=np.float64)
    return np.where(a < 2, 0.5, np.where(a < 4, 1.0, 2.0))


# ----------------------------------------------------------------------------------------------
# E4M3 (float8_e4m3fn): bias 7, 3 mantissa bits, max 448 (0x7E), 0x7F NaN, subnormal step 2^-9
# ----------------------------------------------------------------------------------------------


def e4m3_rne_satfinite(x) -> np.ndarray:
    """float32 -> E4M3 bytes, round to nearest even, saturating at +-448 (satfinite). NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x).astype(np.float64)
    finite = np.isfinite(a)
    a = np.where(finite, np.minimum(a, 448.0), 0.0)
    _, e = np.frexp(a)  # a = m * 2**e, m in [0.5, 1)
    exp = np.maximum(e - 1, -6)  # unbiased exponent of a's binade; subnormals share 2^-6's step
    step = np.ldexp(1.0, exp - 3)  # 3 mantissa bits
    q = np.rint(a / step) * step  # a / step is exact: rint is round-half-even
    q = np.minimum(q, 448.0)
    # encode q (exactly representable now)
    _, qe = np.frexp(q)
    qexp = qe - 1
    normal = q >= 2.0**-6
    mant_normal = np.where(normal, q / np.ldexp(1.0, qexp) - 1.0, 0.0) * 8
    bits_normal = ((qexp + 7) << 3) + mant_normal.astype(np.int64)
    bits_sub = (q / 2.0**-9).astype(np.int64)
    bits = np.where(normal, bits_normal, bits_sub).astype(np.uint8)
    bits = bits | (np.signbit(x).astype(np.uint8) << 7)
    return np.where(np.isnan(x), np.uint8(0x7F), bits).astype(np.uint8)


def e4m3_decode(bits) -> np.ndarray:
    b = np.asarray(bits).astype(np.int64)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e = (b >> 3) & 0xF
    m = b & 0x7
    mag = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * np.ldexp(1.0, e - 7))
    out = sign * mag
    out = np.where((b & 0x7F) == 0x7F, np.nan, out)
    return out.astype(np.float32)


# ----------------------------------------------------------------------------------------------
# Blocks and tiles
# ----------------------------------------------------------------------------------------------


def to_blocks(x: np.ndarray, block: int, tile=None) -> np.ndarray:
    """[..., K] -> [nblocks, block] (1D) or [R, C] -> [R/th * C/tw, th*tw] (2D tiles, row-major tiles)."""
    if tile is None:
        return x.reshape(-1, block)
    th, tw = tile
    r, c = x.shape
    return x.reshape(r // th, th, c // tw, tw).transpose(0, 2, 1, 3).reshape(-1, th * tw)


def from_blocks(b: np.ndarray, shape, tile=None) -> np.ndarray:
    if tile is None:
        return b.reshape(shape)
    th, tw = tile
    r, c = shape
    return b.reshape(r // th, c // tw, th, tw).transpose(0, 2, 1, 3).reshape(r, c)


def to_numpy_f32(x: torch.Tensor) -> np.ndarray:
    return x.detach().to(torch.float32).cpu().numpy()


# ----------------------------------------------------------------------------------------------
# NVFP4: TransformerEngine's chain, written out in numpy float32
# ----------------------------------------------------------------------------------------------


def nvfp4_te_reference(x, *, tile=None, tensor_amax=None, block: int = 16):
    """TE NVFP4 quantization of finite `x` (torch or numpy), from the formulas.

    S_enc = min(2688 / amax, FLT_MAX) (1 if amax == 0 or S_enc == 0);
    s_b   = e4m3_rne_satfinite(min(bamax * (S_enc * fp32(1/6)), 448))     one fp32 rounding of the product
    enc_b = min(1 / (fp32(s_b) * fp32(1 / S_enc)), FLT_MAX)
    q_i   = E2M1_RNE(clamp(x_i * enc_b, -6, 6))

    Returns dict(codes [x.shape] uint8, scales uint8 ([..., K/16] or [R/th, C/tw]),
    tensor_scale float32 (= fp32(1/S_enc)), scaled float32 (x * enc_b after the clamp, x's shape)).
    """
    xn = to_numpy_f32(x) if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        if tensor_amax is None:
            amax_t = F32(np.abs(xn).max()) if xn.size else F32(0)
        else:
            amax_t = F32(tensor_amax)
        s_enc = np.minimum(F32(448 * 6) / amax_t, FLT_MAX)
        if amax_t == 0 or s_enc == 0:
            s_enc = F32(1)
        s_enc = F32(s_enc)
        inv6 = F32(1) / F32(6)
        blocks = to_blocks(xn, block, tile)
        bamax = np.abs(blocks).max(axis=1, keepdims=True).astype(np.float32)
        scale_bits = e4m3_rne_satfinite(np.minimum(bamax * F32(s_enc * inv6), F32(448)))
        s_b = e4m3_decode(scale_bits)
        enc = np.minimum(F32(1) / (s_b * (F32(1) / s_enc)), FLT_MAX).astype(np.float32)
        scaled = np.clip(blocks * enc, F32(-6), F32(6)).astype(np.float32)
    codes = e2m1_rne(scaled)
    if tile is None:
        scale_shape = (*xn.shape[:-1], xn.shape[-1] // block)
    else:
        scale_shape = (xn.shape[0] // tile[0], xn.shape[1] // tile[1])
    return {
        "codes": from_blocks(codes, xn.shape, tile),
        "scales": scale_bits.reshape(scale_shape),
        "tensor_scale": F32(F32(1) / s_enc),
        "scaled": from_blocks(scaled, xn.shape, tile),
    }


# ----------------------------------------------------------------------------------------------
# MXFP4: scale exponents from exact arithmetic, and the torchao oracle
# ----------------------------------------------------------------------------------------------


def mx_exponent_ref(amax: float, mode: str, adaptive: bool = False) -> int:
    """Unbiased E8M0 exponent for a finite block amax (a float32 value), exact arithmetic.

    floor: floor(log2 a) - 2; ceil: ceil(log2 a) - 2; even: floor(log2 a) + [significand >= 1.75] - 2;
    rceil: ceil(log2(fp32(a / 6))); all clamped to [-127, 127] (a zero or subnormal amax gives -127
    for floor/ceil/even, as torchao's bit extraction does). adaptive (rceil): one step finer when
    a / (6 * 2^e) < 0.87 and the finer exponent is a normal E8M0 scale (>= -126).
    """
    a = float(F32(amax))
    if mode == "rceil":
        d = float(F32(a) / F32(6))
        if d == 0:
            e = -127
        else:
            m, ex = math.frexp(d)  # d = m * 2**ex, m in [0.5, 1)
            e = ex - 1 if m == 0.5 else ex
        e = max(-127, min(127, e))
        if adaptive and Fraction(a) / (6 * Fraction(2) ** e) < Fraction(87, 100) and e - 1 >= -126:
            e -= 1
        return e
    if a < 2.0**-126:  # zero or float32-subnormal amax: exponent field 0
        return -127
    m, ex = math.frexp(a)
    floor_log2 = ex - 1
    if mode == "floor":
        e = floor_log2
    elif mode == "ceil":
        e = floor_log2 + (m != 0.5)
    elif mode == "even":
        e = floor_log2 + (2 * m >= 1.75)
    else:
        raise ValueError(mode)
    return max(-127, min(127, e - 2))


def torchao_rceil_exponent(amax: torch.Tensor) -> torch.Tensor:
    """torchao 0.18's eager RCEIL exponent: clamp(ceil(log2(amax / 6)), -127, 127) (float32)."""
    return torch.clamp(torch.ceil(torch.log2(amax.float() / 6.0)), -127, 127).to(torch.int32)


def torchao_mx(x: torch.Tensor, mode: str, block: int = 32):
    """torchao's MXFP4 to_mx: (E8M0 bytes uint8 [..., K/block], packed uint8 [..., K/2])."""
    scale, data = to_mx(x.contiguous(), torch.float4_e2m1fn_x2, block, TORCHAO_MODE[mode])
    return scale.view(torch.uint8), data


def torchao_mx_dequantize(scale_u8: torch.Tensor, data: torch.Tensor, block: int = 32) -> torch.Tensor:
    return to_dtype(data, scale_u8.view(torch.float8_e8m0fnu), torch.float4_e2m1fn_x2, block, torch.float32)


def tiles_as_rows(x: torch.Tensor, th: int, tw: int) -> torch.Tensor:
    """[R, C] -> [R/th * C/tw, th*tw]: every 2D tile flattened to one contiguous row."""
    r, c = x.shape
    return x.reshape(r // th, th, c // tw, tw).permute(0, 2, 1, 3).reshape(-1, th * tw).contiguous()


# ----------------------------------------------------------------------------------------------
# Test data
# ----------------------------------------------------------------------------------------------


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def wide_range(shape, block: int, lo: float, hi: float, seed: int) -> torch.Tensor:
    """randn with every 1D block multiplied by its own 2^U(lo, hi): float32 [shape]."""
    g = rng(seed)
    x = g.standard_normal(shape).astype(np.float32)
    blocks = x.reshape(-1, block)
    blocks *= np.exp2(g.uniform(lo, hi, size=(blocks.shape[0], 1))).astype(np.float32)
    return torch.from_numpy(blocks.reshape(shape).astype(np.float32))


def student_t(shape, df: float, seed: int) -> torch.Tensor:
    return torch.from_numpy(rng(seed).standard_t(df, size=shape).astype(np.float32))


def randn(shape, seed: int) -> torch.Tensor:
    return torch.from_numpy(rng(seed).standard_normal(shape).astype(np.float32))


def blocks_with_amax(amaxes, block: int, seed: int) -> torch.Tensor:
    """One row of `block` elements per amax: |values| < amax, amax itself (random sign) somewhere."""
    g = rng(seed)
    amaxes = np.asarray(amaxes, dtype=np.float32)
    n = len(amaxes)
    x = (g.uniform(-1, 1, size=(n, block)) * amaxes[:, None]).astype(np.float32)
    x = np.clip(x, -np.abs(amaxes)[:, None], np.abs(amaxes)[:, None])
    pos = g.integers(0, block, size=n)
    x[np.arange(n), pos] = amaxes * np.where(g.integers(0, 2, size=n) == 1, F32(-1), F32(1))
    return torch.from_numpy(x.astype(np.float32))


def float32_neighbours(values, count: int) -> np.ndarray:
    """Each value and its `count` nearest float32 neighbours on each side."""
    v = np.asarray(values, dtype=np.float32)
    bits = v.view(np.int32).astype(np.int64)
    offs = np.arange(-count, count + 1)
    # moving the magnitude bits moves away from / toward zero for either sign; positive values only
    out = (bits[:, None] + offs[None, :]).astype(np.int32).view(np.float32).ravel()
    return out[np.isfinite(out) & (out >= 0)]
