"""FP4Linear's MXFP4 x MXFP4 GEMMs on FP8 tensor cores (mx_gemm = "fp8", fp4lab.nn.fp4_linear) on real
training tensors: Fprop, Dgrad and Wgrad outputs are the kernel's, bit for bit
`mxfp4_matmul_reference` of the QTensors the layer quantized, and within fp32 summation order of the
bf16 tensor-core path and the fp32 reference path; GEMMs the kernel cannot take fall back.

Which GEMM ran where is read from a spy on `kernels.mx_gemm.mxfp4_matmul` that calls the real kernel and
records its operands and output (Fprop, then Dgrad, then Wgrad: the order autograd runs them).

Tolerance: the kernel is exact per 32-block, so |C - C_exact| <= (K / 32) (u sum_k |a_k b_k| + 2^-149)
(u = 2^-24; fp4lab.numerics.kernels.mx_gemm); the decoded fp32 GEMM of either other path is within
K (u sum_k |a_k b_k| + 2^-149) of C_exact (tests/nn/test_tensor_cores.py), so the paths differ by at most
the sum of the two, checked element by element from the recorded operands.

CPU (CI): the kernel under Triton's interpreter, in a fresh Python with TRITON_INTERPRET=1 (64 x 64
weights, 2 x 32 tokens; a 64 x 96 one on 2 x 20 bf16 tokens), with operands from the torch quantizers
and from the fused Triton quantizers (interpreted too); the fallbacks (NVFP4, FP8, bf16 and mixed
GEMMs; the CPU without the interpreter) are bit for bit mx_gemm bf16. A K that is not a multiple of
32 cannot reach the kernel: an MXFP4 operand is whole 32-blocks along it. CUDA (@pytest.mark.cuda):
operands captured from a short training run of the mxfp4 recipe at the 125m shapes, and a short
training run with mx_gemm fp8 against bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fp4lab.nn.fp4_linear import FP4Linear
from fp4lab.nn.recipe import GEMMS, load_recipe
from fp4lab.numerics import quantize
from fp4lab.numerics.mx_gemm import along_k, mxfp4_matmul_reference
from fp4lab.numerics.qtensor import QTensor
from tests import interpreted
from tests.kernels.test_triton_mx_gemm import assert_same_bits
from tests.nn.test_tensor_cores import training_like

# MXFP4 on both operands of all three GEMMs: 1D blocks (floor scales, RTN); RCEIL scales with 2D
# 32 x 32 adaptive weight tiles (W^T for Dgrad transposed from W's tiles) and SR on Dgrad's dY; and that
# with the fixed-sign H32 transform on Wgrad's pair.
FP8_RECIPES = ("mxfp4", "mxfp4-rowsr", "mxfp4-rowsr-h32")
U = 2.0**-24


@dataclass(frozen=True)
class KernelCall:
    a: QTensor
    b: QTensor
    out_dtype: torch.dtype
    out: torch.Tensor


class KernelSpy:
    """Within `with`: `kernels.mx_gemm.mxfp4_matmul` runs the real kernel and records each call."""

    def __init__(self):
        from fp4lab.numerics.kernels import mx_gemm as triton_mx_gemm

        self.module, self.kernel, self.calls = triton_mx_gemm, triton_mx_gemm.mxfp4_matmul, []

    def __enter__(self) -> KernelSpy:
        self.module.mxfp4_matmul = self._call
        return self

    def __exit__(self, *exc) -> None:
        self.module.mxfp4_matmul = self.kernel

    def _call(self, a, b, out_dtype=torch.float32, **options):
        out = self.kernel(a, b, out_dtype, **options)
        self.calls.append(KernelCall(a, b, out_dtype, out))
        return out


def make_layer(recipe: str, mx_gemm: str, weight: torch.Tensor, tensor_cores: bool = True) -> FP4Linear:
    layer = FP4Linear(weight.shape[1], weight.shape[0], load_recipe(recipe).linear, seed=11).to(weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
    layer.tensor_cores = tensor_cores
    layer.mx_gemm = mx_gemm
    return layer


def step(layer: FP4Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """y, dx and dW of one forward and backward."""
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad, layer.weight.grad


def training_tensors(tokens: tuple[int, int], in_features: int, out_features: int, seed: int, device="cpu", dtype=torch.float32):
    """x, W and dY shaped like a layer's in training: heavy-tailed rows, and 32-blocks scaled down to E8M0's
    2^-127 (training_like); dY a few orders of magnitude below x, as gradients are."""
    g = torch.Generator().manual_seed(seed)
    rows = tokens[0] * tokens[1]
    x = training_like(rows, in_features, g, device).reshape(*tokens, in_features).to(dtype)
    weight = (torch.randn(out_features, in_features, generator=g) * in_features**-0.5).to(device)
    dy = (training_like(rows, out_features, g, device) * 2.0**-12).reshape(*tokens, out_features).to(dtype)
    return x, weight, dy


def assert_within_paths_bound(got: torch.Tensor, other: torch.Tensor, call: KernelCall, label: str) -> None:
    """|got - other| <= (K + K / 32)(u sum_k |a_k b_k| + 2^-149): the kernel's bound plus the decoded
    GEMM's (module docstring), from the kernel's decoded operands; for bf16 outputs plus each one's
    rounding to bf16 (2^-9 relative)."""
    a, b = call.a.dequantize().double(), call.b.dequantize().double()
    k = a.shape[1]
    bound = (k + k // 32) * (U * (a.abs() @ b.abs().T) + 2.0**-149)
    got, other = got.double().reshape(bound.shape), other.double().reshape(bound.shape)
    if call.out_dtype == torch.bfloat16:
        bound = bound + 2.0**-9 * (got.abs() + other.abs())
    error = (got - other).abs()
    assert torch.isfinite(got).all(), f"{label}: non-finite values"
    worst = (error / bound).max().item()
    assert worst <= 1, f"{label}: {worst:.3g} x the summation-order bound"


def check_gemm_calls(calls: list[KernelCall], outputs, gemms=("fprop", "dgrad", "wgrad")) -> None:
    """One kernel call per GEMM in `gemms` (in autograd's order), each equal to the reference bit for bit
    and to the layer's output for that GEMM (y, dx, dW; Wgrad's token dim padded to a multiple of 32)."""
    assert len(calls) == len(gemms), f"{len(calls)} kernel calls for {gemms}"
    for gemm, call in zip(gemms, calls):
        assert_same_bits(call.out, mxfp4_matmul_reference(call.a, call.b, call.out_dtype), f"{gemm}: kernel vs reference")
        output = outputs[("fprop", "dgrad", "wgrad").index(gemm)]
        assert_same_bits(output.reshape(call.out.shape), call.out, f"{gemm}: layer output vs kernel")


def check_recipe(recipe: str, tokens=(2, 32), features=(64, 64), dtype=torch.float32, seed=0) -> None:
    """mx_gemm fp8 under the interpreter: all three GEMMs on the kernel, equal to the reference of the
    operands it was given, within summation order of the bf16 tensor-core path and the fp32 reference
    path; mx_gemm bf16 calls no kernel."""
    x, weight, dy = training_tensors(tokens, *features, seed=seed, dtype=dtype)
    with KernelSpy() as fp8_spy:
        fp8 = step(make_layer(recipe, "fp8", weight), x, dy)
    check_gemm_calls(fp8_spy.calls, fp8)
    # Layers of one seed draw the same SR bits, so every path quantizes to the same operands.
    with KernelSpy() as spy:
        bf16 = step(make_layer(recipe, "bf16", weight), x, dy)
        reference = step(make_layer(recipe, "fp8", weight, tensor_cores=False), x, dy)
    assert not spy.calls
    for gemm, call, got, want_bf16, want_reference in zip(("fprop", "dgrad", "wgrad"), fp8_spy.calls, fp8, bf16, reference):
        assert got.dtype == want_bf16.dtype, gemm
        assert_within_paths_bound(got, want_bf16, call, f"{recipe} {gemm} vs bf16 tensor cores")
        assert_within_paths_bound(got, want_reference.to(got.dtype), call, f"{recipe} {gemm} vs fp32 reference")


@interpreted.fused_kernels_as_on_cuda()
def check_recipe_with_fused_quantizers(recipe: str) -> None:
    """As on CUDA, the fused Triton quantizers make the operands (under the interpreter, on CPU tensors:
    `kernel_options` answers as for CUDA ones) and emit the codes and scales the kernel reads, packed
    x^T and W^T (2D tiles transposed) included: each call equals the reference, is within summation
    order of the fp32 GEMM of its decoded operands, and for GEMMs without SR (the same bits from the
    torch quantizers) of the fp32 reference path. (Not against mx_gemm bf16 here: the interpreter's
    bf16 cast in `decode_fused` flushes the subnormal values of 2^-127 blocks, which CUDA keeps.)"""
    x, weight, dy = training_tensors((2, 32), 64, 64, seed=4)
    with KernelSpy() as spy:
        fp8 = step(make_layer(recipe, "fp8", weight), x, dy)
    reference = step(make_layer(recipe, "bf16", weight, tensor_cores=False), x, dy)
    check_gemm_calls(spy.calls, fp8)
    linear = load_recipe(recipe).linear
    for (gemm, names), call, got, want in zip(GEMMS.items(), spy.calls, fp8, reference):
        decoded = call.a.dequantize() @ call.b.dequantize().T
        assert_within_paths_bound(got, decoded, call, f"{recipe} {gemm} (fused quantizers) vs its decoded operands")
        if all(linear.operand(name).rounding == "rtn" for name in names):
            assert_within_paths_bound(got, want, call, f"{recipe} {gemm} (fused quantizers) vs fp32 reference")


def check_fallbacks() -> None:
    """GEMMs the kernel cannot take run on the bf16 path, bit for bit what mx_gemm bf16 computes:
    hybrid-operand's NVFP4 Dgrad (Fprop and Wgrad stay on the kernel), and every GEMM of NVFP4, FP8
    and bf16 recipes."""
    x, weight, dy = training_tensors((2, 32), 64, 64, seed=1)
    for recipe, gemms in (("hybrid-operand", ("fprop", "wgrad")), ("nvfp4", ()), ("fp8", ()), ("bf16", ())):
        with KernelSpy() as spy:
            fp8 = step(make_layer(recipe, "fp8", weight), x, dy)
        check_gemm_calls(spy.calls, fp8, gemms)
        bf16 = step(make_layer(recipe, "bf16", weight), x, dy)
        for gemm, got, want in zip(("fprop", "dgrad", "wgrad"), fp8, bf16):
            if gemm not in gemms:
                assert_same_bits(got, want, f"{recipe} {gemm}: the fallback vs mx_gemm bf16")


# ----------------------------------------------------------------------------------------------
# CPU: the kernel's operands (torch only)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tile", [(32, 32), (64, 32), (32, 64)])
def test_tiled_weights_are_exact_1d_operands_in_both_orientations(tile):
    """along_k of 2D tiles (RCEIL adaptive, as mxfp4-rowsr's weights; one tile NaN): the same decoded
    values bit for bit, and transposed the 1D form of quantize(W^T)'s tiles (the tile contract)."""
    g = torch.Generator().manual_seed(5)
    w = training_like(128, 192, g, "cpu")
    w[32:40, 64:70] = float("nan")
    options = {"fmt": "mxfp4", "scale_mode": "rceil", "adaptive": True}
    q, qt = quantize(w, tile=tile, **options), quantize(w.T.contiguous(), tile=tile[::-1], **options)
    rows = along_k(q)
    cols = along_k(q, transposed=True)
    assert rows.tile is None and cols.tile is None and cols.shape == w.T.shape and torch.isnan(q.dequantize()).any()
    assert_same_bits(rows.dequantize(), q.dequantize(), "rows")
    assert_same_bits(cols.dequantize(), q.dequantize().T.contiguous(), "transposed")
    want = along_k(qt)
    assert torch.equal(cols.data, want.data) and torch.equal(cols.scales, want.scales)


def test_along_k_takes_1d_mxfp4_only_along_its_blocks():
    x = torch.randn(64, 96)
    q = quantize(x, "mxfp4")
    assert along_k(q) is q
    assert along_k(q, transposed=True) is None  # blocked along the other dim
    assert along_k(quantize(x, "nvfp4")) is None
    assert along_k(quantize(x, "nvfp4", tile=(16, 16)), transposed=True) is None


# ----------------------------------------------------------------------------------------------
# CPU: the kernel under Triton's interpreter
# ----------------------------------------------------------------------------------------------


INTERPRETED_CHECKS = [
    *(f"check_recipe({recipe!r})" for recipe in FP8_RECIPES),  # the reference of their operands
    *(f"check_recipe_with_fused_quantizers({recipe!r})" for recipe in FP8_RECIPES),
    # bf16 x and dY (y and dx come out of the kernel in bf16, rounded once), and 2 x 20 tokens: Wgrad's
    # token dim zero-padded from 40 to 64
    "check_recipe('mxfp4-rowsr-h32', tokens=(2, 20), features=(96, 64), dtype=torch.bfloat16, seed=2)",
    "check_fallbacks()",  # the GEMMs the kernel cannot take
]


@pytest.mark.slow  # ~40 s: started first under xdist
def test_fp8_gemms_equal_their_references_and_fall_back_under_the_interpreter():
    interpreted.run_interpreted(__name__, INTERPRETED_CHECKS)


def test_cpu_without_the_interpreter_falls_back_bit_for_bit(monkeypatch):
    """On the CPU without TRITON_INTERPRET the kernel cannot run: mx_gemm fp8 computes what bf16 does."""
    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, weight, dy = training_tensors((2, 32), 64, 64, seed=3)
    with KernelSpy() as spy:
        fp8 = step(make_layer("mxfp4", "fp8", weight), x, dy)
    assert not spy.calls
    for gemm, got, want in zip(("fprop", "dgrad", "wgrad"), fp8, step(make_layer("mxfp4", "bf16", weight), x, dy)):
        assert_same_bits(got, want, gemm)


# ----------------------------------------------------------------------------------------------
# CUDA: captured training operands at the 125m shapes, and training
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def captured_mxfp4(tmp_path_factory):
    """Operands of three linears of the 125m model at step 3 of a short mxfp4 training run on CUDA."""
    from fp4lab.train.capture import capture_files, load_capture
    from fp4lab.train.config import TrainConfig
    from fp4lab.train.data import DataConfig
    from fp4lab.train.loop import run

    out = tmp_path_factory.mktemp("mx_capture") / "run"
    config = TrainConfig(
        recipe="mxfp4", model="125m", data=DataConfig(source="synthetic"), steps=4, batch_size=8, seq_len=256,
        device="cuda", compile="off", optimizer="adamw", adam_lr=1e-3, warmup_steps=1, eval_every=4, probe_every=4,
        checkpoint_every=4, out_dir=str(out), capture_steps=[3],
        capture_layers=["layers.0.attention.wq", "layers.5.feed_forward.w1", "layers.11.feed_forward.w2"],
    )
    assert run(config, progress=False)["status"] == "completed"
    return [load_capture(path) for path in capture_files(out)]


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_cuda_captured_operands_fp8_gemms_equal_the_reference(captured_mxfp4, recipe, monkeypatch):
    """On real operands (x, W, dY of a training step, in their training dtypes; 2048 tokens): Fprop,
    Dgrad and Wgrad on the kernel (fused quantizers emitting codes), each bit for bit the reference of
    its QTensors, y and dx in bf16 as in training, and within summation order of the bf16 tensor-core
    path (cuBLAS without reduced-precision bf16 reductions, so its fp32 bound holds)."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    assert len(captured_mxfp4) == 3
    for capture in captured_mxfp4:
        x, dy, weight = capture.x.cuda(), capture.dy.cuda(), capture.w.cuda().float()
        outputs = {}
        for mx_gemm in ("fp8", "bf16"):
            with KernelSpy() as spy, torch.autocast("cuda", dtype=torch.bfloat16):
                outputs[mx_gemm] = step(make_layer(recipe, mx_gemm, weight), x, dy)
            if mx_gemm == "fp8":
                check_gemm_calls(spy.calls, outputs["fp8"])
                calls = spy.calls
            else:
                assert not spy.calls
        for gemm, call, got, want in zip(("fprop", "dgrad", "wgrad"), calls, outputs["fp8"], outputs["bf16"]):
            assert_within_paths_bound(got, want, call, f"{capture.layer} {gemm}")


@pytest.mark.cuda
def test_cuda_training_with_fp8_gemms_tracks_bf16_gemms(tmp_path):
    """Ten steps of the 125m shape, mxfp4, fast path: mx_gemm fp8 and bf16 from the same init and data.
    The GEMMs differ only in fp32 summation order, so the losses agree far inside what a wrong scale or a
    dropped block would move them."""
    from fp4lab.train.config import TrainConfig
    from fp4lab.train.data import DataConfig
    from fp4lab.train.loop import run

    losses = {}
    for mx_gemm in ("fp8", "bf16"):
        config = TrainConfig(
            recipe="mxfp4", model="125m", data=DataConfig(source="synthetic"), steps=10, batch_size=8, seq_len=256,
            device="cuda", compile="off", optimizer="adamw", adam_lr=1e-3, warmup_steps=2, eval_every=10,
            probe_every=10, checkpoint_every=10, out_dir=str(tmp_path / mx_gemm), mx_gemm=mx_gemm,
        )
        summary = run(config, progress=False)
        assert summary["status"] == "completed"
        losses[mx_gemm] = summary["final_val_loss"]
    assert abs(losses["fp8"] - losses["bf16"]) / losses["bf16"] < 5e-3, losses
