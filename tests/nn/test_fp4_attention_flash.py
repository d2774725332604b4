"""FP4 attention as flash attention (`flash_fp4_attention`) against the chunked path (`fp4_attention` on
tensor cores), under Triton's interpreter on the CPU and on CUDA.

What is equal and what is bounded:
- Q and K (along head_dim) and K, Q (along the sequence) are quantized by the same fused-quantizer calls
  as the chunked path's: the same codes and scales by construction;
- dS is quantized inside the backward kernels by `kernels.quantize._tile_block_values`, which gives the
  fused quantizer's bits for the same input, round to nearest and SR alike (`check_tile_block_values`);
- the rest is another order of arithmetic: the online softmax, P rounded to bf16 before its normalisation
  rather than after, delta = rowsum(dO O) rather than rowsum(dP P), GEMMs summed tile by tile. O and dV
  (no FP4 operand downstream of P) are held elementwise to the bound those roundings allow
  (`reordering_bounds`); dQ and dK go through dS's quantization, where an element (or a block's scale)
  within the reordering's error of a rounding boundary can take the neighbouring code, so they are held
  row by row to a small fraction of what dS's quantization moves that row, but for a few rows (a
  quantization along the wrong axis or a lost outer scale moves most rows by that much).
"""

from __future__ import annotations

import pytest
import torch

from fp4lab.nn.attention import Attention, AttentionQuant, flash_fp4_attention, flash_fp4_covers, fp4_attention
from tests.nn.test_fp4_attention_chunked import ONE_CHUNK, output_and_grads, sequence_scaled_qkv

try:  # the kernel of check_tile_block_values finds it among this module's globals
    from fp4lab.numerics.kernels.quantize import _tile_block_values
except ImportError:  # no Triton: the checks are skipped
    _tile_block_values = None

# 96 rows: the interpreter's FP4 tiles (32 and 64) leave a partial tile; two query heads per KV head.
SHAPE = {"batch": 2, "n_heads": 4, "n_kv_heads": 2, "seq": 96, "head_dim": 32}
# dQ, dK, per row: the flash path's distance from the chunked path over the distance dS's quantization
# moves that row (chunked RTN against unquantized dS) plus the reordering's floor. Under the interpreter
# with a GPU's exp2 error: median <= 0.007, and 0.4-1.2 % of rows above 0.5 (a dS code or block scale on
# a rounding boundary, taken the other way after the reordering); without the floor, 13 % of MXFP4 dQ
# rows (18 % on an H100) were above 0.5: rows of P one-hot but for the rounding, whose dS is the
# reordering's alone. dS^T quantized along keys instead: median 0.24-0.79, 42-54 % of rows above 0.5.
ROW_GAP_MEDIAN = 0.1
ROWS_FLIPPED = 0.08


def flash_output_and_grads(q, k, v, grad_out, quant: AttentionQuant) -> list[torch.Tensor]:
    inputs = [x.clone().requires_grad_() for x in (q, k, v)]
    out = flash_fp4_attention(*inputs, quant)
    return [out.detach(), *torch.autograd.grad(out, inputs, grad_out)]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def reordering_bounds(q, k, v, grad_out, fmt: str, flash_out: torch.Tensor) -> dict[str, torch.Tensor]:
    """Elementwise bounds on how far the flash path's O, dV, dQ and dK may lie from the chunked path's
    for the reordering alone ("O", "dV", and the floors "dQ", "dK" of the dS-quantized gradients).

    Both paths take the same quantized Q, K and bf16 V. P is rounded to bf16 (unit roundoff 2^-8) on
    the normalised P in the chunked path and on exp2(s - m) before the division by l in the flash path:
    each <= 2^-8 relative, so |dP_ij| <= 2^-7 P_ij, |dO_i| <= 2^-7 sum_j P_ij |V_j| and
    |d(dV)_j| <= 2^-7 sum_i P_ij |dO_i| (dO rounded to bf16 the same in both). The logits differ by
    their fp32 arithmetic: the dot products summed in another order (<= D 2^-24 sum_d |q_d k_d| each,
    Higham's bound) and a few roundings of s (8 2^-24 |s|); P_ij moves by twice the largest such error
    (s_ij and the row's max or LSE), and the GEMMs' fp32 sums by T 2^-24 relative. P here is exact
    attention's over the quantized operands, which the chunked path computes.

    dS_ij = P_ij (dP_ij - delta_i), with delta_i = dO_i . O_i over the flash path's own O (flash_out) and
    sum_j dP_ij P_ij = dO_i . (P V)_i in the chunked path: apart by d delta_i = dO_i . (O_i - (P V)_i),
    which is computed here (plus 2 D 2^-24 sum_d |dO_id O_id| for the two fp32 sums). Where dS's row is near zero (a one-hot row of P: dP_ij - delta_i
    cancels), that difference is all of the flash path's dS, and quantizing it cannot shrink it below
    half: |Q(x)| <= 2 |x| for x rounded onto the e2m1 grid (a quarter step rounds up to half a step at
    most), and E Q(x) = x for SR. K and Q (quantized along the sequence) the same: so the floors
    |d dQ_id| <= 4 |d delta_i| sum_j P_ij |K_jd| / sqrt(D) and |d dK_jd| <= 4 sum_i P_ij |d delta_i|
    |Q_id| / sqrt(D), summed over a KV head's query heads."""
    from fp4lab.nn.attention import _block_values_along_head_dim

    q_q, k_q = _block_values_along_head_dim(q, fmt), _block_values_along_head_dim(k, fmt)
    batch, n_heads, seq, head_dim = q.shape
    group = n_heads // k.shape[1]
    keys = k_q.decoded().repeat_interleave(group, dim=1).transpose(-1, -2)
    scores = (q_q.decoded() @ keys) / head_dim**0.5
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    dot_sums = (q_q.decoded().abs() @ keys.abs()) / head_dim**0.5  # sum_d |q_d k_d| / sqrt(D)
    logit_error = (head_dim * dot_sums + 8 * scores.abs()).masked_fill(~causal, 0).max() * 2.0**-24
    relative_error = 2.0**-7 + 2 * logit_error + seq * 2.0**-24
    v_heads = v.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
    grad_out = grad_out.to(torch.bfloat16).float()
    out_bound = relative_error * (probs @ v_heads.abs())

    def per_kv_head(x: torch.Tensor) -> torch.Tensor:
        return x.view(batch, k.shape[1], group, seq, -1).sum(dim=2)

    flash_out = flash_out.float()
    delta_error = (grad_out * (flash_out - probs @ v_heads)).sum(dim=-1, keepdim=True).abs()
    delta_error += 2 * head_dim * 2.0**-24 * (grad_out * flash_out).abs().sum(dim=-1, keepdim=True)
    k_heads = k.to(torch.bfloat16).float().repeat_interleave(group, dim=1)
    return {
        "O": out_bound,
        "dV": per_kv_head(relative_error * (probs.transpose(-1, -2) @ grad_out.abs())),
        "dQ": 4 * delta_error * (probs @ k_heads.abs()) / head_dim**0.5,
        "dK": per_kv_head(4 * probs.transpose(-1, -2) @ (delta_error * q.to(torch.bfloat16).float().abs()) / head_dim**0.5),
    }


def check_rtn_flash_against_chunked(device: str) -> None:
    q, k, v, grad_out = (t.to(device) for t in sequence_scaled_qkv(**SHAPE))
    for fmt in ("nvfp4", "mxfp4"):
        quant = AttentionQuant(fmt, "rtn", tensor_cores=True)
        assert flash_fp4_covers(q, quant)
        flash = flash_output_and_grads(q, k, v, grad_out, quant)
        chunked = output_and_grads(q, k, v, grad_out, quant, ONE_CHUNK)
        exact = output_and_grads(q, k, v, grad_out, AttentionQuant(format=None), ONE_CHUNK)
        bounds = reordering_bounds(q, k, v, grad_out, fmt, flash[0])
        for name, i in (("O", 0), ("dV", 3)):
            excess = ((flash[i] - chunked[i]).abs() - bounds[name]).max().item()
            assert excess <= 1e-6, (fmt, name, excess)
        unquantized_ds = output_and_grads(q, k, v, grad_out, AttentionQuant(fmt, None, tensor_cores=True), ONE_CHUNK)
        for name, i in (("dQ", 1), ("dK", 2)):
            # per row (of dQ: a query, quantized along keys; of dK: a key, along queries): the flash
            # path's distance from the chunked path over what dS's quantization moves that row, plus
            # the floor of the reordering (the whole distance where dS's row is near zero)
            gap = (flash[i] - chunked[i]).norm(dim=-1)
            scale = (chunked[i] - unquantized_ds[i]).norm(dim=-1) + bounds[name].norm(dim=-1)
            ratio = gap[scale > 0] / scale[scale > 0]
            assert ratio.median() <= ROW_GAP_MEDIAN, (fmt, name, ratio.median().item())
            assert (ratio > 0.5).float().mean() <= ROWS_FLIPPED, (fmt, name, (ratio > 0.5).float().mean().item())
        assert relative(flash[1], exact[1]) <= 1.25 * relative(chunked[1], exact[1]), fmt
        # another computation than the chunked path's, not a call of it
        assert not torch.equal(flash[1], chunked[1]), fmt


def check_sr_flash_draws_as_chunked(device: str, draws: int = 8) -> None:
    """SR: the flash path's dQ and dK over `draws` draws against the chunked path's, element by element
    (the SR noise of an element is heavy-tailed across elements, so the tests are per element and take
    medians and tail fractions, not norms):
    - the same variance: the median over elements of log(var_flash / var_chunked) within +-0.25 (the
      log of an F(7, 7) ratio has median 0; its median over thousands of elements is within a few
      hundredths). SR left off gives variance 0; uniforms shared between elements of a sum add variance;
    - the same mean: |mean_flash - mean_chunked| over its standard error (a t statistic of ~14 degrees
      of freedom, floored by 1e-3 of the mean and `reordering_bounds`' floor for the reordering) above 4
      for at most 2 % of elements
      (1.3 per mille expected). A biased rounding or another tensor scale moves the means apart."""
    q, k, v, grad_out = (t.to(device) for t in sequence_scaled_qkv(**{**SHAPE, "batch": 1, "n_heads": 2, "n_kv_heads": 1}))
    for fmt in ("nvfp4", "mxfp4"):
        runs = {}
        for name, run in (("flash", flash_output_and_grads), ("chunked", lambda *a: output_and_grads(*a, ONE_CHUNK))):
            quant = AttentionQuant(fmt, "sr", torch.Generator(device=device).manual_seed(7), tensor_cores=True)
            runs[name] = [run(q, k, v, grad_out, quant) for _ in range(draws)]
        floors = reordering_bounds(q, k, v, grad_out, fmt, runs["flash"][0][0])  # O: no SR upstream of it
        for i, grad in ((1, "dQ"), (2, "dK")):
            stacks = {name: torch.stack([r[i] for r in results]) for name, results in runs.items()}
            mean = {name: s.mean(dim=0) for name, s in stacks.items()}
            var = {name: s.var(dim=0) for name, s in stacks.items()}
            noisy = (var["flash"] > 0) & (var["chunked"] > 0)
            assert noisy.float().mean() > 0.5, (fmt, grad, "SR noise on too few elements")
            log_ratio = (var["flash"][noisy] / var["chunked"][noisy]).log().median().item()
            assert abs(log_ratio) <= 0.25, (fmt, grad, log_ratio)
            error = ((var["flash"] + var["chunked"]) / draws).sqrt() + 1e-3 * mean["chunked"].abs() + floors[grad] + 1e-6
            outliers = ((mean["flash"] - mean["chunked"]).abs() / error > 4).float().mean().item()
            assert outliers <= 0.02, (fmt, grad, outliers)
        # each call draws anew from the generator
        assert not torch.equal(runs["flash"][0][1], runs["flash"][1][1])


def _tiles_kernel():
    """A kernel that quantizes each [M, N] tile of x along N with `_tile_block_values`."""
    import triton
    import triton.language as tl

    @triton.jit
    def tiles_kernel(x_ptr, out_ptr, amax_ptr, seed_ptr, n_cols, M: tl.constexpr, N: tl.constexpr, NV: tl.constexpr, SR: tl.constexpr):
        rows = tl.program_id(0) * M + tl.arange(0, M)
        ptrs = rows[:, None] * n_cols + (tl.program_id(1) * N + tl.arange(0, N))[None, :]
        amax_bits = tl.load(amax_ptr)
        values = _tile_block_values(tl.load(x_ptr + ptrs), amax_bits, seed_ptr, rows, tl.program_id(1) * N, n_cols, M, N, NV, SR)
        tl.store(out_ptr + ptrs, values)

    return tiles_kernel


def check_tile_block_values(device: str) -> None:
    """`_tile_block_values`, the backward kernels' dS quantizer, against `quantize_fused` on the same
    tensor, bit for bit: NVFP4 (given tensor amax) and MXFP4, RTN and SR (its draws indexed as the
    fused quantizer's, at [row, col] of an n_cols-wide output), over tiles of 32 x 64."""
    from fp4lab.numerics.kernels.quantize import quantize_fused

    tiles_kernel = _tiles_kernel()
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 128, generator=g) * torch.logspace(-3, 2, 128)).to(device)
    amax = x.abs().amax().reshape(1)
    seed = torch.tensor([12345], dtype=torch.int64, device=device)
    for fmt in ("nvfp4", "mxfp4"):
        for rounding in ("rtn", "sr"):
            options = {"rounding": rounding, "seed": seed if rounding == "sr" else None}
            if fmt == "nvfp4":
                options["tensor_amax"] = amax
            want = quantize_fused(x, fmt=fmt, **options).values
            got = torch.empty_like(want)
            tiles_kernel[(2, 2)](x, got, amax.view(torch.int32), seed, 128, M=32, N=64, NV=fmt == "nvfp4", SR=rounding == "sr")
            assert torch.equal(got, want), (fmt, rounding)


def check_attention_module_runs_flash_with_the_triton_kernel(device: str) -> None:
    """`Attention(kernel="triton")` with FP4 attention runs the flash path, "sdpa" the chunked one."""
    torch.manual_seed(0)
    attention = Attention(64, 2, 1).to(device)
    attention.quant = AttentionQuant("nvfp4", "rtn", tensor_cores=True)
    x = torch.randn(2, 32, 64, device=device)
    from fp4lab.nn.attention import rope_tables

    cos, sin = (t.to(device) for t in rope_tables(32, 32, 10000.0))
    q, k, v = attention.wq(x).view(2, 32, 2, 32), attention.wk(x).view(2, 32, 1, 32), attention.wv(x).view(2, 32, 1, 32)
    from fp4lab.nn.attention import apply_rope

    q, k, v = apply_rope(q, cos, sin).transpose(1, 2), apply_rope(k, cos, sin).transpose(1, 2), v.transpose(1, 2)
    for kernel, path in (("triton", flash_fp4_attention), ("sdpa", fp4_attention)):
        attention.kernel = kernel
        with torch.no_grad():
            got = attention(x, cos, sin)
            want = attention.wo(path(q, k, v, attention.quant).transpose(1, 2).reshape(2, 32, 64))
        assert torch.equal(got, want), kernel
    # the two paths are different arithmetic: the switch is seen in the output
    attention.kernel = "triton"
    with torch.no_grad():
        flash = attention(x, cos, sin)
    attention.kernel = "sdpa"
    with torch.no_grad():
        assert not torch.equal(flash, attention(x, cos, sin))


def test_flash_covers_quantized_attention_only():
    q = torch.empty(1, 2, 64, 32)
    assert not flash_fp4_covers(q, AttentionQuant(format=None))
    assert not flash_fp4_covers(q, AttentionQuant("nvfp4", ds_rounding=None))
    # the CPU without the interpreter: the chunked path
    assert not flash_fp4_covers(q, AttentionQuant("nvfp4", "rtn"))


def check_unquantized_ds_on_tensor_cores(device: str) -> None:
    """ds_rounding=None with tensor cores (the chunked path: flash takes quantized dS only) multiplies
    fp32 dS by the bf16 block values of K and Q: both are decoded first (a dtype error before). Against
    the fp32 reference: the same operands, fp32 GEMMs in another order (S on tensor cores)."""
    q, k, v, grad_out = (t.to(device) for t in sequence_scaled_qkv(batch=1, n_heads=2, n_kv_heads=1, seq=64))
    quant = AttentionQuant("nvfp4", None, tensor_cores=True)
    assert not flash_fp4_covers(q, quant)
    got = output_and_grads(q, k, v, grad_out, quant, ONE_CHUNK)
    want = output_and_grads(q, k, v, grad_out, AttentionQuant("nvfp4", None), ONE_CHUNK)
    for a, b in zip(got, want):
        assert relative(a, b) <= 1e-3


def check_flash_kernels_are_operators_with_true_fakes(device: str) -> None:
    """The flash path's forward and backward are custom operators (`fp4lab::flash_fp4_forward`,
    `fp4lab::flash_fp4_backward`), as the plain flash attention's are: torch.compile keeps them opaque
    (Triton's own launcher runs the kernels, not Inductor) and traces them by their fake implementations,
    which opcheck holds to the real outputs' shapes, dtypes and strides. (Compiling the whole path is a
    CUDA matter: under the interpreter, Dynamo cannot trace the fused quantizers' launches.)"""
    from fp4lab.nn.attention import _block_values_along_head_dim, _quantized_along_seq
    from fp4lab.numerics.kernels import attention as kernels_attention  # noqa: F401  (registers torch.ops.fp4lab.*)

    q, k, v, grad_out = (t.to(device) for t in sequence_scaled_qkv(**{**SHAPE, "seq": 64}))
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    q_q, k_q = (_block_values_along_head_dim(x, "nvfp4") for x in (q, k))
    logit_scale, v_bf16 = q_q.outer * k_q.outer, v.to(torch.bfloat16)
    forward_args = (q_q.values, k_q.values, v_bf16, logit_scale)
    torch.library.opcheck(torch.ops.fp4lab.flash_fp4_forward.default, forward_args, test_utils=checks)
    out, lse2 = torch.ops.fp4lab.flash_fp4_forward(*forward_args)
    q_seq, k_seq = (_quantized_along_seq(x.decoded(), "nvfp4") for x in (q_q, k_q))
    args = (grad_out, q_q.values, k_q.values, v_bf16, out, lse2, logit_scale, q_seq.values, q_seq.outer, k_seq.values,
            k_seq.outer, "nvfp4", None, None)  # fmt: skip
    torch.library.opcheck(torch.ops.fp4lab.flash_fp4_backward.default, args, test_utils=checks)


CHECKS = (
    "check_tile_block_values",
    "check_rtn_flash_against_chunked",
    "check_sr_flash_draws_as_chunked",
    "check_attention_module_runs_flash_with_the_triton_kernel",
    "check_unquantized_ds_on_tensor_cores",
    "check_flash_kernels_are_operators_with_true_fakes",
)


def approximate_exp2_under_the_interpreter(seed: int = 0) -> None:
    """A GPU computes tl.exp2 with PTX's ex2.approx.f32 (about 2 ulp off); the interpreter with numpy's
    correctly rounded exp2, under which a row of P can come out exactly one-hot and hide the
    reordering's floor (`reordering_bounds`). From here on, the interpreter's exp2 is off by up to 2^-22
    relative, at random, as a GPU's is."""
    import numpy as np
    from triton.runtime import interpreter

    draws = np.random.default_rng(seed)

    def approximate_exp2(builder, arg):
        out = builder.unary_op(arg, np.exp2)
        out.data[...] *= (1 + 2.0**-22 * draws.uniform(-1, 1, out.data.shape)).astype(out.data.dtype)
        return out

    interpreter.InterpreterBuilder.create_exp2 = approximate_exp2


# The checks that hold flash against the chunked path by bounds, run with a GPU's exp2 error: after
# the others, since the changed exp2 stays for the rest of the process.
GPU_EXP2_CHECKS = ("check_rtn_flash_against_chunked", "check_sr_flash_draws_as_chunked")


@pytest.mark.slow  # ~2 minutes: started first under xdist
def test_flash_fp4_attention_under_the_interpreter():
    from tests.kernels.test_triton_attention import run_interpreted

    calls = [f"{check}('cpu')" for check in CHECKS if check not in GPU_EXP2_CHECKS]
    calls += ["approximate_exp2_under_the_interpreter()", *(f"{check}('cpu')" for check in GPU_EXP2_CHECKS)]
    done = run_interpreted(__name__, calls, timeout=900)
    assert done.returncode == 0, done.stderr[-8000:]


@pytest.mark.cuda
@pytest.mark.parametrize("check", CHECKS)
def test_flash_fp4_attention_on_cuda(check):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU)")
    pytest.importorskip("triton")
    globals()[check]("cuda")
