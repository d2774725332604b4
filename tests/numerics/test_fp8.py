"""FP8 with current scaling (fp4lab.numerics.fp8) against torchao's float8 reference, bit for bit: the
scale (tensorwise and rowwise amax, the 1e-12 floor), the saturated cast, the decode; then the edges
torchao leaves implicit (zero, NaN and Inf amax) and bad input."""

from __future__ import annotations

import pytest
import torch

from fp4lab.numerics import fp8_quantize, fp8_scale

float8_utils = pytest.importorskip("torchao.float8.float8_utils")
ScalingGranularity = pytest.importorskip("torchao.float8.config").ScalingGranularity

DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def wide(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal values on rows whose magnitudes span 2^-60 .. 2^60, so every row's scale differs and
    per-tensor scaling drives small rows into FP8 subnormals and zero."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-60, 61, (rows, 1), generator=g).float())
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-30, -7.0, 3.5])
    x[1] = 0.0  # an all-zero row: amax 0 takes the 1e-12 floor
    return x


def torchao_cast(x: torch.Tensor, element: str, scaling: str, pow2: bool = False):
    dtype = DTYPES[element]
    if scaling == "tensor":
        scale = float8_utils.tensor_to_scale(x, dtype, round_scales_to_power_of_2=pow2)
    else:
        scale = float8_utils.tensor_to_scale(
            x, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1, round_scales_to_power_of_2=pow2
        )
    data = float8_utils.to_fp8_saturated(x.to(torch.float32) * scale, dtype)
    return data, scale


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scaling", ["tensor", "row"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pow2", [False, True])
def test_scale_values_and_decode_match_torchao_bit_for_bit(element, scaling, dtype, pow2):
    x = wide(64, 96, seed=3).to(dtype)
    q = fp8_quantize(x, element, scaling, pow2=pow2)
    data, scale = torchao_cast(x, element, scaling, pow2)
    assert q.scale.dtype == torch.float32 and q.scale.shape == scale.shape == ((64, 1) if scaling == "row" else ())
    assert torch.equal(bits(q.scale), bits(scale))
    assert q.data.dtype == DTYPES[element] and torch.equal(bits(q.data), bits(data))
    # torchao's decode: Float8TrainingTensor.to_original_precision divides by the scale (in fp32 here).
    assert torch.equal(bits(q.dequantize()), bits(data.to(torch.float32) / scale))
    assert torch.equal(fp8_scale(x, element, scaling, pow2=pow2), q.scale)
    if pow2:
        assert torch.equal(torch.frexp(q.scale).mantissa, torch.full_like(q.scale, 0.5))


def test_power_of_two_scales_round_down_exactly_where_torchao_rounds_up():
    """amax just above 448 * 2^-k makes 448 / amax an ulp below 2^k: for k >= 4 torchao's float32
    exp2(floor(log2(s))) gives 2^k there (log2 rounds up to k), fp4lab the power of two below."""
    x = torch.tensor([[448.0 * (1 + 2.0**-23)], [448.0 * 2.0**-5 * (1 + 2.0**-23)], [300.0]])
    ours = fp8_scale(x, "e4m3", "row", pow2=True).flatten().tolist()
    _, theirs = torchao_cast(x, "e4m3", "row", pow2=True)
    assert ours == [0.5, 16.0, 1.0] and theirs.flatten().tolist() == [0.5, 32.0, 1.0]  # float32 log2(1 - 2^-23) < 0
    assert (fp8_quantize(x, "e4m3", "row", pow2=True).data.float().abs() <= 448).all()


def test_per_row_scales_differ_and_per_tensor_scaling_flushes_small_rows():
    x = wide(64, 96, seed=4)
    rows, tensor = fp8_quantize(x, "e4m3", "row"), fp8_quantize(x, "e4m3", "tensor")
    assert len(set(rows.scale.flatten().tolist())) > 32
    small = x.abs().amax(dim=1) < x.abs().max() * 2.0**-40
    assert small.any()
    assert (tensor.dequantize()[small] == 0).all() and (rows.dequantize()[small] != 0).any()
    # The e4m3 rowwise error is at most half an ulp of 3 mantissa bits, relative, above the subnormals.
    normal = x.abs() * rows.scale >= 2.0**-6
    rel = ((rows.dequantize() - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0**-4 * (1 + 2.0**-20)


def test_element_choice_sets_range_and_precision():
    x = torch.linspace(-1, 1, 4096).reshape(32, 128)
    e4m3, e5m2 = fp8_quantize(x, "e4m3"), fp8_quantize(x, "e5m2")
    assert q_max(e4m3) == 448.0 and q_max(e5m2) == 57344.0
    assert (e5m2.dequantize() - x).abs().max() > 1.5 * (e4m3.dequantize() - x).abs().max()


def q_max(q) -> float:
    return q.data.to(torch.float32).abs().max().item()


def test_zero_tensor_decodes_to_zeros_and_non_finite_values_poison_their_tensor_or_row():
    zero = fp8_quantize(torch.zeros(4, 8))
    assert zero.scale.item() == pytest.approx(448e12) and torch.equal(zero.dequantize(), torch.zeros(4, 8))
    for bad in (float("nan"), float("inf"), float("-inf")):
        x = torch.ones(4, 8)
        x[2, 3] = bad
        assert torch.isnan(fp8_quantize(x, "e4m3", "tensor").dequantize()).all()
        row = fp8_quantize(x, "e5m2", "row").dequantize()
        assert torch.isnan(row[2]).all() and torch.equal(row[[0, 1, 3]], torch.ones(3, 8))


def test_scale_rounding_saturates_the_row_maximum_instead_of_overflowing():
    """fp8_max / amax rounds to float32, so amax * scale can exceed fp8_max by an ulp: it clamps."""
    g = torch.Generator().manual_seed(5)
    x = torch.rand(4096, 16, generator=g) + 0.5
    q = fp8_quantize(x, "e4m3", "row")
    assert torch.isfinite(q.data.to(torch.float32)).all()
    assert ((x.abs() * q.scale).amax(dim=1) > 448).any()


@pytest.mark.parametrize(
    "args, fragment",
    [
        ((torch.zeros(4, dtype=torch.int32),), "x must be a float32, bfloat16 or float16"),
        ((torch.zeros(4), "e3m4"), "element='e3m4' is not supported; allowed: e4m3, e5m2"),
        ((torch.zeros(4), "e4m3", "block"), "scaling='block' is not supported; allowed: tensor, row"),
        ((torch.zeros(()), "e4m3", "row"), "scaling='row' needs x with at least one dim"),
        ((torch.zeros(0, 4),), "x is empty"),
    ],
)
def test_bad_input_names_the_argument(args, fragment):
    with pytest.raises(ValueError, match="fp8_quantize") as err:
        fp8_quantize(*args)
    assert fragment in str(err.value)
