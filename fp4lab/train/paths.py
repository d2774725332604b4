"""The compute path of a run, chosen once: which fast paths run, and why each one that does not is off.

`resolve(config, device, head_dim)` reads the config's switches (compute, compile, attention_kernel,
mx_gemm, producer_fusion, cuda_graphs) and the device, refuses a switch set to a path this device
cannot run (ConfigError, before anything is written), and returns a frozen `ComputePaths`. The model
builder, the loop and `fp4lab bench` take that record; no other layer asks the device which path to
take. CUDA graphs depend on the built model as well (`with_cuda_graphs`). The record goes into
`summary.json` and the run's first log line, so a user sees which paths ran.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from fp4lab.numerics import kernels
from fp4lab.train.config import ConfigError, TrainConfig

# Compute capability from which a GPU has FP8 tensor cores (Ada, Hopper and later).
FP8_TENSOR_CORES = (8, 9)


@dataclass(frozen=True)
class ComputePaths:
    """Every path choice of one run. `off` maps each path that is off (or "sdpa", "bf16") to why."""

    device: str
    tensor_cores: bool  # the fast path: bf16 autocast, GEMMs on tensor cores; else the fp32 reference
    fused_quantizers: bool  # the Triton quantizers, where they cover an operand (numerics.kernels.quantize, fp8)
    fused_optimizer: bool  # torch's fused AdamW kernels
    attention_kernel: str  # "triton" (flash attention with the probes' statistics online) or "sdpa"
    mx_gemm: str  # "fp8": MXFP4 x MXFP4 GEMMs on FP8 tensor cores; "bf16": decoded values on bf16 ones
    producer_fusion: str  # "off", "on" (SwiGLU into W2's operands), "all" (also residual + RMSNorm)
    recompute: str  # "gate-up": FP4 feed-forwards make gate and up again in the backward; "off"
    compile: bool  # torch.compile of the forward and loss
    cuda_graphs: bool  # steps replayed from a captured CUDA graph
    off: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for the run's log: each path and, for those off, why."""
        on = lambda flag: "on" if flag else "off"  # noqa: E731
        parts = [
            f"tensor_cores={on(self.tensor_cores)}", f"fused_quantizers={on(self.fused_quantizers)}",
            f"attention={self.attention_kernel}", f"mx_gemm={self.mx_gemm}", f"producer_fusion={self.producer_fusion}",
            f"recompute={self.recompute}",
            f"compile={on(self.compile)}", f"cuda_graphs={on(self.cuda_graphs)}",
        ]
        why = "; ".join(f"{name}: {reason}" for name, reason in self.off.items())
        return f"compute paths on {self.device}: " + " ".join(parts) + (f" ({why})" if why else "")


def resolve(config: TrainConfig, device: torch.device, head_dim: int) -> ComputePaths:
    """The record for `config` on `device` (a model of `head_dim`); ConfigError where a switch asks for
    a path this device cannot run. cuda_graphs is what config and device allow; `with_cuda_graphs`
    settles it once the model is built."""
    off: dict[str, str] = {}
    fast = tensor_cores(config, device, off)
    kernels_run = _kernels_run(config, device, fast, off)
    return ComputePaths(
        device=str(device),
        tensor_cores=fast,
        fused_quantizers=kernels_run,
        fused_optimizer=fast and device.type == "cuda",
        attention_kernel=attention_kernel(config, kernels_run, head_dim, off),
        mx_gemm=mx_gemm(config, device, kernels_run, off),
        producer_fusion=producer_fusion(config, kernels_run, off),
        recompute=recompute(config, fast, off),
        compile=compiled(config, device, off),
        cuda_graphs=config.cuda_graphs != "off" and device.type == "cuda" and fast,
        off=off,
    )


def with_cuda_graphs(paths: ComputePaths, config: TrainConfig, blocker: str | None, mode_blocker: str | None = None) -> ComputePaths:
    """The record with cuda_graphs settled once the model is built: `blocker` says why its step cannot
    be captured (`nn.build.cuda_graph_blocker`), None if it can; `mode_blocker`, why the way the run
    spreads over ranks takes no graph (a fixed property of the mode: not refused even with "on")."""
    if mode_blocker is not None:
        return replace(paths, cuda_graphs=False, off={**paths.off, "cuda_graphs": mode_blocker})
    if not paths.cuda_graphs:
        if config.cuda_graphs == "on":
            raise ConfigError("cuda_graphs='on' needs the fast path on CUDA (device='cuda', compute='fast' or 'auto')")
        reason = "config cuda_graphs='off'" if config.cuda_graphs == "off" else "needs the fast path on CUDA"
        return replace(paths, off={**paths.off, "cuda_graphs": reason})
    if blocker is None:
        return paths
    if config.cuda_graphs == "on":
        raise ConfigError(f"cuda_graphs='on' but {blocker}; use cuda_graphs='auto' or 'off'")
    return replace(paths, cuda_graphs=False, off={**paths.off, "cuda_graphs": blocker})


def tensor_cores(config: TrainConfig, device: torch.device, off: dict[str, str]) -> bool:
    """The fast path (config.compute; "auto" means: on CUDA)."""
    fast = config.compute == "fast" or (config.compute == "auto" and device.type == "cuda")
    if not fast:
        off["tensor_cores"] = "config compute='reference'" if config.compute == "reference" else "compute='auto' on the CPU: the fp32 reference"
    return fast


def compiled(config: TrainConfig, device: torch.device, off: dict[str, str]) -> bool:
    """torch.compile of the forward and loss (config.compile; "auto" means: on CUDA)."""
    on = config.compile == "on" or (config.compile == "auto" and device.type == "cuda")
    if not on:
        off["compile"] = "config compile='off'" if config.compile == "off" else "compile='auto' on the CPU"
    return on


def attention_kernel(config: TrainConfig, kernels_run: bool, head_dim: int, off: dict[str, str]) -> str:
    """Which kernel runs unquantized attention (config.attention_kernel): "triton" (flash attention
    with the probes' statistics computed online) or "sdpa"; "auto" means triton where the kernels run
    and the kernel takes the model's head_dim."""
    if config.attention_kernel == "triton" and not kernels_run:
        raise ConfigError("attention_kernel='triton' needs the fast path on CUDA with Triton installed; use attention_kernel='auto' or 'sdpa'")
    if config.attention_kernel == "sdpa":
        off["attention_kernel"] = "config attention_kernel='sdpa'"
        return "sdpa"
    if not kernels_run:
        off["attention_kernel"] = off["fused_quantizers"]
        return "sdpa"
    from fp4lab.numerics.kernels.attention import HEAD_DIMS

    if head_dim not in HEAD_DIMS:
        dims = ", ".join(map(str, HEAD_DIMS))
        if config.attention_kernel == "triton":
            raise ConfigError(f"attention_kernel='triton' takes head dims {dims}; this model's is {head_dim}: use attention_kernel='auto' or 'sdpa'")
        off["attention_kernel"] = f"the kernel takes head dims {dims}, not {head_dim}"
        return "sdpa"
    return "triton"


def mx_gemm(config: TrainConfig, device: torch.device, kernels_run: bool, off: dict[str, str]) -> str:
    """Where MXFP4 x MXFP4 GEMMs run (config.mx_gemm): "fp8" (FP8 tensor cores, per-block fp32
    promotion; compute capability 8.9 and up) or "bf16" (decoded values on bf16 tensor cores, and every
    reference-path GEMM); "auto" means bf16, the faster wherever measured (train.config.MX_GEMMS)."""
    usable = kernels_run and torch.cuda.get_device_capability(device) >= FP8_TENSOR_CORES
    if config.mx_gemm == "fp8" and not usable:
        raise ConfigError("mx_gemm='fp8' needs the fast path on a CUDA device with FP8 tensor cores (compute capability 8.9+) and Triton; use mx_gemm='auto' or 'bf16'")
    if config.mx_gemm != "fp8":
        off["mx_gemm"] = "mx_gemm='auto' takes bf16, the faster wherever measured" if config.mx_gemm == "auto" else "config mx_gemm='bf16'"
    return "fp8" if config.mx_gemm == "fp8" else "bf16"


def producer_fusion(config: TrainConfig, kernels_run: bool, off: dict[str, str]) -> str:
    """config.producer_fusion, checked: "on" fuses each feed-forward's SwiGLU into its W2's GEMMs, "all"
    also the residual add and RMSNorm into W1's and W3's x operands (nn.build.build_model); either
    needs the fused kernels."""
    if config.producer_fusion != "off" and not kernels_run:
        raise ConfigError(f"producer_fusion={config.producer_fusion!r} needs the fast path on CUDA with Triton installed; use producer_fusion='off'")
    if config.producer_fusion == "off":
        off["producer_fusion"] = "config producer_fusion='off' (the default: no step-time gain measured)"
    return config.producer_fusion


def recompute(config: TrainConfig, fast: bool, off: dict[str, str]) -> str:
    """config.recompute, checked: "gate-up" recomputes the tensor-core path's FP4 Fprop GEMMs of W1 and
    W3 (nn.build.build_model), so it needs that path."""
    if config.recompute != "off" and not fast:
        raise ConfigError(f"recompute={config.recompute!r} recomputes the fast path's FP4 GEMMs; this run takes the fp32 reference "
                          "(use compute='fast' or a GPU, or recompute='off')")
    if config.recompute == "off":
        off["recompute"] = "config recompute='off' (the default: its step time is not measured yet)"
    return config.recompute


def gpu_kernels_run(device: torch.device) -> bool:
    """Whether the Triton kernels run on `device` as compiled GPU code (not under the interpreter):
    what a benchmark of them needs."""
    return device.type == "cuda" and kernels.runs_on(device)


def _kernels_run(config: TrainConfig, device: torch.device, fast: bool, off: dict[str, str]) -> bool:
    """The fused Triton kernels: on the fast path on CUDA with Triton installed."""
    if not fast:
        off["fused_quantizers"] = "the reference path"
    elif device.type != "cuda":
        off["fused_quantizers"] = "no CUDA device"
    elif not kernels.runs_on(device):
        off["fused_quantizers"] = "Triton is not installed"
    else:
        return True
    return False
