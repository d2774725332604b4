"""quantize() argument validation: every bad input raises ValueError naming the argument (and the
allowed values where there is a closed set)."""

from __future__ import annotations

import pytest
import torch

from fp4lab.numerics import quantize

X = torch.zeros(64, 64)


def raises(match: str):
    return pytest.raises(ValueError, match=match)


@pytest.mark.parametrize(("fmt", "block"), [("nvfp4", 16), ("nvfp4_cta", 16), ("mxfp4", 32)])
def test_last_dim_not_a_multiple_of_the_block(fmt, block):
    with raises(rf"last dim of x .*multiple of the {fmt} block size {block}"):
        quantize(torch.zeros(4, block + 8), fmt)
    with raises("last dim of x"):
        quantize(torch.zeros(block // 2), fmt)


def test_mxfp4_rejects_a_multiple_of_16_that_is_not_32():
    quantize(torch.zeros(2, 48), "nvfp4")  # fine for nvfp4
    with raises("block size 32"):
        quantize(torch.zeros(2, 48), "mxfp4")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.float64, torch.bool, torch.complex64])
def test_wrong_dtype(dtype):
    with raises(r"x has dtype .*; allowed: torch.float32, torch.bfloat16, torch.float16"):
        quantize(torch.zeros(2, 32, dtype=dtype), "nvfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_allowed_dtypes(dtype):
    q = quantize(torch.ones(2, 32, dtype=dtype), "mxfp4")
    assert q.dequantize().eq(1).all()


def test_not_a_tensor():
    with raises("x must be a torch.Tensor"):
        quantize([[0.0] * 32], "nvfp4")


def test_zero_dim_x():
    with raises("0-dim"):
        quantize(torch.tensor(1.0), "nvfp4")


@pytest.mark.parametrize("fmt", ["fp4", "NVFP4", "mxfp8", "", None])
def test_unknown_fmt(fmt):
    with raises(r"fmt=.*allowed: 'nvfp4', 'mxfp4', 'nvfp4_cta'"):
        quantize(X, fmt)


@pytest.mark.parametrize("rounding", ["rne", "stochastic", "RTN", None])
def test_unknown_rounding(rounding):
    with raises(r"rounding=.*allowed: 'rtn', 'sr'"):
        quantize(X, "nvfp4", rounding=rounding)


@pytest.mark.parametrize("mode", ["round", "FLOOR", "rne", ""])
def test_unknown_scale_mode(mode):
    with raises(r"scale_mode=.*allowed: 'floor', 'ceil', 'even', 'rceil'"):
        quantize(X, "mxfp4", scale_mode=mode)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_cta"])
@pytest.mark.parametrize("mode", ["floor", "rceil"])
def test_scale_mode_for_nvfp4(fmt, mode):
    with raises("scale_mode applies to fmt='mxfp4' only"):
        quantize(X, fmt, scale_mode=mode)


@pytest.mark.parametrize("mode", [None, "floor", "ceil", "even"])
def test_adaptive_without_rceil(mode):
    with raises("adaptive=True .*scale_mode='rceil'"):
        quantize(X, "mxfp4", scale_mode=mode, adaptive=True)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_cta"])
def test_adaptive_for_nvfp4(fmt):
    with raises("adaptive applies to fmt='mxfp4' only"):
        quantize(X, fmt, adaptive=True)


@pytest.mark.parametrize("shape", [(64,), (2, 64, 64), (1, 1, 64, 64)])
def test_tile_on_non_2d(shape):
    with raises(r"tile=\(32, 32\) needs a 2D x"):
        quantize(torch.zeros(shape), "mxfp4", tile=(32, 32))


@pytest.mark.parametrize(
    ("fmt", "shape", "tile"),
    [("mxfp4", (48, 64), (32, 32)), ("mxfp4", (64, 96), (32, 64)), ("nvfp4", (40, 32), (16, 16))],
)
def test_non_divisible_tile(fmt, shape, tile):
    with raises(r"not divisible into .* tiles"):
        quantize(torch.zeros(shape), fmt, tile=tile)


@pytest.mark.parametrize(
    ("fmt", "tile"),
    [
        ("mxfp4", (16, 16)),
        ("mxfp4", (32, 16)),
        ("nvfp4", (8, 16)),
        ("nvfp4", (16, 0)),
        ("nvfp4", (16,)),
        ("nvfp4", (16, 16, 16)),
        ("nvfp4", (16.0, 16)),
        ("nvfp4", (-16, 16)),
    ],
)
def test_bad_tile_shape(fmt, tile):
    with raises("tile="):
        quantize(X, fmt, tile=tile)


@pytest.mark.parametrize(
    "amax", [-1.0, float("nan"), float("inf"), float("-inf"), torch.tensor([1.0, 2.0]), [1.0, 2.0]]
)
def test_bad_tensor_amax(amax):
    with raises("tensor_amax must be one finite value >= 0"):
        quantize(X, "nvfp4", tensor_amax=amax)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4_cta"])
def test_tensor_amax_only_for_nvfp4(fmt):
    with raises("tensor_amax applies to fmt='nvfp4' only"):
        quantize(X, fmt, tensor_amax=1.0)


def test_good_tensor_amax_forms_are_accepted():
    for amax in (0.0, 1.0, torch.tensor(3.0), torch.tensor([3.0]), 7):
        q = quantize(X, "nvfp4", tensor_amax=amax)
        assert q.tensor_scale.dim() == 0


@pytest.mark.parametrize("bad", [0, -128, 100, 8, 128.0, "128"])
def test_bad_cta_tile(bad):
    with raises(r"cta_tile=.*must be a positive multiple of 16"):
        quantize(X, "nvfp4_cta", cta_tile=bad)
