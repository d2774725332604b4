"""summary.json: the one owner of its fields. A run's loop hands over what it knows; every field a later
reader (catalog, report, ratchet) may look for is named here."""

from __future__ import annotations

import math
import os
import resource
from pathlib import Path
from typing import Any

import torch

from fp4lab.nn.recipe import Recipe
from fp4lab.train.checkpoint import RunState, finite_or_none
from fp4lab.train.config import TrainConfig
from fp4lab.train.environment import environment
from fp4lab.train.jsonl import read_metrics_file, steady_rate
from fp4lab.train.paths import ComputePaths


def run_summary(
    status: str, diverged_step: int | None, config: TrainConfig, state: RunState, recipe: Recipe, device: torch.device,
    paths: ComputePaths, *, world_size: int, stop_signal: str | None, cuda_graph: bool, gather_bytes_per_step: Any = None,
    resumed_from_step: int = 0,
) -> dict[str, Any]:
    """The fields of one run segment's summary.json. `stop_signal`: the signal behind a "preempted" or
    "interrupted" status; `resumed_from_step`: where this segment began (0: a fresh run); `cuda_graph`: whether this segment's steps replayed a captured graph;
    `gather_bytes_per_step`: the all-gathers of gather_weights="encoded" (train.encoded_gather)."""
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    summary = {
        "status": status,
        "diverged_step": diverged_step,
        "steps_completed": state.step,
        "resumed_from_step": resumed_from_step,
        "steps": config.steps,
        "recipe": recipe.name,
        "model": config.model,
        "final_train_loss": finite_or_none(state.last_loss),
        "best_train_loss": finite_or_none(state.best_loss),
        "final_val_loss": finite_or_none(state.last_val_loss),
        "best_val_loss": finite_or_none(state.best_val_loss),
        "tokens_seen": state.tokens_seen,
        **throughput(config, state),
        "train_seconds": state.train_seconds,
        "qk_clip_events": state.qk_clip_events,
        "peak_memory_mb": peak_mb,
        "device": str(device),
        # which of the machine's GPUs the run had (a local sweep's workers each get their own)
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "paths": paths.as_dict(),
        "stop_signal": stop_signal,
        "world_size": world_size,
        "cuda_graph": cuda_graph,
        "environment": environment(device),  # this segment's (a resumed run may move machines)
    }
    if gather_bytes_per_step is not None:
        summary["gather_bytes_per_step"] = gather_bytes_per_step
    return summary


def throughput(config: TrainConfig, state: RunState) -> dict[str, float | None]:
    """tokens_per_s: the steady pace (`steady_rate` of the steps in metrics.jsonl, this run's whole
    history); tokens_per_s_overall: tokens over training seconds, compilation and CUDA-graph capture
    included; startup_seconds: the training seconds beyond what the steady pace would take (compiling,
    capturing, the first steps' allocations)."""
    metrics = Path(config.out_dir) / "metrics.jsonl"
    rows = read_metrics_file(metrics) if metrics.exists() else ()
    steady = steady_rate((row["step"], rate) for row in rows if type(rate := row.get("tokens_per_s")) in (int, float) and math.isfinite(rate))
    overall = state.tokens_seen / state.train_seconds if state.train_seconds else None
    startup = max(0.0, state.train_seconds - state.tokens_seen / steady) if steady else None
    return {"tokens_per_s": steady, "tokens_per_s_overall": overall, "startup_seconds": startup}
