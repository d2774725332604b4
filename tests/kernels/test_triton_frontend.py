"""The Triton kernels through Triton's GPU front end (Python AST -> TTIR for sm90), on any machine.

The interpreter runs kernels as Python and misses what only the compiler checks: statements after a
taken constexpr `return` are still compiled (a None pointer loaded there fails), loop-carried values
must keep their type, and torch.compile passes a Python float to a user kernel as fp64 where Triton's
own launcher passes fp32 (an fp64 factor widens the running sums of a loop). Each kernel here is built
in the variants the project launches, with float arguments typed both ways. No GPU is needed: this is
the front end only (no PTX), which is where those errors are raised. Every interpreted test does the
same for each kernel variant it launches (tests/interpreted.py, with `build_ttir` here); the variants
below are the FP4 attention and quantizer ones whose compile errors reached a GPU first.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from triton._C.libtriton import ir  # noqa: E402
from triton.backends import backends  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402

POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int32: "*i32", torch.int64: "*i64", torch.uint8: "*u8",
                 torch.float16: "*fp16", torch.float64: "*fp64", torch.int8: "*i8", torch.int16: "*i16", torch.bool: "*i1",
                 torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}  # fmt: skip
F32, BF16, I32, I64, U8 = (torch.empty(1, dtype=d) for d in list(POINTER_TYPES)[:5])
FLOAT_TYPES = {"triton launcher": "fp32", "torch.compile": "fp64"}


def build_ttir(kernel, float_type: str, constexprs: set[str] | None = None, **args) -> None:
    """Build `kernel`'s TTIR for sm90: tensors are pointers of their dtype, None and `constexprs` (by
    default the UPPER-case names) constexprs, bools i1, ints i32 (i64 past it) and floats `float_type`.
    Raises Triton's CompilationError."""
    signature, constants = {}, {}
    for name in kernel.arg_names:
        value = args[name]
        if (name.isupper() if constexprs is None else name in constexprs) or value is None:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        else:
            assert isinstance(value, float), name
            signature[name] = float_type
    target = GPUTarget("cuda", 90, 32)
    backend = backends["nvidia"].compiler(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    ASTSource(kernel, signature, constants).make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
    )


def strides(prefix: str) -> dict[str, int]:
    return {f"stride_{prefix}b": 4096, f"stride_{prefix}h": 1024, f"stride_{prefix}t": 64}


def attention_variants() -> dict[str, tuple]:
    from fp4lab.numerics.kernels import attention

    shared = {"q_ptr": BF16, "k_ptr": BF16, "v_ptr": BF16, "group": 2, "seq": 1024, "log2e_scale": 0.18,
              "HEAD_DIM": 64, "BLOCK_M": 64, "BLOCK_N": 64, "PRECISION": "tf32", "POLY": False}  # fmt: skip
    forward = {**shared, "out_ptr": F32, "lse2_ptr": F32, "row_max_ptr": F32, "row_entropy_ptr": F32, "logit_scale_ptr": None,
               **strides("q"), **strides("k"), **strides("v"), **strides("o"), "n_heads": 4, "sqrt_head_dim": 8.0, "SCALED": False}  # fmt: skip
    backward = {**shared, "grad_out_ptr": BF16, "lse2_ptr": F32, "delta_ptr": F32, "softmax_scale": 0.125,
                **strides("q"), **strides("k"), **strides("v"), **strides("g"), "logit_scale_ptr": None, "ds_seed_ptr": None,
                "ds_amax_ptr": None, "SCALED": False, "DS_FMT": 0, "DS_SR": False}  # fmt: skip
    grad_kv = {**backward, "grad_k_ptr": F32, "grad_v_ptr": F32, **strides("dk"), **strides("dv"), "n_kv_heads": 2,
               "q_seq_ptr": None, "q_seq_outer_ptr": None, "stride_sqb": 0, "stride_sqh": 0, "stride_sqt": 0, "stride_sqd": 0}  # fmt: skip
    grad_q = {**backward, "grad_q_ptr": F32, **strides("dq"), "n_heads": 4,
              "k_seq_ptr": None, "k_seq_outer_ptr": None, "stride_skb": 0, "stride_skh": 0, "stride_skt": 0, "stride_skd": 0}  # fmt: skip
    sequence = {"stride_sqb": 1024, "stride_sqh": 256, "stride_sqt": 1, "stride_sqd": 65536}

    def fp4(variant: dict, operand: str, fmt: int, sr: bool) -> dict:
        nvfp4 = fmt == 1
        return {**variant, f"{operand}_seq_ptr": BF16, f"{operand}_seq_outer_ptr": F32 if nvfp4 else None,
                **{k.replace("sq", f"s{operand}"): v for k, v in sequence.items()}, "logit_scale_ptr": F32 if nvfp4 else None,
                "SCALED": nvfp4, "ds_amax_ptr": I32, "DS_FMT": fmt, "ds_seed_ptr": I64 if sr else None, "DS_SR": sr}  # fmt: skip

    amax = {key: value for key, value in backward.items() if key not in ("softmax_scale", "ds_seed_ptr", "SCALED", "DS_FMT", "DS_SR", "PRECISION")}
    return {
        "forward": (attention._forward_kernel, forward),
        "forward fp4 (scaled logits)": (attention._forward_kernel, {**forward, "logit_scale_ptr": F32, "SCALED": True}),
        "dK/dV": (attention._grad_kv_kernel, grad_kv),
        "dK/dV nvfp4 dS, SR": (attention._grad_kv_kernel, fp4(grad_kv, "q", 1, True)),
        "dK/dV mxfp4 dS, RTN": (attention._grad_kv_kernel, fp4(grad_kv, "q", 2, False)),
        "dQ": (attention._grad_q_kernel, grad_q),
        "dQ nvfp4 dS, SR": (attention._grad_q_kernel, fp4(grad_q, "k", 1, True)),
        "dQ mxfp4 dS, RTN": (attention._grad_q_kernel, fp4(grad_q, "k", 2, False)),
        "dS amax": (attention._grad_scores_amax_kernel, {**amax, "n_heads": 4, "logit_scale_ptr": F32, "ds_amax_ptr": I32}),
    }


def quantize_variants() -> dict[str, tuple]:
    from fp4lab.numerics.kernels import quantize

    rows = {"x_ptr": F32, "R": 64, "C": 64, "r_val": BF16, "r_codes": None, "r_scales": None, "r_signs": None, "r_seed": None,
            "r_u": F32, "r_amax": None, "r_outer": None, "r_stats": None, "BR": 32, "BC": 128, "EVEN": True, "ROW": True,
            "R_NV": 0, "R_MODE": 0, "R_H": 0, "R_SR": True, "R_GIVEN_U": True, "R_CODES": False, "R_VALUES": True, "R_STATS": False,
            "c_val": None, "c_codes": None, "c_scales": None, "c_signs": None, "c_seed": None, "c_u": None, "c_amax": None,
            "c_outer": None, "c_stats": None, "COL": False, "C_NV": 0, "C_MODE": 0, "C_H": 0, "C_SR": False, "C_GIVEN_U": False,
            "C_CODES": False, "C_VALUES": False, "C_STATS": False}  # fmt: skip
    tiles = {"x_ptr": F32, "R": 64, "C": 64, "val_ptr": BF16, "codes_ptr": None, "scales_ptr": None, "amax_ptr": None,
             "outer_ptr": None, "stats_ptr": None, "seed_ptr": None, "u_ptr": F32, "BR": 64, "BC": 64, "TH": 32, "TW": 32,
             "EVEN": True, "NV": 0, "MODE": 0, "CODES": False, "VALUES": True, "SQUARE": 0, "STATS": False, "SR": True, "GIVEN_U": True}  # fmt: skip
    return {
        "1D, given uniforms": (quantize._quantize_kernel, rows),
        "1D, RTN": (quantize._quantize_kernel, {**rows, "r_u": None, "R_SR": False, "R_GIVEN_U": False}),
        "1D nvfp4 Philox SR, both orientations": (quantize._quantize_kernel, {
            **rows, "r_u": None, "r_seed": I64, "R_GIVEN_U": False, "R_NV": 1, "r_amax": I32, "r_outer": F32,
            "COL": True, "c_val": BF16, "c_codes": U8, "c_scales": U8, "C_CODES": True, "C_VALUES": True}),  # fmt: skip
        "2D tiles, given uniforms": (quantize._tile_kernel, tiles),
        "2D tiles, Philox SR": (quantize._tile_kernel, {**tiles, "u_ptr": None, "seed_ptr": I64, "GIVEN_U": False}),
    }


@pytest.mark.parametrize("launcher", FLOAT_TYPES)
@pytest.mark.parametrize("family", ["attention", "quantize"])
def test_kernels_build_for_sm90_with_float_arguments_as_each_launcher_types_them(family, launcher):
    variants = attention_variants() if family == "attention" else quantize_variants()
    failed = {}
    for name, (kernel, args) in variants.items():
        try:
            build_ttir(kernel, FLOAT_TYPES[launcher], **args)
        except triton.compiler.errors.CompilationError as error:
            failed[name] = str(error).strip().splitlines()[-1]
    assert not failed, failed
