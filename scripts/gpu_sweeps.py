"""Sweeps behind the launch shapes of fp4lab's Triton kernels and the MXFP4 GEMM's anatomy (CUDA only).

    python scripts/gpu_sweeps.py gemm-anatomy   OUT_DIR   # where the FP8 GEMM's time goes
    python scripts/gpu_sweeps.py gemm-configs   OUT_DIR   # triton_mx_gemm.GemmConfig candidates
    python scripts/gpu_sweeps.py attention-tiles OUT_DIR  # triton_attention._GPU_TILES candidates
    python scripts/gpu_sweeps.py tile-configs   OUT_DIR   # triton_tile_gemm.TileGemmConfig candidates

Each prints one line per measurement and writes OUT_DIR/<sweep>.json; times are fp4lab.bench's
(medians over replays of CUDA graphs). docs/BENCHMARKS.md quotes the results.

gemm-anatomy times, on the 125m and 350m training GEMMs, bf16 cuBLAS and cuBLAS FP8 over the whole K
(torch._scaled_mm: fast but inexact on Hopper) beside a stripped-down Triton FP8 GEMM on E4M3 values
in four variants: the scaled sum per 32-block (as fp4lab's kernel, with an FMA or two multiplies),
the promotion per 32-block without scaling, and one dot per 128 of K without promotion. The gaps
between them are the costs of promoting and of scaling.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from fp4lab.bench.kernels import _median_ms
from fp4lab.numerics import quantize
from fp4lab.numerics.kernels import mx_gemm as mx

DEVICE = torch.device("cuda")
GEMM_SHAPES = (
    ("125m fprop w1", 16384, 2048, 768), ("125m dgrad w1", 16384, 768, 2048), ("125m wgrad w1", 2048, 768, 16384),
    ("350m fprop w1", 16384, 2816, 1024), ("350m wgrad w1", 2816, 1024, 16384),
)
SCALED_FMA, SCALED_MUL, PROMOTED, UNPROMOTED = range(4)


@triton.jit
def _anatomy_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, out_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, MODE: tl.constexpr):  # fmt: skip
    """C = A @ B^T on E4M3 bytes (M, N multiples of the tile; block-major scale bytes)."""
    rows_a = tl.program_id(0) * BM + tl.arange(0, BM)
    rows_b = tl.program_id(1) * BN + tl.arange(0, BN)
    a_ptrs = a_ptr + rows_a[:, None].to(tl.int64) * K + tl.arange(0, BK)[None, :]
    b_ptrs = b_ptr + rows_b[:, None].to(tl.int64) * K + tl.arange(0, BK)[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kb in range(0, K // BK):
        a = tl.load(a_ptrs).to(tl.float8e4nv, bitcast=True)
        b = tl.load(b_ptrs).to(tl.float8e4nv, bitcast=True)
        partial = tl.dot(a, tl.trans(b), out_dtype=tl.float32)
        if MODE < 2:
            fa = (tl.load(as_ptr + kb * M + rows_a).to(tl.int32) << 23).to(tl.float32, bitcast=True)
            fb = (tl.load(bs_ptr + kb * N + rows_b).to(tl.int32) << 23).to(tl.float32, bitcast=True)
            if MODE == 0:
                acc = tl.fma(partial, fa[:, None] * fb[None, :], acc)
            else:
                acc += (partial * fa[:, None]) * fb[None, :]
        else:
            acc += partial
        a_ptrs += BK
        b_ptrs += BK
    tl.store(out_ptr + rows_a.to(tl.int64)[:, None] * N + rows_b[None, :], acc.to(tl.bfloat16))


def _operands(m: int, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    a32, b32 = (torch.randn(rows, k, generator=g).to(DEVICE) for rows in (m, n))
    return a32, b32, quantize(a32, "mxfp4"), quantize(b32, "mxfp4")


def gemm_anatomy() -> list[dict]:
    rows = []
    for label, m, n, k in GEMM_SHAPES:
        a32, b32, a, b = _operands(m, n, k)
        a16, b16 = a32.bfloat16(), b32.bfloat16()
        a8f, b8f = a32.to(torch.float8_e4m3fn), b32.to(torch.float8_e4m3fn)
        a8, b8 = mx.e4m3_values(a.data), mx.e4m3_values(b.data)
        sa, sb = a.scales.T.contiguous(), b.scales.T.contiguous()
        one = torch.tensor(1.0, device=DEVICE)
        row = {"label": label, "shape": [m, n, k]}

        def time(name, fn):
            ms = _median_ms(fn, DEVICE, 20)
            row[name] = {"ms": ms, "tflops": 2 * m * n * k / ms / 1e9}
            print(label, name, f"{ms:.4f} ms", f"{row[name]['tflops']:.0f} TFLOP/s", flush=True)

        def anatomy(mode, bm, bn, bk, warps, stages):
            out = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
            return lambda: _anatomy_kernel[(m // bm, n // bn)](
                a8, sa, b8, sb, out, m, n, k, BM=bm, BN=bn, BK=bk, MODE=mode, num_warps=warps, num_stages=stages,
                enable_fp_fusion=False)

        time("bf16 cuBLAS", lambda: torch.mm(a16, b16.T))
        time("fp8 cuBLAS whole K (inexact)", lambda: torch._scaled_mm(a8f, b8f.T, one, one, out_dtype=torch.bfloat16))
        time("fp4lab mxfp4_matmul", lambda: mx.mxfp4_matmul(a, b, torch.bfloat16))
        for name, mode, shape in (
            ("scaled per 32, fma, 128x64 w4 s4", SCALED_FMA, (128, 64, 32, 4, 4)),
            ("scaled per 32, fma, 128x128 w8 s3", SCALED_FMA, (128, 128, 32, 8, 3)),
            ("scaled per 32, two muls, 128x128 w8 s3", SCALED_MUL, (128, 128, 32, 8, 3)),
            ("promoted per 32, unscaled, 128x128 w8 s3", PROMOTED, (128, 128, 32, 8, 3)),
            ("one dot per 128 of K, 128x128 w8 s3", UNPROMOTED, (128, 128, 128, 8, 3)),
        ):
            time(name, anatomy(mode, *shape))
        rows.append(row)
    return rows


GEMM_CONFIGS = [mx.GemmConfig((128, 64), 4, 4, step) for step in (1, 2, 4)] + [
    mx.GemmConfig((128, 128), 8, 3, 1), mx.GemmConfig((128, 128), 8, 3, 2), mx.GemmConfig((128, 128), 4, 3, 2),
    mx.GemmConfig((64, 128), 4, 4, 2), mx.GemmConfig((128, 64), 4, 3, 2), mx.GemmConfig((64, 64), 4, 4, 2),
    mx.GemmConfig((128, 256), 8, 3, 2),
]


def gemm_configs() -> list[dict]:
    rows = []
    for label, m, n, k in GEMM_SHAPES:
        a32, b32, a, b = _operands(m, n, k)
        a16, b16 = a32.bfloat16(), b32.bfloat16()
        want = mx.mxfp4_matmul_reference(a, b, torch.bfloat16).view(torch.int16)
        bf16_ms = _median_ms(lambda: torch.mm(a16, b16.T), DEVICE, 20)
        row = {"label": label, "shape": [m, n, k], "bf16_ms": bf16_ms, "configs": []}
        for config in GEMM_CONFIGS:
            exact = torch.equal(mx.mxfp4_matmul(a, b, torch.bfloat16, config=config).view(torch.int16), want)
            ms = _median_ms(lambda: mx.mxfp4_matmul(a, b, torch.bfloat16, config=config), DEVICE, 20)
            result = {"config": list(config), "ms": ms, "tflops": 2 * m * n * k / ms / 1e9, "vs_bf16": bf16_ms / ms, "exact": exact}
            print(label, result, flush=True)
            row["configs"].append(result)
        rows.append(row)
    return rows


ATTENTION_SHAPES = ((4, 12, 4, 4096, 64), (4, 8, 2, 4096, 128), (16, 12, 4, 1024, 64), (16, 8, 2, 1024, 128))
FORWARD_TILES = ((128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 32, 4, 4), (64, 64, 4, 4), (128, 64, 8, 4))
BACKWARD_TILES = ((32, 128, 128, 32, 4, 3), (64, 128, 128, 64, 8, 3), (32, 64, 64, 32, 4, 3), (64, 64, 64, 64, 4, 3),
                  (64, 64, 64, 64, 8, 2), (32, 64, 64, 32, 4, 2), (32, 128, 64, 32, 4, 4))


def attention_tiles() -> list[dict]:
    """Forward and backward kernels timed apart (torch.ops.fp4lab.flash_attention_*) beside SDPA's
    forward and forward + backward; a tile tuple is triton_attention._GPU_TILES's."""
    from fp4lab.numerics.kernels import attention as ta

    rows = []
    g = torch.Generator().manual_seed(0)
    for batch, heads, kv_heads, seq, head_dim in ATTENTION_SHAPES:
        q = torch.randn(batch, heads, seq, head_dim, generator=g).to(DEVICE, torch.bfloat16)
        k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=g).to(DEVICE, torch.bfloat16) for _ in range(2))
        grad = torch.randn_like(q)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def sdpa_both():
            out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
            torch.autograd.backward(out, grad)

        row = {
            "shape": [batch, heads, kv_heads, seq, head_dim],
            "sdpa_forward_ms": _median_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), DEVICE, 20),
            "sdpa_forward_backward_ms": _median_ms(sdpa_both, DEVICE, 20),
            "forward": [], "backward": [],
        }
        kept = ta._GPU_TILES[head_dim]
        try:
            for bm, bn, warps, stages in FORWARD_TILES:
                ta._GPU_TILES[head_dim] = (bm, bn, *kept[2:6], warps, stages)
                ms = _median_ms(lambda: torch.ops.fp4lab.flash_attention_forward(q, k, v, False), DEVICE, 20)
                row["forward"].append({"tile": [bm, bn, warps, stages], "ms": ms})
                print(row["shape"], "forward", row["forward"][-1], flush=True)
            ta._GPU_TILES[head_dim] = kept
            out, lse2, _, _ = torch.ops.fp4lab.flash_attention_forward(q, k, v, False)
            for m1, n1, m2, n2, warps, stages in BACKWARD_TILES:
                ta._GPU_TILES[head_dim] = (*kept[:2], m1, n1, m2, n2, warps, stages)
                ms = _median_ms(lambda: torch.ops.fp4lab.flash_attention_backward(grad, q, k, v, out, lse2, False), DEVICE, 20)
                row["backward"].append({"tile": [m1, n1, m2, n2, warps, stages], "ms": ms})
                print(row["shape"], "backward", row["backward"][-1], flush=True)
        finally:
            ta._GPU_TILES[head_dim] = kept
        rows.append(row)
    return rows


TILE_SHAPES = (("125m fprop w1", 16384, 2048, 768), ("125m dgrad w1", 16384, 768, 2048), ("350m fprop w1", 16384, 2816, 1024))
TILE_CONFIGS = [  # (tile, k_step, warps, stages); the first is the default
    ((128, 128), 64, 8, 3), ((128, 128), 128, 8, 3), ((128, 128), 128, 8, 2), ((128, 128), 64, 8, 4),
    ((128, 128), 64, 4, 4), ((128, 128), 32, 4, 4), ((128, 256), 64, 8, 3), ((256, 128), 64, 8, 3),
    ((128, 256), 128, 8, 2), ((256, 128), 128, 8, 2), ((128, 64), 64, 4, 4), ((64, 128), 64, 4, 4),
    ((128, 64), 128, 4, 3), ((128, 256), 64, 8, 4),
]


def tile_configs() -> list[dict]:
    """TileGemmConfig candidates for the chunk-scaled GEMM of 2D CTA-local NVFP4 weights, on the shapes
    `fp4lab bench gemm` times; "exact": the same bits as the default config (a larger k_step changes
    only how the tensor cores group each chunk's fp32 sum)."""
    from fp4lab.bench.kernels import tile_gemm_operands
    from fp4lab.numerics.kernels.tile_gemm import TileGemmConfig, tile_scaled_matmul

    rows = []
    for label, m, n, k in TILE_SHAPES:
        a16, b16, cells, cell, a_outer = tile_gemm_operands(m, n, k, DEVICE)
        bf16_ms = _median_ms(lambda: torch.mm(a16, b16.T), DEVICE, 20)
        run = lambda config: tile_scaled_matmul(a16, b16, cells, cell, a_outer, torch.bfloat16, config=config)  # noqa: E731
        want = run(TileGemmConfig(*TILE_CONFIGS[0])).view(torch.int16)
        row = {"label": label, "shape": [m, n, k], "bf16_ms": bf16_ms, "configs": []}
        for candidate in TILE_CONFIGS:
            config = TileGemmConfig(*candidate)
            try:
                exact = torch.equal(run(config).view(torch.int16), want)
                ms = _median_ms(lambda: run(config), DEVICE, 20)
            except Exception as error:  # a launch shape over the shared-memory or register budget
                result = {"config": list(candidate), "error": f"{type(error).__name__}: {str(error)[:120]}"}
            else:
                result = {"config": list(candidate), "ms": ms, "tflops": 2 * m * n * k / ms / 1e9, "vs_bf16": bf16_ms / ms, "exact": exact}
            print(label, result, flush=True)
            row["configs"].append(result)
        rows.append(row)
    return rows


SWEEPS = {"gemm-anatomy": gemm_anatomy, "gemm-configs": gemm_configs, "attention-tiles": attention_tiles,
          "tile-configs": tile_configs}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in SWEEPS:
        sys.exit(f"usage: python scripts/gpu_sweeps.py {{{'|'.join(SWEEPS)}}} OUT_DIR")
    if not torch.cuda.is_available():
        sys.exit("gpu_sweeps: needs CUDA (an NVIDIA GPU)")
    out = Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    results = SWEEPS[sys.argv[1]]()
    (out / f"{sys.argv[1]}.json").write_text(json.dumps(results, indent=1))
