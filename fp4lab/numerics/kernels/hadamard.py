"""The full-dimension random Hadamard transform in one Triton kernel: `numerics.hadamard.hadamard_full`
bit for bit.

The reference runs its butterfly as log2(N) pairs of strided torch ops over the whole tensor (28 passes
through memory for the N = 16384 tokens of a 125m Wgrad operand, each a separate launch). Here one
program holds whole rows of the zero-padded [R, N] result in registers and does every stage there:
the signs (exact), then for h = 1, 2, 4, ... each pair (a, b) at distance h inside a group of 2h becomes
(a + b, a - b) in float32, then one multiply by float32(1 / sqrt(N)); `inverse` runs the butterfly
first and the signs after, as the reference does. The same float32 operations on the same values in
the same order, so the same bits (no FMA contraction: `enable_fp_fusion=False`).

A row lives in one program, so N is bounded by the registers: up to `MAX_LENGTH` (16384, the Wgrad
operands of 16 x 1024 tokens); callers fall back to the reference beyond it (`fits`).

Import lazily, after `fp4lab.numerics.kernels.runs_on(device)`.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from fp4lab.numerics.kernels.quantize import _finite_row_amax, _fp32

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
MAX_LENGTH = 16384
_ELEMENTS_PER_PROGRAM = 4096  # rows per program = this // N (at least one)


def fits(n: int) -> bool:
    """Whether the kernel takes a padded length `n` (a power of two up to MAX_LENGTH)."""
    return 1 <= n <= MAX_LENGTH and n & (n - 1) == 0


@triton.jit
def _butterfly(y, BR: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """Every stage h = 1, 2, ..., N / 2 on the [BR, N] float32 rows: (a, b) -> (a + b, a - b)."""
    for stage in tl.static_range(LOG2N):  # h = 2^stage
        pairs = tl.permute(tl.reshape(y, [BR * N // (2 << stage), 2, 1 << stage]), (0, 2, 1))  # (a, b) last
        a, b = tl.split(pairs)
        y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [BR, N])
    return y


@triton.jit
def _hadamard_full_kernel(
    x_ptr, signs_ptr, out_ptr, amax_ptr, R, L, stride_r, stride_c, scale,
    BR: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr, INVERSE: tl.constexpr, AMAX: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, N)
    inside = (rows < R)[:, None] & (cols < L)[None, :]
    offsets = rows.to(tl.int64)[:, None] * stride_r + cols.to(tl.int64)[None, :] * stride_c
    y = tl.load(x_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    signs = tl.load(signs_ptr + cols)[None, :]
    if not INVERSE:
        y = y * signs
    y = _butterfly(y, BR, N, LOG2N)
    if INVERSE:
        y = y * signs
    y = y * _fp32(scale)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * N + cols[None, :], y, mask=(rows < R)[:, None])
    if AMAX:  # rows past R hold zeros: no effect; non-negative floats order as their bits do
        tl.atomic_max(amax_ptr, tl.max(_finite_row_amax(y, None, BR, N, 0), axis=0).to(tl.int32, bitcast=True))


def hadamard_full_fused(x: torch.Tensor, signs: torch.Tensor, *, inverse: bool = False, with_amax: bool = False):
    """`hadamard_full(x, signs, inverse=inverse)` of a 2D float tensor x [R, L] on a CUDA device (or
    the CPU under Triton's interpreter): the [R, N] float32 transform of its rows zero-padded to
    N = signs.numel() (`fits(N)`, N >= L), bit for bit. x may be any strided view, e.g. the transpose
    of a contiguous [L, R] tensor, read in place without a transposed copy.

    with_amax (N a multiple of 16): also the NVFP4 tensor amax of the result (`quantize.finite_amax`
    of it with 1x16 blocks: the max over its finite blocks), a 0-dim float32 tensor taken while the
    kernel writes: (transform, amax). Passed to the fused quantizer as `tensor_amax`, it spares that
    kernel its own read of the transform for the amax."""
    n = signs.numel() if isinstance(signs, torch.Tensor) else 0
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point() or x.numel() == 0:
        raise ValueError(f"hadamard_full_fused: x must be a non-empty 2D float tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not fits(n) or n < x.shape[1]:
        raise ValueError(f"hadamard_full_fused: signs must hold N values, N a power of two in [{x.shape[1]}, {MAX_LENGTH}]; "
                         f"got {n} (use numerics.hadamard_full beyond)")
    if not (x.is_cuda or _INTERPRETED and x.device.type == "cpu"):
        raise ValueError(f"hadamard_full_fused: x is on {x.device}; use a CUDA tensor (or numerics.hadamard_full)")
    if with_amax and n % 16:
        raise ValueError(f"hadamard_full_fused: with_amax needs N a multiple of 16 (NVFP4 blocks), got {n}")
    rows, length = x.shape
    out = torch.empty((rows, n), dtype=torch.float32, device=x.device)
    amax = torch.zeros(1, dtype=torch.int32, device=x.device) if with_amax else None
    br = max(1, _ELEMENTS_PER_PROGRAM // n)
    _hadamard_full_kernel[(triton.cdiv(rows, br),)](
        x, signs.to(device=x.device, dtype=torch.float32).contiguous(), out, amax, rows, length, x.stride(0), x.stride(1), 1.0 / math.sqrt(n),
        BR=br, N=n, LOG2N=n.bit_length() - 1, INVERSE=inverse, AMAX=with_amax,
        num_warps=16 if n >= 8192 else 8 if n >= 2048 else 4, enable_fp_fusion=False,
    )  # fmt: skip
    return (out, amax.view(torch.float32)[0]) if with_amax else out
