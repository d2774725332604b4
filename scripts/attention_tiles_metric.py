"""The kernel ratchet's measurement (sweeps/attention_tiles.md): the fused-probe Triton attention's
forward + backward time at head dim 64 (the models' heads), summed over `fp4lab bench attention`'s
head-dim-64 shapes, printed as `attention_ms: X`, but only after the attention kernel's CUDA tests pass
(a launch configuration that computes wrong results is never measured, so never kept).

Run by `fp4lab ratchet` in its worktree, with the worktree first on PYTHONPATH: the code measured is
the proposal's. Exit 1 without a metric when the tests fail; 2 without CUDA.
"""

from __future__ import annotations

import json
import subprocess
import sys

TESTS = ["tests/kernels/test_triton_attention.py", "tests/nn/test_attention_kernel.py"]
HEAD_DIM = 64


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("attention_tiles_metric: needs a CUDA device (the kernel's launch configuration is what it measures)", file=sys.stderr)
        return 2
    tests = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-x", "-p", "no:cacheprovider", "-o", "addopts=", *TESTS],
                           capture_output=True, text=True)  # fmt: skip
    if tests.returncode != 0:
        tail = (tests.stdout + tests.stderr).strip().splitlines()[-1:] or ["no output"]
        print(f"attention_tiles_metric: the attention kernel's CUDA tests fail: {tail[0]}", file=sys.stderr)
        return 1
    bench = subprocess.run([sys.executable, "-m", "fp4lab.cli", "bench", "attention", "--json"], capture_output=True, text=True)
    if bench.returncode != 0:
        print(f"attention_tiles_metric: fp4lab bench attention failed ({bench.returncode}): {bench.stderr.strip()[-300:]}", file=sys.stderr)
        return 1
    shapes = [a for a in json.loads(bench.stdout)["attention"] if a["head_dim"] == HEAD_DIM]
    if not shapes:
        print("attention_tiles_metric: fp4lab bench attention timed no head-dim-64 shape", file=sys.stderr)
        return 1
    for a in shapes:
        print(f"  {a['batch']} x {a['seq']}, {a['heads']} heads of {a['head_dim']}: {a['fused_ms']:.4f} ms (SDPA {a['sdpa_ms']:.4f})")
    print(f"attention_ms: {sum(a['fused_ms'] for a in shapes):.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
