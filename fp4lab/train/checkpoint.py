"""Atomic files: checkpoints, JSON summaries and the metrics log a resumed run continues."""

from __future__ import annotations

import json
import math
import shutil
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


# A sharded checkpoint is a folder of step folders, each a DCP checkpoint (model and optimizer, every
# rank writing its shards) plus one rank-<r>.pt per rank (its random streams and the run state); the
# file LATEST names the complete one. It is replaced only after a new step folder is whole, so a kill
# mid-save leaves the previous checkpoint readable.
LATEST = "LATEST"


def latest_sharded(folder: Path) -> Path | None:
    """The step folder of the last complete sharded checkpoint in `folder`, or None."""
    try:
        name = (folder / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return folder / name


def save_sharded(folder: Path, step: int, model, optimizers: list, extras: dict[str, Any], rank: int) -> None:
    """Every rank calls this (DCP's save is a collective); `extras` is this rank's part."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    name = f"step-{step}"
    if latest_sharded(folder) == folder / name:  # nothing has trained since it was written
        return
    target = folder / name
    if rank == 0 and target.exists():  # left half-written by a killed save
        shutil.rmtree(target)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizers)
    dcp.save({"model": _tensors_only(model_state), "optimizer": optimizer_state}, checkpoint_id=target)
    save_checkpoint(target / f"rank-{rank}.pt", extras)
    dist.barrier()
    if rank == 0:
        replace_atomically(folder / LATEST, lambda handle: handle.write(name.encode() + b"\n"))
        for old in folder.glob("step-*"):
            if old.name != name:
                shutil.rmtree(old)
    dist.barrier()


def load_sharded(step_folder: Path, model, optimizers: list, rank: int) -> dict[str, Any]:
    """Load model and optimizer shards of `step_folder` in place; return this rank's extras."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    extras = load_checkpoint(step_folder / f"rank-{rank}.pt")
    model_state, optimizer_state = get_state_dict(model, optimizers)
    state = {"model": _tensors_only(model_state), "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=step_folder)
    # strict=False: the FP4 linears' extra state (their generators) travels per rank in `extras`.
    set_state_dict(
        model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        options=StateDictOptions(strict=False),
    )
    return extras


def _tensors_only(model_state: dict[str, Any]) -> dict[str, Any]:
    # Per-layer generator states differ by rank, and DCP keeps one copy of a non-tensor value per key.
    return {k: v for k, v in model_state.items() if not k.endswith("_extra_state")}


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
