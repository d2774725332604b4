"""Keeping attention logits bounded: Kimi K2's QK-Clip (per head, exact) and OptiTrain-FP4's update cap.

`qk_clip_` is QK-Clip from MuonClip (Kimi K2, arXiv 2507.20534, Algorithm 1), extended to grouped-query
attention. `UpdateCap` is the simpler rule of the OptiTrain-FP4 README (github.com/Solorush2021/OptiTrain-FP4),
which caps each matrix's relative update size. They are different things; see `UpdateCap`.

**Data-parallel runs.** Each rank measures its max logits on its own data shard; clipping with those
would scale the replicas differently and they would drift apart. `all_reduce_max_logits_` makes them
the global per-head maxima (an all-reduce MAX; a no-op without a process group); call it on every
rank before `qk_clip_`. `qk_clip_` and `UpdateCap` also take FSDP2-sharded weights (DTensors cut
along dim 0): a head's rows may straddle two shards, so each rank scales the rows it holds by their
head's factor (bit for bit the unsharded clip), and the cap's Frobenius norms are reduced over all
shards (its factor equals the unsharded one up to the summation order of the float64 norms).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist

from fp4lab.optim.sharding import global_norm, is_sharded, local, local_part


def all_reduce_max_logits_(max_logits: torch.Tensor, group=None) -> torch.Tensor:
    """In place, the per-head max logits [n_heads] of this rank -> their maximum over all ranks of
    `group` (default: the world), when torch.distributed is initialized; returned. Every rank must
    call it (a collective), with the tensor on the device its backend reduces (gloo: CPU, NCCL: CUDA)."""
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(max_logits, op=dist.ReduceOp.MAX, group=group)
    return max_logits


@torch.no_grad()
def qk_clip_(
    w_q: torch.Tensor,
    w_k: torch.Tensor,
    max_logits: torch.Tensor,
    tau: float,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """Rescale W_q and W_k in place so that no head's max attention logit exceeds tau; return gamma [n_heads].

    Call it after the optimizer step, on the master weights, with the per-head maximum logit S_max^h
    measured in the forward pass of that step: the largest pre-softmax logit of head h over the batch,
    after RoPE and after the 1/sqrt(head_dim) scale, over unmasked positions. Optimizer states are not
    touched. (Kimi K2: "QK-Clip" rescales the weights after the update, using S_max only as a trigger.)

    w_q: [n_heads * head_dim, dim], the rows of query head h contiguous; w_k: [n_kv_heads * head_dim, dim].

    gamma_h = min(1, tau / S_max^h). Logits are bilinear in (W_q^h, W_k^g), so scaling query head h by
    alpha_h and its key head g by beta_g scales its logits by alpha_h * beta_g (RoPE is linear and
    commutes with the scaling). K2 uses alpha = beta = sqrt(gamma_h) for MHA. Under GQA one key head g
    serves a group of query heads, so K2's rule does not apply as is. Our rule:

        beta_g  = sqrt(gamma_g),  gamma_g = min over the query heads h of group g of gamma_h
        alpha_h = gamma_h / sqrt(gamma_g)

    so every head's logits scale by exactly alpha_h * beta_g = gamma_h: heads over tau end at tau, heads
    under tau keep their logits, and the worst head of a group splits its cut evenly between q and k as
    K2's MHA rule does. With one query head per group (MHA) it is K2's sqrt(gamma_h) on both. The price:
    a head under tau that shares its key head with an offender has its W_q scaled *up* by
    1 / sqrt(gamma_g) to undo the cut on the key. (Megatron-Core's clip_qk instead scales a whole
    group by the group's worst gamma, which also cuts the heads under tau.)

    Heads with gamma = 1 in a group without offenders are multiplied by exactly 1.0, so their weights
    stay bitwise unchanged. The scale factors are computed in float64 and applied in the weights' dtype.
    """
    _check_qk_clip_args(w_q, w_k, max_logits, tau, n_heads, n_kv_heads, head_dim)
    s_max = max_logits.detach().to(torch.float64).cpu()
    gamma = torch.where(s_max > tau, tau / s_max, torch.ones_like(s_max))
    group_size = n_heads // n_kv_heads
    gamma_group = gamma.view(n_kv_heads, group_size).amin(dim=1)
    k_scale = gamma_group.sqrt()
    q_scale = gamma / k_scale.repeat_interleave(group_size)
    _scale_heads_(w_q, q_scale, n_heads, head_dim)
    _scale_heads_(w_k, k_scale, n_kv_heads, head_dim)
    return gamma.to(torch.float32)


def _scale_heads_(w: torch.Tensor, head_scale: torch.Tensor, heads: int, head_dim: int) -> None:
    """Multiply the head_dim rows of each head of w by that head's factor, in w's dtype."""
    # Not waiting for the GPU: a copy from pageable host memory is staged before the call returns.
    head_scale = head_scale.to(w.dtype).to(w.device, non_blocking=True)
    if not is_sharded(w):
        w.view(heads, head_dim, -1).mul_(head_scale[:, None, None])
        return
    # A shard's first row need not start a head: expand to one factor per element and cut it as w is cut.
    row_scale = head_scale.repeat_interleave(head_dim)[:, None].expand(w.shape)
    local(w).mul_(local_part(row_scale, w))


def _check_qk_clip_args(w_q, w_k, max_logits, tau, n_heads, n_kv_heads, head_dim) -> None:
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"qk_clip_: {name}={value!r} must be a positive int")
    if n_heads % n_kv_heads:
        raise ValueError(f"qk_clip_: n_heads={n_heads} must be a multiple of n_kv_heads={n_kv_heads}")
    if not (isinstance(tau, (int, float)) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"qk_clip_: tau={tau!r} must be a finite number > 0")
    if w_q.ndim != 2 or w_q.shape[0] != n_heads * head_dim:
        raise ValueError(
            f"qk_clip_: w_q has shape {list(w_q.shape)}; expected [n_heads * head_dim = {n_heads * head_dim}, dim]"
        )
    if w_k.ndim != 2 or w_k.shape[0] != n_kv_heads * head_dim or w_k.shape[1] != w_q.shape[1]:
        raise ValueError(
            f"qk_clip_: w_k has shape {list(w_k.shape)}; expected [n_kv_heads * head_dim = {n_kv_heads * head_dim}, "
            f"{w_q.shape[1]}]"
        )
    if max_logits.shape != (n_heads,):
        raise ValueError(
            f"qk_clip_: max_logits has shape {list(max_logits.shape)}; expected [{n_heads}] (one per query head)"
        )
    if not torch.isfinite(max_logits).all():
        raise ValueError(
            "qk_clip_: max_logits has NaN or Inf entries; the forward pass diverged, there is no finite cut"
        )


class UpdateCap:
    """OptiTrain-FP4's update cap: ||W_after - W_before||_F <= alpha ||W_before||_F, per matrix.

    Source: the OptiTrain-FP4 README (github.com/Solorush2021/OptiTrain-FP4), which calls it "MuonClip
    (QK-Clip)": alpha = 0.05 for most matrices and 0.02 for the query and key projections, with an
    oversized update rescaled to the cap. The caller gives each parameter its alpha.

    This is NOT Kimi K2's QK-Clip (`qk_clip_`). It caps the relative size of each step, a LARS-like trust
    ratio, and never looks at the logits: many capped steps can still drive the max logit up (it grows
    with ||W_q|| ||W_k||), so there is no bound S_max <= tau; and it slows every capped matrix, MLPs
    included, not only the offending heads.

    Works with any optimizer: `snapshot()` before `optimizer.step()`, `apply()` after. It keeps a copy of
    every capped parameter between the two calls. A matrix whose weights are all zero gets a cap of 0,
    so it never moves: do not cap zero-initialised matrices (LoRA B factors, zero-init projections).
    """

    def __init__(self, params_and_alphas: Iterable[tuple[torch.Tensor, float]]) -> None:
        self.params_and_alphas = list(params_and_alphas)
        for p, alpha in self.params_and_alphas:
            if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and alpha > 0):
                raise ValueError(f"UpdateCap: alpha={alpha!r} must be a finite number > 0 (shape {list(p.shape)})")
        self._before: list[torch.Tensor] | None = None

    @torch.no_grad()
    def snapshot(self) -> None:
        self._before = [p.detach().clone() for p, _ in self.params_and_alphas]

    @torch.no_grad()
    def apply(self) -> torch.Tensor:
        """Shrink every update over its cap onto the cap; return the factor applied per matrix (1.0 =
        untouched), a float64 tensor on the parameters' device.

        Nothing here waits for the GPU: the caps, norms and factors stay on the device and a matrix
        under its cap keeps its bits through a `where` (a step with a Python branch per matrix read two
        norms back per matrix, 144 waits a step at 125m)."""
        if self._before is None:
            raise RuntimeError("UpdateCap.apply() needs a snapshot() taken before the optimizer step")
        factors = []
        for (p, alpha), before in zip(self.params_and_alphas, self._before):
            before_64 = before.to(torch.float64)
            delta = p.detach().to(torch.float64) - before_64
            # Over the whole matrix when p is sharded, so every rank applies the same factor.
            cap = alpha * global_norm(before_64)
            norm = global_norm(delta)
            over = norm > cap
            factor = torch.where(over, cap / norm, torch.ones_like(norm))
            capped = local(before_64) + local(delta) * factor
            local(p).copy_(torch.where(over, capped.to(p.dtype), local(p)))
            factors.append(factor)
        self._before = None
        return torch.stack(factors) if factors else torch.ones(0, dtype=torch.float64)
