"""Build a Llama-style model whose linears and attention follow a recipe."""

from __future__ import annotations

import zlib

import torch

from fp4lab.nn.attention import AttentionQuant
from fp4lab.nn.fp4_linear import FP4Linear
from fp4lab.nn.model import Llama
from fp4lab.nn.model_config import ModelConfig
from fp4lab.nn.recipe import Recipe


def derive_seed(seed: int, name: str) -> int:
    """A per-component seed that is stable across processes (Python's hash() is salted)."""
    return zlib.crc32(f"{seed}:{name}".encode())


def build_model(
    config: ModelConfig, recipe: Recipe, *, seed: int, device: torch.device | str = "cpu", tensor_cores: bool = False,
    fused_quantizers: bool = True, attention_kernel: str = "sdpa", mx_gemm: str = "bf16", producer_fusion: str = "off",
    recompute_gate_up: str = "off",
) -> Llama:
    """Every block linear gets the recipe's linear for its depth, the head gets the head recipe;
    each FP4Linear and each FP4 attention draws its random bits from its own seeded generator (on
    `device`, where the model is moved). `tensor_cores` runs every linear's GEMMs on bf16 tensor
    cores instead of the fp32 reference (fp4lab.nn.fp4_linear), with the fused quantizers where
    `fused_quantizers` (train.paths.ComputePaths decides each of these for a run), and FP4 attention's BF16
    GEMMs (`AttentionQuant.tensor_cores`); `mx_gemm` "fp8" runs their MXFP4 x
    MXFP4 GEMMs on FP8 tensor cores instead. `attention_kernel` "triton" runs unquantized attention
    as fp4lab.numerics.kernels.attention's flash attention, "sdpa" as PyTorch's. `producer_fusion` "on" fuses each
    feed-forward's SwiGLU into its W2's GEMMs (`FP4Linear.swiglu`: the same bits, fewer passes); "all"
    also the residual add and RMSNorm before each feed-forward into its W1's and W3's x operands
    (`FP4Linear.residual_rmsnorm`: the norm within a few ulps of nn.RMSNorm's). `recompute_gate_up`
    "eager" or "compiled" (as the model will run): each feed-forward whose W1 and W3 are FP4 on the
    tensor-core path, or plain bf16 outside the compiled graph (an FP4 model's bf16 blocks), makes gate
    and up again in its backward instead of keeping them (the same bits; `_recomputes_gate_up`)."""

    def make_linear(block_index: int | None, name: str, in_features: int, out_features: int) -> FP4Linear:
        if block_index is None:
            linear, path = recipe.head_linear(), name
        else:
            linear, path = recipe.linear_for_block(block_index, config.n_layers), f"layers.{block_index}.{name}"
        lora_rank = recipe.lora_svd_rank if block_index is not None and not linear.is_high_precision else 0
        layer = FP4Linear(in_features, out_features, linear, seed=derive_seed(seed, path), lora_rank=lora_rank)
        layer.tensor_cores = tensor_cores
        layer.fused_quantizers = fused_quantizers
        layer.mx_gemm = mx_gemm
        return layer

    embedding_dtype = torch.bfloat16 if recipe.embedding == "bf16" else torch.float32
    model = Llama(config, make_linear, embedding_dtype=embedding_dtype).to(device)
    linears = fp4_linears(model).values()
    emulated = any(not (linear.recipe.is_plain_bf16 and not linear.lora_rank) for linear in linears)
    for linear in linears:
        linear.traced_plain = not emulated
    for attention in model.attentions():
        attention.kernel = attention_kernel
    for block in model.layers:
        if isinstance(block.feed_forward.w2, FP4Linear):
            w2 = block.feed_forward.w2
            w2.fuse_swiglu = producer_fusion != "off" and w2.x_operands_fusable()
        if isinstance(block.feed_forward.w1, FP4Linear):
            w1 = block.feed_forward.w1
            w1.fuse_residual_rmsnorm = producer_fusion == "all" and w1.x_operands_fusable(shared=True)
        if recompute_gate_up != "off" and _recomputes_gate_up(block.feed_forward):
            feed_forward = block.feed_forward
            feed_forward.recompute_gate_up = recompute_gate_up
            feed_forward.w1.keeps_fprop_operands = feed_forward.w3.keeps_fprop_operands = True
    if recipe.attention.format != "bf16":
        for index, attention in enumerate(model.attentions()):
            generator = torch.Generator(device=device).manual_seed(derive_seed(seed, f"layers.{index}.attention"))
            attention.quant = AttentionQuant(recipe.attention.format, recipe.attention.ds_rounding, generator, tensor_cores)
    return model


def _recomputes_gate_up(feed_forward) -> bool:
    """W1 and W3 run the emulated tensor-core path, whose Function can keep its Fprop operands, or a
    plain bf16 F.linear outside the compiled graph (a bf16 block of an FP4 model; inside a graph the
    compiler decides what it keeps); not LoRA-SVD's sum of two branches; and W2 does not take gate and
    up into its own fused SwiGLU."""
    w1, w2, w3 = feed_forward.w1, feed_forward.w2, feed_forward.w3
    if not all(isinstance(w, FP4Linear) and w.tensor_cores and not w.lora_rank for w in (w1, w3)):
        return False
    emulated = not (w1.recipe.is_plain_bf16 or w3.recipe.is_plain_bf16)
    eager_plain = w1.recipe.is_plain_bf16 and w3.recipe.is_plain_bf16 and not (w1.traced_plain or w3.traced_plain)
    return (emulated or eager_plain) and not getattr(w2, "fuse_swiglu", False)


def fp4_linears(model: torch.nn.Module) -> dict[str, FP4Linear]:
    return {name: module for name, module in model.named_modules() if isinstance(module, FP4Linear)}


def attention_generators(model: Llama) -> list[torch.Generator]:
    """The random streams of FP4 attention, which checkpoints must carry (they are not parameters)."""
    return [a.quant.generator for a in model.attentions() if a.quant is not None and a.quant.generator is not None]


def graph_generators(model: Llama) -> list[torch.Generator]:
    """Every CUDA generator a training step draws from (the FP4 linears' and FP4 attention's): a CUDA
    graph registers them before capture (`CUDAGraph.register_generator_state`), so that each replay
    draws from the generator's current state and moves it on, as the eager step would."""
    linears = [linear.generator_for(linear.weight.device) for linear in fp4_linears(model).values() if linear.draws_random_bits()]
    return [g for g in linears + attention_generators(model) if g.device.type == "cuda"]


def cuda_graph_blocker(model: Llama) -> str | None:
    """Why one training step of `model` cannot be replayed from a CUDA graph, or None: every FP4
    linear is on the tensor-core path and every random bit comes from a CUDA generator
    (`graph_generators`)."""
    for name, linear in fp4_linears(model).items():
        reason = linear.graph_blocker()
        if reason is not None:
            return f"{name}: {reason}"
    for index, attention in enumerate(model.attentions()):
        generator = attention.quant.generator if attention.quant is not None else None
        if generator is not None and generator.device.type != "cuda":
            return f"layers.{index}.attention: FP4 attention draws dS's random bits from a generator on the CPU"
    return None
