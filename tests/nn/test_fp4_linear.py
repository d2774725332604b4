"""FP4Linear: each GEMM consumes exactly the operands its recipe names, bit for bit."""

from __future__ import annotations

import pytest
import torch

from fp4lab.nn.fp4_linear import SIBLING_OPERANDS, FP4Linear
from fp4lab.nn.recipe import LinearRecipe, OperandSpec, load_recipe
from fp4lab.numerics import hadamard, hadamard_signs, quantize
from fp4lab.numerics.qtensor import QTensor

FP32 = OperandSpec("fp32")


def uniform(spec: OperandSpec, **overrides) -> LinearRecipe:
    specs = {name: spec for name in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")}
    return LinearRecipe(**(specs | overrides))


def make(recipe, in_features=128, out_features=96, seed=7, **kw):
    torch.manual_seed(0)
    layer = FP4Linear(in_features, out_features, recipe, seed=seed, **kw)
    return layer


def run(layer, tokens=64, batch=2):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, tokens, layer.in_features, generator=g, requires_grad=True)
    y = layer(x)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    return x, y, dy


def dq(t, fmt, **kw):
    return quantize(t, fmt, **kw).dequantize()


def test_fp32_operands_reproduce_exact_autograd():
    layer = make(uniform(FP32))
    x, y, dy = run(layer, tokens=50)  # 100 tokens: Wgrad pads M, which must not change anything
    w = layer.weight.detach().requires_grad_(True)
    x_ref = x.detach().requires_grad_(True)
    (x_ref @ w.T).backward(dy)
    torch.testing.assert_close(y, x_ref.detach() @ w.detach().T, rtol=0, atol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.weight.grad, w.grad, rtol=1e-6, atol=1e-5)


def test_paired_transforms_leave_the_products_unchanged():
    signed = OperandSpec("fp32", transform="h32")
    layer = make(uniform(signed))
    x, y, dy = run(layer)
    w = layer.weight.detach()
    torch.testing.assert_close(y, x.detach() @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, dy @ w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.weight.grad, dy.reshape(-1, 96).T @ x.detach().reshape(-1, 128), rtol=1e-5, atol=1e-4)


def test_paired_full_transforms_leave_the_products_unchanged_on_padded_dims():
    """rhtfull on every GEMM: K = 100, N = 72 and 2 x 37 tokens are zero-padded to 128, 128 and 128
    (no block multiple needed), and with fp32 operands the products are the exact ones up to rounding."""
    layer = make(uniform(OperandSpec("fp32", transform="rhtfull")), in_features=100, out_features=72)
    sizes = {gemm: s.numel() for gemm, s in layer.draw_all_signs(torch.Generator().manual_seed(0), 74).items()}
    assert sizes == {"fprop": 128, "dgrad": 128, "wgrad": 128}
    x, y, dy = run(layer, tokens=37)
    w = layer.weight.detach()
    torch.testing.assert_close(y, x.detach() @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, dy @ w, rtol=1e-5, atol=1e-5)
    exact_dw = dy.reshape(-1, 72).T @ x.detach().reshape(-1, 100)
    torch.testing.assert_close(layer.weight.grad, exact_dw, rtol=1e-5, atol=1e-4)


def test_full_transform_pads_to_at_least_the_fp4_block_and_redraws_its_signs():
    recipe = uniform(OperandSpec("bf16"), wgrad_dy=OperandSpec("mxfp4", transform="rhtfull", scale_mode="floor"),
                     wgrad_x=OperandSpec("nvfp4", transform="rhtfull"))
    layer = make(recipe, in_features=40, out_features=24)
    g = torch.Generator().manual_seed(0)
    first, second = layer.draw_all_signs(g, 5)["wgrad"], layer.draw_all_signs(g, 5)["wgrad"]
    assert first.numel() == second.numel() == 32 and not torch.equal(first, second)
    assert layer.draw_all_signs(g, 33)["wgrad"].numel() == 64 and layer.draw_all_signs(g, 33)["fprop"] is None


def test_fp8_operands_are_probed_and_decode_as_their_quantizer():
    from fp4lab.numerics import fp8_quantize

    layer = make(load_recipe("fp8").linear)
    layer.probe = True
    x, y, _ = run(layer)
    assert set(layer.quant_stats) == {"fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x"}
    x2, w = x.detach().reshape(-1, 128), layer.weight.detach()
    expected = fp8_quantize(x2, "e4m3").dequantize() @ fp8_quantize(w, "e4m3").dequantize().T
    assert torch.equal(y.detach().reshape(-1, 96), expected)


def test_mxfp4_rowsr_h32_gemms_are_bit_exact_emulations():
    recipe = load_recipe("mxfp4-rowsr-h32").linear
    layer = make(recipe)
    x, y, dy = run(layer)
    x2, w, dy2 = x.detach().reshape(-1, 128), layer.weight.detach(), dy.reshape(-1, 96)
    mx = dict(scale_mode="rceil")
    w_hat = dq(w, "mxfp4", tile=(32, 32), adaptive=True, **mx)
    assert torch.equal(y.reshape(-1, 96), dq(x2, "mxfp4", **mx) @ w_hat.T)
    # Backward replays the layer's generator: Dgrad dY is the only stochastically rounded operand.
    g = torch.Generator().manual_seed(7)
    dy_hat = dq(dy2, "mxfp4", rounding="sr", generator=g, **mx)
    assert torch.equal(x.grad.reshape(-1, 128), dy_hat @ w_hat)  # Dgrad decodes Fprop's 2D weight
    signs = hadamard_signs(32, "fixed")
    expected_dw = dq(hadamard(dy2.T.contiguous(), 32, signs), "mxfp4", **mx) @ dq(hadamard(x2.T.contiguous(), 32, signs), "mxfp4", **mx).T
    assert torch.equal(layer.weight.grad, expected_dw)


def test_nvfp4_with_one_d_weights_requantizes_w_transposed_for_dgrad():
    recipe = uniform(OperandSpec("nvfp4"))
    layer = make(recipe)
    x, y, dy = run(layer)
    w, dy2 = layer.weight.detach(), dy.reshape(-1, 96)
    assert torch.equal(x.grad.reshape(-1, 128), dq(dy2, "nvfp4") @ dq(w.T.contiguous(), "nvfp4").T)


def test_random_hadamard_signs_are_paired_and_redrawn_each_call():
    # Paired: both Wgrad operands get the same random signs, so with fp32 operands R^T R = I and the
    # product is the exact one, whatever was drawn.
    rht_fp32 = OperandSpec("fp32", transform="rht16")
    layer = make(uniform(FP32, wgrad_dy=rht_fp32, wgrad_x=rht_fp32))
    x, _, dy = run(layer)
    exact = dy.reshape(-1, 96).T @ x.detach().reshape(-1, 128)
    torch.testing.assert_close(layer.weight.grad, exact, rtol=1e-5, atol=1e-4)
    # Redrawn: with nvfp4 operands the signs decide the rounding. The same inputs twice give different
    # gradients, and each call's is the emulation with the next 16 signs of the layer's generator (seed
    # 7; rtn draws nothing else), the same vector on both operands.
    rht = OperandSpec("nvfp4", transform="rht16")
    layer = make(uniform(FP32, wgrad_dy=rht, wgrad_x=rht))
    replay = torch.Generator().manual_seed(7)
    grads, drawn = [], []
    for _ in range(2):
        layer.weight.grad = None
        x, _, dy = run(layer)  # run() draws the same x and dy every time
        signs = hadamard_signs(16, "random", replay)
        dyt, xt = dy.reshape(-1, 96).T.contiguous(), x.detach().reshape(-1, 128).T.contiguous()
        assert torch.equal(layer.weight.grad, dq(hadamard(dyt, 16, signs), "nvfp4") @ dq(hadamard(xt, 16, signs), "nvfp4").T)
        grads.append(layer.weight.grad.clone())
        drawn.append(signs)
    assert not torch.equal(drawn[0], drawn[1])
    assert not torch.equal(grads[0], grads[1])  # same inputs, new signs


def test_backward_saves_quantized_operands():
    layer = make(load_recipe("nvfp4").linear)
    x = torch.randn(4, 128, 128, requires_grad=True)
    y = layer(x)
    saved = y.grad_fn.xt_enc
    assert isinstance(saved, QTensor) and saved.data.dtype == torch.uint8
    assert saved.data.numel() + saved.scales.numel() < x.numel() * x.element_size() / 6
    assert isinstance(y.grad_fn.w_enc, QTensor)  # the 2D weight encoding, reused by Dgrad
    bf16 = make(uniform(OperandSpec("bf16")))(x)
    assert bf16.grad_fn.xt_enc.dtype == torch.bfloat16


def test_stochastic_rounding_is_reproducible_and_resumes_exactly():
    recipe = load_recipe("nvfp4").linear
    a, b = make(recipe, seed=3), make(recipe, seed=3)
    run(a)
    run(b)
    assert torch.equal(a.weight.grad, b.weight.grad)
    state = a.state_dict()
    a.weight.grad = None
    _, _, _ = run(a)
    after_two_steps = a.weight.grad.clone()
    c = make(recipe, seed=99)
    c.load_state_dict(state)
    run(c)
    assert torch.equal(c.weight.grad, after_two_steps)
    d = make(recipe, seed=4)
    run(d)
    assert not torch.equal(d.weight.grad, b.weight.grad)


def test_probe_records_saturation_and_flushing_per_operand():
    layer = make(load_recipe("mxfp4").linear)
    layer.probe = True
    run(layer)
    assert set(layer.quant_stats) == {"fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x"}
    assert all(0.0 <= s <= 1.0 and 0.0 <= f <= 1.0 for s, f in layer.quant_stats.values())
    assert any(s > 0 for s, _ in layer.quant_stats.values())  # OCP floor scales clip block maxima


def test_lora_svd_keeps_top_directions_in_bf16():
    recipe = load_recipe("nvfp4-all").linear
    plain, lora = make(recipe, 128, 128), make(recipe, 128, 128, lora_rank=8)
    g = torch.Generator().manual_seed(5)
    low = torch.randn(128, 8, generator=g) @ torch.randn(8, 128, generator=g)
    w = low + 0.05 * torch.randn(128, 128, generator=g)
    for layer in (plain, lora):
        with torch.no_grad():
            layer.weight.copy_(w)
    lora.realign_low_rank()
    x = torch.randn(256, 128, generator=g, requires_grad=True)
    exact = x.detach() @ w.T
    err = {name: ((layer(x) - exact).norm() / exact.norm()).item() for name, layer in (("plain", plain), ("lora", lora))}
    assert err["lora"] < 0.5 * err["plain"], err
    y = lora(x)
    y.sum().backward()
    assert lora.weight.grad.shape == (128, 128) and x.grad.shape == x.shape
    assert "lora_u" in lora.state_dict() and lora.lora_u.dtype == torch.bfloat16


def test_lora_svd_with_exact_operands_is_exact_up_to_bf16_factors():
    layer = make(uniform(FP32), 64, 64, lora_rank=4)
    layer.realign_low_rank()
    x = torch.randn(32, 64)
    torch.testing.assert_close(layer(x), x @ layer.weight.detach().T, rtol=2e-2, atol=2e-2)


def test_bad_shapes_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="in_features=48 must be a multiple of 32"):
        FP4Linear(48, 64, load_recipe("mxfp4").linear)
    with pytest.raises(ValueError, match="lora_rank"):
        FP4Linear(64, 64, load_recipe("mxfp4").linear, lora_rank=65)
    FP4Linear(48, 40, uniform(OperandSpec("mxfp4", scale_mode="floor", transform="rhtfull")))  # the transform pads


def test_probing_never_changes_training():
    recipe = load_recipe("optitrain").linear  # SR and random Hadamard signs: every draw must match
    quiet, probed = make(recipe, seed=5), make(recipe, seed=5)
    probed.probe = True
    x1, y1, _ = run(quiet)
    x2, y2, _ = run(probed)
    assert torch.equal(y1, y2) and torch.equal(x1.grad, x2.grad)
    assert torch.equal(quiet.weight.grad, probed.weight.grad)
    assert probed.quant_stats and not quiet.quant_stats


def _siblings(recipe: LinearRecipe, tensor_cores: bool, n: int = 3) -> list[FP4Linear]:
    layers = [make(recipe, out_features=96 if i else 256, seed=10 + i) for i in range(n)]
    for layer in layers:
        layer.tensor_cores = tensor_cores
    return layers


def _count_quantizations(monkeypatch) -> list[tuple]:
    import fp4lab.nn.operands as operands

    calls = []
    for name in ("quantize", "fake_quantize", "fake_quantize_factored"):
        original = getattr(operands, name)
        monkeypatch.setattr(operands, name, lambda t, *a, _f=original, **k: calls.append(tuple(t.shape)) or _f(t, *a, **k))
    return calls


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_sibling_layers_quantize_a_shared_activation_once(tensor_cores, monkeypatch):
    """wq, wk and wv (or w1 and w3) read one x: with deterministic x operands (nvfp4: RTN, fixed-sign
    H16 on Wgrad) the first layer's x and x^T serve the others, bit for bit what each would make."""
    recipe = load_recipe("nvfp4-all").linear
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 64, 128, generator=g)
    dys = [torch.randn(2, 64, out, generator=g) for out in (256, 96, 96)]

    def step(share: bool):
        layers = _siblings(recipe, tensor_cores)
        inputs = [x.clone().requires_grad_(True)] if share else [x.clone().requires_grad_(True) for _ in layers]
        calls = _count_quantizations(monkeypatch)
        outs = [layer(inputs[0 if share else i]) for i, layer in enumerate(layers)]
        x_quantizations = sum(shape == (128, 128) for shape in calls)
        sum((o * dy).sum() for o, dy in zip(outs, dys)).backward()
        assert SIBLING_OPERANDS._slot is None  # a backward pass lets go of the shared operands
        monkeypatch.undo()
        return outs, [layer.weight.grad for layer in layers], x_quantizations

    shared, separate = step(True), step(False)
    for a, b in zip(shared[0] + shared[1], separate[0] + separate[1]):
        assert torch.equal(a, b)
    assert (shared[2], separate[2]) == (2, 6)  # x [128 tokens, 128] and x^T [128, 128 tokens] per layer


@pytest.mark.parametrize("case", ["stochastic", "random signs", "probe", "changed in place"])
def test_siblings_do_not_share_what_draws_random_bits_probes_or_a_changed_activation(case, monkeypatch):
    recipe = load_recipe("nvfp4-all").linear
    if case == "stochastic":
        recipe = LinearRecipe(**{**recipe.__dict__, "wgrad_x": OperandSpec("nvfp4", rounding="sr", transform="h16")})
    if case == "random signs":
        recipe = LinearRecipe(**{**recipe.__dict__, "wgrad_x": OperandSpec("nvfp4", transform="rht16"),
                                 "wgrad_dy": OperandSpec("nvfp4", transform="rht16")})
    layers = _siblings(recipe, tensor_cores=False, n=2)
    layers[0].probe = layers[1].probe = case == "probe"
    x = torch.randn(2, 64, 128, generator=torch.Generator().manual_seed(1))
    calls = _count_quantizations(monkeypatch)
    layers[0](x)
    if case == "changed in place":
        x.mul_(2)
    layers[1](x)
    assert sum(shape == (128, 128) for shape in calls) == 4
