"""Stochastic rounding (all formats) and round-to-nearest determinism.

SR replaces only the element rounding: scales are those of RTN, and every SR value is one of the
two E2M1 neighbours of the scaled input, unbiased in expectation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fp4lab.numerics import quantize
from tests._refs import F32, FLT_MAX, e2m1_decode, e4m3_decode, grid_neighbours, randn, student_t, wide_range

CONFIGS = [
    pytest.param("nvfp4", {}, id="nvfp4"),
    pytest.param("nvfp4", {"tile": (16, 16)}, id="nvfp4-16x16"),
    pytest.param("nvfp4_cta", {"cta_tile": 32}, id="nvfp4_cta"),
    pytest.param("nvfp4_cta", {"tile": (16, 16), "cta_tile": 32}, id="nvfp4_cta-16x16"),
    pytest.param("mxfp4", {"scale_mode": "floor"}, id="mxfp4-floor"),
    pytest.param("mxfp4", {"scale_mode": "ceil"}, id="mxfp4-ceil"),
    pytest.param("mxfp4", {"scale_mode": "even"}, id="mxfp4-even"),
    pytest.param("mxfp4", {"scale_mode": "rceil"}, id="mxfp4-rceil"),
    pytest.param("mxfp4", {"scale_mode": "rceil", "adaptive": True}, id="mxfp4-rceil-adaptive"),
    pytest.param("mxfp4", {"scale_mode": "even", "tile": (32, 32)}, id="mxfp4-even-32x32"),
]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def per_element(q, per_block: np.ndarray) -> np.ndarray:
    if q.tile is None:
        return np.repeat(per_block, q.block_size, axis=-1).reshape(tuple(q.shape))
    return np.repeat(np.repeat(per_block, q.tile[0], 0), q.tile[1], 1)


def outer_scale(q) -> np.ndarray:
    ts = q.tensor_scale.numpy()
    if q.fmt == "nvfp4":
        return ts
    t = q.cta_tile
    if q.tile is None:
        rows = int(np.prod(q.shape[:-1]))
        return np.repeat(ts, t)[:rows].reshape(*q.shape[:-1], 1)
    r, c = q.shape
    return np.repeat(np.repeat(ts, t, 0), t, 1)[:r, :c]


def scaled_and_decode_scale(q, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(the input in E2M1 units after the block scale and saturation, the per-element decode scale),
    from the QTensor's scales and the formulas (not from the code under test)."""
    xn = x.float().numpy()
    if q.fmt == "mxfp4":
        e = q.scales.numpy().astype(np.int64) - 127
        assert (q.scales != 0).all(), "keep test data away from the E8M0 flush byte"
        dec = per_element(q, np.exp2(e.astype(np.float64)))
        return np.clip(xn / dec, -6, 6), dec
    s_b = e4m3_decode(q.scales.numpy())
    dec_b = per_element(q, s_b) * outer_scale(q)  # (s_b * outer), float32 like the chain's decode
    with np.errstate(over="ignore", divide="ignore"):
        enc = np.minimum(F32(1) / (per_element(q, s_b) * outer_scale(q)).astype(np.float32), FLT_MAX)
    return np.clip((xn * enc).astype(np.float32), F32(-6), F32(6)), dec_b.astype(np.float64)


def sample_input(fmt: str, seed: int) -> torch.Tensor:
    if fmt == "mxfp4":
        return torch.cat((randn((64, 128), seed) * 3, wide_range((64, 128), 32, -10, 10, seed + 1)))
    return torch.cat(
        (randn((64, 128), seed), student_t((32, 128), 2.0, seed + 1), wide_range((32, 128), 16, -12, 0, seed + 2))
    )


@pytest.mark.parametrize(("fmt", "kwargs"), CONFIGS)
def test_sr_values_are_grid_neighbours_of_the_scaled_input(fmt, kwargs):
    x = sample_input(fmt, seed=50)
    rtn = quantize(x, fmt, **kwargs)
    sr = quantize(x, fmt, rounding="sr", generator=gen(1), **kwargs)
    # SR leaves the scales alone
    assert torch.equal(sr.scales, rtn.scales)
    if rtn.tensor_scale is not None:
        assert torch.equal(sr.tensor_scale, rtn.tensor_scale)
    scaled, _ = scaled_and_decode_scale(sr, x)
    lo, hi = grid_neighbours(scaled)
    mag = np.abs(e2m1_decode(sr.codes().numpy())).astype(np.float64)
    assert ((mag == lo) | (mag == hi)).all()
    codes = sr.codes().numpy()
    nonzero = (codes & 7) != 0
    assert np.array_equal(np.signbit(x.numpy())[nonzero], (codes[nonzero] & 8) != 0)
    # RTN picks one of the same neighbours; SR is not RTN
    rtn_mag = np.abs(e2m1_decode(rtn.codes().numpy())).astype(np.float64)
    assert ((rtn_mag == lo) | (rtn_mag == hi)).all()
    assert not torch.equal(sr.data, rtn.data)


def repeated_rows(fmt: str, n: int) -> torch.Tensor:
    """n copies of one row that spans the whole E2M1 range of its block(s), incl. exact grid points."""
    width = 32 if fmt == "mxfp4" else 16
    g = np.random.default_rng(51)
    row = g.uniform(-1, 1, 2 * width).astype(np.float32) * 6
    row[0], row[width] = 5.9, -6.0  # amax 6 so scales are simple
    row[1:5] = [0.25, 3.0, -1.5, 0.0]
    return torch.from_numpy(np.tile(row, (n, 1)))


@pytest.mark.parametrize(("fmt", "kwargs"), CONFIGS)
def test_sr_mean_is_unbiased(fmt, kwargs):
    """4096 copies of one row: each element's mean SR value equals its input within 5 sigma of the
    Bernoulli variance (gap^2 p (1-p) / N), plus 1e-6 relative for the float32 scale chain."""
    n = 4096
    x = repeated_rows(fmt, n)
    if kwargs.get("tile"):
        x = x[:, :64] if fmt == "mxfp4" else x[:, :32]
    q = quantize(x, fmt, rounding="sr", generator=gen(2), **kwargs)
    deq = q.dequantize().double()
    scaled, dec = scaled_and_decode_scale(q, x)
    lo, hi = grid_neighbours(scaled)
    a = np.abs(scaled)
    var = ((hi - a) * (a - lo) * dec**2).mean(0)  # per column; rows are identical
    sigma = np.sqrt(var / n)
    mean = deq.mean(0).numpy()
    expected = x[0].double().numpy()
    tol = 5 * sigma + 1e-6 * np.abs(expected)
    assert (np.abs(mean - expected) <= tol).all(), np.abs(mean - expected) / np.maximum(sigma, 1e-30)
    # inputs on the scaled grid (zero variance) never move: every draw gives the same value
    exact = var == 0
    assert exact.any() and (deq.std(0).numpy()[exact] == 0).all()
    if fmt == "mxfp4":  # power-of-two scales: grid inputs come back exactly
        assert np.array_equal(mean[exact], expected[exact])
    # and the draws really are random: somewhere both neighbours occur
    assert (deq.std(0) > 0).sum() > 10


def test_sr_mean_detects_a_biased_rounding():
    """Sensitivity check of the bound above: RTN (a biased rounding) fails it."""
    n = 4096
    x = repeated_rows("mxfp4", n)
    q = quantize(x, "mxfp4", scale_mode="rceil")
    scaled, dec = scaled_and_decode_scale(q, x)
    lo, hi = grid_neighbours(scaled)
    a = np.abs(scaled)
    sigma = np.sqrt(((hi - a) * (a - lo) * dec**2).mean(0) / n)
    err = np.abs(q.dequantize().double().mean(0).numpy() - x[0].double().numpy())
    assert (err > 5 * sigma + 1e-6 * np.abs(x[0].numpy())).any()


def test_sr_round_up_probability_is_the_fractional_position():
    """0.25 of the way from 1 to 1.5 rounds up in ~25% of draws; values exactly on the grid never move."""
    n = 1 << 14
    x = torch.tensor([6.0, 1.125, 4.5, 2.0] + [0.0] * 28).repeat(n, 1)
    q = quantize(x, "mxfp4", scale_mode="rceil", rounding="sr", generator=gen(3))
    assert (q.scales == 127).all()
    deq = q.dequantize()
    for col, lo, hi, p in [(1, 1.0, 1.5, 0.25), (2, 4.0, 6.0, 0.25)]:
        v = deq[:, col]
        assert ((v == lo) | (v == hi)).all()
        frac = float((v == hi).double().mean())
        assert abs(frac - p) < 5 * np.sqrt(p * (1 - p) / n)
    assert (deq[:, 0] == 6).all() and (deq[:, 3] == 2).all()


def test_sr_saturates_clipped_values():
    """Adaptive mxfp4 clips values beyond 6 * s; SR of a clipped value is 6 (the saturated value)."""
    x = torch.zeros(512, 32)
    x[:, 0] = 5.0  # rceil: s = 1, 5 / 6 < 0.87 -> s = 1/2, 5 clips to 3
    x[:, 1] = 2.9
    q = quantize(x, "mxfp4", scale_mode="rceil", adaptive=True, rounding="sr", generator=gen(4))
    assert (q.scales == 126).all()
    deq = q.dequantize()
    assert (deq[:, 0] == 3.0).all()
    assert ((deq[:, 1] == 2.0) | (deq[:, 1] == 3.0)).all() and (deq[:, 1] == 3.0).any()


@pytest.mark.parametrize(("fmt", "kwargs"), CONFIGS)
def test_sr_reproducibility(fmt, kwargs):
    x = sample_input(fmt, seed=52)
    a = quantize(x, fmt, rounding="sr", generator=gen(7), **kwargs)
    b = quantize(x, fmt, rounding="sr", generator=gen(7), **kwargs)
    c = quantize(x, fmt, rounding="sr", generator=gen(8), **kwargs)
    assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)
    assert not torch.equal(a.data, c.data)
    # one generator, two draws: different
    g = gen(9)
    d1 = quantize(x, fmt, rounding="sr", generator=g, **kwargs)
    d2 = quantize(x, fmt, rounding="sr", generator=g, **kwargs)
    assert not torch.equal(d1.data, d2.data)


@pytest.mark.parametrize(("fmt", "kwargs"), CONFIGS)
def test_rtn_is_deterministic_and_ignores_the_generator(fmt, kwargs):
    x = sample_input(fmt, seed=53)
    a = quantize(x, fmt, **kwargs)
    b = quantize(x, fmt, rounding="rtn", generator=gen(11), **kwargs)
    c = quantize(x, fmt, rounding="rtn", generator=gen(12), **kwargs)
    assert torch.equal(a.data, b.data) and torch.equal(b.data, c.data)
    assert torch.equal(a.scales, c.scales)
    # rtn is the nearest of the two neighbours (ties aside)
    scaled, _ = scaled_and_decode_scale(a, x)
    mag = np.abs(e2m1_decode(a.codes().numpy())).astype(np.float64)
    lo, hi = grid_neighbours(scaled)
    s = np.abs(scaled.astype(np.float64))
    assert (np.abs(mag - s) <= np.minimum(s - lo, hi - s) + 0.0).all()


def test_sr_without_generator_uses_the_global_rng():
    x = randn((8, 64), seed=54)
    torch.manual_seed(123)
    a = quantize(x, "nvfp4", rounding="sr")
    torch.manual_seed(123)
    b = quantize(x, "nvfp4", rounding="sr")
    assert torch.equal(a.data, b.data)
