"""The Llama-style decoder fp4lab trains: config, presets, parameter count and the model.

Parameter names follow torchtitan exactly (`tok_embeddings`, `layers.{i}.attention.wq`, ...,
`layers.{i}.feed_forward.w1`, `norm`, `output`), so checkpoints and per-layer recipes read the same as
there. Every linear, the output head included, comes from a `make_linear` factory: that is where an
FP4 recipe plugs in. Parameters are fp32 master weights; the precision of each GEMM is the factory's.

Embedding output in BF16 is emulated: the looked-up rows are rounded to `embedding_dtype` and brought
back to fp32, and autograd's casts round their gradient to the same dtype on the way back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fp4lab.nn.attention import FP4_BLOCK_MULTIPLE, Attention, rope_tables

# (block_index or None for the output head, name such as "attention.wq", in_features, out_features)
MakeLinear = Callable[[int | None, str, int, int], nn.Module]
EMBEDDING_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a Llama-style decoder. head_dim = dim // n_heads."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_hidden: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int")
        for name in ("rope_theta", "norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} must be > 0")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelConfig.dim={self.dim} must be a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (GQA groups)"
            )
        if self.head_dim % FP4_BLOCK_MULTIPLE:
            raise ValueError(
                f"ModelConfig.n_heads={self.n_heads} gives head_dim={self.head_dim}, which must be a multiple of "
                f"{FP4_BLOCK_MULTIPLE} so FP4 blocks (nvfp4 16, mxfp4 32) fit along it; change dim or n_heads"
            )
        if self.ffn_hidden % FP4_BLOCK_MULTIPLE:
            raise ValueError(
                f"ModelConfig.ffn_hidden={self.ffn_hidden} must be a multiple of {FP4_BLOCK_MULTIPLE} so FP4 "
                "blocks fit along w2's input; round it with swiglu_hidden()"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def swiglu_hidden(dim: int, multiple_of: int = 256, multiplier: float = 1.0) -> int:
    """Llama's SwiGLU width: 8/3 * dim (the params of a 4*dim MLP), scaled, rounded up to multiple_of."""
    hidden = int(multiplier * int(8 * dim / 3))
    return multiple_of * math.ceil(hidden / multiple_of)


def count_parameters(config: ModelConfig) -> int:
    """Parameters of Llama(config): untied embedding and head, RMSNorm gains, no biases."""
    dim, kv_dim = config.dim, config.n_kv_heads * config.head_dim
    attention = 2 * dim * dim + 2 * dim * kv_dim  # wq, wo; wk, wv
    feed_forward = 3 * dim * config.ffn_hidden
    per_layer = attention + feed_forward + 2 * dim
    return 2 * config.vocab_size * dim + config.n_layers * per_layer + dim


# --- presets: (vocab_size, seq_len) -> ModelConfig -----------------------------------------------
#
# preset  dim  layers  heads/kv  head_dim  ffn   non-embedding params  params at vocab 32000 (50304)
# tiny    128     4      4/2        32      384         0.79M               8.98M   (13.67M)
# 125m    768    12     12/4        64     2048        75.52M             124.67M  (152.78M)
# 350m   1024    24     16/4        64     2816       270.58M             336.12M  (373.61M)
# 1b     2048    16     32/8        64     8192       973.15M            1104.22M (1179.19M)
#
# Embedding and head are untied, so each adds vocab_size * dim; count_parameters() is exact.


def tiny(vocab_size: int, seq_len: int) -> ModelConfig:
    """Trains a few hundred steps at batch 8 x 128 in about a minute on a laptop CPU.

    That holds for byte, character or few-thousand-token vocabularies: at GPT-2's 50k, embedding and
    head hold 94 % of the parameters, the head dominates the FLOPs, and a step is about 10x slower.
    """
    return ModelConfig(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=vocab_size,
        ffn_hidden=swiglu_hidden(128, multiple_of=64),
        max_seq_len=seq_len,
    )


def llama_125m(vocab_size: int, seq_len: int) -> ModelConfig:
    """GPT-2-small width and depth (768 x 12, head_dim 64) with 3-way GQA."""
    return ModelConfig(
        dim=768,
        n_layers=12,
        n_heads=12,
        n_kv_heads=4,
        vocab_size=vocab_size,
        ffn_hidden=swiglu_hidden(768),
        max_seq_len=seq_len,
    )


def llama_350m(vocab_size: int, seq_len: int) -> ModelConfig:
    """GPT-2-medium width and depth (1024 x 24, head_dim 64) with 4-way GQA."""
    return ModelConfig(
        dim=1024,
        n_layers=24,
        n_heads=16,
        n_kv_heads=4,
        vocab_size=vocab_size,
        ffn_hidden=swiglu_hidden(1024),
        max_seq_len=seq_len,
    )


def llama_1b(vocab_size: int, seq_len: int) -> ModelConfig:
    """Llama 3.2 1B's shape (2048 x 16, 32/8 heads, ffn 8192, theta 5e5), with its own untied head."""
    return ModelConfig(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=vocab_size,
        ffn_hidden=swiglu_hidden(2048, multiplier=1.5),
        max_seq_len=seq_len,
        rope_theta=500000.0,
    )


PRESETS: dict[str, Callable[[int, int], ModelConfig]] = {
    "tiny": tiny,
    "125m": llama_125m,
    "350m": llama_350m,
    "1b": llama_1b,
}


def preset(name: str, vocab_size: int, seq_len: int) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; allowed: {', '.join(map(repr, PRESETS))}")
    return PRESETS[name](vocab_size, seq_len)


# --- the model ----------------------------------------------------------------------------------


def default_linear(block_index: int | None, name: str, in_features: int, out_features: int) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=False)


def _build_linear(make_linear: MakeLinear, block_index: int | None, name: str, fan_in: int, fan_out: int) -> nn.Module:
    linear = make_linear(block_index, name, fan_in, fan_out)
    weight = getattr(linear, "weight", None)
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (fan_out, fan_in):
        shape = tuple(weight.shape) if isinstance(weight, torch.Tensor) else None
        raise ValueError(
            f"make_linear({block_index}, {name!r}, {fan_in}, {fan_out}) must return a module with a .weight of "
            f"shape ({fan_out}, {fan_in}), got {shape}"
        )
    return linear


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, linear: Callable[[str, int, int], nn.Module]):
        super().__init__()
        self.w1 = linear("w1", dim, hidden)
        self.w2 = linear("w2", hidden, dim)
        self.w3 = linear("w3", dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if getattr(self.w2, "fuse_swiglu", False):  # an FP4Linear that fuses the SwiGLU into its GEMMs
            return self.w2.swiglu(gate, up)
        return self.w2(F.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then + feed_forward(norm(.))."""

    def __init__(self, config: ModelConfig, block_index: int, make_linear: MakeLinear):
        super().__init__()

        def linear_for(module: str) -> Callable[[str, int, int], nn.Module]:
            return lambda name, fan_in, fan_out: _build_linear(
                make_linear, block_index, f"{module}.{name}", fan_in, fan_out
            )

        self.attention = Attention(config.dim, config.n_heads, config.n_kv_heads, linear_for("attention"))
        self.feed_forward = FeedForward(config.dim, config.ffn_hidden, linear_for("feed_forward"))
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)

    def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
        branch = self.attention(self.attention_norm(x), rope_cos, rope_sin)
        w1 = self.feed_forward.w1
        if getattr(w1, "fuse_residual_rmsnorm", False):  # an FP4Linear that fuses the add and the norm into its x operands
            h, normed = w1.residual_rmsnorm(x, branch, self.ffn_norm)
        else:
            h = x + branch
            normed = self.ffn_norm(h)
        return h + self.feed_forward(normed)


class Llama(nn.Module):
    """Llama-style decoder: tokens [batch, seq] (int64) -> logits [batch, seq, vocab] (fp32), causal.

    make_linear(block_index, name, in_features, out_features) builds every linear: block_index is None
    for the output head, name is e.g. "attention.wq" or "feed_forward.w2" (or "output"); the module
    must hold a .weight [out, in] and compute x @ weight.T. Default: nn.Linear(bias=False).
    embedding_dtype: torch.bfloat16 (default) or torch.float32, the precision the embedding output
    is rounded to (see the module docstring).
    """

    def __init__(
        self,
        config: ModelConfig,
        make_linear: MakeLinear | None = None,
        embedding_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        if embedding_dtype not in EMBEDDING_DTYPES:
            raise ValueError(f"Llama: embedding_dtype={embedding_dtype} is not supported; allowed: {EMBEDDING_DTYPES}")
        make_linear = make_linear or default_linear
        self.config = config
        self.embedding_dtype = embedding_dtype
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i, make_linear) for i in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = _build_linear(make_linear, None, "output", config.dim, config.vocab_size)
        # Derived from the config, so kept out of the state dict (as torchtitan does with freqs_cis).
        rope_cos, rope_sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", rope_cos, persistent=False)
        self.register_buffer("rope_sin", rope_sin, persistent=False)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """normal(0, init_std) everywhere; wo and w2 scaled by 1/sqrt(2 n_layers) (GPT-2), since each
        block adds both to the residual stream. RMSNorm gains start at 1."""
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=std)
        for layer in self.layers:
            attention, feed_forward = layer.attention, layer.feed_forward
            for linear in (attention.wq, attention.wk, attention.wv, feed_forward.w1, feed_forward.w3):
                nn.init.normal_(linear.weight, std=std)
            for linear in (attention.wo, feed_forward.w2):
                nn.init.normal_(linear.weight, std=residual_std)
            nn.init.ones_(layer.attention_norm.weight)
            nn.init.ones_(layer.ffn_norm.weight)
        nn.init.ones_(self.norm.weight)
        nn.init.normal_(self.output.weight, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"Llama: sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}")
        h = self.tok_embeddings(tokens).to(self.embedding_dtype).float()
        rope_cos, rope_sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            h = layer(h, rope_cos, rope_sin)
        return self.output(self.norm(h)).float()

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy; targets [batch, seq] (-100 entries are ignored)."""
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def attentions(self) -> list[Attention]:
        """The attention modules in block order, for the loop to toggle probes and FP4 attention."""
        return [layer.attention for layer in self.layers]
