"""The real operands of chosen FP4 GEMMs, saved from chosen training steps, and read back.

At each step of `TrainConfig.capture_steps`, every FP4Linear whose name matches a pattern of
`capture_layers` (fnmatch: `layers.0.attention.wq`, `layers.*.feed_forward.w2`, `output`) gets its
step's operands saved to `<out_dir>/captures/step-<n>/<layer>.pt`:

    x    [tokens, in]   the layer input, exact (before any quantization), in the activation dtype
    w    [out, in]      the weight the FP4 GEMMs read: the master weight, or with LoRA-SVD the residual
                        W - U V^T (meta["lora_residual"]); the BF16 low-rank part is not an FP4 GEMM
    dy   [tokens, out]  the gradient of the layer output, as backward hands it to the layer
    meta                step, layer, block (None for the head), n_layers, recipe name, the layer's six
                        operand specs, shapes, dtypes, the GEMM path (reference or tensor cores)

Size: 4 bytes x (tokens x (in + out) + in x out) per layer and step in fp32 (tiny preset, 8 x 128
tokens, a 128 x 384 linear: 2.2 MB; a 125m linear at 16 x 1024 tokens: 100 to 250 MB). Only the chosen
steps and layers are copied, and only during those steps.

Capturing never changes training: a forward hook copies x (and computes the LoRA residual with the
forward's own operations), a tensor hook on the output copies dY; neither draws a random bit nor
changes a value, and the step runs eagerly (not replayed from a CUDA graph, which
gives the same bits). Under torch.compile the hooks would be traced into the graph, so a run that
captures must not compile (compile = "off").
"""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import re
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch

from fp4lab.nn.build import fp4_linears
from fp4lab.nn.fp4_linear import FP4Linear
from fp4lab.nn.recipe import OPERANDS, Recipe
from fp4lab.train.checkpoint import load_checkpoint, save_checkpoint
from fp4lab.train.config import ConfigError, TrainConfig

CAPTURE_DIR = "captures"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step-(\d+)")


class CaptureError(ValueError):
    """Captured operands that cannot be found or read; the message names the path and the fix."""


@dataclasses.dataclass(frozen=True)
class CapturedGemm:
    """One layer's operands at one step (the module docstring says what each tensor is)."""

    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    meta: dict[str, Any]
    path: Path

    @property
    def step(self) -> int:
        return self.meta["step"]

    @property
    def layer(self) -> str:
        return self.meta["layer"]


def capture_path(out_dir: str | Path, step: int, layer: str) -> Path:
    return Path(out_dir) / CAPTURE_DIR / f"step-{step}" / f"{layer}.pt"


def matching_layers(names: list[str], patterns: list[str]) -> list[str]:
    """The names matching any pattern; a pattern that matches none is a ConfigError naming real names."""
    for pattern in patterns:
        if not any(fnmatch(name, pattern) for name in names):
            shown = ", ".join(names[:3] + ["...", names[-1]] if len(names) > 4 else names)
            raise ConfigError(f"capture_layers: {pattern!r} matches no FP4 linear of this model; the names are like {shown}")
    return [name for name in names if any(fnmatch(name, pattern) for pattern in patterns)]


class OperandCapture:
    """Saves the operands of the matching layers at the capture steps (the module docstring)."""

    def __init__(self, config: TrainConfig, model: torch.nn.Module, recipe: Recipe, n_layers: int, compiled: bool):
        if compiled:
            raise ConfigError("capture_steps needs compile='off': torch.compile would trace the capture hooks into the graph")
        linears = fp4_linears(model)
        self.layers = {name: linears[name] for name in matching_layers(list(linears), config.capture_layers)}
        self.steps = frozenset(config.capture_steps)
        self.out_dir, self.recipe_name, self.n_layers = Path(config.out_dir), recipe.name, n_layers
        self._taken: dict[str, dict[str, torch.Tensor]] = {}

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Hooks on the matching layers for one forward and backward."""
        self._taken = {name: {} for name in self.layers}
        handles = [linear.register_forward_hook(self._forward_hook(name)) for name, linear in self.layers.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _forward_hook(self, name: str):
        taken = self._taken[name]

        def hook(linear: FP4Linear, args: tuple, output: torch.Tensor) -> None:
            x = args[0]
            with torch.no_grad():
                taken["x"] = x.detach().reshape(-1, x.shape[-1]).clone()
                taken["w"] = _gemm_weight(linear).detach().clone()

            def grad_hook(grad: torch.Tensor) -> None:
                taken["dy"] = grad.detach().reshape(-1, grad.shape[-1]).clone()

            output.register_hook(grad_hook)

        return hook

    def write(self, step: int) -> list[Path]:
        """Write what the last recorded step took, one atomic file per layer."""
        written = []
        for name, taken in self._taken.items():
            missing = [key for key in ("x", "w", "dy") if key not in taken]
            if missing:
                raise RuntimeError(f"capture of {name} at step {step}: no {', '.join(missing)} was recorded")
            linear = self.layers[name]
            block = re.match(r"layers\.(\d+)\.", name)
            meta = {
                "version": FORMAT_VERSION,
                "step": step,
                "layer": name,
                "block": int(block.group(1)) if block else None,
                "n_layers": self.n_layers,
                "recipe": self.recipe_name,
                "operands": {op: dataclasses.asdict(linear.recipe.operand(op)) for op in OPERANDS},
                "lora_residual": bool(linear.lora_rank),
                "path": "tensor_cores" if linear.tensor_cores else "reference",
                "shapes": {key: list(t.shape) for key, t in taken.items()},
                "dtypes": {key: str(t.dtype).removeprefix("torch.") for key, t in taken.items()},
            }
            path = capture_path(self.out_dir, step, name)
            save_checkpoint(path, {key: t.cpu() for key, t in taken.items()} | {"meta": meta})
            written.append(path)
        self._taken = {}
        return written


def _gemm_weight(linear: FP4Linear) -> torch.Tensor:
    """The weight FP4Linear's GEMMs read: with LoRA-SVD the residual, by the forward's own operations."""
    if not linear.lora_rank:
        return linear.weight
    u, v = linear.lora_u.to(torch.float32), linear.lora_v.to(torch.float32)
    return linear.weight - u @ v.T


def capture_files(source: str | Path) -> list[Path]:
    """The capture files of a run folder, its captures/ folder, one step-<n> folder, or one file,
    ordered by step then layer; CaptureError when there are none."""
    source = Path(source)
    if not source.exists():
        raise CaptureError(f"{source} does not exist; pass a run folder trained with capture_steps, or a capture .pt file")
    if source.is_file():
        return [source]
    root = source / CAPTURE_DIR if (source / CAPTURE_DIR).is_dir() else source
    steps = [root] if _STEP_DIR.fullmatch(root.name) else [d for d in root.iterdir() if _STEP_DIR.fullmatch(d.name)]
    files = [f for d in sorted(steps, key=lambda d: int(d.name[5:])) for f in sorted(d.glob("*.pt"))]
    if not files:
        raise CaptureError(f"{source}: no captured GEMM operands ({CAPTURE_DIR}/step-<n>/<layer>.pt); "
                           "train with capture_steps and capture_layers set")
    return files


def load_capture(path: Path) -> CapturedGemm:
    """One capture file, checked: x [M, K], w [N, K], dy [M, N] and its meta; CaptureError otherwise."""
    try:
        saved = load_checkpoint(path)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as exc:  # truncated, foreign, not torch
        raise CaptureError(f"{path}: not a readable capture file ({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    if not isinstance(saved, dict) or not {"x", "w", "dy", "meta"} <= set(saved):
        raise CaptureError(f"{path}: not a capture file (needs x, w, dy and meta); write one with capture_steps")
    x, w, dy, meta = saved["x"], saved["w"], saved["dy"], saved["meta"]
    shapes_fit = all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in (x, w, dy)) and (
        x.shape[0] == dy.shape[0] and x.shape[1] == w.shape[1] and dy.shape[1] == w.shape[0])
    if not shapes_fit or not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
        raise CaptureError(f"{path}: not a version-{FORMAT_VERSION} capture (x [M, K], w [N, K], dy [M, N] and meta)")
    return CapturedGemm(x, w, dy, meta, path)
