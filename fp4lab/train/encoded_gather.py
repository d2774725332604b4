"""FSDP2 all-gathers of FP4 and FP8 weights in the encoding their GEMMs consume (ZeRO++'s quantized weight
communication, done exactly), and the bytes those all-gathers move against a bf16 all-gather.

Under FSDP2 each rank holds rows of W [out_features, in_features] and the block's all-gather brings
the whole W before its forward and again before its backward. Here each rank instead quantizes its own
rows in the encoding the GEMM of that pass reads, and the all-gather moves those bytes (packed E2M1
codes and block scales, or FP8 values and per-row scales, as uint8):

    forward   fprop_w: W blocked along in_features (K)      the rows of a shard are whole rows of W
    backward  dgrad_w: W^T blocked along out_features (N)   each shard's rows hold whole blocks

2D tiles with one spec for both (`LinearRecipe.shares_weight_encoding`) are one encoding, gathered in
both passes. NVFP4's tensor scale and FP8's per-tensor scale come from the amax of the whole W, and
the per-row FP8 scales of W^T from the amaxes of its whole rows (each shard's amaxes, all-reduced with
MAX: `numerics.finite_amax`, `numerics.fp8.fp8_amax`), so every shard is quantized as one process
quantizes W. The layer decodes the gathered encoding instead of quantizing W
(`FP4Linear.gathered_encoding`).

Exact or dense: a weight is gathered encoded only where the quantization of a shard is, bit for bit,
those rows (columns) of the quantization of the whole W, which needs a weight operand spec that is
MXFP4, NVFP4 or FP8 (not CTA-local NVFP4: its outer scale spans 128 rows), round to nearest, no random or
full-dimension transform, blocks, tiles and transform blocks along N inside one shard (shard rows a
multiple of each), W split evenly over the ranks, and no LoRA-SVD (the GEMMs quantize W - U V^T). Both
ways to run the GEMMs take it (the fp32 reference, and the tensor cores, which read the encoding as
the factored operand `factored()` that their own quantizers must match bit for bit). Every
other weight is gathered dense, and `install` says which and why, once.

The hooks are FSDP2's all-gather extension (torch.distributed.fsdp, `fsdp_pre_all_gather` /
`fsdp_post_all_gather`, the contract torchao's float8 weights use), set as attributes of the plain
local shard: the sharded parameter stays a DTensor of fp32 rows, so the optimizers, gradient
clipping and distributed checkpoints see exactly what they see under a dense gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fp4lab.nn.build import fp4_linears
from fp4lab.nn.fp4_linear import FP4Linear, GatheredWeight, encode_operand, transform_operand
from fp4lab.nn.model import Llama
from fp4lab.nn.recipe import OperandSpec
from fp4lab.numerics import BLOCK_SIZE, Fp8Tensor
from fp4lab.numerics.fp8 import fp8_amax
from fp4lab.numerics.qtensor import QTensor
from fp4lab.numerics.quantize import finite_amax

GATHERED_FORMATS = ("mxfp4", "nvfp4", "fp8")
# The GEMM whose contraction each weight operand is blocked along (its sign vector's GEMM).
OPERAND_GEMM = {"fprop_w": "fprop", "dgrad_w": "dgrad"}


@dataclass
class GatherBytes:
    """The bytes of the encoded all-gathers (an all-gather's bytes: its output, ranks x each rank's
    input). A training step gathers each encoded weight twice (FSDP2 reshards every block after its
    forward and gathers it again for its backward): `encoded_per_step` bytes, against `bf16_per_step`
    for bf16 all-gathers of the same weights. `gathers` counts the all-gathers that did run, per pass,
    and `moved` their bytes (evaluation forwards included)."""

    encoded_per_step: int = 0
    bf16_per_step: int = 0
    gathers: dict[str, int] = field(default_factory=lambda: {"forward": 0, "backward": 0})
    moved: int = 0
    layers: list[str] = field(default_factory=list)
    dense: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One log line: how many weights gather encoded, and which gather dense and why."""
        reasons: dict[str, list[str]] = {}
        for name, why in self.dense.items():
            reasons.setdefault(why, []).append(name)
        dense = "; ".join(f"{why}: {', '.join(names)}" for why, names in reasons.items())
        return f"encoded weight all-gather: {len(self.layers)} FP4 linears encoded, {len(self.dense)} dense" + (f" ({dense})" if dense else "")

    def per_step(self) -> dict:
        """summary.json's gather_bytes_per_step."""
        return {
            "encoded": self.encoded_per_step,
            "bf16": self.bf16_per_step,
            "ratio": self.encoded_per_step / self.bf16_per_step if self.bf16_per_step else None,
            "encoded_layers": len(self.layers),
            "dense_layers": len(self.dense),
            "gathers": dict(self.gathers),
            "moved": self.moved,
        }


def dense_reason(layer: FP4Linear, rows: int, world: int) -> str | None:
    """Why `layer`'s weight must be gathered dense with `rows` rows per rank, or None when its encoding
    gathers exactly (module docstring)."""
    if layer.lora_rank:
        return "LoRA-SVD: its GEMMs quantize W - U V^T, not W"
    if layer.out_features % world:
        return f"out_features={layer.out_features} does not split evenly over {world} ranks"
    names = ("fprop_w",) if layer.recipe.shares_weight_encoding else ("fprop_w", "dgrad_w")
    for name in names:
        spec = layer.recipe.operand(name)
        if spec.format not in GATHERED_FORMATS:
            return f"{name} is {spec.format}"
        if spec.rounding != "rtn" or (spec.transform != "none" and spec.transform_signs == "random") or spec.full_transform:
            return f"{name} ({spec.describe()}) draws random bits or transforms the whole dim"
        # The rows of a shard are W's rows: Fprop's blocks lie inside them, Dgrad's (along N) and a
        # tile's rows must not cross a shard boundary (an FP8 scale's amax is all-reduced instead).
        along_rows = [spec.tile[0]] if spec.tile else []
        if name == "dgrad_w":
            along_rows = [spec.tile[1]] if spec.tile else [BLOCK_SIZE[spec.format]] if spec.is_fp4 else []
            along_rows.append(spec.transform_size or 1)
        if any(rows % n for n in along_rows):
            return f"{name}: {rows} rows per rank are not a multiple of {max(along_rows)}"
    return None


def encode_shard(layer: FP4Linear, name: str, shard: torch.Tensor, max_over_ranks) -> QTensor | Fp8Tensor:
    """Operand `name` of this rank's rows of W (fprop_w: the rows, blocked along K; dgrad_w: W^T's
    columns, blocked along N), with NVFP4's tensor scale and FP8's scales from the amax of the whole
    W (of whole rows of W^T): `max_over_ranks(amax)` replaces this shard's amax by the largest of
    every rank's, in place."""
    spec: OperandSpec = layer.recipe.operand(name)
    gemm = OPERAND_GEMM[name]
    length = layer.in_features if gemm == "fprop" else layer.out_features
    # Fixed signs only (dense_reason): no generator state is drawn.
    signs = layer.draw_signs(layer.recipe, gemm, layer.generator_for(shard.device), length)
    t = shard if name == "fprop_w" else shard.T.contiguous()
    t = transform_operand(t, spec, signs)
    amax = None
    if spec.format == "nvfp4":
        amax = finite_amax(t, spec.format, spec.tile)
    elif spec.format == "fp8" and (spec.scaling == "tensor" or name == "dgrad_w"):  # not Fprop's rows: whole here
        amax = fp8_amax(t, spec.scaling)
    if amax is not None:
        max_over_ranks(amax)
    return encode_operand(t, spec, None, None, amax=amax)


def shard_parts(q: QTensor | Fp8Tensor, name: str) -> list[torch.Tensor]:
    """The 2D uint8 tensors of a shard's encoding that differ from shard to shard: codes and block
    scales, FP8 values and Fprop's per-row FP8 scales. The rest (NVFP4's tensor scale, an FP8 scale of
    the tensor or of W^T's rows) comes from all-reduced amaxes: every rank has it."""
    if isinstance(q, QTensor):
        return [q.data, q.scales]
    parts = [q.data.view(torch.uint8)]
    if q.scaling == "row" and name == "fprop_w":
        parts.append(q.scale.view(torch.uint8))
    return parts


def pack(q: QTensor | Fp8Tensor, name: str, nbytes: int) -> torch.Tensor:
    """`shard_parts` as one uint8 vector of `nbytes` (zero-padded: both passes gather one size)."""
    flat = torch.cat([part.reshape(-1) for part in shard_parts(q, name)])
    return torch.nn.functional.pad(flat, (0, nbytes - flat.numel()))


def unpack(gathered: torch.Tensor, local: QTensor | Fp8Tensor, name: str, world: int, full_shape: tuple[int, int]):
    """The whole weight's encoding from the ranks' packed shards (rank-major, as FSDP2 gathers), as
    a QTensor or Fp8Tensor of W (fprop_w) or W^T (dgrad_w)."""
    per_rank = gathered.view(world, -1)
    parts, offset = [], 0
    for part in shard_parts(local, name):
        ranks = per_rank[:, offset : offset + part.numel()].reshape(world, *part.shape)
        offset += part.numel()
        if name == "fprop_w":  # shards stack along rows
            whole = ranks.reshape(-1, part.shape[-1])
        else:  # shards of W^T sit side by side along its last (blocked) dim
            whole = ranks.permute(1, 0, 2).reshape(part.shape[0], -1)
        # Copies: the layer may keep the encoding for its backward after FSDP2 frees the gathered buffer.
        parts.append(whole.clone())
    if isinstance(local, Fp8Tensor):
        scale = parts[1].view(torch.float32) if len(parts) > 1 else local.scale
        return Fp8Tensor(parts[0].view(local.data.dtype), scale, local.element, local.scaling)
    shape = full_shape if name == "fprop_w" else (full_shape[1], full_shape[0])
    return QTensor(
        parts[0], parts[1], local.tensor_scale, local.fmt, torch.Size(shape), local.block_size,
        tile=local.tile, scale_mode=local.scale_mode, cta_tile=local.cta_tile,
    )


def _hook(fsdp_param, param_group, layer: FP4Linear, group, ledger: GatherBytes) -> None:
    """Set the all-gather extension of one FSDP2 parameter of `param_group` (module docstring)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    names = ("fprop_w",) if layer.recipe.shares_weight_encoding else ("fprop_w", "dgrad_w")
    world = dist.get_world_size(group)
    full_shape = (layer.out_features, layer.in_features)
    rows = layer.out_features // world
    shard_bytes = {}
    for name in names:  # the byte size of each pass's encoding of one shard (shapes only)
        probe = encode_operand(torch.zeros(rows, layer.in_features) if name == "fprop_w" else torch.zeros(layer.in_features, rows),
                               layer.recipe.operand(name), None, None)
        shard_bytes[name] = sum(part.numel() for part in shard_parts(probe, name))
    nbytes = max(shard_bytes.values())

    def max_over_ranks(amax: torch.Tensor) -> None:
        # A MAX all-reduce may drop a NaN, which one process's amax (FP8's max |x|) keeps: carry it apart.
        both = torch.stack([torch.where(amax.isnan(), 0.0, amax), amax.isnan().to(amax.dtype)])
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        amax.copy_(torch.where(both[1] > 0, float("nan"), both[0]))

    ledger.encoded_per_step += 2 * world * nbytes
    ledger.bf16_per_step += 2 * 2 * layer.out_features * layer.in_features

    def fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy):
        backward = param_group._training_state == TrainingState.PRE_BACKWARD
        name = names[-1] if backward else names[0]
        local = encode_shard(layer, name, fsdp_param._sharded_local_tensor.detach(), max_over_ranks)
        ledger.gathers["backward" if backward else "forward"] += 1
        ledger.moved += world * nbytes
        return (pack(local, name, nbytes),), (name, local)

    def fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, *, out=None):
        name, local = metadata
        encoding = unpack(all_gather_outputs[0], local, name, world, full_shape)
        if out is None:
            values = torch.full(full_shape, float("nan"), dtype=param_dtype, device=local.data.device)
        else:  # FSDP2 reallocated the storage it freed at the last reshard: poison it again
            values = out
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.fill_(float("nan"))
        layer.gathered = GatheredWeight(values, {name: encoding}, lambda: _full_weight(fsdp_param))
        if out is None:
            return values, (values,)
        return None

    local_tensor = fsdp_param._sharded_local_tensor
    local_tensor.fsdp_pre_all_gather = fsdp_pre_all_gather
    local_tensor.fsdp_post_all_gather = fsdp_post_all_gather
    fsdp_param._init_extensions()  # FSDP2 looks for the hooks when it wraps: tell it they are there


def _full_weight(fsdp_param) -> torch.Tensor:
    with torch.no_grad():
        return fsdp_param.sharded_param.full_tensor()


def install(model: Llama) -> GatherBytes:
    """Gather the weights of `model`'s FP4 linears encoded where exact (after `fully_shard`, before the
    first forward); the returned ledger counts the bytes."""
    ledger = GatherBytes()
    linears = {id(linear): name for name, linear in fp4_linears(model).items()}
    for block in model.layers:
        group = block._get_fsdp_state()._fsdp_param_group
        if group is None:
            continue
        for fsdp_param in group.fsdp_params:
            layer = fsdp_param._module_info.module
            if id(layer) not in linears or fsdp_param._module_info.param_name != "weight":
                continue
            name = linears[id(layer)]
            shard_group = fsdp_param.shard_mesh_from_root.get_group()
            world = dist.get_world_size(shard_group)
            reason = dense_reason(layer, layer.out_features // world, world)
            if reason is not None:
                ledger.dense[name] = reason
                continue
            _hook(fsdp_param, group, layer, shard_group, ledger)
            ledger.layers.append(name)
    return ledger
