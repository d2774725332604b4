"""fp4lab.numerics: pure tensor math for FP4 training (formats, quantizers, rounding, Hadamard) and its FP8 baseline.

The functions here are the exact CPU reference; docs/NUMERICS.md states every contract.
"""

from fp4lab.numerics.fp8 import FP8_ELEMENTS, FP8_SCALINGS, Fp8Tensor, fp8_quantize, fp8_scale
from fp4lab.numerics.hadamard import (
    HADAMARD_SIZES,
    TE_SIGNS,
    hadamard,
    hadamard_full,
    hadamard_matrix,
    hadamard_signs,
    named_signs_on,
)
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.quantize import (
    BLOCK_SIZE,
    FORMATS,
    ROUNDINGS,
    FactoredValues,
    fake_quantize,
    fake_quantize_factored,
    quantize,
)
from fp4lab.numerics.scales import MX_SCALE_MODES

__all__ = [
    "BLOCK_SIZE",
    "FORMATS",
    "FP8_ELEMENTS",
    "FP8_SCALINGS",
    "HADAMARD_SIZES",
    "MX_SCALE_MODES",
    "ROUNDINGS",
    "TE_SIGNS",
    "FactoredValues",
    "Fp8Tensor",
    "QTensor",
    "fake_quantize",
    "fake_quantize_factored",
    "fp8_quantize",
    "fp8_scale",
    "hadamard",
    "hadamard_full",
    "hadamard_matrix",
    "hadamard_signs",
    "named_signs_on",
    "quantize",
]
