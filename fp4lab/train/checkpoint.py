"""Atomic files: checkpoints, JSON summaries and the metrics log a resumed run continues."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from fp4lab.train.atomic import replace_atomically
from fp4lab.train.jsonl import json_line, read_metrics_file


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    replace_atomically(path, lambda handle: torch.save(state, handle))


def load_checkpoint(path: Path) -> dict[str, Any]:
    # Our own checkpoints hold only tensors, numbers, strings and RNG states.
    return torch.load(path, map_location="cpu", weights_only=True)


def write_json(path: Path, value: Any) -> None:
    replace_atomically(path, lambda handle: handle.write(json.dumps(value, indent=1, default=str).encode() + b"\n"))


class MetricsLog:
    """metrics.jsonl: one JSON object per line, flushed as written. Opening it for a run resumed at
    `resume_step` drops the lines of steps >= resume_step first (they were logged after the
    checkpoint and will be logged again), so the file reads as one uninterrupted run."""

    def __init__(self, path: Path, resume_step: int = 0):
        self.path = path
        kept = []
        if resume_step and path.exists():  # a line cut short by a kill is dropped with the rest
            kept = [json_line(r) for r in read_metrics_file(path) if r["step"] < resume_step]
        replace_atomically(path, lambda handle: handle.write("".join(k + "\n" for k in kept).encode()))
        self._handle = open(path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._handle.write(json_line(record) + "\n")
        self._handle.flush()

    def close(self) -> None:
        self._handle.close()


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None
