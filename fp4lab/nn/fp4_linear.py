"""FP4Linear: y = x W^T whose Fprop, Dgrad and Wgrad GEMMs each quantize their operands per recipe.

Emulation: operands are quantized with fp4lab.numerics (bit-exact encodings), decoded to float32 and
multiplied in float32, so every product of two decoded values is exact and accumulation is FP32 —
what an FP4 tensor core computes, up to summation order. BF16 operands are rounded to BF16 the same
way. What backward needs is saved in the representation the recipe gives it (packed FP4, BF16), not
as the full-precision activation.

The three GEMMs, their operands and the dim each operand is quantized along (its contraction dim):

    Fprop  y  [M, N] = x [M, K]  @ W [N, K]^T        fprop_x, fprop_w along K
    Dgrad  dx [M, K] = dy [M, N] @ (W^T [K, N])^T    dgrad_dy, dgrad_w along N
    Wgrad  dW [N, K] = dy^T [N, M] @ (x^T [K, M])^T  wgrad_dy, wgrad_x along M (tokens)

A transform (Hadamard) is applied to both operands of a GEMM along its contraction dim with one sign
vector, so the unquantized product is unchanged. The token dim M is zero-padded to a multiple of the
block and transform sizes for Wgrad (zeros add nothing to the product). A full-dimension transform
(rhtfull) pads each operand's contraction dim itself, to the power of two its sign vector spans
(`transform_length`), so its GEMMs take any in_features, out_features and token count. FP8 operands
are encoded with one current scale per tensor or per row (`numerics.fp8`; on CUDA by the fused
`numerics.kernels.fp8`, the same bits).

Three ways to run the same GEMMs (`FP4Linear.tensor_cores`, then `FP4Linear.mx_gemm`):

- reference (default, the CPU path CI checks): decoded operands in fp32, fp32 GEMMs, output in the
  input's dtype.
- tensor cores (the CUDA fast path): each FP4 operand is decoded to its block values (E2M1 times the
  block scale: exact in bf16), the GEMM runs on bf16 tensor cores with fp32 accumulation and an fp32
  result, and NVFP4's outer scales, which vary only along the rows of an operand, multiply that result
  (the epilogue, like the alpha of Blackwell's FP4 GEMMs); FP8 values (exact in bf16) and their per-tensor
  or per-row decode scales are split the same way, and where the GPU has FP8 tensor cores the FP8
  operands are float8 codes whose GEMMs run there (`torch._scaled_mm`, `nn.gemm.fp8_scaled_mm`: as
  torchao's float8 training, fast accumulation for Fprop only). A weight in 2D CTA-local tiles has one outer scale
  per 128 x 128 square, which changes along the contraction dim: its Fprop and Dgrad sum each chunk
  of K between square boundaries on its own and scale it (`tensor_core_mm`, `numerics.tile_gemm`). The products are the same exact numbers, so
  the two ways agree up to fp32 summation order (and one rounding of each decoded NVFP4 value that
  the reference makes when it folds the outer scale in). The output takes the autocast dtype (bf16
  activations) and the weight gradient stays fp32. An all-bf16 recipe is a plain `F.linear` on bf16
  casts, as in any bf16 PyTorch loop.
- FP8 tensor cores (tensor cores with mx_gemm = "fp8"): a GEMM whose two operands are both MXFP4
  (`FP4Linear.takes_fp8_gemm`) runs as `numerics.kernels.mx_gemm.mxfp4_matmul` on the operands' packed
  E2M1 codes and E8M0 scale bytes, which the quantizers then write (the fused ones write nothing else:
  `PackedOperand`; the torch ones add them to the values, `GemmOperand.packed`). Each 32-block is one FP8 dot, exact,
  scaled in fp32, so Fprop, Dgrad and Wgrad equal the fp32 GEMM of the decoded operands up to fp32
  summation order (within (K / 32)(u sum |a b| + 2^-149) of the exact product, u = 2^-24), and
  `numerics.mx_gemm.mxfp4_matmul_reference` of the same operands bit for bit; the output takes the
  same dtypes as on bf16 tensor cores, rounded once. Taken: 1D blocks of 32 along the contraction dim,
  any scale mode, rounding (RTN, SR) or Hadamard transform (both operands are quantized after it), the
  token dim zero-padded for Wgrad; 2D weight tiles (mxfp4-rowsr's 32 x 32; their sides are multiples
  of the 32-block), whose per-tile scales are exactly per-block scales repeated
  (`numerics.mx_gemm.along_k`), also transposed for Dgrad. Falls back to the bf16 tensor cores above:
  any GEMM with an NVFP4, FP8, bf16 or fp32 operand (so mixed formats, e.g. hybrid-operand's NVFP4
  Dgrad), and tensors where the kernel cannot run (`numerics.kernels.runs_on`: CUDA with
  Triton, or the CPU under Triton's interpreter). A K that is not a multiple of 32 never reaches it:
  MXFP4 operands are whole blocks along K. With mx_gemm = "bf16" nothing here changes a bit.

Producer fusion (`fuse_swiglu`, set on each feed-forward's W2 by producer_fusion = "on"): the
feed-forward calls `swiglu(gate, up)` instead of `self(F.silu(gate) * up)`; on the tensor-core path
one Triton kernel (`numerics.kernels.fusion.swiglu_quantize_fused`) reads gate and up and writes W2's
Fprop x and Wgrad x^T operands, so h is never written, and the backward makes d_gate and d_up from
Dgrad's dh in one kernel (`swiglu_backward_fused`). The same bits as the eager unfused ops (the
kernels equal the torch references bit for bit; stochastic rounding draws from the same Philox
seeds); under torch.compile the unfused SiLU is Inductor's, whose exp may round differently.
`fuses_swiglu` says where it falls back to the unfused ops. With producer_fusion = "all" each block
also hands the residual add and RMSNorm before its feed-forward to W1 (`residual_rmsnorm`,
`fuse_residual_rmsnorm`): one kernel (`kernels.fusion.residual_rmsnorm_quantize_fused`) writes h, the
normed activations and their Fprop x and Wgrad x^T operands, which it offers W1 and W3 through the
sibling slot; the norm's sum of squares runs in the kernel's fixed order, so the normed activations
are within a few ulps of nn.RMSNorm's (docs/BENCHMARKS.md: neither fusion gains step time on an H200).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor
else:  # a torch build without torch.distributed has no sharded weights
    DTensor = ()

from fp4lab.nn.gemm import fp8_gemm_operands, fp8_tensor_core_mm, tensor_core_mm
from fp4lab.nn.operands import (
    GemmOperand,
    PackedOperand,
    contraction_multiple,
    decode_operand,
    encode_operand,
    fp8_codes_fit,
    fp8_kernel_runs,
    fused_operand,
    fused_options,
    gemm_operand,
    kernel_options,
    operand_values,
    packed_form,
    transform_length,
    transform_operand,
    unpacked,
)
from fp4lab.nn.recipe import GEMMS, OPERANDS, LinearRecipe, OperandSpec
from fp4lab.numerics import Fp8Tensor, hadamard_signs, named_signs_on
from fp4lab.numerics.fusion import RMSNORM_MAX_WIDTH, rmsnorm_backward
from fp4lab.numerics.kernels import quantizer_covers, runs_on
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.quantize import DEFAULT_CTA_TILE
from fp4lab.numerics.survey import clip_flush_fractions, count_fractions


@dataclass(frozen=True)
class GatheredWeight:
    """A weight FSDP2 all-gathered as the encodings its GEMMs consume (fp4lab.train.encoded_gather):
    `encodings` maps "fprop_w" (W along in_features) or "dgrad_w" (W^T along out_features) to the
    encoding of the whole weight, bit for bit what the layer would make of the dense weight. `values`
    is the storage FSDP2 gives the unsharded parameter; it holds NaN, not W, so anything that reads the
    weight instead of an encoding shows it in the loss. `exact()` gathers W itself (a collective), for
    probes, which measure the encoding against W."""

    values: torch.Tensor
    encodings: dict
    exact: Callable[[], torch.Tensor]

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether `weight` is the unsharded parameter these encodings were gathered for."""
        return not isinstance(weight, DTensor) and weight.data_ptr() == self.values.data_ptr() != 0


class _SiblingOperands:
    """Sibling layers read one activation (wq, wk and wv read one normed x; w1 and w3 another). Where
    their x operands are deterministic (round to nearest, no random signs) the first layer's quantized
    x and x^T serve the others: the same bits, quantized once and saved once for backward. One slot,
    identified by the activation (by identity and version) and the operands' specs; emptied when a
    backward pass starts, so nothing is kept past the forward that made it."""

    def __init__(self):
        self._slot = None

    def get(self, x: torch.Tensor, key: tuple, make):
        slot = self._slot
        if slot is not None and slot[0]() is x and slot[1] == x._version and slot[2] == key:
            return slot[3]
        value = make()
        self._slot = (weakref.ref(x), x._version, key, value)
        return value

    def put(self, x: torch.Tensor, key: tuple, value) -> None:
        """Offer operands made elsewhere (a fused producer) for x: the siblings' `get` then finds them."""
        self._slot = (weakref.ref(x), x._version, key, value)

    def clear(self) -> None:
        self._slot = None


SIBLING_OPERANDS = _SiblingOperands()


def _activation_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear returns: the autocast dtype inside an autocast region (as nn.Linear), else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class _TensorCoreFP4LinearFunction(torch.autograd.Function):
    """The recipe's three GEMMs on tensor cores (see the module docstring). Backward keeps what the
    reference keeps: Wgrad's x^T operand, encoded from the exact activation at forward time."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, layer: FP4Linear) -> torch.Tensor:
        out_dtype = _activation_dtype(x)
        with torch.autocast(x.device.type, enabled=False):  # every GEMM here picks its own dtypes
            x2 = x.reshape(-1, x.shape[-1])
            g = layer.generator_for(x.device)
            signs = layer.draw_all_signs(g, x2.shape[0])
            # x and x^T (Fprop, Wgrad) from one read of x
            x_operands = layer.x_operands(x, lambda: layer.operand_pair(
                ("fprop_x", "wgrad_x"), x2, (signs["fprop"], signs["wgrad"]), g, keep_packed=True,
                keep_row_packed=layer.keeps_fprop_operands))
            return _gemms_forward(ctx, x, x_operands, weight, layer, signs, out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        with torch.autocast(grad_out.device.type, enabled=False):
            grad_x, grad_w = _gemms_backward(ctx, grad_out, ctx.needs_input_grad[0])
        return grad_x, grad_w, None


class _SwigluFP4LinearFunction(torch.autograd.Function):
    """w2(silu(gate) * up) with the SwiGLU fused into its neighbours (Format-Aware Fusion, section 3):
    forward, one kernel reads gate and up and writes W2's Fprop x and Wgrad x^T operands, never h;
    backward, Dgrad's dh and the SiLU derivative make d_gate and d_up in one kernel. The same bits as
    `layer(F.silu(gate) * up)` on the tensor-core path (`FP4Linear.swiglu`)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, layer: FP4Linear) -> torch.Tensor:
        out_dtype = _activation_dtype(gate)
        with torch.autocast(gate.device.type, enabled=False):
            gate2, up2 = (t.reshape(-1, t.shape[-1]).contiguous() for t in (gate, up))
            signs = layer.draw_all_signs(layer.generator_for(gate.device), gate2.shape[0])
            x_operands = layer.swiglu_operands(gate2, up2, signs)
            ctx.save_for_backward(gate2, up2)
            return _gemms_forward(ctx, gate, x_operands, weight, layer, signs, out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        from fp4lab.numerics.kernels import fusion as triton_fusion

        gate2, up2 = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            grad_h, grad_w = _gemms_backward(ctx, grad_out, True)
            grads = triton_fusion.swiglu_backward_fused(grad_h.reshape(gate2.shape).contiguous(), gate2, up2)
        return grads.d_gate.view(ctx.x_shape), grads.d_up.view(ctx.x_shape), grad_w, None


class _ResidualRmsnormFunction(torch.autograd.Function):
    """(h, n) = (x + branch, rmsnorm(h) * weight) from one kernel that also quantizes n into the x
    operands of the layer after it (Format-Aware Fusion, section 3), left in `layer._produced_operands`
    for `FP4Linear.residual_rmsnorm` to offer its siblings. n is nn.RMSNorm's formula with the mean of
    squares summed in a fixed order (`numerics.fusion.rmsnorm_reference`, bit for bit): within a few
    ulps of torch's rms_norm, whose order is its own. The backward is RMSNorm's, in float32:
    ds = dh + rstd (dt - t mean(dt t)) with t = s rstd and dt = dn weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, eps: float, layer: FP4Linear):
        from fp4lab.numerics.kernels import fusion as triton_fusion

        shape = x.shape
        with torch.autocast(x.device.type, enabled=False):
            x2, branch2 = (t.reshape(-1, shape[-1]).contiguous() for t in (x, branch))
            # Deterministic x operands (fuses_residual_rmsnorm): their signs, if any, are fixed, not drawn.
            g = layer.generator_for(x.device)
            signs = {gemm: layer.draw_signs(layer.recipe, gemm, g, length) for gemm, length in (("fprop", shape[-1]), ("wgrad", x2.shape[0]))}
            row, col = layer.x_operand_options(x2, signs)
            fused = triton_fusion.residual_rmsnorm_quantize_fused(x2, branch2, weight.detach().contiguous(), eps, col=col, emit_normed=True, **row)
        layer._produced_operands = (
            fused_operand(fused.row, row["fmt"], tuple(x2.shape)), fused_operand(fused.col, col["fmt"], tuple(x2.T.shape)))
        ctx.save_for_backward(fused.residual, fused.rstd, weight)
        ctx.x_dtype, ctx.branch_dtype = x.dtype, branch.dtype
        return fused.residual.view(shape), fused.normed.view(shape)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor | None, grad_normed: torch.Tensor | None):
        s, rstd, weight = ctx.saved_tensors
        shape = grad_h.shape if grad_h is not None else grad_normed.shape
        grad_weight = None
        if grad_normed is None:
            grad_s = grad_h.reshape(s.shape).float()
        else:
            grad_s, grad_weight = _rmsnorm_backward(s.device)(s, rstd, weight, grad_normed.reshape(s.shape), None if grad_h is None else grad_h.reshape(s.shape))
        grad_s = grad_s.reshape(shape)
        return grad_s.to(ctx.x_dtype), grad_s.to(ctx.branch_dtype), grad_weight, None, None


def _rmsnorm_backward(device: torch.device):
    """`numerics.fusion.rmsnorm_backward`, compiled by Inductor on CUDA (one or two kernels where the
    eager ops make about ten float32 passes over s, which cost more than the fused forward saves); eager
    elsewhere (the CPU tests run the fused kernels in Triton's interpreter, without a C++ compiler to
    assume)."""
    return _compiled_rmsnorm_backward() if device.type == "cuda" else rmsnorm_backward


@functools.cache
def _compiled_rmsnorm_backward():
    return torch.compile(rmsnorm_backward, dynamic=False)


def _gemms_forward(ctx, x, x_operands, weight: torch.Tensor, layer: FP4Linear, signs, out_dtype: torch.dtype) -> torch.Tensor:
    """Fprop of x's operands (x, x^T) with W's, whose encodings for Fprop and Dgrad come from one read
    of W (unless 2D tiles make W^T's encoding the transpose of W's, or FSDP2 all-gathered them); ctx
    keeps what `_gemms_backward` needs."""
    recipe, g = layer.recipe, layer.generator_for(weight.device)
    x_op, xt_op = x_operands
    gathered = layer.gathered_encoding("fprop_w", weight, signs["fprop"])
    ctx.gathered_weight = None
    if gathered is not None:  # signs=None: the encoding is made, the NaN placeholder is not transformed
        w_op = gemm_operand(weight, recipe.fprop_w, None, g, encoded=gathered, keep_codes=layer.wants_codes("fprop_w", weight.device))
        wt_op = w_op.T if recipe.shares_weight_encoding else None
        ctx.gathered_weight = weight  # Dgrad's encoding comes with the backward's all-gather of it
    elif recipe.shares_weight_encoding:  # Dgrad decodes Fprop's encoding, kept packed where possible
        w_op = layer.operand("fprop_w", weight, signs["fprop"], g, keep_packed=True)
        packed = packed_form(w_op)
        wt_op = packed.T if packed is not None else w_op.T
    else:
        w_op, wt_op = layer.operand_pair(("fprop_w", "dgrad_w"), weight, (signs["fprop"], signs["dgrad"]), g, keep_packed=True,
                                         keep_row_packed=layer.keeps_fprop_operands)
    out = layer.mm(x_op, w_op, out_dtype, fast_accum=True)

    ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
    ctx.layer, ctx.signs, ctx.wt_op, ctx.xt_op = layer, signs, wt_op, xt_op
    out_shape = (*x.shape[:-1], weight.shape[0])
    # The Fprop GEMM's own operands, for `recompute_output` (gate and up of a SwiGLU, `recompute`): as
    # codes and scales where the quantizer wrote them (their decode is the values, exactly), else values.
    ctx.fprop = (kept_form(x_op), kept_form(w_op), out_dtype, out_shape) if layer.keeps_fprop_operands else None
    return out.reshape(out_shape)


def kept_form(operand: GemmOperand | PackedOperand) -> GemmOperand | PackedOperand:
    """The operand as the backward keeps it: its codes and scales where written, else itself."""
    return packed_form(operand) or operand


# The key of a plain bf16 call's operands in its output's autograd node (`Node.metadata`).
PLAIN_FPROP = "fp4lab_plain_fprop"


def recompute_output(node) -> torch.Tensor:
    """The output of the FP4Linear call whose backward node is `node`, made again from the Fprop
    operands that call kept (`FP4Linear.keeps_fprop_operands`): the same GEMM on the same operands
    (decoded from their codes where kept so: the values the forward read), so the same bits. A plain
    bf16 call's operands are the bf16 x and weight its own backward keeps anyway."""
    plain = node.metadata.get(PLAIN_FPROP)
    if plain is not None:
        return F.linear(*plain)
    x_op, w_op, out_dtype, out_shape = node.fprop
    with torch.autocast(node.layer.weight.device.type, enabled=False):  # as in the forward
        return node.layer.mm(x_op, w_op, out_dtype, fast_accum=True).reshape(out_shape)


def recomputable(t: torch.Tensor) -> bool:
    """Whether t is the output of an FP4Linear call that kept its Fprop operands."""
    node = t.grad_fn
    return node is not None and (getattr(node, "fprop", None) is not None or PLAIN_FPROP in node.metadata)


class _Recompute:
    """A saved tensor given up for the FP4Linear backward node that can make it again."""

    __slots__ = ("node",)

    def __init__(self, node):
        self.node = node


class _Delegated:
    """A saved tensor packed by the saved-tensor hooks that were active around ours (a checkpoint's,
    a memory count's), to be unpacked by theirs."""

    __slots__ = ("packed", "unpack")

    def __init__(self, packed, unpack):
        self.packed, self.unpack = packed, unpack


def _unpack_saved(saved):
    if isinstance(saved, _Recompute):
        return recompute_output(saved.node)
    if isinstance(saved, _Delegated):
        return saved.unpack(saved.packed)
    return saved


@torch.compiler.disable
def swiglu_recomputing_inputs(gate: torch.Tensor, up: torch.Tensor, compiled: bool) -> torch.Tensor:
    """F.silu(gate) * up whose backward makes gate and up again from their linears' Fprop operands
    (`recompute_output`) instead of keeping them: a feed-forward's largest activations, two bf16 values
    a hidden element, give way to the shared x operand its W1 and W3 already made. Saved-tensor hooks
    hand the SwiGLU's backward the recomputed tensors, the same values, so its bits do not change.
    `compiled`: the SwiGLU runs as Inductor compiles it, as it does inside a compiled model (eager code
    around the compiled call, since hooks inside a traced frame make Dynamo run the ops eagerly)."""
    # Matched by memory, not by object: a compiled graph may save an alias of its input.
    sources = {_where(t): t.grad_fn for t in (gate, up) if recomputable(t)}
    # The hooks active around this call (torch's own accessor; AOTAutograd reads them the same way):
    # the tensors ours do not take go to them, so the two compose.
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)

    def pack(t: torch.Tensor):
        node = sources.get(_where(t))
        if node is not None:
            return _Recompute(node)
        return t if outer is None else _Delegated(outer[0](t), outer[1])

    with torch.autograd.graph.saved_tensors_hooks(pack, _unpack_saved):
        return (_compiled_swiglu() if compiled else _swiglu)(gate, up)


def _where(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@functools.cache
def _compiled_swiglu():
    return torch.compile(_swiglu)


def _gemms_backward(ctx, grad_out: torch.Tensor, needs_grad_x: bool) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Dgrad (x's gradient, in x's shape and dtype, if needed) and Wgrad from what `_gemms_forward` kept."""
    SIBLING_OPERANDS.clear()
    layer, signs = ctx.layer, ctx.signs
    g = layer.generator_for(grad_out.device)
    dy = grad_out.reshape(-1, grad_out.shape[-1])
    dy_op, dyt_op = layer.operand_pair(("dgrad_dy", "wgrad_dy"), dy, (signs["dgrad"], signs["wgrad"]), g)
    wt_op = ctx.wt_op
    if wt_op is None and needs_grad_x:
        gathered = layer.gathered_encoding("dgrad_w", ctx.gathered_weight, signs["dgrad"])
        if gathered is None:  # never quantize the NaN placeholder
            raise RuntimeError("FP4Linear: the backward found no all-gathered encoding of this weight")
        keep_codes = layer.wants_codes("dgrad_w", grad_out.device)
        wt_op = gemm_operand(ctx.gathered_weight.T, layer.recipe.dgrad_w, None, g, encoded=gathered, keep_codes=keep_codes)
    grad_x = layer.mm(dy_op, wt_op, ctx.x_dtype).reshape(ctx.x_shape) if needs_grad_x else None
    grad_w = layer.mm(dyt_op, ctx.xt_op, torch.float32)
    return grad_x, grad_w


class _FP4LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, layer: FP4Linear) -> torch.Tensor:
        recipe, g = layer.recipe, layer.generator_for(x.device)
        signs = layer.draw_all_signs(g, x.numel() // x.shape[-1])

        def x_operands():
            # Wgrad's x^T is encoded now, from the exact activation, and saved in that (packed) form.
            x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
            x_hat = layer.consume("fprop_x", x2, signs["fprop"], g)
            xt = _pad_last(x2.T, contraction_multiple(recipe, "wgrad"))
            xt_enc = encode_operand(xt, recipe.wgrad_x, signs["wgrad"], g)
            layer.record("wgrad_x", xt, xt_enc, signs["wgrad"])
            return x_hat, xt_enc

        x_hat, xt_enc = layer.x_operands(x, x_operands)
        gathered = layer.gathered_encoding("fprop_w", weight, signs["fprop"])
        if recipe.shares_weight_encoding:  # Dgrad will decode this same encoding: keep it packed
            w_enc = gathered
            if w_enc is None:
                w_enc = encode_operand(weight, recipe.fprop_w, signs["fprop"], g)
                layer.record("fprop_w", weight, w_enc, signs["fprop"])
            w_hat = decode_operand(w_enc)
        elif gathered is not None:
            w_enc, w_hat = None, decode_operand(gathered)
        else:
            w_enc, w_hat = None, layer.consume("fprop_w", weight, signs["fprop"], g)
        out = x_hat @ w_hat.T

        ctx.layer, ctx.signs = layer, signs
        ctx.x_shape, ctx.xt_enc, ctx.w_enc = x.shape, xt_enc, w_enc
        ctx.save_for_backward(weight)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        SIBLING_OPERANDS.clear()
        (weight,) = ctx.saved_tensors
        layer, signs = ctx.layer, ctx.signs
        recipe, g = layer.recipe, layer.generator_for(grad_out.device)
        dy = grad_out.reshape(-1, grad_out.shape[-1]).to(torch.float32)

        grad_x = None
        if ctx.needs_input_grad[0]:
            dy_hat = layer.consume("dgrad_dy", dy, signs["dgrad"], g)
            gathered = None if ctx.w_enc is not None else layer.gathered_encoding("dgrad_w", weight, signs["dgrad"])
            if ctx.w_enc is not None:  # 2D tiles: Q(W^T) = Q(W)^T, so Dgrad decodes Fprop's weight
                wt_hat = decode_operand(ctx.w_enc).T
            elif gathered is not None:
                wt_hat = decode_operand(gathered)
            else:
                wt_hat = layer.consume("dgrad_w", weight.T.contiguous(), signs["dgrad"], g)
            grad_x = (dy_hat @ wt_hat.T).reshape(ctx.x_shape)

        dyt = _pad_last(dy.T, contraction_multiple(recipe, "wgrad"))
        grad_w = layer.consume("wgrad_dy", dyt, signs["wgrad"], g) @ decode_operand(ctx.xt_enc).T
        return grad_x, grad_w, None


def _deterministic(spec: OperandSpec) -> bool:
    """Whether quantizing with `spec` draws no random bits (round to nearest, no random signs)."""
    return (not spec.is_fp4 or spec.rounding == "rtn") and (spec.transform == "none" or spec.transform_signs != "random")


def _pad_last(t: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-t.shape[-1]) % multiple
    return torch.nn.functional.pad(t, (0, pad)) if pad else t.contiguous()


# The extra state's philox base before one is drawn (philox_seed draws them in [0, 2**62)).
UNDRAWN_PHILOX_BASE = -1


class FP4Linear(nn.Module):
    """A bias-free linear layer with FP32 master weights and a per-operand FP4 recipe.

    `seed` seeds the layer's own generator, which drives stochastic rounding and random Hadamard
    signs; its state is part of the module's state_dict (extra state), so a resumed run draws the
    same bits. Set `probe = True` to record the fraction of saturated and flushed values per
    operand in `quant_stats` on the next forward/backward.

    With `lora_rank` > 0 (Full-Stack FP4's LoRA-SVD) the top singular directions of W, refreshed by
    `realign_low_rank()`, are applied in BF16 and only the residual W - U V^T goes through the FP4
    GEMMs; the gradient of W is unchanged in form (the factors are buffers).
    """

    def __init__(self, in_features: int, out_features: int, recipe: LinearRecipe, *, seed: int = 0, lora_rank: int = 0):
        super().__init__()
        _check_shape(in_features, out_features, recipe, lora_rank)
        self.in_features, self.out_features = in_features, out_features
        self.recipe, self.seed = recipe, seed
        self._contraction_multiples = {gemm: contraction_multiple(recipe, gemm) for gemm in GEMMS}
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.normal_(self.weight, std=in_features**-0.5)
        self._generator: torch.Generator | None = None
        self._philox_base: torch.Tensor | None = None
        # The tensor-core path quantizes with the fused Triton kernels where they cover a spec; False
        # keeps the torch reference quantizers (same random bits as the reference path, for checks).
        self.fused_quantizers = True
        # The tensor-core path keeps Wgrad's x^T operand packed between forward and backward.
        self.pack_saved = True
        self.probe = False
        self.quant_stats: dict[str, torch.Tensor] = {}  # operand -> [saturated, flushed] on the device
        self.lora_rank = lora_rank
        if lora_rank:
            self.register_buffer("lora_u", torch.zeros(out_features, lora_rank, dtype=torch.bfloat16))
            self.register_buffer("lora_v", torch.zeros(in_features, lora_rank, dtype=torch.bfloat16))
        self._traced_plain = True
        self.tensor_cores = False
        # "fp8": on the tensor-core path, MXFP4 x MXFP4 GEMMs run on FP8 tensor cores
        # (fp4lab.numerics.kernels.mx_gemm) instead of bf16 ones (module docstring: what falls back);
        # "bf16" keeps the decoded values.
        self.mx_gemm = "bf16"
        # Set by fp4lab.train.encoded_gather when FSDP2 all-gathers this weight as its GEMMs' encodings.
        self.gathered: GatheredWeight | None = None
        # A SwiGLU's W2: FeedForward calls `swiglu(gate, up)`, which fuses the SwiGLU into this layer's
        # x operands and into its backward where it can (producer fusion, `swiglu`).
        self.fuse_swiglu = False
        # The first of a block's feed-forward linears (w1): the block calls `residual_rmsnorm(x, branch,
        # norm)`, which fuses the residual add, the RMSNorm and the quantization of its x operands.
        self.fuse_residual_rmsnorm = False
        self._produced_operands: tuple | None = None
        # W1 and W3 of a feed-forward that recomputes gate and up in its backward (`recompute`): the
        # tensor-core path, or an eager plain bf16 call, keeps its Fprop operands for `recompute_output`.
        self.keeps_fprop_operands = False

    @property
    def tensor_cores(self) -> bool:
        """Run the GEMMs on bf16 tensor cores (True) or as the fp32 reference (False); module docstring."""
        return self._tensor_cores

    @tensor_cores.setter
    def tensor_cores(self, on: bool) -> None:
        self._tensor_cores = on
        self._choose_forward()

    @property
    def traced_plain(self) -> bool:
        """Whether torch.compile traces this layer where it is a plain bf16 linear (module docstring)."""
        return self._traced_plain

    @traced_plain.setter
    def traced_plain(self, on: bool) -> None:
        self._traced_plain = on
        self._choose_forward()

    def _choose_forward(self) -> None:
        # torch.compile traces a plain bf16 linear into the model's graph. An emulated one runs eagerly:
        # its per-layer seed and generator would specialise one graph per layer, and its quantizers
        # have kernels of their own. Disabling the bound forward makes the call itself the graph break.
        # In a model that also has emulated layers, the blocks' compiled code breaks at every linear call
        # (bf16 blocks share the FP4 blocks' code), so a traced plain layer would be compiled on its own,
        # once per weight shape and input dtype, past torch's recompile limit: there it runs eagerly too
        # (`build_model` sets `traced_plain`).
        plain = self.tensor_cores and self.recipe.is_plain_bf16 and not self.lora_rank
        if plain and self._traced_plain:
            self.forward = self._bf16_forward
        else:
            self.forward = torch.compiler.disable(self._bf16_forward if plain else self._emulated_forward)

    def _bf16_forward(self, x: torch.Tensor) -> torch.Tensor:
        operands = x.to(torch.bfloat16), self.weight.to(torch.bfloat16)
        out = F.linear(*operands)
        if self.keeps_fprop_operands and out.grad_fn is not None and not torch.compiler.is_compiling():
            out.grad_fn.metadata[PLAIN_FPROP] = operands  # the mm's backward keeps both already
        return out

    def _emulated_forward(self, x: torch.Tensor) -> torch.Tensor:
        function = _TensorCoreFP4LinearFunction if self.tensor_cores else _FP4LinearFunction
        if not self.lora_rank:
            return function.apply(x, self.weight, self)
        u, v = self.lora_u.to(torch.float32), self.lora_v.to(torch.float32)
        low_rank = x.to(torch.bfloat16).to(torch.float32) @ v @ u.T
        return (low_rank + function.apply(x, self.weight - u @ v.T, self)).to(_activation_dtype(x))

    @torch.no_grad()
    def realign_low_rank(self) -> None:
        """Refresh the BF16 factors to the current top-`lora_rank` singular directions of W."""
        weight = self.weight
        if isinstance(weight, DTensor):
            # FSDP2 holds W sharded between steps; the SVD needs all of it (a collective: every rank
            # calls this). Every rank decomposes the same matrix, so the replicated buffers agree.
            weight = weight.full_tensor()
        u, s, vh = torch.linalg.svd(weight.to(torch.float32), full_matrices=False)
        r = self.lora_rank
        self.lora_u.copy_((u[:, :r] * s[:r]).to(torch.bfloat16))
        self.lora_v.copy_(vh[:r].T.to(torch.bfloat16))

    def generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None or not _same_device(self._generator.device, device):
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def draw_all_signs(self, generator: torch.Generator, tokens: int) -> dict[str, torch.Tensor | None]:
        """The sign vectors of one forward and backward, in the order fprop, dgrad, wgrad (random ones
        drawn from `generator` in that order); the GEMMs contract over in_features, out_features and
        the `tokens` of this call."""
        lengths = {"fprop": self.in_features, "dgrad": self.out_features, "wgrad": tokens}
        return {gemm: self.draw_signs(self.recipe, gemm, generator, lengths[gemm]) for gemm in GEMMS}

    def draw_signs(self, recipe: LinearRecipe, gemm: str, generator: torch.Generator, length: int) -> torch.Tensor | None:
        """The sign vector of `gemm`, whose contraction dim has `length` elements: a transform block
        long, or for a full transform the padded length (`transform_length`)."""
        spec = recipe.operand(GEMMS[gemm][0])
        if spec.transform == "none":
            return None
        if spec.full_transform:
            return hadamard_signs(transform_length(recipe, gemm, length), "random", generator).to(generator.device)
        if spec.transform_signs == "random":
            return hadamard_signs(spec.transform_size, "random", generator).to(generator.device)
        return named_signs_on(spec.transform_size, spec.transform_signs, generator.device)

    def gathered_encoding(self, operand: str, weight: torch.Tensor, signs: torch.Tensor | None) -> QTensor | None:
        """The encoding of weight operand `operand` that FSDP2 all-gathered for `weight`, or None when
        `weight` is not a weight gathered that way. Probes measure it against W, gathered for them."""
        gathered = self.gathered
        if gathered is None or not gathered.holds(weight):
            return None
        if operand not in gathered.encodings:  # never silently quantize the NaN the storage holds
            raise RuntimeError(f"FP4Linear: the all-gather of this weight brought {sorted(gathered.encodings)}, not {operand}")
        encoded = gathered.encodings[operand]
        if self.probe:
            exact = gathered.exact()
            self.record(operand, exact if operand == "fprop_w" else exact.T.contiguous(), encoded, signs)
        return encoded

    def consume(self, operand: str, t: torch.Tensor, signs: torch.Tensor | None, generator) -> torch.Tensor:
        """The float32 values a GEMM reads for `operand` (probed through the packed encoding, which
        draws the same random bits, so probing never changes training)."""
        spec = self.recipe.operand(operand)
        if self.probe and spec.is_quantized:
            encoded = encode_operand(t, spec, signs, generator)
            self.record(operand, t, encoded, signs)
            return decode_operand(encoded)
        return operand_values(t, spec, signs, generator)

    def takes_fp8_gemm(self, gemm: str, device: torch.device) -> bool:
        """Whether `gemm` runs on FP8 tensor cores: mx_gemm "fp8" on the tensor-core path, both operands
        MXFP4 (1D blocks, any scale mode, rounding or transform; or 2D tiles, which
        `numerics.mx_gemm.along_k` writes as 1D blocks), and the kernel runs on `device`."""
        if self.mx_gemm != "fp8" or not self.tensor_cores:
            return False
        both_mxfp4 = all(self.recipe.operand(name).format == "mxfp4" for name in GEMMS[gemm])
        return both_mxfp4 and runs_on(device)

    def wants_codes(self, name: str, device: torch.device) -> bool:
        """Whether operand `name` is made with its codes and scales, for a GEMM on FP8 tensor cores."""
        return self.takes_fp8_gemm(next(gemm for gemm, pair in GEMMS.items() if name in pair), device)

    def mm(self, a: GemmOperand | PackedOperand, b: GemmOperand | PackedOperand, out_dtype: torch.dtype,
           fast_accum: bool = False) -> torch.Tensor:
        """a @ b^T of two operands: on FP8 tensor cores where mx_gemm is "fp8" and both are MXFP4
        encodings the kernel takes (`fp8_gemm_operands`), else `tensor_core_mm` of their values (on FP8
        tensor cores where both are float8 codes). `fast_accum`: Fprop's, as TransformerEngine and
        torchao set cuBLAS's FP8 fast accumulation for Fprop only."""
        operands = fp8_gemm_operands(a, b) if self.mx_gemm == "fp8" else None
        if operands is not None:
            return fp8_tensor_core_mm(*operands, out_dtype)
        return tensor_core_mm(unpacked(a), unpacked(b), out_dtype, fast_accum)

    def operand(
        self, name: str, t: torch.Tensor, signs: torch.Tensor | None, generator, keep_packed: bool = False,
        saved_only: bool = False,
    ) -> GemmOperand | PackedOperand:
        """The tensor-core operand `name` of t, quantized along its last dim: by the fused kernel where
        it covers the spec (CUDA), else by the torch reference (probed through the packed encoding,
        as `consume`). `keep_packed`: the operand is also saved for the backward pass, so the kernel
        writes its packed codes and scales too (`GemmOperand.packed`). An operand of a GEMM on FP8
        tensor cores (`wants_codes`) is made with its codes and scales; the fused kernel writes only
        those (`PackedOperand`), as the GEMM reads nothing else. `saved_only`: the operand is only saved
        for the backward pass (the pair's second, e.g. Wgrad's x^T through the full transform), so the
        kernel writes its codes and scales alone, as `operand_pair` keeps its saved operand."""
        spec = self.recipe.operand(name)
        if self.takes_fused_fp8(spec, signs, t):
            return self._fused_fp8(t, [(spec, False)])[0]
        codes = self.wants_codes(name, t.device)
        tensor_amax = None
        if self.takes_fused_full_transform(spec, signs, t):
            # The transform by its kernel (the reference's bits), then the fused quantizer takes the
            # transformed operand as one without a transform (its SR bits from the Philox stream),
            # and NVFP4's tensor amax from the transform kernel instead of a read of its own.
            from fp4lab.numerics.kernels.hadamard import hadamard_full_fused

            if spec.format == "nvfp4" and spec.tile is None and signs.numel() % 16 == 0:
                t, tensor_amax = hadamard_full_fused(t, signs, with_amax=True)
            else:
                t = hadamard_full_fused(t, signs)
            spec, signs = dataclasses.replace(spec, transform="none"), None
        options = kernel_options(spec, signs, t, self.philox_seed) if self.fused_quantizers else None
        if options is not None and tensor_amax is not None:
            options["tensor_amax"] = tensor_amax
        if options is not None:
            if codes or (saved_only and self.pack_saved):
                options |= {"emit_codes": True, "emit_values": False}
            elif keep_packed and self.pack_saved:
                options["emit_codes"] = True
            return self._fused(t, [(name, options, False)])[0]
        encoded = None
        if self.probe and spec.is_quantized:
            encoded = encode_operand(t, spec, signs, generator)
            self.record(name, t, encoded, signs)
        return gemm_operand(t, spec, signs, generator, encoded, keep_codes=codes)

    def operand_pair(
        self,
        names: tuple[str, str],
        t: torch.Tensor,
        signs: tuple[torch.Tensor | None, torch.Tensor | None],
        generator,
        keep_packed: bool = False,
        keep_row_packed: bool = False,
    ) -> tuple[GemmOperand | PackedOperand, GemmOperand | PackedOperand]:
        """Operand names[0] of t (blocked along its last dim) and names[1] of t^T (blocked along t's
        rows, which are zero-padded to the GEMM's contraction multiple): one read of t when the fused
        kernel covers both specs. `keep_packed`: names[1] is saved for the backward pass, so the
        kernel writes it as packed codes and scales only (`PackedOperand`); so it does for an operand
        of a GEMM on FP8 tensor cores (`wants_codes`). `keep_row_packed`: names[0] is also kept for
        the backward (`keeps_fprop_operands`), so its codes and scales are written beside its values."""
        row_name, col_name = names
        multiple = self._contraction_multiples[next(g for g, pair in GEMMS.items() if col_name in pair)]
        row_spec, col_spec = self.recipe.operand(row_name), self.recipe.operand(col_name)
        if t.shape[0] % multiple == 0 and self.takes_fused_fp8(row_spec, signs[0], t) and self.takes_fused_fp8(col_spec, signs[1], t):
            return tuple(self._fused_fp8(t, [(row_spec, False), (col_spec, True)]))
        # Both covered, or neither from here: no Philox seed is drawn for a request that is not made.
        covered = self.fused_quantizers and t.shape[0] % multiple == 0 and all(
            spec.tile is None and quantizer_covers(spec) for spec in (row_spec, col_spec)
        )
        row = kernel_options(row_spec, signs[0], t, self.philox_seed) if covered else None
        col = kernel_options(col_spec, signs[1], t, self.philox_seed) if row is not None else None
        if row is not None and col is not None:
            if self.wants_codes(row_name, t.device):
                row = row | {"emit_codes": True, "emit_values": False}
            elif keep_row_packed and self.pack_saved:
                row = row | {"emit_codes": True}
            if (keep_packed and self.pack_saved) or self.wants_codes(col_name, t.device):
                col = col | {"emit_codes": True, "emit_values": False}
            return tuple(self._fused(t, [(row_name, row, False), (col_name, col, True)]))
        # The full transform's kernel pads and reads t^T in place: no transposed copy
        in_place = multiple == 1 and self.takes_fused_full_transform(col_spec, signs[1], t)
        col = t.T if in_place else _pad_last(t.T, multiple)
        return (self.operand(row_name, t, signs[0], generator, keep_packed=keep_row_packed and self.pack_saved),
                self.operand(col_name, col, signs[1], generator, saved_only=keep_packed))

    def takes_fused_full_transform(self, spec: OperandSpec, signs: torch.Tensor | None, t: torch.Tensor) -> bool:
        """Whether a full-dimension transform runs as its Triton kernel (`numerics.kernels.hadamard`):
        fused quantizers on, a 2D operand whose padded length the kernel takes, and the kernels run on
        t; the transformed operand is then quantized by the fused quantizer where it covers the spec."""
        if not (spec.full_transform and signs is not None and self.fused_quantizers and t.dim() == 2 and runs_on(t.device)):
            return False
        from fp4lab.numerics.kernels.hadamard import fits

        return fits(signs.numel())

    def takes_fused_fp8(self, spec: OperandSpec, signs: torch.Tensor | None, t: torch.Tensor) -> bool:
        """Whether an FP8 operand comes from the fused FP8 quantizer (`numerics.kernels.fp8`): no
        transform, not a probing step (probes record the torch encoding), and the kernel runs on t."""
        return (spec.format == "fp8" and signs is None and self.fused_quantizers and not self.probe
                and fp8_kernel_runs(t))

    def _fused_fp8(self, t: torch.Tensor, specs: list[tuple[OperandSpec, bool]]) -> list[GemmOperand]:
        """The FP8 operands of t for (spec, transposed) requests: one amax pass over t serves them all
        (a tensor amax, or the per-row and per-column ones of a rowwise pair), then one quantizing
        pass each."""
        from fp4lab.numerics.kernels.fp8 import fp8_amax_bits, fp8_quantize_fused

        def amax_of(spec: OperandSpec, transposed: bool) -> str:
            return "tensor" if spec.scaling == "tensor" else "cols" if transposed else "rows"

        t = t.contiguous()
        amaxes = fp8_amax_bits(t, **{name: True for name in {amax_of(*request) for request in specs}})
        operands = []
        for spec, transposed in specs:
            q = fp8_quantize_fused(t, spec.element, spec.scaling, pow2=spec.pow2_scale, transpose=transposed,
                                   codes=fp8_codes_fit(t), amax_bits=amaxes[amax_of(spec, transposed)])
            operands.append(GemmOperand(q.values, q.outer))
        return operands

    def _fused(self, t: torch.Tensor, requests: list[tuple[str, dict, bool]]) -> list[GemmOperand | PackedOperand]:
        """Run the fused quantizer for (name, options, transposed) requests on one read of t; on a
        probing step the kernel also counts each operand's saturated and flushed elements (`stats`),
        so probing reads nothing twice and never changes the bits a step draws."""
        from fp4lab.numerics.kernels import quantize as triton_quantize

        t = t.contiguous()
        if self.probe:
            requests = [(name, options | {"stats": torch.zeros(2, dtype=torch.int64, device=t.device)}, transposed)
                        for name, options, transposed in requests]
        if len(requests) == 2:
            outputs = triton_quantize.quantize_fused_both(t, row=requests[0][1], col=requests[1][1])
        else:
            outputs = [triton_quantize.quantize_fused(t, **requests[0][1])]
        operands = []
        for (name, options, transposed), q in zip(requests, outputs):
            shape = tuple(t.T.shape if transposed else t.shape)
            if self.probe:
                self.quant_stats[name] = count_fractions(options["stats"], t.numel())
            outer_cell = (options.get("cta_tile") or DEFAULT_CTA_TILE) if options["fmt"] == "nvfp4_cta" and options.get("tile") else None
            operands.append(fused_operand(q, options["fmt"], shape, options.get("tile"), outer_cell))
        return operands

    def x_operands(self, x: torch.Tensor, make):
        """`make()`: this layer's x operands (Fprop's x and Wgrad's x^T), shared with sibling layers
        that read the same x with the same deterministic specs (`_SiblingOperands`)."""
        key = self.sibling_key(x)
        return make() if key is None else SIBLING_OPERANDS.get(x, key, make)

    def sibling_key(self, x: torch.Tensor) -> tuple | None:
        """What identifies this layer's x operands of x among siblings, or None where they are not shared
        (probing, or an x operand that draws random bits: each layer draws its own)."""
        names = ("fprop_x", "wgrad_x")
        if self.probe or not all(_deterministic(self.recipe.operand(name)) for name in names):
            return None
        return (self.tensor_cores, *(self.recipe.operand(name) for name in names),
                self._contraction_multiples["wgrad"], self.fused_quantizers, self.pack_saved,
                *(self.wants_codes(name, x.device) for name in names))

    def x_operand_options(self, t: torch.Tensor, signs: dict) -> tuple[dict, dict]:
        """The fused kernels' options for Fprop's x (along t's last dim) and Wgrad's x^T made by a fused
        producer from t's inputs, as `operand_pair` asks for them: x^T kept packed for the backward,
        codes only for a GEMM on FP8 tensor cores."""
        row = fused_options(self.recipe.fprop_x, signs["fprop"], t, self.philox_seed)
        col = fused_options(self.recipe.wgrad_x, signs["wgrad"], t, self.philox_seed)
        if self.wants_codes("fprop_x", t.device):
            row |= {"emit_codes": True, "emit_values": False}
        if self.pack_saved or self.wants_codes("wgrad_x", t.device):
            col |= {"emit_codes": True, "emit_values": False}
        return row, col

    def x_operands_fusable(self, shared: bool = False) -> bool:
        """Whether a fused producer could ever make this layer's x operands, whatever the tensors: no
        LoRA-SVD (its bf16 branch reads x), both x operands FP4 formats the fused kernels cover without
        2D tiles, and with `shared` (one quantization serving sibling layers) drawn deterministically.
        build_model marks only such layers, so a bf16 layer never routes its block through the fused
        call (a graph break under torch.compile) to fall back."""
        specs = (self.recipe.fprop_x, self.recipe.wgrad_x)
        # The producers take one tensor amax per orientation: no CTA-local scales.
        if self.lora_rank or not all(quantizer_covers(spec) and spec.tile is None and spec.format != "nvfp4_cta" for spec in specs):
            return False
        return not shared or all(_deterministic(spec) for spec in specs)

    def _producer_covers_x(self, t: torch.Tensor) -> bool:
        """Whether a fused producer can make this layer's x operands of t ([..., in_features]) in place of
        its own quantizers: the tensor-core path with fused quantizers, x operands a producer can make
        (`x_operands_fusable`), not probing (probes record the operands from x), no forward hooks
        (operand capture reads x), tokens a multiple of Wgrad's contraction multiple (no padding), and
        the Triton kernels run on t's device."""
        if not (self.tensor_cores and self.fused_quantizers and self.x_operands_fusable()) or self.probe:
            return False
        if self._forward_hooks or self._forward_pre_hooks:
            return False
        tokens = t.numel() // t.shape[-1]
        return tokens % self._contraction_multiples["wgrad"] == 0 and runs_on(t.device)

    @torch.compiler.disable
    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """self(F.silu(gate) * up): the SwiGLU fused into this layer's GEMMs where `fuses_swiglu`
        (`_SwigluFP4LinearFunction`, the same bits), else the unfused ops (probing steps, hooks,
        devices without the kernels)."""
        if self.fuses_swiglu(gate, up):
            return _SwigluFP4LinearFunction.apply(gate, up, self.weight, self)
        return self(F.silu(gate) * up)

    def fuses_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> bool:
        """Whether `swiglu` fuses: fuse_swiglu is set, gate and up have one shape and dtype, and the
        fused producer can make this layer's x operands (`_producer_covers_x`)."""
        if not self.fuse_swiglu or gate.dtype != up.dtype or gate.shape != up.shape:
            return False
        return self._producer_covers_x(gate)

    def swiglu_operands(self, gate: torch.Tensor, up: torch.Tensor, signs: dict) -> tuple:
        """Fprop's x and Wgrad's x^T operands of h = silu(gate) * up, from one fused read of gate and up
        (`kernels.fusion.swiglu_quantize_fused`), with `operand_pair`'s options: x^T kept packed for the
        backward, codes only for a GEMM on FP8 tensor cores."""
        from fp4lab.numerics.kernels import fusion as triton_fusion

        row, col = self.x_operand_options(gate, signs)
        fused = triton_fusion.swiglu_quantize_fused(gate, up, col=col, **row)
        shapes = (tuple(gate.shape), tuple(gate.T.shape))
        return tuple(fused_operand(q, options["fmt"], shape) for q, options, shape in zip((fused.row, fused.col), (row, col), shapes))

    @torch.compiler.disable
    def residual_rmsnorm(self, x: torch.Tensor, branch: torch.Tensor, norm: nn.RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, norm(h)) for h = x + branch, the input of this layer and its siblings: where
        `fuses_residual_rmsnorm`, one Triton kernel (`kernels.fusion.residual_rmsnorm_quantize_fused`)
        writes h and norm(h) and quantizes norm(h) into the x operands this layer and its siblings
        would make of it, so none of them reads it again (`_ResidualRmsnormFunction`); else the
        unfused ops."""
        if not self.fuses_residual_rmsnorm(x, branch, norm):
            h = x + branch
            return h, norm(h)
        h, normed = _ResidualRmsnormFunction.apply(x, branch, norm.weight, norm.eps, self)
        operands, self._produced_operands = self._produced_operands, None
        SIBLING_OPERANDS.put(normed, self.sibling_key(normed), operands)
        return h, normed

    def fuses_residual_rmsnorm(self, x: torch.Tensor, branch: torch.Tensor, norm: nn.RMSNorm) -> bool:
        """Whether `residual_rmsnorm` fuses: fuse_residual_rmsnorm is set, x and branch have one shape
        (bf16 or fp32 each), the norm has a gain and an eps, its width fits the kernel's row, the x
        operands are shared among siblings (deterministic: one quantization serves them all), and the
        fused producer can make them (`_producer_covers_x`)."""
        if not self.fuse_residual_rmsnorm or x.shape != branch.shape or norm.weight is None or norm.eps is None:
            return False
        if {x.dtype, branch.dtype, norm.weight.dtype} - {torch.bfloat16, torch.float32} or x.shape[-1] > RMSNORM_MAX_WIDTH:
            return False
        if self.sibling_key(x) is None:
            return False
        return self._producer_covers_x(x)

    def record(self, operand: str, exact: torch.Tensor, encoded, signs: torch.Tensor | None) -> None:
        if not self.probe or not isinstance(encoded, (QTensor, Fp8Tensor)):
            return
        transformed = transform_operand(exact, self.recipe.operand(operand), signs)
        self.quant_stats[operand] = clip_flush_fractions(transformed, encoded)

    def philox_seed(self, device: torch.device) -> torch.Tensor:
        """A fresh int64 seed on the device for one stochastically rounded operand of the fused
        kernels: a per-layer base drawn once from the layer's generator, then counted up on the device.
        No generator is called step after step, so a CUDA graph can replay the step; the base is part
        of the extra state, so a resumed run draws the same bits."""
        if self._philox_base is None or not _same_device(self._philox_base.device, device):
            self._philox_base = torch.randint(2**62, (1,), generator=self.generator_for(device), device=device)
        seed = self._philox_base.clone()
        self._philox_base.add_(1)
        return seed

    def draws_random_bits(self) -> bool:
        """Whether a step of this layer draws from its generator (SR or random Hadamard signs)."""
        return not all(_deterministic(self.recipe.operand(name)) for name in OPERANDS)

    def graph_blocker(self) -> str | None:
        """Why a step of this layer cannot be replayed from a CUDA graph, or None. Every draw comes
        from the layer's generator on the weight's device (random signs, the torch quantizer's SR bits,
        the Philox bases of the fused kernels): a CUDA generator, which the graph registers
        (`graph_generators`) so that each replay draws the bits the eager step would."""
        if not self.tensor_cores:
            return "the fp32 reference path runs outside a CUDA graph (it is the exact reference, not a fast path)"
        if self.draws_random_bits() and self.weight.device.type != "cuda":
            return "its random bits come from a generator on the CPU; a CUDA graph replays draws of CUDA generators only"
        return None

    def get_extra_state(self) -> dict:
        # Tensors in every state, never None: a distributed checkpoint (torch.distributed.checkpoint)
        # loads into the state dict of a fresh model, whose entries must have the saved kinds. A
        # generator not made yet is saved as the freshly seeded one it would be; a philox base not
        # drawn yet as UNDRAWN_PHILOX_BASE (drawn bases are >= 0).
        device = self.weight.device
        if self._generator is None:
            state = torch.Generator(device=device).manual_seed(self.seed).get_state()
        else:
            state = self._generator.get_state()
        philox = self._philox_base
        philox = torch.full((1,), UNDRAWN_PHILOX_BASE, device=device) if philox is None else philox.clone()
        return {"seed": self.seed, "generator": state, "philox_base": philox}

    def set_extra_state(self, state: dict) -> None:
        self.seed = state["seed"]
        if state["generator"] is None:  # None in checkpoints from before the generator was always saved
            self._generator = None
        else:
            # In place where it exists: a captured CUDA graph draws from this very generator.
            if self._generator is None or not _same_device(self._generator.device, self.weight.device):
                self._generator = torch.Generator(device=self.weight.device)
            self._generator.set_state(state["generator"])
        saved = state.get("philox_base")  # absent in checkpoints from before the fused kernels
        if saved is None or saved.item() == UNDRAWN_PHILOX_BASE:
            self._philox_base = None
        elif self._philox_base is not None:
            self._philox_base.copy_(saved)  # in place: a captured CUDA graph counts up this tensor
        else:
            self._philox_base = saved.to(self.weight.device).clone()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, lora_rank={self.lora_rank}"


def _same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """"cuda" and "cuda:0" name one device (an index left out means the current one)."""
    a, b = torch.device(a), torch.device(b)
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _check_shape(in_features: int, out_features: int, recipe: LinearRecipe, lora_rank: int) -> None:
    for gemm, size, dim in (("fprop", in_features, "in_features"), ("dgrad", out_features, "out_features")):
        multiple = contraction_multiple(recipe, gemm)
        if size % multiple:
            raise ValueError(f"FP4Linear: {dim}={size} must be a multiple of {multiple} for the {gemm} operands of this recipe")
    for name in ("fprop_w", "dgrad_w"):
        tile = recipe.operand(name).tile
        if tile and (out_features % tile[0] or in_features % tile[1] or in_features % tile[0] or out_features % tile[1]):
            raise ValueError(f"FP4Linear: weight [{out_features}, {in_features}] is not divisible into {name} tiles {tile}")
    if lora_rank < 0 or lora_rank > min(in_features, out_features):
        raise ValueError(f"FP4Linear: lora_rank={lora_rank} must be in [0, min(in_features, out_features)]")
