"""The fused FP8 quantizer (`numerics.kernels.fp8`) against `numerics.fp8`, bit for bit, and FP4Linear's FP8
operands taking it; under Triton's CPU interpreter (CI) and on CUDA."""

from __future__ import annotations

import pytest
import torch

from fp4lab.nn.fp4_linear import FP4Linear
from fp4lab.nn.recipe import LinearRecipe, OperandSpec, load_recipe
from fp4lab.numerics.fp8 import FP8_DTYPES, fp8_quantize
from tests import interpreted


def assert_same_bits(fast: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """Equal dtype, shape and bits, any NaN where the other has one."""
    assert fast.dtype == want.dtype and fast.shape == want.shape, f"{label}: {fast.dtype} {list(fast.shape)} vs {want.dtype} {list(want.shape)}"
    assert torch.equal(fast.isnan(), want.isnan()), f"{label}: NaNs differ"
    as_int = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[want.dtype]
    assert torch.equal(fast.nan_to_num().view(as_int), want.nan_to_num().view(as_int)), f"{label}: {(fast.float() - want.float()).abs().nan_to_num().max().item()}"


def wide_range(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Rows spanning 2^-30..2^10 (FP8 subnormals and saturation after the scale), a NaN, a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-30, 10, (rows, 1), generator=g).float())
    x[3, 5] = float("nan")
    x[4] = 0.0
    return x


def grid_and_ties(element: str) -> torch.Tensor:
    """Every finite FP8 value, every midpoint between neighbours (ties to even) and fp8_max: amax is
    fp8_max, so the tensor scale is 1 and x * scale is x."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPES[element]).float()
    values = values[values.isfinite()].unique()
    return torch.cat([values, (values[1:] + values[:-1]) / 2]).reshape(1, -1)


def check_fused_fp8_matches_the_reference(device: str) -> None:
    from fp4lab.numerics.kernels.fp8 import fp8_quantize_fused

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = wide_range(70, 100, seed=1).to(dtype)
        if dtype == torch.float16:
            x = x.clamp(-6e4, 6e4)
        for element in ("e4m3", "e5m2"):
            for scaling in ("tensor", "row"):
                for pow2 in (False, True):
                    for transpose in (False, True):
                        label = f"{dtype} {element} {scaling} pow2={pow2} transpose={transpose}"
                        q = fp8_quantize_fused(x.to(device), element, scaling, pow2=pow2, transpose=transpose)
                        want = fp8_quantize(x.T if transpose else x, element, scaling, pow2=pow2).factored()
                        assert_same_bits(q.values.cpu(), want.values.bfloat16(), label + " values")
                        assert_same_bits(q.outer.cpu(), want.outer, label + " outer")
                        if dtype == torch.float32:  # the codes FP8 tensor cores read: fp8_quantize's own data
                            # (the interpreter casts NaN to a finite code; the GPU's cvt gives NaN: checked there)
                            y = x if device == "cuda" else x.nan_to_num(0.0, 1.0, -1.0)
                            codes = fp8_quantize_fused(y.to(device), element, scaling, pow2=pow2, transpose=transpose, codes=True)
                            data = fp8_quantize(y.T if transpose else y, element, scaling, pow2=pow2).data
                            got = codes.values.cpu()
                            assert got.dtype == data.dtype and torch.equal(got.float().isnan(), data.float().isnan()), label
                            finite = ~data.float().isnan()  # a NaN's sign and payload are the cast's own
                            assert torch.equal(got.view(torch.uint8)[finite], data.view(torch.uint8)[finite]), label + " codes"
    for element in ("e4m3", "e5m2"):
        x = grid_and_ties(element)
        q = fp8_quantize_fused(x.to(device), element)
        assert_same_bits(q.values.cpu(), fp8_quantize(x, element).factored().values.bfloat16(), f"{element} grid and ties")


def check_fp8_layers_take_the_fused_quantizer() -> None:
    """Under the interpreter (CPU tensors taken as CUDA ones): an FP8 layer's six operands come from the
    fused quantizer (x^T, W^T and dY^T transposed in the kernel), and its forward and gradients equal
    those of the torch quantizers bit for bit; a probing step takes the torch path."""
    from fp4lab.nn import fp4_linear
    from fp4lab.numerics.kernels import fp8 as triton_fp8

    fp4_linear.fp8_kernel_runs = lambda t: True
    calls = []
    kernel = triton_fp8.fp8_quantize_fused
    triton_fp8.fp8_quantize_fused = lambda x, *args, **kw: calls.append(kw["transpose"]) or kernel(x, *args, **kw)
    amax_passes = []
    amax_kernel = triton_fp8.fp8_amax_bits
    triton_fp8.fp8_amax_bits = lambda x, **kw: amax_passes.append(sorted(kw)) or amax_kernel(x, **kw)
    # Mixed: an NVFP4 wgrad_dy makes Wgrad's contraction a multiple of 16, which 2 x 44 tokens are not:
    # x^T is padded, so x's two FP8 operands and dY's come one at a time (FP4Linear.operand).
    mixed = LinearRecipe(*(OperandSpec("fp8", element="e4m3", scaling="tensor"),) * 2, *(OperandSpec("fp8", element="e5m2", scaling="tensor"),) * 2,
                         OperandSpec("nvfp4"), OperandSpec("fp8", element="e4m3", scaling="tensor"))
    # The amax passes: one per operand pair of x, W and dY (a tensorwise pair shares its tensor amax,
    # a rowwise one takes its rows' and columns' amaxes from one read), one per lone operand.
    cases = [(load_recipe("fp8").linear, 48, [False] * 3 + [True] * 3, [["tensor"]] * 3),
             (load_recipe("fp8-rowwise").linear, 48, [False] * 3 + [True] * 3, [["cols", "rows"]] * 3),
             (mixed, 44, [False] * 4 + [True], [["tensor"]] * 4)]  # W a pair; x, x^T and dY alone
    for recipe, tokens, expected_calls, expected_amax_passes in cases:
        results = []
        for fused in (False, True):
            calls.clear()
            amax_passes.clear()
            torch.manual_seed(0)
            layer = FP4Linear(96, 64, recipe, seed=3)
            layer.tensor_cores, layer.fused_quantizers = True, fused
            g = torch.Generator().manual_seed(1)
            x = (torch.randn(2, tokens, 96, generator=g) * torch.rand(2, tokens, 1, generator=g)).requires_grad_(True)
            y = layer(x)
            y.backward(torch.randn(y.shape, generator=g))
            results.append((y.detach(), x.grad, layer.weight.grad))
            assert sorted(calls) == (expected_calls if fused else []), (recipe, calls)
            assert sorted(amax_passes) == (expected_amax_passes if fused else []), (recipe, amax_passes)
            calls.clear()
            layer.probe = True
            layer(x).sum().backward()
            assert calls == [] and sorted(layer.quant_stats) == sorted(["fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x"])
        for name, ref, fast in zip(("y", "dx", "dw"), *results):
            assert torch.equal(fast, ref), f"{recipe} {name}: {(fast - ref).abs().max().item()}"


def check_amax_pass_matches_the_reference(device: str) -> None:
    """fp8_amax_bits: max |x| of the tensor, of each row and of each column from one read, the bits of
    numerics.fp8.fp8_amax's (a NaN where one is inside); a quantization given a shared amax equals one
    that takes its own."""
    from fp4lab.numerics.fp8 import fp8_amax
    from fp4lab.numerics.kernels.fp8 import fp8_amax_bits, fp8_quantize_fused

    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((70, 100), (300, 260), (1, 5)):
            x = wide_range(*shape, seed=2).to(dtype) if shape[0] > 4 else torch.tensor([[-3.0, 0.5, -0.0, 2.0, 1.0]], dtype=dtype)
            got = fp8_amax_bits(x.to(device), tensor=True, rows=True, cols=True)
            for name, want in (("tensor", fp8_amax(x)), ("rows", fp8_amax(x, "row")), ("cols", fp8_amax(x.T, "row"))):
                assert_same_bits(got[name].cpu().view(torch.float32), want.reshape(-1), f"{dtype} {shape} {name}")
            alone = fp8_quantize_fused(x.to(device), "e4m3", "row", transpose=True)
            shared = fp8_quantize_fused(x.to(device), "e4m3", "row", transpose=True, amax_bits=got["cols"])
            assert_same_bits(shared.values.cpu(), alone.values.cpu(), "shared amax values")
            assert_same_bits(shared.outer.cpu(), alone.outer.cpu(), "shared amax outer")
    with pytest.raises(ValueError, match="amax_bits must be 1 int32 values"):
        fp8_quantize_fused(x.to(device), amax_bits=got["rows"].float())


def test_amax_pass_and_fused_quantizer_match_the_reference_and_layers_take_them_under_the_interpreter():
    calls = ["check_amax_pass_matches_the_reference('cpu')", "check_fused_fp8_matches_the_reference('cpu')",
             "check_fp8_layers_take_the_fused_quantizer()"]
    interpreted.run_interpreted(__name__, calls)


@pytest.mark.cuda
def test_amax_pass_matches_the_reference_on_cuda():
    check_amax_pass_matches_the_reference("cuda")


@pytest.mark.cuda
def test_fused_fp8_matches_the_reference_on_cuda():
    check_fused_fp8_matches_the_reference("cuda")


def test_fused_fp8_refuses_what_it_cannot_quantize():
    pytest.importorskip("triton")
    from fp4lab.numerics.kernels.fp8 import fp8_quantize_fused

    with pytest.raises(ValueError, match="x must be a non-empty 2D tensor"):
        fp8_quantize_fused(torch.ones(8))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use a CUDA tensor \\(or numerics.fp8.fp8_quantize\\)"):
            fp8_quantize_fused(torch.ones(4, 8))
