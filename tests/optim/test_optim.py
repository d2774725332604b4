"""fp4lab.optim: Muon (against torch.optim.Muon, NVFP4 Newton-Schulz), build_optimizer routing, resume, config.

AdamW's tests are in test_optim_adamw.py, QK-Clip's and the update cap's in test_optim_qk_clip.py.
"""

from __future__ import annotations

import ast
import io
import math
import re
from pathlib import Path

import pytest
import torch

from fp4lab.nn.build import build_model
from fp4lab.nn.model_config import preset
from fp4lab.nn.recipe import load_recipe
from fp4lab.numerics import quantize
from fp4lab.optim import CombinedOptimizer, Muon, OptimizerConfig, build_optimizer, newton_schulz
from fp4lab.optim.muon import KELLER_COEFFICIENTS, NS_POLYNOMIALS, lr_scale

TORCH_LR_FN = {"original": "original", "moonlight": "match_rms_adamw"}


pytestmark = pytest.mark.usefixtures("one_thread")


def _save_load(state_dict: dict) -> dict:
    """Round trip through torch.save / torch.load(weights_only=True), as a checkpoint would."""
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ------------------------------------------------------------------------------------------- Muon


@pytest.mark.parametrize("lr_scaling", ["original", "moonlight"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_bf16_muon_is_bit_identical_to_torch_muon(lr_scaling, nesterov):
    gen = torch.Generator().manual_seed(0)
    shapes = [(96, 32), (32, 80)]  # tall (lr factor sqrt(3) under "original") and wide
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = Muon(ours, lr=0.03, weight_decay=0.1, nesterov=nesterov, lr_scaling=lr_scaling)
    ref = torch.optim.Muon(theirs, lr=0.03, weight_decay=0.1, nesterov=nesterov, adjust_lr_fn=TORCH_LR_FN[lr_scaling])
    for _ in range(3):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["momentum_buffer"], ref.state[b]["momentum_buffer"])


def test_lr_scaling_factors():
    assert lr_scale((256, 64), "original") == 2.0  # Keller: sqrt(fan_out / fan_in) for tall matrices
    assert lr_scale((64, 256), "original") == 1.0
    assert lr_scale((256, 64), "moonlight") == pytest.approx(3.2)  # 0.2 * sqrt(256)
    assert lr_scale((64, 256), "moonlight") == pytest.approx(3.2)


def test_moonlight_scaling_gives_update_rms_near_0_2():
    # Moonlight's rationale: 0.2 * sqrt(max(A, B)) * NS(G) has RMS ~0.2, AdamW's typical update RMS.
    g = torch.randn(256, 128, generator=torch.Generator().manual_seed(1))
    p = torch.nn.Parameter(torch.zeros(256, 128))
    p.grad = g
    Muon([p], lr=1.0, lr_scaling="moonlight").step()
    rms = p.detach().pow(2).mean().sqrt().item()
    assert 0.15 < rms < 0.2


def test_weight_decay_is_decoupled_and_uses_the_unscaled_lr():
    w0 = torch.randn(64, 16)
    p = torch.nn.Parameter(w0.clone())
    p.grad = torch.zeros_like(p)  # NS(0) = 0: only the decay acts
    Muon([p], lr=0.05, weight_decay=0.2, lr_scaling="moonlight").step()
    assert torch.equal(p.detach(), w0 * (1 - 0.05 * 0.2))


@pytest.mark.parametrize("shape", [(4,), (2, 3, 4), ()])
def test_muon_rejects_non_2d_params_naming_the_shape(shape):
    with pytest.raises(ValueError, match=re.escape(str(list(shape)))):
        Muon([torch.nn.Parameter(torch.zeros(shape))])


def test_muon_checks_groups_added_later():
    opt = Muon([torch.nn.Parameter(torch.zeros(4, 4))])
    with pytest.raises(ValueError, match=r"\[8\]"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(8))]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"lr_scaling": "match_rms_adamw"},
            "lr_scaling='match_rms_adamw' is not supported; allowed: 'original', 'moonlight'",
        ),
        ({"ns_format": "fp8"}, "ns_format='fp8' is not supported; allowed: 'bf16', 'nvfp4'"),
        ({"momentum": 1.0}, "momentum=1.0 must be in"),
    ],
)
def test_muon_option_errors_name_the_option_and_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Muon([torch.nn.Parameter(torch.zeros(16, 16))], **kwargs)


@pytest.mark.parametrize("shape", [(20, 48), (48, 20), (40, 12)])
def test_nvfp4_muon_needs_both_sides_multiples_of_16(shape):
    message = f"both must be multiples of 16; a parameter of shape {list(shape)} is not (use ns_format='bf16'"
    with pytest.raises(ValueError, match=re.escape(message)):
        Muon([torch.nn.Parameter(torch.zeros(shape))], ns_format="nvfp4")
    with pytest.raises(ValueError, match=re.escape(f"shape {list(shape)} is not (use fmt='bf16')")):
        newton_schulz(torch.randn(shape), fmt="nvfp4")
    Muon([torch.nn.Parameter(torch.zeros(shape))], ns_format="bf16")
    Muon([torch.nn.Parameter(torch.zeros(32, 48))], ns_format="nvfp4")


# Deliberate errors of the emulation below, one per GEMM operand: the test checks that newton_schulz
# differs from each, so an operand left in bf16 or blocked along the wrong axis cannot pass.
NS_EMULATION_BREAKS = (
    "gram-bf16",  # A = X X^T as a bf16 GEMM
    "gram-short-axis",  # X blocked along the short side for X X^T
    "square-bf16",  # A A as a bf16 GEMM
    "square-right-along-rows",  # the right A blocked along its rows: relying on A being symmetric
    "square-left-along-columns",  # the left A blocked along its columns
    "bx-bf16",  # B X as a bf16 GEMM
    "bx-b-along-rows",  # B blocked along its rows
    "bx-x-long-axis",  # X blocked along the long side for B X (the Gram product's encoding reused)
)


def emulated_nvfp4_newton_schulz(g: torch.Tensor, steps: int, broken: str | None = None) -> torch.Tensor:
    """newton_schulz(g, fmt="nvfp4") written from its docstring, for a matrix or a stack [n, rows, cols]
    (each matrix normalized and quantized alone; the GEMMs batched); `broken` names a deliberate error."""
    a, b, c = KELLER_COEFFICIENTS

    def each(f, t: torch.Tensor) -> torch.Tensor:
        return torch.stack([f(m) for m in t]) if t.ndim == 3 else f(t)

    def fp4(t: torch.Tensor) -> torch.Tensor:  # 1x16 blocks along the last dim, decoded to fp32
        return each(lambda m: quantize(m.contiguous(), "nvfp4").dequantize(), t)

    tall = g.shape[-2] > g.shape[-1]
    x = g.bfloat16().mT if tall else g.bfloat16()
    # Each matrix's Frobenius norm, reduced as newton_schulz reduces it: on CUDA another reduction
    # order could move a bf16 rounding (the CPU test holds the stack to each matrix run alone).
    norm = x.norm() if x.ndim == 2 else torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True)
    x = x / norm.clamp(min=1e-7)
    for _ in range(steps):
        if broken == "gram-bf16":
            gram = x @ x.mT
        elif broken == "gram-short-axis":
            gram = (fp4(x.mT).mT @ fp4(x.mT)).bfloat16()
        else:
            gram = (fp4(x) @ fp4(x).mT).bfloat16()
        left = fp4(gram.mT).mT if broken == "square-left-along-columns" else fp4(gram)
        right = fp4(gram) if broken == "square-right-along-rows" else fp4(gram.mT).mT
        square = (gram @ gram).float() if broken == "square-bf16" else left @ right
        poly = (b * gram.float() + c * square).bfloat16()
        b_side = fp4(poly.mT).mT if broken == "bx-b-along-rows" else fp4(poly)
        x_side = fp4(x) if broken == "bx-x-long-axis" else fp4(x.mT).mT
        product = (poly @ x).float() if broken == "bx-bf16" else b_side @ x_side
        x = (a * x.float() + product).bfloat16()
    return x.mT if tall else x


@pytest.mark.parametrize("shape", [(64, 32), (32, 96)])
def test_nvfp4_newton_schulz_is_three_nvfp4_gemms_blocked_along_their_contraction_axes(shape):
    g = _gradient_like(*shape, torch.Generator().manual_seed(2))  # rows and columns of unequal scale
    out = newton_schulz(g, steps=2, fmt="nvfp4")
    assert out.dtype == torch.bfloat16 and out.shape == g.shape
    assert torch.equal(out, emulated_nvfp4_newton_schulz(g, steps=2))
    for broken in NS_EMULATION_BREAKS:
        assert not torch.equal(out, emulated_nvfp4_newton_schulz(g, steps=2, broken=broken)), broken
    assert not torch.equal(out, newton_schulz(g, steps=2, fmt="bf16"))


def _gradient_stack(n: int, rows: int, cols: int) -> torch.Tensor:
    """n gradient-like matrices of very different scales: a norm or a tensor scale shared by the stack would show."""
    gen = torch.Generator().manual_seed(2)
    return torch.stack([_gradient_like(rows, cols, gen) * (1.0, 1e-3, 50.0)[i % 3] for i in range(n)])


@pytest.mark.parametrize("shape", [(96, 48), (48, 96)])
def test_batched_nvfp4_newton_schulz_is_each_matrix_s_bit_for_bit(shape):
    stack = _gradient_stack(3, *shape)
    out = newton_schulz(stack, steps=2, fmt="nvfp4")
    assert out.dtype == torch.bfloat16 and out.shape == stack.shape
    for i in range(3):  # the CPU's fp32 bmm sums each product as its mm does
        assert torch.equal(out[i], newton_schulz(stack[i], steps=2, fmt="nvfp4")), i
    assert torch.equal(out, emulated_nvfp4_newton_schulz(stack, steps=2))
    with pytest.raises(ValueError, match=re.escape("shape [3, 40, 48] is not (use fmt='bf16')")):
        newton_schulz(torch.zeros(3, 40, 48), fmt="nvfp4")


def check_fused_newton_schulz_equals_the_emulation(device: str, shapes) -> None:
    """newton_schulz(fmt="nvfp4") where Triton runs takes every operand from the fused quantizer (six
    per step) and gives the emulation's bits (the emulation quantizes with the torch reference)."""
    from fp4lab.numerics.kernels import quantize as triton_quantize

    calls = []
    fused = triton_quantize.quantize_fused
    triton_quantize.quantize_fused = lambda x, **options: calls.append(tuple(x.shape)) or fused(x, **options)
    try:
        for shape in shapes:
            g = _gradient_like(*shape, torch.Generator().manual_seed(2)).to(device)
            calls.clear()
            out = newton_schulz(g, steps=2, fmt="nvfp4")
            assert len(calls) == 12, (shape, calls)
            assert torch.equal(out, emulated_nvfp4_newton_schulz(g, steps=2)), shape
    finally:
        triton_quantize.quantize_fused = fused


def test_fused_nvfp4_newton_schulz_equals_the_reference_under_the_interpreter():
    from tests import interpreted

    interpreted.run_interpreted(__name__, "check_fused_newton_schulz_equals_the_emulation('cpu', [(64, 32), (32, 96)])")


def check_fused_nvfp4_adam_v_equals_the_reference(device: str) -> None:
    """AdamW(v_format="nvfp4") where Triton runs encodes and decodes v with the fused quantizer and
    decode (one call each per quantized parameter and step) and keeps the torch reference's bits:
    parameters and every state tensor equal after three steps (an fp32-v norm and a 3D parameter too)."""
    from fp4lab.numerics import kernels
    from fp4lab.numerics.kernels import quantize as triton_quantize
    from fp4lab.optim.adamw import AdamW

    calls = []
    fused, decode = triton_quantize.quantize_fused, triton_quantize.decode_fused
    triton_quantize.quantize_fused = lambda x, **o: calls.append("encode") or fused(x, **o)
    triton_quantize.decode_fused = lambda *a, **o: calls.append("decode") or decode(*a, **o)
    runs_on = kernels.runs_on
    results = []
    try:
        for kernels.runs_on in (runs_on, lambda device: False):  # fused where it runs, then the reference
            g = torch.Generator().manual_seed(4)
            params = [torch.nn.Parameter(torch.randn(shape, generator=g).to(device)) for shape in ((96, 64), (2, 48, 64), (64,))]
            optimizer = AdamW(params, lr=1e-2, v_format="nvfp4")
            for _ in range(3):
                for p in params:
                    p.grad = (torch.randn(p.shape, generator=g) * torch.rand(p.shape[-1], generator=g) ** 4).to(device)
                optimizer.step()
            results.append((params, [optimizer.state[p] for p in params]))
            # 2 quantized parameters: encoded when their state is made, then decoded and encoded each step
            expected = (2 + 6, 6) if len(results) == 1 else (0, 0)
            assert (calls.count("encode"), calls.count("decode")) == expected, calls
            calls.clear()
    finally:
        triton_quantize.quantize_fused, triton_quantize.decode_fused, kernels.runs_on = fused, decode, runs_on
    (fast, fast_state), (ref, ref_state) = results
    for a, b, sa, sb in zip(fast, ref, fast_state, ref_state):
        assert torch.equal(a, b), (a - b).abs().max()
        assert sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa), sorted(sa)


def test_fused_nvfp4_adam_v_equals_the_reference_under_the_interpreter():
    from tests import interpreted

    interpreted.run_interpreted(__name__, "check_fused_nvfp4_adam_v_equals_the_reference('cpu')")


@pytest.mark.cuda
def test_fused_nvfp4_adam_v_equals_the_reference_on_cuda():
    pytest.importorskip("triton")
    check_fused_nvfp4_adam_v_equals_the_reference("cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("optimizer", ["adamw-nvfp4-v", "muon-nvfp4-ns"])
def test_fullstack_optimizer_steps_never_wait_for_the_gpu(optimizer):
    """fullstack's optimizer steps run outside the CUDA graph, so a host wait in them serialises host and
    GPU: the NVFP4 v's decode once copied its sign vector from host memory per parameter and step (a
    blocking copy synchronises the stream). torch's sync debug mode turns every such wait into an error."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU)")
    pytest.importorskip("triton")
    from fp4lab.optim.adamw import AdamW

    params = [torch.nn.Parameter(torch.randn(256, 128, device="cuda")) for _ in range(2)]
    if optimizer == "adamw-nvfp4-v":
        opt = AdamW(params, lr=1e-3, v_format="nvfp4")
    else:
        opt = Muon(params, ns_format="nvfp4", ns_coefficients=NS_POLYNOMIALS["cubic"])
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()  # creates the state (and copies the constants to the GPU, once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(torch.isfinite(p).all() for p in params)


def test_tensor_core_newton_schulz_is_the_reference_where_triton_does_not_run():
    stack = _gradient_stack(3, 48, 96)
    assert torch.equal(newton_schulz(stack, steps=2, fmt="nvfp4", tensor_cores=True), newton_schulz(stack, steps=2, fmt="nvfp4"))


def check_nvfp4_newton_schulz_on_tensor_cores(device: str, shapes, stack_shape) -> None:
    """The NVFP4 GEMMs on bf16 tensor cores (block values, outer scales after) against the fp32 GEMM of the
    decoded operands: the same codes and scales and the same exact products (bf16 x bf16 is exact in
    fp32), so they differ only by roundings. The reference rounds each decoded element once (values x
    outer, <= u relative, u = 2^-24), so each product by <= 2u + u^2, and sums k of them in fp32; the
    tensor-core path sums exact products and rounds alpha = outer_a outer_b and the scaled result once
    each. A recursive fp32 sum of k terms errs by <= (k - 1) u sum |terms| (Higham, Thm 3.1's gamma);
    Hopper's MMA is taken as 4 u per addition (it aligns addends by truncation). So
    |fast - ref| <= ((k - 1) (4 + 1) u + 2u + 3u) sum_i |a_i| |b_i| of the decoded operands."""
    from fp4lab.optim.muon import _nvfp4_decoded, _nvfp4_matmul, _nvfp4_tensor_core_matmul

    u = 2.0**-24
    for shape in shapes:
        x = (_gradient_stack(shape[0], *shape[1:]) if len(shape) == 3 else _gradient_like(*shape, torch.Generator().manual_seed(4))).to(device)
        x = (x / x.norm(dim=(-2, -1), keepdim=True)).bfloat16()
        for left, right in [(x, x.mT), (x @ x.mT, x)]:
            left, right = left.contiguous(), right.contiguous()
            fast, ref = _nvfp4_tensor_core_matmul(left, right), _nvfp4_matmul(left, right)
            k = left.shape[-1]
            magnitude = _nvfp4_decoded(left).abs() @ _nvfp4_decoded(right.mT).abs().mT
            bound = ((k - 1) * 5 * u + 5 * u) * magnitude
            excess = ((fast - ref).abs() - bound).max().item()
            assert excess <= 0, (shape, k, excess)
            assert not torch.equal(fast, ref)  # a different rounding, not the same call
    # Through the iteration, a changed rounding can flip a code: the results stay as close to exact
    # orthogonalization (the bf16 iteration) as the reference's.
    stack = _gradient_stack(*stack_shape).to(device)
    exact = newton_schulz(stack, NS_POLYNOMIALS["cubic"], steps=5).float()
    errors = [
        ((newton_schulz(stack, NS_POLYNOMIALS["cubic"], steps=5, fmt="nvfp4", tensor_cores=on).float() - exact).norm() / exact.norm()).item()
        for on in (False, True)
    ]
    assert errors[1] <= 1.25 * errors[0] + 0.005, errors


def test_nvfp4_newton_schulz_on_tensor_cores_under_the_interpreter():
    from tests import interpreted

    interpreted.run_interpreted(__name__, "check_nvfp4_newton_schulz_on_tensor_cores('cpu', [(2, 64, 96), (64, 32)], (3, 64, 96))")


@pytest.mark.cuda
def test_nvfp4_newton_schulz_on_tensor_cores_is_the_reference_up_to_rounding():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU)")
    pytest.importorskip("triton")
    check_nvfp4_newton_schulz_on_tensor_cores("cuda", [(2, 768, 2048), (3, 256, 128), (512, 1024)], (4, 768, 2048))


@pytest.mark.cuda
def test_fused_nvfp4_newton_schulz_equals_the_reference_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU)")
    pytest.importorskip("triton")
    check_fused_newton_schulz_equals_the_emulation("cuda", [(64, 32), (768, 2048), (2048, 768)])
    check_fused_batched_newton_schulz_equals_the_emulation("cuda", [(768, 768), (2048, 768), (768, 2048)], n=4, steps=2)


def check_fused_batched_newton_schulz_equals_the_emulation(device: str, shapes, n: int, steps: int) -> None:
    """A stack of n matrices takes six fused quantizations per step, not 6 n: each operand of the stack
    in one nvfp4_cta call with one CTA tile (one outer scale) per matrix; and gives the bits of the
    emulation, which quantizes each matrix alone with the torch reference."""
    from fp4lab.numerics.kernels import quantize as triton_quantize

    calls = []
    fused = triton_quantize.quantize_fused
    triton_quantize.quantize_fused = lambda x, **options: calls.append((x.shape[0], options)) or fused(x, **options)
    try:
        for rows, cols in shapes:
            stack = _gradient_stack(n, rows, cols).to(device)
            calls.clear()
            out = newton_schulz(stack, steps=steps, fmt="nvfp4")
            assert len(calls) == 6 * steps, ((rows, cols), len(calls))
            for stacked_rows, options in calls:
                assert options["fmt"] == "nvfp4_cta", options
                assert stacked_rows == n * options["cta_tile"], (stacked_rows, options)
            assert torch.equal(out, emulated_nvfp4_newton_schulz(stack, steps=steps)), (rows, cols)
    finally:
        triton_quantize.quantize_fused = fused


def test_fused_batched_nvfp4_newton_schulz_equals_the_reference_under_the_interpreter():
    from tests import interpreted

    # One step: the interpreter spends about 1.5 s a quantize call, whatever the stack's size.
    check = "check_fused_batched_newton_schulz_equals_the_emulation('cpu', [(64, 32), (32, 96)], n=3, steps=1)"
    interpreted.run_interpreted(__name__, check)


def _gradient_like(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """dW = delta^T x over a batch, with a few large input channels, as in LLM activations."""
    x = torch.randn(512, cols, generator=gen)
    x[:, :4] *= 20
    delta = torch.randn(512, rows, generator=gen)
    return delta.T @ x


# Singular values after 5 steps, min and max, on a 256x128 matrix (seed 3), measured with this code:
#                     quintic bf16   quintic nvfp4    cubic bf16    cubic nvfp4
#   gaussian          0.680 1.137    1.8   6.0e4      0.207 0.846   0.207 0.850
#   gradient_like     0.681 1.136    0.0   3.2e33     0.041 1.000   0.041 1.016
# Keller's quintic leaves each step as a cancellation, a - 4.775 s^2 + 2.03 s^4 = 0.70 at s = 1 from
# terms near 3.4 and 2.7, so the NVFP4 error of the GEMMs comes out about fivefold, and a singular value
# pushed past about 1.3 grows without bound (the quintic grows as s^5); with the Gram product alone in
# NVFP4 the largest already reaches 4.8. The cubic's 1.5 - 0.5 s^2 cancels far less and contracts toward
# 1 from both sides: the fullstack recipe runs it.
@pytest.mark.parametrize("kind", ["gaussian", "gradient_like"])
def test_nvfp4_cubic_keeps_the_singular_values_of_the_bf16_cubic_and_the_quintic_diverges(kind):
    gen = torch.Generator().manual_seed(3)
    g = torch.randn(256, 128, generator=gen) if kind == "gaussian" else _gradient_like(256, 128, gen)

    def svdvals(polynomial: str, fmt: str) -> torch.Tensor:
        return torch.linalg.svdvals(newton_schulz(g, NS_POLYNOMIALS[polynomial], fmt=fmt).float())

    cubic, cubic_bf16 = svdvals("cubic", "nvfp4"), svdvals("cubic", "bf16")
    assert cubic.max() < 1.05 and cubic.max() - cubic_bf16.max() < 0.03, (cubic.max(), cubic_bf16.max())
    assert (cubic - cubic_bf16).abs().max() < 0.05
    assert svdvals("quintic", "bf16").max() < 1.15 and svdvals("quintic", "nvfp4").max() > 100


def test_muon_state_dict_round_trip_resumes_bit_identically():
    gen = torch.Generator().manual_seed(4)
    w0 = [torch.randn(48, 32, generator=gen), torch.randn(32, 64, generator=gen)]
    grads = [[torch.randn(w.shape, generator=gen) for w in w0] for _ in range(2)]
    for ns_format in ("bf16", "nvfp4"):
        kwargs = {"lr": 0.02, "weight_decay": 0.1, "ns_format": ns_format, "lr_scaling": "moonlight"}
        straight = [torch.nn.Parameter(w.clone()) for w in w0]
        opt = Muon(straight, **kwargs)
        for step_grads in grads:
            for p, g in zip(straight, step_grads):
                p.grad = g.clone()
            opt.step()

        first = [torch.nn.Parameter(w.clone()) for w in w0]
        opt1 = Muon(first, **kwargs)
        for p, g in zip(first, grads[0]):
            p.grad = g.clone()
        opt1.step()
        saved = _save_load(opt1.state_dict())
        resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
        opt2 = Muon(resumed, lr=1.0, ns_format=ns_format)  # hyperparameters come from the checkpoint
        opt2.load_state_dict(saved)
        for p, g in zip(resumed, grads[1]):
            p.grad = g.clone()
        opt2.step()
        for a, b in zip(straight, resumed):
            assert torch.equal(a, b), ns_format


# ------------------------------------------------------------------------------------- build


def llama_params(
    n_layers: int = 2, dim: int = 32, n_kv_heads_dim: int = 16, hidden: int = 64, vocab: int = 128
) -> dict[str, torch.nn.Parameter]:
    """torchtitan Llama parameter names and shapes, without fp4lab.nn (optim may not import it)."""
    gen = torch.Generator().manual_seed(5)
    shapes = {"tok_embeddings.weight": (vocab, dim)}
    for i in range(n_layers):
        shapes |= {
            f"layers.{i}.attention.wq.weight": (dim, dim),
            f"layers.{i}.attention.wk.weight": (n_kv_heads_dim, dim),
            f"layers.{i}.attention.wv.weight": (n_kv_heads_dim, dim),
            f"layers.{i}.attention.wo.weight": (dim, dim),
            f"layers.{i}.feed_forward.w1.weight": (hidden, dim),
            f"layers.{i}.feed_forward.w2.weight": (dim, hidden),
            f"layers.{i}.feed_forward.w3.weight": (hidden, dim),
            f"layers.{i}.attention_norm.weight": (dim,),
            f"layers.{i}.ffn_norm.weight": (dim,),
        }
    shapes |= {"norm.weight": (dim,), "output.weight": (vocab, dim)}
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.1) for n, s in shapes.items()}


def test_routing_follows_the_muon_convention():
    params = llama_params()
    opt = build_optimizer(params.items(), OptimizerConfig())
    muon = {n for n, r in opt.route.items() if r == "muon"}
    expected = {
        f"layers.{i}.{m}.weight"
        for i in range(2)
        for m in (
            "attention.wq",
            "attention.wk",
            "attention.wv",
            "attention.wo",
            "feed_forward.w1",
            "feed_forward.w2",
            "feed_forward.w3",
        )
    }
    assert muon == expected
    assert set(opt.route) == set(params)  # everything else is AdamW's
    muon_ids = {id(p) for g in opt.optimizers["muon"].param_groups for p in g["params"]}
    assert muon_ids == {id(params[n]) for n in expected}
    assert isinstance(opt, CombinedOptimizer)


def test_lora_svd_factors_are_buffers_no_optimizer_sees():
    model = build_model(preset("tiny", 256, 64), load_recipe("fullstack"), seed=0)
    buffers = {name for name, _ in model.named_buffers() if name.endswith(("lora_u", "lora_v"))}
    assert buffers and not any("lora" in name for name, _ in model.named_parameters())
    opt = build_optimizer(model.named_parameters(), OptimizerConfig())
    assert set(opt.route) == {name for name, _ in model.named_parameters()}
    assert {n for n, r in opt.route.items() if r == "muon"} == {
        name for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("layers.")
    }


def test_adamw_name_routes_everything_to_adamw_at_adam_lr():
    params = llama_params()
    opt = build_optimizer(params.items(), OptimizerConfig(name="adamw", adam_lr=1e-3))
    assert set(opt.route.values()) == {"adamw"} and list(opt.optimizers) == ["adamw"]
    assert all(g["lr"] == 1e-3 for g in opt.param_groups)


def test_groups_lr_and_weight_decay():
    params = llama_params()
    cfg = OptimizerConfig(lr=0.03, adam_lr=4e-4, weight_decay=0.1)
    opt = build_optimizer(params.items(), cfg)
    (muon_group,) = opt.optimizers["muon"].param_groups
    assert muon_group["lr"] == 0.03 and muon_group["weight_decay"] == 0.1
    decay, no_decay = opt.optimizers["adamw"].param_groups
    assert {id(p) for p in decay["params"]} == {id(params["tok_embeddings.weight"]), id(params["output.weight"])}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.ndim == 1 for p in no_decay["params"]) and len(no_decay["params"]) == 5
    assert decay["lr"] == no_decay["lr"] == 4e-4


def test_set_lr_scale_multiplies_each_groups_base_lr():
    opt = build_optimizer(llama_params().items(), OptimizerConfig(lr=0.02, adam_lr=3e-4))
    opt.set_lr_scale(0.5)
    assert sorted(g["lr"] for g in opt.param_groups) == [1.5e-4, 1.5e-4, 0.01]
    opt.set_lr_scale(0.1)  # relative to the base lr, not compounding
    assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx([3e-5, 3e-5, 0.002])


def test_frozen_params_are_left_out():
    params = llama_params()
    params["output.weight"].requires_grad_(False)
    opt = build_optimizer(params.items(), OptimizerConfig())
    assert "output.weight" not in opt.route


def test_muon_without_any_block_matrix_is_an_error():
    params = {"blocks.0.attn.weight": torch.nn.Parameter(torch.zeros(16, 16))}
    with pytest.raises(ValueError, match="no parameter is a 2D 'layers"):
        build_optimizer(params.items(), OptimizerConfig())


def _fake_grads(params: dict[str, torch.nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen) + 0.1 * p.detach()


def test_combined_state_dict_round_trip_resumes_bit_identically():
    cfg = OptimizerConfig(ns_format="nvfp4", adam_v_format="nvfp4", update_cap=(0.05, 0.02), weight_decay=0.1)
    straight = llama_params()
    opt = build_optimizer(straight.items(), cfg)
    for step in range(3):
        _fake_grads(straight, step)
        opt.set_lr_scale(1.0 - 0.1 * step)
        opt.step()

    first = llama_params()
    opt1 = build_optimizer(first.items(), cfg)
    for step in range(2):
        _fake_grads(first, step)
        opt1.set_lr_scale(1.0 - 0.1 * step)
        opt1.step()
    emb_state = opt1.optimizers["adamw"].state[first["tok_embeddings.weight"]]
    assert emb_state["v_codes"].dtype == torch.uint8  # the embedding's v really is NVFP4 here
    saved = _save_load(opt1.state_dict())
    resumed = {n: torch.nn.Parameter(p.detach().clone()) for n, p in first.items()}
    opt2 = build_optimizer(resumed.items(), cfg)
    opt2.load_state_dict(saved)
    assert opt2.optimizers["adamw"].state[resumed["tok_embeddings.weight"]]["v_codes"].dtype == torch.uint8
    _fake_grads(resumed, 2)
    opt2.set_lr_scale(1.0 - 0.1 * 2)
    opt2.step()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_load_state_dict_from_a_different_optimizer_name_is_refused():
    saved = build_optimizer(llama_params().items(), OptimizerConfig(name="adamw")).state_dict()
    opt = build_optimizer(llama_params().items(), OptimizerConfig(name="muon"))
    with pytest.raises(ValueError, match="different OptimizerConfig.name"):
        opt.load_state_dict(saved)


def test_update_cap_is_wired_to_block_matrices_with_alpha_qk_on_wq_wk():
    params = llama_params()
    opt = build_optimizer(params.items(), OptimizerConfig(update_cap=(0.05, 0.02), lr=5.0))
    alphas = {id(p): a for p, a in opt.cap.params_and_alphas}
    names = {id(p): n for n, p in params.items()}
    assert {names[i] for i in alphas} == {n for n, r in opt.route.items() if r == "muon"}
    for i, alpha in alphas.items():
        assert alpha == (0.02 if names[i].endswith(("wq.weight", "wk.weight")) else 0.05)
    before = {n: p.detach().clone() for n, p in params.items()}
    _fake_grads(params, 0)
    opt.step()  # lr=5 makes every Muon update far larger than 5 % of the weight: the cap binds
    for n, p in params.items():
        if id(p) in alphas:
            ratio = (torch.linalg.vector_norm(p.detach() - before[n]) / torch.linalg.vector_norm(before[n])).item()
            assert ratio == pytest.approx(alphas[id(p)], rel=1e-5), n


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("name", "sgd", "OptimizerConfig.name='sgd' is not supported; allowed: 'muon', 'adamw'"),
        ("lr_scaling", "rms", "OptimizerConfig.lr_scaling='rms' is not supported; allowed: 'original', 'moonlight'"),
        ("ns_format", "bf8", "OptimizerConfig.ns_format='bf8' is not supported; allowed: 'bf16', 'nvfp4'"),
        ("adam_v_format", "int4", "OptimizerConfig.adam_v_format='int4' is not supported; allowed: 'fp32', 'nvfp4'"),
        ("lr", 0.0, "OptimizerConfig.lr=0.0 must be a finite number > 0"),
        ("adam_lr", math.nan, "OptimizerConfig.adam_lr=nan must be a finite number > 0"),
        ("weight_decay", -0.1, "OptimizerConfig.weight_decay=-0.1 must be a finite number >= 0"),
        ("betas", (0.9, 1.0), "OptimizerConfig.betas=(0.9, 1.0) must be two numbers in [0, 1)"),
        ("momentum", 1.5, "OptimizerConfig.momentum=1.5 must be in [0, 1)"),
        ("ns_steps", 0, "OptimizerConfig.ns_steps=0 must be an int in [1, 99]"),
        ("ns_coefficients", (1.0, 2.0), "OptimizerConfig.ns_coefficients=(1.0, 2.0) must be three numbers"),
        ("update_cap", 0.05, "OptimizerConfig.update_cap=0.05 must be None or (alpha, alpha_qk)"),
        ("nesterov", "yes", "OptimizerConfig.nesterov='yes' must be True or False"),
    ],
)
def test_config_errors_are_one_line_and_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        OptimizerConfig(**{field: value})
    assert "\n" not in str(info.value)


def test_optim_imports_only_numerics_from_fp4lab():
    """The layering rule: numerics <- nn <- optim; optim must not import nn or anything above it."""
    for path in Path(__file__).resolve().parents[2].joinpath("fp4lab", "optim").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            modules = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module]
            for m in modules:
                if m.startswith("fp4lab"):
                    assert m.startswith(("fp4lab.numerics", "fp4lab.optim", "fp4lab.validation")), f"{path.name} imports {m}"


def test_batched_newton_schulz_equals_one_matrix_at_a_time():
    gen = torch.Generator().manual_seed(4)
    for shape in ((48, 96), (96, 48), (64, 64)):
        stack = torch.randn(3, *shape, generator=gen)
        batched = newton_schulz(stack)
        for i in range(3):
            torch.testing.assert_close(batched[i].float(), newton_schulz(stack[i]).float(), rtol=0, atol=2e-3)


MIXED_SHAPES = [(32, 64), (32, 64), (64, 32), (48, 48), (32, 64)]


def _muon_steps(**options) -> list[torch.Tensor]:
    """MIXED_SHAPES parameters after three Muon steps on seeded gradients, each matrix's at its own scale."""
    gen = torch.Generator().manual_seed(5)
    params = [
        torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i))) for i, s in enumerate(MIXED_SHAPES)
    ]
    opt = Muon(params, lr=0.02, weight_decay=0.01, **options)
    for _ in range(3):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (i - 2)
        opt.step()
    return [p.detach() for p in params]


def test_batched_muon_steps_like_unbatched_muon():
    for unbatched, batched in zip(_muon_steps(), _muon_steps(batched=True)):
        torch.testing.assert_close(batched, unbatched, rtol=0, atol=1e-3)


def test_batched_nvfp4_muon_steps_bit_for_bit_like_unbatched(monkeypatch):
    from fp4lab.optim import muon

    options = {"ns_format": "nvfp4", "ns_coefficients": NS_POLYNOMIALS["cubic"]}  # the quintic diverges in NVFP4
    unbatched = _muon_steps(**options)
    stacks = []
    one_call = muon.newton_schulz
    monkeypatch.setattr(muon, "newton_schulz", lambda g, *ns, **kw: stacks.append(tuple(g.shape)) or one_call(g, *ns, **kw))
    batched = _muon_steps(batched=True, **options)
    assert stacks == [(3, 32, 64), (1, 64, 32), (1, 48, 48)] * 3
    for a, b in zip(unbatched, batched):
        assert torch.equal(a, b)


def test_fused_config_batches_muon_and_fuses_adamw():
    params = llama_params()
    opt = build_optimizer(params.items(), OptimizerConfig(fused=True))
    assert opt.optimizers["muon"].batched and opt.optimizers["muon"].ns_tensor_cores
    adamw = opt.optimizers["adamw"]
    assert type(adamw) is torch.optim.AdamW and all(g["fused"] for g in adamw.param_groups)
    plain = build_optimizer(params.items(), OptimizerConfig())
    assert not plain.optimizers["muon"].batched and not plain.optimizers["muon"].ns_tensor_cores
    assert type(plain.optimizers["adamw"]) is not torch.optim.AdamW
    nvfp4_v = build_optimizer(params.items(), OptimizerConfig(fused=True, adam_v_format="nvfp4"))
    assert type(nvfp4_v.optimizers["adamw"]) is not torch.optim.AdamW  # torch has no NVFP4 state


def test_the_cubic_newton_schulz_is_selectable_and_is_the_classic_iteration(tmp_path):
    from fp4lab.nn.recipe import load_recipe
    from fp4lab.optim.muon import NS_POLYNOMIALS, newton_schulz
    from fp4lab.train.build import optimizer_config
    from fp4lab.train.config import TrainConfig

    g = torch.randn(48, 96, generator=torch.Generator().manual_seed(3))
    cubic = newton_schulz(g, NS_POLYNOMIALS["cubic"], steps=3).float()
    x = g.bfloat16() / g.bfloat16().norm()
    for _ in range(3):  # 0.5 (3 I - X X^T) X, in the same bf16 arithmetic up to one rounding of b * XX^T
        x = (1.5 * x.float() - 0.5 * (x @ x.T).float() @ x.float()).bfloat16()
    assert torch.allclose(cubic, x.float(), rtol=0, atol=2e-2)
    # the cubic drives every singular value to 1; Keller's quintic leaves them spread around 1
    s_cubic = torch.linalg.svdvals(newton_schulz(g, NS_POLYNOMIALS["cubic"], steps=40).float())
    s_quintic = torch.linalg.svdvals(newton_schulz(g, NS_POLYNOMIALS["quintic"], steps=40).float())
    assert (s_cubic - 1).abs().max() < 0.02 and (s_quintic - 1).abs().max() > 0.1
    # the wire: a run's ns_polynomial (else its recipe's) reaches Muon
    recipe = load_recipe("nvfp4")
    assert optimizer_config(TrainConfig(ns_polynomial="cubic"), recipe, fused=False).ns_coefficients == NS_POLYNOMIALS["cubic"]
    assert optimizer_config(TrainConfig(), recipe, fused=False).ns_coefficients == NS_POLYNOMIALS["quintic"]
    (tmp_path / "cubic.toml").write_text('extends = "nvfp4"\nname = "cubic"\n[optimizer]\nns_polynomial = "cubic"\n')
    from_recipe = optimizer_config(TrainConfig(), load_recipe(str(tmp_path / "cubic.toml")), fused=False)
    assert from_recipe.ns_coefficients == NS_POLYNOMIALS["cubic"]
