"""Blockwise Walsh-Hadamard transforms with a sign diagonal (fixed-sign H16/H32, or random: RHT).

Each block of `size` elements along the last dim is multiplied by R = diag(signs) @ H / sqrt(size),
H the Sylvester-ordered Hadamard matrix. R is orthonormal, so applying it to both operands of a
GEMM along their shared contraction dim leaves the product unchanged: (A R)(B R)^T = A B^T.
`hadamard_full` is the same transform over the whole (zero-padded) last dim.

`hadamard` computes the product as a fast Walsh-Hadamard butterfly in a fixed order of float32
operations (not as a matrix product, whose summation order depends on the BLAS), so a GPU kernel
that performs the same operations (fp4lab.numerics.kernels.quantize) reproduces it bit for bit.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
import torch.nn.functional as F

HADAMARD_SIZES = (16, 32, 64, 128)
SIGN_KINDS = ("fixed", "random", "none")

# TransformerEngine's wgrad sign vector (get_wgrad_sign_vector; kernel mask 0xD7E8), shared by every
# layer; the NVFP4 paper's "single random sign vector". Longer transforms repeat it.
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


@lru_cache(maxsize=None)
def _sylvester(size: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


def hadamard_signs(size: int, kind: str = "fixed", generator: torch.Generator | None = None) -> torch.Tensor:
    """A float32 +-1 sign vector of length `size`: "fixed" (TE's, repeated), "random" (drawn from
    `generator`: draw once and pass the same vector to both GEMM operands) or "none" (all +1). `size`
    is a block size of HADAMARD_SIZES, or for "random" and "none" any power of two (`hadamard_full`)."""
    if kind == "fixed" or not _is_power_of_two(size):
        _check_size(size)
    if kind == "fixed":
        return torch.tensor(TE_SIGNS, dtype=torch.float32).repeat(size // len(TE_SIGNS))
    if kind == "random":
        device = generator.device if generator is not None else "cpu"
        bits = torch.randint(0, 2, (size,), generator=generator, device=device)
        return (1 - 2 * bits).to(torch.float32)
    if kind == "none":
        return torch.ones(size)
    raise ValueError(f"hadamard_signs: kind={kind!r} is not supported; allowed: {', '.join(map(repr, SIGN_KINDS))}")


def hadamard_matrix(size: int, signs: torch.Tensor | str = "fixed") -> torch.Tensor:
    """R = diag(signs) @ H_size / sqrt(size) as float32 (rows are scaled by the signs)."""
    _check_size(size)
    return (_sign_vector(size, signs, torch.device("cpu"))[:, None] * _sylvester(size)) / math.sqrt(size)


@lru_cache(maxsize=None)
def named_signs_on(size: int, kind: str, device: torch.device) -> torch.Tensor:
    """`hadamard_signs(size, kind)` ("fixed" or "none") on `device`, copied there once. A copy from host
    memory per call would make the host wait for the GPU (a blocking copy synchronises the stream:
    the NVFP4 Adam v's decode did it for every parameter and step), and a CUDA graph's capture
    refuses it."""
    return hadamard_signs(size, kind).to(device)


def _sign_vector(size: int, signs: torch.Tensor | str, device: torch.device) -> torch.Tensor:
    if isinstance(signs, str):
        if signs == "random":
            raise ValueError(
                "hadamard: draw random signs once with hadamard_signs(size, 'random', generator) and pass "
                "the same tensor for both GEMM operands"
            )
        if signs not in ("fixed", "none"):
            raise ValueError(
                f"hadamard: signs={signs!r} is not supported; allowed: 'fixed', 'none' or a tensor of {size} "
                "values in {-1, +1} (see hadamard_signs)"
            )
        return named_signs_on(size, signs, torch.device(device))
    return _check_signs(signs, size).to(device=device, dtype=torch.float32)


def hadamard(x: torch.Tensor, size: int, signs: torch.Tensor | str = "fixed", *, inverse: bool = False) -> torch.Tensor:
    """Apply R (or R^T with inverse=True) to every block of `size` along the last dim of x.

    Computed in float32 and returned in x's dtype (a bf16 input is rounded once, as TE's RHT is). The
    exact sequence, which fused kernels replicate: multiply by the signs (exact), log2(size) butterfly
    stages h = 1, 2, 4, ... that replace each pair (a, b) at distance h inside a group of 2h by
    (a + b, a - b), then one multiply by float32(1 / sqrt(size)). inverse=True: the butterfly first,
    then the signs, then the scale (R^T = H diag(signs) / sqrt(size), H being symmetric).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError("hadamard: x must be a floating-point torch.Tensor")
    _check_size(size)
    if x.dim() == 0 or x.shape[-1] % size:
        raise ValueError(
            f"hadamard: the last dim of x (shape {list(x.shape)}) must be a multiple of size={size}"
        )
    s = _sign_vector(size, signs, x.device)
    return _butterfly(x.to(torch.float32), size, s, inverse).reshape(x.shape).to(x.dtype)


def hadamard_full(x: torch.Tensor, signs: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """The full-dimension random Hadamard transform U = diag(signs) H_N / sqrt(N) (OptiTrain-FP4's
    "pad to power of 2 & multiply by U = 1/sqrt(N) * H * D"): x's last dim is zero-padded to
    N = signs.numel(), a power of two, and every row of N is transformed by the butterfly of `hadamard`
    (the same float32 operations, so for N in HADAMARD_SIZES the two agree bit for bit). Returns the
    padded [..., N] result in float32; the zeros add nothing to a product of two operands transformed
    with the same signs. inverse=True applies U^T and keeps the N columns (slice off the padding)."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise ValueError("hadamard_full: x must be a floating-point torch.Tensor with at least one dim")
    n = signs.numel() if isinstance(signs, torch.Tensor) else 0
    if not _is_power_of_two(n) or n < x.shape[-1]:
        raise ValueError(
            f"hadamard_full: signs must be a vector of N values +-1, N a power of two >= the last dim of x "
            f"({x.shape[-1]}); draw it with hadamard_signs(N, 'random', generator)"
        )
    s = _check_signs(signs, n).to(device=x.device, dtype=torch.float32)
    y = F.pad(x.to(torch.float32), (0, n - x.shape[-1]))
    return _butterfly(y, n, s, inverse).reshape(*x.shape[:-1], n)


def _butterfly(x: torch.Tensor, size: int, s: torch.Tensor, inverse: bool) -> torch.Tensor:
    """diag(s) H / sqrt(size) (or its transpose) on every float32 block of `size`, in the fixed order
    `hadamard` documents; x is only ever read."""
    y = x.reshape(-1, size)
    if not inverse:
        y = y * s
    y = y.contiguous()
    # Stages alternate between two buffers (no stacked copies); the caller's x is only ever read.
    aliases_x = y.data_ptr() == x.data_ptr()
    out = torch.empty_like(y)
    h = 1
    while h < size:
        pairs, result = y.view(-1, size // (2 * h), 2, h), out.view(-1, size // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        torch.add(a, b, out=result[:, :, 0])
        torch.sub(a, b, out=result[:, :, 1])
        y, out = out, (torch.empty_like(y) if aliases_x else y)
        aliases_x = False
        h *= 2
    if inverse:
        y = y * s
    return y * (1.0 / math.sqrt(size))  # one float32 rounding of the scale, one of each product


def _is_power_of_two(n) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def _check_size(size: int) -> None:
    if not isinstance(size, int) or size not in HADAMARD_SIZES:
        raise ValueError(f"hadamard: size={size!r} is not supported; allowed: {', '.join(map(str, HADAMARD_SIZES))}")


def _check_signs(signs: torch.Tensor, size: int) -> torch.Tensor:
    """Check the shape always and the values on the CPU only: reading a GPU tensor's values would make
    the host wait for the GPU (device vectors come from hadamard_signs, which draws only +-1)."""
    valid = isinstance(signs, torch.Tensor) and signs.shape == (size,)
    if valid and signs.device.type == "cpu":
        valid = bool(((signs == 1) | (signs == -1)).all())
    if not valid:
        raise ValueError(
            f"hadamard: signs must be 'fixed', 'none' or a tensor of {size} values in {{-1, +1}} "
            "(see hadamard_signs)"
        )
    return signs
