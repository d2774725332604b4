"""fp4lab.numerics: pure tensor math for FP4 training (formats, quantizers, rounding, Hadamard).

The functions here are the exact CPU reference; docs/NUMERICS.md states every contract.
"""

from fp4lab.numerics.hadamard import HADAMARD_SIZES, TE_SIGNS, hadamard, hadamard_matrix, hadamard_signs
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.quantize import BLOCK_SIZE, FORMATS, ROUNDINGS, FactoredValues, fake_quantize, fake_quantize_factored, quantize
from fp4lab.numerics.scales import MX_SCALE_MODES

__all__ = [
    "BLOCK_SIZE",
    "FORMATS",
    "HADAMARD_SIZES",
    "MX_SCALE_MODES",
    "QTensor",
    "ROUNDINGS",
    "TE_SIGNS",
    "hadamard",
    "hadamard_matrix",
    "hadamard_signs",
    "FactoredValues",
    "fake_quantize",
    "fake_quantize_factored",
    "quantize",
]
