"""Per-GEMM error on real tensors: the backward GEMMs of captured layers (fp4lab.train.capture) recomputed
under each operand format or recipe, against the fp32 product of the same exact tensors.

For one capture (x [M, K], W [N, K], dY [M, N]) and one candidate (a LinearRecipe):

    Dgrad  dX = dY W        dY [M, N] and W^T [K, N] quantized along N
    Wgrad  dW = dY^T X      dY^T [N, M] and X^T [K, M] quantized along M (tokens, zero-padded)

each operand exactly as FP4Linear's reference path reads it: `operand_values` with the recipe's spec,
the GEMM's one sign vector (`FP4Linear.draw_all_signs`, drawn in the layer's order) on both operands, products in fp32. The error of
an output Y_q is rel = ||Y_q - Y|| / ||Y|| (Frobenius, Y = the fp32 product of the unquantized
operands), with max |Y_q - Y|, the cosine of Y_q and Y, and the error energy E = ||Y_q - Y||^2 that
the Format-Aware Fusion paper compares (its equal-tensor E_MX / E_CTA of Dgrad, appendix C.4).

Stochastic rounding and random signs draw from a generator seeded per capture and candidate, so a
result does not depend on which other candidates are measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fp4lab.nn.fp4_linear import FP4Linear, contraction_multiple, operand_values
from fp4lab.nn.recipe import GEMMS, OPERANDS, LinearRecipe, OperandSpec, Recipe
from fp4lab.train.capture import CapturedGemm, CaptureError, load_capture
from fp4lab.train.gemm_formats import DEFAULT_FORMATS, FORMATS  # noqa: F401 (DEFAULT_FORMATS: importable here too)

# The paper's equal-tensor comparison of Dgrad error energy, E_MX / E_CTA.
MX_VS_CTA = ("mxfp4", "nvfp4_cta")
BACKWARD_GEMMS = ("dgrad", "wgrad")


@dataclass(frozen=True)
class Candidate:
    """A format of FORMATS (`spec`) or a named recipe, whose linear for the captured layer's block
    (the head's for `output`) gives the operand specs."""

    name: str
    spec: OperandSpec | None = None
    recipe: Recipe | None = None

    @property
    def kind(self) -> str:
        return "format" if self.spec is not None else "recipe"

    def linear(self, meta: dict) -> LinearRecipe:
        if self.spec is not None:
            return LinearRecipe(*(self.spec,) * len(OPERANDS))
        if meta["block"] is None:
            return self.recipe.head_linear()
        return self.recipe.linear_for_block(meta["block"], meta["n_layers"])

    def quantized(self) -> bool:
        """Whether any backward operand (of the recipe's body linear) is FP4 or FP8."""
        linear = LinearRecipe(*(self.spec,) * len(OPERANDS)) if self.spec is not None else self.recipe.linear
        return any(linear.operand(name).is_quantized for gemm in BACKWARD_GEMMS for name in GEMMS[gemm])

    def describe(self) -> str:
        if self.spec is not None:
            return self.spec.describe()
        body = self.recipe.linear
        return f"Dgrad {body.dgrad_dy.describe()} x {body.dgrad_w.describe()}; Wgrad {body.wgrad_dy.describe()} x {body.wgrad_x.describe()}"


def candidates(formats: Iterable[str], recipes: Iterable[Recipe]) -> list[Candidate]:
    return [Candidate(name, spec=FORMATS[name]) for name in formats] + [Candidate(r.name, recipe=r) for r in recipes]


@dataclass(frozen=True)
class GemmError:
    step: int
    layer: str
    candidate: str
    gemm: str
    rel: float
    max_abs: float
    cosine: float
    energy: float

    def as_dict(self) -> dict:
        return asdict(self)


def backward_outputs(capture: CapturedGemm, linear: LinearRecipe, seed: int) -> dict[str, torch.Tensor]:
    """Dgrad's dX and Wgrad's dW of `capture` with the operands of `linear`, as FP4Linear computes them."""
    x, w, dy = (t.to(torch.float32) for t in (capture.x, capture.w, capture.dy))
    with torch.device("meta"):  # the layer lends its sign rules and shape checks; its weight is never made
        try:
            layer = FP4Linear(w.shape[1], w.shape[0], linear, seed=seed)
        except ValueError as exc:
            raise CaptureError(f"{capture.path}: {exc}") from None
    generator = layer.generator_for(torch.device("cpu"))
    signs = layer.draw_all_signs(generator, x.shape[0])
    dy_hat = operand_values(dy, linear.dgrad_dy, signs["dgrad"], generator)
    wt_hat = operand_values(w.T.contiguous(), linear.dgrad_w, signs["dgrad"], generator)
    multiple = contraction_multiple(linear, "wgrad")
    dyt_hat = operand_values(_pad_tokens(dy.T, multiple), linear.wgrad_dy, signs["wgrad"], generator)
    xt_hat = operand_values(_pad_tokens(x.T, multiple), linear.wgrad_x, signs["wgrad"], generator)
    return {"dgrad": dy_hat @ wt_hat.T, "wgrad": dyt_hat @ xt_hat.T}


def exact_outputs(capture: CapturedGemm) -> dict[str, torch.Tensor]:
    """The fp32 products of the unquantized operands."""
    x, w, dy = (t.to(torch.float32) for t in (capture.x, capture.w, capture.dy))
    return {"dgrad": dy @ w, "wgrad": dy.T @ x}


def _pad_tokens(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero tokens up to the contraction multiple (they add nothing to the product), as FP4Linear pads."""
    return torch.nn.functional.pad(t, (0, (-t.shape[-1]) % multiple)).contiguous()


def compare(quantized: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    q, y = quantized.double(), exact.double()
    error = (q - y).norm().item()
    norm, q_norm = y.norm().item(), q.norm().item()
    return {
        "rel": error / norm if norm else math.inf,
        "max_abs": (q - y).abs().max().item(),
        "cosine": (q * y).sum().item() / (norm * q_norm) if norm and q_norm else math.nan,
        "energy": error**2,
    }


def measure(
    files: list[Path], chosen: list[Candidate], seed: int = 0, on_capture: Callable[[], None] | None = None
) -> list[GemmError]:
    """The Dgrad and Wgrad error of every candidate on every capture file (one file in memory at a time)."""
    rows = []
    for path in files:
        capture = load_capture(path)
        exact = exact_outputs(capture)
        for candidate in chosen:
            outputs = backward_outputs(capture, candidate.linear(capture.meta), seed)
            for gemm in BACKWARD_GEMMS:
                rows.append(GemmError(capture.step, capture.layer, candidate.name, gemm, **compare(outputs[gemm], exact[gemm])))
        if on_capture is not None:
            on_capture()
    return rows


def summarize(rows: list[GemmError], chosen: list[Candidate]) -> dict:
    """Per candidate and GEMM: the mean rel error over captures, the geometric mean of its error energy
    over the best quantized candidate's (by mean rel error) on the same captures, and which candidate that is;
    and the paper's E_MX / E_CTA on Dgrad where both formats were measured."""
    names = [c.name for c in chosen]
    # bf16 beside FP4 and FP8 is the baseline, not a contender: best is the lowest-error quantized candidate.
    contenders = [c.name for c in chosen if c.quantized()] or names
    energy = {(r.candidate, r.gemm, r.step, r.layer): r.energy for r in rows}
    captures = list(dict.fromkeys((r.step, r.layer) for r in rows))
    summary: dict = {"candidates": {}, "best": {}}
    for gemm in BACKWARD_GEMMS:
        mean = {name: _mean([r.rel for r in rows if r.candidate == name and r.gemm == gemm]) for name in names}
        best = min(contenders, key=lambda name: mean[name])
        summary["best"][gemm] = best
        for name in names:
            ratio = _geomean_ratio(energy, name, best, gemm, captures)
            summary["candidates"].setdefault(name, {})[gemm] = {"mean_rel": mean[name], "energy_vs_best": ratio}
    mx, cta = MX_VS_CTA
    if mx in names and cta in names:
        wins = sum(energy[(cta, "dgrad", *c)] < energy[(mx, "dgrad", *c)] for c in captures)
        summary["mx_vs_cta"] = {
            "mx": mx, "cta": cta, "gemm": "dgrad", "energy_ratio_geomean": _geomean_ratio(energy, mx, cta, "dgrad", captures),
            "cta_lower": wins, "captures": len(captures),
        }
    return summary


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _geomean_ratio(energy: dict, a: str, b: str, gemm: str, captures: list) -> float:
    """The geometric mean over captures of E_a / E_b (inf where b is exact and a is not, 1 where both are)."""
    logs = []
    for capture in captures:
        ea, eb = energy[(a, gemm, *capture)], energy[(b, gemm, *capture)]
        if ea == eb:
            logs.append(0.0)
        elif eb == 0 or ea == 0:
            return math.inf if eb == 0 else 0.0
        else:
            logs.append(math.log(ea / eb))
    return math.exp(sum(logs) / len(logs))
