"""quantize(): float tensors to MXFP4 / NVFP4 / CTA-local NVFP4 QTensors (the exact CPU reference).

The scale chains, their sources and every edge case are written down in docs/NUMERICS.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fp4lab.numerics import e2m1
from fp4lab.numerics.qtensor import FactoredValues, QTensor
from fp4lab.numerics.scales import (
    E4M3_NAN_BITS,
    E8M0_NAN_BITS,
    FLT_MAX,
    MX_SCALE_MODES,
    e4m3_decode,
    e4m3_encode,
    e8m0_decode,
    mx_exponent,
    nvfp4_encode_scale,
)

FORMATS = ("nvfp4", "mxfp4", "nvfp4_cta")
ROUNDINGS = ("rtn", "sr")
BLOCK_SIZE = {"nvfp4": 16, "nvfp4_cta": 16, "mxfp4": 32}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DEFAULT_CTA_TILE = 128


def quantize(
    x: torch.Tensor,
    fmt: str,
    *,
    rounding: str = "rtn",
    tile: tuple[int, int] | None = None,
    scale_mode: str | None = None,
    generator: torch.Generator | None = None,
    tensor_amax: torch.Tensor | float | None = None,
    adaptive: bool = False,
    cta_tile: int | None = None,
) -> QTensor:
    """Quantize `x` to FP4 along its last dim (1D blocks) or in 2D tiles.

    fmt:         "nvfp4" (1x16, E4M3 block scales, one FP32 tensor scale, TE's chain),
                 "nvfp4_cta" (as nvfp4, with one FP32 outer scale per CTA tile instead of per
                 tensor) or "mxfp4" (1x32, E8M0 block scales).
    rounding:    "rtn" (round to nearest, ties to even) or "sr" (unbiased stochastic rounding
                 between the two neighbouring E2M1 values, drawn from `generator`).
    tile:        (th, tw) for 2D weight tiles (x must be 2D): one scale per tile, so the encoding of
                 x.T with tile (tw, th) is the exact transpose. th and tw are multiples of the block.
    scale_mode:  mxfp4 only: "floor" (OCP, default), "ceil", "even" or "rceil" (torchao's modes).
    tensor_amax: nvfp4 only: use this amax for the tensor scale instead of max|x| (e.g. delayed).
    adaptive:    mxfp4 with scale_mode="rceil" only: halve a block's scale when its amax uses less
                 than 0.87 of the range the upward scale grants (values beyond then saturate).
    cta_tile:    nvfp4_cta only: rows per outer-scale tile (T x T squares for 2D tiles); default 128.
    """
    enc = _encode(x, fmt, rounding, tile, scale_mode, generator, tensor_amax, adaptive, cta_tile)
    # A poisoned block's codes are +0: what its scaled values round to depends on the NaN sign bits of
    # the platform (and for an Inf block, on the exponent read from Inf), not on the data. Decoded
    # values need no such care: the block's NaN scale makes every one of them NaN.
    elements = torch.where(enc.nonfinite, 0.0, enc.elements)
    return QTensor(
        data=e2m1.pack(e2m1.encode_grid(elements).reshape(x.shape)),
        scales=_scale_grid(enc.scale_bits, x, enc.block, tile),
        tensor_scale=enc.tensor_scale,
        fmt=fmt,
        shape=x.shape,
        block_size=enc.block,
        tile=tuple(tile) if tile is not None else None,
        scale_mode=enc.scale_mode,
        cta_tile=enc.cta_tile,
    )


def fake_quantize(x: torch.Tensor, fmt: str, **options) -> torch.Tensor:
    """`quantize(x, fmt, **options).dequantize()`, bit for bit, without packing: the float32 values
    a GEMM consumes. Same arguments and errors as `quantize`."""
    enc = _encode(x, fmt, **({"rounding": "rtn"} | options))
    if fmt == "mxfp4":
        values = enc.elements * e8m0_decode(enc.scale_bits)
    else:
        values = enc.elements * e4m3_decode(enc.scale_bits) * enc.outer_decode
    return values.reshape(x.shape)


def fake_quantize_factored(x: torch.Tensor, fmt: str, **options) -> FactoredValues:
    """`fake_quantize` with the outer scale kept apart: the operand form of an emulated FP4 GEMM whose
    products run on bf16 tensor cores and whose outer scales are applied to the fp32 result."""
    enc = _encode(x, fmt, **({"rounding": "rtn"} | options))
    if fmt == "mxfp4":
        return FactoredValues((enc.elements * e8m0_decode(enc.scale_bits)).reshape(x.shape), None)
    values = (enc.elements * e4m3_decode(enc.scale_bits)).reshape(x.shape)
    if fmt == "nvfp4_cta" and options.get("tile") is not None:
        return FactoredValues(values, enc.tensor_scale, enc.cta_tile)
    outer = enc.outer_decode
    if fmt == "nvfp4_cta":  # [..., 1, 1] per block row of the grouped view: one scale per row of x
        outer = outer.reshape(*x.shape[:-1], 1)
    return FactoredValues(values, outer)


def finite_amax(x: torch.Tensor, fmt: str, tile: tuple[int, int] | None = None) -> torch.Tensor:
    """The amax behind `quantize(x, fmt, tile=tile)`'s NVFP4 tensor scale (0-dim): the largest amax of a
    block (tile) holding no NaN or Inf. A part of x cut along block (tile) boundaries holds whole blocks,
    so the largest of the parts' amaxes, passed back as `tensor_amax`, quantizes every part exactly as
    the whole tensor is quantized (shards of a weight under FSDP2: fp4lab.train.encoded_gather)."""
    block = _check_arguments(x, fmt, "rtn", tile, None, None, False, None)
    grouped, reduce_dims = _group(x.detach().to(torch.float32).contiguous(), block, tile)
    block_amax = grouped.abs().amax(dim=reduce_dims, keepdim=True)
    return _tensor_amax(torch.where(torch.isfinite(block_amax), block_amax, 0.0), None)


@dataclass
class _Encoding:
    elements: torch.Tensor  # E2M1 values (float32, signed) in the grouped view of `_group`
    scale_bits: torch.Tensor  # one per group, broadcastable against `elements`
    tensor_scale: torch.Tensor | None
    outer_decode: torch.Tensor | None  # 1 / S_enc broadcastable against `elements` (nvfp4 formats)
    block: int
    scale_mode: str | None
    cta_tile: int | None
    nonfinite: torch.Tensor  # per block: a NaN or Inf inside, so its scale is NaN


def _encode(
    x, fmt, rounding="rtn", tile=None, scale_mode=None, generator=None, tensor_amax=None, adaptive=False, cta_tile=None
) -> _Encoding:
    block = _check_arguments(x, fmt, rounding, tile, scale_mode, tensor_amax, adaptive, cta_tile)
    if fmt == "mxfp4":
        scale_mode = scale_mode or "floor"
    if fmt == "nvfp4_cta":
        cta_tile = cta_tile or DEFAULT_CTA_TILE

    xf = x.detach().to(torch.float32).contiguous()
    grouped, reduce_dims = _group(xf, block, tile)
    block_amax = grouped.abs().amax(dim=reduce_dims, keepdim=True)
    nonfinite = ~torch.isfinite(block_amax)  # a NaN or Inf poisons its own block only
    finite_block_amax = _scale_grid(torch.where(nonfinite, 0.0, block_amax), xf, block, tile)

    tensor_scale = outer_decode = None
    if fmt == "mxfp4":
        scale_bits, multiplier = mx_exponent(block_amax, scale_mode, adaptive=adaptive)
        scale_bits = torch.where(nonfinite, E8M0_NAN_BITS, scale_bits).to(torch.uint8)
        scaled = grouped * multiplier
    else:
        if fmt == "nvfp4":
            s_enc = nvfp4_encode_scale(_tensor_amax(finite_block_amax, tensor_amax))
            s_enc_per_block = s_enc
        else:
            s_enc = nvfp4_encode_scale(_cta_amax(finite_block_amax, tile, cta_tile))
            s_enc_per_block = _cta_to_blocks(s_enc, xf, tile, cta_tile)
        tensor_scale, outer_decode = 1.0 / s_enc, 1.0 / s_enc_per_block
        # One float32 rounding: amax * (S_enc * (1/6)), as TE's kernel and its reference compute it.
        scale_bits = e4m3_encode(torch.clamp(block_amax * (s_enc_per_block * (1.0 / 6.0)), max=448.0))
        scale_bits = torch.where(nonfinite, E4M3_NAN_BITS, scale_bits).to(torch.uint8)
        encode = torch.clamp(1.0 / (e4m3_decode(scale_bits) * outer_decode), max=FLT_MAX)
        scaled = grouped * encode  # both roundings saturate at 6, as TE's clamp to [-6, 6] does

    elements = e2m1.round_to_nearest(scaled) if rounding == "rtn" else e2m1.round_stochastic(scaled, generator)
    return _Encoding(elements, scale_bits, tensor_scale, outer_decode, block, scale_mode, cta_tile, nonfinite)


def _group(x: torch.Tensor, block: int, tile: tuple[int, int] | None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """View x as blocks: [..., K/b, b] reduced over -1, or [R/th, th, C/tw, tw] reduced over (1, 3)."""
    if tile is None:
        return x.reshape(*x.shape[:-1], x.shape[-1] // block, block), (-1,)
    th, tw = tile
    rows, cols = x.shape
    return x.reshape(rows // th, th, cols // tw, tw), (1, 3)


def _scale_grid(per_block: torch.Tensor, x: torch.Tensor, block: int, tile: tuple[int, int] | None) -> torch.Tensor:
    if tile is None:
        return per_block.reshape(*x.shape[:-1], x.shape[-1] // block)
    return per_block.reshape(x.shape[0] // tile[0], x.shape[1] // tile[1])


def _tensor_amax(finite_block_amax: torch.Tensor, tensor_amax) -> torch.Tensor:
    """The amax behind S_enc: the largest finite block amax (blocks holding NaN/Inf are left out:
    they poison only themselves), or the caller's `tensor_amax`."""
    device = finite_block_amax.device
    if tensor_amax is not None:
        # reshape: a one-element [1] amax must still give the documented 0-dim tensor_scale
        return torch.as_tensor(tensor_amax, dtype=torch.float32, device=device).reshape(())
    return finite_block_amax.amax() if finite_block_amax.numel() else torch.zeros((), device=device)


def _cta_to_blocks(per_cta: torch.Tensor, x: torch.Tensor, tile, cta_tile: int) -> torch.Tensor:
    """Broadcast per-CTA-tile values against the block amax of `_group`."""
    if tile is None:
        rows = x.numel() // x.shape[-1]
        per_row = per_cta.repeat_interleave(cta_tile)[:rows]
        return per_row.reshape(*x.shape[:-1], 1, 1)
    th, tw = tile
    grid = per_cta.repeat_interleave(cta_tile // th, dim=0).repeat_interleave(cta_tile // tw, dim=1)
    return grid[: x.shape[0] // th, None, : x.shape[1] // tw, None]


def _cta_amax(finite_block_amax: torch.Tensor, tile, cta_tile: int) -> torch.Tensor:
    """Amax per CTA tile, from the grid of finite block amaxes: per `cta_tile` rows spanning the last
    dim (1D blocks), or per cta_tile x cta_tile square (2D tiles)."""
    grid = finite_block_amax.reshape(-1, finite_block_amax.shape[-1])
    if tile is None:
        per_row = grid.amax(dim=1) if grid.shape[1] else torch.zeros(grid.shape[0], device=grid.device)
        return _tile_max(per_row[:, None], cta_tile, 1)[:, 0]
    return _tile_max(grid, cta_tile // tile[0], cta_tile // tile[1])


def _tile_max(grid: torch.Tensor, rows_per_tile: int, cols_per_tile: int) -> torch.Tensor:
    """Max over rows_per_tile x cols_per_tile groups of a 2D grid (the last group may be short)."""
    rows, cols = grid.shape
    row_tiles, col_tiles = math.ceil(rows / rows_per_tile), math.ceil(cols / cols_per_tile)
    padded = torch.nn.functional.pad(grid, (0, col_tiles * cols_per_tile - cols, 0, row_tiles * rows_per_tile - rows))
    return padded.reshape(row_tiles, rows_per_tile, col_tiles, cols_per_tile).amax(dim=(1, 3))


def _check_arguments(x, fmt, rounding, tile, scale_mode, tensor_amax, adaptive, cta_tile) -> int:
    """Validate quantize()'s arguments; return the block size. Errors name the argument and the fix."""
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"quantize: x must be a torch.Tensor, got {type(x).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"quantize: fmt={fmt!r} is not supported; allowed: {', '.join(map(repr, FORMATS))}")
    if x.dtype not in INPUT_DTYPES:
        allowed = ", ".join(str(d) for d in INPUT_DTYPES)
        raise ValueError(f"quantize: x has dtype {x.dtype}; allowed: {allowed} (convert with x.float())")
    if rounding not in ROUNDINGS:
        raise ValueError(f"quantize: rounding={rounding!r} is not supported; allowed: 'rtn', 'sr'")
    if x.dim() == 0:
        raise ValueError("quantize: x is 0-dim; it needs at least one dimension (the blocked last dim)")
    block = BLOCK_SIZE[fmt]
    if fmt == "mxfp4":
        if scale_mode is not None and scale_mode not in MX_SCALE_MODES:
            allowed = ", ".join(map(repr, MX_SCALE_MODES))
            raise ValueError(f"quantize: scale_mode={scale_mode!r} is not supported for mxfp4; allowed: {allowed}")
        if adaptive and scale_mode != "rceil":
            raise ValueError("quantize: adaptive=True refines the upward scale; pass scale_mode='rceil' with it")
    else:
        if scale_mode is not None:
            raise ValueError(f"quantize: scale_mode applies to fmt='mxfp4' only; pass scale_mode=None for {fmt}")
        if adaptive:
            raise ValueError(f"quantize: adaptive applies to fmt='mxfp4' only; pass adaptive=False for {fmt}")
    if tensor_amax is not None:
        if fmt != "nvfp4":
            raise ValueError(f"quantize: tensor_amax applies to fmt='nvfp4' only; pass tensor_amax=None for {fmt}")
        amax = torch.as_tensor(tensor_amax, dtype=torch.float32)
        # A device amax is checked by its shape only: reading its value would make the host wait for
        # the GPU, which a CUDA graph's capture forbids.
        if amax.numel() != 1 or (amax.device.type == "cpu" and not (torch.isfinite(amax).all() and amax.item() >= 0)):
            raise ValueError(f"quantize: tensor_amax must be one finite value >= 0, got {tensor_amax!r}")
    if cta_tile is not None:
        if fmt != "nvfp4_cta":
            raise ValueError(f"quantize: cta_tile applies to fmt='nvfp4_cta' only; pass cta_tile=None for {fmt}")
        if not isinstance(cta_tile, int) or cta_tile <= 0 or cta_tile % block:
            raise ValueError(f"quantize: cta_tile={cta_tile!r} must be a positive multiple of {block}")
    if tile is None:
        if x.shape[-1] % block:
            raise ValueError(
                f"quantize: the last dim of x (shape {list(x.shape)}) must be a multiple of the {fmt} "
                f"block size {block}; pad it or pick another format"
            )
        return block
    if len(tuple(tile)) != 2 or any(not isinstance(t, int) or t <= 0 or t % block for t in tile):
        raise ValueError(f"quantize: tile={tile!r} must be (th, tw) with positive multiples of {block} for {fmt}")
    if x.dim() != 2:
        raise ValueError(f"quantize: tile={tuple(tile)} needs a 2D x (a weight), got shape {list(x.shape)}")
    if x.shape[0] % tile[0] or x.shape[1] % tile[1]:
        raise ValueError(f"quantize: x shape {list(x.shape)} is not divisible into {tuple(tile)} tiles; pad the weight")
    if fmt == "nvfp4_cta" and ((cta_tile or DEFAULT_CTA_TILE) % tile[0] or (cta_tile or DEFAULT_CTA_TILE) % tile[1]):
        raise ValueError(f"quantize: cta_tile must be a multiple of both tile dims {tuple(tile)}")
    return block
