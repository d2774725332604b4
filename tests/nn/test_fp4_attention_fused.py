"""FP4 attention on the fused Triton quantizers: what `fp4_attention` runs where Triton runs.

Q and K (along head_dim, then along the sequence) and dS with dS^T (one read of dS, both
orientations) go through `numerics.kernels.quantize` instead of the torch reference; every other
operation is the same code. So with round-to-nearest the result equals the reference path's bit for
bit on the same device (tests/nn/test_attention.py holds that one to an emulation from the docstring),
also in chunks, where NVFP4's tensor scale of the whole dS reaches the kernel as `tensor_amax`; with
SR the Philox draws average to the same expectation.

CPU (CI): the exact and the seeding checks, each in a fresh Python under Triton's interpreter
(TRITON_INTERPRET=1), small shapes. CUDA (`cuda` marker): those and the average over SR draws.
"""

from __future__ import annotations

import pytest
import torch

import fp4lab.numerics.kernels as kernels
from fp4lab.nn.attention import AttentionQuant
from tests import interpreted
from tests.nn.test_attention import assert_sr_mean_approaches_the_expectation, qkv_and_grad
from tests.nn.test_fp4_attention_chunked import chunk_elements_for, output_and_grads, sequence_scaled_qkv


class FusedCalls:
    """Counts the fused quantizer's calls (the attention imports them at call time)."""

    def __enter__(self):
        from fp4lab.numerics.kernels import quantize as triton_quantize

        self.module, self.one, self.both = triton_quantize, triton_quantize.quantize_fused, triton_quantize.quantize_fused_both
        self.calls = {"one": 0, "both": 0}

        def one(x, **options):
            self.calls["one"] += 1
            return self.one(x, **options)

        def both(x, row, col):
            self.calls["both"] += 1
            return self.both(x, row, col)

        triton_quantize.quantize_fused, triton_quantize.quantize_fused_both = one, both
        return self.calls

    def __exit__(self, *exc):
        self.module.quantize_fused, self.module.quantize_fused_both = self.one, self.both


def on(device: str, tensors):
    return [t.to(device) for t in tensors]


def reference_path(function, *args):
    """`function(*args)` with the fused quantizers switched off (the one question both the attention
    and `kernels.fake_quantize` ask, `kernels.runs_on`): the torch reference quantizers."""
    runs_on = kernels.runs_on
    kernels.runs_on = lambda device: False
    try:
        return function(*args)
    finally:
        kernels.runs_on = runs_on


def check_fused_rtn_equals_the_reference(device: str) -> None:
    """RTN dS, in one chunk and in two: out, dQ, dK, dV equal the torch reference path's on the same
    device bit for bit (the same fp32 sums of the same decoded operands), and every quantization went
    through the fused kernels: Q and K (forward), K and Q along the sequence, then one read of each
    chunk's dS for both orientations. In two chunks each gets the whole dS's NVFP4 tensor scale: the
    largest |dS| sits in the last rows, so a chunk's own amax would give other bits.

    mxfp4 runs on unit Gaussians: sequence-scaled inputs give dS blocks of E8M0 scale 2^-127 whose
    decoded values are fp32 subnormals, which Triton's interpreter flushes to zero (the kernels keep
    them on CUDA: tests/kernels/test_triton_quantize.py's "wide" inputs)."""
    assert kernels.runs_on(torch.device(device))
    shape = dict(batch=1, n_heads=2, n_kv_heads=1, seq=64)
    for fmt, qkv in (("nvfp4", sequence_scaled_qkv(**shape)), ("mxfp4", qkv_and_grad(**shape))):
        q, k, v, grad_out = on(device, qkv)
        for chunks, chunk_elements in ((1, 1 << 40), (2, chunk_elements_for(q, 32))):
            quant = AttentionQuant(fmt, "rtn")
            with FusedCalls() as calls:
                fused = output_and_grads(q, k, v, grad_out, quant, chunk_elements)
            assert calls == {"one": 4, "both": chunks}, (fmt, chunks, calls)
            reference = reference_path(output_and_grads, q, k, v, grad_out, quant, chunk_elements)
            for name, a, b in zip(("out", "dq", "dk", "dv"), fused, reference):
                assert torch.equal(a, b), (fmt, chunks, name, (a - b).abs().max().item())


def sr_grads(device: str):
    """dQ, dK of unit-Gaussian inputs (those tests/nn/test_attention.py measures SR on) under `quant`."""
    q, k, v, grad_out = on(device, qkv_and_grad(batch=1, n_heads=2, n_kv_heads=1, seq=64))
    return lambda quant: output_and_grads(q, k, v, grad_out, quant, 1 << 40)[1:3]


def check_fused_sr_draws_from_the_generator(device: str) -> None:
    """SR dS on the fused kernels draws its Philox seeds from quant.generator: the same generator state
    gives the same bits, another state other bits, and neither is RTN's."""
    grads = sr_grads(device)
    generator = lambda seed: torch.Generator(device=device).manual_seed(seed)
    with FusedCalls() as calls:
        first = grads(AttentionQuant("nvfp4", "sr", generator(0)))
    assert calls == {"one": 4, "both": 1}, calls
    again, other = (grads(AttentionQuant("nvfp4", "sr", generator(s))) for s in (0, 1))
    rtn = grads(AttentionQuant("nvfp4", "rtn"))
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not any(torch.equal(a, b) for a, b in zip(first, other))
    assert not any(torch.equal(a, b) for a, b in zip(first, rtn))


def check_fused_sr_averages_to_the_expectation(device: str) -> None:
    """The mean dQ, dK over 16 SR draws approaches the unquantized-dS gradients as tests/nn/test_attention.py
    measures for the reference (one draw about 0.13 from it, the mean of 16 about 0.035, RTN 0.09)."""
    assert_sr_mean_approaches_the_expectation(sr_grads(device), torch.Generator(device=device).manual_seed(2))


INTERPRETED_CHECKS = ("check_fused_rtn_equals_the_reference", "check_fused_sr_draws_from_the_generator")


def test_fused_fp4_attention_under_the_interpreter():
    interpreted.run_interpreted(__name__, [f"{check}('cpu')" for check in INTERPRETED_CHECKS])


# 16 SR draws take minutes under the interpreter: the average runs on CUDA only.
@pytest.mark.cuda
@pytest.mark.parametrize("check", (*INTERPRETED_CHECKS, "check_fused_sr_averages_to_the_expectation"))
def test_fused_fp4_attention_on_cuda(check):
    globals()[check]("cuda")
