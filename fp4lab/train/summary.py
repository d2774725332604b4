"""summary.json: the one owner of its fields. A run's loop hands over what it knows; every field a later
reader (catalog, report, ratchet) may look for is named here."""

from __future__ import annotations

import os
import resource
from typing import Any

import torch

from fp4lab.nn.recipe import Recipe
from fp4lab.train.checkpoint import RunState, finite_or_none
from fp4lab.train.config import TrainConfig
from fp4lab.train.paths import ComputePaths


def run_summary(
    status: str, diverged_step: int | None, config: TrainConfig, state: RunState, recipe: Recipe, device: torch.device,
    paths: ComputePaths, *, world_size: int, stop_signal: str | None, cuda_graph: bool, gather_bytes_per_step: Any = None,
) -> dict[str, Any]:
    """The fields of one run segment's summary.json. `stop_signal`: the signal behind a "preempted" or
    "interrupted" status; `cuda_graph`: whether this segment's steps replayed a captured graph;
    `gather_bytes_per_step`: the all-gathers of gather_weights="encoded" (train.encoded_gather)."""
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    summary = {
        "status": status,
        "diverged_step": diverged_step,
        "steps_completed": state.step,
        "steps": config.steps,
        "recipe": recipe.name,
        "model": config.model,
        "final_train_loss": finite_or_none(state.last_loss),
        "best_train_loss": finite_or_none(state.best_loss),
        "final_val_loss": finite_or_none(state.last_val_loss),
        "best_val_loss": finite_or_none(state.best_val_loss),
        "tokens_seen": state.tokens_seen,
        "tokens_per_s": state.tokens_seen / state.train_seconds if state.train_seconds else None,
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
    }
    if gather_bytes_per_step is not None:
        summary["gather_bytes_per_step"] = gather_bytes_per_step
    return summary
