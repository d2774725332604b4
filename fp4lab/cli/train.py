"""`fp4lab train`: one training run from a recipe, a config file and options; resumes from the run
folder's checkpoint."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from fp4lab.cli.choices import (
    AttentionKernel,
    Compile,
    Compute,
    CudaGraphs,
    Device,
    GatherWeights,
    LrSchedule,
    ModelPreset,
    MxGemm,
    NsPolynomial,
    Optimizer,
    Parallel,
    ProducerFusion,
    QkClip,
    Recompute,
    TokenDtype,
    complete_recipe,
)
from fp4lab.cli.conventions import fail


def train(
    recipe: Annotated[Optional[str], typer.Option(help="Recipe name (fp4lab recipes) or path to a recipe .toml.", autocompletion=complete_recipe, rich_help_panel="Recipe, model and data")] = None,
    model: Annotated[Optional[ModelPreset], typer.Option(help="Model preset (default tiny).", rich_help_panel="Recipe, model and data")] = None,
    data: Annotated[Optional[str], typer.Option(help="shakespeare (embedded) | synthetic | pycode (after fp4lab data build pycode) | NAME of your own corpus (after fp4lab data build NAME ...) | path to a .bin token file.", rich_help_panel="Recipe, model and data")] = None,
    val_data: Annotated[Optional[str], typer.Option(help="Validation .bin file (default: hold out the tail of --data).", rich_help_panel="Recipe, model and data")] = None,
    token_dtype: Annotated[Optional[TokenDtype], typer.Option(help="Id width of .bin files (default uint16).", rich_help_panel="Recipe, model and data")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="Vocabulary size (BPE size for shakespeare).", rich_help_panel="Recipe, model and data")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps (default 200).", rich_help_panel="Length, evaluation and checkpoints")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per step (default 8).", rich_help_panel="Length, evaluation and checkpoints")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence (default 128).", rich_help_panel="Length, evaluation and checkpoints")] = None,
    optimizer: Annotated[Optional[Optimizer], typer.Option(help="muon (hidden matrices; AdamW for the rest) or adamw (default: the recipe's, else muon).", rich_help_panel="Optimizer")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Muon learning rate (default 0.02).", rich_help_panel="Optimizer")] = None,
    adam_lr: Annotated[Optional[float], typer.Option(help="AdamW learning rate (default 1e-2).", rich_help_panel="Optimizer")] = None,
    weight_decay: Annotated[Optional[float], typer.Option(help="Decoupled weight decay (default 0).", rich_help_panel="Optimizer")] = None,
    lr_schedule: Annotated[Optional[LrSchedule], typer.Option(help="Learning-rate schedule (default cosine).", rich_help_panel="Optimizer")] = None,
    warmup_steps: Annotated[Optional[int], typer.Option(help="Linear warmup steps (default 20).", rich_help_panel="Optimizer")] = None,
    ns_steps: Annotated[Optional[int], typer.Option(help="Newton-Schulz steps K of Muon (default 5).", rich_help_panel="Optimizer")] = None,
    ns_polynomial: Annotated[Optional[NsPolynomial], typer.Option(help="Muon's Newton-Schulz polynomial: quintic (Keller Jordan's) or cubic 0.5(3I - XX^T)X (default: the recipe's, else quintic).", rich_help_panel="Optimizer")] = None,
    qk_clip: Annotated[Optional[QkClip], typer.Option(help="QK-Clip: kimi (rescale W_q and W_k), update_cap (OptiTrain-FP4's update cap) or none (default: the recipe's).", rich_help_panel="Optimizer")] = None,
    qk_clip_tau: Annotated[Optional[float], typer.Option(help="QK-Clip threshold tau (default: the recipe's, 100).", rich_help_panel="Optimizer")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of init, data order and every random stream (default 0).", rich_help_panel="Recipe, model and data")] = None,
    eval_every: Annotated[Optional[int], typer.Option(help="Validation loss every N steps (default 50).", rich_help_panel="Length, evaluation and checkpoints")] = None,
    probe_every: Annotated[Optional[int], typer.Option(help="Attention and quantization probes every N steps (default 25).", rich_help_panel="Length, evaluation and checkpoints")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(help="Checkpoint every N steps (default 50).", rich_help_panel="Length, evaluation and checkpoints")] = None,
    max_minutes: Annotated[Optional[float], typer.Option(help="Stop cleanly (resumable) after this much wall time.", rich_help_panel="Length, evaluation and checkpoints")] = None,
    capture_steps: Annotated[Optional[str], typer.Option(help="Comma-separated steps at which to save the GEMM operands (x, W, dY) of --capture-layers to <out>/captures, for numerics --capture.", rich_help_panel="Length, evaluation and checkpoints")] = None,
    capture_layers: Annotated[Optional[str], typer.Option(help="Comma-separated fnmatch patterns of FP4 linear names whose operands --capture-steps saves, e.g. 'layers.0.attention.wq,layers.*.feed_forward.w2'.", rich_help_panel="Length, evaluation and checkpoints")] = None,
    device: Annotated[Optional[Device], typer.Option(help="Where to train (default auto: the GPU when there is one, else the CPU).", rich_help_panel="Device and fast path")] = None,
    compute: Annotated[Optional[Compute], typer.Option(help="fast (bf16 activations, tensor-core GEMMs, fused kernels), reference (fp32, exact emulation) or auto (default: fast on CUDA).", rich_help_panel="Device and fast path")] = None,
    compile: Annotated[Optional[Compile], typer.Option(help="torch.compile (default auto: on CUDA).", rich_help_panel="Device and fast path")] = None,
    cuda_graphs: Annotated[Optional[CudaGraphs], typer.Option(help="Replay steps from a CUDA graph (default auto: on CUDA where nothing draws from a torch.Generator).", rich_help_panel="Device and fast path")] = None,
    attention_kernel: Annotated[Optional[AttentionKernel], typer.Option(help="Attention on the fast path: triton (flash attention that yields the max-logit and entropy probes online; FP4 attention on the same kernels) or sdpa (PyTorch's; FP4 attention chunked) (default auto: triton on CUDA).", rich_help_panel="Device and fast path")] = None,
    mx_gemm: Annotated[Optional[MxGemm], typer.Option(help="MXFP4 x MXFP4 GEMMs on the fast path: fp8 (FP8 tensor cores, each 32-block promoted to fp32) or bf16 (decoded values on bf16 tensor cores) (default auto: bf16, the faster on an H200; fp8 is opt-in).", rich_help_panel="Device and fast path")] = None,
    producer_fusion: Annotated[Optional[ProducerFusion], typer.Option(help="on: fuse each feed-forward's SwiGLU into its W2's GEMMs (the quantized operands written straight from gate and up; the SiLU derivative fused into the backward), the same bits; all: also the residual add and RMSNorm into W1's and W3's operands, the norm within a few ulps (default off).", rich_help_panel="Device and fast path")] = None,
    recompute: Annotated[Optional[Recompute], typer.Option(help="gate-up: each FP4 feed-forward makes gate and up again in its backward from W1's and W3's Fprop operands instead of keeping them (the same bits; less activation memory, two more GEMMs a block) (default off).", rich_help_panel="Device and fast path")] = None,
    parallel: Annotated[Optional[Parallel], typer.Option(help="Parallelism over torchrun's processes: ddp (DistributedDataParallel), fsdp (FSDP2), hsdp (FSDP2 sharded within a node, replicated across nodes), pp (pipeline stages of transformer blocks) or none (default).", rich_help_panel="Several GPUs")] = None,
    pp_microbatches: Annotated[Optional[int], typer.Option(help="With --parallel pp: microbatches each global batch is split into (default 4, DualPipeV's minimum on 2 ranks).", rich_help_panel="Several GPUs")] = None,
    gather_weights: Annotated[Optional[GatherWeights], typer.Option(help="What FSDP2's weight all-gathers move (fsdp, hsdp): dense rows (default) or, where exact, the FP4 encoding the GEMMs consume (the same run, fewer bytes; summary.json reports them).", rich_help_panel="Several GPUs")] = None,
    nproc_per_node: Annotated[Optional[int], typer.Option(help="Train on N local processes (GPUs) through torchrun; with N > 1 pass --parallel too (a sweep run's config has it).", rich_help_panel="Several GPUs")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Run folder (default runs/<recipe>-<model>-s<seed>).", rich_help_panel="Run folder and records")] = None,
    config: Annotated[Optional[Path], typer.Option(help="A TOML file of train settings; flags override it.", rich_help_panel="Run folder and records")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Delete this run folder's checkpoint and logs first instead of resuming.", rich_help_panel="Run folder and records")] = False,
    log_to: Annotated[Optional[str], typer.Option(metavar="TRACKERS", help="Also log the metrics and the config to these trackers, comma-separated: tensorboard, wandb, mlflow (docs/TRACKERS.md; pip install 'fp4lab[trackers]').", rich_help_panel="Run folder and records")] = None,
    catalog: Annotated[Optional[Path], typer.Option(help="Record this sweep run's start and end in this catalog (sweep jobs pass it; needs --config jobs/<sweep>/<id>.toml and no other flag but --nproc-per-node; rank 0 records).", rich_help_panel="Run folder and records")] = None,
) -> None:
    """Train a small Llama-style model with one FP4 recipe; resumes from the run folder's checkpoint."""
    options = dict(locals())  # each option under its name, the name of the config field it sets (_config_options)
    train_config = _train_config(options)
    if catalog is not None:  # refused before anything is touched
        _refuse_changes_to_a_sweep_run(options)
    if nproc_per_node is not None:
        _launch_ranks(train_config, nproc_per_node, fresh, config, catalog)
    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 speaks
    # Rank 0 holds the run folder from here (the loop takes it again): a folder another trainer holds is
    # refused before --fresh clears anything. Under torchrun rank 0 alone clears: the others cannot
    # read the folder before joining the process group, which rank 0 joins only after clearing.
    with _holding(Path(train_config.out_dir)) if main_rank else contextlib.nullcontext():
        if main_rank and fresh:
            _clear_run_folder(Path(train_config.out_dir))
        elif main_rank and catalog is None:
            _note_finished_run(train_config)
        summary = _run(train_config, config, catalog)
    if summary["status"] == "interrupted" and main_rank:
        print(f"interrupted with {summary['steps_completed']} steps done, checkpoint written: the same command resumes "
              f"from step {summary['steps_completed']} ({train_config.out_dir})", file=sys.stderr)
    if main_rank:
        print_summary_block(summary, train_config.out_dir)
    if summary["status"] == "interrupted":
        raise typer.Exit(130)


# The options that say how and where to run, not what: none sets the TrainConfig field of its name.
RUN_OPTIONS = ("out", "config", "fresh", "catalog", "nproc_per_node")
# The options that set TrainConfig.data, and the DataConfig field each sets.
DATA_OPTIONS = {"data": "source", "val_data": "val_source", "token_dtype": "token_dtype", "vocab_size": "vocab_size"}
# Comma-separated on the command line, lists in the config: the type of each item.
LIST_OPTIONS = {"capture_steps": int, "capture_layers": str, "log_to": str}


def _config_options(options: dict) -> tuple[dict, dict]:
    """The options given (not None) that set TrainConfig fields, and those that set its DataConfig's:
    each under its field's name."""
    fields, data_fields = {}, {}
    for name, value in options.items():
        if value is None or name in RUN_OPTIONS:
            continue
        if name in LIST_OPTIONS:
            value = _comma_list(value, LIST_OPTIONS[name], "--" + name.replace("_", "-"))
        if name in DATA_OPTIONS:
            data_fields[DATA_OPTIONS[name]] = value
        else:
            fields[name] = value
    return fields, data_fields


def _train_config(options: dict):
    """The run's TrainConfig: the --config file's (or the defaults), with the options given over it."""
    from fp4lab.train.config import ConfigError, TrainConfig

    fields, data_fields = _config_options(options)
    config, out = options["config"], options["out"]
    try:
        base = TrainConfig.from_toml(config).to_dict() if config is not None else TrainConfig().to_dict()
        values = base | fields
        values["data"] = base["data"] | data_fields
        if out is not None:
            values["out_dir"] = str(out)
        elif config is None or "out_dir" not in _toml_keys(config):
            values["out_dir"] = f"runs/{Path(values['recipe']).stem}-{values['model']}-s{values['seed']}"
        return TrainConfig.from_dict(values, "train")
    except (ConfigError, ValueError) as exc:
        fail(str(exc))


def _refuse_changes_to_a_sweep_run(options: dict) -> None:
    """With --catalog the run is a sweep's, trained exactly as its config file says: only --config and
    --nproc-per-node may be given."""
    allowed = ("config", "catalog", "nproc_per_node")
    changed = [name for name, value in options.items() if name not in allowed and value is not None and value is not False]
    if options["config"] is None or changed:
        fail(f"train: --catalog trains a sweep run exactly as written: pass only --config jobs/<sweep>/<id>.toml"
             f"{' (drop ' + ', '.join('--' + k.replace('_', '-') for k in changed) + ')' if changed else ''}")


def _run(train_config, config: Path | None, catalog: Path | None) -> dict:
    """Train in this process (with --catalog, the sweep run that config file is, recorded there); its summary."""
    from fp4lab.lab.records.catalog import CatalogError
    from fp4lab.nn.recipe import RecipeError
    from fp4lab.train.atomic import NoSpaceLeft
    from fp4lab.train.checkpoint import CheckpointDamaged
    from fp4lab.train.config import CheckpointMismatch, ConfigError
    from fp4lab.train.loop import run

    try:
        if catalog is not None:
            from fp4lab.lab.records.catalog import Catalog
            from fp4lab.lab.runs.job import train_recorded

            return train_recorded(config, Catalog(catalog))
        return run(train_config)
    except CheckpointMismatch as exc:
        fail(f"{str(exc).splitlines()[0]}: --fresh starts over, --out trains into another folder")
    except (ConfigError, RecipeError, ValueError, CatalogError, CheckpointDamaged, NoSpaceLeft) as exc:
        fail(str(exc).splitlines()[0])


def _launch_ranks(train_config, nproc_per_node: int, fresh: bool, config: Path | None, catalog: Path | None) -> NoReturn:
    """Train `train_config` on `nproc_per_node` local processes: torchrun (torch.distributed.run)
    starts `fp4lab train --config <the resolved config>` on each; with --catalog, `fp4lab train --config
    jobs/<sweep>/<id>.toml --catalog C` (rank 0 records the run). Its exit code is ours."""
    import subprocess
    import tempfile

    from fp4lab.lab.runs.job import train_command
    from fp4lab.train.config import toml_text

    if nproc_per_node < 1:
        fail(f"train: --nproc-per-node {nproc_per_node} must be at least 1")
    if nproc_per_node > 1 and train_config.parallel == "none":
        fail(f"train: --nproc-per-node {nproc_per_node} needs --parallel ddp, fsdp, hsdp or pp (how the ranks share the model)")
    if train_config.batch_size % nproc_per_node:
        fail(f"train: --batch-size {train_config.batch_size} does not split over {nproc_per_node} processes; "
             f"use a multiple of {nproc_per_node} (resuming a run, whose batch size is fixed: a number of processes that divides it)")
    if catalog is not None:  # the sweep run's own config: its name is the run id, its manifest lies next to it
        raise typer.Exit(subprocess.run(train_command(config, catalog, nproc=nproc_per_node), check=False).returncode)
    if fresh:  # before any rank starts; the ranks get the resolved config without --fresh
        with _holding(Path(train_config.out_dir)):
            _clear_run_folder(Path(train_config.out_dir))
    with tempfile.TemporaryDirectory(prefix="fp4lab-train-") as folder:
        resolved = Path(folder) / "train.toml"
        resolved.write_text(toml_text(train_config.to_dict(), ["fp4lab train --nproc-per-node: the resolved run"]))
        code = subprocess.run(train_command(resolved, nproc=nproc_per_node), check=False).returncode
    raise typer.Exit(code)


def _comma_list(text: str | None, kind: type, option: str) -> list | None:
    if text is None:
        return None
    try:
        return [kind(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        fail(f"train: {option} {text!r} must be a comma-separated list of {kind.__name__}s")


def print_summary_block(summary: dict, out_dir, file=None) -> None:
    """The block ending a run's output; `fp4lab scan` reads its status from the worker logs."""
    print("---", file=file)
    for key in ("status", "diverged_step", "steps_completed", "final_train_loss", "best_train_loss", "final_val_loss", "tokens_per_s", "startup_seconds", "train_seconds", "peak_memory_mb"):
        value = summary.get(key)
        print(f"{key}: {value:.6g}" if isinstance(value, float) else f"{key}: {value}", file=file)
    print(f"out_dir: {out_dir}", file=file)


def _note_finished_run(config) -> None:
    """Say so when a run folder already holds a finished run: training again only reprints its summary."""
    summary_path = Path(config.out_dir) / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError):
        return
    if summary.get("status") in ("completed", "diverged") and summary.get("steps") == config.steps:
        print(f"{config.out_dir} already holds this run, {summary['status']} after {summary.get('steps_completed')} steps: "
              "nothing to train, its summary follows (--fresh trains it again, --out another folder)", file=sys.stderr)



def _toml_keys(path: Path) -> set[str]:
    import tomllib

    return set(tomllib.loads(path.read_text()))


@contextlib.contextmanager
def _holding(folder: Path):
    """This process holds the run folder (fp4lab.train.run_folder) while the block runs; a folder another
    trainer holds is a one-line error."""
    from fp4lab.train.run_folder import RunFolderBusy, hold

    held = contextlib.ExitStack()
    try:
        held.enter_context(hold(folder))
    except RunFolderBusy as exc:
        fail(f"train: {exc}")
    with held:
        yield


def _clear_run_folder(folder: Path) -> None:
    """Remove only the files a training run writes (either kind of checkpoint, one process or sharded),
    never anything else the user keeps there."""
    from fp4lab.train.checkpoint import CHECKPOINT, PREVIOUS_CHECKPOINT, SHARDED_CHECKPOINT, remove_checkpoint

    for name in (CHECKPOINT, PREVIOUS_CHECKPOINT, SHARDED_CHECKPOINT):
        remove_checkpoint(folder / name)
    for name in ("metrics.jsonl", "summary.json", "config.json"):
        (folder / name).unlink(missing_ok=True)
