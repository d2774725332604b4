"""The SwiGLU fused into W2's GEMMs (producer_fusion = "on": FP4Linear.swiglu, _SwigluFP4LinearFunction)
computes what the unfused feed-forward computes, bit for bit, and the config reaches every W2; the
residual add and RMSNorm fused into W1's and W3's x operands ("all": FP4Linear.residual_rmsnorm,
_ResidualRmsnormFunction) compute what the unfused block computes with its norm pinned to the kernel's
formula (its sum of squares in a fixed order), forward bit for bit, and the config reaches every W1.

CPU (CI): under Triton's interpreter, in a fresh Python with TRITON_INTERPRET=1, where the fused
kernels run on CPU tensors. Both paths use the fused Triton quantizers there (`kernel_options`
answers for CPU tensors as for CUDA ones, as in tests/nn/test_mx_gemm_linear.py), so stochastic rounding
draws from the same Philox seeds in both: the output and dW2 are equal bit for bit, and d_gate, d_up
are the backward kernel's on the unfused path's dh, bit for bit. Against autograd's d_gate they may
differ by one bf16 ulp in rare elements: the interpreter's exp is numpy's, and torch's CPU exp
differs in the last float32 bit between its vectorised body and its scalar edges, whose place moves
with the tensors' alignment (seen: 1 element of 6144, in some runs). On CUDA both call libdevice's
expf, and tests/kernels/test_triton_fusion.py holds the kernel to autograd bit for bit.
CUDA: a short training run with the fusion on equals one with it off, loss for loss.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from fp4lab.nn.build import build_model, fp4_linears
from fp4lab.nn.fp4_linear import FP4Linear
from fp4lab.nn.model_config import preset
from fp4lab.nn.recipe import load_recipe
from tests import interpreted

# RTN x operands (mxfp4, nvfp4 with its random-sign RHT16 Wgrad, mxfp4-rowsr-h32 with its fixed H32),
# and fprop_x stochastically rounded (sr-x, a test recipe below).
FUSED_RECIPES = ("mxfp4", "nvfp4", "mxfp4-rowsr-h32")


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{label}: {got.dtype} {tuple(got.shape)} vs {want.dtype} {tuple(want.shape)}"
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[want.dtype]
    bad = got.reshape(-1).view(view) != want.reshape(-1).view(view)
    assert not bad.any(), f"{label}: {int(bad.sum())} of {bad.numel()} differ"


def w2_layer(recipe_name: str, hidden: int, dim: int, fprop_x_sr: bool = False) -> FP4Linear:
    linear = load_recipe(recipe_name).linear_for_block(0, 4)
    if fprop_x_sr:
        linear = replace(linear, fprop_x=replace(linear.fprop_x, rounding="sr"))
    layer = FP4Linear(hidden, dim, linear, seed=7)
    layer.tensor_cores = True
    return layer


@interpreted.fused_kernels_as_on_cuda()
def check_swiglu_matches_unfused(recipe_name: str, tokens: int = 64, hidden: int = 96, dim: int = 64, fprop_x_sr: bool = False) -> None:
    """One forward and backward of w2(silu(gate) * up), fused and unfused, from the same layer state."""
    from fp4lab.numerics.kernels import fusion as triton_fusion

    g = torch.Generator().manual_seed(3)
    gate, up = (torch.randn(2, tokens // 2, hidden, generator=g).to(torch.bfloat16) for _ in range(2))
    grad = torch.randn(2, tokens // 2, dim, generator=g).to(torch.bfloat16)
    unfused, fused = (w2_layer(recipe_name, hidden, dim, fprop_x_sr) for _ in range(2))
    with torch.no_grad():
        fused.weight.copy_(unfused.weight)
    fused.fuse_swiglu = True

    calls = []
    results, grad_h = [], []
    with interpreted.spying(triton_fusion, "swiglu_quantize_fused", lambda *a, **k: calls.append(1)):
        for layer in (unfused, fused):
            g_in, u_in = gate.clone().requires_grad_(), up.clone().requires_grad_()
            if layer is unfused:  # FeedForward's expression, keeping dh (W2's Dgrad output)
                h = F.silu(g_in) * u_in
                h.register_hook(grad_h.append)
                out = layer(h)
            else:
                out = layer.swiglu(g_in, u_in)
            out.backward(grad)
            results.append((out, g_in.grad, u_in.grad, layer.weight.grad))
    assert len(calls) == 1, f"{recipe_name}: the fused path ran {len(calls)} times (expected once: the fused layer only)"
    for name, got, want in zip(("out", "dW2"), results[1][::3], results[0][::3]):
        assert_same_bits(got, want, f"{recipe_name} {name}")
    # The backward kernel fed the same dh, gate and up gives the fused path's gradients bit for bit;
    # autograd's (torch's CPU exp) are within one bf16 ulp of them (see run_interpreted).
    want = triton_fusion.swiglu_backward_fused(grad_h[0].reshape(-1, hidden).contiguous(), gate.reshape(-1, hidden), up.reshape(-1, hidden))
    for name, got, kernel, autograd in zip(("d_gate", "d_up"), results[1][1:3], (want.d_gate, want.d_up), results[0][1:3]):
        assert_same_bits(got.reshape(-1, hidden), kernel, f"{recipe_name} {name}")
        assert_within_one_bf16_ulp(autograd.reshape(-1, hidden), kernel, f"{recipe_name} {name} (autograd)")


def assert_within_one_bf16_ulp(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """bf16 tensors of finite values that differ by at most one ulp, in at most 1 element in 1000."""
    steps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert steps.max() <= 1 and (steps > 0).sum() <= got.numel() // 1000, f"{label}: {int((steps > 0).sum())} differ, by up to {int(steps.max())} ulps"


def check_fallbacks() -> None:
    """Where it cannot fuse, swiglu is the unfused expression: probing, a forward hook (operand
    capture), tokens not a multiple of Wgrad's block."""
    g = torch.Generator().manual_seed(4)
    layer = w2_layer("mxfp4", 64, 32)
    layer.fuse_swiglu = True
    gate, up = (torch.randn(64, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    assert layer.fuses_swiglu(gate, up)
    layer.probe = True
    assert not layer.fuses_swiglu(gate, up)
    layer.probe = False
    handle = layer.register_forward_hook(lambda *args: None)
    assert not layer.fuses_swiglu(gate, up)
    handle.remove()
    assert not layer.fuses_swiglu(gate[:40], up[:40])  # 40 tokens: Wgrad would pad to 64
    layer.fuse_swiglu = False
    assert not layer.fuses_swiglu(gate, up)


class PinnedRmsnorm(torch.nn.Module):
    """nn.RMSNorm with the fused kernel's formula (numerics.fusion.rmsnorm_reference: the sum of squares
    in a fixed order), so the unfused block computes what the fused one should, bit for bit."""

    def __init__(self, norm: torch.nn.RMSNorm):
        super().__init__()
        self.weight, self.eps = norm.weight, norm.eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from fp4lab.numerics.fusion import rmsnorm_reference

        normed, _ = rmsnorm_reference(h.reshape(-1, h.shape[-1]), self.weight, self.eps)
        return normed.view(h.shape)


class Branch(torch.nn.Module):
    """Stands in for the attention (whose FP4 linears the interpreter would run for minutes): a bf16
    branch of the normed input, as the attention's output projection gives one."""

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        return (0.5 * x).to(torch.bfloat16)


def fusion_block(recipe_name: str, fused: bool):
    """Block 0 of the tiny model on the tensor-core path (its attention a stand-in branch), its RMSNorm
    before the feed-forward fused into W1's and W3's x operands or pinned to the fused kernel's
    formula; its rope tables."""
    torch.manual_seed(0)
    model = build_model(preset("tiny", 256, 32), load_recipe(recipe_name), seed=0, tensor_cores=True, producer_fusion="all" if fused else "off")
    block = model.layers[0]
    block.attention = Branch()
    if not fused:
        block.ffn_norm = PinnedRmsnorm(block.ffn_norm)
    with torch.no_grad():
        block.ffn_norm.weight.uniform_(0.5, 1.5)  # a gain that is not 1, so its gradient and use are seen
    return block, model.rope_cos[:32], model.rope_sin[:32]


@interpreted.fused_kernels_as_on_cuda()
def check_residual_rmsnorm_matches_unfused(recipe_name: str) -> None:
    """One forward and backward of a block, fused and unfused: the output and the feed-forward's weight
    gradients bit for bit (W1 and W3 read the kernel's operands, which equal quantizing the pinned
    norm), the rest within float32 rounding (the norm's backward is the fused function's own); W1 and W3
    made no x operands of their own on the fused path."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 32, 128, generator=g)
    grad = torch.randn(1, 32, 128, generator=g)
    results = []
    for fused in (False, True):
        block, rope_cos, rope_sin = fusion_block(recipe_name, fused)
        made = []
        for layer in (block.feed_forward.w1, block.feed_forward.w3):
            pair = layer.operand_pair
            layer.operand_pair = lambda names, *a, pair=pair, **k: made.append(names[0]) or pair(names, *a, **k)
        assert block.feed_forward.w1.fuse_residual_rmsnorm is fused
        x_in = x.clone().requires_grad_()
        out = block(x_in, rope_cos, rope_sin)
        out.backward(grad)
        assert made.count("fprop_x") == (0 if fused else 1), f"{recipe_name}: fused={fused}: W1/W3 made their x operands {made.count('fprop_x')} times"
        results.append((out, x_in.grad, {name: p.grad for name, p in block.named_parameters()}))
    (out, dx, grads), (fused_out, fused_dx, fused_grads) = results
    assert_same_bits(fused_out, out, f"{recipe_name} out")
    for name in ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight"):
        assert_same_bits(fused_grads[name], grads[name], f"{recipe_name} d{name}")
    torch.testing.assert_close(fused_dx, dx, rtol=1e-4, atol=1e-6)
    for name, want in grads.items():
        torch.testing.assert_close(fused_grads[name], want, rtol=1e-3, atol=1e-5, msg=lambda m, name=name: f"{recipe_name} d{name}: {m}")


def check_residual_rmsnorm_fallbacks() -> None:
    """Where it cannot fuse, residual_rmsnorm is the unfused add and norm: the flag off, probing, a
    forward hook, tokens not a multiple of Wgrad's block, an x operand that draws random bits
    (stochastically rounded: W1 and W3 each draw their own)."""
    block, _, _ = fusion_block("mxfp4", True)
    w1, norm = block.feed_forward.w1, block.ffn_norm
    x, branch = torch.randn(64, 128), torch.randn(64, 128).to(torch.bfloat16)
    assert w1.fuses_residual_rmsnorm(x, branch, norm)
    w1.probe = True
    assert not w1.fuses_residual_rmsnorm(x, branch, norm)
    w1.probe = False
    handle = w1.register_forward_hook(lambda *args: None)
    assert not w1.fuses_residual_rmsnorm(x, branch, norm)
    handle.remove()
    assert not w1.fuses_residual_rmsnorm(x[:40], branch[:40], norm)
    w1.fuse_residual_rmsnorm = False
    assert not w1.fuses_residual_rmsnorm(x, branch, norm)
    w1.fuse_residual_rmsnorm = True
    w1.recipe = replace(w1.recipe, fprop_x=replace(w1.recipe.fprop_x, rounding="sr"))
    assert not w1.fuses_residual_rmsnorm(x, branch, norm)
    h, normed = w1.residual_rmsnorm(x, branch, norm)
    assert torch.equal(h, x + branch) and torch.equal(normed, norm(x + branch))


# The residual + RMSNorm wiring on both formats and on a transformed Wgrad operand (nvfp4's fixed-sign
# H16); the kernel's other options (rceil scales, H32) are held to its reference in
# tests/kernels/test_triton_fusion.py. One interpreter start for all.
INTERPRETED_CHECKS = [
    *(f"check_swiglu_matches_unfused({recipe!r})" for recipe in FUSED_RECIPES),
    "check_swiglu_matches_unfused('mxfp4', fprop_x_sr=True)",  # the same stochastic rounding draws
    "check_fallbacks()",  # where SwiGLU cannot fuse
    *(f"check_residual_rmsnorm_matches_unfused({recipe!r})" for recipe in ("mxfp4", "nvfp4")),
    "check_residual_rmsnorm_fallbacks()",
]


@pytest.mark.slow  # ~50 s: started first under xdist
def test_fused_producers_equal_the_unfused_blocks_and_fall_back_under_the_interpreter():
    interpreted.run_interpreted(__name__, INTERPRETED_CHECKS)


def test_producer_fusion_reaches_every_w2_and_w1_and_the_blocks_call_them():
    """build_model(producer_fusion="on") marks each block's W2 and only those, "all" also each W1,
    and neither marks a bf16 layer (its fused call would only fall back); FeedForward then calls W2.swiglu and the block W1.residual_rmsnorm (here, on the CPU without the
    interpreter, the unfused expressions: the same output as a model without the fusion)."""
    config = preset("tiny", 256, 32)
    recipe = load_recipe("mxfp4")
    models = {}
    for fusion in ("off", "on", "all"):
        torch.manual_seed(0)  # the initial weights, as build_training seeds them
        models[fusion] = build_model(config, recipe, seed=0, tensor_cores=True, producer_fusion=fusion)
    w2s = {f"layers.{i}.feed_forward.w2" for i in range(config.n_layers)}
    w1s = {f"layers.{i}.feed_forward.w1" for i in range(config.n_layers)}
    for fusion, swiglu, norm in (("off", set(), set()), ("on", w2s, set()), ("all", w2s, w1s)):
        layers = fp4_linears(models[fusion]).items()
        assert {name for name, layer in layers if layer.fuse_swiglu} == swiglu, fusion
        assert {name for name, layer in layers if layer.fuse_residual_rmsnorm} == norm, fusion
    torch.manual_seed(0)
    plain = build_model(config, load_recipe("bf16"), seed=0, tensor_cores=True, producer_fusion="all")
    assert not any(layer.fuse_swiglu or layer.fuse_residual_rmsnorm for layer in fp4_linears(plain).values())
    calls = []
    for block in models["all"].layers:
        w1, w2 = block.feed_forward.w1, block.feed_forward.w2
        w2.swiglu = lambda gate, up, w2=w2: calls.append("swiglu") or w2(F.silu(gate) * up)
        w1.residual_rmsnorm = lambda x, branch, norm: calls.append("norm") or (x + branch, norm(x + branch))
    tokens = torch.randint(256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outputs = [model(tokens) for model in models.values()]
    assert sorted(calls) == ["norm"] * config.n_layers + ["swiglu"] * config.n_layers
    assert torch.equal(outputs[0], outputs[2]) and torch.equal(outputs[1], outputs[2])


def cuda_training_losses(tmp_path, fusion: str) -> list[float]:
    """The losses of eight eager steps of the tiny model on mxfp4 on CUDA (graphed as by default) with
    producer_fusion `fusion`."""
    from fp4lab.train import loop
    from fp4lab.train.config import DataConfig, TrainConfig

    config = TrainConfig(
        recipe="mxfp4", model="tiny", data=DataConfig(source="synthetic"), seq_len=256, batch_size=8, steps=8,
        eval_every=100, checkpoint_every=100, probe_every=100, device="cuda", compile="off", producer_fusion=fusion,
        out_dir=str(tmp_path / fusion),
    )
    assert loop.run(config, progress=False)["status"] == "completed"
    with open(tmp_path / fusion / "metrics.jsonl") as f:
        return [json.loads(line)["loss"] for line in f if '"loss"' in line]


@pytest.mark.cuda
def test_cuda_training_with_the_fused_swiglu_equals_training_without(tmp_path):
    """Eight steps of the tiny model on mxfp4 (round-to-nearest x operands), eager (torch.compile would
    give the unfused SiLU Inductor's own exp) and graphed as by default: the same loss at every step
    with producer_fusion on and off."""
    from fp4lab.numerics.kernels import runs_on

    if not runs_on(torch.device("cuda")):
        pytest.skip("needs Triton")
    losses = [cuda_training_losses(tmp_path, fusion) for fusion in ("off", "on")]
    assert losses[0] == losses[1] and len(losses[0]) >= 8, losses


@pytest.mark.cuda
def test_cuda_training_with_the_fused_residual_rmsnorm_tracks_training_without(tmp_path):
    """Eight steps of the tiny model on mxfp4, eager and graphed as by default, with producer_fusion
    "all" and "on": the fused kernel ran in every block, and the losses agree to within what a few
    ulps in the normed activations (then quantized to FP4) can move them."""
    from fp4lab.numerics.kernels import fusion as triton_fusion
    from fp4lab.numerics.kernels import runs_on

    if not runs_on(torch.device("cuda")):
        pytest.skip("needs Triton")
    calls = []
    producer = triton_fusion.residual_rmsnorm_quantize_fused
    try:
        triton_fusion.residual_rmsnorm_quantize_fused = lambda *a, **k: calls.append(1) or producer(*a, **k)
        losses = [cuda_training_losses(tmp_path, fusion) for fusion in ("on", "all")]
    finally:
        triton_fusion.residual_rmsnorm_quantize_fused = producer
    assert len(calls) >= preset("tiny", 256, 256).n_layers, calls
    assert len(losses[0]) == len(losses[1]) >= 8
    assert max(abs(a - b) for a, b in zip(*losses)) < 0.02, losses
