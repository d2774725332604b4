"""The operands of FP4Linear's GEMMs: how a 2D tensor becomes what a GEMM reads, per operand spec.

`encode_operand` / `decode_operand` / `operand_values`: the reference path's encodings (packed QTensor,
Fp8Tensor, bf16 or fp32) and their fp32 values. `gemm_operand`: the tensor-core path's operand, a
`GemmOperand` (bf16 block values and the outer scale the GEMM's epilogue applies) or, kept for the
backward pass, a `PackedOperand` (the fused kernel's codes and scales). `kernel_options` /
`fused_options`: the fused quantizer's arguments where it covers a spec. `contraction_multiple` and
`transform_length`: the padding each GEMM's contraction dim needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fp4lab.nn.recipe import GEMMS, LinearRecipe, OperandSpec
from fp4lab.numerics import (
    BLOCK_SIZE,
    Fp8Tensor,
    fake_quantize,
    fake_quantize_factored,
    fp8_quantize,
    hadamard,
    hadamard_full,
    quantize,
)
from fp4lab.numerics.kernels import quantizer_covers, runs_on
from fp4lab.numerics.mx_gemm import MX_BLOCK, along_k
from fp4lab.numerics.qtensor import QTensor

FP8_CODES = (torch.float8_e4m3fn, torch.float8_e5m2)
# torch._scaled_mm: FP8 tensor cores from compute capability 8.9 (Ada, Hopper) on, every dim of both
# operands a multiple of 16.
SCALED_MM_CAPABILITY, SCALED_MM_MULTIPLE = (8, 9), 16


def fp8_codes_fit(t: torch.Tensor) -> bool:
    """Whether an FP8 operand of t's shape is made as float8 codes for FP8 tensor cores
    (`nn.gemm.fp8_scaled_mm`; else as bf16 values for bf16 tensor cores): a 2D CUDA tensor on a device
    with FP8 tensor cores, both dims multiples of 16, so that every GEMM it meets takes it (each dim of
    a GEMM is a dim of one of its operands)."""
    return (t.is_cuda and t.dim() == 2 and all(d % SCALED_MM_MULTIPLE == 0 for d in t.shape)
            and torch.cuda.get_device_capability(t.device) >= SCALED_MM_CAPABILITY)


def transform_operand(t: torch.Tensor, spec: OperandSpec, signs: torch.Tensor | None) -> torch.Tensor:
    """t with the spec's Hadamard along its last dim: blockwise, or over the whole dim zero-padded to
    the length of the sign vector (a full transform), or t itself without one."""
    if signs is None:
        return t
    return hadamard_full(t, signs) if spec.full_transform else hadamard(t, spec.transform_size, signs)


def encode_operand(
    t: torch.Tensor, spec: OperandSpec, signs: torch.Tensor | None, generator, amax: torch.Tensor | None = None
) -> QTensor | Fp8Tensor | torch.Tensor:
    """The representation of a 2D operand (quantized along its last dim) that a GEMM consumes.
    `amax`: the amax behind an NVFP4 tensor scale or FP8 scale other than t's own (that of the whole
    weight, for a shard of it)."""
    t = transform_operand(t, spec, signs)
    if spec.format == "fp32":
        return t
    if spec.format == "bf16":
        return t.to(torch.bfloat16)
    if spec.format == "fp8":
        return fp8_quantize(t, spec.element, spec.scaling, pow2=spec.pow2_scale, amax=amax)
    return quantize(t, spec.format, **quantize_options(spec, generator), tensor_amax=amax)


def decode_operand(encoded: QTensor | Fp8Tensor | torch.Tensor) -> torch.Tensor:
    return encoded.dequantize() if isinstance(encoded, (QTensor, Fp8Tensor)) else encoded.to(torch.float32)


def operand_values(t: torch.Tensor, spec: OperandSpec, signs: torch.Tensor | None, generator) -> torch.Tensor:
    """`decode_operand(encode_operand(...))` without packing, for operands consumed at once."""
    if not spec.is_fp4:
        return decode_operand(encode_operand(t, spec, signs, generator))
    return fake_quantize(transform_operand(t, spec, signs), spec.format, **quantize_options(spec, generator))


def quantize_options(spec: OperandSpec, generator) -> dict:
    return {
        "rounding": spec.rounding,
        "tile": spec.tile,
        "scale_mode": spec.scale_mode,
        "generator": generator if spec.rounding == "sr" else None,
        "adaptive": spec.adaptive,
        "cta_tile": spec.cta_tile,
    }


def kernel_options(spec: OperandSpec, signs: torch.Tensor | None, t: torch.Tensor, seed) -> dict | None:
    """The fused quantizer's arguments for `spec`, or None where it does not cover the spec or cannot
    run (no CUDA tensor, no Triton). `seed()` gives the Philox seed of a stochastically rounded one."""
    if not (t.is_cuda and quantizer_covers(spec) and runs_on(t.device)):
        return None
    return fused_options(spec, signs, t, seed)


def fp8_kernel_runs(t: torch.Tensor) -> bool:
    """Whether the fused FP8 quantizer runs on t: a CUDA tensor, with Triton (tests under Triton's
    interpreter replace this for CPU tensors)."""
    return t.is_cuda and runs_on(t.device)


def fused_options(spec: OperandSpec, signs: torch.Tensor | None, t: torch.Tensor, seed) -> dict:
    """`kernels.quantize.quantize_fused`'s arguments for a spec it covers (`numerics.kernels.quantizer_covers`); tests under
    Triton's CPU interpreter call it for CPU tensors, where `kernel_options` says None."""
    options = {"fmt": spec.format, "scale_mode": spec.scale_mode, "rounding": spec.rounding, "signs": signs}
    options["seed"] = seed(t.device) if spec.rounding == "sr" else None
    if spec.adaptive:
        options["adaptive"] = True
    if spec.format == "nvfp4_cta":
        options["cta_tile"] = spec.cta_tile
    if spec.tile is not None:
        options["tile"] = spec.tile
    return options


def contraction_multiple(recipe: LinearRecipe, gemm: str) -> int:
    """The contraction length of `gemm` must be a multiple of this (blocks, tiles and transform); 1
    under a full transform, which pads the dim itself (`transform_length`)."""
    if recipe.operand(GEMMS[gemm][0]).full_transform:
        return 1
    multiple = 1
    for name in GEMMS[gemm]:
        spec = recipe.operand(name)
        if spec.is_fp4:
            multiple = math.lcm(multiple, BLOCK_SIZE[spec.format], *(spec.tile or ()))
        multiple = math.lcm(multiple, max(spec.transform_size, 1))
    return multiple


def transform_length(recipe: LinearRecipe, gemm: str, length: int) -> int:
    """The padded contraction length N of a full transform of `gemm` over `length` elements: the next
    power of two, and at least the operands' FP4 block, so the padded operands divide into blocks (the
    recipe allows no tiles with a full transform)."""
    blocks = [BLOCK_SIZE[recipe.operand(name).format] for name in GEMMS[gemm] if recipe.operand(name).is_fp4]
    return max(1 << (length - 1).bit_length(), *blocks, 1)


@dataclass(frozen=True)
class GemmOperand:
    """One operand of a tensor-core GEMM: `values` [rows, K] (bf16 where exact, else fp32; float8 codes
    for FP8 tensor cores: `fp8_codes_fit`) and the outer scale that multiplies the result: None, 0-dim,
    or one per row ([rows, 1]); or, for a weight in 2D CTA-local NVFP4 tiles, one per `outer_cell` x
    `outer_cell` square, which scales each chunk of the sum along K (`numerics.tile_gemm`)."""

    values: torch.Tensor
    outer: torch.Tensor | None = None
    packed: PackedOperand | None = None  # the same operand as codes and scales, where the kernel wrote them
    outer_cell: int | None = None

    @property
    def T(self) -> GemmOperand:  # noqa: N802 (reads like tensor.T)
        """The transposed operand, for an encoding valid in both orientations (2D weight tiles)."""
        if self.outer_cell is None:
            _check_transposable(self.outer, "GemmOperand")
        outer = self.outer.T if self.outer_cell is not None else self.outer
        return GemmOperand(self.values.T, outer, self.packed.T if self.packed is not None else None, self.outer_cell)


def _check_transposable(outer: torch.Tensor | None, what: str) -> None:
    if outer is not None and outer.dim():
        raise ValueError(f"{what}.T: a per-row outer scale does not transpose into a per-row scale")


@dataclass(frozen=True)
class PackedOperand:
    """A tensor-core operand kept for the backward pass as the fused kernel's packed codes and block
    scales (0.5 byte per element plus a byte per block, against 2 for bf16 values), as FP4 training
    keeps its saved operands; `unpack()` decodes the bf16 values when the GEMM needs them."""

    codes: torch.Tensor
    scales: torch.Tensor
    outer: torch.Tensor | None
    fmt: str
    shape: tuple[int, int]
    tile: tuple[int, int] | None = None
    transposed: bool = False
    outer_cell: int | None = None  # as GemmOperand's: `outer` holds one scale per square of this side

    @property
    def T(self) -> PackedOperand:  # noqa: N802 (reads like tensor.T)
        """The transposed operand, for an encoding valid in both orientations (2D weight tiles)."""
        if self.outer_cell is None:
            _check_transposable(self.outer, "PackedOperand")
        return replace(self, transposed=not self.transposed)

    def unpack(self) -> GemmOperand:
        from fp4lab.numerics.kernels.quantize import decode_fused

        values = decode_fused(self.codes, self.scales, fmt=self.fmt, shape=self.shape, tile=self.tile)
        operand = GemmOperand(values, self.outer, outer_cell=self.outer_cell)
        return operand.T if self.transposed else operand

    def along_k(self) -> QTensor | None:
        """This operand as the FP8 GEMM's MXFP4 operand, 1D blocks of 32 along its last dim
        (`numerics.mx_gemm.along_k`: 2D tiles expressed per block), or None where it is not one."""
        if self.fmt != "mxfp4":
            return None
        encoded = QTensor(self.codes, self.scales, None, self.fmt, torch.Size(self.shape), MX_BLOCK, tile=self.tile)
        return along_k(encoded, self.transposed)


def fused_operand(q, fmt: str, shape: tuple, tile: tuple[int, int] | None = None, outer_cell: int | None = None) -> GemmOperand | PackedOperand:
    """The operand a fused kernel's output (`kernels.quantize.FusedQuant`) gives a GEMM: its values
    (with the packed codes where written), or the packed codes and scales alone. `outer_cell`: the
    side of the squares of a 2D CTA-local outer scale."""
    packed = PackedOperand(q.codes, q.scales, q.outer, fmt, shape, tile=tile, outer_cell=outer_cell) if q.codes is not None else None
    return packed if q.values is None else GemmOperand(q.values, q.outer, packed, outer_cell)


def unpacked(operand: GemmOperand | PackedOperand) -> GemmOperand:
    return operand.unpack() if isinstance(operand, PackedOperand) else operand


def packed_form(operand: GemmOperand | PackedOperand) -> PackedOperand | None:
    """The operand's codes and scales, where they were written."""
    return operand if isinstance(operand, PackedOperand) else operand.packed


def gemm_operand(
    t: torch.Tensor, spec: OperandSpec, signs: torch.Tensor | None, generator, encoded=None, keep_codes: bool = False
) -> GemmOperand:
    """What a tensor-core GEMM reads for a 2D operand quantized along its last dim. `encoded` (a QTensor
    of the same operand, made for a probe) is used instead of quantizing again, so the random bits
    drawn are the same either way. `keep_codes` (an FP4 spec): the operand also carries its codes and
    scales (`GemmOperand.packed`), which the FP8 GEMM reads."""
    t = transform_operand(t.to(torch.float32), spec, signs) if signs is not None else t
    if spec.format == "fp32":
        return GemmOperand(t.to(torch.float32))
    if spec.format == "bf16":
        return GemmOperand(t.to(torch.bfloat16))
    if spec.format == "fp8" or keep_codes:  # FP8: E4M3 / E5M2 values are exact in bf16; the scale goes to the epilogue
        encoded = encoded if encoded is not None else encode_operand(t, spec, None, generator)
    if spec.format == "fp8" and fp8_codes_fit(encoded.data):  # the codes themselves, for FP8 tensor cores
        return GemmOperand(encoded.data, encoded.factored().outer)
    parts = encoded.factored() if encoded is not None else fake_quantize_factored(t, spec.format, **quantize_options(spec, generator))
    packed = None
    if keep_codes:
        packed = PackedOperand(encoded.data, encoded.scales, parts.outer, encoded.fmt, tuple(encoded.shape), tile=encoded.tile)
    return GemmOperand(parts.values.to(torch.bfloat16), parts.outer, packed, parts.outer_cell)
