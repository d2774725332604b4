"""Fused FP4 producers (fp4lab.numerics.kernels.fusion) against their torch reference
(fp4lab.numerics.fusion), bit for bit, and the reference against the unfused ops of the model.

Two kinds of check:
- faithful: each reference is the unfused composition fp4lab runs today: FeedForward's
  silu(w1 x) * w3 x (under bf16 autocast too) then `quantize`; autograd's gradients of it; the
  residual add then nn.RMSNorm (equal up to the sum order of the mean of squares, which torch leaves
  to the device: a few float32 ulps) then `quantize`. CPU, no Triton.
- exact: kernel == reference, torch.equal on the bits of every tensor (values, outer, codes, scale
  bytes, h / s / rstd / n, d_gate / d_up). On CUDA at realistic shapes (marked `cuda`), and on the
  CPU under Triton's interpreter at small ones. Under the interpreter exp is numpy's, which differs
  from torch's CPU exp in the last bit of some float32 results: there, bf16 inputs are compared bit
  for bit as everywhere (h rounds to bf16), and for fp32 inputs the produced tensor is compared to
  within 4 ulps and every encoding bit for bit against the reference quantizer applied to the
  kernel's own produced tensor. RMSNorm has no exp: bit for bit in every case.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fp4lab.numerics import BLOCK_SIZE, hadamard_signs, quantize
from fp4lab.numerics.fusion import (
    encode_reference,
    residual_rmsnorm_quantize_reference,
    rmsnorm_backward,
    rmsnorm_reference,
    swiglu_backward_reference,
    swiglu_quantize_reference,
)
from tests import interpreted

FIELDS = ("values", "outer", "codes", "scales")


def _gen(seed: int, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def assert_same_bits(got, want, label: str) -> None:
    """Equal bit for bit (-0.0 stays -0.0; the inputs hold no NaN)."""
    assert got is not None and got.dtype == want.dtype and got.shape == want.shape, f"{label}: {got.dtype if got is not None else None} vs {want.dtype}, shape"
    view = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.uint8: torch.uint8}[want.dtype]
    bad = got.reshape(-1).view(view) != want.reshape(-1).view(view)
    assert not bad.any(), f"{label}: {int(bad.sum())} of {bad.numel()} differ, e.g. {got.reshape(-1)[bad][:3].tolist()} vs {want.reshape(-1)[bad][:3].tolist()}"


def assert_encoding(got, want, label: str) -> None:
    for field in FIELDS:
        expected = getattr(want, field)
        if expected is None:
            assert getattr(got, field) is None, f"{label}: {field} should be None"
        else:
            assert_same_bits(getattr(got, field), expected, f"{label} {field}")


def assert_within_ulps(got, want, ulps: int, label: str) -> None:
    """float32 tensors of one sign pattern within `ulps` units in the last place."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape, label
    distance = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
    worst = int(distance.max()) if distance.numel() else 0
    assert worst <= ulps, f"{label}: {worst} ulps apart"


# ----------------------------------------------------------------------------------------------
# Cases shared by the CUDA tests and the interpreter check
# ----------------------------------------------------------------------------------------------

# (fmt, scale_mode, rounding, signs size) for the row orientation; the col orientation takes the next one
ORIENTATIONS = [("mxfp4", None, "rtn", 0), ("nvfp4", None, "rtn", 0), ("mxfp4", "rceil", "sr", 32), ("nvfp4", None, "sr", 16)]


def orientation(index: int, device, seed: int) -> dict:
    fmt, mode, rounding, size = ORIENTATIONS[index % len(ORIENTATIONS)]
    signs = hadamard_signs(size, "random", _gen(size)).to(device) if size else None
    return {"fmt": fmt, "scale_mode": mode, "rounding": rounding, "signs": signs, "seed": seed}


def expected(t: torch.Tensor, spec: dict, transpose: bool = False):
    """(reference encoding, kernel options) for `t` (the produced tensor) and one orientation: SR
    draws the reference's uniforms from a generator seeded with spec's seed, and the kernel is given
    the same draws (e2m1.round_stochastic's torch.rand over the [rows, blocks, block] view)."""
    fmt, rounding = spec["fmt"], spec["rounding"]
    shape = (t.shape[1], t.shape[0]) if transpose else tuple(t.shape)
    options = {"scale_mode": spec["scale_mode"], "rounding": rounding, "signs": spec["signs"]}
    kernel = {"fmt": fmt, "emit_codes": True, **options}
    if rounding == "sr":
        block = BLOCK_SIZE[fmt]
        draws = torch.rand((shape[0], shape[1] // block, block), generator=_gen(spec["seed"], t.device), device=t.device)
        kernel["uniforms"] = draws.reshape(shape).contiguous()
        options["generator"] = _gen(spec["seed"], t.device)
    return encode_reference(t, fmt, transpose=transpose, **options), kernel


def swiglu_inputs(shape, dtype, device, seed: int, magnitude: float = 1.0):
    g = _gen(seed)
    gate, up = (torch.randn(shape, generator=g) * 3 for _ in range(2))
    return gate.mul(magnitude).to(device, dtype), up.mul(magnitude).to(device, dtype)


def check_swiglu(gate, up, row: dict, col: dict | None, exact: bool, label: str) -> None:
    from fp4lab.numerics.kernels.fusion import swiglu_quantize_fused

    ref = swiglu_quantize_reference(gate, up, row["fmt"])  # h only: the encodings come from `expected`
    h = ref.h
    if not exact:  # the kernel's h (numpy's exp under the interpreter), within ulps of the reference's
        probe = swiglu_quantize_fused(gate, up, fmt="mxfp4", emit_h=True)
        assert_within_ulps(probe.h, ref.h, 4, f"{label} h")
        h = probe.h
    want_row, row_kernel = expected(h, row)
    want_col, col_kernel = expected(h, col, transpose=True) if col is not None else (None, None)
    out = swiglu_quantize_fused(gate, up, col=col_kernel, emit_h=True, **row_kernel)
    assert_same_bits(out.h, h, f"{label} h")
    assert_encoding(out.row, want_row, f"{label} row")
    if col is not None:
        assert_encoding(out.col, want_col, f"{label} col")
    assert swiglu_quantize_fused(gate, up, **row_kernel).h is None


def rmsnorm_inputs(shape, dtypes, device, seed: int, magnitude: float = 1.0):
    g = _gen(seed)
    x, residual = (torch.randn(shape, generator=g) * magnitude for _ in range(2))
    weight = 1 + torch.randn(shape[1], generator=g) / 4
    return x.to(device, dtypes[0]), residual.to(device, dtypes[1]), weight.to(device, dtypes[2])


def check_rmsnorm(x, residual, weight, eps, row: dict, col: dict | None, label: str) -> None:
    from fp4lab.numerics.kernels.fusion import residual_rmsnorm_quantize_fused

    ref = residual_rmsnorm_quantize_reference(x, residual, weight, eps, row["fmt"])
    want_row, row_kernel = expected(ref.normed, row)
    want_col, col_kernel = expected(ref.normed, col, transpose=True) if col is not None else (None, None)
    out = residual_rmsnorm_quantize_fused(x, residual, weight, eps, col=col_kernel, emit_normed=True, **row_kernel)
    assert_same_bits(out.residual, ref.residual, f"{label} residual")
    assert_same_bits(out.rstd, ref.rstd, f"{label} rstd")
    assert_same_bits(out.normed, ref.normed, f"{label} normed")
    assert_encoding(out.row, want_row, f"{label} row")
    if col is not None:
        assert_encoding(out.col, want_col, f"{label} col")


def check_backward(grad_h, gate, up, row: dict | None, col: dict | None, exact: bool, label: str) -> None:
    from fp4lab.numerics.kernels.fusion import swiglu_backward_fused

    ref = swiglu_backward_reference(grad_h, gate, up)
    plain = swiglu_backward_fused(grad_h, gate, up)
    if exact:
        assert_same_bits(plain.d_gate, ref.d_gate, f"{label} d_gate")
        assert_same_bits(plain.d_up, ref.d_up, f"{label} d_up")
    else:
        # 1 + g (1 - sig) cancels near g = -1.28: relative to the largest gradient, not in ulps
        scale = float(ref.d_gate.abs().max()) if ref.d_gate.numel() else 0.0
        assert torch.allclose(plain.d_gate, ref.d_gate, rtol=1e-5, atol=scale * 1e-6), f"{label} d_gate"
        assert_within_ulps(plain.d_up, ref.d_up, 4, f"{label} d_up")
    if row is None and col is None:
        return
    kernel = {}
    wants = {}
    # One seed per orientation: the same SR draws for both gradients, as the kernel uses them
    for name, produced in (("gate", plain.d_gate), ("up", plain.d_up)):
        if row is not None:
            wants[f"{name}_row"], kernel["row"] = expected(produced, row)
        if col is not None:
            wants[f"{name}_col"], kernel["col"] = expected(produced, col, transpose=True)
    out = swiglu_backward_fused(grad_h, gate, up, **kernel)
    assert_same_bits(out.d_gate, plain.d_gate, f"{label} d_gate (quantizing)")
    assert_same_bits(out.d_up, plain.d_up, f"{label} d_up (quantizing)")
    for name, want in wants.items():
        assert_encoding(getattr(out, name), want, f"{label} {name}")


def run_cases(device, token_shapes, widths, exact_fp32: bool, magnitudes=(1.0,), dtypes=(torch.bfloat16, torch.float32)) -> None:
    """Every producer over dtypes, formats, both orientations, SR and transforms, odd and zero token
    counts and the given magnitudes."""
    case = 0
    for tokens in token_shapes:
        for width in widths:
            for dtype in dtypes:
                for magnitude in magnitudes:
                    exact = exact_fp32 or dtype == torch.bfloat16
                    row, col = orientation(case, device, case), orientation(case + 1, device, case + 100)
                    label = f"{tokens}x{width} {dtype} x{magnitude} {row['fmt']}/{col['fmt']}"
                    gate, up = swiglu_inputs((tokens, width), dtype, device, case, magnitude)
                    check_swiglu(gate, up, row, None, exact, f"swiglu {label}")
                    check_swiglu(gate, up, row, col, exact, f"swiglu+col {label}")
                    # (x, residual, weight): the model's (bf16 branch, fp32 residual and gain), all bf16
                    # (s rounded to bf16 before and after the rstd product), bf16 stream, fp32 gain
                    mixes = [(torch.bfloat16, torch.float32, torch.float32), (dtype,) * 3, (dtype, dtype, torch.float32)]
                    dtypes = mixes[case % 3] if dtype == torch.bfloat16 else (dtype,) * 3
                    x, residual, weight = rmsnorm_inputs((tokens, width), dtypes, device, case, magnitude)
                    check_rmsnorm(x, residual, weight, 1e-5, row, None, f"rmsnorm {dtypes} {label}")
                    check_rmsnorm(x, residual, weight, 1e-5, col, row, f"rmsnorm+col {dtypes} {label}")
                    grad_h = swiglu_inputs((tokens, width), dtype, device, case + 7)[0]
                    check_backward(grad_h, gate, up, None, None, exact, f"backward {label}")
                    check_backward(grad_h, gate, up, row, col, exact, f"backward+q {label}")
                    case += 1


def check_seeded_sr(device, shape) -> None:
    """SR from an in-kernel Philox seed draws, per element, what quantize_fused draws for the same
    element of the produced tensor: the fused producers equal quantize_fused of the reference's h and
    n (bf16 inputs: h exact everywhere), codes-only orientations included."""
    from fp4lab.numerics.kernels.fusion import residual_rmsnorm_quantize_fused, swiglu_quantize_fused
    from fp4lab.numerics.kernels.quantize import quantize_fused, quantize_fused_both

    seed = torch.tensor([20261201], dtype=torch.int64, device=device)
    for fmt in ("mxfp4", "nvfp4"):
        row = {"fmt": fmt, "rounding": "sr", "seed": seed, "emit_codes": True}
        col = {"fmt": fmt, "rounding": "sr", "seed": seed, "emit_codes": True, "emit_values": False}
        gate, up = swiglu_inputs(shape, torch.bfloat16, device, seed=11)
        h = swiglu_quantize_reference(gate, up, fmt).h
        fused = swiglu_quantize_fused(gate, up, col=col, **row)
        want_row, want_col = quantize_fused_both(h, row, col)
        assert_encoding(fused.row, want_row, f"seeded swiglu {fmt} row")
        assert_encoding(fused.col, want_col, f"seeded swiglu {fmt} col")
        x, residual, weight = rmsnorm_inputs(shape, (torch.bfloat16, torch.float32, torch.float32), device, seed=12)
        n = residual_rmsnorm_quantize_reference(x, residual, weight, 1e-5, fmt).normed
        fused = residual_rmsnorm_quantize_fused(x, residual, weight, 1e-5, **row)  # mxfp4: the one-pass kernel
        assert_encoding(fused.row, quantize_fused(n, **row), f"seeded rmsnorm {fmt} row")


# ----------------------------------------------------------------------------------------------
# Faithful: the references are the unfused ops (CPU)
# ----------------------------------------------------------------------------------------------


def _feed_forward(dim: int, hidden: int, seed: int):
    from fp4lab.nn.model import FeedForward

    torch.manual_seed(seed)
    return FeedForward(dim, hidden, lambda name, fan_in, fan_out: nn.Linear(fan_in, fan_out, bias=False))


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_swiglu_reference_is_the_model_feed_forward(autocast, fmt):
    """What FeedForward feeds w2 (captured by a hook), under bf16 autocast or in fp32, is the
    reference's h, and its encoding is `quantize` of it: the fused producer replaces exactly that."""
    ff = _feed_forward(64, 128, seed=0)
    x = torch.randn(24, 64, generator=_gen(1))
    captured = {}
    ff.w2.register_forward_pre_hook(lambda module, args: captured.update(h=args[0]))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ff(x)
        gate, up = ff.w1(x), ff.w3(x)
    ref = swiglu_quantize_reference(gate, up, fmt)
    assert ref.h.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert_same_bits(ref.h, captured["h"], "h")
    q = quantize(captured["h"].float(), fmt)
    assert_same_bits(ref.row.codes, q.data, "codes")
    assert_same_bits(ref.row.scales, q.scales, "scales")
    assert_same_bits(ref.row.values, q.factored().values.bfloat16(), "values")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swiglu_backward_reference_is_autograd(dtype):
    """d_gate and d_up are autograd's gradients of silu(gate) * up, bit for bit; their encodings are
    `quantize` of them along either dim."""
    gate, up = swiglu_inputs((32, 64), dtype, "cpu", seed=3)
    grad_h = swiglu_inputs((32, 64), dtype, "cpu", seed=4)[0]
    leaves = [t.clone().requires_grad_() for t in (gate, up)]
    (F.silu(leaves[0]) * leaves[1]).backward(grad_h)
    ref = swiglu_backward_reference(grad_h, gate, up, row={"fmt": "nvfp4"}, col={"fmt": "mxfp4"})
    assert_same_bits(ref.d_gate, leaves[0].grad, "d_gate")
    assert_same_bits(ref.d_up, leaves[1].grad, "d_up")
    assert_same_bits(ref.gate_row.codes, quantize(leaves[0].grad.float(), "nvfp4").data, "d_gate row codes")
    assert_same_bits(ref.up_col.codes, quantize(leaves[1].grad.float().T.contiguous(), "mxfp4").data, "d_up col codes")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("magnitude", [1.0, 2.0**-9, 2.0**40])
@pytest.mark.parametrize("dims", [(16, 96), (8, 1024)])
def test_rmsnorm_reference_is_nn_rmsnorm(dims, magnitude, device):
    """s = x + residual as the block adds them (fp32 residual + bf16 branch), and n within a few float32
    ulps of nn.RMSNorm (the sum order of the mean of squares is torch's own; at 2^-9 eps dominates
    the mean, so a dropped or misplaced eps shows); `quantize` of n is the reference's encoding."""
    rows, dim = dims
    branch, residual, weight = rmsnorm_inputs(dims, (torch.bfloat16, torch.float32, torch.float32), device, 5, magnitude)
    norm = nn.RMSNorm(dim, eps=1e-5, device=device)
    with torch.no_grad():
        norm.weight.copy_(weight)
        ref = residual_rmsnorm_quantize_reference(branch, residual, weight, 1e-5, "nvfp4")
        s = residual + branch
        assert_same_bits(ref.residual, s, "residual")
        # CUDA's rms_norm also multiplies by 1/D and takes rsqrtf (up to 2 ulps): a wider bound there
        assert_within_ulps(ref.normed, norm(s), 4 if device == "cpu" else 8, "normed")
        rstd = torch.rsqrt(s.double().square().mean(1) + 1e-5)
        assert torch.allclose(ref.rstd.double(), rstd, rtol=1e-6, atol=0)
    q = quantize(ref.normed, "nvfp4")
    assert_same_bits(ref.row.codes, q.data, "codes")
    assert_same_bits(ref.row.scales, q.scales, "scales")


def float32_rstd(squares: np.ndarray, width: int, eps: float) -> np.ndarray:
    """1 / sqrt(sum / width + eps) of float32 row sums (numpy), each step rounded to float32."""
    mean = squares.astype(np.float32) / np.float32(width)
    return (np.float32(1) / np.sqrt((mean + np.float32(eps)).astype(np.float64)).astype(np.float32)).astype(np.float32)


def test_rmsnorm_reference_sums_in_lanes_then_by_halving():
    """The mean of squares is summed in the kernel's order, recomputed here in numpy float32: lane j of
    32 adds columns j, j + 32, ... left to right, then the lanes are added by halving. On rows whose
    squares span 2^-20..2^20 that order gives other bits than a left-to-right sum for some rows, so
    the check can tell the orders apart."""
    g = torch.Generator().manual_seed(11)
    rows, width = 64, 200  # not a multiple of 32: the last chunk is zero-padded
    s = torch.randn(rows, width, generator=g) * torch.exp2(torch.randint(-10, 11, (rows, width), generator=g).float())
    _, rstd = rmsnorm_reference(s, torch.ones(width), eps=1e-5)
    squares = np.pad(s.numpy() * s.numpy(), ((0, 0), (0, -width % 32)))
    lanes = np.zeros((rows, 32), np.float32)
    for c0 in range(0, squares.shape[1], 32):
        lanes = lanes + squares[:, c0:c0 + 32]
    while lanes.shape[1] > 1:
        half = lanes.shape[1] // 2
        lanes = lanes[:, :half] + lanes[:, half:]
    assert_same_bits(rstd, torch.from_numpy(float32_rstd(lanes[:, 0], width, 1e-5)), "rstd")
    in_order = np.zeros(rows, np.float32)
    for c in range(width):
        in_order = in_order + squares[:, c]
    assert not torch.equal(rstd, torch.from_numpy(float32_rstd(in_order, width, 1e-5)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_grad_s", [True, False])
def test_rmsnorm_backward_is_autograd_of_the_reference(dtype, with_grad_s):
    """The fused norm's backward formula (`rmsnorm_backward`) against autograd through
    `rmsnorm_reference` and the residual stream's own gradient: ds and dweight within float32 sum-order
    error; a dropped term (the mean(dt t) projection, grad_s, the gain in dt) is off by O(1)."""
    torch.manual_seed(3)
    s = (torch.randn(24, 96) * 3).to(dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(96)).to(dtype).requires_grad_()
    grad_n, grad_s = torch.randn(24, 96).to(dtype), torch.randn(24, 96).to(dtype)
    normed, rstd = rmsnorm_reference(s, weight, 1e-5)
    loss = (normed.float() * grad_n.float()).sum() + ((s.float() * grad_s.float()).sum() if with_grad_s else 0)
    expected_ds, expected_dw = torch.autograd.grad(loss, (s, weight))
    ds, dw = rmsnorm_backward(s.detach(), rstd.detach(), weight.detach(), grad_n, grad_s if with_grad_s else None)
    assert ds.dtype == torch.float32 and dw.dtype == dtype
    # autograd rounds its intermediates to dtype; the formula keeps float32 until the end
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(ds, expected_ds.float(), rtol=tolerance, atol=tolerance)
    assert torch.allclose(dw.float(), expected_dw.float(), rtol=tolerance, atol=tolerance * 24)


# ----------------------------------------------------------------------------------------------
# Exact: under Triton's interpreter (CPU) and on CUDA
# ----------------------------------------------------------------------------------------------

INTERPRETED_CHECK = """
import sys, torch
from tests.kernels.test_triton_fusion import check_seeded_sr, run_cases
# Small shapes: the interpreter runs every block op in numpy. 32 tokens (h^T's blocks run along them)
# and 0; widths 64 and 96, narrower than a tile (masked loads and stores; RMSNorm rows padded to
# 128). Magnitudes 2^-40 and 2^40 keep h, n and every scale normal: the interpreter's float casts
# mishandle subnormals, the GPU's do not (the CUDA tests cover them).
run_cases("cpu", (32, 0), (64, 96), exact_fp32=False, magnitudes=(1.0,))
run_cases("cpu", (32,), (64,), exact_fp32=False, magnitudes=(2.0**-40, 2.0**40), dtypes=(torch.bfloat16,))
check_seeded_sr("cpu", (32, 96))
print("ok")
"""


def test_kernels_under_triton_interpreter():
    """The fused kernels, run by Triton's CPU interpreter, equal their references (see the module
    docstring for fp32 exp)."""
    done = interpreted.interpreter_python(INTERPRETED_CHECK.format())
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def _recorded_launches(monkeypatch, tf) -> list:
    """(kernel, args, kwargs) of every launch the host functions make for a spread of options, on CPU
    tensors that are never read: the kernels are replaced by recorders."""
    launches = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.kernel, args, kwargs))

    for name in ("_producer_quantize_kernel", "_producer_amax_kernel", "_rmsnorm_rows_kernel", "_swiglu_backward_kernel", "_swiglu_backward_amax_kernel"):
        monkeypatch.setattr(tf, name, Recorder(getattr(tf, name)))
    monkeypatch.setattr(tf, "_check_inputs", lambda *args, **kwargs: None)  # CPU tensors outside the interpreter
    gate, up = swiglu_inputs((64, 256), torch.bfloat16, "cpu", seed=0)
    x, residual, weight = rmsnorm_inputs((64, 768), (torch.bfloat16, torch.float32, torch.float32), "cpu", seed=0)
    signs = hadamard_signs(16, "random", _gen(16))
    tf.swiglu_quantize_fused(gate, up, fmt="nvfp4", emit_codes=True, emit_h=True, col={"fmt": "mxfp4", "signs": signs})
    tf.residual_rmsnorm_quantize_fused(x, residual, weight, 1e-5, fmt="mxfp4", emit_codes=True, emit_normed=True)
    tf.residual_rmsnorm_quantize_fused(x, residual, weight, 1e-5, fmt="nvfp4", col={"fmt": "nvfp4"})
    tf.swiglu_backward_fused(gate, gate, up)
    tf.swiglu_backward_fused(gate, gate, up, row={"fmt": "nvfp4"})
    return launches


def test_kernels_compile_for_hopper(monkeypatch):
    """Every kernel, as the host functions launch it, compiles for sm_90 without a GPU (Triton's bundled
    ptxas), and its PTX does what the exactness argument needs: no flush of subnormals in an add, mul,
    div or sqrt, correctly rounded div and sqrt, no fma outside libdevice's expf (fma.rn.ftz / fma.rm.ftz
    there) except the one written out in silu's derivative (fma.rn.f32, as nvcc contracts torch's)."""
    pytest.importorskip("triton")
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import mangle_type

    from fp4lab.numerics.kernels import fusion as tf

    launches = _recorded_launches(monkeypatch, tf)
    assert len(launches) == 9
    options = ("num_warps", "enable_fp_fusion")
    for kernel, args, kwargs in launches:
        values = dict(zip(kernel.arg_names, args)) | {k: v for k, v in kwargs.items() if k not in options}
        constexpr = {p.name for p in kernel.params if p.is_constexpr}
        signature = {n: "constexpr" if n in constexpr or values[n] is None else mangle_type(values[n]) for n in kernel.arg_names}
        source = ASTSource(fn=kernel, signature=signature, constexprs={n: values[n] for n in signature if signature[n] == "constexpr"})
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={k: kwargs[k] for k in options}).asm["ptx"]
        label = f"{kernel.__name__} P={values.get('P')}"
        assert not re.search(r"\b(add|sub|mul|div|sqrt|rcp)\.[a-z.]*ftz", ptx), label
        assert not re.search(r"\b(div|sqrt|rcp)\.approx", ptx), label
        has = {op: op in ptx for op in ("ex2.approx", "fma.rn.f32", "fma", "sqrt.rn.f32", "div.rn.f32")}
        uses_exp = values.get("P", 0) != tf._NORM_APPLY.value and kernel.__name__ != "_rmsnorm_rows_kernel"
        explicit_fma = kernel.__name__.startswith("_swiglu_backward")
        assert has["ex2.approx"] == uses_exp, f"{label}: {has}"
        assert has["fma.rn.f32"] == explicit_fma, f"{label}: {has}"
        assert uses_exp or not has["fma"], f"{label}: {has}"
        if kernel.__name__ == "_rmsnorm_rows_kernel":
            assert has["sqrt.rn.f32"] and has["div.rn.f32"], f"{label}: {has}"


@pytest.mark.cuda
@pytest.mark.parametrize("width", [768, 2048])
def test_kernels_on_cuda(width):
    """16 x 1024 tokens (and a masked 1000), both dtypes, both formats, both orientations, SR, H16 /
    H32: bit for bit, fp32 included (libdevice's expf is torch's CUDA silu's)."""
    pytest.importorskip("triton")
    run_cases("cuda", (16 * 1024, 1056), (width,), exact_fp32=True)
    check_seeded_sr("cuda", (16 * 1024, width))


@pytest.mark.cuda
def test_extreme_magnitudes_on_cuda():
    """Tiny (fp32-subnormal h and n, E8M0 scales near 2^-127, NVFP4 S_enc at FLT_MAX) and huge inputs,
    800 features: tiles that end inside the tensor (masked)."""
    pytest.importorskip("triton")
    run_cases("cuda", (256,), (800,), exact_fp32=True, magnitudes=(2.0**-70, 2.0**-40, 2.0**50))


# ----------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------


def test_bench_refuses_off_cuda():
    from fp4lab.bench.fusion import bench_producer_fusion

    assert bench_producer_fusion((64, 256), "mxfp4", torch.device("cpu"), repeats=1) is None


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_bench_times_every_producer(fmt):
    pytest.importorskip("triton")
    from fp4lab.bench.fusion import PRODUCERS, bench_producer_fusion

    bench = bench_producer_fusion((1024, 768), fmt, torch.device("cuda"), repeats=3)
    assert set(bench.timings) == set(PRODUCERS)
    for timing in bench.timings.values():
        assert timing.unfused_ms > 0 and timing.compiled_ms > 0 and timing.fused_ms > 0
        assert timing.gain == timing.unfused_ms / timing.fused_ms
    assert bench.as_dict()["swiglu"]["gain_over_compiled"] > 0
