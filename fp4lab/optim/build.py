"""build_optimizer: route a Llama's parameters to Muon and AdamW and drive both as one optimizer.

Routing (the Muon convention of Keller Jordan's README and Moonlight's toy_train.py, arXiv 2502.16982):
Muon takes the 2D hidden matrices of the transformer blocks, `layers.{i}.attention.{wq,wk,wv,wo}.weight`
and `layers.{i}.feed_forward.{w1,w2,w3}.weight` (torchtitan's Llama names), in practice every 2D
parameter under `layers.`. AdamW takes the rest: `tok_embeddings.weight`, the output head `output.weight`,
the norm gains and every 1D parameter. With `name="adamw"` AdamW takes everything, at `adam_lr`.
The LoRA-SVD factors of Full-Stack FP4's linears (arXiv 2607.04422), `lora_u` and `lora_v` of FP4Linear,
are buffers, not parameters: the training loop recomputes them from the weight's SVD every
`lora_svd_every` steps, so no optimizer sees them.

Weight decay applies to matrices and embeddings but not to 1D parameters (norm gains), as in nanoGPT's
configure_optimizers: decaying a gain pulls the layer's output scale toward zero.

Parameters with requires_grad=False are left out (a frozen part of a model has nothing to optimize).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from fp4lab.optim.adamw import V_FORMATS, AdamW
from fp4lab.optim.muon import KELLER_COEFFICIENTS, LR_SCALINGS, NS_FORMATS, Muon
from fp4lab.optim.qk_clip import UpdateCap
from fp4lab.validation import Checks, is_number

OPTIMIZER_NAMES = ("muon", "adamw")
_BLOCK_PARAM = re.compile(r"layers\.\d+\.")
_QK_PARAM = re.compile(r"layers\.\d+\.attention\.w[qk]\.weight$")


@dataclass(frozen=True)
class OptimizerConfig:
    """What the training loop needs to build its optimizer. Invalid values raise a one-line ValueError.

    name:            "muon" (Muon for hidden matrices, AdamW for the rest) or "adamw" (AdamW for all).
    lr:              Muon's lr. 0.02 with lr_scaling="original" is Keller's; with "moonlight" use an
                     AdamW-sized lr (about 3e-4 to 1e-3; Moonlight).
    adam_lr:         AdamW's lr (Keller's README: 3e-4 beside Muon).
    betas, eps:      AdamW's (0.9, 0.95) and 1e-8 as in Keller's README and Moonlight.
    weight_decay:    decoupled, for both optimizers (Keller's README: 0.01); not applied to 1D parameters.
    momentum, nesterov, ns_steps, ns_coefficients, lr_scaling, ns_format: Muon's (fp4lab.optim.muon).
    adam_v_format:   "fp32" or "nvfp4" storage of AdamW's second moment (fp4lab.optim.adamw).
    update_cap:      None, or (alpha, alpha_qk) for OptiTrain-FP4's update cap (fp4lab.optim.qk_clip.UpdateCap),
                     e.g. (0.05, 0.02); it caps the block matrices, alpha_qk for attention.wq / wk.
    fused:           AdamW with an fp32 second moment runs as torch.optim.AdamW(fused=True), one kernel
                     for all tensors (CUDA; the same arithmetic as fp4lab's AdamW up to fusion), and
                     Muon's Newton-Schulz (bf16 or NVFP4) runs batched, one stack of matrices per shape,
                     its NVFP4 GEMMs on bf16 tensor cores (scales after the GEMM: not the reference's bits).
    """

    name: str = "muon"
    lr: float = 0.02
    adam_lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = KELLER_COEFFICIENTS
    lr_scaling: str = "original"
    ns_format: str = "bf16"
    adam_v_format: str = "fp32"
    update_cap: tuple[float, float] | None = None
    fused: bool = False

    def __post_init__(self) -> None:
        _check.choice("OptimizerConfig.name", self.name, OPTIMIZER_NAMES)
        _check.choice("OptimizerConfig.lr_scaling", self.lr_scaling, LR_SCALINGS)
        _check.choice("OptimizerConfig.ns_format", self.ns_format, NS_FORMATS)
        _check.choice("OptimizerConfig.adam_v_format", self.adam_v_format, V_FORMATS)
        for field in ("lr", "adam_lr", "eps"):
            _check.number(f"OptimizerConfig.{field}", getattr(self, field), positive=True)
        _check.number("OptimizerConfig.weight_decay", self.weight_decay, positive=False)
        if not is_number(self.momentum) or not 0 <= self.momentum < 1:
            raise ValueError(f"OptimizerConfig.momentum={self.momentum!r} must be in [0, 1)")
        if not isinstance(self.nesterov, bool):  # a config value, so ValueError like every other field
            raise ValueError(  # noqa: TRY004
                f"OptimizerConfig.nesterov={self.nesterov!r} must be True or False"
            )
        if not _tuple_of(self.betas, 2) or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"OptimizerConfig.betas={self.betas!r} must be two numbers in [0, 1), e.g. (0.9, 0.95)")
        if not isinstance(self.ns_steps, int) or isinstance(self.ns_steps, bool) or not 1 <= self.ns_steps < 100:
            raise ValueError(f"OptimizerConfig.ns_steps={self.ns_steps!r} must be an int in [1, 99]")
        if not _tuple_of(self.ns_coefficients, 3):
            raise ValueError(
                f"OptimizerConfig.ns_coefficients={self.ns_coefficients!r} must be three numbers (a, b, c)"
            )
        cap = self.update_cap
        if cap is not None and (not _tuple_of(cap, 2) or not all(c > 0 for c in cap)):
            raise ValueError(
                f"OptimizerConfig.update_cap={cap!r} must be None or (alpha, alpha_qk), both > 0, e.g. (0.05, 0.02)"
            )


_check = Checks(ValueError, quote_choices=True)


def _tuple_of(x, n: int) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == n and all(is_number(v) for v in x)


def is_hidden_matrix(name: str, p: torch.Tensor) -> bool:
    """Whether the Muon convention gives this parameter to Muon: 2D and inside a block."""
    return p.ndim == 2 and _BLOCK_PARAM.match(name) is not None


class CombinedOptimizer:
    """Muon and AdamW (either may be absent) behind one optimizer interface, plus the optional update cap.

    `route` maps every optimized parameter name to "muon" or "adamw". Every param group carries
    "base_lr", the lr it was built with; `set_lr_scale(f)` sets each group's lr to base_lr * f, which is
    all a warmup / cosine schedule needs. state_dict() holds both optimizers' state dicts (the groups'
    lr and base_lr included), so load_state_dict() resumes bit for bit.
    """

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer], route: dict[str, str], cap: UpdateCap | None):
        self.optimizers = optimizers
        self.route = route
        self.cap = cap
        for group in self.param_groups:
            group["base_lr"] = group["lr"]

    @property
    def param_groups(self) -> list[dict]:
        return [group for opt in self.optimizers.values() for group in opt.param_groups]

    def set_lr_scale(self, factor: float) -> None:
        for group in self.param_groups:
            group["lr"] = group["base_lr"] * factor

    def step(self) -> None:
        if self.cap is not None:
            self.cap.snapshot()
        for opt in self.optimizers.values():
            opt.step()
        if self.cap is not None:
            self.cap.apply()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != set(self.optimizers):
            raise ValueError(
                f"CombinedOptimizer.load_state_dict: the checkpoint holds optimizers {sorted(state_dict)}, "
                f"this run has {sorted(self.optimizers)}; was it saved with a different OptimizerConfig.name?"
            )
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])


def build_optimizer(named_parameters: Iterable[tuple[str, torch.Tensor]], cfg: OptimizerConfig) -> CombinedOptimizer:
    """Route `model.named_parameters()` per the module docstring and build the optimizers `cfg` names."""
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    route = {n: "muon" if cfg.name == "muon" and is_hidden_matrix(n, p) else "adamw" for n, p in named}
    if cfg.name == "muon" and "muon" not in route.values():
        raise ValueError(
            "build_optimizer: name='muon' but no parameter is a 2D 'layers.{i}.' block matrix; expected torchtitan "
            "Llama names such as layers.0.attention.wq.weight"
        )
    optimizers: dict[str, torch.optim.Optimizer] = {}
    muon_params = [p for n, p in named if route[n] == "muon"]
    if muon_params:
        optimizers["muon"] = Muon(
            muon_params,
            lr=cfg.lr,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            weight_decay=cfg.weight_decay,
            ns_steps=cfg.ns_steps,
            ns_coefficients=tuple(cfg.ns_coefficients),
            lr_scaling=cfg.lr_scaling,
            ns_format=cfg.ns_format,
            batched=cfg.fused,
            ns_tensor_cores=cfg.fused,
        )
    adam_groups = [
        {"params": [p for n, p in named if route[n] == "adamw" and p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for n, p in named if route[n] == "adamw" and p.ndim < 2], "weight_decay": 0.0},
    ]
    adam_groups = [g for g in adam_groups if g["params"]]
    if adam_groups and cfg.fused and cfg.adam_v_format == "fp32":
        optimizers["adamw"] = torch.optim.AdamW(adam_groups, lr=cfg.adam_lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    elif adam_groups:
        optimizers["adamw"] = AdamW(
            adam_groups, lr=cfg.adam_lr, betas=tuple(cfg.betas), eps=cfg.eps, v_format=cfg.adam_v_format
        )
    cap = None
    if cfg.update_cap is not None:
        alpha, alpha_qk = cfg.update_cap
        cap = UpdateCap((p, alpha_qk if _QK_PARAM.match(n) else alpha) for n, p in named if is_hidden_matrix(n, p))
    return CombinedOptimizer(optimizers, route, cap)
