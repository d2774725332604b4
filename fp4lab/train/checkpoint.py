"""Checkpoints: atomic files (checkpoints, JSON summaries, the metrics log a resumed run continues), a
run's checkpoint names (`checkpoint.pt`, or `checkpoint.dcp/` of a run on several ranks), saving one
(`save_run`), resuming the newest on any number of ranks (`resume_run`), and reading the newest's model
tensors on the CPU, whichever kind it is (`saved_model`, what `fp4lab export` reads)."""

from __future__ import annotations

import errno
import json
import math
import pickle
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp4lab.nn.build import attention_generators, fp4_linears
from fp4lab.nn.model import Llama
from fp4lab.train import distributed
from fp4lab.train.atomic import no_space_left, replace_atomically
from fp4lab.train.config import RESULT_NEUTRAL, CheckpointMismatch, ConfigError, TrainConfig
from fp4lab.train.jsonl import json_line, read_metrics_file
from fp4lab.train.run_folder import CHECKPOINT, PREVIOUS_CHECKPOINT, SHARDED_CHECKPOINT


def save_checkpoint(path: Path, state: dict[str, Any], keep_previous: Path | None = None) -> None:
    replace_atomically(path, lambda handle: torch.save(state, handle), keep_previous=keep_previous)


def load_checkpoint(path: Path) -> dict[str, Any]:
    # Our own checkpoints hold only tensors, numbers, strings and RNG states.
    return torch.load(path, map_location="cpu", weights_only=True)


class CheckpointDamaged(RuntimeError):
    """No generation of a run folder's one-process checkpoint can be read; the message names the files."""


# What torch.load raises on a file cut short or overwritten: its zip reader's RuntimeError, an
# unpickling error, an end of file, or a value that is not a checkpoint.
_UNREADABLE = (RuntimeError, EOFError, OSError, ValueError, KeyError, pickle.UnpicklingError)


def _first_sentence(exc: BaseException) -> str:
    """`Type: message` cut at its first sentence (torch's zip reader appends a paragraph of advice)."""
    message = (str(exc).strip().splitlines() or [""])[0]
    cut = message.find(". ", 20)
    return f"{type(exc).__name__}: {message[:cut] if cut > 0 else message}"[:160]


def load_newest(out: Path) -> tuple[dict[str, Any], Path]:
    """The newest one-process checkpoint of the run folder `out` that reads whole, and its file:
    checkpoint.pt, or, when that is missing or damaged, the generation before it (checkpoint.prev.pt),
    saying so on stderr in one line naming both. CheckpointDamaged when neither reads."""
    failures = []
    for path in (out / CHECKPOINT, out / PREVIOUS_CHECKPOINT):
        if not path.exists():
            continue
        try:
            checkpoint = load_checkpoint(path)
            checkpoint["state"]["step"]  # a file of another kind has no run state
        except _UNREADABLE as exc:
            failures.append(f"{path} ({_first_sentence(exc)})")
            continue
        if failures:
            print(f"warning: {failures[0]} cannot be read; resuming from {path}, the checkpoint before it", file=sys.stderr, flush=True)
        return checkpoint, path
    if not failures:
        raise FileNotFoundError(f"{out} holds no checkpoint ({CHECKPOINT} or {PREVIOUS_CHECKPOINT})")
    raise CheckpointDamaged(f"no checkpoint of {out} can be read: {'; '.join(failures)}. To train this run again from step 0, "
                            f"remove {out / CHECKPOINT} and {out / PREVIOUS_CHECKPOINT} (or train with --fresh)")


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
    previous = one_process.with_name(PREVIOUS_CHECKPOINT)
    if not (one_process.exists() or previous.exists()):
        return step_folder
    if step_folder is None:
        return one_process
    try:  # mmap: only the run state is read, not the tensors
        one_process_step = torch.load(one_process, map_location="cpu", weights_only=True, mmap=True)["state"]["step"]
    except _UNREADABLE:  # damaged or missing: the sharded checkpoint is whole
        return step_folder
    return one_process if one_process_step > int(step_folder.name.removeprefix(STEP_PREFIX)) else step_folder


def saved_model(out: Path) -> tuple[dict[str, torch.Tensor], int, Path]:
    """The model tensors of the run folder's newest checkpoint, whole and on the CPU, whichever kind
    wrote it; with the step it was saved after and the file or step folder read. No model and no
    process group are needed: a sharded checkpoint's tensors are read by their global shapes. None of
    the random streams (`_extra_state`) come with them. FileNotFoundError when there is no checkpoint."""
    source = newest_checkpoint(out / CHECKPOINT, out / SHARDED_CHECKPOINT)
    if source is None:
        raise FileNotFoundError(f"{out} holds no checkpoint ({CHECKPOINT} or {SHARDED_CHECKPOINT}/)")
    if source.name == CHECKPOINT:
        checkpoint, source = load_newest(out)
        return _tensors_only(checkpoint["model"]), checkpoint["state"]["step"], source
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = dcp.FileSystemReader(source).read_metadata().state_dict_metadata
    model = {
        key.removeprefix("model."): torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in saved.items() if key.startswith("model.") and isinstance(entry, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # loading in one process without a process group is the intent here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load({"model": model}, checkpoint_id=source, no_dist=True)
    return model, load_checkpoint(source / "rank-0.pt")["state"]["step"], source


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
        try:
            self._handle.write(json_line(record) + "\n")
            self._handle.flush()
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise no_space_left(self.path, error, "the lines written before it are kept") from error
            raise

    def close(self, summary: dict[str, Any] | None = None) -> None:
        try:
            self._handle.close()
        except OSError as error:  # a full disk was already reported by the write that met it
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise


def finite_or_none(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


# --- a run's checkpoints: which files, saving, and resuming on any number of ranks --------------------

# Config fields a resumed run may change besides the result-neutral ones: how the ranks share the
# model (and into how many microbatches a pipeline cuts the batch) changes only summation order,
# rounding scales and which random bits are drawn, not what is trained. (A run id still hashes them:
# train.config.HASHED_UNLESS_DEFAULT.)
RESUMABLE_CHANGES = ("parallel", "pp_microbatches")


@dataclass
class RunState:
    """What the loop carries from step to step besides model and optimizer (checkpointed too)."""

    step: int = 0
    best_loss: float = math.inf
    best_val_loss: float = math.inf
    last_loss: float | None = None
    last_val_loss: float | None = None
    train_seconds: float = 0.0
    tokens_seen: int = 0
    qk_clip_events: int = 0
    history: dict[str, Any] = field(default_factory=dict)

def save_run(out: Path, config: TrainConfig, model: Llama, optimizer, state: RunState, ranks: distributed.Ranks) -> None:
    if ranks.mode != "none":
        extras = {
            "config": config.to_dict(),
            "world_size": ranks.world,
            "linears": {name: linear.get_extra_state() for name, linear in fp4_linears(model).items()},
            "attention_generators": [g.get_state() for g in attention_generators(model)],
            "torch_rng": torch.get_rng_state(),
            "state": state.__dict__,
        }
        if ranks.mode == "pp":  # which blocks' attention streams those are (_pipeline_streams merges them)
            extras["generator_blocks"] = list(_generators_by_block(model))
        save_sharded(out / SHARDED_CHECKPOINT, state.step, model, list(optimizer.optimizers.values()), extras, ranks.rank,
                     per_parameter=ranks.mode == "pp")
        other = out / CHECKPOINT
    else:
        save_checkpoint(
            out / CHECKPOINT,
            keep_previous=out / PREVIOUS_CHECKPOINT,
            state={
                "config": config.to_dict(),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "attention_generators": [g.get_state() for g in attention_generators(model)],
                "torch_rng": torch.get_rng_state(),
                "state": state.__dict__,
            },
        )
        other = out / SHARDED_CHECKPOINT
    # A run resumed from the other format: the checkpoint just written is newer and whole, so the old
    # one goes (until then, newest_checkpoint picks the newer of the two).
    if ranks.main and other.exists():
        remove_checkpoint(other)

def resume_run(out: Path, config: TrainConfig, model: Llama, optimizer, ranks: distributed.Ranks,
            whole_optimizer_order: dict[str, list[str]] | None = None) -> RunState:
    """Restore the run folder's newest checkpoint, whichever kind of run wrote it, on however many ranks
    this run has; a fresh RunState when there is none. Model and optimizer state are the saved values,
    resharded (checkpoint.load_sharded, checkpoint.load_whole). Random streams: rank r continues the
    saved rank r's, a rank the saved world lacked gets fresh ones (distributed.fresh_random_streams);
    the step and run state come from rank 0. Under pp, every block continues the streams the one process
    (or rank 0 of data-parallel ranks) saved for it; `whole_optimizer_order`: the parameter names of the
    whole model's optimizers in position order (build_training's), for a one-process checkpoint."""
    source = newest_checkpoint(out / CHECKPOINT, out / SHARDED_CHECKPOINT)
    if source is None:
        return RunState()
    if source.name != CHECKPOINT:
        return _restore_sharded(source, config, model, optimizer, ranks)
    checkpoint, source = load_newest(out)
    if ranks.mode == "none":
        return _restore(source, checkpoint, config, model, optimizer)
    _check_resumable(source, checkpoint["config"], config)
    load_whole(model, optimizer.optimizers, checkpoint["model"], checkpoint["optimizer"], whole_optimizer_order)
    state = RunState(**checkpoint["state"])
    if ranks.mode == "pp":
        linears = {name: checkpoint["model"][f"{name}._extra_state"] for name in fp4_linears(model)}
        _set_streams(model, linears, _own_blocks(model, checkpoint["attention_generators"]), checkpoint["torch_rng"])
    elif ranks.main:
        linears = {name: checkpoint["model"][f"{name}._extra_state"] for name in fp4_linears(model)}
        _set_streams(model, linears, checkpoint["attention_generators"], checkpoint["torch_rng"])
    else:
        distributed.fresh_random_streams(model, state.step)
    return state

def _restore(path: Path, checkpoint: dict[str, Any], config: TrainConfig, model: Llama, optimizer) -> RunState:
    _check_resumable(path, checkpoint["config"], config)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    for generator, rng in zip(attention_generators(model), checkpoint["attention_generators"]):
        generator.set_state(rng)
    torch.set_rng_state(checkpoint["torch_rng"])
    return RunState(**checkpoint["state"])

def _restore_sharded(step_folder: Path, config: TrainConfig, model: Llama, optimizer, ranks: distributed.Ranks) -> RunState:
    main = load_checkpoint(step_folder / "rank-0.pt")
    _check_resumable(step_folder.parent, main["config"], config)
    saved_pp = main["config"].get("parallel") == "pp"
    if ranks.mode == "pp" and saved_pp and main["world_size"] != ranks.world:
        raise ConfigError(
            f"{step_folder.parent} was written by {main['world_size']} pp ranks; a pp run resumes it on as many (its "
            f"stages' random streams are per rank): resume it on {main['world_size']}, or with parallel none, ddp or fsdp"
        )
    load_sharded(step_folder, model, list(optimizer.optimizers.values()), per_parameter=saved_pp)
    state = RunState(**main["state"])
    if ranks.mode == "pp" and not saved_pp:  # rank 0 kept the one-process streams of every block
        _set_streams(model, main["linears"], _own_blocks(model, main["attention_generators"]), main["torch_rng"])
    elif saved_pp and ranks.mode != "pp":  # each block's streams are on the rank that held it
        if ranks.main:
            _set_streams(model, *_pipeline_streams(step_folder, main["world_size"]), main["torch_rng"])
        else:
            distributed.fresh_random_streams(model, state.step)
    elif ranks.rank < main["world_size"]:
        own = main if ranks.main else load_checkpoint(step_folder / f"rank-{ranks.rank}.pt")
        _set_streams(model, own["linears"], own["attention_generators"], own["torch_rng"])
    else:
        distributed.fresh_random_streams(model, state.step)
    return state

def _generators_by_block(model: Llama) -> dict[int, torch.Generator]:
    """The FP4 attention generators of the model's blocks (every block's or none: nn.build), by block
    index, in attention_generators' order."""
    blocks = [int(index) for index, _ in model.layers.named_children()]
    return {i: a.quant.generator for i, a in zip(blocks, model.attentions()) if a.quant is not None}

def _own_blocks(model: Llama, attention: list[torch.Tensor]) -> list[torch.Tensor]:
    """This pp rank's part of the attention generator states of the whole model."""
    return [attention[i] for i in _generators_by_block(model)] if attention else []

def _pipeline_streams(step_folder: Path, world: int) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """The random streams of a pp checkpoint as one process holds them: every rank's linears, and the
    attention generators of all blocks in block order."""
    linears: dict[str, Any] = {}
    attention: dict[int, torch.Tensor] = {}
    for rank in range(world):
        extras = load_checkpoint(step_folder / f"rank-{rank}.pt")
        linears.update(extras["linears"])
        attention.update(zip(extras["generator_blocks"], extras["attention_generators"]))
    return linears, [attention[i] for i in sorted(attention)]

def _set_streams(model: Llama, linears: dict[str, Any], attention: list[torch.Tensor], torch_rng: torch.Tensor) -> None:
    for name, linear in fp4_linears(model).items():
        linear.set_extra_state(linears[name])
    for generator, rng in zip(attention_generators(model), attention):
        generator.set_state(rng)
    torch.set_rng_state(torch_rng)

def _check_resumable(path: Path, saved: dict[str, Any], config: TrainConfig) -> None:
    current = config.to_dict()
    defaults = TrainConfig().to_dict()  # a checkpoint older than a field ran with its default
    changed = [
        k for k in current if k not in RESULT_NEUTRAL + RESUMABLE_CHANGES and saved.get(k, defaults[k]) != current[k]
    ]
    if changed == ["steps"]:
        raise CheckpointMismatch(
            f"{path} belongs to a run of {saved['steps']} steps, not {current['steps']}: its learning-rate schedule "
            f"spans all {saved['steps']} steps, so it cannot be extended exactly; train {current['steps']} steps "
            "from scratch, in this folder or another out_dir"
        )
    if changed:
        raise CheckpointMismatch(
            f"{path} was written by a run with a different {', '.join(changed)}; resume with the same "
            "settings, or start afresh, in this folder or another out_dir"
        )
