"""QK-Clip (Kimi K2, extended to GQA) on real q/k logits, and OptiTrain-FP4's update cap."""

from __future__ import annotations

import math
import re

import pytest
import torch

from fp4lab.optim import UpdateCap, qk_clip_

DIM, HEAD_DIM, SEQ = 64, 16, 24


pytestmark = pytest.mark.usefixtures("one_thread")


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on [seq, heads, head_dim] (pairs (2i, 2i+1), base 10000)."""
    seq, _, d = x.shape
    freqs = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = torch.arange(seq, dtype=torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def max_logits(x: torch.Tensor, w_q: torch.Tensor, w_k: torch.Tensor, n_heads: int, n_kv_heads: int) -> torch.Tensor:
    """S_max^h: the largest causal pre-softmax logit per query head, post-RoPE, after the 1/sqrt(d) scale."""
    q = _rope((x @ w_q.T).view(SEQ, n_heads, HEAD_DIM))
    k = _rope((x @ w_k.T).view(SEQ, n_kv_heads, HEAD_DIM))
    k = k.repeat_interleave(n_heads // n_kv_heads, dim=1)
    logits = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(HEAD_DIM)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, -math.inf).amax(dim=(1, 2))


def _setup(n_heads: int, n_kv_heads: int, blow_up: dict[int, float], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, DIM, generator=gen)
    w_q = torch.randn(n_heads * HEAD_DIM, DIM, generator=gen) / math.sqrt(DIM)
    w_k = torch.randn(n_kv_heads * HEAD_DIM, DIM, generator=gen) / math.sqrt(DIM)
    for h, factor in blow_up.items():
        w_q[h * HEAD_DIM : (h + 1) * HEAD_DIM] *= factor
    return x, w_q, w_k


TAU = 10.0


def test_mha_offending_head_ends_at_tau_with_sqrt_gamma_on_q_and_k():
    n = 4
    x, w_q, w_k = _setup(n, n, {1: 40.0})
    before = max_logits(x, w_q, w_k, n, n)
    assert before[1] > 10 * TAU and (before[[0, 2, 3]] < TAU).all()
    q0, k0 = w_q.clone(), w_k.clone()
    gamma = qk_clip_(w_q, w_k, before, TAU, n, n, HEAD_DIM)
    assert gamma[1].item() == pytest.approx(TAU / before[1].item(), rel=1e-6)
    assert torch.equal(gamma[[0, 2, 3]], torch.ones(3))
    rows = slice(HEAD_DIM, 2 * HEAD_DIM)
    root = math.sqrt(TAU / before[1].item())
    torch.testing.assert_close(w_q[rows], q0[rows] * root, rtol=1e-6, atol=0)  # K2's MHA rule
    torch.testing.assert_close(w_k[rows], k0[rows] * root, rtol=1e-6, atol=0)
    keep = torch.ones(n * HEAD_DIM, dtype=torch.bool)
    keep[rows] = False
    assert torch.equal(w_q[keep], q0[keep]) and torch.equal(w_k[keep], k0[keep])
    after = max_logits(x, w_q, w_k, n, n)
    assert after[1].item() == pytest.approx(TAU, rel=1e-5)
    assert torch.equal(after[[0, 2, 3]], before[[0, 2, 3]])


def test_gqa_groups_with_one_and_with_two_offending_heads():
    """6 query heads over 2 key heads (groups {0,1,2} and {3,4,5}). Group 0: head 1 offends. Group 1:
    heads 3 and 5 offend by different amounts, head 4 does not. Every offender ends at tau; heads 0, 2
    and 4 keep their logits (their key head was cut, their query scaled up to match)."""
    n, n_kv = 6, 2
    x, w_q, w_k = _setup(n, n_kv, {1: 30.0, 3: 25.0, 5: 60.0}, seed=1)
    before = max_logits(x, w_q, w_k, n, n_kv)
    offenders, others = [1, 3, 5], [0, 2, 4]
    assert (before[offenders] > 5 * TAU).all() and (before[others] < TAU).all()
    k0 = w_k.clone()
    gamma = qk_clip_(w_q, w_k, before, TAU, n, n_kv, HEAD_DIM)
    after = max_logits(x, w_q, w_k, n, n_kv)
    torch.testing.assert_close(after[offenders], torch.full((3,), TAU), rtol=1e-5, atol=0)
    torch.testing.assert_close(after[others], before[others], rtol=1e-5, atol=0)
    # each key head is cut by sqrt of its group's worst gamma
    for g, worst in ((0, gamma[1]), (1, torch.minimum(gamma[3], gamma[5]))):
        rows = slice(g * HEAD_DIM, (g + 1) * HEAD_DIM)
        torch.testing.assert_close(w_k[rows], k0[rows] * worst.sqrt(), rtol=1e-6, atol=0)


def test_heads_under_tau_leave_the_weights_bitwise_unchanged():
    n, n_kv = 4, 2
    x, w_q, w_k = _setup(n, n_kv, {})
    logits = max_logits(x, w_q, w_k, n, n_kv)
    assert (logits < TAU).all()
    q0, k0 = w_q.clone(), w_k.clone()
    gamma = qk_clip_(w_q, w_k, logits, TAU, n, n_kv, HEAD_DIM)
    assert torch.equal(gamma, torch.ones(n))
    assert torch.equal(w_q, q0) and torch.equal(w_k, k0)


def test_clip_works_in_place_on_parameters_with_grad():
    w_q = torch.nn.Parameter(torch.ones(2 * HEAD_DIM, DIM))
    w_k = torch.nn.Parameter(torch.ones(HEAD_DIM, DIM))
    qk_clip_(w_q, w_k, torch.tensor([40.0, 5.0]), 10.0, 2, 1, HEAD_DIM)
    assert w_k[0, 0].item() == pytest.approx(0.5)  # sqrt(10 / 40)
    assert w_q[0, 0].item() == pytest.approx(0.5) and w_q[-1, 0].item() == pytest.approx(2.0)  # 1 / 0.5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_kv_heads": 3}, "n_heads=4 must be a multiple of n_kv_heads=3"),
        ({"tau": 0.0}, "tau=0.0 must be a finite number > 0"),
        ({"max_logits": torch.ones(3)}, "max_logits has shape [3]; expected [4]"),
        ({"max_logits": torch.tensor([1.0, math.nan, 1.0, 1.0])}, "max_logits has NaN or Inf"),
        ({"w_k": torch.zeros(2 * HEAD_DIM, DIM + 1)}, f"w_k has shape [{2 * HEAD_DIM}, {DIM + 1}]"),
        ({"head_dim": 8}, "w_q has shape"),
    ],
)
def test_qk_clip_argument_errors(kwargs, message):
    args = {
        "w_q": torch.zeros(4 * HEAD_DIM, DIM),
        "w_k": torch.zeros(2 * HEAD_DIM, DIM),
        "max_logits": torch.ones(4),
        "tau": 10.0,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": HEAD_DIM,
    } | kwargs
    with pytest.raises(ValueError, match=re.escape(message)):
        qk_clip_(**args)


# ------------------------------------------------------------------------------------- update cap


def test_update_cap_binds_exactly_and_leaves_small_updates_alone():
    gen = torch.Generator().manual_seed(2)
    big, small = (
        torch.nn.Parameter(torch.randn(32, 32, generator=gen)),
        torch.nn.Parameter(torch.randn(16, 32, generator=gen)),
    )
    cap = UpdateCap([(big, 0.05), (small, 0.02)])
    opt = torch.optim.SGD([big, small], lr=1.0)  # any optimizer: the cap only looks at the weights
    big.grad = torch.randn(32, 32, generator=gen)  # ||dW|| ~ ||W||: far over 5 %
    small.grad = torch.randn(16, 32, generator=gen) * 1e-3  # ~0.1 % of ||W||: under 2 %
    b0, s0 = big.detach().clone(), small.detach().clone()
    uncapped = b0 - big.grad
    cap.snapshot()
    opt.step()
    s_after = small.detach().clone()
    factors = cap.apply()
    delta = big.detach() - b0
    assert (delta.norm() / b0.norm()).item() == pytest.approx(0.05, rel=1e-6)
    cosine = torch.nn.functional.cosine_similarity(delta.flatten(), (uncapped - b0).flatten(), dim=0)
    assert cosine.item() == pytest.approx(1.0, abs=1e-6)  # same direction, only shorter
    assert factors[0].item() == pytest.approx(0.05 * b0.norm().item() / big.grad.norm().item(), rel=1e-6)
    assert factors[1].item() == 1.0 and torch.equal(small.detach(), s_after)
    assert not torch.equal(s_after, s0)
    # The capped matrix, bit for bit: W_before + delta * (alpha ||W_before|| / ||delta||), in float64.
    step = uncapped.double() - b0.double()
    factor = 0.05 * torch.linalg.vector_norm(b0.double()) / torch.linalg.vector_norm(step)
    assert torch.equal(big.detach(), (b0.double() + step * factor).float())
    assert factors.dtype == torch.float64 and factors[0] == factor


def test_update_cap_needs_a_snapshot_and_a_positive_alpha():
    p = torch.nn.Parameter(torch.ones(4, 4))
    with pytest.raises(RuntimeError, match="snapshot"):
        UpdateCap([(p, 0.05)]).apply()
    with pytest.raises(ValueError, match=r"alpha=0 must be a finite number > 0"):
        UpdateCap([(p, 0)])


@pytest.mark.cuda
def test_update_cap_never_waits_for_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU)")
    gen = torch.Generator(device="cuda").manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(64, 64, device="cuda", generator=gen)) for _ in range(3)]
    cap = UpdateCap((p, 0.05) for p in params)
    cap.snapshot()
    with torch.no_grad():
        params[0].add_(torch.randn(64, 64, device="cuda", generator=gen))  # over its cap
        params[1].add_(torch.randn(64, 64, device="cuda", generator=gen) * 1e-4)  # under it
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host read now raises
    try:
        factors = cap.apply()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert factors[0].item() < 1.0 and factors[1].item() == 1.0 and factors[2].item() == 1.0


@pytest.mark.cuda
def test_qk_clip_of_host_max_logits_never_waits_for_the_gpu():
    # The training loop reads every layer's max logits once a step and clips each layer from that read.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU)")
    gen = torch.Generator(device="cuda").manual_seed(4)
    w_q, w_k = torch.randn(4 * 8, 16, device="cuda", generator=gen), torch.randn(2 * 8, 16, device="cuda", generator=gen)
    expected_q, expected_k = w_q.clone(), w_k.clone()
    max_logits = torch.tensor([1.0, 9.0, 2.0, 3.0])
    gamma_cuda = qk_clip_(expected_q, expected_k, max_logits.cuda(), 4.0, 4, 2, 8)  # reads the logits back
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gamma = qk_clip_(w_q, w_k, max_logits, 4.0, 4, 2, 8)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gamma, gamma_cuda) and torch.equal(w_q, expected_q) and torch.equal(w_k, expected_k)
    assert torch.equal(gamma, torch.tensor([1.0, 4.0 / 9.0, 1.0, 1.0]))  # float32, as qk_clip_ returns it
