"""Every built-in recipe's linears, GEMM by GEMM: Fprop, Dgrad and Wgrad of FP4Linear (reference path)
equal, bit for bit, an emulation written here from the recipe's operand specs alone.

The emulation takes each GEMM operand in the orientation the recipe names ([rows, contraction]:
x and W for Fprop, dY and W^T for Dgrad, dY^T and x^T for Wgrad), applies its transform (the Hadamard
with the sign vector its prefix names: h = TE's fixed signs, hplain = none, rht = random; rhtfull =
random signs over the contraction dim zero-padded to the next power of two, at least the FP4 block),
quantizes it along its last (contraction) dim with the spec's format, scale mode, rounding, tile,
adaptive and CTA tile, decodes it to float32 and takes the float32 product `a @ b.T`. FP8 operands are
quantized by the formula written here (amax over the tensor or the row, scale = fp8_max / max(amax,
1e-12) divided in float64, optionally rounded down to a power of two, clamp, cast, divide), not by
fp4lab's quantizer. Nothing in it comes from
the layer.

Random bits are replayed from a generator seeded like the layer's: the layer draws, in this order, the
random sign vectors of the GEMMs (fprop, dgrad, wgrad; rht* transforms only), then in the forward pass
fprop_x, wgrad_x, fprop_w, and in the backward pass dgrad_dy, dgrad_w (unless Dgrad decodes Fprop's
weight), wgrad_dy; only stochastically rounded operands draw (one uniform per element).

The products are bit-exact because the layer's reference GEMMs are the same float32 `a @ b.T` on the
same decoded values. One layout detail is mirrored: where Fprop and Dgrad share one 2D-tiled weight
encoding (docs/RECIPES.md; Q(W^T) = Q(W)^T, checked), the layer's Dgrad reads Q(W) in its row-major
layout, so the emulation hands the GEMM Q(W)^T in that layout too (same values, same BLAS call, same
summation order as the layer's).

Full-Stack FP4's LoRA-SVD linear (fullstack): the FP4 GEMMs act on the residual W - U V^T (recomputed
here as the layer computes it); the BF16 low-rank branch is not part of any recipe operand and is added
back with the same torch ops (its gradient by autograd), which keeps the comparison bit-exact: the two
contributions are summed once, and a float sum of two terms does not depend on their order.
"""

from __future__ import annotations

import re

import pytest
import torch

from fp4lab.nn.fp4_linear import FP4Linear
from fp4lab.nn.recipe import GEMMS, LinearRecipe, OperandSpec, list_recipes, load_recipe
from fp4lab.numerics import hadamard, hadamard_full, hadamard_signs, quantize

# M = 256 tokens, K = 256, N = 160: every operand spans two 128-row CTA tiles (the last one short for
# N); all sizes are multiples of the 16 and 32 blocks, the 16x16 and 32x32 tiles and the transforms.
M_BATCH, M_TOKENS, K, N = 2, 128, 256, 160
SEED = 11
FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}

# A recipe no built-in ships that reaches what the built-ins do not: full transforms on every GEMM, whose
# contraction dims (K = 256, N = 160 -> 256, 2 x 100 tokens -> 256) need and do not need padding, on
# FP4, FP8 (per row, per tensor) and BF16 operands.
FULL_RHT = LinearRecipe(
    fprop_x=OperandSpec("nvfp4", transform="rhtfull", rounding="sr"),
    fprop_w=OperandSpec("fp8", transform="rhtfull", element="e4m3", scaling="row", pow2_scale=False),
    dgrad_dy=OperandSpec("fp8", transform="rhtfull", element="e5m2", scaling="tensor", pow2_scale=True),
    dgrad_w=OperandSpec("bf16", transform="rhtfull"),
    wgrad_dy=OperandSpec("mxfp4", scale_mode="floor", transform="rhtfull"),
    wgrad_x=OperandSpec("nvfp4", transform="rhtfull"),
)


def _cases():
    cases = []
    for name in list_recipes():
        recipe = load_recipe(name)
        seen: list[LinearRecipe] = []
        for label, linear in [("linear", recipe.linear)] + [(f"blocks[{i}]", b.linear) for i, b in enumerate(recipe.blocks)]:
            if linear in seen:
                continue
            seen.append(linear)
            # As fp4lab.nn.build: block linears carry the recipe's LoRA-SVD rank unless high precision.
            rank = 0 if linear.is_high_precision else recipe.lora_svd_rank
            cases.append(pytest.param(linear, rank, M_TOKENS, id=f"{name}:{label}"))
    return cases + [pytest.param(FULL_RHT, 0, 100, id="full-rht-padded")]


def _signs(specs: tuple[OperandSpec, OperandSpec], length: int, generator: torch.Generator) -> torch.Tensor | None:
    spec = specs[0]
    if spec.transform == "none":
        return None
    if spec.transform == "rhtfull":
        block = max([{"mxfp4": 32, "nvfp4": 16, "nvfp4_cta": 16}.get(s.format, 1) for s in specs])
        padded = 1
        while padded < max(length, block):
            padded *= 2
        return hadamard_signs(padded, "random", generator)
    kind, size = re.fullmatch(r"(h|hplain|rht)(\d+)", spec.transform).groups()
    return hadamard_signs(int(size), {"h": "fixed", "hplain": "none", "rht": "random"}[kind], generator)


def _fp8(t: torch.Tensor, element: str, scaling: str, pow2: bool) -> torch.Tensor:
    dtype = FP8[element]
    top = torch.finfo(dtype).max
    amax = t.abs().amax(dim=-1, keepdim=True) if scaling == "row" else t.abs().max()
    scale = (top / torch.clamp(amax.double(), min=1e-12)).float()
    if pow2:  # round down: in float64 the log2 of a float32 just below 2^k stays below k
        scale = torch.exp2(torch.floor(torch.log2(scale.double()))).float()
    return torch.clamp(t * scale, -top, top).to(dtype).float() / scale


def _operand(t: torch.Tensor, spec: OperandSpec, signs: torch.Tensor | None, generator: torch.Generator) -> torch.Tensor:
    """The float32 values a GEMM reads for operand t [rows, contraction] under `spec`."""
    t = t.to(torch.float32).contiguous()
    if signs is not None and spec.transform == "rhtfull":
        t = hadamard_full(torch.nn.functional.pad(t, (0, signs.numel() - t.shape[-1])), signs)
    elif signs is not None:
        t = hadamard(t, signs.numel(), signs)
    if spec.format == "fp32":
        return t
    if spec.format == "bf16":
        return t.to(torch.bfloat16).to(torch.float32)
    if spec.format == "fp8":
        return _fp8(t, spec.element, spec.scaling, spec.pow2_scale)
    q = quantize(
        t,
        spec.format,
        rounding=spec.rounding,
        tile=spec.tile,
        scale_mode=spec.scale_mode,
        adaptive=spec.adaptive,
        cta_tile=spec.cta_tile,
        generator=generator if spec.rounding == "sr" else None,
    )
    return q.dequantize()


def _emulate(linear: LinearRecipe, x2: torch.Tensor, w: torch.Tensor, dy2: torch.Tensor, seed: int):
    """(y, dx, dW) of the three GEMMs, each operand quantized along its contraction dim per `linear`."""
    g = torch.Generator().manual_seed(seed)
    lengths = {"fprop": x2.shape[1], "dgrad": dy2.shape[1], "wgrad": x2.shape[0]}
    signs = {gemm: _signs((linear.operand(a), linear.operand(b)), lengths[gemm], g) for gemm, (a, b) in GEMMS.items()}
    fx = _operand(x2, linear.fprop_x, signs["fprop"], g)  # [M, K] along K
    wx = _operand(x2.T, linear.wgrad_x, signs["wgrad"], g)  # [K, M] along M
    fw = _operand(w, linear.fprop_w, signs["fprop"], g)  # [N, K] along K
    ddy = _operand(dy2, linear.dgrad_dy, signs["dgrad"], g)  # [M, N] along N
    dw = _operand(w.T, linear.dgrad_w, signs["dgrad"], g) if not _one_weight_encoding(linear) else None  # [K, N] along N
    wdy = _operand(dy2.T, linear.wgrad_dy, signs["wgrad"], g)  # [N, M] along M
    if dw is None:
        # Dgrad decodes Fprop's 2D-tiled encoding (docs/RECIPES.md): no draw of its own, Q(W)^T in
        # Q(W)'s row-major layout, as the layer keeps it. For round to nearest those are the values of
        # Q(W^T) along N all the same (the transpose identity), checked here from the recipe.
        if linear.dgrad_w.rounding == "rtn":
            assert torch.equal(_operand(w.T, linear.dgrad_w, None, g), fw.T), "the transpose identity of 2D tiles"
        dw = fw.T
    y = fx @ fw.T
    dx = ddy @ dw.T
    dW = wdy @ wx.T  # noqa: N806
    return y, dx, dW


def _one_weight_encoding(linear: LinearRecipe) -> bool:
    """docs/RECIPES.md: where fprop_w and dgrad_w are one 2D-tiled spec, Dgrad decodes Fprop's weight
    encoding. (Not with a transform: a Hadamard along K for Fprop and along N for Dgrad cannot share.)"""
    return linear.fprop_w.tile is not None and linear.fprop_w == linear.dgrad_w and linear.fprop_w.transform == "none"


def _inputs(tokens: int):
    g = torch.Generator().manual_seed(1)

    def spread(*shape):  # powers of two in [1/8, 8]
        return torch.exp2(torch.randint(-3, 4, shape, generator=g).float())

    # Magnitudes vary by token and by feature, so per-tensor, per-CTA and per-block scales differ along
    # both axes of every operand (quantizing along the wrong axis, or with the wrong outer scale, shows).
    x = torch.randn(M_BATCH, tokens, K, generator=g) * spread(M_BATCH, tokens, 1) * spread(K)
    dy = torch.randn(M_BATCH, tokens, N, generator=g) * spread(M_BATCH, tokens, 1) * spread(N)
    return x, dy


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize(("linear", "lora_rank", "tokens"), _cases())
def test_each_gemm_is_the_bit_exact_emulation_of_its_recipe(linear: LinearRecipe, lora_rank: int, tokens: int):
    torch.manual_seed(0)
    layer = FP4Linear(K, N, linear, seed=SEED, lora_rank=lora_rank)
    assert not layer.tensor_cores  # the fp32 reference path
    if lora_rank:
        layer.realign_low_rank()
    x, dy = _inputs(tokens)
    x.requires_grad_(True)
    y = layer(x)
    y.backward(dy)

    x2, dy2 = x.detach().reshape(-1, K), dy.reshape(-1, N)
    w = layer.weight.detach()
    low_rank, low_rank_dx = torch.zeros(()), torch.zeros(())
    if lora_rank:
        u, v = layer.lora_u.to(torch.float32), layer.lora_v.to(torch.float32)
        w = w - u @ v.T  # the residual the FP4 GEMMs see, as the layer forms it
        xr = x2.detach().requires_grad_(True)
        low = xr.to(torch.bfloat16).to(torch.float32) @ v @ u.T
        low.backward(dy2)
        low_rank, low_rank_dx = low.detach(), xr.grad
    y_ref, dx_ref, dw_ref = _emulate(linear, x2, w, dy2, SEED)
    if lora_rank:
        y_ref, dx_ref = low_rank + y_ref, low_rank_dx + dx_ref

    assert _bits_equal(y.detach().reshape(-1, N), y_ref), "Fprop"
    assert _bits_equal(x.grad.reshape(-1, K), dx_ref), "Dgrad"
    assert _bits_equal(layer.weight.grad, dw_ref), "Wgrad"
    if not linear.is_high_precision:  # the emulation is not trivially right: an FP4 GEMM is not exact
        assert not torch.equal(y_ref, x2 @ w.T + low_rank)
    specs = [linear.operand(name) for name in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")]
    if any((s.is_fp4 and s.rounding == "sr") or s.transform.startswith("rht") for s in specs):
        # ... and the replayed generator state matters: another state gives other gradients.
        _, dx_other, dw_other = _emulate(linear, x2, w, dy2, SEED + 1)
        assert not (torch.equal(dx_other, dx_ref - low_rank_dx) and torch.equal(dw_other, dw_ref))
