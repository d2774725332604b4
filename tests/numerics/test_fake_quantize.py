"""fake_quantize is quantize(...).dequantize() without packing: bit for bit, random bits included."""

import pytest
import torch

from fp4lab.numerics import fake_quantize, quantize

CASES = [
    ("nvfp4", {}),
    ("nvfp4", {"tile": (16, 16)}),
    ("nvfp4", {"tensor_amax": 3.0}),
    ("nvfp4_cta", {}),
    ("nvfp4_cta", {"tile": (16, 16), "cta_tile": 32}),
    ("nvfp4_cta", {"tile": (16, 16), "cta_tile": 48}),  # the last column of CTA squares cut short
    ("mxfp4", {"scale_mode": "floor"}),
    ("mxfp4", {"scale_mode": "even"}),
    ("mxfp4", {"scale_mode": "rceil", "adaptive": True, "tile": (32, 32)}),
    ("nvfp4", {"rounding": "sr"}),
    ("mxfp4", {"scale_mode": "ceil", "rounding": "sr"}),
]


@pytest.mark.parametrize("fmt, options", CASES)
def test_fake_quantize_matches_quantize_dequantize(fmt, options):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 256, generator=g) * torch.exp2(torch.randint(-24, 6, (192, 1), generator=g).float())
    x[5, 7], x[100, 200] = float("nan"), float("-inf")
    seeded = lambda: {"generator": torch.Generator().manual_seed(11)} if options.get("rounding") == "sr" else {}
    packed = quantize(x, fmt, **options, **seeded()).dequantize()
    fake = fake_quantize(x, fmt, **options, **seeded())
    assert torch.equal(packed.isnan(), fake.isnan())
    assert torch.equal(packed.nan_to_num(nan=0.0), fake.nan_to_num(nan=0.0))


def test_fake_quantize_validates_like_quantize():
    with pytest.raises(ValueError, match="fmt='fp3' is not supported"):
        fake_quantize(torch.randn(4, 32), "fp3")


@pytest.mark.parametrize("fmt, options", CASES)
def test_factored_values_times_outer_is_fake_quantize_and_qtensor_factored_agrees(fmt, options):
    from fp4lab.numerics import fake_quantize_factored

    g = torch.Generator().manual_seed(2)
    x = torch.randn(192, 256, generator=g) * torch.exp2(torch.randint(-24, 6, (192, 1), generator=g).float())
    seeded = lambda: {"generator": torch.Generator().manual_seed(11)} if options.get("rounding") == "sr" else {}
    parts = fake_quantize_factored(x, fmt, **options, **seeded())
    assert torch.equal(parts.folded(), fake_quantize(x, fmt, **options, **seeded()))
    assert torch.equal(parts.values.bfloat16().float(), parts.values)  # every form is exact on bf16 tensor cores
    from_codes = quantize(x, fmt, **options, **seeded()).factored()
    assert torch.equal(from_codes.values, parts.values) and from_codes.outer_cell == parts.outer_cell
    assert (parts.outer_cell is not None) == (fmt == "nvfp4_cta" and options.get("tile") is not None)
    if parts.outer is not None:
        assert torch.equal(from_codes.outer.expand_as(parts.outer), parts.outer)
    assert torch.equal(from_codes.folded(), parts.folded())
