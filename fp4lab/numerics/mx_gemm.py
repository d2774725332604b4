"""The MXFP4 GEMM of FP8 tensor cores in torch: `mxfp4_matmul_reference`, the bits that
`fp4lab.numerics.kernels.mx_gemm.mxfp4_matmul` computes (its docstring says why they are exact but for
the fp32 additions across K blocks), with the operand checks both share.

Torch only: nothing here imports Triton, so callers can check operands,
ask `kernels.runs_on(device)` and build the kernel's operands (`along_k`) before importing the kernel.
"""

from __future__ import annotations

import torch

from fp4lab.numerics import e2m1
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.scales import E8M0_NAN_BITS

MX_BLOCK = 32  # elements per E8M0 scale along K: one FP8 dot and one fp32 promotion each
OUT_DTYPES = (torch.float32, torch.bfloat16)


def along_k(q: QTensor, transposed: bool = False) -> QTensor | None:
    """The MXFP4 encoding q (or q^T, for an encoding in 2D tiles) as the kernel's operand: 1D blocks of
    32 along the last dim, the same decoded values bit for bit; None where it cannot be one.

    1D blocks along the last dim are that operand already. 2D tiles (th, tw) are too, exactly: their
    sides are multiples of the 32-block (`quantize` requires it), and every 32-block along a row of a
    tile has the tile's scale byte, so the per-tile scales repeated over the tile's rows and its
    32-blocks are the per-block scales (a NaN tile's byte poisons the same rows and columns in either
    form). q^T of a tiled encoding is the tiled encoding of the transpose (`quantize`'s tile contract):
    the codes are unpacked, transposed and packed again along the new last dim. None for other formats,
    1D blocks transposed (blocked along the wrong dim) and anything but 2D."""
    if q.fmt != "mxfp4" or len(q.shape) != 2:
        return None
    if q.tile is None:
        return None if transposed else q
    codes, scales, (th, tw), shape = q.data, q.scales, q.tile, q.shape
    if transposed:
        codes = e2m1.pack(e2m1.unpack(codes).T.contiguous())
        scales, (th, tw), shape = scales.T, (tw, th), torch.Size((shape[1], shape[0]))
    per_block = scales.repeat_interleave(th, dim=0).repeat_interleave(tw // MX_BLOCK, dim=1).contiguous()
    return QTensor(codes, per_block, None, "mxfp4", shape, MX_BLOCK, scale_mode=q.scale_mode)


def mxfp4_matmul_reference(a: QTensor, b: QTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What `mxfp4_matmul` computes, in torch, on any device: per K block the exact fp32 GEMM of the
    raw E2M1 values, times 2^(ea + eb) applied as the kernel applies it, added in block order into an
    fp32 accumulator that starts at +0; then one rounding to out_dtype."""
    m, n, kb = check_operands("mxfp4_matmul_reference", a, b, out_dtype)
    a_values = e2m1.decode(a.codes()).reshape(m, kb, MX_BLOCK)
    b_values = e2m1.decode(b.codes()).reshape(n, kb, MX_BLOCK)
    a_bytes, b_bytes = a.scales.to(torch.int32), b.scales.to(torch.int32)
    acc = torch.zeros((m, n), dtype=torch.float32, device=a.data.device)
    for k in range(kb):
        partial = a_values[:, k] @ b_values[:, k].T  # multiples of 1/4 below 2^11: exact in any order, and in TF32
        biased = a_bytes[:, k, None] + b_bytes[None, :, k]
        b1 = (biased - 127).clamp(1, 254)
        b2 = (biased - b1).clamp(min=1)
        scaled = partial * (b1 << 23).view(torch.float32) * (b2 << 23).view(torch.float32)
        nan = (a_bytes[:, k, None] == E8M0_NAN_BITS) | (b_bytes[None, :, k] == E8M0_NAN_BITS)
        acc = acc + torch.where(nan, float("nan"), scaled)
    return acc.to(out_dtype)


def check_operands(where: str, a, b, out_dtype) -> tuple[int, int, int]:
    """(M, N, K / 32) of valid operands, else a one-line ValueError naming the argument."""
    for name, q in (("a", a), ("b", b)):
        if not isinstance(q, QTensor):
            raise ValueError(f"{where}: {name} must be a QTensor, got {type(q).__name__}; pass quantize(t, 'mxfp4')")
        if q.fmt != "mxfp4" or q.tile is not None:
            what = f"fmt {q.fmt!r}" if q.fmt != "mxfp4" else f"2D tiles {q.tile}"
            raise ValueError(f"{where}: {name} has {what}; pass an MXFP4 operand with 1D blocks along K, quantize(t, 'mxfp4')")
        if len(q.shape) != 2:
            raise ValueError(f"{where}: {name} has shape {list(q.shape)}; pass a 2D operand [rows, K] (flatten leading dims first)")
        rows, k = q.shape
        if k % MX_BLOCK:
            raise ValueError(f"{where}: K={k} of {name} is not a multiple of {MX_BLOCK}; pad the contraction dim with zeros to a multiple of {MX_BLOCK}")
        for part, t, want in (("data", q.data, (rows, k // 2)), ("scales", q.scales, (rows, k // MX_BLOCK))):
            if t.dtype != torch.uint8 or tuple(t.shape) != want:
                raise ValueError(f"{where}: {name}.{part} must be uint8 of shape {list(want)}, got {t.dtype} {list(t.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"{where}: a is [M, K={a.shape[1]}] and b is [N, K={b.shape[1]}]; both must be quantized along the same K (C = a @ b^T)"
        )
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: out_dtype={out_dtype} is not supported; allowed: torch.float32, torch.bfloat16")
    if b.data.device != a.data.device:
        raise ValueError(f"{where}: b is on {b.data.device} and a on {a.data.device}; put both operands on one device")
    return a.shape[0], b.shape[0], a.shape[1] // MX_BLOCK
