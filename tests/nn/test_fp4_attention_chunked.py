"""FP4 attention in chunks of query rows: the same numerics as one chunk, O(B H rows T) scores at a time.

`fp4_attention(..., chunk_elements)` bounds each [B, H, rows, keys] intermediate; a budget of at least
B * H * T * T elements runs the whole sequence as one chunk, the reference here (tests/nn/test_attention.py
checks that one bit for bit against an emulation written from the docstring).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fp4lab.nn.attention import AttentionQuant, _query_chunks, fp4_attention

ONE_CHUNK = 1 << 40
# dK and dV add their chunks' fp32 products in another order than one chunk's single GEMM, so they
# differ by fp32 reassociation: a few ulps of the sum of |terms| (<= 96 terms of the query dot product
# here, each rounding <= 2^-24 relative). Measured here: at most 4e-8 of max |dK| (dV 1.1e-7); a dS
# element quantized otherwise moves by an FP4 step (>= 1/12 of its block's max), far above the tolerance.
REASSOCIATION_TOLERANCE = 1e-5


def sequence_scaled_qkv(batch=2, n_heads=4, n_kv_heads=2, seq=96, head_dim=32, seed=0):
    """GQA inputs whose magnitudes grow along the sequence: the largest |dS| sits in the last query rows,
    so the first chunks alone would pick smaller NVFP4 tensor scales than the whole dS."""
    g = torch.Generator().manual_seed(seed)
    growth = torch.logspace(-1, 1, seq)[None, None, :, None]
    q = torch.randn(batch, n_heads, seq, head_dim, generator=g) * growth
    k = torch.randn(batch, n_kv_heads, seq, head_dim, generator=g) * growth.flip(2)
    v = torch.randn(batch, n_kv_heads, seq, head_dim, generator=g)
    return q, k, v, torch.randn(batch, n_heads, seq, head_dim, generator=g) * growth


def chunk_elements_for(q: torch.Tensor, rows: int) -> int:
    batch, n_heads, seq, _ = q.shape
    return batch * n_heads * seq * rows


def output_and_grads(q, k, v, grad_out, quant: AttentionQuant, chunk_elements: int) -> list[torch.Tensor]:
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fp4_attention(*inputs, quant, chunk_elements)
    return [out.detach(), *torch.autograd.grad(out, inputs, grad_out)]


def test_query_chunks_cover_the_sequence_in_whole_blocks_within_the_budget():
    q = torch.empty(2, 4, 160, 32)
    for budget, expected_rows in ((chunk_elements_for(q, 64), 64), (chunk_elements_for(q, 63), 32), (1, 32)):
        chunks = _query_chunks(q, budget)
        assert [c.start for c in chunks] == list(range(0, 160, expected_rows))
        assert all(c.stop == min(c.start + expected_rows, 160) for c in chunks)
    assert _query_chunks(q, ONE_CHUNK) == [slice(0, 160)]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
# 96 rows: a budget of 48 rows rounds down to whole mxfp4 blocks (three chunks of 32, not 48 + 48
# cutting a block of dS^T in two); 64 leaves a short last chunk of 32.
@pytest.mark.parametrize("rows", [48, 64])
def test_chunked_rtn_attention_equals_one_chunk(fmt, rows):
    """RTN quantizes every dS element as one chunk does (NVFP4 with the whole dS's tensor scale), so
    O and dQ (per query row) are bit-equal on CPU and dK, dV differ by fp32 summation order only."""
    q, k, v, grad_out = sequence_scaled_qkv()
    quant = AttentionQuant(fmt, "rtn")
    assert len(_query_chunks(q, chunk_elements_for(q, rows))) > 1
    got = output_and_grads(q, k, v, grad_out, quant, chunk_elements_for(q, rows))
    want = output_and_grads(q, k, v, grad_out, quant, ONE_CHUNK)
    for name, a, b in zip(("out", "dq"), got, want):
        assert torch.equal(a, b), (name, (a - b).abs().max().item())
    for name, a, b in zip(("dk", "dv"), got[2:], want[2:]):
        gap = ((a - b).abs().max() / b.abs().max()).item()
        assert gap <= REASSOCIATION_TOLERANCE, (name, gap)


def test_chunked_attention_with_quantization_off_equals_one_chunk():
    q, k, v, grad_out = sequence_scaled_qkv(seq=64)
    quant = AttentionQuant(format=None)
    got = output_and_grads(q, k, v, grad_out, quant, chunk_elements_for(q, 32))
    want = output_and_grads(q, k, v, grad_out, quant, ONE_CHUNK)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=REASSOCIATION_TOLERANCE * b.abs().max().item(), msg=name)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_chunked_sr_gradients_average_to_the_one_chunk_average(fmt):
    """SR draws chunk by chunk (other draws), from the same distribution: the mean dQ, dK over draws
    of the chunked path sits as close to one chunk's mean as two such means sit to each other.

    Measured, relative distance of the 32-draw means (dQ / dK): chunked vs one chunk nvfp4 0.029 / 0.009,
    mxfp4 0.033 / 0.024; one chunk vs one chunk with another seed nvfp4 0.044 / 0.008, mxfp4 0.036 /
    0.017. A bias in either path would stay as the draws average out; tests/nn/test_attention.py holds
    both paths' means to the unquantized-dS expectation as well.
    """
    q, k, v, grad_out = sequence_scaled_qkv(batch=1, n_heads=2, n_kv_heads=1, seq=64)

    def mean_grads(chunk_elements: int, seed: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        draws = [output_and_grads(q, k, v, grad_out, AttentionQuant(fmt, "sr", generator), chunk_elements)[1:3]
                 for _ in range(32)]
        return [torch.stack(d).mean(dim=0) for d in zip(*draws)]

    one_chunk, one_chunk_again = mean_grads(ONE_CHUNK, 0), mean_grads(ONE_CHUNK, 1)
    chunked = mean_grads(chunk_elements_for(q, 32), 2)
    for i, name in enumerate(("dq", "dk")):
        spread = ((one_chunk_again[i] - one_chunk[i]).norm() / one_chunk[i].norm()).item()
        gap = ((chunked[i] - one_chunk[i]).norm() / one_chunk[i].norm()).item()
        assert gap < 2 * spread, (name, gap, spread)


class LargestTensor(TorchDispatchMode):
    """Records the most elements any op's output holds (forward and the autograd backward alike: the
    CPU engine runs the backward on this thread, under this mode)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in torch.utils._pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.numel = max(self.numel, tensor.numel())
        return out


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_no_intermediate_exceeds_one_chunk_of_scores(fmt):
    """Forward and backward (SR, NVFP4's amax pass included) create no tensor larger than one chunk's
    [B, H, rows, T] scores; one chunk creates [B, H, T, T] ones, so the instrument sees them."""
    q, k, v, grad_out = sequence_scaled_qkv(batch=1, n_heads=2, n_kv_heads=1, seq=256, head_dim=32)
    batch, n_heads, seq, head_dim = q.shape
    rows = 32  # B H rows T = B H T D here: the O(B H T D) tensors (Q, K per head, dQ ...) are no larger
    quant = AttentionQuant(fmt, "sr", torch.Generator().manual_seed(0))
    largest = {}
    for name, chunk_elements in (("chunked", chunk_elements_for(q, rows)), ("one chunk", ONE_CHUNK)):
        inputs = [x.clone().requires_grad_() for x in (q, k, v)]
        with LargestTensor() as forward:
            out = fp4_attention(*inputs, quant, chunk_elements)
        with LargestTensor() as backward:
            out.backward(grad_out)
        largest[name] = (forward.numel, backward.numel)
    assert largest["chunked"] == (batch * n_heads * rows * seq,) * 2, largest
    assert largest["one chunk"] == (batch * n_heads * seq * seq,) * 2, largest


@pytest.mark.cuda
def test_cuda_peak_memory_stays_below_one_full_score_matrix():
    """At T = 8192 one fp32 [B, H, T, T] score matrix is 2 GiB; forward plus backward in chunks of the
    default budget (256 MiB each, 8 chunks here) must peak below that, over what inputs and gradients hold."""
    device = torch.device("cuda")
    batch, n_heads, n_kv_heads, seq, head_dim = 1, 8, 2, 8192, 64
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(batch, n_heads, seq, head_dim, device=device, generator=g).requires_grad_()
    k = torch.randn(batch, n_kv_heads, seq, head_dim, device=device, generator=g).requires_grad_()
    v = torch.randn(batch, n_kv_heads, seq, head_dim, device=device, generator=g).requires_grad_()
    grad_out = torch.randn(batch, n_heads, seq, head_dim, device=device, generator=g)
    quant = AttentionQuant("nvfp4", "sr", torch.Generator(device=device).manual_seed(0))
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fp4_attention(q, k, v, quant).backward(grad_out)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    full_scores = batch * n_heads * seq * seq * 4
    assert peak < full_scores, f"peak {peak / 2**30:.2f} GiB, one score matrix {full_scores / 2**30:.2f} GiB"
    assert all(torch.isfinite(x.grad).all() for x in (q, k, v))


def check_tensor_core_fp4_attention(device: str) -> None:
    """`AttentionQuant.tensor_cores`: every GEMM on bf16 operands with fp32 accumulation, the FP4 ones on
    block values with the outer scales after. Against the fp32 GEMMs of decoded values (the reference):

    - Q and K along head_dim, K and Q along the sequence and RTN dS in both orientations get the same
      codes and scales: their block values times outer scale are the reference's decoded values, bit for bit;
    - an FP4 GEMM then differs only by roundings: the reference rounds each decoded element once
      (<= u, u = 2^-24), so each product by <= 2u + u^2, and sums k of them in fp32; the tensor-core path
      sums exact products (bf16 x bf16 is exact in fp32) and rounds the outer product and the scaled
      result once each. A recursive fp32 sum of k terms errs by <= (k - 1) u sum |terms| (Higham,
      Thm 3.1); Hopper's MMA is taken as 4u per addition (it aligns addends by truncation). So
      |fast - ref| <= ((k - 1) 5u + 5u) sum |a| |b| over the decoded operands;
    - through softmax and dS's quantization a moved rounding can flip a code downstream, so the outputs
      and gradients are held to being as close to exact attention as the reference's."""
    from fp4lab.nn.attention import _fp4_matmul, _quant_ds, _quant_operand, _quant_operand_seq

    u = 2.0**-24
    q, k, v, grad_out = (t.to(device) for t in sequence_scaled_qkv(batch=1, n_heads=2, n_kv_heads=1, seq=64, head_dim=32))
    for fmt in ("nvfp4", "mxfp4"):
        ref_quant, fast_quant = AttentionQuant(fmt, "rtn"), AttentionQuant(fmt, "rtn", tensor_cores=True)
        ref_q, ref_k = _quant_operand(q, ref_quant), _quant_operand(k, ref_quant)
        fast_q, fast_k = _quant_operand(q, fast_quant), _quant_operand(k, fast_quant)
        assert fast_q.values.dtype == torch.bfloat16 and ref_q.values.dtype == torch.float32
        assert torch.equal(fast_q.decoded(), ref_q.values) and torch.equal(fast_k.decoded(), ref_k.values)
        for fast_seq, ref_seq in ((_quant_operand_seq(fast_k, fast_quant), _quant_operand_seq(ref_k, ref_quant)),
                                  (_quant_operand_seq(fast_q, fast_quant), _quant_operand_seq(ref_q, ref_quant))):
            assert torch.equal(fast_seq.decoded(), ref_seq.values)
        grad_scores = torch.randn(1, 2, 64, 64, generator=torch.Generator().manual_seed(5)).to(device)
        for fast_ds, ref_ds in zip(_quant_ds(grad_scores, fast_quant, None, None), _quant_ds(grad_scores, ref_quant, None, None)):
            assert torch.equal(fast_ds.decoded(), ref_ds.values)
        k_heads = (fast_k.repeat_heads(2), ref_k.repeat_heads(2))
        for a, b, ra, rb in [(fast_q, k_heads[0].mT(), ref_q, k_heads[1].mT()),  # S: contracts head_dim
                             (fast_ds, _quant_operand_seq(fast_q, fast_quant), ref_ds, _quant_operand_seq(ref_q, ref_quant))]:  # dK's
            fast, ref = _fp4_matmul(a, b), _fp4_matmul(ra, rb)
            terms = a.values.shape[-1]
            bound = ((terms - 1) * 5 * u + 5 * u) * (ra.values.abs() @ rb.values.abs())
            assert ((fast - ref).abs() - bound).max() <= 0, fmt
            # NVFP4's outer scales make it another computation (MXFP4's E8M0-scaled products, a few bits
            # each, can sum exactly in fp32 either way).
            assert fmt == "mxfp4" or not torch.equal(fast, ref)
        exact = output_and_grads(q, k, v, grad_out, AttentionQuant(format=None), ONE_CHUNK)
        ref = output_and_grads(q, k, v, grad_out, ref_quant, ONE_CHUNK)
        fast = output_and_grads(q, k, v, grad_out, fast_quant, ONE_CHUNK)
        for i in range(4):  # O, dQ, dK, dV
            error = lambda got: ((got[i] - exact[i]).norm() / exact[i].norm()).item()
            assert error(fast) <= 1.25 * error(ref) + 0.01, (fmt, i, error(fast), error(ref))


def test_tensor_core_fp4_attention_under_the_interpreter():
    from tests import interpreted

    interpreted.run_interpreted(__name__, "check_tensor_core_fp4_attention('cpu')")


@pytest.mark.cuda
def test_tensor_core_fp4_attention_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU)")
    pytest.importorskip("triton")
    check_tensor_core_fp4_attention("cuda")


def test_the_tensor_core_flag_reaches_fp4_attention_from_the_fast_path():
    from fp4lab.nn.build import build_model
    from fp4lab.nn.model_config import preset
    from fp4lab.nn.recipe import load_recipe

    for fast in (False, True):
        model = build_model(preset("tiny", 256, 64), load_recipe("fullstack"), seed=0, tensor_cores=fast)
        assert [a.quant.tensor_cores for a in model.attentions()] == [fast] * len(model.attentions())
