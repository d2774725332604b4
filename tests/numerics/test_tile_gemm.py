"""The chunk-scaled GEMM of 2D CTA-local NVFP4 weights (`numerics.tile_gemm`, `numerics.kernels.tile_gemm`).

The torch reference against the fp32 GEMM of the folded values (bit for bit where every partial sum is
exact; within fp32 summation order on quantized operands); the Triton kernel against the reference bit
for bit on exact data, under Triton's CPU interpreter (CI) and on CUDA; and FP4Linear's nvfp4-cta
Fprop and Dgrad taking it.
"""

from __future__ import annotations

import pytest
import torch

from fp4lab.nn.fp4_linear import FP4Linear, GemmOperand, gemm_operand, tensor_core_mm
from fp4lab.nn.recipe import OperandSpec, load_recipe
from fp4lab.numerics import fake_quantize
from fp4lab.numerics.qtensor import expand_cells
from fp4lab.numerics.tile_gemm import tile_scaled_matmul_reference
from tests import interpreted

U = 2.0**-24
# (M, N, K, cell): squares that divide both dims, a last row and column of squares cut short, and one
# square wider than K.
SHAPES = [(64, 96, 128, 32), (40, 70, 80, 48), (32, 48, 64, 16), (24, 16, 32, 64)]


def exact_operands(m: int, n: int, k: int, cell: int, seed: int):
    """Small whole numbers scaled by powers of two per square: every partial sum and every scaling is
    exact in fp32, so any summation order gives the same bits."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(-6, 7, (m, k), generator=g).float().bfloat16()
    b = torch.randint(-6, 7, (n, k), generator=g).float().bfloat16()
    cells = torch.exp2(torch.randint(-4, 5, (-(-n // cell), -(-k // cell)), generator=g).float())
    return a, b, cells


def folded_gemm(a, b, cells, cell, a_outer, out_dtype):
    """The fp32 GEMM of b with its square scales folded in, times a's outer scale: the reference path."""
    b_folded = b.float() * expand_cells(cells, cell, b.shape)
    out = a.float() @ b_folded.T
    return (out if a_outer is None else out * a_outer.reshape(-1, 1)).to(out_dtype)


def outers(m: int):
    return [None, torch.tensor(0.375), torch.exp2(torch.arange(m, dtype=torch.float32) % 7 - 3).reshape(m, 1)]


@pytest.mark.parametrize("m, n, k, cell", SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_the_folded_gemm_where_partials_are_exact(m, n, k, cell, out_dtype):
    a, b, cells = exact_operands(m, n, k, cell, seed=m + n)
    for a_outer in outers(m):
        fast = tile_scaled_matmul_reference(a, b, cells, cell, a_outer, out_dtype)
        assert fast.dtype == out_dtype
        assert torch.equal(fast, folded_gemm(a, b, cells, cell, a_outer, out_dtype))


def test_each_square_scales_only_its_own_chunk():
    """One square's scale changed: only the output columns of its rows of b move, by exactly its chunk."""
    a, b, cells = exact_operands(32, 64, 96, 32, seed=3)
    base = tile_scaled_matmul_reference(a, b, cells, 32)
    bumped = cells.clone()
    bumped[1, 2] *= 2
    moved = tile_scaled_matmul_reference(a, b, bumped, 32) - base
    chunk = a.float()[:, 64:96] @ b.float()[32:64, 64:96].T * cells[1, 2]
    assert torch.equal(moved[:, 32:64], chunk)
    assert not moved[:, :32].any() and not moved[:, 64:].any()


def quantized_operands(seed: int, cta_tile: int = 32):
    """x in 1D CTA-local NVFP4 (per-row outer) and W in 2D 16 x 16 tiles with square outer scales, from
    training-like tensors whose rows and squares span many binades."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(96, 160, generator=g) * torch.exp2(torch.randint(-8, 8, (96, 1), generator=g).float())
    w = torch.randn(80, 160, generator=g) * torch.exp2(torch.randint(-6, 6, (5, 10), generator=g).float()).repeat_interleave(16, 0).repeat_interleave(16, 1)
    x_spec = OperandSpec("nvfp4_cta", cta_tile=cta_tile)
    w_spec = OperandSpec("nvfp4_cta", tile=(16, 16), cta_tile=cta_tile)
    return x, w, x_spec, w_spec


def assert_within_summation_order(fast, a_values, b_values):
    k = a_values.shape[1]
    ref = a_values.double() @ b_values.double().T
    bound = k * (U * (a_values.abs().double() @ b_values.abs().double().T) + 2.0**-149)
    assert ((fast.double() - ref).abs() <= bound).all(), f"max error / bound {((fast.double() - ref).abs() / bound).max().item():.3g}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("transposed", [False, True], ids=["fprop", "dgrad"])
def test_tensor_core_operands_of_cta_local_weights_stay_bf16_and_match_the_reference(transposed, device):
    """The weight's GemmOperand keeps bf16 values and its square scales (transposed with it for Dgrad),
    and the GEMM (the reference on the CPU, the kernel on CUDA) equals the fp32 GEMM of the
    fake-quantized operands up to summation order."""
    x, w, x_spec, w_spec = quantized_operands(seed=5)
    if transposed:  # Dgrad: dY [M, out] against W^T [in, out]; the same square grid, transposed
        x = x[:, :80]
        x_spec = OperandSpec("nvfp4_cta", cta_tile=32)
    w_op = gemm_operand(w.to(device), w_spec, None, None)
    assert w_op.values.dtype == torch.bfloat16 and w_op.outer_cell == 32 and tuple(w_op.outer.shape) == (3, 5)
    b = w_op.T if transposed else w_op
    out = tensor_core_mm(gemm_operand(x.to(device), x_spec, None, None), b, torch.float32).cpu()
    w_values = fake_quantize(w, "nvfp4_cta", tile=(16, 16), cta_tile=32)
    assert_within_summation_order(out, fake_quantize(x, "nvfp4_cta", cta_tile=32), w_values.T if transposed else w_values)


def test_invalid_operands_get_one_line_errors():
    a, b, cells = exact_operands(16, 32, 64, 32, seed=1)
    cases = [
        ((a, b, cells[:, :1], 32), "cells must be one scale per 32 x 32 square of b, shape \\[1, 2\\]"),
        ((a, b[:, :32], cells, 32), "both must run along the same K"),
        ((a, b, cells, 0), "cell=0 must be a positive whole number"),
        ((a, b, cells, 32, torch.ones(5)), "a_outer must be None, one scale, or one per row of a \\(16\\)"),
        ((a.reshape(-1), b, cells, 32), "a must be a 2D float tensor"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            tile_scaled_matmul_reference(*args)
    with pytest.raises(ValueError, match="out_dtype=torch.float16 is not supported"):
        tile_scaled_matmul_reference(a, b, cells, 32, None, torch.float16)
    square = GemmOperand(b, cells, outer_cell=32)
    with pytest.raises(ValueError, match="only b \\(the weight\\) may carry per-square outer scales"):
        tensor_core_mm(square, square, torch.float32)


def check_kernel_against_reference(device: str, shapes=SHAPES, tile=(16, 32), k_step=32) -> None:
    """The kernel equals the reference bit for bit on exact data: each shape, each form of a's outer
    scale, fp32 and bf16 output, b contiguous and as a transposed view (Dgrad's W^T); and on quantized
    operands it stays within fp32 summation order of the exact product."""
    from fp4lab.numerics.kernels.tile_gemm import TileGemmConfig, tile_scaled_matmul

    config = TileGemmConfig(tile=tile, k_step=k_step, warps=4, stages=2)
    for m, n, k, cell in shapes:
        a, b, cells = exact_operands(m, n, k, cell, seed=m * n)
        for b_view in (b, b.T.contiguous().T):
            for a_outer in outers(m):
                for out_dtype in (torch.float32, torch.bfloat16):
                    on = [t if t is None else t.to(device) for t in (a, b_view, cells, a_outer)]
                    fast = tile_scaled_matmul(on[0], on[1], on[2], cell, on[3], out_dtype, config=config)
                    want = tile_scaled_matmul_reference(a, b_view, cells, cell, a_outer, out_dtype)
                    assert torch.equal(fast.cpu(), want), f"{(m, n, k, cell)} {out_dtype} outer={a_outer is not None}"
    x, w, x_spec, w_spec = quantized_operands(seed=9)
    x_op, w_op = gemm_operand(x, x_spec, None, None), gemm_operand(w, w_spec, None, None)
    fast = tile_scaled_matmul(x_op.values.to(device), w_op.values.to(device), w_op.outer.to(device), 32, x_op.outer.to(device), config=config)
    assert_within_summation_order(fast.cpu(), fake_quantize(x, "nvfp4_cta", cta_tile=32), fake_quantize(w, "nvfp4_cta", tile=(16, 16), cta_tile=32))


def check_cta_local_weights_take_the_kernel() -> None:
    """Under the interpreter, FP4Linear with 2D CTA-local weights on the tensor-core path sends Fprop
    and Dgrad (not Wgrad) to the kernel, and its forward and gradients stay within summation order of
    the fp32 reference path."""
    from fp4lab.numerics.kernels import tile_gemm as triton_tile_gemm

    calls = []
    kernel = triton_tile_gemm.tile_scaled_matmul
    triton_tile_gemm.tile_scaled_matmul = lambda *args, **kw: calls.append(args[1].shape) or kernel(*args, **kw)
    recipe = load_recipe("nvfp4-cta").linear
    results = []
    for tensor_cores in (False, True):
        torch.manual_seed(0)
        layer = FP4Linear(256, 128, recipe, seed=3)
        layer.tensor_cores, layer.fused_quantizers = tensor_cores, False
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 64, 256, generator=g).requires_grad_(True)
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=g))
        results.append((y.detach(), x.grad, layer.weight.grad))
    assert calls == [torch.Size([128, 256]), torch.Size([256, 128])], calls  # W for Fprop, W^T for Dgrad
    for name, ref, fast in zip(("y", "dx", "dw"), *results):
        assert ((fast - ref).abs().max() / ref.abs().max()).item() < 64 * U * 256, name


def test_kernel_equals_the_reference_and_fp4_linear_sends_it_cta_local_weights_under_the_interpreter():
    interpreted.run_interpreted(__name__, ["check_kernel_against_reference('cpu')", "check_cta_local_weights_take_the_kernel()"])


@pytest.mark.cuda
def test_kernel_equals_the_reference_on_cuda():
    """The default launch shape and a small one, on shapes of the 125m model's Fprop and Dgrad."""
    check_kernel_against_reference("cuda", shapes=SHAPES + [(512, 768, 2048, 128), (512, 2048, 768, 128)], tile=(128, 128), k_step=64)
    check_kernel_against_reference("cuda")


def test_bench_tile_gemm_is_cuda_only():
    from fp4lab.bench.kernels import bench_tile_gemm

    assert bench_tile_gemm(64, 64, 128, torch.device("cpu")) is None


@pytest.mark.cuda
def test_cuda_bench_tile_gemm_reports_the_ratio_to_bf16():
    from fp4lab.bench.kernels import bench_tile_gemm

    result = bench_tile_gemm(1024, 2048, 768, torch.device("cuda"), repeats=3)
    row = result.as_dict()
    assert row["ms"] > 0 and row["bf16_ms"] > 0 and row["throughput_vs_bf16"] == pytest.approx(row["bf16_ms"] / row["ms"])
