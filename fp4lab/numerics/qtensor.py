"""QTensor: packed FP4 codes with their block scales and optional FP32 outer scales."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fp4lab.numerics import e2m1
from fp4lab.numerics.scales import e4m3_decode, e8m0_decode


@dataclass(frozen=True)
class FactoredValues:
    """What an FP4 GEMM on bf16 tensor cores consumes: `fake_quantize(x) == folded()` bit for bit.

    values:     float32 E2M1 values times their block scale, each exact in bf16 (E2M1 x 2^k: 2
                significant bits; E2M1 x E4M3: at most 6), so a bf16 GEMM multiplies them exactly
                and accumulates in fp32.
    outer:      the nvfp4 decode scale 1 / S_enc (0-dim), or for 1D nvfp4_cta one scale per row
                ([..., 1]); None for mxfp4. These vary only along the rows, never along the blocked
                (contraction) dim, so they factor out of a GEMM into its epilogue (Blackwell's alpha).
                For 2D nvfp4_cta tiles, one scale per `outer_cell` x `outer_cell` square
                ([ceil(R / T), ceil(C / T)]): it varies along the contraction dim too, so a GEMM
                scales each T-wide chunk of its sum (`numerics.tile_gemm`).
    outer_cell: the side T of those squares (the CTA tile); None where `outer` is not per square.
    """

    values: torch.Tensor
    outer: torch.Tensor | None
    outer_cell: int | None = None

    def folded(self) -> torch.Tensor:
        """values times the outer scale that applies to each element, in float32: one rounding."""
        if self.outer is None:
            return self.values
        if self.outer_cell is None:
            return self.values * self.outer
        return self.values * expand_cells(self.outer, self.outer_cell, self.values.shape)


def expand_cells(cells: torch.Tensor, cell: int, shape) -> torch.Tensor:
    """One value per `cell` x `cell` square of a 2D tensor of `shape` (the last row and column of squares
    may be cut short), broadcast to one per element."""
    rows, cols = shape
    return cells.repeat_interleave(cell, dim=0)[:rows].repeat_interleave(cell, dim=1)[:, :cols]


@dataclass(frozen=True)
class QTensor:
    """A tensor quantized to MXFP4 or NVFP4.

    data:         uint8, the input's shape with the last dim halved; element 2i in the low nibble.
    scales:       uint8 raw bits (E4M3 for nvfp4*, E8M0 for mxfp4); `[..., K // block]` for 1D
                  blocks, `[R // th, C // tw]` for 2D tiles.
    tensor_scale: float32 decode scale(s) 1 / S_enc: a 0-dim tensor for nvfp4, one per CTA tile for
                  nvfp4_cta (`[ceil(R / T)]` for 1D, `[ceil(R / T), ceil(C / T)]` for 2D tiles);
                  None for mxfp4.
    """

    data: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    fmt: str
    shape: torch.Size
    block_size: int
    tile: tuple[int, int] | None = None
    scale_mode: str | None = None
    cta_tile: int | None = None

    def codes(self) -> torch.Tensor:
        """Unpacked E2M1 codes, one uint8 per element, in the input's shape."""
        return e2m1.unpack(self.data).reshape(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.fmt == "mxfp4":
            return self._block_values(e8m0_decode(self.scales)).to(dtype)
        # code * E4M3 scale is exact in float32, so decoding rounds once, at the outer scale.
        values = self._block_values(e4m3_decode(self.scales))
        return (values * self._outer_scale()).to(dtype)

    def factored(self) -> FactoredValues:
        """The GEMM operand form of this encoding: `fake_quantize_factored` of the same input and bits."""
        if self.fmt == "mxfp4":
            return FactoredValues(self._block_values(e8m0_decode(self.scales)), None)
        values = self._block_values(e4m3_decode(self.scales))
        if self.fmt == "nvfp4":
            return FactoredValues(values, self.tensor_scale)
        if self.tile is not None:
            return FactoredValues(values, self.tensor_scale, self.cta_tile)
        return FactoredValues(values, self._outer_scale())

    def _outer_scale(self) -> torch.Tensor:
        """The nvfp4 outer decode scale, broadcastable to the input's shape."""
        if self.fmt == "nvfp4":
            return self.tensor_scale
        t = self.cta_tile
        if self.tile is None:
            rows = self.shape.numel() // self.shape[-1] if len(self.shape) else 1
            per_row = self.tensor_scale.repeat_interleave(t)[:rows]
            return per_row.reshape(*self.shape[:-1], 1)
        return expand_cells(self.tensor_scale, t, self.shape)

    def _block_values(self, per_block: torch.Tensor) -> torch.Tensor:
        """E2M1 values times their block's (or tile's) scale, broadcast over a grouped view rather
        than through a per-element copy of the scales."""
        values = e2m1.decode(self.codes())
        if self.tile is None:
            grouped = values.reshape(*self.shape[:-1], self.shape[-1] // self.block_size, self.block_size)
            return (grouped * per_block[..., None]).reshape(self.shape)
        (th, tw), (rows, cols) = self.tile, self.shape
        return (values.reshape(rows // th, th, cols // tw, tw) * per_block[:, None, :, None]).reshape(self.shape)
