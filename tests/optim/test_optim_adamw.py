"""fp4lab.optim.AdamW: torch.optim.AdamW's arithmetic in fp32; Full-Stack FP4's NVFP4 second moment."""

from __future__ import annotations

import io
import math

import pytest
import torch

from fp4lab.numerics import quantize
from fp4lab.optim import AdamW, decode_v, encode_v
from fp4lab.optim.adamw import adam_step_bound_coefficient, quantized_v

pytestmark = pytest.mark.usefixtures("one_thread")


def _heavy(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Heavy-tailed samples (a Gaussian scale mixture with lognormal scales), from `gen` alone."""
    return torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


def test_fp32_matches_torch_adamw_over_several_steps():
    gen = torch.Generator().manual_seed(0)
    shapes = [(16, 256), (24, 20), (256,)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    kwargs = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    opt, ref = AdamW(ours, **kwargs), torch.optim.AdamW(theirs, **kwargs)
    for _ in range(6):
        for a, b in zip(ours, theirs):
            a.grad = torch.randn(a.shape, generator=gen) * torch.rand(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opt.step()
        ref.step()
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        torch.testing.assert_close(opt.state[a]["exp_avg_sq"], ref.state[b]["exp_avg_sq"], rtol=1e-6, atol=0)


def test_which_tensors_store_v_in_nvfp4():
    def param(*shape):
        return torch.nn.Parameter(torch.zeros(shape))

    assert quantized_v(param(16, 256))  # 4096 elements, last dim a multiple of 16
    assert not quantized_v(param(4096))  # 1D (norm gains)
    assert not quantized_v(param(200, 24))  # 4800 elements but 24 is not a multiple of 16
    assert not quantized_v(param(8, 16))  # tiny
    ps = [param(16, 256), param(4096), param(8, 16)]
    opt = AdamW(ps, v_format="nvfp4")
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[ps[0]]["v_codes"].dtype == torch.uint8 and "exp_avg_sq" not in opt.state[ps[0]]
    assert all("exp_avg_sq" in opt.state[p] and "v_codes" not in opt.state[p] for p in ps[1:])


def test_unknown_v_format_is_rejected():
    with pytest.raises(ValueError, match=r"v_format='fp8' is not supported; allowed: 'fp32', 'nvfp4'"):
        AdamW([torch.nn.Parameter(torch.zeros(4))], v_format="fp8")


def test_encoding_zero_decodes_to_exact_zero():
    assert torch.equal(decode_v(encode_v(torch.zeros(4, 64))), torch.zeros(4, 64))


def _ema_of_squares(gen: torch.Generator, sample, steps: int = 60, beta2: float = 0.95) -> torch.Tensor:
    v = torch.zeros_like(sample(gen))
    for _ in range(steps):
        g = sample(gen)
        v = beta2 * v + (1 - beta2) * g * g
    return v


def test_one_shot_v_error_and_the_transform_beats_naive_nvfp4():
    """Encode/decode of a realistic v. The denominator uses sqrt(v), so the sqrt-domain error is the
    one that matters; quantizing v directly flushes small entries to 0 and loses them."""
    gen = torch.Generator().manual_seed(1)
    row_scale = torch.exp(torch.randn(64, 1, generator=gen))
    v = _ema_of_squares(gen, lambda g: torch.randn(64, 256, generator=g) * row_scale)
    v_hat = decode_v(encode_v(v))
    assert _rel(v_hat, v) < 0.03 and _rel(v_hat.sqrt(), v.sqrt()) < 0.015  # measured 0.021, 0.011

    heavy = _ema_of_squares(gen, lambda g: _heavy(g, 64, 256))
    naive = quantize(heavy, "nvfp4").dequantize()
    ours = decode_v(encode_v(heavy))
    assert (naive == 0).any() and not (ours == 0).any()
    assert _rel(ours.sqrt(), heavy.sqrt()) < 0.5 * _rel(naive.sqrt(), heavy.sqrt())


def _parallel_runs(sample, steps: int, seed: int, betas=(0.9, 0.95)):
    """fp32 and nvfp4 AdamW fed the same gradient stream (independent of the weights)."""
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(64, 256, generator=gen)
    pf, pq = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    of = AdamW([pf], lr=1e-3, betas=betas, weight_decay=0.0)
    oq = AdamW([pq], lr=1e-3, betas=betas, weight_decay=0.0, v_format="nvfp4")
    for _ in range(steps):
        g = sample(gen)
        pf.grad, pq.grad = g.clone(), g.clone()
        of.step()
        oq.step()
    return of.state[pf]["exp_avg_sq"], decode_v(oq.state[pq])


def test_stored_v_tracks_an_fp32_adamw_run():
    """The stored v of an nvfp4 run against the exact v of an fp32 run after 60 steps. Errors compound:
    each step re-encodes b2 * v_hat + (1 - b2) g^2, and round-to-nearest repeats the same error on a
    slowly changing state, so the trajectory error is 3-4x the one-shot error, and larger still on
    heavy tails (measured: 0.068 / 0.036 for v / sqrt(v); heavy tails 0.39 / 0.18). The bounds keep margin."""
    gen = torch.Generator().manual_seed(2)
    row_scale = torch.exp(torch.randn(64, 1, generator=gen))
    v, v_hat = _parallel_runs(lambda g: torch.randn(64, 256, generator=g) * row_scale, steps=60, seed=3)
    assert _rel(v_hat, v) < 0.1
    assert _rel(v_hat.sqrt(), v.sqrt()) < 0.05
    v, v_hat = _parallel_runs(lambda g: _heavy(g, 64, 256), steps=60, seed=4)
    assert _rel(v_hat.sqrt(), v.sqrt()) < 0.25


def test_adversarial_gradients_never_step_beyond_adams_own_bound():
    """Tiny, huge and zero entries in one NVFP4 block, then the gradient drops to 0 everywhere. The raw
    decoded v collapses far below the truth (the test checks that it does); the clamp v >= c m^2 keeps
    every coordinate's step within |dW| <= lr sqrt(1 - b2^t) / (1 - b1^t) / sqrt(c), the largest step
    exact Adam can take, where the unclamped step would exceed it about a hundredfold."""
    b1, b2, lr, eps = 0.9, 0.95, 1e-3, 1e-8
    c = adam_step_bound_coefficient(b1, b2)
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(16, 256, generator=gen)
    pq, pf = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    oq = AdamW([pq], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0, v_format="nvfp4")
    of = AdamW([pf], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0)
    base = torch.randn(16, 256, generator=gen) * 1e-2
    base[:, 208:224] = 0.0  # a block that never sees a gradient
    worst_ratio, worst_unclamped = 1.0, 0.0
    for t in range(1, 31):
        g = base.clone()
        if t <= 20:
            g[0, :16] = torch.tensor([1e3, 20, -20, 1e-6, 0, 5, -5, 1e-3] + [0.5] * 8)
            g[1, :4] = torch.tensor([1e4, -1e-7, 0.0, 30.0])
        else:
            g.zero_()  # the gradient stops (a token that no longer occurs): m carries on, v must not collapse
        if t > 1:
            raw, true, m = decode_v(oq.state[pq]), of.state[pf]["exp_avg_sq"], oq.state[pq]["exp_avg"]
            live = (true > 0) & (m != 0)
            worst_ratio = min(worst_ratio, (raw[live] / true[live]).min().item())
            m_t = m.lerp(g, 1 - b1)
            v_t = raw * b2 + (1 - b2) * g * g
            unclamped = lr / (1 - b1**t) * m_t.abs() / (v_t.sqrt() / math.sqrt(1 - b2**t) + eps)
            worst_unclamped = max(worst_unclamped, unclamped.max().item())
        before = pq.detach().clone()
        pq.grad, pf.grad = g.clone(), g.clone()
        oq.step()
        of.step()
        step = (pq.detach() - before).abs()
        bound = lr * math.sqrt(1 - b2**t) / (1 - b1**t) / math.sqrt(c)
        assert torch.isfinite(pq).all() and torch.isfinite(decode_v(oq.state[pq])).all()
        rounding = 2 * torch.finfo(torch.float32).eps * before.abs()  # the step is measured on fp32 weights
        assert (step <= bound * (1 + 1e-5) + rounding).all(), t
    assert worst_ratio < 1e-3  # the quantizer did collapse some v (measured 8e-8) ...
    assert worst_unclamped > 50 * lr  # ... enough that the unclamped step would explode (measured 109 lr)
    assert torch.equal(pq.detach()[:, 208:224], w0[:, 208:224])  # m = 0 there: no step at all


def test_exact_adam_obeys_the_step_bound_the_clamp_enforces():
    """The clamp is sound only if the exact v satisfies v_t >= c m_t^2: check it on torch's AdamW."""
    b1, b2 = 0.9, 0.95
    c = adam_step_bound_coefficient(b1, b2)
    gen = torch.Generator().manual_seed(6)
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(b1, b2), weight_decay=0.0)
    for t in range(40):
        p.grad = _heavy(gen, 4096) * (t % 7 != 0)
        opt.step()
        state = opt.state[p]
        assert (state["exp_avg_sq"] >= c * state["exp_avg"].square() * (1 - 1e-5)).all()
    assert adam_step_bound_coefficient(0.99, 0.95) == 0.0  # b1^2 >= b2: no such bound, no clamp


def _regression(v_format: str, seed: int, steps: int = 300, lr: float = 1e-2) -> tuple[float, float]:
    """Least squares y = x W*^T + noise with lognormal feature scales and linear lr decay.

    Returns (mean loss over the last 20 steps, first loss)."""
    gen = torch.Generator().manual_seed(seed)
    d_in, d_out = 256, 32
    feature_scale = torch.exp(0.5 * torch.randn(d_in, generator=gen))
    w_true = torch.randn(d_out, d_in, generator=gen) / d_in**0.5
    w = torch.nn.Parameter(torch.zeros(d_out, d_in))
    opt = AdamW([w], lr=lr, betas=(0.9, 0.95), weight_decay=0.0, v_format=v_format)
    losses = []
    for t in range(steps):
        opt.param_groups[0]["lr"] = lr * (1 - t / steps)
        x = torch.randn(64, d_in, generator=gen) * feature_scale
        y = x @ w_true.T + 0.01 * torch.randn(64, d_out, generator=gen)
        loss = (x @ w.T - y).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert (v_format == "nvfp4") == ("v_codes" in opt.state[w])
    return sum(losses[-20:]) / 20, losses[0]


def test_nvfp4_v_trains_a_regression_close_to_fp32():
    """From an initial loss of ~1.7 both end near the noise floor (1e-4): measured 2.8e-4 (fp32) and
    2.7e-4 (nvfp4) over seeds 0-3. With wider feature scales (exp(N(0, 1))) nvfp4 can lag far behind
    (fp4lab/optim/adamw.py, "Measured limits")."""
    fp32, start = _regression("fp32", seed=0)
    nvfp4, _ = _regression("nvfp4", seed=0)
    assert fp32 < 1e-3 * start
    assert nvfp4 < 2.0 * fp32 + 1e-4, (nvfp4, fp32)


def test_nvfp4_state_dict_round_trip_keeps_dtypes_and_resumes_bit_identically():
    gen = torch.Generator().manual_seed(7)
    w0 = [torch.randn(16, 256, generator=gen), torch.randn(256, generator=gen)]
    grads = [[torch.randn(w.shape, generator=gen) for w in w0] for _ in range(3)]
    kwargs = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "v_format": "nvfp4"}

    straight = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = AdamW(straight, **kwargs)
    for step_grads in grads:
        for p, g in zip(straight, step_grads):
            p.grad = g.clone()
        opt.step()

    first = [torch.nn.Parameter(w.clone()) for w in w0]
    opt1 = AdamW(first, **kwargs)
    for step_grads in grads[:2]:
        for p, g in zip(first, step_grads):
            p.grad = g.clone()
        opt1.step()
    buf = io.BytesIO()
    torch.save(opt1.state_dict(), buf)
    buf.seek(0)
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in first]
    opt2 = AdamW(resumed, v_format="nvfp4")
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    loaded = opt2.state[resumed[0]]
    assert loaded["v_codes"].dtype == torch.uint8 and loaded["v_scales"].dtype == torch.uint8
    assert torch.equal(loaded["v_codes"], opt1.state[first[0]]["v_codes"])
    for p, g in zip(resumed, grads[2]):
        p.grad = g.clone()
    opt2.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)
