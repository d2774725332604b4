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
# mid-save leaves the previous checkpoint readable. DCP stores every tensor by its global shape, so
# any number of ranks, or one process, can load it (load_sharded).
LATEST = "LATEST"
STEP_PREFIX = "step-"


def latest_sharded(folder: Path) -> Path | None:
    """The step folder of the last complete sharded checkpoint in `folder`, or None."""
    try:
        name = (folder / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return folder / name


def newest_checkpoint(one_process: Path, sharded: Path) -> Path | None:
    """What a run folder resumes from: the one-process checkpoint file, the step folder of the sharded
    checkpoint, or None. A run that changed between one process and several ranks writes the other
    format and then removes the one it resumed from (remove_checkpoint); a kill in between leaves
    both, and the newer step wins (a save always follows at least one step of training)."""
    step_folder = latest_sharded(sharded)
    if not one_process.exists():
        return step_folder
    if step_folder is None:
        return one_process
    # mmap: only the run state is read, not the tensors.
    one_process_step = torch.load(one_process, map_location="cpu", weights_only=True, mmap=True)["state"]["step"]
    return one_process if one_process_step > int(step_folder.name.removeprefix(STEP_PREFIX)) else step_folder


def remove_checkpoint(path: Path) -> None:
    """Remove a one-process checkpoint file or a sharded checkpoint folder, once a newer checkpoint of
    the other format is whole. LATEST goes first: a kill midway leaves no folder that claims a
    complete checkpoint."""
    if path.is_dir():
        (path / LATEST).unlink(missing_ok=True)
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def save_sharded(folder: Path, step: int, model, optimizers: list, extras: dict[str, Any], rank: int, per_parameter: bool = False) -> None:
    """Every rank calls this (DCP's save is a collective); `extras` is this rank's part.
    `per_parameter`: the ranks hold different parameters (pipeline stages), so their optimizers' param
    groups differ; the optimizer state is then stored under each parameter's name, the group settings
    included (torchtitan's flattened form), since DCP keeps one rank's copy of each group otherwise.
    Whoever loads it passes the same to load_sharded."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    name = f"{STEP_PREFIX}{step}"
    if latest_sharded(folder) == folder / name:  # nothing has trained since it was written
        return
    target = folder / name
    if rank == 0 and target.exists():  # left half-written by a killed save
        shutil.rmtree(target)
    dist.barrier()
    model_state, optimizer_state = get_state_dict(model, optimizers, options=StateDictOptions(flatten_optimizer_state_dict=per_parameter))
    dcp.save({"model": _tensors_only(model_state), "optimizer": optimizer_state}, checkpoint_id=target)
    save_checkpoint(target / f"rank-{rank}.pt", extras)
    dist.barrier()
    if rank == 0:
        replace_atomically(folder / LATEST, lambda handle: handle.write(name.encode() + b"\n"))
        for old in folder.glob(f"{STEP_PREFIX}*"):
            if old.name != name:
                shutil.rmtree(old)
    dist.barrier()


def load_sharded(step_folder: Path, model, optimizers: list, per_parameter: bool = False) -> None:
    """Load the model and optimizer state of `step_folder` in place, resharded to however this run
    holds them (FSDP2 shards on any number of ranks, DDP replicas, or one process without a process
    group): DCP reads each tensor's part by its global offsets. The per-rank extras are the caller's.
    `per_parameter`: as the checkpoint was saved (save_sharded); a pipeline stage takes its own
    parameters' entries from a checkpoint of ranks that held them all."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(strict=False, flatten_optimizer_state_dict=per_parameter)
    model_state, optimizer_state = get_state_dict(model, optimizers, options=options)
    state = {"model": _tensors_only(model_state), "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=step_folder)
    # strict=False: the FP4 linears' extra state (their generators) travels per rank in the extras.
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options)


def load_whole(model, optimizers: dict[str, Any], model_state: dict[str, Any], optimizer_states: dict[str, Any],
               whole_order: dict[str, list[str]] | None = None) -> None:
    """Load a one-process checkpoint (model.state_dict(), and per optimizer name its state_dict(), as
    CombinedOptimizer saves them) into a model held by ranks: every rank cuts its own shards (FSDP2)
    or takes the whole tensors (DDP). torch keys an optimizer's state by the position of each
    parameter in its param groups; the ranks' optimizers list the same parameters in the same order
    (built alike), so the positions translate to the parameter names DCP's state dicts use. Pipeline
    stages hold some parameters only: `whole_order` gives the whole model's optimizers' names in
    position order."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    names = {id(p): n for n, p in model.named_parameters()}
    by_name: dict[str, Any] = {"state": {}, "param_groups": []}
    for key, optimizer in optimizers.items():
        saved = optimizer_states[key]
        if whole_order is None:
            order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        else:
            order = whole_order[key]
        positions = [i for group in saved["param_groups"] for i in group["params"]]
        name_of = dict(zip(positions, order))
        by_name["state"].update({name_of[i]: value for i, value in saved["state"].items()})
        by_name["param_groups"] += [{**g, "params": [name_of[i] for i in g["params"]]} for g in saved["param_groups"]]
    # The linears' extra state (random streams) is the caller's, per rank; set_state_dict's full path
    # would put a placeholder into every key it is not given, so each keeps its own.
    kept = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    # strict=False: a pipeline stage takes its own parameters' entries and leaves the others'.
    set_state_dict(
        model, list(optimizers.values()), model_state_dict=_tensors_only(model_state) | kept, optim_state_dict=by_name,
        options=StateDictOptions(full_state_dict=True, strict=False),
    )


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
