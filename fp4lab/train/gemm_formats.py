"""The operand formats fp4lab.train.gemm_error compares by name (`fp4lab numerics --capture --format`),
in a torch-free module: `fp4lab numerics --help` lists them without importing torch."""

from __future__ import annotations

from fp4lab.nn.recipe import OperandSpec

# The built-in candidates: one spec for every operand, round to nearest, each along its contraction
# dim (fp8: per-tensor or per-row current scaling, as in fp4lab's fp8 recipes). Data, so a new format
# or transform of the recipe language is one more entry.
FORMATS: dict[str, OperandSpec] = {
    "bf16": OperandSpec("bf16"),
    "mxfp4": OperandSpec("mxfp4", scale_mode="floor"),
    "mxfp4-h32": OperandSpec("mxfp4", scale_mode="floor", transform="h32"),
    "mxfp4-rceil": OperandSpec("mxfp4", scale_mode="rceil"),
    "nvfp4": OperandSpec("nvfp4"),
    "nvfp4-h16": OperandSpec("nvfp4", transform="h16"),
    "nvfp4-rht16": OperandSpec("nvfp4", transform="rht16"),
    "nvfp4-rhtfull": OperandSpec("nvfp4", transform="rhtfull"),
    "nvfp4_cta": OperandSpec("nvfp4_cta"),
    "nvfp4_cta-h16": OperandSpec("nvfp4_cta", transform="h16"),
    "fp8-e4m3": OperandSpec("fp8", element="e4m3", scaling="tensor"),
    "fp8-e4m3-row": OperandSpec("fp8", element="e4m3", scaling="row"),
}
# Without --format: bf16 and the FP4 formats (FP8 is asked for by name: beside FP4 it would be every
# table's best and its E/E_best column's reference).
DEFAULT_FORMATS = tuple(name for name, spec in FORMATS.items() if spec.format != "fp8")
