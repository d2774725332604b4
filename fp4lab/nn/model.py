"""The Llama-style decoder fp4lab trains (its shape and presets: `fp4lab.nn.model_config`).

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

import torch
import torch.nn.functional as F
from torch import nn

from fp4lab.nn.attention import Attention, rope_tables
from fp4lab.nn.fp4_linear import swiglu_recomputing_inputs
from fp4lab.nn.model_config import ModelConfig

# (block_index or None for the output head, name such as "attention.wq", in_features, out_features)
MakeLinear = Callable[[int | None, str, int, int], nn.Module]
EMBEDDING_DTYPES = (torch.bfloat16, torch.float32)


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
        # "eager" or "compiled" (as the model runs): the backward makes gate and up again from W1's and
        # W3's Fprop operands instead of keeping them (FP4Linear's `swiglu_recomputing_inputs`).
        self.recompute_gate_up = "off"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if getattr(self.w2, "fuse_swiglu", False):  # an FP4Linear that fuses the SwiGLU into its GEMMs
            return self.w2.swiglu(gate, up)
        if self.recompute_gate_up != "off":
            return self.w2(swiglu_recomputing_inputs(gate, up, compiled=self.recompute_gate_up == "compiled"))
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

    def forward(self, tokens: torch.Tensor, fp32_logits: bool = True) -> torch.Tensor:
        """Logits in fp32; with fp32_logits=False in the head's own dtype (bf16 on the fast path)."""
        seq = tokens.shape[1]
        if seq > self.config.max_seq_len:
            raise ValueError(f"Llama: sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}")
        h = self.tok_embeddings(tokens).to(self.embedding_dtype).float()
        rope_cos, rope_sin = self.rope_cos[:seq], self.rope_sin[:seq]
        for layer in self.layers:
            h = layer(h, rope_cos, rope_sin)
        logits = self.output(self.norm(h))
        return logits.float() if fp32_logits else logits

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy; targets [batch, seq] (-100 entries are ignored)."""
        # The cast to fp32 sits beside the cross entropy rather than in forward: where torch.compile
        # breaks the graph between the two (at an FP4 recipe's eager linears), the loss's graph is
        # then handed bf16 logits and keeps those for its backward, not an fp32 copy (same values,
        # half the bytes: 1 GiB at 16 x 1024 tokens and a 32k vocabulary).
        logits = self(tokens, fp32_logits=False).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def attentions(self) -> list[Attention]:
        """The attention modules in block order, for the loop to toggle probes and FP4 attention."""
        return [layer.attention for layer in self.layers]
