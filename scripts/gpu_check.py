"""GPU check and benchmark for fp4lab (run on a CUDA machine; see docs/BENCHMARKS.md).

  python scripts/gpu_check.py numerics            # CPU vs CUDA encodings, bit for bit; quantizer speed
  python scripts/gpu_check.py train --recipes bf16,nvfp4 --model 125m --steps 300 --out runs-gpu

`numerics` prints JSON: for every format and scale mode, how many bytes of codes, scales and tensor
scales differ between the CPU reference and the same code on CUDA (expected: 0), and the quantizer's
throughput on a 8192 x 8192 tensor. `train` runs fp4lab's training loop on CUDA for each recipe and
prints one JSON summary per recipe (tokens/s, final train and validation loss).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from fp4lab.numerics import fake_quantize, quantize

CASES = [
    ("nvfp4", {}),
    ("nvfp4", {"tile": (16, 16)}),
    ("nvfp4_cta", {}),
    ("nvfp4_cta", {"tile": (16, 16)}),
    ("mxfp4", {"scale_mode": "floor"}),
    ("mxfp4", {"scale_mode": "ceil"}),
    ("mxfp4", {"scale_mode": "even"}),
    ("mxfp4", {"scale_mode": "rceil"}),
    ("mxfp4", {"scale_mode": "rceil", "adaptive": True, "tile": (32, 32)}),
]


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    normal = torch.randn(1024, 2048, generator=g)
    wide = normal * torch.exp2(torch.randint(-30, 10, (1024, 128), generator=g).float()).repeat_interleave(16, 1)
    student = normal / torch.sqrt(torch.randn(1024, 2048, 3, generator=g).pow(2).sum(-1) / 3)
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 0.0, -0.0])
    ties = (grid.repeat(1024 * 2048 // len(grid) + 1)[: 1024 * 2048] * torch.exp2(torch.randint(-8, 8, (1,), generator=g).float())).reshape(1024, 2048)
    return {"normal": normal, "wide": wide, "student_t": student, "ties": ties}


def check_numerics() -> dict:
    results = []
    for name, x in inputs().items():
        for fmt, options in CASES:
            cpu = quantize(x, fmt, **options)
            gpu = quantize(x.cuda(), fmt, **options)
            fake = fake_quantize(x.cuda(), fmt, **options)
            row = {
                "input": name,
                "format": fmt,
                "options": {k: str(v) for k, v in options.items()},
                "code_bytes_differ": int((cpu.data != gpu.data.cpu()).sum()),
                "scale_bytes_differ": int((cpu.scales != gpu.scales.cpu()).sum()),
                "tensor_scale_differ": 0 if cpu.tensor_scale is None else int((cpu.tensor_scale != gpu.tensor_scale.cpu()).sum()),
                "fake_differs_from_dequantize": int((fake != gpu.dequantize()).sum()),
            }
            results.append(row)
    mismatched = [r for r in results if any(v for k, v in r.items() if k.endswith("differ") or k.startswith("fake"))]
    return {"cases": len(results), "mismatched": mismatched, "speed": quantizer_speed()}


def quantizer_speed() -> list[dict]:
    x = torch.randn(8192, 8192, device="cuda")
    rows = []
    for fmt, options in CASES[:1] + CASES[4:5] + [("nvfp4", {"rounding": "sr"})]:
        for name, fn in (("quantize", quantize), ("fake_quantize", fake_quantize)):
            for _ in range(3):
                fn(x, fmt, **options)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn(x, fmt, **options)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end) / 10
            rows.append({"fn": name, "format": fmt, "options": options, "ms": round(ms, 3), "input_GB_per_s": round(x.numel() * 4 / ms / 1e6, 1)})
    return rows


def train(recipes: list[str], model: str, steps: int, batch: int, seq: int, out: str) -> list[dict]:
    from fp4lab.train.config import TrainConfig
    from fp4lab.train.loop import run

    summaries = []
    for recipe in recipes:
        config = TrainConfig(
            recipe=recipe, model=model, steps=steps, batch_size=batch, seq_len=seq, device="cuda",
            adam_lr=3e-3, warmup_steps=max(1, steps // 10), eval_every=max(1, steps // 4), eval_batches=8,
            probe_every=max(1, steps // 4), checkpoint_every=steps, out_dir=f"{out}/{recipe}",
        )
        tic = time.time()
        summary = run(config, progress=False)
        summary["wall_seconds"] = round(time.time() - tic, 1)
        summaries.append(summary)
        print(json.dumps(summary), flush=True)
    return summaries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("numerics", "train"))
    parser.add_argument("--recipes", default="bf16,nvfp4,mxfp4-rowsr-h32")
    parser.add_argument("--model", default="125m")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--out", default="runs-gpu")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here")
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__}), flush=True)
    if args.what == "numerics":
        print(json.dumps(check_numerics(), indent=1), flush=True)
    else:
        train(args.recipes.split(","), args.model, args.steps, args.batch_size, args.seq_len, args.out)


if __name__ == "__main__":
    main()
