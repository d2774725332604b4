"""MXFP4 GEMM on FP8 tensor cores (fp4lab.numerics.kernels.mx_gemm) against its torch reference
(fp4lab.numerics.mx_gemm), bit for bit.

Three facts are checked, on the CPU (the reference in-process, the kernel under Triton's interpreter)
and on CUDA (@pytest.mark.cuda, skipped without a GPU, see conftest.py):

- kernel == reference, bit for bit (NaN at the same places);
- with one block along K, both are the exact partial * 2^(ea + eb) rounded once to fp32, for every
  pair of scale bytes, and equal the fp32 GEMM of the decoded operands;
- with more blocks, |C - C_fp64| <= (K / 32) * 2^-24 * sum_k |scaled partial_k| (+ 2^-149 per block),
  and the fp32 GEMM of the decoded operands is within the sum of its own bound and that one.

Operands come from `quantize(x, "mxfp4")` of normal, Student-t and row-scaled (2^-U(0, 20) per row)
data, with whole zero blocks, and from hand-made codes and scale bytes: every byte, tiny (2^-127 up),
huge (products overflow), NaN bytes, and blocks mixing 6 x 6 with 0.5 x 0.5 products.
"""

from __future__ import annotations

import os

import pytest
import torch

from fp4lab.numerics import e2m1, quantize
from fp4lab.numerics.mx_gemm import mxfp4_matmul_reference
from fp4lab.numerics.qtensor import QTensor
from tests import interpreted

MX = 32
# (M, N, K): ragged M and N (masks), K from one block to eight
SMALL_SHAPES = ((33, 50, 32), (70, 17, 96), (16, 129, 256))
# Fprop y = x W^T, Dgrad dx = dy W, Wgrad dW = dy^T x of a 768 x 2048 linear on 4096 tokens
GPU_SHAPES = {"fprop": (4096, 768, 2048), "dgrad": (4096, 2048, 768), "wgrad": (768, 2048, 4096)}


# ----------------------------------------------------------------------------------------------
# Operands
# ----------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _data(kind: str, rows: int, k: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    x = torch.randn(rows, k, generator=g)
    if kind == "student_t":  # 3 degrees of freedom: heavy tails, wide block scales
        chi2 = sum(torch.randn(rows, k, generator=g) ** 2 for _ in range(3)) / 3
        x = x / chi2.sqrt()
    elif kind == "row_scaled":
        x = x * torch.exp2(-torch.randint(0, 21, (rows, 1), generator=g).float())
    elif kind == "zero_blocks":  # about a third of the 32-blocks all zero
        keep = torch.randint(0, 3, (rows, k // MX, 1), generator=g) > 0
        x = (x.reshape(rows, k // MX, MX) * keep).reshape(rows, k)
    elif kind == "all_zero":
        x = torch.zeros(rows, k)
    return x


def _raw(codes: torch.Tensor, scales: torch.Tensor) -> QTensor:
    """An MXFP4 QTensor from codes (one per element) and scale bytes (one per 32-block)."""
    return QTensor(e2m1.pack(codes.to(torch.uint8)), scales.to(torch.uint8), None, "mxfp4", codes.shape, MX)


def _random_codes(rows: int, k: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 16, (rows, k), generator=g)


def _raw_operand(kind: str, rows: int, k: int, seed: int) -> QTensor:
    g = _gen(seed)
    codes, blocks = _random_codes(rows, k, g), (rows, k // MX)
    if kind == "any_byte":  # every E8M0 value but NaN: results from 0 through subnormals to Inf
        scales = torch.randint(0, 255, blocks, generator=g)
    elif kind == "wide_blocks":  # 2^-27 .. 2^27 per block: the fp32 sum across blocks rounds often
        scales = torch.randint(100, 155, blocks, generator=g)
    elif kind == "tiny":  # 2^-127 .. 2^-110: partials scaled into the subnormals and to zero
        scales = torch.randint(0, 18, blocks, generator=g)
    elif kind == "huge":  # 2^100 .. 2^127: partials overflow to +-Inf (and Inf - Inf to NaN)
        scales = torch.randint(227, 255, blocks, generator=g)
    elif kind == "nan_bytes":  # a few 0xFF blocks: their rows of C NaN
        scales = torch.randint(120, 135, blocks, generator=g)
        scales[torch.rand(blocks, generator=g) < 0.03] = 0xFF
    elif kind == "mixed_products":  # 6 x 6 = 36 beside 0.5 x 0.5 = 1/4 in each block: 13 bits per partial
        codes = torch.where(torch.arange(k) % 2 == 0, 7, 1).expand(rows, k) | (torch.randint(0, 2, (rows, k), generator=g) * 8)
        scales = torch.randint(110, 145, blocks, generator=g)
    else:
        raise ValueError(f"_raw_operand: kind={kind!r} is unknown")
    return _raw(codes, scales)


QUANTIZED_KINDS = ("normal", "student_t", "row_scaled", "zero_blocks", "all_zero")
RAW_KINDS = ("wide_blocks", "any_byte", "tiny", "huge", "nan_bytes", "mixed_products")
# Finite results whose fp64 bound and decoded-GEMM comparison hold (no overflow, no NaN, no products
# of decoded values below fp32's normal range: the decoded GEMM rounds those one by one)
BOUNDED_KINDS = (*QUANTIZED_KINDS, "wide_blocks", "mixed_products")


def operands(kind: str, m: int, n: int, k: int, seed: int = 0, device="cpu") -> tuple[QTensor, QTensor]:
    """(A [m, k], B [n, k]) of one kind, quantized along k, on `device`."""
    if kind in QUANTIZED_KINDS:
        return tuple(quantize(_data(kind, rows, k, seed + i).to(device), "mxfp4") for i, rows in enumerate((m, n)))
    return tuple(_on(_raw_operand(kind, rows, k, seed + i), device) for i, rows in enumerate((m, n)))


def _on(q: QTensor, device) -> QTensor:
    return QTensor(q.data.to(device), q.scales.to(device), None, "mxfp4", q.shape, MX)


def every_scale_pair(seed: int = 0, device="cpu") -> tuple[QTensor, QTensor]:
    """(A, B) with K = 32 whose row i has scale byte i (0 .. 254): C[i, j] is partial * 2^(i + j - 254)
    for every pair of E8M0 values; random codes make the partials many-bit multiples of 1/4."""
    g = _gen(seed)
    byte = torch.arange(255)[:, None]
    return _on(_raw(_random_codes(255, MX, g), byte), device), _on(_raw(_random_codes(255, MX, g), byte), device)


def largest_partials(top_byte: int, device="cpu") -> tuple[QTensor, QTensor]:
    """(A [16, 32], B [255, 32]), K = 32, every code 6 (some -6): partials of +-1152, the largest, under A
    scale bytes top_byte - 15 .. top_byte and every B byte. Around byte 244 (2^117), the largest A scale
    for which partial * 2^ea cannot overflow, the kernel switches from per-row factors to the split."""
    a_codes = torch.full((16, MX), 7)
    a_codes[::3] |= 8
    b_codes = torch.full((255, MX), 7)
    b_codes[1::4] |= 8
    a_bytes = torch.arange(top_byte - 15, top_byte + 1)[:, None]
    return _on(_raw(a_codes, a_bytes), device), _on(_raw(b_codes, torch.arange(255)[:, None]), device)


# ----------------------------------------------------------------------------------------------
# Exact values in fp64 and the comparisons
# ----------------------------------------------------------------------------------------------


def scaled_partials(a: QTensor, b: QTensor) -> torch.Tensor:
    """[K / 32, M, N] float64: each block's partial * 2^(ea + eb), exact (NaN for a 0xFF byte)."""
    blocks = a.shape[1] // MX
    a_values = e2m1.decode(a.codes()).double().reshape(a.shape[0], blocks, MX)
    b_values = e2m1.decode(b.codes()).double().reshape(b.shape[0], blocks, MX)
    partials = torch.einsum("mkx,nkx->kmn", a_values, b_values)
    a_exp, b_exp = a.scales.double().T - 127, b.scales.double().T - 127  # [K / 32, rows]
    scale = torch.exp2(a_exp[:, :, None] + b_exp[:, None, :])  # 2^-254 .. 2^254: exact in fp64
    nan = (a.scales.T == 0xFF)[:, :, None] | (b.scales.T == 0xFF)[:, None, :]
    return torch.where(nan, float("nan"), partials * scale)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """Equal bit for bit (-0.0 is not +0.0), NaN at the same places."""
    nan = torch.isnan(want)
    assert got.dtype == want.dtype and got.shape == want.shape, f"{label}: {got.dtype} {list(got.shape)} vs {want.dtype} {list(want.shape)}"
    assert torch.equal(torch.isnan(got), nan), f"{label}: NaN positions differ"
    view = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
    bad = (got.view(view) != want.view(view)) & ~nan
    assert not bad.any(), f"{label}: {int(bad.sum())} values differ, e.g. {got[bad][:3].tolist()} vs {want[bad][:3].tolist()}"


def assert_single_block_exact(c: torch.Tensor, a: QTensor, b: QTensor, label: str) -> None:
    """K = 32: C is the exact scaled partial rounded once to fp32 (+0 for a -0 result: the accumulator
    starts at +0, and +0 + -0 = +0)."""
    assert a.shape[1] == MX, label
    want = scaled_partials(a, b)[0].float().cpu() + 0.0
    assert_same_bits(c.cpu(), want, label)


def assert_within_fp64_bound(c: torch.Tensor, a: QTensor, b: QTensor, label: str) -> None:
    """|C - C_fp64| <= (K / 32) * 2^-24 * sum_k |scaled partial_k| (1 + 2^-20) + (K / 32) * 2^-149: each
    scaled partial rounds once (relative 2^-24, or 2^-150 absolute when subnormal), then K / 32 - 1 fp32
    additions. C_fp64 is the fp64 GEMM of the decoded operands taken block by block: each block's
    partial is exact in fp64, their sum rounds by at most (K / 32) 2^-53 sum_k |partial_k|, which the
    2^-20 covers. (A plain fp64 GEMM is not that exact: within one block 36 x 2^e beside 1/4 x 2^e cancel,
    and across blocks the scales span up to 500 binades, so its 2^-53 sum |a b| can exceed this bound.)"""
    scaled = scaled_partials(a, b)
    blocks = scaled.shape[0]
    exact = scaled.sum(0)
    bound = blocks * 2.0**-24 * scaled.abs().sum(0) * (1 + 2.0**-20) + blocks * 2.0**-149
    error = (c.double() - exact).abs()
    assert torch.isfinite(c).all(), f"{label}: non-finite results"
    worst = (error / bound).max().item()
    assert worst <= 1, f"{label}: error {worst:.3g} x the bound"


def assert_matches_decoded_gemm(c: torch.Tensor, a: QTensor, b: QTensor, label: str) -> None:
    """Against the emulated GEMM (decoded operands multiplied in fp32, FP4Linear's reference path):
    equal with one block along K (every product is exact and shares the block's scale, so every fp32
    partial sum is exact), else within its bound (K - 1) u sum |a b| plus the kernel's (K / 32) u sum |a b|."""
    decoded = a.dequantize() @ b.dequantize().T
    if a.shape[1] == MX:  # + 0.0: a GEMM may sum -0 products to -0, the kernel's accumulator starts at +0
        assert_same_bits(c, decoded + 0.0, f"{label} vs decoded GEMM")
        return
    k, blocks = a.shape[1], a.shape[1] // MX
    magnitude = a.dequantize().double().abs() @ b.dequantize().double().abs().T
    bound = (k + blocks) * 2.0**-24 * magnitude * (1 + 2.0**-20)
    worst = ((c.double() - decoded.double()).abs() / bound.clamp(min=2.0**-149)).max().item()
    assert worst <= 1, f"{label}: {worst:.3g} x the bound from the decoded GEMM"


@pytest.fixture(scope="module")
def mx():
    pytest.importorskip("triton")
    from fp4lab.numerics.kernels import mx_gemm as triton_mx_gemm

    return triton_mx_gemm


# ----------------------------------------------------------------------------------------------
# CPU: the reference
# ----------------------------------------------------------------------------------------------


def test_reference_single_block_rounds_once_for_every_scale_pair():
    """The split 2^(ea + eb) = 2^e1 * 2^e2 rounds partial * 2^(ea + eb) once, for all 255 x 255 byte
    pairs: to zero, through the subnormals, and to Inf."""
    a, b = every_scale_pair()
    c = mxfp4_matmul_reference(a, b)
    assert_single_block_exact(c, a, b, "every scale pair")
    assert torch.isinf(c).any() and (c == 0).any() and ((c != 0) & (c.abs() < 2.0**-126)).any()


@pytest.mark.parametrize("kind", BOUNDED_KINDS)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_reference_within_fp64_bound_and_decoded_gemm(kind, shape):
    a, b = operands(kind, *shape, seed=sum(shape))
    c = mxfp4_matmul_reference(a, b)
    assert_within_fp64_bound(c, a, b, kind)
    assert_matches_decoded_gemm(c, a, b, kind)


@pytest.mark.parametrize("top_byte", [244, 245, 254])
def test_reference_single_block_largest_partials(top_byte):
    a, b = largest_partials(top_byte)
    assert_single_block_exact(mxfp4_matmul_reference(a, b), a, b, f"largest partials {top_byte}")


def test_reference_single_block_tiny_and_huge():
    for kind in ("tiny", "huge", "any_byte"):
        a, b = operands(kind, 40, 24, MX, seed=5)
        assert_single_block_exact(mxfp4_matmul_reference(a, b), a, b, kind)


def test_reference_nan_byte_poisons_its_row_and_column():
    a, b = operands("nan_bytes", 64, 48, 128, seed=3)
    c = mxfp4_matmul_reference(a, b)
    want = (a.scales == 0xFF).any(1)[:, None] | (b.scales == 0xFF).any(1)[None, :]
    assert want.any() and not want.all() and torch.equal(torch.isnan(c), want)


def test_reference_bf16_is_one_rounding_of_fp32():
    a, b = operands("student_t", 33, 50, 96, seed=1)
    assert_same_bits(mxfp4_matmul_reference(a, b, torch.bfloat16), mxfp4_matmul_reference(a, b).bfloat16(), "bf16")


# ----------------------------------------------------------------------------------------------
# CPU: errors (shared by the kernel and the reference)
# ----------------------------------------------------------------------------------------------


def _zeros(rows: int, k: int, block: int = MX) -> QTensor:
    return QTensor(torch.zeros(rows, k // 2, dtype=torch.uint8), torch.zeros(rows, k // block, dtype=torch.uint8), None, "mxfp4", torch.Size([rows, k]), block)


@pytest.mark.parametrize("name", ["mxfp4_matmul", "mxfp4_matmul_reference"])
def test_bad_operands_raise_one_line_value_errors(name):
    fn = mxfp4_matmul_reference if name == "mxfp4_matmul_reference" else pytest.importorskip("fp4lab.numerics.kernels.mx_gemm").mxfp4_matmul
    x = torch.randn(16, 64)
    cases = [
        ((_zeros(4, 48, 16), _zeros(4, 48, 16)), {}, "K=48 of a is not a multiple of 32; pad"),
        ((quantize(x, "nvfp4"), quantize(x, "mxfp4")), {}, "a has fmt 'nvfp4'; pass an MXFP4"),
        ((quantize(x, "mxfp4"), quantize(torch.randn(32, 64), "mxfp4", tile=(32, 32))), {}, r"b has 2D tiles \(32, 32\)"),
        ((quantize(x, "mxfp4"), quantize(torch.randn(16, 96), "mxfp4")), {}, r"a is \[M, K=64\] and b is \[N, K=96\]; both must be quantized along the same K"),
        ((quantize(x, "mxfp4"), x), {}, "b must be a QTensor, got Tensor"),
        ((quantize(torch.randn(2, 8, 64), "mxfp4"), quantize(x, "mxfp4")), {}, r"a has shape \[2, 8, 64\]; pass a 2D operand"),
        ((quantize(x, "mxfp4"), quantize(x, "mxfp4")), {"out_dtype": torch.float16}, "out_dtype=torch.float16 is not supported"),
    ]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            fn(*args, **kwargs)
        assert "\n" not in str(info.value) and str(info.value).startswith(f"{name}: ")


def test_kernel_rejects_cpu_operands_and_bad_tiles(mx):
    a = quantize(torch.randn(16, 64), "mxfp4")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="a is on cpu; both operands must be on one CUDA device"):
            mx.mxfp4_matmul(a, a)
    for tile in ((8, 128), (48, 64), (128,)):
        with pytest.raises(ValueError, match="tile=.* powers of two >= 16"):
            mx.mxfp4_matmul(a, a, tile=tile)


# ----------------------------------------------------------------------------------------------
# CPU: the kernel under Triton's interpreter
# ----------------------------------------------------------------------------------------------


INTERPRETED_CHECK = """
import sys, torch
from tests.kernels.test_triton_mx_gemm import *
from fp4lab.numerics.mx_gemm import mxfp4_matmul_reference
from fp4lab.numerics.kernels.mx_gemm import GemmConfig, mxfp4_matmul

a, b = every_scale_pair()
c = mxfp4_matmul(a, b, tile=(64, 64))
assert_same_bits(c, mxfp4_matmul_reference(a, b), "every scale pair")
assert_single_block_exact(c, a, b, "every scale pair")
for top_byte in (243, 244, 245, 254):  # A tiles around the switch from per-row factors to the split
    a, b = largest_partials(top_byte)
    assert_single_block_exact(mxfp4_matmul(a, b, tile=(16, 64)), a, b, f"largest partials {{top_byte}}")

for i, (m, n, k) in enumerate(SMALL_SHAPES):
    tile = ((16, 32), (32, 16), (16, 16))[i]
    for kind in QUANTIZED_KINDS + RAW_KINDS:
        a, b = operands(kind, m, n, k, seed=i)
        c = mxfp4_matmul(a, b, tile=tile)
        label = f"{{kind}} {{m}}x{{n}}x{{k}}"
        assert_same_bits(c, mxfp4_matmul_reference(a, b), label)
        if kind in BOUNDED_KINDS:
            assert_within_fp64_bound(c, a, b, label)
            assert_matches_decoded_gemm(c, a, b, label)
        if k == 32 and kind != "nan_bytes":
            assert_single_block_exact(c, a, b, label)
    for kind in ("student_t", "any_byte"):  # bf16: rounding, subnormals, Inf and NaN
        a, b = operands(kind, m, n, k, seed=i)
        want = mxfp4_matmul_reference(a, b, torch.bfloat16)
        assert_same_bits(mxfp4_matmul(a, b, torch.bfloat16, tile=tile), want, f"bf16 {{kind}} {{m}}x{{n}}x{{k}}")

# the default launch shape, its masks on both sides
a, b = operands("row_scaled", 130, 129, 64, seed=9)
assert_same_bits(mxfp4_matmul(a, b), mxfp4_matmul_reference(a, b), "default tile")
# 1, 2 and 4 K blocks per loop iteration (and 4 falling back to 2 where K / 32 is 6)
for k in (128, 192):
    for kind in ("normal", "any_byte"):
        a, b = operands(kind, 40, 24, k, seed=k)
        want = mxfp4_matmul_reference(a, b)
        for step in (1, 2, 4):
            got = mxfp4_matmul(a, b, config=GemmConfig(tile=(16, 16), blocks_per_step=step))
            assert_same_bits(got, want, f"{{kind}} K={{k}} blocks_per_step={{step}}")
print("ok")
"""


def test_kernel_under_triton_interpreter():
    """The kernel's arithmetic, run by Triton's CPU interpreter, equals the reference bit for bit on every
    kind of operand, and the fp64 and decoded-GEMM checks hold for it too."""
    done = interpreted.interpreter_python(INTERPRETED_CHECK.format(), timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_kernel_compiles_for_hopper_to_fp8_wgmma_without_fma_or_ftz(mx):
    """Compiled for sm_90 without a GPU (Triton's bundled ptxas), with the wrapper's launch options and
    default launch shape: each K block is one FP8 wgmma with an fp32 accumulator, and the scaling is
    plain mul.rn / add.rn (no contraction into FMA, no flush of subnormals), for both output dtypes."""
    pytest.importorskip("triton")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = mx.DEFAULT_CONFIG
    for out_type, bf16 in (("*fp32", False), ("*bf16", True)):
        signature = {name: "*u8" for name in ("a_values", "a_scales", "b_values", "b_scales")}
        signature |= {"out_ptr": out_type, "M": "i32", "N": "i32"}
        constexprs = {"KB": 4, "BM": config.tile[0], "BN": config.tile[1], "STEP": config.blocks_per_step,
                      "GROUP": mx.GROUP_ROWS, "OUT_BF16": bf16}
        signature |= dict.fromkeys(constexprs, "constexpr")
        source = ASTSource(fn=mx._mxfp4_matmul_kernel, signature=signature, constexprs=constexprs)
        options = mx.LAUNCH_OPTIONS | {"num_warps": config.warps, "num_stages": config.stages}
        ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
        assert f"wgmma.mma_async.sync.aligned.m64n{config.tile[1]}k32.f32.e4m3.e4m3" in ptx, out_type
        assert "mul.rn.f32" in ptx and "add.rn.f32" in ptx, out_type
        assert "fma.rn.f32" not in ptx and ".ftz" not in ptx, out_type


# ----------------------------------------------------------------------------------------------
# CUDA: the same equalities at the GEMM shapes of a 768 x 2048 linear on 4096 tokens
# ----------------------------------------------------------------------------------------------


@pytest.mark.cuda
def test_cuda_every_scale_pair(mx):
    a, b = every_scale_pair(device="cuda")
    c = mx.mxfp4_matmul(a, b)
    assert_same_bits(c, mxfp4_matmul_reference(a, b), "every scale pair")
    assert_single_block_exact(c, _on(a, "cpu"), _on(b, "cpu"), "every scale pair")
    for top_byte in (243, 244, 245, 254):
        a, b = largest_partials(top_byte, device="cuda")
        assert_single_block_exact(mx.mxfp4_matmul(a, b), _on(a, "cpu"), _on(b, "cpu"), f"largest partials {top_byte}")


@pytest.mark.cuda
@pytest.mark.parametrize("kind", QUANTIZED_KINDS + RAW_KINDS)
@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cuda_small_shapes_match_reference(mx, kind, shape):
    a, b = operands(kind, *shape, seed=sum(shape), device="cuda")
    label = f"{kind} {shape}"
    for out_dtype in (torch.float32, torch.bfloat16):
        c = mx.mxfp4_matmul(a, b, out_dtype)
        assert_same_bits(c, mxfp4_matmul_reference(a, b, out_dtype), f"{label} {out_dtype}")
    c = mx.mxfp4_matmul(a, b).cpu()
    a, b = _on(a, "cpu"), _on(b, "cpu")
    if kind in BOUNDED_KINDS:
        assert_within_fp64_bound(c, a, b, label)
        assert_matches_decoded_gemm(c, a, b, label)
    if shape[2] == MX and kind != "nan_bytes":
        assert_single_block_exact(c, a, b, label)


@pytest.mark.cuda
@pytest.mark.parametrize("gemm", GPU_SHAPES)
@pytest.mark.parametrize("kind", ("normal", "student_t", "row_scaled", "zero_blocks", "wide_blocks", "mixed_products", "any_byte"))
def test_cuda_linear_shapes_match_reference(mx, gemm, kind):
    m, n, k = GPU_SHAPES[gemm]
    a, b = operands(kind, m, n, k, seed=k, device="cuda")
    c = mx.mxfp4_matmul(a, b)
    assert_same_bits(c, mxfp4_matmul_reference(a, b), f"{gemm} {kind}")
    assert_same_bits(mx.mxfp4_matmul(a, b, torch.bfloat16), c.bfloat16(), f"{gemm} {kind} bf16")
    if kind in BOUNDED_KINDS:
        assert_matches_decoded_gemm(c, a, b, f"{gemm} {kind}")
        rows = slice(0, 256)  # the fp64 check on a slice of rows: [K / 32, M, N] fp64 is large
        a_rows = QTensor(a.data[rows], a.scales[rows], None, "mxfp4", torch.Size([256, k]), MX)
        assert_within_fp64_bound(c[rows], a_rows, b, f"{gemm} {kind}")


@pytest.mark.cuda
def test_cuda_single_block_linear_operands_equal_decoded_gemm(mx):
    """K = 32: the kernel equals the fp32 GEMM of the decoded operands on cuBLAS, bit for bit."""
    for kind in ("normal", "student_t", "row_scaled", "zero_blocks"):
        a, b = operands(kind, 4096, 768, MX, seed=7, device="cuda")
        assert_matches_decoded_gemm(mx.mxfp4_matmul(a, b), a, b, kind)


def test_bench_mx_gemm_is_cuda_only():
    from fp4lab.bench.kernels import bench_mx_gemm

    assert bench_mx_gemm(64, 64, 64, torch.device("cpu")) is None


@pytest.mark.cuda
def test_cuda_bench_mx_gemm_reports_the_ratio_to_bf16(mx):
    from fp4lab.bench.kernels import bench_mx_gemm

    m, n, k = GPU_SHAPES["fprop"]
    result = bench_mx_gemm(m, n, k, torch.device("cuda"), repeats=3)
    row = result.as_dict()
    assert row["ms"] > 0 and row["bf16_ms"] > 0 and row["throughput_vs_bf16"] == pytest.approx(row["bf16_ms"] / row["ms"])
    assert row["tflops"] == pytest.approx(2 * m * n * k / row["ms"] / 1e9)
