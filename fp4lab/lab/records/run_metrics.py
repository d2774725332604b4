"""What the ledger and its plots read from one run's metrics.jsonl: the loss at every logged step, the
validation losses, the attention probes per layer and the per-step throughput; and the two figures taken
from them, the steady throughput and the endpoint train loss.

This module never imports torch.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4lab.lab.records.values import finite_number, mean_or_nan
from fp4lab.train.jsonl import read_metrics_file, steady_rate


@dataclass
class RunMetrics:
    """What the plots need from one run's metrics.jsonl."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)  # (step, val_loss)
    entropy: list[tuple[int, list[float]]] = field(default_factory=list)  # (step, mean over heads per layer)
    max_logit: list[tuple[int, list[float]]] = field(default_factory=list)  # (step, max over heads per layer)
    throughput: list[tuple[int, float]] = field(default_factory=list)  # (step, tokens_per_s of that step)
    skipped_lines: int = 0  # torn or corrupt lines left out


def read_metrics(path: Path) -> RunMetrics:
    """Parse a metrics.jsonl (torn or corrupt lines skipped and counted in `skipped_lines`, as every
    reader does); raises ValueError when it is missing, unreadable or has no loss."""
    metrics = RunMetrics()
    counts: dict[str, int] = {}
    try:
        rows = list(read_metrics_file(path, counts))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    metrics.skipped_lines = counts["skipped_lines"]
    for row in rows:
        step = row["step"]
        loss = finite_number(row.get("loss"))
        if loss is not None:
            metrics.steps.append(step)
            metrics.loss.append(loss)
        val = finite_number(row.get("val_loss"))
        if val is not None:
            metrics.val.append((step, val))
        tokens_per_s = finite_number(row.get("tokens_per_s"))
        if tokens_per_s is not None:
            metrics.throughput.append((step, tokens_per_s))
        if "attn_entropy" in row or "attn_entropy_mean" in row:
            layers = _per_layer(row.get("attn_entropy"), mean_or_nan) or _per_layer(row.get("attn_entropy_mean"), mean_or_nan)
            if layers:
                metrics.entropy.append((step, layers))
        if "max_logit" in row:
            layers = _per_layer(row.get("max_logit"), max)
            if layers:
                metrics.max_logit.append((step, layers))
    if not metrics.steps:
        raise ValueError(f"{path}: no loss values")
    return metrics


def _per_layer(value: Any, reduce) -> list[float] | None:
    """One number per layer: a layer's list of per-head values reduced by `reduce` (NaN where none is
    finite), a layer's single value kept; None where `value` is no list of layers."""
    if not isinstance(value, list) or not value:
        return None
    out = []
    for layer in value:
        if isinstance(layer, list):
            nums = [v for v in (finite_number(x) for x in layer) if v is not None]
            out.append(reduce(nums) if nums else math.nan)
        else:
            v = finite_number(layer)
            out.append(math.nan if v is None else v)
    return out


def steady_tokens_per_s(metrics: RunMetrics | None) -> float | None:
    """The median per-step throughput over the second half of a run's recorded steps (None without any):
    the pace once compiled, which probe and evaluation steps, the few slow ones, do not move."""
    return steady_rate(metrics.throughput) if metrics is not None else None


def endpoint_train_loss(metrics: RunMetrics | None) -> float | None:
    """The mean train loss over the last tenth of a run's logged steps (at least one step; None without
    any): its loss at the end of training, with the noise of a single batch averaged out."""
    if metrics is None or not metrics.loss:
        return None
    return statistics.fmean(metrics.loss[-math.ceil(len(metrics.loss) / 10) :])
