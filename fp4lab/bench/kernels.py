"""Quantizer benchmarks: bytes moved per second, against a device-to-device copy of the same tensor.

Each case quantizes one [rows, cols] bf16 tensor along its last dim into what a tensor-core GEMM
reads (bf16 block values and the outer scale) with the fused Triton kernel where it exists (CUDA),
else with the torch reference (`fake_quantize_factored`, and `hadamard` first for H16). Bytes are
those the kernel must move: the bf16 input read once, the bf16 values written (the reference moves
more, through its intermediates; it is timed on the same count). The copy reads and writes the same
tensor once each; the ratio of the two rates is the figure of merit (1.0: as fast as a copy).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from fp4lab.numerics import fake_quantize_factored, hadamard, hadamard_signs

# (label, format, options, Hadamard size or 0)
CASES = (
    ("mxfp4", "mxfp4", {"scale_mode": "floor"}, 0),
    ("mxfp4 rceil", "mxfp4", {"scale_mode": "rceil"}, 0),
    ("mxfp4 H16", "mxfp4", {"scale_mode": "floor"}, 16),
    ("mxfp4 SR", "mxfp4", {"scale_mode": "floor", "rounding": "sr"}, 0),
    ("nvfp4", "nvfp4", {}, 0),
    ("nvfp4 H16", "nvfp4", {}, 16),
    ("nvfp4 SR", "nvfp4", {"rounding": "sr"}, 0),
    ("nvfp4 H16 SR", "nvfp4", {"rounding": "sr"}, 16),
)


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
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=torch.bfloat16)
    moved = 2 * x.numel() * x.element_size()  # read the input, write bf16 values of the same size
    copy_ms = _median_ms(lambda out=torch.empty_like(x): out.copy_(x), device, repeats)
    copy_rate = moved / copy_ms / 1e6
    results = []
    for label, fmt, options, size in CASES:
        quantizer, implementation = _quantizer(fmt, options, size, device)
        ms = _median_ms(lambda: quantizer(x), device, repeats)
        result = KernelBench(label, implementation, rows, cols, str(device), ms, moved / ms / 1e6, copy_rate)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


def _quantizer(fmt: str, options: dict, size: int, device: torch.device):
    generator = torch.Generator(device=device).manual_seed(0)
    signs = hadamard_signs(size, "fixed").to(device) if size else None
    if device.type == "cuda":
        from fp4lab.numerics.fast import triton_available

        if triton_available():
            from fp4lab.numerics.triton_quantize import quantize_fused

            seed = torch.zeros(1, dtype=torch.int64, device=device)
            return (lambda x: quantize_fused(x, fmt=fmt, signs=signs, seed=seed, **options)), "triton"

    def reference(x: torch.Tensor):
        t = hadamard(x.to(torch.float32), size, signs) if size else x
        sr = {"generator": generator} if options.get("rounding") == "sr" else {}
        return fake_quantize_factored(t, fmt, **options, **sr).values.to(torch.bfloat16)

    return reference, "torch reference"


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            tic = time.perf_counter()
            fn()
            times.append((time.perf_counter() - tic) * 1e3)
    return statistics.median(times)
