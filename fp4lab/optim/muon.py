"""Muon for the 2D hidden matrices of a transformer, with Newton-Schulz in bf16 or on NVFP4 iterates.

The update rule is torch.optim.Muon's (torch >= 2.9, `torch/optim/_muon.py`), which is Keller Jordan's
Muon (github.com/KellerJordan/Muon, `muon.py`):

    B   <- lerp(B, G, 1 - mu)                    EMA momentum (mu = 0.95)
    U   <- lerp(G, B, mu) if nesterov else B     Nesterov: (1 - mu) G + mu B
    O   <- NS_k(U)                               k quintic Newton-Schulz steps, (a, b, c) = (3.4445, -4.775, 2.0315)
    W   <- W (1 - lr wd)                         decoupled weight decay with the *unscaled* lr
    W   <- W - lr * scale(shape) * O

`lr_scaling` picks scale(shape) for a rows x cols matrix:

- "original" (Keller): sqrt(max(1, rows / cols)), so the update's spectral norm is lr * sqrt(fan_out / fan_in)
  for tall matrices and lr otherwise.
- "moonlight" (Moonlight, "Muon is Scalable for LLM Training", arXiv 2502.16982): 0.2 * sqrt(max(rows, cols)).
  A full-rank orthogonal matrix has RMS 1 / sqrt(max(rows, cols)), so this gives the update an RMS of about
  0.2, the RMS of a typical AdamW update, letting Muon reuse AdamW's lr and weight decay.

With `ns_format="bf16"` a step is bit-identical to torch.optim.Muon with the same settings (the tests
check it). The class does not inherit from it: torch's step calls a private, module-level Newton-Schulz
function, and the NVFP4 mode needs its own loop, so `newton_schulz` below is the one loop both modes run.

`ns_format="nvfp4"` follows Full-Stack FP4 (Ding et al., arXiv 2607.04422), which runs the Newton-Schulz
iteration of its orthogonalized optimizer natively in NVFP4: each of the three GEMMs of an iteration
(X X^T, A A, B X) is an NVFP4 GEMM whose two operands are quantized with `quantize(., "nvfp4")` (round to
nearest; on a GPU by the fused quantizer, the same bits) along that GEMM's contraction axis.
`newton_schulz` states the axes and the roundings.

`ns_tensor_cores=True` (OptimizerConfig.fused) runs the NVFP4 GEMMs on bf16 tensor cores, the
outer scales applied after (`newton_schulz`): the same codes, other roundings than the reference.

`batched=True` (OptimizerConfig.fused) runs each group's same-shape matrices as one stack, in either
mode: a handful of batched kernels per Newton-Schulz step for the stack instead of a handful per matrix
(a 125m model's 84 matrices come in three shapes). Each matrix of the stack keeps its own Frobenius norm
and, in NVFP4, its own tensor scales, so a stack gives each matrix's result alone up to the summation
order of the batched GEMMs (in NVFP4 the tests find the same bits on the CPU).

**Sharded parameters (FSDP2).** Newton-Schulz needs the whole matrix; this is the "gather" scheme of the
distributed-Muon literature (each rank orthogonalizes every matrix; the alternative, Moonlight's and
Essential AI's round-robin assignment of whole matrices to ranks, saves compute but needs a scatter
back). For a DTensor parameter (fully_shard's `Shard(0)`, HSDP's 2D mesh alike) the momentum buffer is a
DTensor placed like the parameter and the momentum and Nesterov math run on the shards; the update is
all-gathered (cast to bf16 first: Newton-Schulz's first operation is that same cast, so half the traffic
changes no bit; every matrix of the group in one collective, `sharding.gather_whole`), orthogonalized whole, in either mode and batched or not, and each rank
applies its own rows of the result. `lr_scale` reads the parameter's global shape (a DTensor's shape).
The step is bit-identical to the unsharded one: the gathered matrix is the unsharded update exactly
and every other operation is elementwise. Plain tensors (one process, DDP) take the unsharded path as is.
Chosen for simplicity and exactness; the price is that every rank runs every matrix's Newton-Schulz
(not measured against the round-robin scheme) and one all-gather of every update per step.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from fp4lab.numerics import BLOCK_SIZE, kernels
from fp4lab.numerics.epilogue import bf16_matmul_fp32
from fp4lab.optim.plumbing import closure_loss, dense_grads
from fp4lab.optim.sharding import gather_whole, is_sharded, local, local_part

LR_SCALINGS = ("original", "moonlight")
NS_FORMATS = ("bf16", "nvfp4")
NVFP4_BLOCK = BLOCK_SIZE["nvfp4"]
# Each side of the matrix is the contraction axis of one NVFP4 GEMM of the iteration (newton_schulz).
_NVFP4_SHAPE_RULE = f"NVFP4 Newton-Schulz contracts over both sides of a matrix: both must be multiples of {NVFP4_BLOCK}"
KELLER_COEFFICIENTS = (3.4445, -4.775, 2.0315)
# (a, b, c) of X <- a X + b (X X^T) X + c (X X^T)^2 X by name: Keller Jordan's quintic (fast, leaves
# singular values in roughly [0.7, 1.2]), and the classic cubic X <- 0.5 (3 I - X X^T) X that
# OptiTrain-FP4 writes, which converges to exactly 1 but slowly for small singular values.
NS_POLYNOMIALS = {"quintic": KELLER_COEFFICIENTS, "cubic": (1.5, -0.5, 0.0)}
# torch.optim.Muon's and Keller's guard against dividing a zero gradient by its zero norm.
NS_EPS = 1e-7


def newton_schulz(
    g: torch.Tensor,
    coefficients: tuple[float, float, float] = KELLER_COEFFICIENTS,
    steps: int = 5,
    fmt: str = "bf16",
    eps: float = NS_EPS,
    tensor_cores: bool = False,
) -> torch.Tensor:
    """Approximately orthogonalize the 2D matrix g (U S V^T -> U S' V^T, S' roughly in [0.7, 1.2]); bf16 result.

    g may also be a stack [n, rows, cols] of same-shape matrices, each orthogonalized as if alone (its
    own norm; in NVFP4 its own tensor scales) by batched GEMMs.

    The loop is Keller Jordan's quintic iteration as torch.optim.Muon writes it: cast to bf16, view the
    matrix wide (transpose when rows > cols, so the Gram matrix X X^T is the small one), divide by the
    Frobenius norm (which bounds the spectral norm by 1), then `steps` times
    A = X X^T;  B = b A + c A A;  X = a X + B X.

    fmt="nvfp4" (Full-Stack FP4, arXiv 2607.04422) makes each of the three GEMMs of an iteration an NVFP4
    GEMM: both operands quantized (round to nearest, 1x16 blocks, E4M3 block scales, one fp32 tensor
    scale each) along that GEMM's contraction axis, decoded to fp32, multiplied with fp32 accumulation.
    With X [m, n] the wide view (m <= n):

        A = X X^T    contracts n: X blocked along n, for both operands (the same encoding);
        A A          contracts m: the left A blocked along its rows (last dim), the right A along its
                     columns (A^T blocked along its last dim); A = X X^T is not assumed exactly symmetric;
        B X          contracts m: B blocked along its last dim, X re-quantized along m (X^T blocked
                     along its last dim), from the bf16 iterate.

    tensor_cores=True (Muon's `ns_tensor_cores`, the fast path's; CUDA with Triton, else ignored) runs
    those NVFP4 GEMMs on bf16 tensor cores: each operand's block values (E2M1 times its E4M3 block
    scale, exact in bf16) multiplied with fp32 accumulation, the two per-matrix outer scales applied to
    the fp32 result (`_nvfp4_tensor_core_matmul`). The same codes and scales, the same exact sum, other
    roundings than the fp32 GEMM of decoded values: not the reference's bits.

    A is rounded to bf16 (as the bf16 mode's A = X X^T is); B = b A + c (A A) and X = a X + (B X) are
    evaluated in fp32 from the bf16 A and X and rounded once to bf16, so the iterate stays bf16 between
    steps; the additions b A and a X are not GEMMs and read the unquantized bf16 values. Every side of
    the matrix is a contraction axis of some GEMM, so both must be multiples of 16.
    """
    if g.ndim not in (2, 3):
        raise ValueError(
            f"newton_schulz: g must be a 2D matrix or a 3D stack of same-shape matrices, got shape {list(g.shape)}"
        )
    if fmt not in NS_FORMATS:
        raise ValueError(f"newton_schulz: fmt={fmt!r} is not supported; allowed: {', '.join(map(repr, NS_FORMATS))}")
    if fmt == "nvfp4" and any(side % NVFP4_BLOCK for side in g.shape[-2:]):
        raise ValueError(f"newton_schulz: {_NVFP4_SHAPE_RULE}; shape {list(g.shape)} is not (use fmt='bf16')")
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    x = g.bfloat16()
    if tall:
        x = x.mT
    # A lone matrix keeps torch.optim.Muon's whole-tensor reduction, whose bits the bf16 mode matches.
    norm = x.norm() if x.ndim == 2 else torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True)
    x.div_(norm.clamp(min=eps))
    addmm = torch.addmm if x.ndim == 2 else torch.baddbmm
    for _ in range(steps):
        if fmt == "nvfp4":
            matmul = _nvfp4_tensor_core_matmul if tensor_cores and kernels.runs_on(x.device) else _nvfp4_matmul
            gram = matmul(x, x.mT).bfloat16()
            gram_update = (b * gram.float() + c * matmul(gram, gram)).bfloat16()
            x = (a * x.float() + matmul(gram_update, x)).bfloat16()
        else:
            gram = x @ x.mT
            gram_update = addmm(gram, gram, gram, beta=b, alpha=c)
            x = addmm(x, gram_update, x, beta=a)
    return x.mT if tall else x


def _nvfp4_matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """left [..., m, k] @ right [..., k, n] as NVFP4 GEMMs: each operand blocked along k, decoded, fp32 product."""
    return _nvfp4_decoded(left) @ _nvfp4_decoded(right.mT).mT


def _nvfp4_tensor_core_matmul(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """`_nvfp4_matmul` on bf16 tensor cores (CUDA): the block values of both operands, quantized as
    `_nvfp4_decoded` quantizes them, multiplied with fp32 accumulation, then times the product of the
    two matrices' outer scales. The products of block values are exact in fp32, so this and the
    reference differ only by roundings: the reference's of each decoded element (values x outer) and
    both GEMMs' accumulations, within a few k u of sum |a| |b| (u = 2^-24; the CUDA test states it)."""
    left_values, left_outer = _nvfp4_block_values(left)
    right_values, right_outer = _nvfp4_block_values(right.mT)
    return bf16_matmul_fp32(left_values, right_values.mT) * (left_outer * right_outer.mT)


def _nvfp4_block_values(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(block values in bf16 [..., rows, cols], each row's outer scale [..., rows, 1]) of x quantized as
    `_nvfp4_decoded` quantizes it, by the fused quantizer; values x outer is its decoded result."""
    from fp4lab.numerics.kernels.quantize import quantize_fused

    flat, options = _as_one_tensor_per_matrix(x)
    q = quantize_fused(flat, **options)
    return q.values.view(x.shape), q.outer.view(*x.shape[:-1], 1)


def _nvfp4_decoded(x: torch.Tensor) -> torch.Tensor:
    """Each matrix of x ([rows, cols] or a stack [n, rows, cols]) quantized to NVFP4 (round to nearest,
    its own tensor scale) in 1x16 blocks along its last dim, decoded to fp32.

    NVFP4 has one tensor scale per tensor, so the stack is quantized as one [n * rows, cols] tensor in
    nvfp4_cta with a CTA tile of `rows` rows, one outer scale per matrix: each matrix's NVFP4 encoding bit
    for bit, in one call for the whole stack. Where Triton runs, by the fused quantizer (one amax read,
    one pass; its block values and decode scales are the reference's bit for bit, and values x scale is
    the reference's one rounding) instead of the reference's ~90 small ops a call, 30 calls per
    matrix (or stack) per optimizer step: by that count, most of Full-Stack FP4's step on a GPU
    (docs/BENCHMARKS.md)."""
    flat, options = _as_one_tensor_per_matrix(x)
    return kernels.fake_quantize(flat, **options).view(x.shape)


def _as_one_tensor_per_matrix(x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """x's matrices as one [n * rows, cols] tensor, and the quantizer's options that give each matrix its
    own NVFP4 encoding (nvfp4_cta, one CTA tile of `rows` rows per matrix)."""
    rows, cols = x.shape[-2:]
    return x.contiguous().view(-1, cols), {"fmt": "nvfp4_cta", "cta_tile": rows}


def lr_scale(shape: torch.Size | tuple[int, int], lr_scaling: str) -> float:
    """The factor Muon multiplies lr by for a rows x cols matrix (see the module docstring for the sources)."""
    rows, cols = shape
    if lr_scaling == "original":
        return math.sqrt(max(1.0, rows / cols))
    if lr_scaling == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"Muon: lr_scaling={lr_scaling!r} is not supported; allowed: {', '.join(map(repr, LR_SCALINGS))}")


class Muon(torch.optim.Optimizer):
    """Muon (Keller Jordan; torch.optim.Muon's update rule) for 2D hidden matrices only.

    Embeddings, the output head, norm gains and any other non-2D parameter belong to AdamW (Keller's
    README; Moonlight's toy_train.py): `fp4lab.optim.build_optimizer` does that routing. A parameter
    that is not 2D is rejected with a ValueError naming its shape, also when it arrives through
    `add_param_group` (torch.optim.Muon only checks that at construction).

    State per parameter: "momentum_buffer" (grad dtype), the key torch.optim.Muon uses. state_dict()
    and load_state_dict() are torch's, so a resumed run continues bit for bit.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_steps: int = 5,
        ns_coefficients: tuple[float, float, float] = KELLER_COEFFICIENTS,
        lr_scaling: str = "original",
        ns_format: str = "bf16",
        batched: bool = False,
        ns_tensor_cores: bool = False,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Muon: lr={lr!r} must be >= 0")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum={momentum!r} must be in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Muon: weight_decay={weight_decay!r} must be >= 0")
        if not isinstance(ns_steps, int) or not 1 <= ns_steps < 100:
            raise ValueError(f"Muon: ns_steps={ns_steps!r} must be an int in [1, 99]")
        if len(tuple(ns_coefficients)) != 3:
            raise ValueError(f"Muon: ns_coefficients={ns_coefficients!r} must be three floats (a, b, c)")
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "nesterov": nesterov,
            "weight_decay": weight_decay,
            "ns_steps": ns_steps,
            "ns_coefficients": tuple(ns_coefficients),
            "lr_scaling": lr_scaling,
            "ns_format": ns_format,
        }
        self.batched = batched
        self.ns_tensor_cores = ns_tensor_cores
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            params, updates = [], []
            for p, grad in dense_grads(group, "Muon"):
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                # Elementwise: on the local shards of a DTensor (same storage, no DTensor dispatch).
                buf, grad = local(state["momentum_buffer"]), local(grad)
                buf.lerp_(grad, 1 - mu)
                params.append(p)
                update = grad.lerp(buf, mu) if group["nesterov"] else buf
                updates.append(update.bfloat16() if is_sharded(p) else update)
            whole = gather_whole(updates, params)
            for p, update in zip(params, self._orthogonalize(whole, group)):
                if is_sharded(p):
                    update = local_part(update, p)
                # A DTensor's shape is global: the scale is the whole matrix's, as unsharded.
                scale = lr_scale(p.shape, group["lr_scaling"])
                p = local(p)
                p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr * scale)
        return loss

    def _orthogonalize(self, updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Newton-Schulz of every update: one matrix at a time, or (batched, either format) one stack per
        shape, dtype and device."""
        ns = (group["ns_coefficients"], group["ns_steps"], group["ns_format"])
        on_tensor_cores = {"tensor_cores": self.ns_tensor_cores}
        if not self.batched:
            return [newton_schulz(u, *ns, **on_tensor_cores) for u in updates]
        by_shape: dict[tuple, list[int]] = {}
        for i, u in enumerate(updates):
            by_shape.setdefault((u.shape, u.dtype, u.device), []).append(i)
        result: list[torch.Tensor] = [None] * len(updates)  # type: ignore[list-item]
        for indices in by_shape.values():
            stacked = newton_schulz(torch.stack([updates[i] for i in indices]), *ns, **on_tensor_cores)
            for i, orthogonal in zip(indices, stacked.unbind(0)):
                result[i] = orthogonal
        return result


def _check_group(group: dict) -> None:
    if group["lr_scaling"] not in LR_SCALINGS:
        raise ValueError(
            f"Muon: lr_scaling={group['lr_scaling']!r} is not supported; allowed: {', '.join(map(repr, LR_SCALINGS))}"
        )
    if group["ns_format"] not in NS_FORMATS:
        raise ValueError(
            f"Muon: ns_format={group['ns_format']!r} is not supported; allowed: {', '.join(map(repr, NS_FORMATS))}"
        )
    for p in group["params"]:
        if p.ndim != 2:
            raise ValueError(
                f"Muon: a parameter of shape {list(p.shape)} is not a 2D matrix; Muon is for hidden matrices, "
                "give embeddings, the output head and 1D parameters to AdamW (fp4lab.optim.build_optimizer does)"
            )
        if torch.is_complex(p):
            raise ValueError(f"Muon: complex parameters are not supported (shape {list(p.shape)})")
        if group["ns_format"] == "nvfp4" and any(side % NVFP4_BLOCK for side in p.shape):
            raise ValueError(
                f"Muon: ns_format='nvfp4': {_NVFP4_SHAPE_RULE}; a parameter of shape {list(p.shape)} is not "
                "(use ns_format='bf16', or give it to AdamW)"
            )
