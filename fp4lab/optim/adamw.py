"""AdamW with the second moment stored in fp32 or, as in Full-Stack FP4, in NVFP4.

The update is torch.optim.AdamW's (Loshchilov & Hutter's decoupled weight decay, Adam's bias
correction), written out op for op like torch's single-tensor path, so with `v_format="fp32"` a step
matches torch.optim.AdamW (bit for bit on CPU with torch 2.13; the tests require 1e-6 relative):

    W <- W (1 - lr wd);  m <- lerp(m, g, 1 - b1);  v <- b2 v + (1 - b2) g^2
    W <- W - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

`v_format="nvfp4"` stores v in NVFP4 between steps (Full-Stack FP4, Ding et al., arXiv 2607.04422). v is
non-negative and heavy-tailed, and the update divides by sqrt(v), so v is not quantized directly but
after a transform that low precision survives (`encode_v` / `decode_v`):

    s = sqrt(v);  mu = mean of s over the last dim (one per row);  u = H(s - mu)
    stored: NVFP4(u) (round to nearest) and mu in fp32;  decoded: v_hat = (H^T dequant(NVFP4(u)) + mu)^2

with H the fixed-sign blockwise Hadamard of `fp4lab.numerics.hadamard` (size `HADAMARD_SIZE`). A step
decodes v_hat, computes v_t = b2 v_hat + (1 - b2) g^2 in fp32, updates the weights with that v_t and
re-encodes it, as the 8-bit and 4-bit optimizers do (Dettmers et al., ICLR 2022; Li et al., arXiv 2309.01507).
Where the Triton kernels run, H and the quantizer are one fused pass and the decode another
(`numerics.kernels.encode` / `decode`, the torch reference's bits): the reference launches some fifty
small kernels per parameter and step, which left fullstack's AdamW step host-bound.

**Never dividing by a collapsed v.** The 4-bit-optimizer paper (Li et al.) shows the failure: a small but
non-zero v rounded to 0 turns m / (sqrt(v) + eps) into m / eps. Here the transform keeps v_hat >= 0 (it is
a square) and a block that underflows decodes to the row mean mu rather than to 0, the role of that
paper's zero-free map. That is not a guarantee: an entry sharing a block with a much larger one can
still decode near 0. Two bounds that the exact v obeys are enforced on the v_t a step uses:

- v_t >= (1 - b2) g_t^2 (since v_{t-1} >= 0): it holds by construction, as v_hat >= 0.
- v_t >= c m_t^2 with c = (1 - b2)(1 - b1^2 / b2) / (1 - b1)^2, when b1^2 < b2. By Cauchy-Schwarz,
  m_t^2 = (1-b1)^2 (sum_i b1^(t-i) g_i)^2 <= (1-b1)^2 (sum_k (b1^2/b2)^k) (sum_i b2^(t-i) g_i^2)
  <= (1-b1)^2 / (1 - b1^2/b2) * v_t / (1 - b2). Equivalently, exact Adam's per-coordinate step
  never exceeds lr sqrt(1 - b2^t) / (1 - b1^t) / sqrt(c) (Kingma & Ba bound the step in the same
  spirit, section 2.1). Clamping to it only ever moves v_t toward the truth, and it caps every
  coordinate's step at what exact Adam could take, whatever the quantizer did. It covers the case the
  g^2 bound cannot: a coordinate whose gradient falls to 0 while m still carries its history.

Tensors that cannot be blocked keep v in fp32 ("exp_avg_sq", as in fp32 mode): 1D tensors (norm gains),
tensors whose last dim is not a multiple of `HADAMARD_SIZE`, and tensors with fewer than
`MIN_QUANTIZED_NUMEL` elements (bitsandbytes' min_8bit_size and lpmm's THRESHOLD, both 4096: the
saving there is nil and small tensors are the sensitive ones). `quantized_v(p)` tells which is which.

Measured limits of the NVFP4 v (round to nearest; fp32 weights, b2 = 0.95):

- Errors compound. Each step re-encodes b2 * v_hat + (1 - b2) g^2, and round to nearest repeats nearly
  the same error on a slowly changing state, so it integrates instead of averaging out. After 60-100
  steps the stored v is off by 0.07 relative (sqrt(v): 0.036) for Gaussian gradients, 3-4x the
  one-shot error, and by 0.4-1.4 (sqrt(v): 0.16-0.18) for heavy-tailed ones; the squaring decoder
  biases small entries upward. Stochastic rounding of u cut the heavy-tailed v error to 0.14-0.17 in
  the same runs (not implemented: it needs a counter-based generator for bit-exact resume).
- Blocks run along the last dim, i.e. the input features of a Linear weight. When the gradient's
  scale varies across input features (activation outlier channels), small and large entries share
  blocks and the small ones lose their precision. On least squares with exp(N(0, 1)) feature scales
  (three seeds), nvfp4 v ended at a loss of 3e-3 to 0.15 against 1.6e-4 for fp32 at lr 3e-3, and of
  3.7e-4 to 6.4e-3 against 4.1e-4 at lr 1e-2; with exp(N(0, 0.5)) scales it matched fp32 on four
  seeds (the tests).

State per parameter: "step" (float32 tensor, as torch), "exp_avg"; then "exp_avg_sq" (fp32 v) or the
NVFP4 v as plain tensors, so checkpoints load with torch.load(weights_only=True): "v_codes" (uint8,
packed E2M1), "v_scales" (uint8, E4M3 block scales), "v_tensor_scale" (float32), "v_mean" (float32, [..., 1]).

**Sharded parameters (FSDP2).** For a DTensor parameter (fully_shard's `Shard(0)`) the step runs on the
local shards; "exp_avg", "exp_avg_sq" and the NVFP4 pieces codes, scales and mean are DTensors placed
like the parameter (so distributed checkpoints see them sharded), "v_tensor_scale" is a plain tensor,
equal on every rank. The NVFP4 encoding reduces over three extents: the row mean and the Hadamard
blocks run along the last dim, which every rank holds whole (a parameter sharded along its last dim
is refused); the tensor scale comes from the amax of the whole tensor, which `encode_v` takes as the
MAX over the shards (an all-reduce) rather than each shard's own. So a sharded step is bit-identical
to the unsharded one (the tests check it), in both formats. `quantized_v` reads the global shape.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import torch

from fp4lab.numerics import BLOCK_SIZE, QTensor, hadamard, kernels, named_signs_on
from fp4lab.optim.plumbing import closure_loss, dense_grads
from fp4lab.optim.sharding import all_reduce_max_over_shards_, check_last_dim_whole, is_sharded, like_sharded, local
from fp4lab.validation import Checks

V_FORMATS = ("fp32", "nvfp4")
# H16 spans exactly one NVFP4 scale block, so an outlier is spread only within its own block, and any
# last dim that NVFP4 can block qualifies. On EMAs of column-scaled and Student-t squared gradients it
# gave a lower v error than H32 (0.44 vs 1.31 and 0.94 vs 1.80 relative, 100 steps), on sparse ones a
# higher (0.25 vs 0.20).
HADAMARD_SIZE = 16
MIN_QUANTIZED_NUMEL = 4096
NVFP4_BLOCK = BLOCK_SIZE["nvfp4"]
_check = Checks(ValueError, quote_choices=True)
# The NVFP4 v state keys. torch's load_state_dict casts every state tensor of a float parameter to the
# parameter's dtype (uint8 codes included); load_state_dict below puts the saved tensors back as saved.
V_KEYS = ("v_codes", "v_scales", "v_tensor_scale", "v_mean")


def encode_v(v: torch.Tensor, shard_of: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Full-Stack FP4's NVFP4 encoding of a second moment v >= 0 (last dim a multiple of HADAMARD_SIZE).

    With `shard_of` (a DTensor parameter; v is this rank's shard of its second moment, a plain tensor)
    the tensor scale is that of the whole tensor: the amax is all-reduced (MAX) over the shards."""
    s = v.to(torch.float32).sqrt()
    mean = s.mean(dim=-1, keepdim=True)
    centred = s - mean
    tensor_amax = None
    if shard_of is not None:
        tensor_amax = all_reduce_max_over_shards_(_finite_amax(hadamard(centred, HADAMARD_SIZE)), shard_of)
    q = kernels.encode(
        centred, "nvfp4", signs=named_signs_on(HADAMARD_SIZE, "fixed", v.device), tensor_amax=tensor_amax
    )
    return {"v_codes": q.data, "v_scales": q.scales, "v_tensor_scale": q.tensor_scale, "v_mean": mean}


def _finite_amax(u: torch.Tensor) -> torch.Tensor:
    """The amax `quantize` derives the NVFP4 tensor scale from: the largest block amax among the blocks
    without NaN or Inf (0 for an empty shard), so the MAX over shards is the unsharded value."""
    block_amax = u.abs().reshape(-1, NVFP4_BLOCK).amax(dim=1)
    if not block_amax.numel():
        return torch.zeros((), device=u.device)
    # Nonfinite blocks count as 0 (amaxes are >= 0): no boolean indexing, which would wait for the GPU.
    return torch.where(torch.isfinite(block_amax), block_amax, 0.0).amax()


def decode_v(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """v_hat = (H^T dequant(u) + mean)^2, float32, from the pieces `encode_v` returned."""
    codes = state["v_codes"]
    shape = torch.Size((*codes.shape[:-1], codes.shape[-1] * 2))
    q = QTensor(
        data=codes,
        scales=state["v_scales"],
        tensor_scale=state["v_tensor_scale"],
        fmt="nvfp4",
        shape=shape,
        block_size=NVFP4_BLOCK,
    )
    s = hadamard(kernels.decode(q), HADAMARD_SIZE, inverse=True) + state["v_mean"]
    return s.square()


def quantized_v(p: torch.Tensor) -> bool:
    """Whether v_format="nvfp4" stores this parameter's v in NVFP4 (else fp32; see the module docstring)."""
    return p.ndim >= 2 and p.shape[-1] % HADAMARD_SIZE == 0 and p.numel() >= MIN_QUANTIZED_NUMEL


def adam_step_bound_coefficient(beta1: float, beta2: float) -> float:
    """c in v_t >= c m_t^2, the bound exact Adam's v obeys (module docstring); 0 when beta1^2 >= beta2."""
    gamma = beta1 * beta1 / beta2
    if gamma >= 1.0:
        return 0.0
    return (1.0 - beta2) * (1.0 - gamma) / (1.0 - beta1) ** 2


class AdamW(torch.optim.Optimizer):
    """AdamW (torch.optim.AdamW's arithmetic) with v stored in fp32 or NVFP4 (`v_format`)."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        v_format: str = "fp32",
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"AdamW: lr={lr!r} must be >= 0")
        if len(tuple(betas)) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW: betas={betas!r} must be two values in [0, 1)")
        if not eps >= 0.0:
            raise ValueError(f"AdamW: eps={eps!r} must be >= 0")
        if not weight_decay >= 0.0:
            raise ValueError(f"AdamW: weight_decay={weight_decay!r} must be >= 0")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "v_format": v_format}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        # Checked before it is added, on what torch would store (the defaults filled in).
        _check.choice("AdamW: v_format", param_group.get("v_format", self.defaults["v_format"]), V_FORMATS)
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            for param, grad in dense_grads(group, "AdamW"):
                state = self.state[param]
                quantized = group["v_format"] == "nvfp4" and quantized_v(param)
                if quantized:
                    check_last_dim_whole(param, "AdamW: v_format='nvfp4'")
                p, grad = local(param), local(grad)
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    if quantized:
                        state.update(_encode_v_state(torch.zeros_like(p, dtype=torch.float32), param))
                    else:
                        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                exp_avg = local(state["exp_avg"])
                exp_avg_sq = decode_v({k: local(state[k]) for k in V_KEYS}) if quantized else local(state["exp_avg_sq"])
                state["step"] += 1
                step = state["step"].item()

                p.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                if quantized:
                    torch.maximum(
                        exp_avg_sq, exp_avg.square() * adam_step_bound_coefficient(beta1, beta2), out=exp_avg_sq
                    )
                    state.update(_encode_v_state(exp_avg_sq, param))

                step_size = lr / (1 - beta1**step)
                bias_correction2_sqrt = (1 - beta2**step) ** 0.5
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            for key in V_KEYS:
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, copy=True)


def _encode_v_state(v: torch.Tensor, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """encode_v of this rank's v; for a DTensor parameter, the pieces cut by rows as sharded as it is."""
    if not is_sharded(param):
        return encode_v(v)
    encoded = encode_v(v, shard_of=param)
    return {k: t if k == "v_tensor_scale" else like_sharded(t, param) for k, t in encoded.items()}
