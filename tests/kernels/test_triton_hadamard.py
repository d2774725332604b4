"""The full-dimension Hadamard kernel (`numerics.kernels.hadamard`) against `numerics.hadamard_full`, bit for
bit, and FP4Linear's full-transform operands taking it; under Triton's CPU interpreter (CI) and on CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp4lab.nn.fp4_linear import FP4Linear
from fp4lab.nn.recipe import load_recipe
from fp4lab.numerics.hadamard import hadamard_full, hadamard_signs
from fp4lab.numerics.quantize import finite_amax
from tests import interpreted


def check_kernel_matches_the_reference(device: str) -> None:
    """Rows zero-padded to N (including N = 1, one row spanning N, several rows per program and the
    kernel's largest N), float32 and bfloat16 inputs with magnitudes over 2^-20..2^20, forward and
    inverse, contiguous rows and a transposed view: the same float32 bits."""
    from fp4lab.numerics.kernels.hadamard import MAX_LENGTH, hadamard_full_fused

    g = torch.Generator().manual_seed(0)
    for rows, length, n in ((3, 5, 8), (7, 100, 128), (2, 1000, 1024), (1, 1, 1), (5, 16, 16), (2, 12000, MAX_LENGTH)):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(rows, length, generator=g) * torch.exp2(torch.randint(-20, 20, (rows, length), generator=g).float())
            x = x.to(dtype)
            signs = hadamard_signs(n, "random", g)
            for inverse in (False, True):
                want = hadamard_full(x, signs, inverse=inverse)
                # x itself, and x as the transpose of a contiguous [length, rows] tensor (read in place)
                for layout, source in (("rows", x), ("x^T view", x.T.contiguous().T)):
                    got = hadamard_full_fused(source.to(device), signs.to(device), inverse=inverse).cpu()
                    label = f"{rows}x{length} -> {n} {dtype} inverse={inverse} {layout}"
                    assert got.shape == want.shape, label
                    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{label}: {(got - want).abs().max().item()}"
    # with_amax: NVFP4's tensor amax of the transform (its finite 1x16 blocks), also over a row that
    # an Inf turns into Inf and NaN (excluded), equal to the reference's finite_amax bit for bit
    for rows, length, n, poisoned in ((5, 16, 16, False), (7, 100, 128, True), (2, 12000, MAX_LENGTH, True), (9, 3000, 4096, False)):
        x = torch.randn(rows, length, generator=g) * 3.0
        if poisoned:
            x[1, 3] = float("inf")
        signs = hadamard_signs(n, "random", g)
        want = hadamard_full(x, signs)
        got, amax = hadamard_full_fused(x.T.contiguous().T.to(device), signs.to(device), with_amax=True)
        assert torch.equal(got.cpu().view(torch.int32), want.view(torch.int32))
        want_amax = finite_amax(want, "nvfp4")
        assert amax.shape == () and torch.equal(amax.cpu().view(torch.int32), want_amax.view(torch.int32)), (amax, want_amax)
    with pytest.raises(ValueError, match="multiple of 16"):
        hadamard_full_fused(torch.ones(2, 8, device=device), torch.ones(8, device=device), with_amax=True)
    with pytest.raises(ValueError, match="a power of two in"):
        hadamard_full_fused(torch.ones(2, 8, device=device), torch.ones(4, device=device))
    with pytest.raises(ValueError, match="use numerics.hadamard_full beyond"):
        hadamard_full_fused(torch.ones(2, 8, device=device), torch.ones(2 * MAX_LENGTH, device=device))


def check_full_transform_operands_take_the_kernel() -> None:
    """optitrain's Wgrad operands (rhtfull, NVFP4) come from the kernel and then the fused quantizer;
    with round to nearest (no random bits in the quantizer) the layer's output and gradients equal
    those of the torch reference quantizers bit for bit, over tokens that are not a power of two."""
    from fp4lab.numerics.kernels import hadamard as triton_hadamard

    calls = []
    kernel = triton_hadamard.hadamard_full_fused
    triton_hadamard.hadamard_full_fused = lambda x, signs, **kw: calls.append((*x.shape, x.stride(0))) or kernel(x, signs, **kw)
    linear = load_recipe("optitrain").linear
    rtn = dataclasses.replace(linear, **{name: dataclasses.replace(getattr(linear, name), rounding="rtn")
                                        for name in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")})
    results = []
    for fused in (False, True):
        calls.clear()
        torch.manual_seed(0)
        layer = FP4Linear(96, 64, rtn, seed=3)
        layer.tensor_cores, layer.fused_quantizers = True, fused
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 50, 96, generator=g).requires_grad_(True)
        y = layer(x)
        y.backward(torch.randn(y.shape, generator=g))
        results.append((y.detach(), x.grad, layer.weight.grad))
        # dY^T and x^T, 100 tokens -> 128, read in place as transposed views (row stride 1: no copy)
        assert sorted(calls) == ([(64, 100, 1), (96, 100, 1)] if fused else []), calls
    for name, ref, fast in zip(("y", "dx", "dw"), *results):
        assert torch.equal(fast, ref), f"{name}: {(fast - ref).abs().max().item()}"


def test_kernel_matches_the_reference_and_full_transform_operands_take_it_under_the_interpreter():
    interpreted.run_interpreted(__name__, ["check_kernel_matches_the_reference('cpu')", "check_full_transform_operands_take_the_kernel()"])


@pytest.mark.cuda
def test_kernel_matches_the_reference_on_cuda():
    check_kernel_matches_the_reference("cuda")
