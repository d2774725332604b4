"""Attention: RoPE, GQA vs a naive MHA reference, the probes (exact vs naive), FP4 attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fp4lab.nn.attention import (
    Attention,
    AttentionQuant,
    apply_rope,
    attention_entropy,
    fp4_attention,
    max_attention_logits,
    rope_tables,
)
from fp4lab.numerics import quantize

DIM, N_HEADS, N_KV_HEADS, HEAD_DIM = 128, 4, 2, 32

# FP4 attention vs exact attention: relative Frobenius error of (output, dQ, dK, dV) on `qkv_and_grad()`
# (unit Gaussians, B=2, 4/2 heads, T=64, d=32), measured with this code (max over 5 SR seeds; 3 other input
# seeds agree within 0.015). The output error is the Q/K rounding alone (V stays BF16); dS and the
# backward re-quantization of K and Q (along the sequence) add to dQ, dK only.
#   nvfp4  SR dS 0.107 0.212 0.214 0.109 | RTN dS 0.107 0.190 0.190 0.109 | exact dS 0.107 0.171 0.168 0.109
#   mxfp4  SR dS 0.132 0.259 0.268 0.137 | RTN dS 0.132 0.225 0.234 0.137 | exact dS 0.132 0.181 0.186 0.137
# The bounds below leave about 20 % headroom over the SR row.
FP4_ERROR_BOUND = {"nvfp4": (0.13, 0.26, 0.26, 0.13), "mxfp4": (0.16, 0.31, 0.32, 0.17)}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def naive_logits(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Causal logits [B, H, T, T] with K repeated per query head, masked entries at -inf."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    seq = q.shape[-2]
    return logits.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), -math.inf)


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """MHA with K and V repeated for each query head of their group."""
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return torch.softmax(naive_logits(q, k), dim=-1) @ v


def qkv_and_grad(batch=2, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, seq=64, head_dim=HEAD_DIM, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_heads, seq, head_dim, generator=g).requires_grad_()
    k = torch.randn(batch, n_kv_heads, seq, head_dim, generator=g).requires_grad_()
    v = torch.randn(batch, n_kv_heads, seq, head_dim, generator=g).requires_grad_()
    return q, k, v, torch.randn(batch, n_heads, seq, head_dim, generator=g)


def output_and_grads(attention_fn, q, k, v, grad_out) -> list[torch.Tensor]:
    out = attention_fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out)]


def sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def module_and_input(seq=16, batch=3, seed=0):
    torch.manual_seed(seed)
    attention = Attention(DIM, N_HEADS, N_KV_HEADS)
    cos, sin = rope_tables(HEAD_DIM, seq, 10000.0)
    return attention, torch.randn(batch, seq, DIM), cos, sin


def projected_qk(attention: Attention, x, cos, sin):
    """The post-RoPE q, k the module attends with, computed outside it."""
    batch, seq, _ = x.shape
    q = apply_rope(attention.wq(x).view(batch, seq, N_HEADS, HEAD_DIM), cos, sin).transpose(1, 2)
    k = apply_rope(attention.wk(x).view(batch, seq, N_KV_HEADS, HEAD_DIM), cos, sin).transpose(1, 2)
    return q.detach(), k.detach()


# --- RoPE ---------------------------------------------------------------------------------------


def test_rope_scores_depend_only_on_relative_position():
    cos, sin = rope_tables(HEAD_DIM, 64, 10000.0)
    q, k = torch.randn(2, HEAD_DIM, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).unbind(0)
    # The same q (and k) at every one of 64 positions, rotated by each position's angles.
    q_at = apply_rope(q.expand(1, 64, 1, HEAD_DIM), cos.double(), sin.double())[0, :, 0]
    k_at = apply_rope(k.expand(1, 64, 1, HEAD_DIM), cos.double(), sin.double())[0, :, 0]

    def score(query_pos: int, key_pos: int) -> float:
        return float(q_at[query_pos] @ k_at[key_pos])

    # The angles are fp32 tables: absolute error ~ position * 2^-24 * |q| |k|.
    tolerance = 1e-5 * float(q.norm() * k.norm())
    assert score(10, 3) == pytest.approx(score(50, 43), abs=tolerance)
    assert score(7, 7) == pytest.approx(score(40, 40), abs=tolerance) == pytest.approx(float(q @ k), abs=tolerance)
    assert abs(score(10, 3) - score(10, 5)) > 100 * tolerance


def test_rope_matches_the_complex_pair_layout_of_meta_llama():
    """torchtitan/Meta rotate (x[2i], x[2i+1]) as one complex number by pos * theta^(-2i/d)."""
    seq, theta = 12, 500000.0
    x = torch.randn(2, seq, 3, HEAD_DIM)
    freqs = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    freqs_cis = torch.polar(torch.ones(seq, HEAD_DIM // 2), torch.outer(torch.arange(seq).float(), freqs))
    expected = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * freqs_cis[:, None]).flatten(-2)
    torch.testing.assert_close(apply_rope(x, *rope_tables(HEAD_DIM, seq, theta)), expected)


# --- the default (SDPA) path --------------------------------------------------------------------


def test_gqa_module_matches_naive_mha_with_repeated_kv():
    attention, x, cos, sin = module_and_input()
    q, k = projected_qk(attention, x, cos, sin)
    v = attention.wv(x).view(*x.shape[:2], N_KV_HEADS, HEAD_DIM).transpose(1, 2)
    expected = attention.wo(naive_attention(q, k, v).transpose(1, 2).flatten(2))
    torch.testing.assert_close(attention(x, cos, sin), expected)


def test_gqa_module_equals_mha_module_with_kv_weights_repeated_per_head():
    gqa, x, cos, sin = module_and_input()
    mha = Attention(DIM, N_HEADS, N_HEADS)
    group = N_HEADS // N_KV_HEADS
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            per_head = getattr(gqa, name).weight.view(N_KV_HEADS, HEAD_DIM, DIM)
            getattr(mha, name).weight.copy_(per_head.repeat_interleave(group, dim=0).reshape(-1, DIM))
    torch.testing.assert_close(gqa(x, cos, sin), mha(x, cos, sin))


# --- probes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_elements", [1, 700, 1 << 24])
def test_max_logits_are_exact_per_head_post_rope_over_causal_positions(max_elements):
    attention, x, cos, sin = module_and_input()
    q, k = projected_qk(attention, x, cos, sin)
    expected = naive_logits(q, k).amax(dim=(0, 2, 3))
    torch.testing.assert_close(max_attention_logits(q, k, max_elements), expected, rtol=1e-6, atol=1e-6)

    attention.record_max_logits = True
    attention(x, cos, sin)
    assert attention.last_max_logits.shape == (N_HEADS,) and attention.last_max_logits.dtype == torch.float32
    assert not attention.last_max_logits.requires_grad
    torch.testing.assert_close(attention.last_max_logits, expected, rtol=1e-6, atol=1e-6)


def test_max_logits_ignore_masked_future_positions():
    # Query 0 would meet the huge key 3 if the mask leaked; every causal pair has logit 0.
    q = torch.zeros(1, 1, 4, HEAD_DIM)
    q[0, 0, 0] = 1.0
    k = torch.zeros(1, 1, 4, HEAD_DIM)
    k[0, 0, 3] = 100.0
    assert max_attention_logits(q, k).item() == 0.0
    k[0, 0, 0] = 100.0  # now query 0 sees it at key 0
    assert max_attention_logits(q, k).item() == pytest.approx(100.0 * HEAD_DIM / math.sqrt(HEAD_DIM))


@pytest.mark.parametrize("max_elements", [1, 700, 1 << 24])
def test_entropy_is_exact_mean_row_entropy_over_probe_batch(max_elements):
    attention, x, cos, sin = module_and_input(batch=3)
    q, k = projected_qk(attention, x, cos, sin)
    p = torch.softmax(naive_logits(q[:2], k[:2]).double(), dim=-1)
    row_entropy = -torch.special.xlogy(p, p).sum(dim=-1)  # [B, H, T]; xlogy gives 0 log 0 = 0
    expected = row_entropy.mean(dim=(0, 2)).float()
    torch.testing.assert_close(attention_entropy(q[:2], k[:2], max_elements), expected, rtol=1e-5, atol=1e-6)

    attention.probe = True  # probe_batch defaults to 2 of the 3 sequences
    attention(x, cos, sin)
    torch.testing.assert_close(attention.last_entropy, expected, rtol=1e-5, atol=1e-6)


def test_entropy_of_uniform_attention_is_mean_log_row_length():
    seq = 8
    q = torch.zeros(1, 2, seq, HEAD_DIM)  # all logits 0: row i is uniform over i + 1 keys
    expected = sum(math.log(i + 1) for i in range(seq)) / seq
    torch.testing.assert_close(attention_entropy(q, q[:, :1]), torch.full((2,), expected))


def test_probes_are_off_by_default_cost_nothing_and_never_change_the_output(monkeypatch):
    attention, x, cos, sin = module_and_input()
    expected = attention(x, cos, sin)
    assert attention.last_max_logits is None and attention.last_entropy is None

    def must_not_run(*args, **kwargs):
        raise AssertionError("a probe ran while switched off")

    with monkeypatch.context() as patched:
        patched.setattr("fp4lab.nn.attention.max_attention_logits", must_not_run)
        patched.setattr("fp4lab.nn.attention.attention_entropy", must_not_run)
        assert torch.equal(attention(x, cos, sin), expected)

    attention.record_max_logits = attention.probe = True
    assert torch.equal(attention(x, cos, sin), expected)
    assert attention.last_max_logits is not None and attention.last_entropy is not None


# --- FP4 attention ------------------------------------------------------------------------------


def test_fp4_attention_with_quantization_off_matches_sdpa_forward_and_backward():
    q, k, v, grad_out = qkv_and_grad()
    got = output_and_grads(lambda *t: fp4_attention(*t, AttentionQuant(format=None)), q, k, v, grad_out)
    want = output_and_grads(sdpa, q, k, v, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_attention_error_is_within_the_measured_bound(fmt):
    q, k, v, grad_out = qkv_and_grad()
    quant = AttentionQuant(fmt, "sr", torch.Generator().manual_seed(1))
    got = output_and_grads(lambda *t: fp4_attention(*t, quant), q, k, v, grad_out)
    want = output_and_grads(sdpa, q, k, v, grad_out)
    errors = [relative_error(a, b) for a, b in zip(got, want)]
    assert all(0 < e < bound for e, bound in zip(errors, FP4_ERROR_BOUND[fmt])), errors


@pytest.mark.parametrize("chunk_rows", [64, 32])
def test_fp4_attention_stochastic_ds_gradients_average_to_their_expectation(chunk_rows):
    """dQ, dK are linear in dSq, so under SR their mean over draws approaches the unquantized-dS value.

    dQ draws from dS, dK from its own quantization of dS^T. Measured (relative to that expectation), dQ / dK:
    one draw 0.123 / 0.135, mean of 16 draws 0.035 / 0.037, of 64 draws 0.022 / 0.021, RTN 0.090 / 0.088.
    An unbiased mean of 16 would sit at 0.25 x one draw = 0.031 / 0.034; the remainder is nvfp4's own
    saturation bias (an E4M3 block scale rounded down clips its block max), about 1.2 % relative.
    In two chunks of 32 query rows (chunk_rows 32; SR draws chunk by chunk): one draw 0.136 / 0.125, mean
    of 16 draws 0.036 / 0.035, RTN 0.090 / 0.088 (RTN quantizes as one chunk does).
    """
    q, k, v, grad_out = qkv_and_grad(batch=1, n_heads=2, n_kv_heads=1, seq=64)
    chunk_elements = q.shape[0] * q.shape[1] * q.shape[2] * chunk_rows

    def grads(quant: AttentionQuant) -> list[torch.Tensor]:
        return output_and_grads(lambda *t: fp4_attention(*t, quant, chunk_elements), q, k, v, grad_out)[1:3]

    assert_sr_mean_approaches_the_expectation(grads, torch.Generator().manual_seed(0))


def assert_sr_mean_approaches_the_expectation(grads, generator: torch.Generator) -> None:
    """`grads(quant)` gives (dQ, dK): the mean of 16 nvfp4 SR draws from `generator` sits well closer to
    the unquantized-dS gradients than one draw and than RTN."""
    expectation = grads(AttentionQuant("nvfp4", ds_rounding=None))
    draws = [grads(AttentionQuant("nvfp4", "sr", generator)) for _ in range(16)]
    rtn = grads(AttentionQuant("nvfp4", "rtn"))
    for i, name in enumerate(("dq", "dk")):
        single = relative_error(draws[0][i], expectation[i])
        averaged = relative_error(torch.stack([d[i] for d in draws]).mean(dim=0), expectation[i])
        assert averaged < 0.4 * single, (name, averaged, single)  # unbiased: 1/sqrt(16) = 0.25
        assert averaged < 0.5 * relative_error(rtn[i], expectation[i]), name


def test_fp4_attention_saves_fp4_q_k_and_the_unrounded_v():
    q, k, v, _ = qkv_and_grad(batch=1, seq=32)
    out = fp4_attention(q, k, v, AttentionQuant("mxfp4", "rtn"))
    assert out.grad_fn is not None
    q_q, k_q, v_saved = out.grad_fn.saved_tensors
    # mxfp4 values are E2M1 times a power of two: at most 2 significant bits.
    for saved, original in ((q_q, q), (k_q, k)):
        assert saved.shape == original.shape and not torch.equal(saved, original)
        mantissa, _ = torch.frexp(saved)
        assert torch.all((mantissa * 4).frac() == 0)
    assert v_saved is v  # nothing consumes an FP4 V: it is never quantized


# An independent emulation of FP4 attention from its description (fp4_attention's docstring): each FP4
# GEMM's operands quantized along that GEMM's contraction axis, decoded, fp32 products; PV, P^T dO and
# dO V^T on BF16 operands; the backward re-quantizes the forward's Qq, Kq; SR draws dS then dS^T.
# Each entry of EMULATION_BREAKS is one way of getting an axis or a precision wrong; the test checks that
# fp4_attention matches the faithful emulation bit for bit and differs from every broken one.
EMULATION_BREAKS = (
    "dq-ds-along-queries",  # dS for dQ blocked along queries
    "dk-ds-along-keys",  # dS^T for dK blocked along keys (its own draw)
    "dk-reuses-dq-ds",  # dK reads dQ's quantized dS, transposed: no second quantization
    "dq-k-along-head-dim",  # K not re-quantized for dQ: Kq, blocked along head_dim
    "dk-q-along-head-dim",  # Q not re-quantized for dK: Qq, blocked along head_dim
    "dq-dk-from-exact-qk",  # the backward re-quantizes the exact Q, K, not the forward's Qq, Kq
    "v-fp4-in-pv",  # V rounded to FP4 for PV (and dO V^T)
    "v-fp4-in-dp",  # V rounded to FP4 for dO V^T only
)


def _fq(x: torch.Tensor, fmt: str, rounding: str = "rtn", generator: torch.Generator | None = None) -> torch.Tensor:
    """x blocked along its last dim, encoded and decoded to fp32."""
    return quantize(x.contiguous(), fmt, rounding=rounding, generator=generator).dequantize()


def _fq_rows(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., T, D] blocked along T (x^T blocked along its last dim), decoded, in x's layout."""
    return _fq(x.transpose(-1, -2), fmt).transpose(-1, -2)


def emulated_fp4_attention(q, k, v, grad_out, fmt: str, ds_rounding: str, seed: int, broken: str | None = None):
    """(out, dq, dk, dv) of FP4 attention, written from its description; `broken` names a deliberate error."""
    bf16 = lambda x: x.to(torch.bfloat16).float()
    generator = torch.Generator().manual_seed(seed)
    batch, n_heads, seq, head_dim = q.shape
    group = n_heads // k.shape[1]
    per_head = lambda x: x.repeat_interleave(group, dim=1)
    q_q, k_q = _fq(q, fmt), _fq(k, fmt)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    p = torch.softmax((q_q @ per_head(k_q).transpose(-1, -2) / math.sqrt(head_dim)).masked_fill(future, -math.inf), -1)
    v_pv = _fq(v, fmt) if broken == "v-fp4-in-pv" else v
    v_dp = _fq(v, fmt) if broken in ("v-fp4-in-pv", "v-fp4-in-dp") else v
    out = bf16(p) @ bf16(per_head(v_pv))
    dv = bf16(p).transpose(-1, -2) @ bf16(grad_out)
    dp = bf16(grad_out) @ bf16(per_head(v_dp)).transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))

    if broken == "dq-ds-along-queries":
        ds_for_dq = _fq(ds.transpose(-1, -2), fmt, ds_rounding, generator).transpose(-1, -2)
    else:
        ds_for_dq = _fq(ds, fmt, ds_rounding, generator)
    if broken == "dk-ds-along-keys":
        ds_t_for_dk = _fq(ds, fmt, ds_rounding, generator).transpose(-1, -2)
    elif broken == "dk-reuses-dq-ds":
        ds_t_for_dk = ds_for_dq.transpose(-1, -2)
    else:
        ds_t_for_dk = _fq(ds.transpose(-1, -2), fmt, ds_rounding, generator)
    q_src, k_src = (q, k) if broken == "dq-dk-from-exact-qk" else (q_q, k_q)
    k_for_dq = k_q if broken == "dq-k-along-head-dim" else _fq_rows(k_src, fmt)
    q_for_dk = q_q if broken == "dk-q-along-head-dim" else _fq_rows(q_src, fmt)
    scale = 1.0 / math.sqrt(head_dim)
    dq = ds_for_dq @ per_head(k_for_dq) * scale
    dk = ds_t_for_dk @ q_for_dk * scale
    fold = lambda x: x.view(batch, k.shape[1], group, seq, head_dim).sum(2)
    return out, dq, fold(dk), fold(dv)


def position_scaled_qkv(seed: int = 0):
    """GQA inputs whose magnitudes vary along the sequence as well as head_dim, so every axis matters."""
    g = torch.Generator().manual_seed(seed)
    b, h, h_kv, t, d = 1, 4, 2, 64, 32
    scale = torch.logspace(-2, 1, t)[None, None, :, None]
    q = torch.randn(b, h, t, d, generator=g) * scale * torch.logspace(-1, 1, d)
    k = torch.randn(b, h_kv, t, d, generator=g) * scale.flip(2)
    v = torch.randn(b, h_kv, t, d, generator=g) * torch.logspace(1, -1, d)
    return q, k, v, torch.randn(b, h, t, d, generator=g) * scale


@pytest.mark.parametrize(("fmt", "ds_rounding"), [("nvfp4", "sr"), ("nvfp4", "rtn"), ("mxfp4", "sr")])
def test_fp4_attention_is_bit_exact_to_an_emulation_with_every_operand_on_its_contraction_axis(fmt, ds_rounding):
    q, k, v, grad_out = position_scaled_qkv()
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    quant = AttentionQuant(fmt, ds_rounding, torch.Generator().manual_seed(7))
    got = output_and_grads(lambda *t: fp4_attention(*t, quant), *inputs, grad_out)
    want = emulated_fp4_attention(q, k, v, grad_out, fmt, ds_rounding, seed=7)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert torch.equal(a, b), (name, (a - b).abs().max().item())
    for broken in EMULATION_BREAKS:
        wrong = emulated_fp4_attention(q, k, v, grad_out, fmt, ds_rounding, seed=7, broken=broken)
        assert not all(torch.equal(a, b) for a, b in zip(got, wrong)), f"{broken} is indistinguishable"


def test_fp4_attention_needs_sequence_length_multiple_of_32():
    q, k, v, _ = qkv_and_grad(seq=48)
    with pytest.raises(ValueError, match="multiple of 32"):
        fp4_attention(q, k, v, AttentionQuant("nvfp4"))


@pytest.mark.parametrize(("field", "value"), [("format", "int4"), ("format", "nvfp4_cta"), ("ds_rounding", "floor")])
def test_attention_quant_rejects_unknown_settings(field, value):
    with pytest.raises(ValueError, match=field):
        AttentionQuant(**{field: value})


def test_module_runs_fp4_attention_when_quant_is_set():
    attention, x, cos, sin = module_and_input(seq=32)
    exact = attention(x, cos, sin)
    attention.quant = AttentionQuant(format=None)
    torch.testing.assert_close(attention(x, cos, sin), exact, rtol=1e-5, atol=1e-5)
    attention.quant = AttentionQuant("nvfp4", "sr", torch.Generator().manual_seed(0))
    quantized = attention(x, cos, sin)
    quantized.sum().backward()
    assert 0 < relative_error(quantized.detach(), exact.detach()) < 0.3
    assert all(torch.isfinite(p.grad).all() for p in attention.parameters())
