"""The fused NVFP4 GEMM epilogue equals `(acc * (a_outer * b_outer)).to(out_dtype)` bit for bit."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fp4lab.numerics.kernels.epilogue import scale_result  # noqa: E402
from tests import interpreted  # noqa: E402

MODES = {
    "scalar a": lambda m, n: (torch.tensor(3.7e-3), None),
    "scalar b": lambda m, n: (None, torch.tensor(1.3e2)),
    "scalar both": lambda m, n: (torch.tensor(3.7e-3), torch.tensor(1.3e2)),
    "rows and scalar": lambda m, n: (torch.rand(m, 1) * 1e-2 + 1e-4, torch.tensor(7.1)),
    "rows and cols": lambda m, n: (torch.rand(m, 1) + 0.5, torch.rand(n) * 3 + 0.25),
}


def reference(acc, a, b, out_dtype):
    if b is not None and b.dim():
        b = b.reshape(1, -1)
    alpha = b if a is None else a if b is None else a * b
    return (acc * alpha).to(out_dtype)


def test_the_numerics_reference_is_this_emulation_bit_for_bit():
    from fp4lab.numerics.epilogue import scale_result_reference

    for _, acc, a, b in cases("cpu"):
        for out_dtype in (torch.bfloat16, torch.float32):
            assert torch.equal(scale_result_reference(acc, a, b, out_dtype), reference(acc, a, b, out_dtype))


def cases(device):
    torch.manual_seed(0)
    for name, make in MODES.items():
        for m, n in ((256, 512), (37, 300)):  # a ragged shape exercises the masks
            acc = torch.randn(m, n) * torch.logspace(-8, 8, n)  # magnitudes across the fp32 range
            a, b = make(m, n)
            yield name, acc.to(device), *(t if t is None else t.to(device) for t in (a, b))


@pytest.mark.cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_epilogue_equals_the_torch_reference_on_cuda(out_dtype):
    for name, acc, a, b in cases("cuda"):
        expected = reference(acc, a, b, out_dtype)
        got = scale_result(acc.clone(), a, b, out_dtype)
        assert got.dtype == out_dtype and torch.equal(got, expected), name


@pytest.mark.cuda
def test_fp32_epilogue_writes_in_place():
    acc = torch.randn(64, 128, device="cuda")
    assert scale_result(acc, torch.tensor(2.0, device="cuda"), None, torch.float32).data_ptr() == acc.data_ptr()


INTERPRETED = """
import torch, sys
from tests.kernels.test_triton_epilogue import cases, reference
from fp4lab.numerics.kernels.epilogue import scale_result
for name, acc, a, b in cases("cpu"):
    got = scale_result(acc.clone(), a, b, torch.float32)
    assert torch.equal(got, reference(acc, a, b, torch.float32)), name
"""


def test_epilogue_under_triton_interpreter():
    """The kernel's float32 arithmetic, run by Triton's CPU interpreter, equals the reference (fp32 out:
    the interpreter's bf16 cast truncates where the GPU's rounds to nearest even)."""
    done = interpreted.interpreter_python(INTERPRETED.format(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize(
    "acc, a, b, out_dtype, message",
    [
        (torch.zeros(4, 4, dtype=torch.bfloat16), torch.tensor(1.0), None, torch.bfloat16, "contiguous 2D float32"),
        (torch.zeros(4, 4).T, torch.tensor(1.0), None, torch.bfloat16, "contiguous 2D float32"),
        (torch.zeros(4, 4), torch.ones(3), None, torch.bfloat16, "a_outer holds 3 scales where 1 or 4"),
        (torch.zeros(4, 4), None, None, torch.bfloat16, "nothing to scale by"),
        (torch.zeros(4, 4), torch.tensor(1.0), None, torch.int8, "out_dtype"),
    ],
)
def test_epilogue_refuses_what_it_cannot_compute(acc, a, b, out_dtype, message):
    with pytest.raises(ValueError, match=message):
        scale_result(acc, a, b, out_dtype)
