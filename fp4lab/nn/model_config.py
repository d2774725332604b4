"""The decoder's shape: ModelConfig, the named presets and the parameter count.

Torch-free, so the orchestrator and the CLI read the preset names (`--model`) without importing torch;
the model itself is in `fp4lab.nn.model`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


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
        # Imported here, not at the top: reading the preset names (the CLI's --model choices) stays torch-free.
        from fp4lab.nn.attention import FP4_BLOCK_MULTIPLE

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
