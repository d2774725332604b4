"""Quantizer benchmarks: bytes moved per second, against a device-to-device copy of the same tensor.

Each case quantizes one [rows, cols] tensor (bf16, or fp32 for the 2D weight tiles of master weights)
into what a tensor-core GEMM reads: bf16 block values and the outer scale, for rows (along the last
dim), for x^T, or for both orientations from one read, optionally with packed codes and scale bytes,
or codes and scale bytes only (what the backward pass keeps). A decode case turns such codes and
scale bytes back into bf16 block values. On CUDA the fused Triton kernels run where they cover the
case, else (and on the CPU) the torch reference (`fake_quantize_factored`, after `hadamard` for H16;
`quantize` for codes only, `QTensor.factored` to decode). Bytes are those the fused kernel must move:
x read once per pass (NVFP4 reads x once more for its tensor amax), bf16 values written per
orientation unless codes only, codes (half a byte per element) and scale bytes when emitted; a
decode reads codes and scale bytes and writes bf16 values. The reference moves more through its
intermediates; it is timed on the same count. The copy reads and writes the bf16 tensor once each;
the ratio of the two rates is the figure of merit (1.0: as fast as a copy).

On CUDA every time is the median over `repeats` replays of a CUDA graph of several calls, so Python's
launch cost, which is of the order of a kernel's time at 8192 x 8192, is not counted.

`bench_mx_gemm` times the MXFP4 GEMM on FP8 tensor cores, `bench_tile_gemm` the chunk-scaled GEMM of 2D
CTA-local weights, each against a bf16 cuBLAS GEMM of the same shape (CUDA only), and reports the
throughput ratio.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from fp4lab.numerics import BLOCK_SIZE, fake_quantize_factored, hadamard, hadamard_signs, quantize


@dataclass(frozen=True)
class Case:
    """One benchmark case: options per orientation (quantize_fused's: fmt, scale_mode, adaptive,
    rounding, and `signs` as the Hadamard size)."""

    label: str
    row: dict | None = None  # quantized along the last dim
    col: dict | None = None  # quantized along the rows (the output is x^T)
    codes: bool = False
    values: bool = True  # False: codes and scale bytes only (with codes=True)
    decode: bool = False  # decode the row orientation's codes and scale bytes back to bf16 values
    tile: tuple[int, int] | None = None  # 2D weight tiles (row only)
    dtype: torch.dtype = torch.bfloat16

    @property
    def orientations(self) -> list[tuple[dict, bool]]:
        """(options, transpose) of each orientation quantized."""
        return [(o, t) for o, t in ((self.row, False), (self.col, True)) if o is not None]


def _cases() -> tuple[Case, ...]:
    variants = (("", {}), (" H16", {"signs": 16}), (" SR", {"rounding": "sr"}), (" H16 SR", {"signs": 16, "rounding": "sr"}))
    cases = []
    for fmt, base in (("mxfp4", {"fmt": "mxfp4", "scale_mode": "floor"}), ("nvfp4", {"fmt": "nvfp4"})):
        cases += [Case(f"{fmt}{suffix}", row=base | extra) for suffix, extra in variants]
        if fmt == "mxfp4":  # the CPU smoke test expects "mxfp4", "mxfp4 rceil" first
            cases.insert(1, Case("mxfp4 rceil", row=base | {"scale_mode": "rceil"}))
        cases.append(Case(f"{fmt} codes", row=base, codes=True))
        for suffix, extra in (variants[0], variants[3]):
            cases.append(Case(f"{fmt}{suffix} x^T", col=base | extra))
            cases.append(Case(f"{fmt}{suffix} both", row=base | extra, col=base | extra))
        if fmt == "mxfp4":  # the backward pass's packed x^T, and its decode for the GEMM
            cases.append(Case("mxfp4 x^T codes only", col=base, codes=True, values=False))
            cases.append(Case("mxfp4 decode", row=base, decode=True))
    cases.append(Case("nvfp4 16x16 tiles fp32", row={"fmt": "nvfp4"}, tile=(16, 16), dtype=torch.float32))
    cases.append(Case("mxfp4 rceil adaptive 32x32 tiles fp32", row={"fmt": "mxfp4", "scale_mode": "rceil", "adaptive": True},
                      tile=(32, 32), dtype=torch.float32))  # fmt: skip
    return tuple(cases)


CASES = _cases()


@dataclass(frozen=True)
class KernelBench:
    case: str
    implementation: str  # "triton" or "torch reference"
    rows: int
    cols: int
    device: str
    ms: float
    gb_per_s: float
    copy_gb_per_s: float

    @property
    def fraction_of_copy(self) -> float:
        return self.gb_per_s / self.copy_gb_per_s

    def as_dict(self) -> dict:
        return asdict(self) | {"fraction_of_copy": self.fraction_of_copy}


def bench_kernels(
    rows: int, cols: int, device: torch.device, repeats: int = 20, on_result: Callable[[KernelBench], None] | None = None
) -> list[KernelBench]:
    x32 = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(device=device)
    inputs = {torch.float32: x32, torch.bfloat16: x32.to(torch.bfloat16)}
    x = inputs[torch.bfloat16]
    copy_moved = 2 * x.numel() * x.element_size()
    copy_ms = _median_ms(lambda out=torch.empty_like(x): out.copy_(x), device, repeats)
    copy_rate = copy_moved / copy_ms / 1e6
    results = []
    for case in CASES:
        x = inputs[case.dtype]
        quantizer, implementation = _quantizer(case, x)
        ms = _median_ms(lambda: quantizer(x), device, repeats)
        result = KernelBench(case.label, implementation, rows, cols, str(device), ms, _bytes(case, x) / ms / 1e6, copy_rate)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _bytes(case: Case, x: torch.Tensor) -> int:
    n = x.numel()
    packed = {}  # codes and scale bytes per orientation
    for options, transpose in case.orientations:
        per_scale = case.tile[0] * case.tile[1] if case.tile else BLOCK_SIZE[options["fmt"]]
        packed[transpose] = n // 2 + n // per_scale
    if case.decode:
        return packed[False] + 2 * n
    passes = 1 + any(o["fmt"] == "nvfp4" for o, _ in case.orientations)
    written = 0
    for _, transpose in case.orientations:
        written += (2 * n if case.values else 0) + (packed[transpose] if case.codes else 0)
    return passes * n * x.element_size() + written


def _materialize(options: dict, case: Case, device: torch.device) -> dict:
    options = dict(options, emit_codes=case.codes or case.decode, emit_values=case.values and not case.decode)
    if "signs" in options:
        options["signs"] = hadamard_signs(options["signs"], "fixed").to(device)
    if options.get("rounding") == "sr":
        options["seed"] = torch.zeros(1, dtype=torch.int64, device=device)
    if case.tile is not None:
        options["tile"] = case.tile
    return options


def _quantizer(case: Case, x: torch.Tensor) -> tuple[Callable, str]:
    """The fused kernel where it covers the case (checked by one call: unsupported options raise
    ValueError), else the torch reference."""
    from fp4lab.train.paths import gpu_kernels_run

    if gpu_kernels_run(x.device):
        from fp4lab.numerics.kernels.quantize import decode_fused, quantize_fused, quantize_fused_both

        opts = [_materialize(o, case, x.device) for o, _ in case.orientations]
        if len(opts) == 2:
            fused = lambda x: quantize_fused_both(x, opts[0], opts[1])  # noqa: E731
        else:
            fused = lambda x: quantize_fused(x, transpose=case.row is None, **opts[0])  # noqa: E731
        try:
            if case.decode:  # the codes are made once, outside the timing
                q = fused(x)
                fused = lambda x: decode_fused(q.codes, q.scales, fmt=opts[0]["fmt"], shape=tuple(x.shape), tile=case.tile)  # noqa: E731
            fused(x)
            return fused, "triton"
        except ValueError:
            pass
    return _reference(case, x), "torch reference"


def _reference(case: Case, x: torch.Tensor) -> Callable:
    device = x.device
    generator = torch.Generator(device=device).manual_seed(0)
    specs = []
    for options, transpose in case.orientations:
        options = dict(options)
        size = options.pop("signs", 0)
        signs = hadamard_signs(size, "fixed").to(device) if size else None
        if options.get("rounding") == "sr":
            options["generator"] = generator
        if case.tile is not None:
            options["tile"] = case.tile
        specs.append((options.pop("fmt"), options, size, signs, transpose))

    def reference(x: torch.Tensor):
        outs = []
        for fmt, options, size, signs, transpose in specs:
            y = x.to(torch.float32)
            y = y.T.contiguous() if transpose else y
            y = hadamard(y, size, signs) if size else y
            if case.values:
                outs.append(fake_quantize_factored(y, fmt, **options).values.to(torch.bfloat16))
            else:
                q = quantize(y, fmt, **options)
                outs.append((q.data, q.scales))
        return outs

    if case.decode:
        fmt, options, size, signs, _ = specs[0]
        y = x.to(torch.float32)
        q = quantize(hadamard(y, size, signs) if size else y, fmt, **options)
        return lambda x: q.factored().values.to(torch.bfloat16)
    return reference


@dataclass(frozen=True)
class GemmBench:
    """An FP4 GEMM kernel (the MXFP4 GEMM on FP8 tensor cores, `numerics.kernels.mx_gemm`, or the
    chunk-scaled GEMM of CTA-local weights, `numerics.kernels.tile_gemm`; bf16 out) against a bf16 cuBLAS
    GEMM of the same [m, k] x [n, k]^T shape (bf16 out), each timed as the quantizers are. The
    operands are quantized once, outside the timing."""

    case: str
    m: int
    n: int
    k: int
    device: str
    ms: float
    bf16_ms: float

    @property
    def tflops(self) -> float:
        return 2 * self.m * self.n * self.k / self.ms / 1e9

    @property
    def bf16_tflops(self) -> float:
        return 2 * self.m * self.n * self.k / self.bf16_ms / 1e9

    @property
    def throughput_vs_bf16(self) -> float:
        """Above 1: the FP4 GEMM outruns bf16 (at most 1.83 on an H200, FP8's peak over bf16's)."""
        return self.bf16_ms / self.ms

    def as_dict(self) -> dict:
        return asdict(self) | {"tflops": self.tflops, "bf16_tflops": self.bf16_tflops, "throughput_vs_bf16": self.throughput_vs_bf16}


def bench_mx_gemm(m: int, n: int, k: int, device: torch.device, repeats: int = 20, label: str = "") -> GemmBench | None:
    """Time `mxfp4_matmul` against `torch.mm` in bf16 on one shape; None off CUDA or without Triton (the
    kernel is CUDA only). k must be a multiple of 32."""
    from fp4lab.train.paths import gpu_kernels_run

    if not gpu_kernels_run(device):
        return None
    from fp4lab.numerics.kernels.mx_gemm import mxfp4_matmul

    g = torch.Generator().manual_seed(0)
    a32, b32 = (torch.randn(rows, k, generator=g).to(device) for rows in (m, n))
    a, b = quantize(a32, "mxfp4"), quantize(b32, "mxfp4")
    a16, b16 = a32.to(torch.bfloat16), b32.to(torch.bfloat16)
    ms = _median_ms(lambda: mxfp4_matmul(a, b, torch.bfloat16), device, repeats)
    bf16_ms = _median_ms(lambda: torch.mm(a16, b16.T), device, repeats)
    return GemmBench(label or f"{m}x{n}x{k}", m, n, k, str(device), ms, bf16_ms)


def bench_tile_gemm(m: int, n: int, k: int, device: torch.device, repeats: int = 20, label: str = "") -> GemmBench | None:
    """Time the chunk-scaled GEMM of a 2D CTA-local NVFP4 weight (`numerics.kernels.tile_gemm`, 128 x 128
    squares, a per-row a outer scale, bf16 out) against `torch.mm` in bf16 on one shape; None off CUDA
    or without Triton. The operands are quantized once, outside the timing."""
    from fp4lab.train.paths import gpu_kernels_run

    if not gpu_kernels_run(device):
        return None
    from fp4lab.numerics.kernels.tile_gemm import tile_scaled_matmul

    a16, b16, cells, cell, a_outer = tile_gemm_operands(m, n, k, device)
    ms = _median_ms(lambda: tile_scaled_matmul(a16, b16, cells, cell, a_outer, torch.bfloat16), device, repeats)
    bf16_ms = _median_ms(lambda: torch.mm(a16, b16.T), device, repeats)
    return GemmBench(label or f"{m}x{n}x{k}", m, n, k, str(device), ms, bf16_ms)


def tile_gemm_operands(m: int, n: int, k: int, device: torch.device) -> tuple:
    """`tile_scaled_matmul`'s operands for one shape, from seeded Gaussians: a [m, k] NVFP4 with CTA-local
    row scales, b [n, k] a 2D CTA-local weight (16 x 16 tiles, 128 x 128 squares); (a values, b values,
    b's square scales, the square side, a's outer scales)."""
    from fp4lab.numerics import fake_quantize_factored

    g = torch.Generator().manual_seed(0)
    a32, b32 = (torch.randn(rows, k, generator=g).to(device) for rows in (m, n))
    a = fake_quantize_factored(a32, "nvfp4_cta")
    b = fake_quantize_factored(b32, "nvfp4_cta", tile=(16, 16))
    return a.values.to(torch.bfloat16), b.values.to(torch.bfloat16), b.outer, b.outer_cell, a.outer


_CALLS_PER_GRAPH = 10


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    if device.type == "cuda":
        graph = _capture(fn)
        if graph is not None:
            return _cuda_median_ms(graph.replay, repeats) / _CALLS_PER_GRAPH
        return _cuda_median_ms(fn, repeats)
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append((time.perf_counter() - tic) * 1e3)
    return statistics.median(times)


def _capture(fn) -> torch.cuda.CUDAGraph | None:
    """A CUDA graph of _CALLS_PER_GRAPH calls of fn, or None where fn cannot be captured (some
    reference paths)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn()  # warm-up on a side stream, as capture requires
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(_CALLS_PER_GRAPH):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph
    except RuntimeError:
        torch.cuda.synchronize()
        return None


def _cuda_median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def training_gemm_shapes(model: str, batch_size: int, seq_len: int) -> list[tuple[str, int, int, int]]:
    """(label, m, n, k) of the largest linears' GEMMs in one training step of `model` at batch_size x
    seq_len tokens (C [m, n] = A [m, k] @ B [n, k]^T): w1's Fprop, Dgrad and Wgrad, and wq's Fprop."""
    from fp4lab.nn.model_config import preset

    config = preset(model, 32768, seq_len)
    tokens, dim, hidden = batch_size * seq_len, config.dim, config.ffn_hidden
    return [
        (f"{model} w1 Fprop", tokens, hidden, dim),
        (f"{model} w1 Dgrad", tokens, dim, hidden),
        (f"{model} w1 Wgrad", hidden, dim, tokens),
        (f"{model} wq Fprop", tokens, dim, dim),
    ]
