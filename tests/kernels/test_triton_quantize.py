"""Fused Triton quantizers (fp4lab.numerics.kernels.quantize) against the torch reference, bit for bit.

The reference of `quantize_fused(x, fmt=f, signs=s, transpose=t, ...)` is
`fake_quantize_factored(hadamard(y, len(s), s), f, ...)` (and `quantize(...)` for codes and scale
bytes) with y = x.float(), or x.float().T for t. SR is compared with the reference's own uniforms
passed in; the kernel's in-kernel Philox draws are checked statistically.

CUDA tests carry @pytest.mark.cuda (skipped without a GPU, see conftest.py). Two CPU tests run
everywhere: fp4lab imports no Triton, and the kernels under Triton's interpreter when Triton is
installed. Only torch, numpy, pytest and triton are needed here, so the module runs on a bare GPU box.
"""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import pytest
import torch

from fp4lab.numerics import BLOCK_SIZE, e2m1, fake_quantize_factored, hadamard, hadamard_signs, quantize
from fp4lab.numerics.qtensor import QTensor
from tests import interpreted

MX_MODES = ("floor", "ceil", "even", "rceil")
FORMAT_MODES = [("mxfp4", m) for m in MX_MODES] + [("nvfp4", None), ("nvfp4_cta", None)]
BLOCK = BLOCK_SIZE
SIGNS = {  # name -> (size, kind)
    "none": None,
    "fixed16": (16, "fixed"),
    "random16": (16, "random"),
    "fixed32": (32, "fixed"),
    "random32": (32, "random"),
}


# ----------------------------------------------------------------------------------------------
# Inputs: 2D tensors whose blocks run along either dim, so each serves both orientations
# ----------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tile_scale(shape, low: int, high: int, seed: int, tile: int = 16) -> torch.Tensor:
    """2^U(low, high) per tile x tile square: every 1D block, along rows or columns, gets one scale."""
    rows, cols = (math.ceil(n / tile) for n in shape)
    exps = torch.randint(low, high, (rows, cols), generator=_gen(seed)).float()
    grid = torch.exp2(exps).repeat_interleave(tile, 0).repeat_interleave(tile, 1)
    return grid[: shape[0], : shape[1]]


def _ties(shape, seed: int) -> torch.Tensor:
    """E2M1 midpoints that stay exact after scaling. 16x16 tiles with +-4 on the diagonal (MXFP4: every
    scale mode then gives multiplier 1) or +-6 (NVFP4: with the tensor amax 2688 below, S_enc = 1 and
    the block scale is 1), so every block along either dim holds midpoints and its maximum."""
    g = _gen(seed)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = mids[torch.randint(0, 7, shape, generator=g)] * (1 - 2 * torch.randint(0, 2, shape, generator=g))
    rows, cols = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
    diag = (rows % 16) == (cols % 16)
    block_max = torch.where((rows // 16 + cols // 16) % 2 == 0, 4.0, 6.0)
    x = torch.where(diag, block_max, x.clamp(-3.5, 3.5))  # below every block max
    x[0, 0] = 2688.0
    return x


def inputs(shape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = _gen(seed)
    normal = torch.randn(shape, generator=g)
    chi2 = sum(torch.randn(shape, generator=g) ** 2 for _ in range(3)) / 3
    zero_blocks = torch.randn(shape, generator=g) * (_tile_scale(shape, 0, 2, seed + 1, 32) - 1)  # 2^0 - 1 = 0
    nonfinite = torch.randn(shape, generator=g)
    flat = nonfinite.view(-1)
    for i, value in enumerate((float("nan"), float("inf"), float("-inf"), float("nan"))):
        flat[(i * 7919 + 13) % flat.numel()] = value
    nonfinite[1] = float("nan")  # a whole row: every row-block of it, one element of each column block
    return {
        "normal": normal,
        "student_t": torch.randn(shape, generator=g) / chi2.sqrt(),
        # E8M0 scales down to 2^-127 and fp32-subnormal inputs; E4M3 scales flushed to 0
        "wide": torch.randn(shape, generator=g) * _tile_scale(shape, -140, 10, seed + 2),
        "zero_blocks": zero_blocks,
        "all_zero": torch.zeros(shape),
        "ties": _ties(shape, seed + 3),
        "nonfinite": nonfinite,
        "tiny_tensor": torch.randn(shape, generator=g) * 2.0**-130,  # NVFP4 S_enc = FLT_MAX
    }


# ----------------------------------------------------------------------------------------------
# Reference and comparison
# ----------------------------------------------------------------------------------------------


def reference(x, fmt, scale_mode=None, rounding="rtn", signs=None, transpose=False, seed=1234):
    """(FactoredValues, QTensor, uniforms): the reference's encoding of the operand and, for SR, the
    uniforms it drew (the same draws the kernel is given)."""
    y = x.float().T.contiguous() if transpose else x.float()
    if signs is not None:
        y = hadamard(y, signs.numel(), signs)
    options = {"rounding": rounding, "scale_mode": scale_mode}
    uniforms = None
    if rounding == "sr":
        # e2m1.round_stochastic draws torch.rand over the grouped view [rows, blocks, block]
        block = BLOCK[fmt]
        shape = (y.shape[0], y.shape[1] // block, block)
        uniforms = torch.rand(shape, generator=_cuda_gen(seed), device=y.device).reshape(y.shape)
    factored = fake_quantize_factored(y, fmt, generator=_cuda_gen(seed) if rounding == "sr" else None, **options)
    q = quantize(y, fmt, generator=_cuda_gen(seed) if rounding == "sr" else None, **options)
    return factored, q, uniforms


def _cuda_gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def assert_matches(out, factored, q, label: str) -> None:
    expected = factored.values.to(torch.bfloat16)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out.values), nan), f"{label}: NaN positions differ"
    # bits, not values: -0.0 must stay -0.0
    got_bits, want_bits = out.values.view(torch.int16)[~nan], expected.view(torch.int16)[~nan]
    bad = (got_bits != want_bits).nonzero()
    assert bad.numel() == 0, f"{label}: {bad.shape[0]} values differ, e.g. {out.values[~nan][bad[:3, 0]].tolist()} vs {expected[~nan][bad[:3, 0]].tolist()}"
    assert torch.equal(out.scales, q.scales), f"{label}: scale bytes differ"
    assert torch.equal(out.codes, q.data), f"{label}: codes differ"
    if factored.outer is None:
        assert out.outer is None
    else:  # 0-dim (nvfp4), or one per row (nvfp4_cta: [rows, 1])
        assert out.outer.shape == factored.outer.shape and torch.equal(out.outer.view(torch.int32), factored.outer.view(torch.int32)), f"{label}: outer"


def assert_same_bits(got, want, label: str) -> None:
    """Equal bit for bit (-0.0 stays -0.0), NaN at the same places."""
    nan = torch.isnan(want)
    assert got.dtype == want.dtype and torch.equal(torch.isnan(got), nan), f"{label}: dtype or NaN positions differ"
    view = torch.int16 if want.dtype == torch.bfloat16 else torch.int32
    bad = (got.view(view) != want.view(view)) & ~nan
    assert not bad.any(), f"{label}: {int(bad.sum())} values differ, e.g. {got[bad][:3].tolist()} vs {want[bad][:3].tolist()}"


def assert_codes_only(decode_fused, lean, full, fmt: str, tile, label: str, cta_tile: int = 128) -> None:
    """`lean` (emit_values=False) holds the codes, scales and outer of `full` (the same call with values)
    and no values; decode_fused of its codes gives full's values (bf16) and QTensor.factored's (fp32)
    (nvfp4_cta: the QTensor of the per-CTA-tile outer scales, every cta_tile-th row's; with 2D tiles
    the kernel's one per square)."""
    assert lean.values is None, label
    assert torch.equal(lean.codes, full.codes) and torch.equal(lean.scales, full.scales), f"{label}: codes or scales differ"
    assert (lean.outer is None) == (full.outer is None), label
    if full.outer is not None:
        assert torch.equal(lean.outer.view(torch.int32), full.outer.view(torch.int32)), f"{label}: outer"
    shape = tuple(full.values.shape)
    assert_same_bits(decode_fused(lean.codes, lean.scales, fmt=fmt, shape=shape, tile=tile), full.values, f"{label} decode")
    outer, cta = (lean.outer if tile else lean.outer[::cta_tile, 0], cta_tile) if fmt == "nvfp4_cta" else (lean.outer, None)
    factored = QTensor(lean.codes, lean.scales, outer, fmt, torch.Size(shape), BLOCK[fmt], tile=tile, cta_tile=cta).factored()
    fp32 = decode_fused(lean.codes, lean.scales, fmt=fmt, shape=shape, tile=tile, out_dtype=torch.float32)
    assert_same_bits(fp32, factored.values, f"{label} decode fp32")


def every_scale_byte(fmt: str, tile=None, device="cpu"):
    """(codes, scales, shape): each of the 256 scale bytes (E8M0 0 = 2^-127 and 0xFF = NaN; E4M3
    subnormals, -0.0, negatives, NaN 0x7F / 0xFF) over blocks holding all 16 codes in both nibbles.
    1D: row r has bytes r and 255 - r (a wrong scale column shows); tiles: a 16 x 16 grid of them."""
    th, tw = tile or (1, BLOCK[fmt])
    if tile is None:
        scales = torch.stack((torch.arange(256), 255 - torch.arange(256)), dim=1).to(torch.uint8)
    else:
        scales = torch.arange(256).reshape(16, 16).T.contiguous().to(torch.uint8)
    rows, cols = scales.shape[0] * th, scales.shape[1] * tw
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    codes = ((c + r + c // 16 * 3) % 16).to(torch.uint8)  # 16 consecutive elements hold all 16 codes
    return e2m1.pack(codes).to(device), scales.to(device), (rows, cols)


@pytest.fixture(scope="module")
def tq():
    pytest.importorskip("triton")
    from fp4lab.numerics.kernels import quantize as triton_quantize

    return triton_quantize


def _signs(name: str, device="cuda"):
    if SIGNS[name] is None:
        return None
    size, kind = SIGNS[name]
    return hadamard_signs(size, kind, _gen(size) if kind == "random" else None).to(device)


# Even shapes are multiples of every tile (the unmasked kernels); odd ones exercise the masks: 33 rows
# for the row-wise orientation, 96 x 80 for x^T (its blocks run along the 96 rows).
EVEN_SHAPE = (128, 256)
ODD_SHAPE = {False: (33, 96), True: (96, 80)}


# ----------------------------------------------------------------------------------------------
# CUDA: bit-exact against the reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("transform", [0, 16, 32], ids=["plain", "h16", "h32"])
@pytest.mark.parametrize("rounding", ["rtn", "sr"])
@pytest.mark.parametrize("fmt,mode", FORMAT_MODES, ids=[m or f for f, m in FORMAT_MODES])
def test_exact_bf16(tq, fmt, mode, rounding, transform, transpose):
    """Every input kind, fixed and random signs, even and odd shapes: values, codes, scales, outer."""
    sign_names = ["none"] if not transform else [f"fixed{transform}", f"random{transform}"]
    for shape in (EVEN_SHAPE, ODD_SHAPE[transpose]):
        for kind, x in inputs(shape).items():
            x = x.to("cuda", torch.bfloat16)
            for sign_name in sign_names:
                signs = _signs(sign_name)
                factored, q, uniforms = reference(x, fmt, mode, rounding, signs, transpose)
                out = tq.quantize_fused(
                    x, fmt=fmt, scale_mode=mode, rounding=rounding, signs=signs, uniforms=uniforms,
                    transpose=transpose, emit_codes=True,
                )  # fmt: skip
                assert_matches(out, factored, q, f"{kind} {shape} {sign_name}")


@pytest.mark.cuda
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("rounding,transform", [("rtn", None), ("sr", "random16"), ("rtn", "fixed32")])
@pytest.mark.parametrize("fmt,mode", FORMAT_MODES, ids=[m or f for f, m in FORMAT_MODES])
def test_probe_counts(tq, fmt, mode, rounding, transform, transpose):
    """`stats` holds exactly survey.clip_flush_counts of the reference's encoding, every input kind
    (subnormals, zero blocks, NaN and Inf included), even and odd shapes, and the values are unchanged."""
    from fp4lab.numerics.survey import clip_flush_counts

    counted = 0
    for shape in (EVEN_SHAPE, ODD_SHAPE[transpose]):
        for kind, x in inputs(shape).items():
            x = x.to("cuda", torch.bfloat16)
            signs = _signs(transform or "none")
            factored, q, uniforms = reference(x, fmt, mode, rounding, signs, transpose)
            stats = torch.zeros(2, dtype=torch.int64, device="cuda")
            out = tq.quantize_fused(x, fmt=fmt, scale_mode=mode, rounding=rounding, signs=signs, uniforms=uniforms,
                                    transpose=transpose, emit_codes=True, stats=stats)
            assert_matches(out, factored, q, f"{kind} {shape} with stats")
            y = x.float().T.contiguous() if transpose else x.float()
            want = clip_flush_counts(hadamard(y, signs.numel(), signs) if signs is not None else y, q)
            assert torch.equal(stats, want), f"{kind} {shape}: counts {stats.tolist()} vs {want.tolist()}"
            counted += int(want.sum() > 0)
    assert counted >= 4  # the inputs saturate or flush somewhere


@pytest.mark.cuda
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("fmt,mode", FORMAT_MODES, ids=[m or f for f, m in FORMAT_MODES])
def test_exact_fp32(tq, fmt, mode, transpose):
    """fp32 inputs (fp32-subnormal elements included), RTN and SR, with and without H32."""
    for kind, x in inputs(EVEN_SHAPE, seed=5).items():
        x = x.to("cuda")
        for rounding in ("rtn", "sr"):
            for sign_name in ("none", "random32"):
                signs = _signs(sign_name)
                factored, q, uniforms = reference(x, fmt, mode, rounding, signs, transpose)
                out = tq.quantize_fused(
                    x, fmt=fmt, scale_mode=mode, rounding=rounding, signs=signs, uniforms=uniforms,
                    transpose=transpose, emit_codes=True,
                )  # fmt: skip
                assert_matches(out, factored, q, f"{kind} {rounding} {sign_name}")


BOTH_CASES = {
    "mx-rtn/nv-sr-h16": (dict(fmt="mxfp4", scale_mode="floor"), dict(fmt="nvfp4", rounding="sr", signs="random16")),
    "nv/nv": (dict(fmt="nvfp4"), dict(fmt="nvfp4")),  # two amaxes from one pass, NaNs differ per orientation
    "nv-h32/nv": (dict(fmt="nvfp4", signs="fixed32"), dict(fmt="nvfp4", rounding="sr")),
    "rceil-sr-h32/even": (dict(fmt="mxfp4", scale_mode="rceil", rounding="sr", signs="random32"), dict(fmt="mxfp4", scale_mode="even")),
    "ceil-sr-h16/nv-h16": (dict(fmt="mxfp4", scale_mode="ceil", rounding="sr", signs="fixed16"), dict(fmt="nvfp4", signs="random16")),
    "cta/cta-sr-h16": (dict(fmt="nvfp4_cta"), dict(fmt="nvfp4_cta", rounding="sr", signs="random16")),  # CTA-local amaxes of both
    "cta-h16/nv": (dict(fmt="nvfp4_cta", signs="fixed16"), dict(fmt="nvfp4")),  # a CTA-local and a tensor amax
}


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(BOTH_CASES))
def test_exact_both_orientations(tq, case):
    """quantize_fused_both equals the reference of x (row options) and of x^T (col options)."""
    row_opts, col_opts = BOTH_CASES[case]
    for shape in (EVEN_SHAPE, (96, 160)):
        for kind, x in inputs(shape, seed=9).items():
            x = x.to("cuda", torch.bfloat16)
            outs, refs = [], []
            for opts, transpose in ((row_opts, False), (col_opts, True)):
                opts = dict(opts, signs=_signs(opts.get("signs", "none")), emit_codes=True)
                factored, q, uniforms = reference(
                    x, opts["fmt"], opts.get("scale_mode"), opts.get("rounding", "rtn"), opts["signs"], transpose, seed=7 + transpose
                )  # fmt: skip
                refs.append((factored, q))
                outs.append(dict(opts, uniforms=uniforms) if uniforms is not None else opts)
            row_out, col_out = tq.quantize_fused_both(x, outs[0], outs[1])
            assert row_out.values.shape == shape and col_out.values.shape == shape[::-1]
            assert_matches(row_out, *refs[0], f"{kind} {shape} row")
            assert_matches(col_out, *refs[1], f"{kind} {shape} col")


TILE_CASES = [  # (fmt, scale_mode, adaptive, tile): the recipes' weight tiles and larger ones
    ("nvfp4", None, False, (16, 16)),
    ("nvfp4", None, False, (32, 16)),
    ("nvfp4", None, False, (64, 64)),
    ("mxfp4", "rceil", True, (32, 32)),
    ("mxfp4", "rceil", False, (32, 32)),
    ("mxfp4", "floor", False, (32, 64)),
    ("mxfp4", "even", False, (64, 32)),
    ("mxfp4", "rceil", True, (128, 128)),
]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt,mode,adaptive,tile", TILE_CASES, ids=[f"{f}-{m}-{'ad' if a else ''}{t[0]}x{t[1]}" for f, m, a, t in TILE_CASES])
def test_exact_2d_tiles(tq, fmt, mode, adaptive, tile, dtype):
    """2D weight tiles from fp32 (master weights) or bf16: values, codes, tile scale bytes, outer, on
    every input kind, for shapes that fill whole regions and shapes that do not (the masked kernels)."""
    options = dict(tile=tile) | (dict(scale_mode=mode, adaptive=adaptive) if fmt == "mxfp4" else {})
    th, tw = tile
    for shape in ((256, 512), (3 * th, 5 * tw), (th, tw)):
        for kind, x in inputs(shape, seed=11).items():
            x = x.to("cuda", dtype)
            factored = fake_quantize_factored(x.float(), fmt, **options)
            q = quantize(x.float(), fmt, **options)
            out = tq.quantize_fused(x, fmt=fmt, emit_codes=True, **options)
            assert out.scales.shape == (shape[0] // th, shape[1] // tw)
            assert_matches(out, factored, q, f"{kind} {shape}")
            lean = tq.quantize_fused(x, fmt=fmt, **options)
            assert torch.equal(lean.values.view(torch.int16), out.values.view(torch.int16))


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,mode,adaptive,tile", TILE_CASES, ids=[f"{f}-{m}-{'ad' if a else ''}{t[0]}x{t[1]}" for f, m, a, t in TILE_CASES])
def test_exact_2d_tiles_sr(tq, fmt, mode, adaptive, tile):
    """2D weight tiles rounded stochastically, given the reference's uniforms (its torch.rand over
    the [R/th, th, C/tw, tw] view: one per element of x, in x's order): values, codes, scale bytes and
    outer on every input kind, whole regions and masked ones."""
    options = dict(tile=tile) | (dict(scale_mode=mode, adaptive=adaptive) if fmt == "mxfp4" else {})
    th, tw = tile
    for shape in ((256, 512), (3 * th, 5 * tw)):
        for kind, x in inputs(shape, seed=12).items():
            x = x.to("cuda")
            uniforms = torch.rand(shape, generator=_cuda_gen(9), device="cuda")
            factored = fake_quantize_factored(x, fmt, rounding="sr", generator=_cuda_gen(9), **options)
            q = quantize(x, fmt, rounding="sr", generator=_cuda_gen(9), **options)
            out = tq.quantize_fused(x, fmt=fmt, rounding="sr", uniforms=uniforms, emit_codes=True, **options)
            assert_matches(out, factored, q, f"{kind} {shape} sr")


@pytest.mark.cuda
@pytest.mark.parametrize("tile,cta_tile", [((16, 16), 128), ((16, 16), 48), ((32, 32), 64), ((16, 32), 32)])
def test_exact_cta_local_2d_tiles(tq, tile, cta_tile):
    """2D CTA-local tiles: each tile's amax folded into its square's slot and one outer scale per square
    (squares larger and smaller than a kernel's region, not a power of two, cut short at odd shapes):
    values, codes, scale bytes and outer from fp32 and bf16, and codes only, decoded."""
    options = dict(tile=tile, cta_tile=cta_tile)
    th, tw = tile
    for shape in ((256, 512), (3 * th, 5 * tw), (160, 96)):
        for kind, x in inputs(shape, seed=31).items():
            for dtype in (torch.float32, torch.bfloat16):
                xd = x.to("cuda", dtype)
                label = f"{kind} {shape} {dtype}"
                out = tq.quantize_fused(xd, fmt="nvfp4_cta", emit_codes=True, **options)
                assert out.outer.shape == (-(-shape[0] // cta_tile), -(-shape[1] // cta_tile)), label
                factored = fake_quantize_factored(xd.float(), "nvfp4_cta", **options)
                assert_matches(out, factored, quantize(xd.float(), "nvfp4_cta", **options), label)
                lean = tq.quantize_fused(xd, fmt="nvfp4_cta", emit_codes=True, emit_values=False, **options)
                assert_codes_only(tq.decode_fused, lean, out, "nvfp4_cta", tile, label + " codes only", cta_tile=cta_tile)


@pytest.mark.cuda
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
def test_exact_adaptive_1d(tq, transpose):
    """adaptive=True on 1D blocks (both orientations, and from one read with another spec)."""
    for kind, x in inputs((96, 160), seed=13).items():
        x = x.to("cuda")
        y = x.T.contiguous() if transpose else x
        factored = fake_quantize_factored(y, "mxfp4", scale_mode="rceil", adaptive=True)
        q = quantize(y, "mxfp4", scale_mode="rceil", adaptive=True)
        out = tq.quantize_fused(x, fmt="mxfp4", scale_mode="rceil", adaptive=True, transpose=transpose, emit_codes=True)
        assert_matches(out, factored, q, kind)
        opts = dict(fmt="mxfp4", scale_mode="rceil", adaptive=True, emit_codes=True)
        both = tq.quantize_fused_both(x, opts if not transpose else dict(fmt="nvfp4", emit_codes=True), opts if transpose else dict(fmt="nvfp4", emit_codes=True))
        assert_matches(both[1 if transpose else 0], factored, q, kind + " both")


@pytest.mark.cuda
@pytest.mark.parametrize("cta_tile", [16, 48, 256])
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
def test_exact_cta_local_tiles(tq, cta_tile, transpose):
    """nvfp4_cta with CTA tiles smaller than a kernel's tile of rows (16: several per program; 48: not
    a power of two, straddling programs) and larger (256): each row's amax lands in its own tile's slot,
    the last tile partial on odd shapes; RTN and SR, with and without H16, both orientations at once."""
    signs = _signs("random16")
    for shape in (EVEN_SHAPE, ODD_SHAPE[transpose]):
        for kind, x in inputs(shape, seed=29).items():
            x = x.to("cuda", torch.bfloat16)
            y = x.float().T.contiguous() if transpose else x.float()
            for rounding, s in (("rtn", None), ("sr", signs)):
                yt = hadamard(y, 16, s) if s is not None else y
                g = (lambda: _cuda_gen(31)) if rounding == "sr" else (lambda: None)
                grouped = (yt.shape[0], yt.shape[1] // 16, 16)  # e2m1.round_stochastic's draws, in its shape
                uniforms = torch.rand(grouped, generator=_cuda_gen(31), device="cuda").reshape(yt.shape) if rounding == "sr" else None
                opts = dict(rounding=rounding, cta_tile=cta_tile)
                factored = fake_quantize_factored(yt, "nvfp4_cta", generator=g(), **opts)
                q = quantize(yt, "nvfp4_cta", generator=g(), **opts)
                out = tq.quantize_fused(x, fmt="nvfp4_cta", signs=s, uniforms=uniforms, transpose=transpose, emit_codes=True, **opts)
                assert out.outer.shape == (yt.shape[0], 1)
                assert_matches(out, factored, q, f"{kind} {shape} {rounding}")


@pytest.mark.cuda
def test_values_without_codes_and_outer(tq):
    """emit_codes=False (the training path) gives the same values; codes and scales are None."""
    x = inputs(EVEN_SHAPE)["student_t"].to("cuda", torch.bfloat16)
    for fmt in ("mxfp4", "nvfp4", "nvfp4_cta"):
        full = tq.quantize_fused(x, fmt=fmt, emit_codes=True)
        lean = tq.quantize_fused(x, fmt=fmt)
        assert lean.codes is None and lean.scales is None
        assert torch.equal(lean.values, full.values)
        assert (lean.outer is None) == (fmt == "mxfp4")


# ----------------------------------------------------------------------------------------------
# CUDA: codes only (emit_values=False) and the fused decode
# ----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("transpose", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize("fmt,mode", FORMAT_MODES, ids=[m or f for f, m in FORMAT_MODES])
def test_codes_only_and_decode(tq, fmt, mode, transpose):
    """Every input kind (NaN/Inf blocks; `wide`: E8M0 2^-127 and E4M3 subnormal scales), even and odd
    shapes, RTN and Philox SR (one seed for both calls), with and without H16: codes only equals the
    codes of the call with values, and decode_fused of them equals its values bit for bit."""
    seed = torch.tensor([5], dtype=torch.int64, device="cuda")
    for shape in (EVEN_SHAPE, ODD_SHAPE[transpose]):
        for kind, x in inputs(shape, seed=17).items():
            x = x.to("cuda", torch.bfloat16)
            for rounding, sign_name in (("rtn", "none"), ("sr", "none"), ("rtn", "random16"), ("sr", "random16")):
                opts = dict(fmt=fmt, scale_mode=mode, rounding=rounding, signs=_signs(sign_name), transpose=transpose, emit_codes=True)
                opts |= dict(seed=seed) if rounding == "sr" else {}
                full = tq.quantize_fused(x, **opts)
                lean = tq.quantize_fused(x, emit_values=False, **opts)
                assert_codes_only(tq.decode_fused, lean, full, fmt, None, f"{kind} {shape} {rounding} {sign_name}")
                if kind == "wide" and shape == EVEN_SHAPE and sign_name == "none":  # the edge scales occur
                    edge = full.scales == 0 if fmt == "mxfp4" else (full.scales > 0) & (full.scales < 8)
                    assert edge.any(), f"{kind} {rounding}: no E8M0 2^-127 / E4M3 subnormal scale"


BOTH_CODES_ONLY = {  # (row emit_values, col emit_values)
    "values/codes": (True, False),  # the training path: values for the forward GEMM, x^T packed
    "codes/values": (False, True),
    "codes/codes": (False, False),
}


@pytest.mark.cuda
@pytest.mark.parametrize("emit", list(BOTH_CODES_ONLY))
@pytest.mark.parametrize("case", ["mx-rtn/nv-sr-h16", "nv/nv", "rceil-sr-h32/even", "cta/cta-sr-h16"])
def test_codes_only_both_orientations(tq, case, emit):
    """quantize_fused_both with either orientation or both codes only: the same codes, scales and
    outer as with values, the same values where they are kept, and decoded codes equal to them."""
    seeds = [torch.tensor([3 + i], dtype=torch.int64, device="cuda") for i in range(2)]
    for shape in (EVEN_SHAPE, (96, 160)):
        for kind, x in inputs(shape, seed=19).items():
            x = x.to("cuda", torch.bfloat16)
            opts = []
            for base, seed in zip(BOTH_CASES[case], seeds):
                o = dict(base, signs=_signs(base.get("signs", "none")), emit_codes=True)
                opts.append(o | (dict(seed=seed) if o.get("rounding") == "sr" else {}))
            full = tq.quantize_fused_both(x, opts[0], opts[1])
            lean = tq.quantize_fused_both(x, *(dict(o, emit_values=e) for o, e in zip(opts, BOTH_CODES_ONLY[emit])))
            for name, want, got, o, kept in zip(("row", "col"), full, lean, opts, BOTH_CODES_ONLY[emit]):
                label = f"{kind} {shape} {name}"
                if kept:
                    assert_same_bits(got.values, want.values, label)
                    assert torch.equal(got.codes, want.codes) and torch.equal(got.scales, want.scales), label
                else:
                    assert_codes_only(tq.decode_fused, got, want, o["fmt"], None, label)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt,mode,adaptive,tile", TILE_CASES, ids=[f"{f}-{m}-{'ad' if a else ''}{t[0]}x{t[1]}" for f, m, a, t in TILE_CASES])
def test_codes_only_and_decode_2d_tiles(tq, fmt, mode, adaptive, tile):
    """2D weight tiles from fp32 and bf16, codes only, decoded through their tile scale grid; whole
    regions and masked ones."""
    options = dict(tile=tile) | (dict(scale_mode=mode, adaptive=adaptive) if fmt == "mxfp4" else {})
    th, tw = tile
    for shape in ((256, 512), (3 * th, 5 * tw), (th, tw)):
        for kind, x in inputs(shape, seed=23).items():
            for dtype in (torch.float32, torch.bfloat16):
                xd = x.to("cuda", dtype)
                full = tq.quantize_fused(xd, fmt=fmt, emit_codes=True, **options)
                lean = tq.quantize_fused(xd, fmt=fmt, emit_codes=True, emit_values=False, **options)
                assert_codes_only(tq.decode_fused, lean, full, fmt, tile, f"{kind} {shape} {dtype}")


@pytest.mark.cuda
@pytest.mark.parametrize("tiled", [False, True], ids=["1d", "tiles"])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_decode_every_scale_byte(tq, fmt, tiled):
    """decode_fused of all 16 codes under each of the 256 scale bytes equals QTensor.factored, in bf16
    (the subnormal products of E8M0 2^-127 and 2^-126 included) and fp32."""
    tile = (BLOCK[fmt], BLOCK[fmt]) if tiled else None
    codes, scales, shape = every_scale_byte(fmt, tile, "cuda")
    assert_decodes_as_reference(tq, codes, scales, fmt, shape, tile)


def assert_decodes_as_reference(tq, codes, scales, fmt, shape, tile) -> None:
    """decode_fused equals QTensor.factored bit for bit, in bf16 and fp32."""
    want = QTensor(codes, scales, None, fmt, torch.Size(shape), BLOCK[fmt], tile=tile).factored().values
    for dtype in (torch.bfloat16, torch.float32):
        got = tq.decode_fused(codes, scales, fmt=fmt, shape=shape, tile=tile, out_dtype=dtype)
        assert_same_bits(got, want.to(dtype), f"{fmt} {shape} {tile} {dtype}")


@pytest.mark.cuda
def test_decode_odd_shapes(tq):
    """Random codes and scale bytes in shapes that fill no whole program (masked loads and stores), 1D
    and tiled, and one that fills several, in bf16 and fp32."""
    g = torch.Generator().manual_seed(29)
    cases = [("mxfp4", (33, 96), None), ("nvfp4", (1, 16), None), ("nvfp4", (257, 272), None), ("mxfp4", (128, 1024), None),
             ("mxfp4", (96, 288), (32, 32)), ("nvfp4", (48, 80), (16, 16)), ("mxfp4", (64, 96), (64, 32))]  # fmt: skip
    for fmt, shape, tile in cases:
        rows, cols = shape
        th, tw = tile or (1, BLOCK[fmt])
        codes = torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8).cuda()
        scales = torch.randint(0, 256, (rows // th, cols // tw), generator=g, dtype=torch.uint8).cuda()
        assert_decodes_as_reference(tq, codes, scales, fmt, shape, tile)


@pytest.mark.cuda
def test_codes_only_and_decode_errors(tq):
    x = torch.zeros(64, 64, device="cuda")
    with pytest.raises(ValueError, match="emit_codes=True"):
        tq.quantize_fused(x, fmt="mxfp4", emit_values=False)
    with pytest.raises(ValueError, match="emit_codes=True"):
        tq.quantize_fused_both(x, {"fmt": "mxfp4"}, {"fmt": "nvfp4", "emit_values": False})
    with pytest.raises(ValueError, match="emit_values must be a bool"):
        tq.quantize_fused(x, fmt="mxfp4", emit_codes=True, emit_values=0)
    codes = torch.zeros(64, 32, dtype=torch.uint8, device="cuda")
    scales = torch.zeros(64, 2, dtype=torch.uint8, device="cuda")
    ok = dict(fmt="mxfp4", shape=(64, 64))
    for kwargs, match in (
        (dict(ok, fmt="fp8"), "fmt='fp8' is not supported"),
        # nvfp4_cta decodes (its blocks are NVFP4's 1x16): mxfp4-sized scales are refused by their shape.
        (dict(ok, fmt="nvfp4_cta"), r"scales must be a uint8 tensor of shape \[64, 4\], got torch.uint8 \[64, 2\]"),
        (dict(ok, shape=(64, 48)), "shape"),
        (dict(ok, shape=(64,)), "shape"),
        (dict(ok, shape=(32, 64)), r"codes must be a uint8 tensor of shape \[32, 32\]"),
        (dict(ok, fmt="nvfp4"), r"scales must be a uint8 tensor of shape \[64, 4\]"),
        (dict(ok, tile=(32, 32)), r"scales must be a uint8 tensor of shape \[2, 2\]"),
        (dict(ok, tile=(16, 16)), "tile"),
        (dict(fmt="mxfp4", shape=(96, 96), tile=(96, 32)), "powers of two"),
        (dict(ok, out_dtype=torch.float16), "out_dtype"),
    ):
        with pytest.raises(ValueError, match=match):
            tq.decode_fused(codes, scales, **kwargs)
    not_contiguous = torch.zeros(32, 64, dtype=torch.uint8, device="cuda").T
    for bad, match in ((codes.int(), "uint8"), (codes.cpu(), "CUDA"), (not_contiguous, "contiguous")):
        with pytest.raises(ValueError, match=match):
            tq.decode_fused(bad, scales, **ok)
    with pytest.raises(ValueError, match="one CUDA device"):
        tq.decode_fused(codes, scales.cpu(), **ok)


# ----------------------------------------------------------------------------------------------
# CUDA: stochastic rounding with in-kernel Philox draws
# ----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("transpose,tile", [(False, None), (True, None), (False, (32, 32))], ids=["rows", "transposed", "tiles"])
def test_sr_philox_unbiased_and_between_neighbours(tq, transpose, tile):
    """Columns j = 0 mod 16 hold 4.0 (every 32-block, and every 32 x 32 tile, has amax 4: MXFP4
    multiplier 1, values in E2M1 units), the others one of 15 off-grid values v between grid
    neighbours lo < hi. Every result is lo or hi, and over n draws the mean for each v lies within 6
    standard errors sqrt((v-lo)(hi-v)/n) of v, plus the bias that the 2^-16 granularity of the
    uniforms allows (2^-16 of a step)."""
    rows, cols, draws = 256, 512, 16
    v = torch.tensor([0.1, 0.3, 0.6, 0.9, 1.1, 1.4, 1.6, 1.9, 2.2, 2.7, 3.3, 3.9, 4.5, 5.1, 5.9])
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    hi = grid[torch.searchsorted(grid, v)]
    lo = grid[torch.searchsorted(grid, v) - 1]
    x = torch.cat((torch.tensor([4.0]), v)).repeat(rows, cols // 16)
    # transpose=True quantizes the transpose of its input: hand it x^T to quantize x itself
    operand = (x.T.contiguous() if transpose else x).to("cuda")
    total = torch.zeros(v.numel(), dtype=torch.float64)
    for draw in range(draws):
        seed = torch.tensor([draw * 7919 + 1], dtype=torch.int64, device="cuda")
        out = tq.quantize_fused(operand, fmt="mxfp4", rounding="sr", seed=seed, transpose=transpose, tile=tile).values
        body = out.float().cpu().reshape(rows, cols // 16, 16)[..., 1:]
        assert ((body == lo) | (body == hi)).all()
        total += body.double().sum(dim=(0, 1))
    n = rows * cols // 16 * draws
    v, lo, hi = v.double(), lo.double(), hi.double()
    bound = 6 * torch.sqrt((v - lo) * (hi - v) / n) + (hi - lo) * 2.0**-16
    assert ((total / n - v).abs() <= bound).all(), (total / n - v, bound)


@pytest.mark.cuda
def test_sr_philox_seed_reproducible_and_independent(tq):
    """Same seed, same bits; another seed, other bits; neighbouring elements (one Philox call serves
    eight, two halves of one word serve elements 2i and 2i + 1) round independently: P(both up) =
    P(up)^2 within sampling error, for pairs in one word and pairs of words."""
    x = torch.full((512, 1024), 1.25, device="cuda")  # between 1 and 1.5: up with p = 1/2
    x[:, ::32] = 4.0
    seed = torch.tensor([3], dtype=torch.int64, device="cuda")
    a = tq.quantize_fused(x, fmt="mxfp4", rounding="sr", seed=seed).values
    b = tq.quantize_fused(x, fmt="mxfp4", rounding="sr", seed=seed.clone()).values
    c = tq.quantize_fused(x, fmt="mxfp4", rounding="sr", seed=seed + 1).values
    assert torch.equal(a, b) and not torch.equal(a, c)
    body = torch.ones(1024, dtype=torch.bool)
    body[::32] = False
    up = (a[:, body] == 1.5).float()
    assert set(a[:, body].unique().tolist()) == {1.0, 1.5}
    p = up.mean().item()
    assert abs(p - 0.5) < 6 * math.sqrt(0.25 / up.numel())
    up = (a == 1.5).float()  # columns 8g + k: word k // 2 of call g, its high half for odd k
    for i, j in ((2, 3), (3, 4), (2, 6)):  # halves of one word, neighbouring words, words 1 and 3
        pairs = up[:, i::8] * up[:, j::8]
        assert abs(pairs.mean().item() - p * p) < 6 * math.sqrt(p * p * (1 - p * p) / pairs.numel())


# ----------------------------------------------------------------------------------------------
# CUDA: errors
# ----------------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(fmt="nvfp4_cta", tile=(32, 32), cta_tile=48), "cta_tile"),
        (dict(fmt="nvfp4_cta", cta_tile=24), "cta_tile"),
        (dict(fmt="nvfp4_cta", scale_mode="floor"), "scale_mode"),
        (dict(fmt="mxfp4", tile=(16, 16)), "tile"),
        (dict(fmt="nvfp4", tile=(16, 16), rounding="sr"), "seed"),
        (dict(fmt="nvfp4", tile=(16, 16), signs="signs16"), "tile"),
        (dict(fmt="nvfp4", tile=(16, 16), transpose=True), "tile"),
        (dict(fmt="nvfp4", tile=(48, 16)), "tile"),
        (dict(fmt="mxfp4", adaptive=True), "adaptive"),
        (dict(fmt="nvfp4", adaptive=True), "adaptive"),
        (dict(fmt="nvfp4", cta_tile=128), "cta_tile"),
        (dict(fmt="nvfp4", tensor_amax=1.0), "tensor_amax"),
        (dict(fmt="mxfp4", tensor_amax=1.0), "tensor_amax"),
        (dict(fmt="nvfp4", scale_mode="floor"), "scale_mode"),
        (dict(fmt="mxfp4", rounding="sr"), "seed"),
        (dict(fmt="mxfp4", seed="seed"), "seed"),
        (dict(fmt="mxfp4", signs="signs64"), "signs"),
        (dict(fmt="mxfp4", rounding="down"), "rounding"),
    ],
)
def test_unsupported_options_raise_value_error(tq, kwargs, name):
    x = torch.zeros(64, 64, device="cuda")
    if kwargs.get("seed") == "seed":  # rtn: a seed is an error; sr: the tile is
        kwargs = dict(kwargs, seed=torch.tensor([1], device="cuda"))
    if kwargs.get("signs") in ("signs64", "signs16"):
        kwargs = dict(kwargs, signs=torch.ones(int(kwargs["signs"][5:]), device="cuda"))
    with pytest.raises(ValueError, match=name):
        tq.quantize_fused(x, **kwargs)


@pytest.mark.cuda
def test_bad_tensors_raise_value_error(tq):
    with pytest.raises(ValueError, match="CUDA"):
        tq.quantize_fused(torch.zeros(64, 64), fmt="mxfp4")
    with pytest.raises(ValueError, match="multiple of 32"):
        tq.quantize_fused(torch.zeros(64, 48, device="cuda"), fmt="mxfp4")
    with pytest.raises(ValueError, match="rows"):
        tq.quantize_fused(torch.zeros(40, 64, device="cuda"), fmt="mxfp4", transpose=True)
    with pytest.raises(ValueError, match="contiguous"):
        tq.quantize_fused(torch.zeros(64, 64, device="cuda").T, fmt="mxfp4")
    with pytest.raises(ValueError, match="dtype"):
        tq.quantize_fused(torch.zeros(64, 64, device="cuda", dtype=torch.float16), fmt="mxfp4")
    with pytest.raises(ValueError, match="2D"):
        tq.quantize_fused(torch.zeros(2, 64, 64, device="cuda"), fmt="mxfp4")
    with pytest.raises(ValueError, match="option 'transpose'"):
        tq.quantize_fused_both(torch.zeros(64, 64, device="cuda"), {"fmt": "mxfp4", "transpose": True}, {"fmt": "mxfp4"})


# ----------------------------------------------------------------------------------------------
# CPU
# ----------------------------------------------------------------------------------------------


def test_fp4lab_imports_no_triton():
    """fp4lab.numerics and fp4lab.nn (every submodule, and the kernel layer's torch-only package, but not
    its kernel modules) import and work without Triton, and do not load it when it is installed;
    kernels.runs_on then says no for a CUDA device."""
    code = textwrap.dedent(
        """
        import importlib, pkgutil, sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        import fp4lab.numerics, fp4lab.nn
        import torch
        from fp4lab.numerics.kernels import runs_on
        for package in (fp4lab.numerics, fp4lab.nn):
            for info in pkgutil.iter_modules(package.__path__):
                importlib.import_module(f"{package.__name__}.{info.name}")  # numerics.kernels: its __init__ only
        assert not runs_on(torch.device("cuda"))
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    code = "import sys, torch; t = 'triton' in sys.modules; import fp4lab.numerics, fp4lab.nn; print(t or 'triton' not in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True, text=True)
    assert done.stdout.strip() == "True"


INTERPRETED_CHECK = """
import sys, torch
from tests.kernels.test_triton_quantize import inputs, assert_matches, assert_codes_only, assert_same_bits, every_scale_byte, BLOCK
from fp4lab.numerics import fake_quantize_factored, hadamard, hadamard_signs, quantize
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.kernels.quantize import decode_fused, quantize_fused, quantize_fused_both

def ref(y, fmt, mode, rounding, signs):
    if signs is not None:
        y = hadamard(y, signs.numel(), signs)
    u = None
    if rounding == "sr":
        u = torch.rand(y.shape[0], y.shape[1] // BLOCK[fmt], BLOCK[fmt], generator=torch.Generator().manual_seed(1)).reshape(y.shape)
    opts = dict(scale_mode=mode, rounding=rounding)
    g = lambda: torch.Generator().manual_seed(1) if rounding == "sr" else None
    return fake_quantize_factored(y, fmt, generator=g(), **opts), quantize(y, fmt, generator=g(), **opts), u

# The interpreter emulates float conversions without subnormals: keep to normal magnitudes. It runs
# a custom reduction element by element in Python: few, small cases (two inputs each).
cases = [("mxfp4", "floor", "rtn", None), ("mxfp4", "rceil", "sr", 32), ("mxfp4", "even", "rtn", 16),
         ("mxfp4", "ceil", "sr", None), ("nvfp4", None, "rtn", 16), ("nvfp4", None, "sr", 32)]
kinds = [(name, x) for name, x in inputs((32, 64), seed=2).items() if name not in ("wide", "tiny_tensor")]
for i, (fmt, mode, rounding, size) in enumerate(cases):
    for name, x in (kinds[i % len(kinds)], kinds[(i + 3) % len(kinds)]):
        signs = hadamard_signs(size, "random", torch.Generator().manual_seed(size)) if size else None
        row, row_q, row_u = ref(x.float(), fmt, mode, rounding, signs)
        col, col_q, col_u = ref(x.float().T.contiguous(), fmt, mode, rounding, signs)
        opts = dict(fmt=fmt, scale_mode=mode, rounding=rounding, signs=signs, emit_codes=True)
        label = f"{{name}} {{fmt}} {{mode}} {{rounding}} {{size}}"
        assert_matches(quantize_fused(x, uniforms=row_u, **opts), row, row_q, label)
        both = quantize_fused_both(x, dict(opts, uniforms=row_u), dict(opts, uniforms=col_u))
        assert_matches(both[0], row, row_q, label + " both/row")
        assert_matches(both[1], col, col_q, label + " both/col")

for fmt, opts in (("nvfp4", dict(tile=(16, 16))), ("mxfp4", dict(tile=(32, 32), scale_mode="rceil", adaptive=True)),
                  ("nvfp4_cta", dict(tile=(16, 16), cta_tile=16))):
    for name, x in kinds[:2]:
        out = quantize_fused(x, fmt=fmt, emit_codes=True, **opts)
        assert_matches(out, fake_quantize_factored(x.float(), fmt, **opts), quantize(x.float(), fmt, **opts), f"{{name}} {{fmt}} tiles")
# 2D tiles with SR, given the reference's uniforms (one per element of x, in x's order)
for fmt, opts in (("nvfp4", dict(tile=(16, 16))), ("mxfp4", dict(tile=(32, 32), scale_mode="floor")),
                  ("nvfp4_cta", dict(tile=(16, 16), cta_tile=32))):
    for name, x in kinds[1:3]:
        u = torch.rand(x.shape, generator=torch.Generator().manual_seed(5))
        g = lambda: torch.Generator().manual_seed(5)
        out = quantize_fused(x, fmt=fmt, rounding="sr", uniforms=u, emit_codes=True, **opts)
        want = [f(x.float(), fmt, rounding="sr", generator=g(), **opts) for f in (fake_quantize_factored, quantize)]
        assert_matches(out, *want, f"{{name}} {{fmt}} tiles sr")

# Codes only and its fused decode: rows, x^T, either orientation of both, tiles (nvfp4 once: its amax
# pass is slow here). Every scale byte decoded to fp32: the interpreter's bf16 cast flushes the
# subnormal products of E8M0 bytes 0 and 1.
x = kinds[0][1]
signs = hadamard_signs(16, "random", torch.Generator().manual_seed(16))
mx = dict(fmt="mxfp4", scale_mode="rceil", rounding="sr", signs=signs, emit_codes=True)
row, col = (dict(mx, uniforms=torch.rand(s, generator=torch.Generator().manual_seed(3))) for s in (x.shape, x.shape[::-1]))
full = quantize_fused_both(x, row, col)
assert_codes_only(decode_fused, quantize_fused(x, emit_values=False, **row), full[0], "mxfp4", None, "mxfp4 rows")
assert_codes_only(decode_fused, quantize_fused(x, transpose=True, emit_values=False, **col), full[1], "mxfp4", None, "mxfp4 x^T")
lean = quantize_fused_both(x, row, dict(col, emit_values=False))
assert torch.equal(lean[0].values, full[0].values) and torch.equal(lean[0].codes, full[0].codes)
assert_codes_only(decode_fused, lean[1], full[1], "mxfp4", None, "mxfp4 both/col")
nv = dict(fmt="nvfp4", emit_codes=True)
full = quantize_fused_both(x, nv, nv)
lean = quantize_fused_both(x, dict(nv, emit_values=False), nv)
assert_codes_only(decode_fused, lean[0], full[0], "nvfp4", None, "nvfp4 both/row")
assert torch.equal(lean[1].values, full[1].values) and torch.equal(lean[1].codes, full[1].codes)
lean = quantize_fused(x, fmt="mxfp4", tile=(32, 32), emit_codes=True, emit_values=False)
assert_codes_only(decode_fused, lean, quantize_fused(x, fmt="mxfp4", tile=(32, 32), emit_codes=True), "mxfp4", (32, 32), "mxfp4 tiles")
# nvfp4_cta with CTA tiles of 16 rows: two or four per program of rows, each row's amax in its slot;
# both orientations from one read (x^T stochastically rounded after H16), and x^T codes only.
signs = hadamard_signs(16, "random", torch.Generator().manual_seed(16))
y = hadamard(x.float().T.contiguous(), 16, signs)
u = torch.rand(y.shape, generator=torch.Generator().manual_seed(4))
g = lambda: torch.Generator().manual_seed(4)
cta = dict(fmt="nvfp4_cta", cta_tile=16, emit_codes=True)
col = dict(cta, rounding="sr", signs=signs, uniforms=u)
both = quantize_fused_both(x, cta, col)
assert_matches(both[0], fake_quantize_factored(x.float(), "nvfp4_cta", cta_tile=16), quantize(x.float(), "nvfp4_cta", cta_tile=16), "cta rows")
col_ref = [f(y, "nvfp4_cta", cta_tile=16, rounding="sr", generator=g()) for f in (fake_quantize_factored, quantize)]
assert_matches(both[1], *col_ref, "cta x^T sr h16")
lean = quantize_fused(x, transpose=True, emit_values=False, **col)
assert_codes_only(decode_fused, lean, both[1], "nvfp4_cta", None, "cta x^T codes only", cta_tile=16)
lean = quantize_fused(x, fmt="nvfp4_cta", tile=(16, 16), cta_tile=48, emit_codes=True, emit_values=False)
assert_codes_only(decode_fused, lean, quantize_fused(x, fmt="nvfp4_cta", tile=(16, 16), cta_tile=48, emit_codes=True), "nvfp4_cta", (16, 16), "cta 2D squares", cta_tile=48)

for fmt in ("mxfp4", "nvfp4"):
    for tile in (None, (BLOCK[fmt], BLOCK[fmt])):
        codes, scales, shape = every_scale_byte(fmt, tile)
        want = QTensor(codes, scales, None, fmt, torch.Size(shape), BLOCK[fmt], tile=tile).factored().values
        got = decode_fused(codes, scales, fmt=fmt, shape=shape, tile=tile, out_dtype=torch.float32)
        assert_same_bits(got, want, f"{{fmt}} {{tile}} every scale byte")
"""


def test_kernels_under_triton_interpreter():
    """The kernels' integer and float arithmetic, run by Triton's CPU interpreter, equals the reference
    (normal magnitudes: the interpreter's float casts mishandle subnormals, the GPU's do not)."""
    done = interpreted.interpreter_python(INTERPRETED_CHECK.format(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


PROBE_COUNTS_CHECK = """
import torch
from tests.kernels.test_triton_quantize import inputs, BLOCK
from fp4lab.numerics import hadamard, hadamard_signs, quantize
from fp4lab.numerics.survey import clip_flush_counts
from fp4lab.numerics.kernels.quantize import quantize_fused, quantize_fused_both

def expected(y, fmt, signs=None, u=None, **opts):
    # the reference's saturated and flushed counts of y's quantization (the kernel given the same uniforms)
    if signs is not None:
        y = hadamard(y, signs.numel(), signs)
    g = torch.Generator().manual_seed(7) if u is not None else None
    q = quantize(y, fmt, rounding="sr" if u is not None else "rtn", generator=g, **opts)
    return clip_flush_counts(y, q)

def uniforms(y, fmt):
    return torch.rand(y.shape[0], y.shape[1] // BLOCK[fmt], BLOCK[fmt], generator=torch.Generator().manual_seed(7)).reshape(y.shape)

def zeros():
    return torch.zeros(2, dtype=torch.int64)

checked = 0
# heavy tails flush, floor scales and E4M3-rounded block scales saturate; 33 rows exercise the masks
for shape in ((32, 64), (33, 96)):
    kinds = inputs(shape, seed=5)
    for name in ("student_t", "nonfinite", "ties"):
        x = kinds[name]
        y, yt = x.float(), x.float().T.contiguous()
        signs = hadamard_signs(16, "random", torch.Generator().manual_seed(16))
        for fmt, mode, sr, transform in (("mxfp4", "floor", False, None), ("nvfp4", None, True, signs), ("nvfp4_cta", None, False, None)):
            opts = {"scale_mode": mode} if mode else ({"cta_tile": 16} if fmt == "nvfp4_cta" else {})
            row_u = uniforms(hadamard(y, 16, signs) if transform is not None else y, fmt) if sr else None
            want = expected(y, fmt, transform, row_u, **opts)
            stats = zeros()
            quantize_fused(x, fmt=fmt, signs=transform, rounding="sr" if sr else "rtn", uniforms=row_u, stats=stats, **opts)
            assert torch.equal(stats, want), (name, shape, fmt, "rows", stats.tolist(), want.tolist())
            checked += int(want.sum() > 0)
            if shape[0] % BLOCK[fmt] == 0:
                col_u = uniforms(hadamard(yt, 16, signs) if transform is not None else yt, fmt) if sr else None
                pair = zeros(), zeros()
                rounding = "sr" if sr else "rtn"
                quantize_fused_both(x, dict(fmt=fmt, signs=transform, rounding=rounding, uniforms=row_u, stats=pair[0], **opts),
                                    dict(fmt=fmt, signs=transform, rounding=rounding, uniforms=col_u, stats=pair[1], **opts))
                assert torch.equal(pair[0], want), (name, fmt, "both/rows", pair[0].tolist(), want.tolist())
                want_col = expected(yt, fmt, transform, col_u, **opts)
                assert torch.equal(pair[1], want_col), (name, fmt, "both/cols", pair[1].tolist(), want_col.tolist())
    x = inputs((64, 64), seed=6)["student_t"]
    for fmt, opts in (("nvfp4", dict(tile=(16, 16))), ("mxfp4", dict(tile=(32, 32), scale_mode="floor")),
                      ("nvfp4_cta", dict(tile=(16, 16), cta_tile=32))):
        stats = zeros()
        quantize_fused(x, fmt=fmt, stats=stats, **opts)
        want = clip_flush_counts(x.float(), quantize(x.float(), fmt, **opts))
        assert torch.equal(stats, want), (fmt, "tiles", stats.tolist(), want.tolist())
        checked += int(want.sum() > 0)
assert checked >= 10, checked  # the inputs do saturate and flush
print("ok")
"""


def test_probe_counts_under_triton_interpreter():
    """The fused quantizers' `stats` count exactly the saturated and flushed elements that
    survey.clip_flush_counts finds in the reference encoding: rows, x^T, both orientations, masks,
    SR with a transform, CTA-local scales and 2D tiles."""
    done = interpreted.interpreter_python(PROBE_COUNTS_CHECK, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
