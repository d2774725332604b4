"""NVFP4 (1x16 E4M3 block scales + FP32 tensor scale) and CTA-local NVFP4, bit-exact against
TransformerEngine's chain written from the formulas in numpy float32 (tests/_refs.py)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fp4lab.numerics import quantize
from tests._refs import (
    F32,
    e2m1_decode,
    e4m3_decode,
    e4m3_rne_satfinite,
    nvfp4_te_reference,
    randn,
    student_t,
    wide_range,
)


def assert_matches_te_chain(x: torch.Tensor, *, tile=None, tensor_amax=None) -> dict:
    """Codes, E4M3 scale bytes and the tensor scale equal the from-formula TE chain, bit for bit;
    dequantize is code * fp32(s_b) * (1/S_enc)."""
    q = quantize(x, "nvfp4", tile=tile, tensor_amax=tensor_amax)
    ref = nvfp4_te_reference(x, tile=tile, tensor_amax=tensor_amax)
    assert q.fmt == "nvfp4" and q.block_size == 16 and q.scale_mode is None
    assert q.scales.dtype == torch.uint8 and q.data.dtype == torch.uint8
    assert q.scales.shape == ref["scales"].shape
    bad = q.scales.numpy() != ref["scales"]
    assert not bad.any(), f"{int(bad.sum())}/{bad.size} E4M3 scales differ from the TE chain"
    bad = q.codes().numpy() != ref["codes"]
    assert not bad.any(), f"{int(bad.sum())}/{bad.size} codes differ from the TE chain"
    assert q.tensor_scale.dtype == torch.float32 and q.tensor_scale.dim() == 0
    assert q.tensor_scale.numpy().view(np.int32) == np.array(ref["tensor_scale"], np.float32).view(np.int32)
    s_b = e4m3_decode(ref["scales"])
    s_b = np.repeat(s_b, 16, axis=-1) if tile is None else np.repeat(np.repeat(s_b, tile[0], 0), tile[1], 1)
    expected = (e2m1_decode(ref["codes"]) * s_b) * ref["tensor_scale"]
    assert np.array_equal(q.dequantize().numpy(), expected.astype(np.float32))
    return ref


def scale_classes(scales: np.ndarray) -> tuple[int, int, int]:
    """(zero scales, E4M3-subnormal scales, scales >= 2^-6)."""
    s = np.asarray(scales)
    return int((s == 0).sum()), int(((s > 0) & (s < 8)).sum()), int((s >= 8).sum())


# ----------------------------------------------------------------------------------------------
# the numpy E4M3 rounding used by the reference, against torch's cast
# ----------------------------------------------------------------------------------------------


def test_numpy_e4m3_rounding_matches_torch_cast_on_a_dense_sweep():
    """Every float32 whose low 13 mantissa bits are 0 (so every E4M3 value, midpoint and quarter
    point), +-1 ulp, for binades 2^-14 .. 2^9, both signs, clamped at 448 as satfinite does."""
    exps = np.arange(127 - 14, 127 + 10, dtype=np.int64)
    mants = np.arange(0, 1 << 10, dtype=np.int64) << 13
    bits = ((exps[:, None] << 23) | mants[None, :]).ravel()
    bits = np.concatenate([bits, bits + 1, bits - 1, [0]])
    x = bits.astype(np.int32).view(np.float32)
    x = np.concatenate([x, -x])
    ours = e4m3_rne_satfinite(x)
    torch_bits = torch.from_numpy(np.clip(x, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    bad = ours != torch_bits
    assert not bad.any(), f"{int(bad.sum())} differ, e.g. {x[bad][:5]}"
    # decode round trip over all finite E4M3 bytes
    all_bytes = np.array([b for b in range(256) if b & 0x7F != 0x7F], dtype=np.uint8)
    assert np.array_equal(e4m3_decode(all_bytes), torch.from_numpy(all_bytes).view(torch.float8_e4m3fn).float().numpy())
    assert np.array_equal(e4m3_rne_satfinite(e4m3_decode(all_bytes)), all_bytes)


def test_numpy_e4m3_saturates_and_flushes():
    x = np.array(
        [448, 449, 464, 1e6, np.finfo(np.float32).max, 2.0**-10, 2.0**-10 * 1.0001, 2.0**-9, 3 * 2.0**-10],
        dtype=np.float32,
    )
    assert e4m3_rne_satfinite(x).tolist() == [0x7E, 0x7E, 0x7E, 0x7E, 0x7E, 0x00, 0x01, 0x01, 0x02]


# ----------------------------------------------------------------------------------------------
# 1x16, bit-exact vs the TE chain
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_randn(dtype):
    x = randn((128, 512), seed=30).to(dtype)
    assert_matches_te_chain(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heavy_tailed(dtype):
    assert_matches_te_chain(student_t((64, 512), 2.0, seed=31).to(dtype))
    assert_matches_te_chain(student_t((3, 16, 256), 1.0, seed=32).to(dtype))  # Cauchy, 3D


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wide_per_block_range_gives_subnormal_and_zero_scales(dtype):
    x = wide_range((128, 512), 16, -30, 0, seed=33).to(dtype)
    ref = assert_matches_te_chain(x)
    zeros, subnormal, normal = scale_classes(ref["scales"])
    assert zeros > 0 and subnormal > 0 and normal > 0
    # a zero block scale (no lower clamp) decodes to exactly 0
    q = quantize(x, "nvfp4")
    zero_blocks = torch.from_numpy(ref["scales"] == 0).repeat_interleave(16, dim=-1)
    assert (q.dequantize()[zero_blocks] == 0).all()


def test_all_zero_tensor():
    x = torch.zeros(4, 64)
    ref = assert_matches_te_chain(x)
    q = quantize(x, "nvfp4")
    assert float(q.tensor_scale) == 1.0 and (q.scales == 0).all() and (q.codes() & 7 == 0).all()
    assert ref["tensor_scale"] == 1


def test_all_zero_blocks_and_negative_zero():
    x = randn((8, 128), seed=34)
    x[2] = 0
    x[5, 16:48] = 0
    x[6, :16] = -0.0
    assert_matches_te_chain(x)
    q = quantize(x, "nvfp4")
    assert (q.scales[2] == 0).all() and (q.codes()[6, :16] == 0x8).all()


@pytest.mark.parametrize("factor", [1.0, 10.0, 0.5, 0.01, 1e-30, 1e30, 0.0])
def test_tensor_amax_override(factor):
    """A delayed / external amax: larger (scales use less of E4M3), smaller (block scales saturate
    at 448, elements at 6), zero (S_enc = 1) or huge (S_enc tiny: scales underflow)."""
    x = randn((32, 256), seed=35)
    amax = float(x.abs().max()) * factor
    assert_matches_te_chain(x, tensor_amax=amax)
    assert_matches_te_chain(x, tensor_amax=torch.tensor(amax))
    if factor == 0.5:
        assert (quantize(x, "nvfp4", tensor_amax=amax).scales == 0x7E).any()


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=2.0**-120, max_value=2.0**120, width=32))
def test_tensor_scale_is_the_reciprocal_of_a_correctly_rounded_s_enc(amax):
    """S_enc = fp32(2688 / amax) is ONE division (TE: fp8_max * fp4_max / global_amax), not
    2688 * fp32(1 / amax), which is 1 ulp off for about a quarter of all amaxes."""
    x = torch.ones(1, 16)
    q = quantize(x, "nvfp4", tensor_amax=amax)
    with np.errstate(over="ignore"):
        s_enc = np.minimum(F32(2688) / F32(amax), np.finfo(np.float32).max)
    assert q.tensor_scale.numpy().view(np.int32) == (F32(1) / F32(s_enc)).view(np.int32)


def test_s_enc_double_rounding_would_be_caught():
    """The amaxes below are ones where 2688 * fp32(1/amax) != fp32(2688/amax): the chain must give
    the latter (codes, scales and tensor scale)."""
    g = np.random.default_rng(47)
    cand = (g.uniform(1, 2, 4000) * np.exp2(g.integers(-30, 30, 4000))).astype(np.float32)
    hard = cand[(F32(2688) * (F32(1) / cand)) != (F32(2688) / cand)][:32]
    assert len(hard) == 32
    x = randn((64, 64), seed=48)
    for amax in hard[:8]:
        assert_matches_te_chain(x, tensor_amax=float(amax))
    for amax in hard[8:]:
        xx = x.clone()
        xx[0, 0] = float(amax)
        xx = xx.clamp(-float(amax), float(amax))
        assert_matches_te_chain(xx)


def test_tensor_amax_tiny_gives_flt_max_clamp():
    """amax so small that 2688 / amax overflows: S_enc = FLT_MAX."""
    x = torch.full((1, 16), 1e-44)
    ref = assert_matches_te_chain(x, tensor_amax=1e-44)
    assert ref["tensor_scale"] == F32(1) / np.finfo(np.float32).max
    assert_matches_te_chain(torch.full((2, 32), 1e-42))


def test_e4m3_midpoint_block_amax():
    """Block amaxes whose scaled value bamax * S_enc / 6 lands exactly on E4M3 midpoints (and 1 ulp
    around), so the single-rounding requirement and RNE ties are both exercised."""
    # tensor amax 2688 -> S_enc = 1, so the scale is e4m3(bamax * fp32(1/6))
    e4m3_vals = e4m3_decode(np.arange(1, 0x7E, dtype=np.uint8)).astype(np.float64)
    mids = (e4m3_vals[:-1] + e4m3_vals[1:]) / 2
    targets = np.concatenate([mids, e4m3_vals]) * 6
    bamax = np.concatenate(
        [
            targets,
            np.nextafter(targets.astype(np.float32), np.float32(1e9)),
            np.nextafter(targets.astype(np.float32), np.float32(0)),
        ]
    ).astype(np.float32)
    n = len(bamax)
    x = np.zeros((n + 1, 16), dtype=np.float32)
    x[:n, 0] = bamax
    x[:n, 1] = -bamax / 3
    x[n, 0] = 2688
    assert_matches_te_chain(torch.from_numpy(x))


@settings(max_examples=40, deadline=None)
@given(
    log2_range=st.floats(min_value=0, max_value=40),
    rows=st.integers(1, 4),
    blocks=st.integers(1, 8),
    seed=st.integers(0, 2**16),
    bf16=st.booleans(),
)
def test_hypothesis_random_ranges(log2_range, rows, blocks, seed, bf16):
    x = wide_range((rows, blocks * 16), 16, -log2_range, 0, seed=seed)
    x = x * float(np.exp2(np.random.default_rng(seed).uniform(-60, 60)))
    if bf16:
        x = x.bfloat16()
    assert_matches_te_chain(x)


# ----------------------------------------------------------------------------------------------
# 16x16 tiles (2D weights)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tile", [(16, 16), (32, 16), (16, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_match_the_te_chain(tile, dtype):
    w = wide_range((96, 192), 16, -20, 0, seed=36).to(dtype)
    ref = assert_matches_te_chain(w, tile=tile)
    assert ref["scales"].shape == (96 // tile[0], 192 // tile[1])
    assert_matches_te_chain(w, tile=tile, tensor_amax=float(w.float().abs().max()) * 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tile_transpose_identity(dtype):
    w = wide_range((128, 80), 16, -25, 0, seed=37).to(dtype)
    for tile in [(16, 16), (32, 16)]:
        a = quantize(w, "nvfp4", tile=tile)
        b = quantize(w.T.contiguous(), "nvfp4", tile=tile[::-1])
        assert torch.equal(a.dequantize().T, b.dequantize())
        assert torch.equal(a.codes().T, b.codes())
        assert torch.equal(a.scales.T, b.scales)
        assert torch.equal(a.tensor_scale, b.tensor_scale)


def test_tile_scale_is_the_scale_of_the_tile_amax():
    w = randn((64, 64), seed=38)
    q = quantize(w, "nvfp4", tile=(16, 16))
    s_enc = F32(2688) / F32(w.abs().max())
    tile_amax = w.abs().reshape(4, 16, 4, 16).amax(dim=(1, 3)).numpy()
    expected = e4m3_rne_satfinite(np.minimum(tile_amax * F32(s_enc * (F32(1) / F32(6))), F32(448)))
    assert np.array_equal(q.scales.numpy(), expected)


# ----------------------------------------------------------------------------------------------
# torchao 0.18 nvfp4_quantize is not TE's chain
# ----------------------------------------------------------------------------------------------


def test_torchao_nvfp4_quantize_is_not_the_te_chain():
    """torchao 0.18's nvfp4_quantize clamps the E4M3 block scale to >= 2^-6 (E4M3_EPS) and rounds
    bamax / 6 / per_tensor_scale twice, so on wide-range data it disagrees with TE; that is why the
    oracle here is the TE chain from the formulas, not torchao."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    x = wide_range((64, 256), 16, -30, 0, seed=39)
    ours = quantize(x, "nvfp4")
    ref = assert_matches_te_chain(x)
    ao_scales, ao_data = nvfp4_quantize(x, 16, per_tensor_amax_to_scale(x.abs().amax()))
    ao_scales = ao_scales.view(torch.uint8)
    assert (ao_scales >= 0x08).all()  # torchao never goes below 2^-6
    te_small = torch.from_numpy(ref["scales"] < 0x08)
    assert te_small.sum() > 100  # TE keeps subnormal and zero scales
    differ = ao_scales != ours.scales
    assert (differ[te_small]).all()  # every block TE scales below 2^-6 disagrees
    assert int(differ.sum()) > 0.2 * differ.numel()
    assert (ao_data != ours.data).any()


# ----------------------------------------------------------------------------------------------
# NaN / Inf policy
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_block_policy(bad):
    """A block holding NaN/Inf gets the E4M3 NaN scale 0x7F and decodes to NaN; the tensor amax is
    taken over the blocks free of NaN/Inf (docs/NUMERICS.md), so every other block equals the TE
    chain on the tensor with the poisoned block zeroed. The finite 50.0 sharing the poisoned block
    would set the amax if only the bad element were ignored."""
    x = randn((4, 64), seed=40)
    x[0, 0] = 50.0
    clean = x.clone()
    x[0, 5] = bad
    clean[0, :16] = 0.0
    q = quantize(x, "nvfp4")
    ref = nvfp4_te_reference(clean)
    assert int(q.scales[0, 0]) == 0x7F
    assert q.tensor_scale.numpy().view(np.int32) == np.array(ref["tensor_scale"]).view(np.int32)
    assert float(q.tensor_scale) != float(F32(1) / (F32(2688) / F32(50)))
    deq = q.dequantize()
    assert torch.isnan(deq[0, :16]).all()
    assert not torch.isnan(deq[0, 16:]).any() and not torch.isnan(deq[1:]).any()
    keep = np.ones(ref["scales"].shape, dtype=bool)
    keep[0, 0] = False
    assert np.array_equal(q.scales.numpy()[keep], ref["scales"][keep])
    keep_el = np.repeat(keep, 16, axis=-1)
    assert np.array_equal(q.codes().numpy()[keep_el], ref["codes"][keep_el])
    assert (q.codes()[0, :16] & 7 == 0).all()  # codes of a poisoned block are (+-)0


@pytest.mark.parametrize("tile", [None, (16, 16)])
def test_nonfinite_block_policy_cta(tile):
    """nvfp4_cta: the poisoned block is left out of its CTA tile's amax; other CTA tiles are untouched."""
    x = randn((64, 64), seed=46)
    x[3, 2] = 40.0
    clean = x.clone()
    x[3, 7] = float("nan")
    if tile is None:
        clean[3, :16] = 0.0
    else:
        clean[:16, :16] = 0.0
    q = quantize(x, "nvfp4_cta", cta_tile=32, tile=tile)
    ref = quantize(clean, "nvfp4_cta", cta_tile=32, tile=tile)
    assert torch.equal(q.tensor_scale, ref.tensor_scale)
    poisoned = torch.zeros_like(q.scales, dtype=torch.bool)
    poisoned[(3, 0) if tile is None else (0, 0)] = True
    assert int(q.scales[poisoned]) == 0x7F
    assert torch.equal(q.scales[~poisoned], ref.scales[~poisoned])
    deq, ref_deq = q.dequantize(), ref.dequantize()
    nan = torch.isnan(deq)
    assert nan.sum() == 16 if tile is None else nan.sum() == 256
    assert torch.equal(deq[~nan], ref_deq[~nan])


def test_all_nonfinite_tensor():
    x = torch.full((1, 32), float("nan"))
    x[0, 16:] = float("inf")
    q = quantize(x, "nvfp4")
    assert q.scales.tolist() == [[0x7F, 0x7F]] and float(q.tensor_scale) == 1.0
    assert torch.isnan(q.dequantize()).all()


# ----------------------------------------------------------------------------------------------
# nvfp4_cta: one FP32 outer scale per CTA tile
# ----------------------------------------------------------------------------------------------


def assert_same_encoding(cta_part, scales_part, outer, nv):
    assert torch.equal(cta_part, nv.codes())
    assert torch.equal(scales_part, nv.scales)
    assert outer.numpy().view(np.int32) == nv.tensor_scale.numpy().view(np.int32)


@pytest.mark.parametrize(
    ("shape", "cta_tile"), [((256, 128), None), ((300, 64), 128), ((3, 50, 96), 32), ((16, 32), 64)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cta_row_tiles_equal_nvfp4_of_each_slab(shape, cta_tile, dtype):
    g = np.random.default_rng(41)
    x = torch.from_numpy(g.standard_normal(shape).astype(np.float32))
    rows = x.reshape(-1, shape[-1])
    rows *= torch.from_numpy(np.exp2(g.uniform(-20, 20, (rows.shape[0], 1))).astype(np.float32))
    x = x.to(dtype)
    q = quantize(x, "nvfp4_cta", cta_tile=cta_tile)
    t = cta_tile or 128
    assert q.cta_tile == t and q.fmt == "nvfp4_cta"
    n_rows = rows.shape[0]
    assert q.tensor_scale.shape == (math.ceil(n_rows / t),) and q.tensor_scale.dtype == torch.float32
    codes = q.codes().reshape(n_rows, -1)
    scales = q.scales.reshape(n_rows, -1)
    deq = q.dequantize().reshape(n_rows, -1)
    flat = x.reshape(n_rows, -1)
    for i in range(math.ceil(n_rows / t)):
        slab = flat[i * t : (i + 1) * t]
        nv = quantize(slab, "nvfp4")
        assert_same_encoding(codes[i * t : (i + 1) * t], scales[i * t : (i + 1) * t], q.tensor_scale[i], nv)
        assert torch.equal(deq[i * t : (i + 1) * t], nv.dequantize())
        ref = nvfp4_te_reference(slab)
        assert np.array_equal(nv.codes().numpy(), ref["codes"])


@pytest.mark.parametrize(("tile", "cta_tile"), [((16, 16), 64), ((16, 32), 64), ((32, 16), 32)])
def test_cta_2d_squares_equal_nvfp4_of_each_square(tile, cta_tile):
    w = wide_range((160, 96), 16, -15, 15, seed=42)  # 160 = 2.5 squares of 64: a partial square
    q = quantize(w, "nvfp4_cta", tile=tile, cta_tile=cta_tile)
    t = cta_tile
    th, tw = tile
    assert q.tensor_scale.shape == (math.ceil(160 / t), math.ceil(96 / t))
    codes, deq = q.codes(), q.dequantize()
    for i in range(math.ceil(160 / t)):
        for j in range(math.ceil(96 / t)):
            sq = w[i * t : (i + 1) * t, j * t : (j + 1) * t].contiguous()
            nv = quantize(sq, "nvfp4", tile=tile)
            sc = q.scales[i * t // th : (i * t + sq.shape[0]) // th, j * t // tw : (j * t + sq.shape[1]) // tw]
            assert_same_encoding(codes[i * t : (i + 1) * t, j * t : (j + 1) * t], sc, q.tensor_scale[i, j], nv)
            assert torch.equal(deq[i * t : (i + 1) * t, j * t : (j + 1) * t], nv.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cta_2d_transpose_identity(dtype):
    w = wide_range((192, 128), 16, -20, 20, seed=43).to(dtype)
    for tile, t in [((16, 16), 64), ((16, 32), 32), ((16, 16), 128)]:
        a = quantize(w, "nvfp4_cta", tile=tile, cta_tile=t)
        b = quantize(w.T.contiguous(), "nvfp4_cta", tile=tile[::-1], cta_tile=t)
        assert torch.equal(a.dequantize().T, b.dequantize())
        assert torch.equal(a.codes().T, b.codes())
        assert torch.equal(a.scales.T, b.scales)
        assert torch.equal(a.tensor_scale.T, b.tensor_scale)


def test_cta_one_tile_covering_everything_is_nvfp4():
    x = wide_range((64, 128), 16, -20, 0, seed=44)
    q = quantize(x, "nvfp4_cta", cta_tile=64)
    nv = quantize(x, "nvfp4")
    assert torch.equal(q.data, nv.data) and torch.equal(q.scales, nv.scales)
    assert torch.equal(q.tensor_scale, nv.tensor_scale.reshape(1))


def test_cta_local_scale_helps_a_quiet_slab():
    """A slab 2^-20 quieter than its neighbour keeps normal E4M3 scales with its own outer scale,
    where the tensor-wide scale of nvfp4 flushes its block scales to zero."""
    x = randn((256, 64), seed=45)
    x[128:] *= 2.0**-20
    cta = quantize(x, "nvfp4_cta", cta_tile=128)
    nv = quantize(x, "nvfp4")
    assert (nv.scales[128:] == 0).all()
    assert (cta.scales[128:] >= 0x08).all()
    err = (cta.dequantize()[128:] - x[128:]).norm() / x[128:].norm()
    assert err < 0.2


@pytest.mark.parametrize("bad", [0, -16, 40, 8, 128.0, "128", True])
def test_cta_tile_validation(bad):
    x = torch.zeros(128, 64)
    with pytest.raises(ValueError, match="cta_tile"):
        quantize(x, "nvfp4_cta", cta_tile=bad)


def test_cta_tile_only_for_nvfp4_cta_and_multiple_of_tile():
    x = torch.zeros(128, 64)
    for fmt in ("nvfp4", "mxfp4"):
        with pytest.raises(ValueError, match="cta_tile"):
            quantize(x, fmt, cta_tile=128)
    with pytest.raises(ValueError, match="cta_tile"):
        quantize(x, "nvfp4_cta", tile=(32, 32), cta_tile=48)
    with pytest.raises(ValueError, match="cta_tile"):
        quantize(torch.zeros(96, 96), "nvfp4_cta", tile=(16, 48), cta_tile=64)
