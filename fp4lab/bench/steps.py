"""Training-step benchmarks: fp4lab recipes and the plain PyTorch anchor, same shape, one process.

Each configuration resolves its compute paths, then builds its model, optimizer and step the way a run
does (`train.paths.resolve`, `train.build.build_training` and `train.step.TrainStep` for fp4lab, `bench.anchor` for the anchor), warms up (torch.compile compiles and the
CUDA graph is captured then: give more warm-up steps than GRAPH_WARMUP_STEPS), and times
`steps` whole steps: forward and loss, backward, gradient clipping, optimizer step, with the loss and
gradient norm read back every step as the training loop reads them. Batches are random tokens.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fp4lab.bench import memory
from fp4lab.bench.anchor import TORCHAO_FLOAT8, anchor_step
from fp4lab.nn.build import cuda_graph_blocker
from fp4lab.nn.model_config import preset
from fp4lab.nn.recipe import load_recipe
from fp4lab.train import paths
from fp4lab.train.build import build_training, plain_pytorch_settings
from fp4lab.train.config import TrainConfig
from fp4lab.train.step import TrainStep, clip_and_step

ANCHOR = "anchor"


@dataclass(frozen=True)
class StepBench:
    """One timed configuration. `name` is a recipe, "anchor", or a torchao float8 anchor (TORCHAO_FLOAT8)."""

    name: str
    model: str
    batch_size: int
    seq_len: int
    device: str
    compute: str
    compiled: bool
    cuda_graph: bool
    paths: dict | None  # fp4lab's resolved train.paths.ComputePaths; None for the anchor
    optimizer: str
    step_ms: float  # median over the timed steps
    step_ms_spread: float  # (max - min) / median of the timed steps
    tokens_per_s: float
    peak_memory_mb: float | None
    first_loss: float
    last_loss: float

    def as_dict(self) -> dict:
        return asdict(self)


def bench_steps(
    recipes: list[str],
    *,
    model: str,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    steps: int,
    warmup: int,
    compile: str = "auto",
    cuda_graphs: str = "auto",
    attention_kernel: str = "auto",
    mx_gemm: str = "auto",
    producer_fusion: str = "off",
    recompute: str = "off",
    optimizer: str = "adamw",
    vocab_size: int = 4096,
    on_result: Callable[[StepBench], None] | None = None,
    profile_dir: Path | None = None,
    memory_dir: Path | None = None,
) -> list[StepBench]:
    """The anchor, then every recipe, each timed over `steps` steps after `warmup`. With
    `profile_dir`, three more steps of each run under torch.profiler and their table of kernels,
    by device time, goes to `profile_dir/<name>.txt`. With `memory_dir` (CUDA), the allocator's history
    is recorded from the build through the timed steps (which it slows: time without it) and what holds
    the peak goes to `memory_dir/<name>.txt` (`bench.memory`)."""
    model_config = preset(model, vocab_size, seq_len)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=g).to(device)
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    shape = {"model": model, "batch_size": batch_size, "seq_len": seq_len, "device": str(device)}
    results = []
    for name in [ANCHOR, *recipes]:
        traced = memory.recorded(device, Path(memory_dir) / f"{name}.txt") if memory_dir is not None else contextlib.nullcontext()
        with traced:
            anchored = name == ANCHOR or name in TORCHAO_FLOAT8
            config = TrainConfig(
                recipe="bf16" if anchored else name, model=model, batch_size=batch_size, seq_len=seq_len,
                device=device.type, compile=compile, cuda_graphs=cuda_graphs, attention_kernel=attention_kernel, mx_gemm=mx_gemm,
                producer_fusion=producer_fusion, recompute=recompute, optimizer=optimizer, adam_lr=3e-4, lr=0.02,
            )
            chosen = paths.resolve(config, device, model_config.head_dim)
            if anchored:
                # A plain PyTorch loop runs on PyTorch's settings, whatever an fp4lab recipe timed before it
                # changed: the torchao anchors come after fp4lab's recipes.
                plain_pytorch_settings()
                step = anchor_step(model_config, device, compile=chosen.compile, float8=name if name in TORCHAO_FLOAT8 else None)
                compute = f"torchao float8 {TORCHAO_FLOAT8[name]}" if name in TORCHAO_FLOAT8 else "bf16 autocast"
                optimizer_name, graphed, record = "adamw (torch, fused on CUDA)", False, None
            else:
                step, chosen = _fp4lab_step(config, model_config, device, chosen)
                compute, optimizer_name, graphed = "fast" if chosen.tensor_cores else "reference", optimizer, chosen.cuda_graphs
                record = chosen.as_dict()
            times, losses, peak = _time(step, x, y, device, steps, warmup)
        if profile_dir is not None:
            _profile(step, x, y, device, Path(profile_dir) / f"{name}.txt")
        median = statistics.median(times)
        result = StepBench(
            name=name, **shape, compute=compute, compiled=chosen.compile, cuda_graph=graphed, paths=record, optimizer=optimizer_name,
            step_ms=median * 1e3, step_ms_spread=(max(times) - min(times)) / median,
            tokens_per_s=batch_size * seq_len / median, peak_memory_mb=peak,
            first_loss=losses[0], last_loss=losses[-1],
        )
        results.append(result)
        if on_result is not None:
            on_result(result)
        del step
        torch._dynamo.reset()  # compiled graphs hold the last model; free it before the next one
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def _fp4lab_step(config: TrainConfig, model_config, device: torch.device, chosen: paths.ComputePaths):
    """The training loop's step, as `run` builds it (CUDA graph included where it applies), and the
    compute paths with cuda_graphs settled."""
    model, optimizer, loss_fn = build_training(config, load_recipe(config.recipe), model_config, device, paths=chosen)
    chosen = paths.with_cuda_graphs(chosen, config, cuda_graph_blocker(model))
    train_step = TrainStep(model, loss_fn, chosen.cuda_graphs)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
        loss = train_step(tokens, targets)
        grad_norm = clip_and_step(model, optimizer, config.grad_clip, keep_grads=train_step.graphed)
        return loss.item(), grad_norm.item()

    return step, chosen


def _time(step, x, y, device: torch.device, steps: int, warmup: int) -> tuple[list[float], list[float], float | None]:
    """Per-step wall times (the step reads values back, so each ends synchronised), losses, peak MB.

    The peak covers the warm-up too: its eager steps hold every activation the ordinary way, while
    replays of a CUDA graph reuse the graph's memory without the allocator counting it again."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    losses = []
    for _ in range(warmup):
        losses.append(step(x, y)[0])
    times = []
    for _ in range(steps):
        tic = time.perf_counter()
        losses.append(step(x, y)[0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - tic)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return times, losses, peak


def _profile(step, x, y, device: torch.device, path: Path) -> None:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step(x, y)
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70))
