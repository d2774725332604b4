"""MXFP4 (1x32, E8M0): bit-exact against torchao 0.18 `to_mx` in all four scale modes, NaN/Inf
policy, the documented RCEIL divergence from torchao's eager fallback, 2D 32x32 tiles and the
adaptive finer scale."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4lab.numerics import quantize
from tests._refs import (
    F32,
    MX_MODES,
    blocks_with_amax,
    e2m1_decode,
    e2m1_rne,
    grid_step,
    mx_exponent_ref,
    randn,
    student_t,
    tiles_as_rows,
    torchao_mx,
    torchao_mx_dequantize,
    torchao_rceil_exponent,
    unpack_uint4,
    wide_range,
)

ADAPTIVE_CLIP_BOUND = 1 - 6 / (0.87 * 12)  # 0.4253: worst relative error of a clipped element


def assert_matches_torchao(x: torch.Tensor, mode: str, *, adaptive: bool = False) -> int:
    """Our mxfp4 scales and packed bytes equal torchao's to_mx, except (RCEIL only) on blocks where
    torchao's ceil(log2()) mis-rounds; there ours is exactly one binade coarser and equals the exact
    rule. Returns the number of such blocks."""
    q = quantize(x, "mxfp4", scale_mode=mode)
    scale, data = torchao_mx(x, mode)
    assert q.scales.dtype == torch.uint8 and q.data.dtype == torch.uint8
    assert q.scales.shape == scale.shape and q.data.shape == data.shape
    assert q.tensor_scale is None and q.block_size == 32 and q.scale_mode == mode
    diverged = torch.zeros(scale.shape, dtype=torch.bool)
    if mode == "rceil":
        amax = x.float().reshape(*x.shape[:-1], -1, 32).abs().amax(-1)
        exact = torch.tensor([mx_exponent_ref(a, "rceil") for a in amax.flatten().tolist()]).reshape(amax.shape)
        diverged = (torchao_rceil_exponent(amax) != exact) & torch.isfinite(amax)
        assert torch.equal(q.scales[diverged].int(), scale[diverged].int() + 1)
    ok = ~diverged
    bad = q.scales[ok] != scale[ok]
    assert not bad.any(), f"{mode}: {int(bad.sum())} E8M0 bytes differ from torchao"
    data_ok = ok.repeat_interleave(16, dim=-1)
    bad = q.data[data_ok] != data[data_ok]
    assert not bad.any(), f"{mode}: {int(bad.sum())} packed bytes differ from torchao"
    return int(diverged.sum())


def nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)
    )


# ----------------------------------------------------------------------------------------------
# bit-exact vs torchao
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MX_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_randn_matches_torchao(mode, dtype):
    x = randn((64, 512), seed=1).to(dtype)
    assert assert_matches_torchao(x, mode) == 0


@pytest.mark.parametrize("mode", MX_MODES)
def test_heavy_tailed_matches_torchao(mode):
    x = student_t((32, 1024), df=2.0, seed=2)
    assert_matches_torchao(x, mode)
    assert_matches_torchao(x.bfloat16(), mode)


@pytest.mark.parametrize("mode", MX_MODES)
def test_wide_per_block_range_matches_torchao(mode):
    x = wide_range((128, 256), 32, -30, 10, seed=3)
    assert_matches_torchao(x, mode)
    assert_matches_torchao(x.bfloat16(), mode)


@pytest.mark.parametrize("mode", MX_MODES)
def test_float32_subnormal_region_matches_torchao(mode):
    """Blocks with amax from 2^-118 down into float32 subnormals (E8M0 byte 0 and its neighbours)."""
    x = wide_range((64, 256), 32, -149, -118, seed=4)
    scales = quantize(x, "mxfp4", scale_mode=mode).scales
    assert (scales == 0).any() and (scales > 0).any()
    assert_matches_torchao(x, mode)


@pytest.mark.parametrize("mode", MX_MODES)
def test_all_zero_blocks_and_tensor(mode):
    x = randn((4, 128), seed=5)
    x[1] = 0
    x[2, 32:64] = 0
    x[3, :32] = -0.0
    assert_matches_torchao(x, mode)
    q = quantize(x, "mxfp4", scale_mode=mode)
    assert q.scales[1].tolist() == [0, 0, 0, 0] and int(q.scales[2, 1]) == 0
    assert (q.dequantize()[1] == 0).all()
    zeros = torch.zeros(2, 64)
    assert_matches_torchao(zeros, mode)
    assert (quantize(zeros, "mxfp4", scale_mode=mode).scales == 0).all()


# The reference table: amax -> unbiased exponent (floor, rceil, ceil, even) and dequantized amax.
MODE_TABLE = [
    (1.0, {"floor": -2, "rceil": -2, "ceil": -2, "even": -2}, {"floor": 1, "rceil": 1, "ceil": 1, "even": 1}),
    (3.0, {"floor": -1, "rceil": -1, "ceil": 0, "even": -1}, {"floor": 3, "rceil": 3, "ceil": 3, "even": 3}),
    (3.01, {"floor": -1, "rceil": 0, "ceil": 0, "even": -1}, {"floor": 3, "rceil": 3, "ceil": 3, "even": 3}),
    (5.0, {"floor": 0, "rceil": 0, "ceil": 1, "even": 0}, {"floor": 4, "rceil": 4, "ceil": 4, "even": 4}),
    (6.5, {"floor": 0, "rceil": 1, "ceil": 1, "even": 0}, {"floor": 6, "rceil": 6, "ceil": 6, "even": 6}),
    (7.0, {"floor": 0, "rceil": 1, "ceil": 1, "even": 1}, {"floor": 6, "rceil": 8, "ceil": 8, "even": 8}),
    (8.0, {"floor": 1, "rceil": 1, "ceil": 1, "even": 1}, {"floor": 8, "rceil": 8, "ceil": 8, "even": 8}),
    (12.0, {"floor": 1, "rceil": 1, "ceil": 2, "even": 1}, {"floor": 12, "rceil": 12, "ceil": 12, "even": 12}),
    (0.0, dict.fromkeys(MX_MODES, -127), dict.fromkeys(MX_MODES, 0)),
    (1e-40, dict.fromkeys(MX_MODES, -127), dict.fromkeys(MX_MODES, 0)),
]


@pytest.mark.parametrize("mode", MX_MODES)
@pytest.mark.parametrize(("amax", "exponents", "dequant"), MODE_TABLE)
def test_reference_table_of_mode_boundaries(mode, amax, exponents, dequant):
    x = torch.zeros(1, 32)
    x[0, 5] = amax
    q = quantize(x, "mxfp4", scale_mode=mode)
    assert int(q.scales[0, 0]) - 127 == exponents[mode]
    assert float(q.dequantize()[0, 5]) == dequant[mode]
    assert mx_exponent_ref(amax, mode) == exponents[mode]
    assert_matches_torchao(x, mode)


@pytest.mark.parametrize("mode", MX_MODES)
def test_boundary_amaxes_and_neighbours_at_many_scales_match_torchao(mode):
    """Every table amax (and powers of two, 1.75 and 6 significands), its float32 neighbours,
    at binades 2^-40 .. 2^40, each as the amax of a random block."""
    base = np.array([1, 1.75, 3, 3.01, 5, 6, 6.5, 7, 8, 12], dtype=np.float32)
    scaled = (base[None, :] * np.exp2(np.arange(-40, 41, 4, dtype=np.float32))[:, None]).ravel()
    amaxes = np.concatenate([scaled, np.nextafter(scaled, F32(np.inf)), np.nextafter(scaled, F32(0))])
    x = blocks_with_amax(amaxes, 32, seed=6)
    diverged = assert_matches_torchao(x, mode)
    q = quantize(x, "mxfp4", scale_mode=mode)
    expected = torch.tensor([mx_exponent_ref(a, mode) + 127 for a in amaxes.tolist()], dtype=torch.uint8)
    assert torch.equal(q.scales[:, 0], expected)
    if mode == "rceil":
        # 6 * 2^k one ulp up makes amax / 6 = 2^k (1 + 2^-23): torchao's float log2 rounds that to k
        assert diverged > 0


@pytest.mark.parametrize("mode", MX_MODES)
def test_saturation_matches_torchao(mode):
    """Blocks whose values exceed 6 * scale (floor/even amax in (6, 8) * 2^e), and amax near FLT_MAX."""
    amaxes = np.array([7.0, 7.5, 7.99, 14.0, 15.9, 3.4e38, 3.0e38, 1.7e38], dtype=np.float32)
    x = blocks_with_amax(amaxes, 32, seed=7)
    assert_matches_torchao(x, mode)
    deq = quantize(x, "mxfp4", scale_mode=mode).dequantize()
    # decoding 4 * 2^126 (ceil/even/rceil of amax ~ 3.4e38) overflows float32 for torchao too
    assert torch.equal(deq, torchao_mx_dequantize(*torchao_mx(x, mode)))
    assert torch.isfinite(deq[:5]).all()
    if mode == "floor":
        # amax 7 under the OCP rule: scale 1, amax clamps to 6
        assert float(deq[0].abs().max()) == 6.0


@pytest.mark.parametrize("mode", MX_MODES)
def test_3d_input_matches_torchao(mode):
    x = randn((3, 7, 96), seed=8) * 100
    q = quantize(x, "mxfp4", scale_mode=mode)
    assert q.scales.shape == (3, 7, 3) and q.data.shape == (3, 7, 48)
    assert_matches_torchao(x, mode)


@pytest.mark.parametrize("mode", MX_MODES)
def test_dequantize_matches_torchao(mode):
    x = torch.cat((wide_range((32, 256), 32, -30, 10, seed=9), wide_range((8, 256), 32, -149, -118, seed=10)))
    q = quantize(x, "mxfp4", scale_mode=mode)
    scale, data = torchao_mx(x, mode)
    theirs = torchao_mx_dequantize(scale, data)
    assert torch.equal(q.dequantize(), theirs)
    assert q.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert torch.equal(q.dequantize(torch.bfloat16), theirs.bfloat16())


def test_default_scale_mode_is_floor():
    x = randn((4, 64), seed=11) * 7
    q = quantize(x, "mxfp4")
    assert q.scale_mode == "floor"
    assert torch.equal(q.data, quantize(x, "mxfp4", scale_mode="floor").data)


# ----------------------------------------------------------------------------------------------
# RCEIL: exact ceil(log2(amax / 6)) versus torchao's eager float log2
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [-20, -5, 4, 10, 30])
def test_rceil_divergence_from_torchao_eager_is_pinned(k):
    """amax = 6 * 2^k one ulp up, so fp32(amax / 6) = 2^k (1 + 2^-23): exact ceil(log2) is k + 1
    (what the hardware's cvt.rp ... ue8m0 gives, and what we give); torchao 0.18's eager
    torch.ceil(torch.log2()) rounds log2 to k and gives the smaller exponent."""
    amax = np.nextafter(F32(6.0 * 2.0**k), F32(np.inf))
    assert F32(amax) / F32(6) == F32(2.0**k * (1 + 2.0**-23))
    x = torch.zeros(1, 32)
    x[0, 0] = float(amax)
    ours = int(quantize(x, "mxfp4", scale_mode="rceil").scales[0, 0]) - 127
    theirs = int(torchao_mx(x, "rceil")[0][0, 0]) - 127
    assert ours == k + 1 == mx_exponent_ref(float(amax), "rceil")
    assert theirs == k
    # with the torchao scale the amax would saturate: amax / 2^k > 6
    assert float(amax) / 2.0**k > 6


@settings(max_examples=150, deadline=None)
@given(st.floats(min_value=2.0**-100, max_value=2.0**100, width=32))
def test_rceil_scale_is_exact_ceil_log2(a):
    x = torch.zeros(1, 32)
    x[0, 3] = a
    q = quantize(x, "mxfp4", scale_mode="rceil")
    e = int(q.scales[0, 0]) - 127
    assert e == mx_exponent_ref(a, "rceil")
    # the scale is the smallest power of two that keeps fp32(amax / 6) within range
    d = float(F32(a) / F32(6))
    assert d <= 2.0**e and (e == -127 or d > 2.0 ** (e - 1))


# ----------------------------------------------------------------------------------------------
# NaN / Inf policy
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MX_MODES)
def test_nan_block_gets_nan_scale_and_decodes_to_nan(mode):
    x = randn((4, 128), seed=12)
    clean = x.clone()
    x[1, 40] = float("nan")
    q = quantize(x, "mxfp4", scale_mode=mode)
    assert int(q.scales[1, 1]) == 0xFF
    deq = q.dequantize()
    assert torch.isnan(deq[1, 32:64]).all()
    assert not torch.isnan(deq[1, :32]).any() and not torch.isnan(deq[1, 64:]).any()
    # torchao gives 0xFF too; every other block equals both torchao and the clean tensor
    scale, data = torchao_mx(x, mode)
    assert torch.equal(q.scales, scale)
    ref = quantize(clean, "mxfp4", scale_mode=mode)
    poisoned = torch.zeros_like(q.scales, dtype=torch.bool)
    poisoned[1, 1] = True
    assert torch.equal(q.scales[~poisoned], ref.scales[~poisoned])
    keep = (~poisoned).repeat_interleave(16, dim=-1)
    assert torch.equal(q.data[keep], ref.data[keep]) and torch.equal(q.data[keep], data[keep])


@pytest.mark.parametrize("mode", MX_MODES)
@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_inf_block_policy(mode, value):
    """Our policy (not torchao's, which saturates Inf blocks): a block holding +-Inf gets the NaN
    scale 0xFF and decodes to NaN; the other blocks are unaffected."""
    x = randn((2, 96), seed=13)
    clean = x.clone()
    x[0, 70] = value
    q = quantize(x, "mxfp4", scale_mode=mode)
    assert int(q.scales[0, 2]) == 0xFF
    deq = q.dequantize()
    assert torch.isnan(deq[0, 64:]).all()
    ref = quantize(clean, "mxfp4", scale_mode=mode)
    assert torch.equal(deq[0, :64], ref.dequantize()[0, :64]) and torch.equal(deq[1], ref.dequantize()[1])


def test_all_nan_block_and_nan_in_tiles():
    x = torch.full((32, 64), float("nan"))
    x[:, 32:] = 1.0
    q = quantize(x, "mxfp4", scale_mode="rceil", tile=(32, 32))
    assert q.scales.tolist() == [[0xFF, 127 - 2]]
    deq = q.dequantize()
    assert torch.isnan(deq[:, :32]).all() and (deq[:, 32:] == 1).all()


# ----------------------------------------------------------------------------------------------
# 2D 32x32 tiles
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MX_MODES)
@pytest.mark.parametrize("tile", [(32, 32), (64, 32), (32, 96)])
def test_tile_is_the_1d_rule_over_the_tile(mode, tile):
    """A tile's scale is the 1D rule applied to the tile amax, and its codes are torchao's to_mx of
    the flattened tile taken as one block."""
    th, tw = tile
    w = wide_range((128, 192), 32, -8, 8, seed=14)
    q = quantize(w, "mxfp4", scale_mode=mode, tile=tile)
    assert q.scales.shape == (128 // th, 192 // tw) and q.tile == tile
    rows = tiles_as_rows(w, th, tw)
    expected = torch.tensor([mx_exponent_ref(a, mode) + 127 for a in rows.abs().amax(1).tolist()], dtype=torch.uint8)
    assert torch.equal(q.scales.flatten(), expected)
    scale, data = torchao_mx(rows, mode, block=th * tw)
    assert torch.equal(q.scales.flatten(), scale.flatten())
    assert torch.equal(tiles_as_rows(q.codes(), th, tw), unpack_uint4(data))


@pytest.mark.parametrize(("mode", "adaptive"), [(m, False) for m in MX_MODES] + [("rceil", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_transpose_identity(mode, adaptive, dtype):
    w = wide_range((128, 96), 32, -12, 12, seed=15).to(dtype)
    a = quantize(w, "mxfp4", scale_mode=mode, tile=(32, 32), adaptive=adaptive)
    b = quantize(w.T.contiguous(), "mxfp4", scale_mode=mode, tile=(32, 32), adaptive=adaptive)
    assert torch.equal(a.dequantize().T, b.dequantize())
    assert torch.equal(a.codes().T, b.codes())
    assert torch.equal(a.scales.T, b.scales)
    # non-square tiles transpose to the swapped tile
    c = quantize(w, "mxfp4", scale_mode=mode, tile=(64, 32), adaptive=adaptive)
    d = quantize(w.T.contiguous(), "mxfp4", scale_mode=mode, tile=(32, 64), adaptive=adaptive)
    assert torch.equal(c.dequantize().T, d.dequantize())


def test_tile_dequantize_broadcasts_the_tile_scale():
    w = wide_range((64, 64), 32, -10, 10, seed=16)
    q = quantize(w, "mxfp4", scale_mode="even", tile=(32, 32))
    scale = 2.0 ** (q.scales.double() - 127)
    expected = torch.from_numpy(e2m1_decode(q.codes().numpy())).double() * scale.repeat_interleave(
        32, 0
    ).repeat_interleave(32, 1)
    assert torch.equal(q.dequantize().double(), expected)


# ----------------------------------------------------------------------------------------------
# adaptive (rceil): halve the upward scale when amax / (6 s) < 0.87
# ----------------------------------------------------------------------------------------------


def adaptive_expectation(x: torch.Tensor):
    """Per block: exact exponent with the adaptive rule, and the codes E2M1_RNE(clamp(x / 2^e))."""
    blocks = x.float().reshape(-1, 32).numpy()
    exps = np.array([mx_exponent_ref(a, "rceil", adaptive=True) for a in np.abs(blocks).max(1).tolist()])
    scaled = np.clip(blocks * np.exp2(-exps.astype(np.float64))[:, None], -6, 6).astype(np.float32)
    return exps, e2m1_rne(scaled).reshape(x.shape)


@pytest.mark.parametrize("seed", [17, 18])
def test_adaptive_scales_and_codes_match_the_rule(seed):
    x = torch.cat((randn((64, 256), seed), wide_range((64, 256), 32, -20, 20, seed + 100)))
    q = quantize(x, "mxfp4", scale_mode="rceil", adaptive=True)
    exps, codes = adaptive_expectation(x)
    assert torch.equal(q.scales.flatten().long() - 127, torch.from_numpy(exps))
    assert torch.equal(q.codes(), torch.from_numpy(codes))
    plain = quantize(x, "mxfp4", scale_mode="rceil")
    finer = q.scales != plain.scales
    assert finer.any() and (~finer).any()  # both branches exercised
    assert torch.equal(q.scales[finer].int(), plain.scales[finer].int() - 1)


@settings(max_examples=100, deadline=None)
@given(
    ratio=st.floats(min_value=0.5, max_value=1.0, exclude_min=True),
    k=st.integers(min_value=-100, max_value=100),
    seed=st.integers(min_value=0, max_value=2**31),
)
def test_adaptive_finer_scale_taken_exactly_when_condition_holds(ratio, k, seed):
    """amax = ratio * 6 * 2^k, so the upward scale is 2^k and the finer one 2^(k-1) iff ratio < 0.87."""
    a = F32(ratio * 6 * 2.0**k)
    x = blocks_with_amax([a], 32, seed=seed % 1000)
    s_up = mx_exponent_ref(float(a), "rceil")
    e = int(quantize(x, "mxfp4", scale_mode="rceil", adaptive=True).scales[0, 0]) - 127
    holds = float(a) / (6 * 2.0**s_up) < 0.87
    assert e == (s_up - 1 if holds else s_up)


def test_adaptive_threshold_dense_sweep():
    """600 consecutive float32 amaxes around 0.87 * 6 (upward scale 1): the finer scale is taken
    exactly below the threshold."""
    a0 = F32(0.87 * 6)
    amaxes = (a0.view(np.int32) + np.arange(-300, 301, dtype=np.int32)).view(np.float32)
    x = torch.zeros(len(amaxes), 32)
    x[:, 0] = torch.from_numpy(amaxes)
    e = quantize(x, "mxfp4", scale_mode="rceil", adaptive=True).scales[:, 0].long() - 127
    holds = torch.tensor([float(a) / 6 < 0.87 for a in amaxes.tolist()])
    assert torch.equal(e, torch.where(holds, -1, 0))
    assert holds.any() and (~holds).any()


def test_adaptive_never_takes_the_flush_byte():
    """E8M0 byte 0 encodes with multiplier 1 (TE/torchao flush), so the finer scale is only taken
    when it is a normal E8M0 scale: an upward exponent of -126 stays, even below 0.87."""
    a = F32(0.8 * 6 * 2.0**-126)
    x = torch.zeros(1, 32)
    x[0, 0] = float(a)
    x[0, 1] = float(a) / 3
    q = quantize(x, "mxfp4", scale_mode="rceil", adaptive=True)
    assert int(q.scales[0, 0]) == 1
    assert torch.equal(q.dequantize(), quantize(x, "mxfp4", scale_mode="rceil").dequantize())
    assert float(q.dequantize()[0, 0]) != 0
    # one binade up, the finer scale is taken
    x2 = x * 2
    assert int(quantize(x2, "mxfp4", scale_mode="rceil", adaptive=True).scales[0, 0]) == 1


def per_element(per_block: torch.Tensor, tile) -> torch.Tensor:
    if tile is None:
        return per_block.repeat_interleave(32, dim=-1)
    return per_block.repeat_interleave(tile[0], 0).repeat_interleave(tile[1], 1)


def check_adaptive_error_bounds(x: torch.Tensor, tile=None) -> int:
    """Blocks/tiles that took the finer scale: clipped elements saturate with relative error below
    0.4253, the others err by at most half a grid step. Without adaptive nothing clips."""
    q = quantize(x, "mxfp4", scale_mode="rceil", adaptive=True, tile=tile)
    plain = quantize(x, "mxfp4", scale_mode="rceil", tile=tile)
    finer = per_element(q.scales != plain.scales, tile)
    scale = per_element(2.0 ** (q.scales.double() - 127), tile)
    plain_scale = per_element(2.0 ** (plain.scales.double() - 127), tile)
    xd = x.double()
    assert not (xd.abs() > 6 * plain_scale).any()
    err = (q.dequantize().double() - xd).abs()
    clipped = xd.abs() > 6 * scale
    assert not (clipped & ~finer).any()
    rel = err[clipped] / xd.abs()[clipped]
    assert (rel < ADAPTIVE_CLIP_BOUND).all(), float(rel.max())
    assert (q.dequantize().double().abs()[clipped] == 6 * scale[clipped]).all()  # clipped elements saturate
    inside = finer & ~clipped
    step = torch.from_numpy(grid_step((xd.abs() / scale).numpy()))
    assert (err[inside] <= 0.5 * step[inside] * scale[inside]).all()
    return int(clipped.sum())


def test_adaptive_error_bounds_1d():
    x = torch.cat((randn((128, 256), 19), student_t((64, 256), 3.0, 20)))
    assert check_adaptive_error_bounds(x) > 0


def test_adaptive_error_bounds_2d_tiles():
    w = student_t((128, 256), 4.0, 21)
    assert check_adaptive_error_bounds(w, tile=(32, 32)) > 0
    q = quantize(w, "mxfp4", scale_mode="rceil", adaptive=True, tile=(32, 32))
    plain = quantize(w, "mxfp4", scale_mode="rceil", tile=(32, 32))
    assert (q.scales != plain.scales).any()


@settings(max_examples=60, deadline=None)
@given(ratio=st.floats(min_value=0.5, max_value=0.8699), k=st.integers(-60, 60), seed=st.integers(0, 10_000))
def test_adaptive_clip_bound_hypothesis(ratio, k, seed):
    """Blocks that take the finer scale, with values spread up to the amax: the clip bound holds."""
    a = F32(ratio * 6 * 2.0**k)
    g = np.random.default_rng(seed)
    x = torch.from_numpy((g.uniform(-1, 1, (4, 32)) * float(a)).astype(np.float32))
    x[:, 0] = float(a)
    check_adaptive_error_bounds(x)
