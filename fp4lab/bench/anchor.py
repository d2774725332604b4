"""The anchor: a plain PyTorch Llama training step of fp4lab's model shape, as a researcher writes it.

No fp4lab code: `nn.Linear` without bias, `nn.RMSNorm`, RoPE, grouped-query SDPA (flash attention),
SwiGLU, an untied head, bf16 autocast with fp32 master weights, fused AdamW, gradient clipping and,
optionally, torch.compile of the forward and loss. Its tokens/s are what fp4lab's bf16 recipe must
match and its step time is what the FP4 recipes are measured against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fp4lab.nn.model_config import ModelConfig


class _Block(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = c.n_heads, c.n_kv_heads, c.head_dim
        self.attention_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.wq = nn.Linear(c.dim, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.dim, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.dim, bias=False)
        self.ffn_norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.w1 = nn.Linear(c.dim, c.ffn_hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.ffn_hidden, bias=False)
        self.w2 = nn.Linear(c.ffn_hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = _rope(self.wq(h).view(b, t, self.n_heads, self.head_dim), cos, sin).transpose(1, 2)
        k = _rope(self.wk(h).view(b, t, self.n_kv_heads, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(h).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(attn.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class PlainLlama(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layers))
        self.norm = nn.RMSNorm(c.dim, eps=c.norm_eps)
        self.head = nn.Linear(c.dim, c.vocab_size, bias=False)
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)
        angles = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=c.init_std)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# torchao's float8 training of the same loop, the peer of fp4lab's fp8 recipes: the name's torchao recipe
# (Float8LinearConfig.from_recipe_name) on every linear of the blocks; the head stays bf16, as fp4lab's.
TORCHAO_FLOAT8 = {"torchao-float8": "tensorwise", "torchao-float8-rowwise": "rowwise"}


def anchor_step(config: ModelConfig, device: torch.device, *, compile: bool, lr: float = 3e-4, float8: str | None = None):
    """A step function `step(tokens, targets) -> (loss, grad_norm)` of the plain loop; `float8`, a
    TORCHAO_FLOAT8 name: its linears converted to torchao's float8 training."""
    model = PlainLlama(config).to(device)
    if float8 is not None:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(TORCHAO_FLOAT8[float8]),
                                   module_filter_fn=lambda module, fqn: fqn != "head")
    fused = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=fused)

    def forward(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return model.loss(tokens, targets)

    loss_fn = torch.compile(forward) if compile else forward

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
        loss = loss_fn(tokens, targets)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), grad_norm.item()

    return step
