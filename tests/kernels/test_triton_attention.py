"""The Triton flash attention (fp4lab.numerics.kernels.attention) against SDPA, autograd and the two probes.

Each check is a function of (device, dtype, shapes) that raises on a mismatch. The CPU tests run them
in a subprocess under TRITON_INTERPRET=1 (fp32, small shapes: B=2, H=4, H_kv=2, T in {1, 17, 40,
64}, D in {16, 32}; the interpreter's tiles are 32 x 16 and 16 x 32: T=17 ends inside the first tile,
T=40 in a second one, and every diagonal tile is split in two by the other operand's tiles); the CUDA
tests (@pytest.mark.cuda, skipped without a GPU) run the same checks with bf16 inputs at training
shapes. The bf16 check also runs under the interpreter at small shapes, with its bf16 dots and casts
made to behave as the GPU's (INTERPRETED below): it covers the bf16 casts of P, dS and the outputs,
not the GPU's own arithmetic.

Errors of O, dQ, dK, dV are max |got - want| / max(max |want|, 1): elementwise relative error means
nothing where a gradient cancels to ~0 (dQ, dK are exactly 0 at T=1, both sides give ~1e-7 noise),
and the inputs here are O(1).

fp32 tolerances (interpreter; measured errors in brackets):
- O, LSE 1e-5 [3e-7]: the same fp32 softmax, summed in another order (tiles of 16 keys, exp2 instead of
  exp): a few ulps, far below 1e-5;
- dQ, dK, dV 1e-5 [1.4e-6]: the same, through three GEMMs;
- max logit: bit for bit with dyadic inputs (every partial sum of q.k exact, so both sides hold the
  same dot products, and both divide by sqrt(D) correctly rounded); with normal inputs within the
  summation-order error of the dot products (`max_logit_bound`, about 4 D 2^-24 max sum_d |q_d k_d| /
  sqrt(D); measured 1.3 % of it). On CUDA the probe divides by sqrt(D) as a multiplication by the
  reciprocal: still exact for D = 16, 64 (powers of 4), within one ulp for D = 32, 128;
- entropy 1e-6 absolute [2.4e-7]: log l - u / l accumulated per tile against the probe's
  log_softmax; a few ulps per row, and the mean over rows averages them.
"""

from __future__ import annotations

import math
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402 (after the skip: these need Triton)

from fp4lab.numerics.attention import attention_entropy, max_attention_logits  # noqa: E402
from fp4lab.numerics.kernels import attention as triton_attention  # noqa: E402
from tests import interpreted  # noqa: E402

CPU_SHAPES = [(2, 4, 2, seq, head_dim) for seq in (1, 17, 40, 64) for head_dim in (16, 32)]  # B, H, H_kv, T, D
GPU_SHAPES = [(2, 12, 4, 1024, 64), (4, 12, 4, 2048, 128), (2, 12, 4, 4096, 64), (3, 12, 4, 1537, 128)]
FP32_TOLERANCE = {"out": 1e-5, "lse": 1e-5, "grad": 1e-5, "entropy": 1e-6}
# On a GPU tl.exp2 is ex2.approx (2 ulps) and rows sum up to 1024 terms: ten times the CPU's.
FP32_CUDA_TOLERANCE = {"out": 1e-4, "lse": 1e-5, "grad": 1e-4, "entropy": 1e-5}
# The polynomial exp2 (relative error 8.6e-5 per exponential) moves O and the gradients by about that.
FP32_POLY_TOLERANCE = {"out": 5e-4, "lse": 5e-4, "grad": 5e-4, "entropy": 5e-4}
# bf16 inputs: O and the gradients are held to twice the error of torch's own bf16 SDPA (both against
# fp32 attention of the same bf16 inputs) plus 2^-9 (one bf16 rounding); the statistics stay fp32
# (logits and P are fp32 in the kernel): the entropy differs by the summation order of up to 4096
# terms and ex2.approx's 2 ulps per exponential, well inside 1e-4.
BF16_STATISTICS_TOLERANCE = {"lse": 1e-4, "entropy": 1e-4}
UNIT_ROUNDOFF = 2.0**-24  # fp32: half an ulp of 1


def make_inputs(batch, n_heads, n_kv_heads, seq, head_dim, dtype=torch.float32, device="cpu", seed=0, logit_scale=2.0):
    """q, k, v as Attention.forward hands them over: [B, H, T, D] views of [B, T, H, D] (strided, last
    dim contiguous), needing grad. q is scaled so the logits spread over several units (peaked and
    flat rows alike)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, n_heads, head_dim, generator=g) * logit_scale
    k, v = (torch.randn(batch, seq, n_kv_heads, head_dim, generator=g) for _ in range(2))
    return tuple(x.to(device=device, dtype=dtype).transpose(1, 2).requires_grad_() for x in (q, k, v))


def sdpa_and_grads(q, k, v, grad_out, dtype):
    """Causal GQA SDPA of q, k, v cast to dtype, and dq, dk, dv for grad_out (returned in fp32)."""
    q, k, v = (x.detach().to(dtype).requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(dtype))
    return out.float(), *(g.float() for g in grads)


def causal_lse(q, k):
    """log-sum-exp over the causal keys of each row's logits, fp32 [B, H, T]."""
    group = q.shape[1] // k.shape[1]
    logits = q.float() @ k.float().repeat_interleave(group, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    seq = q.shape[2]
    future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    return torch.logsumexp(logits.masked_fill(future, -math.inf), dim=-1)


def error(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / max(want.float().abs().max().item(), 1.0)).item()


def max_logit_bound(q, k) -> torch.Tensor:
    """Per head, the worst difference of two fp32 dot products summed in different orders, divided by
    sqrt(D): each is off by at most (D + 1) u sum_d |q_d k_d| (Higham's gamma_D, u = 2^-24), counted
    twice for each side since tensor cores may truncate their additions instead of rounding them; plus
    one ulp (<= 2u |x|) for a divisor rounded differently (CUDA's probe multiplies by 1 / sqrt(D))."""
    head_dim = q.shape[-1]
    worst = max_attention_logits(q.detach().abs(), k.detach().abs())
    return (4 * (head_dim + 1) + 2) * UNIT_ROUNDOFF * worst


def run_attention(q, k, v, grad_out, exp2_poly=False, probe_batch=None):
    result = triton_attention.flash_attention(q, k, v, exp2_poly=exp2_poly, probe_batch=probe_batch)
    grads = torch.autograd.grad(result.out, (q, k, v), grad_out)
    return result, grads


# --- checks (run under the interpreter on CPU, and on CUDA) ------------------------------------


def check_fp32_against_references(device="cpu", shapes=CPU_SHAPES, exp2_poly=False, tolerance=None):
    """fp32 inputs: O, LSE and dQ, dK, dV against SDPA and its autograd, the statistics against the probes."""
    tolerance = tolerance or (FP32_POLY_TOLERANCE if exp2_poly else FP32_TOLERANCE)
    for seed, shape in enumerate(shapes):
        q, k, v = make_inputs(*shape, device=device, seed=seed)
        grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 100)).to(device)
        result, grads = run_attention(q, k, v, grad_out, exp2_poly=exp2_poly)
        want_out, *want_grads = sdpa_and_grads(q, k, v, grad_out, torch.float32)
        label = f"{shape} exp2_poly={exp2_poly}"
        assert result.out.dtype == torch.float32 and result.out.shape == q.shape, label
        assert error(result.out, want_out) <= tolerance["out"], f"{label}: O error {error(result.out, want_out):.2e}"
        assert error(result.lse, causal_lse(q, k)) <= tolerance["lse"], f"{label}: LSE error {error(result.lse, causal_lse(q, k)):.2e}"
        for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads):
            assert got.shape == want.shape and got.dtype == torch.float32, f"{label}: {name} {got.shape} {got.dtype}"
            assert error(got, want) <= tolerance["grad"], f"{label}: {name} error {error(got, want):.2e}"
        check_statistics(result, q, k, tolerance["entropy"], label)
        if exp2_poly and shape[3] > 1:  # the flag takes effect (exp2(0) = 1 either way: T=1 cannot tell)
            default_lse = triton_attention.flash_attention(q, k, v).lse
            assert error(result.lse, default_lse) > FP32_TOLERANCE["lse"] / 10, f"{label}: exp2_poly changed nothing"


def check_statistics(result, q, k, entropy_tolerance, label):
    """Per head: max logits against max_attention_logits within the dot products' summation-order bound,
    entropy against attention_entropy; detached, fp32, [H]."""
    for name in ("lse", "row_max_logits", "row_entropy", "max_logits", "entropy"):
        stat = getattr(result, name)
        assert stat.dtype == torch.float32 and not stat.requires_grad, f"{label}: {name} {stat.dtype} {stat.requires_grad}"
    want_max = max_attention_logits(q, k)
    gap = (result.max_logits - want_max).abs()
    assert result.max_logits.shape == (q.shape[1],) and (gap <= max_logit_bound(q, k)).all(), f"{label}: max logits off by {gap.max():.2e}"
    want_entropy = attention_entropy(q, k)
    gap = (result.entropy - want_entropy).abs().max().item()
    assert result.entropy.shape == (q.shape[1],) and gap <= entropy_tolerance, f"{label}: entropy off by {gap:.2e}"


def check_max_logits_exact(device="cpu", dtype=torch.float32, shapes=CPU_SHAPES, ulps=0):
    """Dyadic inputs (multiples of 1/4 up to 2: every product and partial sum exact in fp32, so any
    summation order gives the same dot products): S_max^h equals the probe's to `ulps` (0 on the CPU,
    where both divide by sqrt(D) correctly rounded)."""
    for seed, (batch, n_heads, n_kv_heads, seq, head_dim) in enumerate(shapes):
        g = torch.Generator().manual_seed(seed)
        q = torch.randint(-8, 9, (batch, n_heads, seq, head_dim), generator=g) / 4
        k = torch.randint(-8, 9, (batch, n_kv_heads, seq, head_dim), generator=g) / 4
        q, k = q.to(device=device, dtype=dtype), k.to(device=device, dtype=dtype)
        result = triton_attention.flash_attention(q, k, k)
        want = max_attention_logits(q, k)
        spacing = torch.nextafter(want, torch.full_like(want, math.inf)) - want
        gap = (result.max_logits - want).abs()
        assert (gap <= ulps * spacing).all(), f"{(batch, n_heads, n_kv_heads, seq, head_dim)}: max logits off by {gap.max():.3e}"
        # per row: the max over keys j <= i of the logits (the masked-out future never leaks in)
        want_rows = causal_row_max(q, k)
        row_gap = (result.row_max_logits - want_rows).abs()
        assert (row_gap <= ulps * (torch.nextafter(want_rows, want_rows + 1) - want_rows)).all(), f"{seq, head_dim}: row max"


def causal_row_max(q, k):
    """max over the causal keys of each row's logits, fp32 [B, H, T]."""
    group = q.shape[1] // k.shape[1]
    logits = q.float() @ k.float().repeat_interleave(group, dim=1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    future = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).triu(1)
    return logits.masked_fill(future, -math.inf).amax(dim=-1)


def check_probe_batch(device="cpu", dtype=torch.float32, shape=(3, 4, 2, 17, 16), entropy_tolerance=1e-6):
    """probe_batch=n averages the entropy over the first n sequences only, as Attention.probe_batch
    does (more than the batch: all of it); the max logit always covers the whole batch."""
    q, k, v = make_inputs(*shape, dtype=dtype, device=device)
    whole_batch = attention_entropy(q, k)
    for probe_batch in (1, 2, 5):
        result = triton_attention.flash_attention(q, k, v, probe_batch=probe_batch)
        want = attention_entropy(q[:probe_batch], k[:probe_batch])
        gap = (result.entropy - want).abs().max().item()
        assert gap <= entropy_tolerance, f"probe_batch={probe_batch}: entropy off by {gap:.2e}"
        # the subset's entropy is told apart from the whole batch's, so ignoring probe_batch would fail
        assert probe_batch >= shape[0] or (want - whole_batch).abs().max() > 10 * entropy_tolerance
        assert torch.equal(result.max_logits, result.row_max_logits.amax(dim=(0, 2)))


@triton.jit
def _exp2_poly_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, triton_attention._exp2_poly(x), mask=offsets < n)


def check_exp2_poly_error(device="cpu", points=1 << 16):
    """The polynomial exp2's worst relative error over [-126, 0], the attention's arguments (s - max),
    is at most EXP2_POLY_MAX_REL_ERROR and within 1 % of it (the documented figure is the measured one);
    2^0 = 1 and integers are exact; below -126 (and -inf) it gives 0."""
    whole = torch.arange(-126, 1, dtype=torch.float32)
    fractions = torch.linspace(0, 1, points // 128, dtype=torch.float64)[:-1]
    x = (whole[:-1, None].double() + fractions[None, :]).flatten().float()
    x = torch.cat((x, whole, torch.tensor([-126.5, -127.0, -300.0, -math.inf]))).to(device)
    out = torch.empty_like(x)
    _exp2_poly_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    x, out = x.cpu(), out.cpu()
    in_range = x >= -126
    relative = (out[in_range].double() / torch.exp2(x[in_range].double()) - 1).abs().max().item()
    bound = triton_attention.EXP2_POLY_MAX_REL_ERROR
    assert 0.99 * bound <= relative <= bound, f"exp2 polynomial: max relative error {relative:.4e} against the documented {bound:.4e}"
    assert torch.equal(out[-131:-4], torch.exp2(whole)), "exp2 polynomial: integer arguments are not exact"
    assert torch.equal(out[-4:], torch.zeros(4)), "exp2 polynomial: arguments below -126 do not give 0"


def check_bf16_against_references(device="cuda", shapes=GPU_SHAPES, exp2_poly=False):
    """bf16 inputs on CUDA: O and dQ, dK, dV within twice torch's bf16 SDPA error (+ one bf16 rounding),
    both against fp32 attention of the same bf16 values; LSE, max logits, entropy as in fp32."""
    for seed, shape in enumerate(shapes):
        q, k, v = make_inputs(*shape, dtype=torch.bfloat16, device=device, seed=seed)
        grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 100)).to(device, torch.bfloat16)
        result, grads = run_attention(q, k, v, grad_out, exp2_poly=exp2_poly)
        exact = sdpa_and_grads(q, k, v, grad_out, torch.float32)
        torch_bf16 = sdpa_and_grads(q, k, v, grad_out, torch.bfloat16)
        label = f"{shape} exp2_poly={exp2_poly}"
        assert result.out.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in grads), label
        for name, got, want, theirs in zip(("out", "dq", "dk", "dv"), (result.out, *grads), exact, torch_bf16):
            allowed = 2 * error(theirs, want) + 2.0**-9
            assert error(got, want) <= allowed, f"{label}: {name} error {error(got, want):.2e} > {allowed:.2e}"
        # The polynomial exp2 scales each exp by (1 + e), |e| <= EXP2_POLY_MAX_REL_ERROR: the LSE moves by
        # at most log(1 + e) <= e; the entropy by at most 2e (log Z and the mean log(1 + e)) plus
        # 2e times the probabilities' mean absolute deviation of the logits, below the logits' range.
        poly = triton_attention.EXP2_POLY_MAX_REL_ERROR if exp2_poly else 0.0
        logit_range = (max_attention_logits(q, k) + max_attention_logits(-q, k)).max().item()
        lse_error = error(result.lse, causal_lse(q, k))
        assert lse_error <= BF16_STATISTICS_TOLERANCE["lse"] + poly, f"{label}: LSE error {lse_error:.2e}"
        check_statistics(result, q, k, BF16_STATISTICS_TOLERANCE["entropy"] + poly * (2 + 2 * logit_range), label)


# --- CPU: the checks under Triton's interpreter -------------------------------------------------

# Three gaps of Triton 3.6's interpreter, filled in the subprocess before a check runs:
# - loop bounds that derive from program_id become ints through int() of a 1-element array, which
#   numpy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream by #9172);
# - tl.dot multiplies bf16 operands as their uint16 bit patterns: they are widened to fp32 first
#   (exact, as the GPU's bf16 products are);
# - fp32 -> bf16 casts truncate: they round to nearest even, as the GPU's do (torch's cast).
INTERPRETED = """
import sys
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter

original_patch, original_dot, original_cast = (
    interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot, interpreter.InterpreterBuilder.cast_impl
)

def patch(tensor, scope):
    original_patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

def widen(operand):
    if operand.dtype != tl.bfloat16:
        return operand
    return interpreter.TensorHandle((operand.data.astype(np.uint32) << 16).view(np.float32), tl.float32)

def create_dot(self, a, b, *rest):
    return original_dot(self, widen(a), widen(b), *rest)

def cast_impl(self, src, dst_type):
    if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
        return original_cast(self, src, dst_type)
    rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
    return interpreter.TensorHandle(rounded.numpy().view(np.uint16), tl.bfloat16)

interpreter._patch_lang_tensor = patch
interpreter.InterpreterBuilder.create_dot = create_dot
interpreter.InterpreterBuilder.cast_impl = cast_impl
"""


def run_interpreted(module: str, calls: str | list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`calls` of the test module `module` (e.g. "tests.kernels.test_triton_attention"), in order, in one
    fresh Python under TRITON_INTERPRET=1 with the interpreter's gaps above filled
    (`interpreted.checks_code`); the completed process (check its returncode; stderr names what failed)."""
    return interpreted.interpreter_python(INTERPRETED + interpreted.checks_code(module, calls), timeout)


INTERPRETED_CHECKS = [
    "check_fp32_against_references()",
    "check_max_logits_exact()",
    "check_probe_batch()",
    "check_exp2_poly_error()",
    "check_fp32_against_references(shapes=[(2, 4, 2, 17, 16), (2, 4, 2, 64, 32)], exp2_poly=True)",
    "check_bf16_against_references(device='cpu', shapes=[(2, 4, 2, 64, 32), (2, 4, 2, 40, 16)])",
    "check_bf16_against_references(device='cpu', shapes=[(2, 4, 2, 64, 32)], exp2_poly=True)",
]


@pytest.mark.slow  # ~50 s: started first under xdist
def test_kernels_under_triton_interpreter():
    done = run_interpreted(__name__, INTERPRETED_CHECKS, timeout=600)
    assert done.returncode == 0, done.stderr[-8000:]


# --- CUDA: bf16 at training shapes --------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("exp2_poly", [False, True], ids=["exp2", "exp2_poly"])
def test_bf16_matches_references_on_cuda(exp2_poly):
    check_bf16_against_references(exp2_poly=exp2_poly)


@pytest.mark.cuda
def test_fp32_matches_references_on_cuda():
    check_fp32_against_references(device="cuda", shapes=[(2, 12, 4, 1024, 64), (2, 12, 4, 777, 128)], tolerance=FP32_CUDA_TOLERANCE)


@pytest.mark.cuda
def test_max_logits_exact_on_cuda():
    """bf16 dyadic inputs: D=64 bit for bit; D=128 within one ulp (CUDA's probe divides by sqrt(128)
    as a multiplication by its fp32 reciprocal, the kernel with correct rounding)."""
    check_max_logits_exact(device="cuda", dtype=torch.bfloat16, shapes=[(2, 12, 4, 2048, 64)], ulps=0)
    check_max_logits_exact(device="cuda", dtype=torch.bfloat16, shapes=[(2, 12, 4, 1025, 128)], ulps=1)


@pytest.mark.cuda
def test_probe_batch_on_cuda():
    check_probe_batch(device="cuda", dtype=torch.bfloat16, shape=(4, 12, 4, 1024, 64), entropy_tolerance=1e-4)


@pytest.mark.cuda
def test_exp2_poly_error_on_cuda():
    check_exp2_poly_error(device="cuda")


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes, dtypes, message",
    [
        (((2, 4, 8, 48), (2, 2, 8, 48), (2, 2, 8, 48)), None, r"head_dim 48 is not supported; use one of \(16, 32, 64, 128\)"),
        (((2, 6, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16)), None, r"q's 6 heads are not a multiple of k's 4; make n_heads a multiple of n_kv_heads"),
        (((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 9, 16)), None, r"k \(2, 2, 8, 16\) and v \(2, 2, 9, 16\) differ"),
        (((2, 4, 8, 16), (2, 2, 9, 16), (2, 2, 9, 16)), None, "differ in batch, seq or head_dim"),
        (((1, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16)), None, "differ in batch, seq or head_dim"),
        (((4, 8, 16), (2, 8, 16), (2, 8, 16)), None, r"q has shape \(4, 8, 16\); pass \[batch, heads, seq, head_dim\]"),
        (None, (torch.float16, torch.float16, torch.float16), "q is torch.float16; cast q, k, v to torch.bfloat16 or torch.float32"),
        (None, (torch.float32, torch.bfloat16, torch.float32), "give them one dtype"),
    ],
)
def test_unsupported_inputs_raise_value_error(shapes, dtypes, message):
    shapes = shapes or ((2, 4, 8, 16), (2, 2, 8, 16), (2, 2, 8, 16))
    dtypes = dtypes or (torch.float32,) * 3
    q, k, v = (torch.zeros(shape, dtype=dtype) for shape, dtype in zip(shapes, dtypes))
    with pytest.raises(ValueError, match=message):
        triton_attention.flash_attention(q, k, v)


def test_bad_probe_batch_and_device_raise_value_error():
    q, k = torch.zeros(2, 4, 8, 16), torch.zeros(2, 2, 8, 16)
    with pytest.raises(ValueError, match="probe_batch=0; pass a positive count"):
        triton_attention.flash_attention(q, k, k, probe_batch=0)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":  # CPU tensors are refused
        with pytest.raises(ValueError, match="move them to CUDA"):
            triton_attention.flash_attention(q, k, k)
