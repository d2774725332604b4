"""FP8 recipes on FP8 tensor cores (`nn.gemm.fp8_scaled_mm`, torch._scaled_mm): fp4lab's fp8 and
fp8-rowwise linears against torchao's float8 training (0.18, the test oracle) on the same weights,
inputs and output gradient; and, on any machine, what an operand of float8 codes does beside others."""

from __future__ import annotations

import pytest
import torch

from fp4lab.nn.fp4_linear import FP4Linear
from fp4lab.nn.gemm import tensor_core_mm
from fp4lab.nn.operands import GemmOperand
from fp4lab.nn.recipe import load_recipe
from fp4lab.numerics import fp8_quantize

TORCHAO_RECIPE = {"fp8": "tensorwise", "fp8-rowwise": "rowwise"}


def test_float8_codes_meeting_bf16_values_run_as_their_bf16_values():
    """An operand of codes meeting one of bf16 values (a mixed recipe, a shape FP8 tensor cores do not
    take) is used as the values its codes are: exact in bf16."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g), torch.randn(48, 64, generator=g)
    qa = fp8_quantize(a, "e4m3", "row")
    codes = GemmOperand(qa.data, qa.factored().outer)
    values = GemmOperand(qa.data.to(torch.bfloat16), qa.factored().outer)
    other = GemmOperand(b.to(torch.bfloat16))
    for out_dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(tensor_core_mm(codes, other, out_dtype), tensor_core_mm(values, other, out_dtype))
        assert torch.equal(tensor_core_mm(other, codes, out_dtype), tensor_core_mm(other, values, out_dtype))


def _pair(recipe: str, in_features: int, out_features: int):
    """fp4lab's FP8 linear on the tensor-core path and torchao's Float8Linear of the same weight."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    layer = FP4Linear(in_features, out_features, load_recipe(recipe).linear).cuda()
    layer.tensor_cores = True
    oracle = torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False)).cuda()
    oracle[0].weight.data.copy_(layer.weight.data)
    convert_to_float8_training(oracle, config=Float8LinearConfig.from_recipe_name(TORCHAO_RECIPE[recipe]))
    return layer, oracle[0]


def _run(module, x: torch.Tensor, grad: torch.Tensor):
    x = x.detach().clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = module(x)
    y.backward(grad)
    return y, x.grad, module.weight.grad


def _same_bits(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, label
    differ = got.view(torch.int16) != want.view(torch.int16)
    assert not differ.any(), f"{label}: {int(differ.sum())} of {differ.numel()} differ, max {(got.float() - want.float()).abs().max().item()}"


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["fp8", "fp8-rowwise"])
@pytest.mark.parametrize("shape", [(1024, 768, 2048), (512, 2048, 768)])
def test_fp8_linears_give_torchaos_float8_bits_on_fp8_tensor_cores(recipe, shape):
    """Fprop and Dgrad (bf16, as both return them) bit for bit; Wgrad, which fp4lab keeps in fp32 where
    torchao returns bf16: per tensor, fp4lab's rounded to bf16 equals torchao's; per row, torchao rounds
    the unscaled product to bf16 before scaling it (its order), so the two differ by at most those two
    bf16 roundings: |t - f| <= (2^-8 + 2^-16) |f| (f fp4lab's, one fp32 rounding of the same product)."""
    tokens, in_features, out_features = shape
    layer, oracle = _pair(recipe, in_features, out_features)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, in_features, device="cuda", generator=g).to(torch.bfloat16)
    grad = (torch.randn(tokens, out_features, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
    calls = []
    scaled_mm = torch._scaled_mm
    torch._scaled_mm = lambda *args, **kw: calls.append(kw.get("use_fast_accum")) or scaled_mm(*args, **kw)
    try:
        y, dx, dw = _run(layer, x, grad)
    finally:
        torch._scaled_mm = scaled_mm
    assert calls == [True, False, False], calls  # Fprop with fast accumulation, Dgrad and Wgrad without
    y_ref, dx_ref, dw_ref = _run(oracle, x, grad)
    _same_bits(y, y_ref, f"{recipe} output")
    _same_bits(dx, dx_ref, f"{recipe} input gradient")
    assert dw.dtype == torch.float32 and dw_ref.dtype == torch.float32
    if recipe == "fp8":
        _same_bits(dw.to(torch.bfloat16), dw_ref.to(torch.bfloat16), f"{recipe} weight gradient")
    else:
        bound = (2**-8 + 2**-16) * dw.abs()
        assert ((dw_ref - dw).abs() <= bound).all(), f"{recipe} weight gradient: {((dw_ref - dw).abs() - bound).max().item()}"


@pytest.mark.cuda
def test_fp8_operands_are_float8_codes_and_save_one_byte_per_element():
    layer, _ = _pair("fp8", 768, 2048)
    x = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    saved = y.grad_fn
    assert saved.xt_op.values.dtype == torch.float8_e4m3fn and saved.wt_op.values.dtype == torch.float8_e4m3fn
    assert saved.xt_op.values.shape == (768, 1024)  # x^T for Wgrad: 1 byte per element, not bf16's 2
