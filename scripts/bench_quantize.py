"""Throughput of the fused Triton quantizers (fp4lab.numerics.triton_quantize) on one CUDA GPU.

For each case: the median kernel time (triton.testing.do_bench), the bytes read plus written per
second (x read once per pass: NVFP4 takes a second pass for its tensor amax; bf16 values written per
orientation, plus packed codes and scale bytes with --codes), and that as a fraction of a torch
device-to-device copy of the same tensor timed in the same run.

    python scripts/bench_quantize.py [--shape 8192x8192] [--codes] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fp4lab.numerics import hadamard_signs  # noqa: E402
from fp4lab.numerics.triton_quantize import BLOCK, quantize_fused, quantize_fused_both  # noqa: E402

# name -> (options per orientation: one dict for quantize_fused, two for quantize_fused_both, transpose)
TRANSFORMS = {"": {}, "+h16": {"signs": 16}, "+sr": {"rounding": "sr"}, "+h16+sr": {"signs": 16, "rounding": "sr"}}
CASES = {}
for fmt in ("mxfp4", "nvfp4"):
    for suffix, extra in TRANSFORMS.items():
        CASES[f"{fmt}{suffix}"] = ([dict(fmt=fmt, **extra)], False)
    for suffix in ("", "+h16+sr"):
        CASES[f"{fmt}{suffix} x^T"] = ([dict(fmt=fmt, **TRANSFORMS[suffix])], True)
        CASES[f"{fmt}{suffix} both"] = ([dict(fmt=fmt, **TRANSFORMS[suffix])] * 2, None)


def _materialize(options: dict, device, codes: bool) -> dict:
    options = dict(options, emit_codes=codes)
    if "signs" in options:
        options["signs"] = hadamard_signs(options["signs"], "fixed").to(device)
    if options.get("rounding") == "sr":
        options["seed"] = torch.tensor([1], dtype=torch.int64, device=device)
    return options


def _bytes(x: torch.Tensor, orientations: list[dict], codes: bool) -> int:
    n = x.numel()
    passes = 1 + any(o["fmt"] == "nvfp4" for o in orientations)  # the amax pass reads x once more
    written = sum(2 * n + (n // 2 + n // BLOCK[o["fmt"]] if codes else 0) for o in orientations)
    return passes * n * x.element_size() + written


def _median_ms(fn) -> float:
    """Median time of fn replayed from a CUDA graph: the kernels alone, without Python's launch cost."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="8192x8192")
    parser.add_argument("--codes", action="store_true", help="also write packed codes and scale bytes")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows, cols = (int(n) for n in args.shape.split("x"))
    x = torch.randn(rows, cols, device="cuda", dtype=torch.bfloat16)
    copy_out = torch.empty_like(x)
    copy_ms = _median_ms(lambda: copy_out.copy_(x))
    copy_tbps = 2 * x.numel() * x.element_size() / copy_ms / 1e9
    results = [{"case": "torch copy", "ms": copy_ms, "tb_per_s": copy_tbps, "of_copy": 1.0}]
    for name, (orientations, transpose) in CASES.items():
        opts = [_materialize(o, x.device, args.codes) for o in orientations]
        if transpose is None:
            run = lambda opts=opts: quantize_fused_both(x, opts[0], opts[1])  # noqa: E731
        else:
            run = lambda opts=opts, transpose=transpose: quantize_fused(x, transpose=transpose, **opts[0])  # noqa: E731
        ms = _median_ms(run)
        tbps = _bytes(x, opts, args.codes) / ms / 1e9
        results.append({"case": name, "ms": ms, "tb_per_s": tbps, "of_copy": tbps / copy_tbps})
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"{torch.cuda.get_device_name()}, x {rows}x{cols} bf16, codes {'on' if args.codes else 'off'}")
    print(f"{'case':22s} {'ms':>8s} {'TB/s':>7s} {'of copy':>8s}")
    for r in results:
        print(f"{r['case']:22s} {r['ms']:8.4f} {r['tb_per_s']:7.3f} {r['of_copy']:8.1%}")


if __name__ == "__main__":
    main()
