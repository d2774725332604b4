"""The `fp4lab` command line.

Commands import torch (and everything heavy) inside their bodies, so `fp4lab --help` stays fast.
Conventions, the same on every command: the main input is a positional argument; an enumerated
option is a choice that `--help` lists; `--json` (on every command that lists or reports) prints
exactly one JSON document on stdout and nothing else there; help text is plain text (brackets such as
`[slurm]` are shown as written). Exit codes: 0 ok, 1 a scan or a run found a problem, 2 a usage or
input error (one line on stderr), 130 interrupted.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, Optional

import typer
from typer.core import TyperGroup

# The allowed values of enumerated options. Plain tuples here, not imports: the library modules that
# define them import torch or pydantic, and `fp4lab --help` must not. tests/test_cli_conventions.py
# checks each against its source.
MODEL_PRESETS = ("tiny", "125m", "350m", "1b")  # fp4lab.train.config.MODEL_PRESETS, fp4lab.nn.model.PRESETS
OPTIMIZERS = ("muon", "adamw")  # fp4lab.train.config.OPTIMIZERS
LR_SCHEDULES = ("cosine", "constant", "wsd")  # fp4lab.train.config.LR_SCHEDULES
QK_CLIPS = ("none", "kimi", "update_cap")  # fp4lab.train.config.QK_CLIPS
NS_POLYNOMIALS = ("quintic", "cubic")  # fp4lab.train.config.NS_POLYNOMIALS, fp4lab.optim.muon.NS_POLYNOMIALS
DEVICES = ("cpu", "cuda", "auto")  # fp4lab.train.config.DEVICES
COMPUTES = ("auto", "reference", "fast")  # fp4lab.train.config.COMPUTES
COMPILES = ("auto", "on", "off")  # fp4lab.train.config.COMPILES
CUDA_GRAPHS = ("auto", "on", "off")  # fp4lab.train.config.CUDA_GRAPHS
ATTENTION_KERNELS = ("auto", "triton", "sdpa")  # fp4lab.train.config.ATTENTION_KERNELS
MX_GEMMS = ("auto", "fp8", "bf16")  # fp4lab.train.config.MX_GEMMS
PRODUCER_FUSIONS = ("off", "on", "all")  # fp4lab.train.config.PRODUCER_FUSIONS
PARALLELS = ("none", "ddp", "fsdp", "hsdp", "pp")  # fp4lab.train.config.PARALLELS
GATHER_WEIGHTS = ("dense", "encoded")  # fp4lab.train.config.GATHER_WEIGHTS
TOKEN_DTYPES = ("uint16", "uint32")  # fp4lab.train.data.TOKEN_DTYPES
DISTRIBUTIONS = ("normal", "student-t", "outlier")  # fp4lab.numerics.survey.DISTRIBUTIONS
GEMM_FORMATS = (  # tuple(fp4lab.train.gemm_error.FORMATS)
    "bf16", "mxfp4", "mxfp4-h32", "mxfp4-rceil", "nvfp4", "nvfp4-h16", "nvfp4-rht16", "nvfp4-rhtfull", "nvfp4_cta",
    "nvfp4_cta-h16", "fp8-e4m3", "fp8-e4m3-row",
)
LOG_PRESETS = ("nanogpt", "megatron", "torchtitan", "fp4lab")  # fp4lab.lab.records.logscan.PRESETS
SWEEP_EXECUTORS = ("local", "slurm", "sbatch")  # fp4lab.lab.runs.executors.EXECUTORS
RATCHET_EXECUTORS = ("local", "slurm")  # what fp4lab.lab.ratchet.loop.Ratchet accepts
PROPOSERS = ("optuna", "llm", "command")  # fp4lab.lab.ratchet.proposers.PROPOSERS
BENCH_WHAT = ("all", "kernels", "steps", "gemm", "attention", "fusion")
CORPORA = ("pycode",)  # fp4lab.train.pycode.NAME: the corpora `fp4lab data build` makes

# typer turns a Literal into a choice: --help shows <a|b|c>, any other value is a usage error (exit 2).
ModelPreset = Literal[MODEL_PRESETS]
Optimizer = Literal[OPTIMIZERS]
LrSchedule = Literal[LR_SCHEDULES]
QkClip = Literal[QK_CLIPS]
NsPolynomial = Literal[NS_POLYNOMIALS]
Device = Literal[DEVICES]
Compute = Literal[COMPUTES]
Compile = Literal[COMPILES]
CudaGraphs = Literal[CUDA_GRAPHS]
AttentionKernel = Literal[ATTENTION_KERNELS]
MxGemm = Literal[MX_GEMMS]
ProducerFusion = Literal[PRODUCER_FUSIONS]
Parallel = Literal[PARALLELS]
GatherWeights = Literal[GATHER_WEIGHTS]
TokenDtype = Literal[TOKEN_DTYPES]
Distribution = Literal[DISTRIBUTIONS]
LogPreset = Literal[LOG_PRESETS]
SweepExecutor = Literal[SWEEP_EXECUTORS]
RatchetExecutor = Literal[RATCHET_EXECUTORS]
Proposer = Literal[PROPOSERS]
BenchWhat = Literal[BENCH_WHAT]
Corpus = Literal[CORPORA]


def _plain_help(command, params: list) -> list:
    """Help text as written: typer reads it as rich markup, where `[stop]` or `[slurm]` (TOML tables)
    would vanish as unknown tags, so each text is escaped (once). Flags lose the `<bool>` value type
    typer labels them with, as if they took a value."""
    from rich.markup import escape

    for item in (command, *params):
        if getattr(item, "help", None) and not getattr(item, "_fp4lab_plain_help", False):
            item.help = escape(item.help)
            item._fp4lab_plain_help = True
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
    return params


class _Commands(TyperGroup):
    """fp4lab's command group: it and each of its commands get plain help text (_plain_help)."""

    def get_params(self, ctx: typer.Context) -> list:
        return _plain_help(self, super().get_params(ctx))

    def get_command(self, ctx: typer.Context, name: str):
        command = super().get_command(ctx, name)
        if command is not None and not isinstance(command, _Commands):
            _plain_help(command, command.get_params(ctx))
        return command


app = typer.Typer(
    name="fp4lab",
    cls=_Commands,
    help="Find which FP4 training recipe trains a language model stably and fast.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"fp4lab {version('fp4lab')}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print fp4lab's version and exit.")
    ] = None,
) -> None:
    """Find which FP4 training recipe trains a language model stably and fast."""


class UserError(Exception):
    """A mistake in the user's input: reported in one line, exit code 2."""


def fail(message: str) -> NoReturn:
    raise UserError(message)


def _print_json(document: Any) -> None:
    """The one JSON document of a `--json` command, on stdout: strict JSON, with non-finite floats as
    the strings "nan", "inf" and "-inf" (as in metrics.jsonl) and paths as strings."""
    json.dump(_strict(document), sys.stdout, indent=1, allow_nan=False, default=str)
    sys.stdout.write("\n")


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


@app.command()
def numerics(
    tensor: Annotated[
        Optional[Path], typer.Option(help="A .pt file holding a tensor (or a dict of tensors: pick one with --key).")
    ] = None,
    key: Annotated[Optional[str], typer.Option(help="Entry of a dict/state_dict in --tensor.")] = None,
    dist: Annotated[
        Optional[Distribution], typer.Option(help="Synthesize the tensor instead (default normal when no --tensor).")
    ] = None,
    shape: Annotated[str, typer.Option(help="ROWSxCOLS of a synthesized tensor.")] = "512x1024",
    seed: Annotated[int, typer.Option(help="Seed for synthesis, stochastic rounding and random signs.")] = 0,
    capture: Annotated[
        Optional[Path], typer.Option(help="A run folder trained with capture_steps (or one capture .pt file): the Dgrad and Wgrad output error of each format on its captured real operands.")
    ] = None,
    gemm_format: Annotated[
        Optional[list[str]], typer.Option("--format", help=f"With --capture: an operand format to compare, one of {', '.join(GEMM_FORMATS)} (repeatable; default bf16 and every FP4 one, or none when --recipe is given).")
    ] = None,
    recipe: Annotated[
        Optional[list[str]], typer.Option(help="With --capture: a recipe whose own Dgrad and Wgrad operand specs to compare (repeatable).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")] = False,
) -> None:
    """Quantization error of one tensor under every FP4 format x scale mode x rounding x transform;
    with --capture, the error of the backward GEMM outputs on the real operands a run captured."""
    if capture is not None:
        if tensor is not None or dist is not None or key is not None:
            fail("numerics: --capture reads its own tensors; drop --tensor, --key and --dist")
        _numerics_capture(capture, gemm_format, recipe or [], seed, as_json)
        return
    if gemm_format or recipe:
        fail("numerics: --format and --recipe compare GEMM outputs on captured tensors; pass --capture RUN too")

    from fp4lab.numerics.survey import survey_cases

    if tensor is not None and dist is not None:
        fail("numerics: pass either --tensor or --dist, not both")
    if tensor is None and dist is None:
        dist = "normal"
    x, source = _load_tensor(tensor, key) if tensor is not None else _synthesize(dist, shape, seed)

    from fp4lab.numerics.survey import survey

    if as_json:
        rows = [row.as_dict() for row in survey(x, seed=seed)]
        _print_json({"source": source, "shape": list(x.shape), "seed": seed, "rows": rows})
        return

    from rich.progress import Progress

    with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task("quantizing", total=len(survey_cases()))
        rows = list(survey(x, seed=seed, on_case=lambda: progress.advance(task)))
    _print_numerics(rows, title=f"Quantization error of {source}, shape {list(x.shape)}, seed {seed}")


def _numerics_capture(source: Path, formats: list[str] | None, recipes: list[str], seed: int, as_json: bool) -> None:
    """`numerics --capture`: a thin wrapper of fp4lab.train.gemm_error."""
    from fp4lab.nn.recipe import RecipeError, load_recipe
    from fp4lab.train.capture import CaptureError, capture_files
    from fp4lab.train.gemm_error import DEFAULT_FORMATS, candidates, measure, summarize
    from fp4lab.validation import Checks

    for name in formats or []:
        Checks(UserError).choice("numerics: --format", name, GEMM_FORMATS)
    try:
        loaded = [load_recipe(name) for name in recipes]
    except RecipeError as exc:
        fail(f"numerics: --recipe: {str(exc).splitlines()[0]}")
    names = list(dict.fromkeys(formats)) if formats is not None else ([] if recipes else list(DEFAULT_FORMATS))
    chosen = candidates(names, list({r.name: r for r in loaded}.values()))
    try:
        files = capture_files(source)
        if as_json:
            rows = measure(files, chosen, seed)
        else:
            from rich.progress import Progress

            with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
                task = progress.add_task("GEMMs on captured operands", total=len(files))
                rows = measure(files, chosen, seed, on_capture=lambda: progress.advance(task))
    except CaptureError as exc:
        fail(f"numerics: --capture: {exc}")
    summary = summarize(rows, chosen)
    if as_json:
        described = [{"name": c.name, "kind": c.kind, "operands": c.describe()} for c in chosen]
        _print_json({"source": str(source), "seed": seed, "candidates": described, "captures": [str(f) for f in files],
                     "rows": [row.as_dict() for row in rows], "summary": summary})
        return
    _print_gemm_errors(rows, summary, chosen, title=f"Backward GEMM output error on the operands captured in {source}")


def _print_gemm_errors(rows, summary: dict, chosen, title: str) -> None:
    from rich.table import Table

    by_key = {(r.step, r.layer, r.candidate, r.gemm): r for r in rows}
    table = Table(title=title, caption="rel = ||Y_q - Y|| / ||Y|| against the fp32 product of the same exact tensors; "
                  "bold: the lowest Dgrad error of that capture among quantized (FP4, FP8) candidates")
    for name in ("step", "layer", "candidate"):
        table.add_column(name, no_wrap=True)
    for name in ("Dgrad rel%", "Dgrad cos", "Wgrad rel%", "Wgrad cos"):
        table.add_column(name, justify="right", no_wrap=True)
    contenders = [c.name for c in chosen if c.quantized()] or [c.name for c in chosen]
    captures = list(dict.fromkeys((r.step, r.layer) for r in rows))
    for step, layer in captures:
        best = min(contenders, key=lambda name: by_key[(step, layer, name, "dgrad")].rel)
        for candidate in chosen:
            d, w = (by_key[(step, layer, candidate.name, gemm)] for gemm in ("dgrad", "wgrad"))
            table.add_row(str(step), layer, candidate.name, f"{100 * d.rel:.2f}", f"{d.cosine:.5f}", f"{100 * w.rel:.2f}",
                          f"{w.cosine:.5f}", style="bold" if candidate.name == best else None)
        table.add_section()
    means = Table(title=f"Mean over {len(captures)} captures; E/E_best: geometric mean of the error energy over the best quantized candidate's",
                  caption="bold: the lowest mean error of that GEMM among quantized candidates")
    for name in ("candidate", "operands"):
        means.add_column(name)
    for name in ("Dgrad rel%", "Dgrad E/E_best", "Wgrad rel%", "Wgrad E/E_best"):
        means.add_column(name, justify="right", no_wrap=True)
    for candidate in chosen:
        cells = []
        for gemm in ("dgrad", "wgrad"):
            stats = summary["candidates"][candidate.name][gemm]
            text = f"{100 * stats['mean_rel']:.2f}"
            cells += [f"[bold]{text}[/]" if summary["best"][gemm] == candidate.name else text, f"{stats['energy_vs_best']:.3f}"]
        means.add_row(candidate.name, candidate.describe(), *cells)
    console = _console()
    console.print(table)
    console.print(means)
    pair = summary.get("mx_vs_cta")
    if pair:
        console.print(f"E_MX / E_CTA (Dgrad error energy, {pair['mx']} over {pair['cta']}, geometric mean over the same tensors): "
                      f"{pair['energy_ratio_geomean']:.3f}; {pair['cta']} lower in {pair['cta_lower']} of {pair['captures']} captures",
                      markup=False)


def _print_numerics(rows, title: str) -> None:
    from rich.table import Table

    best = {}
    for row in rows:
        group = (row.format, row.scale_mode, row.rounding)
        if group not in best or row.stats.rel_rms < best[group].stats.rel_rms:
            best[group] = row
    table = Table(title=title, caption="bold: lowest error over transforms for that format, scale and rounding")
    for name in ("format", "scale", "round", "transform"):
        table.add_column(name, no_wrap=True)
    for name in ("relRMS%", "SNR dB", "bias%", "satur%", "flush%"):
        table.add_column(name, justify="right", no_wrap=True)
    previous = None
    for row in rows:
        s = row.stats
        if previous is not None and previous != (row.format, row.scale_mode):
            table.add_section()
        previous = (row.format, row.scale_mode)
        table.add_row(
            row.format, row.scale_mode, row.rounding, row.transform,
            f"{100 * s.rel_rms:.2f}", f"{s.snr_db:.2f}", f"{100 * s.bias:+.3f}",
            f"{100 * s.saturated:.3f}", f"{100 * s.flushed:.2f}",
            style="bold" if best[(row.format, row.scale_mode, row.rounding)] is row else None,
        )
    effect = Table(title="Transform effect: change of rel RMS vs no transform (RTN); negative is better")
    effect.add_column("format")
    effect.add_column("scale")
    transforms = [r.transform for r in rows if r.transform != "none"]
    transforms = list(dict.fromkeys(transforms))
    for name in transforms:
        effect.add_column(name, justify="right")
    base = {(r.format, r.scale_mode): r.stats.rel_rms for r in rows if r.rounding == "rtn" and r.transform == "none"}
    for (fmt, mode), none_error in base.items():
        cells = []
        for name in transforms:
            err = next(r.stats.rel_rms for r in rows if (r.format, r.scale_mode, r.rounding, r.transform) == (fmt, mode, "rtn", name))
            change = 100 * (err / none_error - 1) if none_error else 0.0
            cells.append(f"[green]{change:+.1f}%[/]" if change < 0 else f"[red]{change:+.1f}%[/]")
        effect.add_row(fmt, mode, *cells)
    console = _console()
    console.print(table)
    console.print(effect)


@app.command()
def train(
    recipe: Annotated[Optional[str], typer.Option(help="Recipe name (fp4lab recipes) or path to a recipe .toml.")] = None,
    model: Annotated[Optional[ModelPreset], typer.Option(help="Model preset (default tiny).")] = None,
    data: Annotated[Optional[str], typer.Option(help="shakespeare (embedded) | synthetic | pycode (after fp4lab data build pycode) | path to a .bin token file.")] = None,
    val_data: Annotated[Optional[str], typer.Option(help="Validation .bin file (default: hold out the tail of --data).")] = None,
    token_dtype: Annotated[Optional[TokenDtype], typer.Option(help="Id width of .bin files (default uint16).")] = None,
    vocab_size: Annotated[Optional[int], typer.Option(help="Vocabulary size (BPE size for shakespeare).")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Optimizer steps (default 200).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per step (default 8).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence (default 128).")] = None,
    optimizer: Annotated[Optional[Optimizer], typer.Option(help="muon (hidden matrices; AdamW for the rest) or adamw (default: the recipe's, else muon).")] = None,
    lr: Annotated[Optional[float], typer.Option(help="Muon learning rate (default 0.02).")] = None,
    adam_lr: Annotated[Optional[float], typer.Option(help="AdamW learning rate (default 1e-2).")] = None,
    weight_decay: Annotated[Optional[float], typer.Option(help="Decoupled weight decay (default 0).")] = None,
    lr_schedule: Annotated[Optional[LrSchedule], typer.Option(help="Learning-rate schedule (default cosine).")] = None,
    warmup_steps: Annotated[Optional[int], typer.Option(help="Linear warmup steps (default 20).")] = None,
    ns_steps: Annotated[Optional[int], typer.Option(help="Newton-Schulz steps K of Muon (default 5).")] = None,
    ns_polynomial: Annotated[Optional[NsPolynomial], typer.Option(help="Muon's Newton-Schulz polynomial: quintic (Keller Jordan's) or cubic 0.5(3I - XX^T)X (default: the recipe's, else quintic).")] = None,
    qk_clip: Annotated[Optional[QkClip], typer.Option(help="QK-Clip: kimi (rescale W_q and W_k), update_cap (OptiTrain-FP4's update cap) or none (default: the recipe's).")] = None,
    qk_clip_tau: Annotated[Optional[float], typer.Option(help="QK-Clip threshold tau (default: the recipe's, 100).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of init, data order and every random stream (default 0).")] = None,
    eval_every: Annotated[Optional[int], typer.Option(help="Validation loss every N steps (default 50).")] = None,
    probe_every: Annotated[Optional[int], typer.Option(help="Attention and quantization probes every N steps (default 25).")] = None,
    checkpoint_every: Annotated[Optional[int], typer.Option(help="Checkpoint every N steps (default 50).")] = None,
    max_minutes: Annotated[Optional[float], typer.Option(help="Stop cleanly (resumable) after this much wall time.")] = None,
    capture_steps: Annotated[Optional[str], typer.Option(help="Comma-separated steps at which to save the GEMM operands (x, W, dY) of --capture-layers to <out>/captures, for numerics --capture.")] = None,
    capture_layers: Annotated[Optional[str], typer.Option(help="Comma-separated fnmatch patterns of FP4 linear names whose operands --capture-steps saves, e.g. 'layers.0.attention.wq,layers.*.feed_forward.w2'.")] = None,
    device: Annotated[Optional[Device], typer.Option(help="Where to train (default cpu).")] = None,
    compute: Annotated[Optional[Compute], typer.Option(help="fast (bf16 activations, tensor-core GEMMs, fused kernels), reference (fp32, exact emulation) or auto (default: fast on CUDA).")] = None,
    compile: Annotated[Optional[Compile], typer.Option(help="torch.compile (default auto: on CUDA).")] = None,
    cuda_graphs: Annotated[Optional[CudaGraphs], typer.Option(help="Replay steps from a CUDA graph (default auto: on CUDA where nothing draws from a torch.Generator).")] = None,
    attention_kernel: Annotated[Optional[AttentionKernel], typer.Option(help="Unquantized attention on the fast path: triton (flash attention that yields the max-logit and entropy probes online) or sdpa (PyTorch's) (default auto: triton on CUDA).")] = None,
    mx_gemm: Annotated[Optional[MxGemm], typer.Option(help="MXFP4 x MXFP4 GEMMs on the fast path: fp8 (FP8 tensor cores, each 32-block promoted to fp32) or bf16 (decoded values on bf16 tensor cores) (default auto: bf16, the faster on an H200; fp8 is opt-in).")] = None,
    producer_fusion: Annotated[Optional[ProducerFusion], typer.Option(help="on: fuse each feed-forward's SwiGLU into its W2's GEMMs (the quantized operands written straight from gate and up; the SiLU derivative fused into the backward), the same bits; all: also the residual add and RMSNorm into W1's and W3's operands, the norm within a few ulps (default off).")] = None,
    parallel: Annotated[Optional[Parallel], typer.Option(help="Parallelism over torchrun's processes: ddp (DistributedDataParallel), fsdp (FSDP2), hsdp (FSDP2 sharded within a node, replicated across nodes), pp (pipeline stages of transformer blocks) or none (default).")] = None,
    pp_microbatches: Annotated[Optional[int], typer.Option(help="With --parallel pp: microbatches each global batch is split into (default 4, DualPipeV's minimum on 2 ranks).")] = None,
    gather_weights: Annotated[Optional[GatherWeights], typer.Option(help="What FSDP2's weight all-gathers move (fsdp, hsdp): dense rows (default) or, where exact, the FP4 encoding the GEMMs consume (the same run, fewer bytes; summary.json reports them).")] = None,
    nproc_per_node: Annotated[Optional[int], typer.Option(help="Train on N local processes (GPUs) through torchrun; with N > 1 pass --parallel too (a sweep run's config has it).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Run folder (default runs/<recipe>-<model>-s<seed>).")] = None,
    config: Annotated[Optional[Path], typer.Option(help="A TOML file of train settings; flags override it.")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="Delete this run folder's checkpoint and logs first instead of resuming.")] = False,
    catalog: Annotated[Optional[Path], typer.Option(help="Record this sweep run's start and end in this catalog (sweep jobs pass it; needs --config jobs/<sweep>/<id>.toml and no other flag but --nproc-per-node; rank 0 records).")] = None,
) -> None:
    """Train a small Llama-style model with one FP4 recipe; resumes from the run folder's checkpoint."""
    from fp4lab.lab.records.catalog import CatalogError
    from fp4lab.nn.recipe import RecipeError
    from fp4lab.train.config import CheckpointMismatch, ConfigError, TrainConfig

    flags = {
        "recipe": recipe, "model": model, "steps": steps, "batch_size": batch_size, "seq_len": seq_len,
        "optimizer": optimizer, "lr": lr, "adam_lr": adam_lr, "weight_decay": weight_decay,
        "lr_schedule": lr_schedule, "warmup_steps": warmup_steps, "ns_steps": ns_steps, "ns_polynomial": ns_polynomial, "qk_clip": qk_clip,
        "qk_clip_tau": qk_clip_tau, "seed": seed, "eval_every": eval_every, "probe_every": probe_every,
        "checkpoint_every": checkpoint_every, "max_minutes": max_minutes, "device": device,
        "compute": compute, "compile": compile, "cuda_graphs": cuda_graphs,
        "attention_kernel": attention_kernel, "mx_gemm": mx_gemm, "producer_fusion": producer_fusion, "parallel": parallel, "pp_microbatches": pp_microbatches,
        "gather_weights": gather_weights,
        "capture_steps": _comma_list(capture_steps, int, "--capture-steps"), "capture_layers": _comma_list(capture_layers, str, "--capture-layers"),
    }
    data_flags = {"source": data, "val_source": val_data, "token_dtype": token_dtype, "vocab_size": vocab_size}
    try:
        base = TrainConfig.from_toml(config).to_dict() if config is not None else TrainConfig().to_dict()
        values = base | {k: v for k, v in flags.items() if v is not None}
        values["data"] = base["data"] | {k: v for k, v in data_flags.items() if v is not None}
        if out is not None:
            values["out_dir"] = str(out)
        elif config is None or "out_dir" not in _toml_keys(config):
            values["out_dir"] = f"runs/{Path(values['recipe']).stem}-{values['model']}-s{values['seed']}"
        train_config = TrainConfig.from_dict(values, "train")
    except (ConfigError, ValueError) as exc:
        fail(str(exc))
    if catalog is not None:  # refused before anything is touched
        changed = [k for k, v in {**flags, **data_flags, "out": out, "fresh": fresh or None}.items() if v is not None]
        if config is None or changed:
            fail(f"train: --catalog trains a sweep run exactly as written: pass only --config jobs/<sweep>/<id>.toml"
                 f"{' (drop ' + ', '.join('--' + k.replace('_', '-') for k in changed) + ')' if changed else ''}")
    if nproc_per_node is not None:
        _launch_ranks(train_config, nproc_per_node, fresh, config, catalog)
    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 speaks
    # Under torchrun rank 0 alone clears: the others cannot read the folder before joining the process
    # group, which rank 0 joins only after clearing.
    if main_rank and fresh:
        _clear_run_folder(Path(train_config.out_dir))
    elif main_rank and catalog is None:
        _note_finished_run(train_config)

    from fp4lab.train.loop import run

    try:
        if catalog is not None:
            from fp4lab.lab.records.catalog import Catalog
            from fp4lab.lab.runs.job import train_recorded

            summary = train_recorded(config, Catalog(catalog))
        else:
            summary = run(train_config)
    except CheckpointMismatch as exc:
        fail(f"{str(exc).splitlines()[0]}: --fresh starts over, --out trains into another folder")
    except (ConfigError, RecipeError, ValueError, CatalogError) as exc:
        fail(str(exc).splitlines()[0])
    if summary["status"] == "interrupted" and main_rank:
        print(f"interrupted after step {summary['steps_completed']}: checkpoint written; run the same command to resume "
              f"({train_config.out_dir})", file=sys.stderr)
    if main_rank:
        _print_summary_block(summary, train_config.out_dir)
    if summary["status"] == "interrupted":
        raise typer.Exit(130)


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


def _print_summary_block(summary: dict, out_dir, file=None) -> None:
    """The block ending a run's output; `fp4lab scan` reads its status from the worker logs."""
    print("---", file=file)
    for key in ("status", "diverged_step", "steps_completed", "final_train_loss", "best_train_loss", "final_val_loss", "tokens_per_s", "train_seconds", "peak_memory_mb"):
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


# (model, batch, seq, timed steps, warmup, kernel shape) when not given: a GPU-sized run on CUDA, a
# smoke-sized one on the CPU.
BENCH_DEFAULTS = {"cuda": ("125m", 16, 1024, 20, 5, "8192x8192"), "cpu": ("tiny", 8, 128, 10, 2, "1024x1024")}


@app.command()
def bench(
    what: Annotated[BenchWhat, typer.Argument(help="kernels (quantizers vs a copy), steps (training steps vs the plain PyTorch loop), gemm (the MXFP4 GEMM on FP8 tensor cores vs bf16 cuBLAS, the 125m and 350m GEMMs at --batch-size x --seq-len), attention (Triton flash attention with the fused probes vs SDPA, fwd + bwd, head dims 64 and 128, seq 1024-8192), fusion (each fused FP4 producer vs its torch ops, eager and compiled, at the --model's widths and --batch-size x --seq-len tokens) or all. gemm, attention and fusion need CUDA.")] = "all",
    recipes: Annotated[str, typer.Option(help="Comma-separated recipes to time beside the anchor.")] = "bf16,nvfp4,nvfp4-all,mxfp4-rowsr-h32",
    model: Annotated[Optional[ModelPreset], typer.Option(help="Model preset (default 125m on CUDA, tiny on the CPU).")] = None,
    batch_size: Annotated[Optional[int], typer.Option(help="Sequences per step (default 16 on CUDA, 8 on the CPU).")] = None,
    seq_len: Annotated[Optional[int], typer.Option(help="Tokens per sequence (default 1024 on CUDA, 128 on the CPU).")] = None,
    steps: Annotated[Optional[int], typer.Option(help="Timed steps per configuration (default 20 on CUDA, 10 on the CPU).")] = None,
    warmup: Annotated[Optional[int], typer.Option(help="Untimed steps first, compilation included (default 5 on CUDA, 2 on the CPU).")] = None,
    optimizer: Annotated[Optimizer, typer.Option(help="adamw (as the anchor) or muon.")] = "adamw",
    compile: Annotated[Compile, typer.Option(help="torch.compile of fp4lab and the anchor (auto: on CUDA).")] = "auto",
    cuda_graphs: Annotated[CudaGraphs, typer.Option(help="Replay fp4lab's steps from a CUDA graph (auto: where possible on CUDA).")] = "auto",
    attention_kernel: Annotated[AttentionKernel, typer.Option(help="fp4lab's unquantized attention: triton (fused probes) or sdpa (auto: triton on CUDA).")] = "auto",
    mx_gemm: Annotated[MxGemm, typer.Option(help="fp4lab's MXFP4 GEMMs: fp8 or bf16 tensor cores (auto: bf16, the faster on an H200).")] = "auto",
    producer_fusion: Annotated[ProducerFusion, typer.Option(help="on: fp4lab's feed-forwards fuse the SwiGLU into W2's GEMMs; all: also the residual add and RMSNorm into W1's and W3's operands (time them against off).")] = "off",
    shape: Annotated[Optional[str], typer.Option(help="ROWSxCOLS of the quantized tensor (default 8192x8192 on CUDA, 1024x1024 on the CPU).")] = None,
    device: Annotated[Device, typer.Option(help="Where to time (auto: CUDA if there is one).")] = "auto",
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads (default: torch's).")] = None,
    profile: Annotated[Optional[Path], typer.Option(help="Also profile 3 steps of each run; kernel tables into this folder.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document instead of tables.")] = False,
) -> None:
    """Time fp4lab against its anchors: quantizers vs a copy, training steps vs a plain PyTorch loop."""
    import torch

    from fp4lab.nn.recipe import RecipeError, load_recipe
    from fp4lab.train.config import ConfigError, TrainConfig

    if device == "cuda" and not torch.cuda.is_available():
        fail("bench: --device cuda but CUDA is not available here; use --device cpu")
    target = torch.device("cuda" if device == "cuda" or (device == "auto" and torch.cuda.is_available()) else "cpu")
    names = [r.strip() for r in recipes.split(",") if r.strip()]
    try:
        for name in names:
            load_recipe(name)
    except RecipeError as exc:
        fail(f"bench: {exc}")
    d_model, d_batch, d_seq, d_steps, d_warmup, d_shape = BENCH_DEFAULTS[target.type]
    model, batch_size, seq_len = model or d_model, batch_size or d_batch, seq_len or d_seq
    steps, warmup = steps or d_steps, d_warmup if warmup is None else warmup
    try:
        kernels = TrainConfig(
            model=model, batch_size=batch_size, seq_len=seq_len, steps=steps, device=target.type,
            attention_kernel=attention_kernel, mx_gemm=mx_gemm, producer_fusion=producer_fusion,
        )
        from fp4lab.train.loop import attention_kernel as resolve_attention, mx_gemm as resolve_mx_gemm, producer_fusion as resolve_fusion

        from fp4lab.nn.model import preset

        model_shape = preset(model, 4096, seq_len)
        # refused here, not after the anchor ran
        resolve_attention(kernels, target, model_shape.head_dim), resolve_mx_gemm(kernels, target), resolve_fusion(kernels, target)
    except ConfigError as exc:
        fail(f"bench: {exc}")
    rows, cols = _parse_shape(shape or d_shape, "bench: --shape")
    if threads is not None:
        torch.set_num_threads(threads)

    from rich.console import Console

    console = Console(stderr=True, quiet=as_json)
    report: dict = {"device": torch.cuda.get_device_name(target) if target.type == "cuda" else "cpu", "torch": torch.__version__}
    if what in ("all", "kernels"):
        from fp4lab.bench.kernels import bench_kernels

        console.print(f"quantizers on a {rows} x {cols} bf16 tensor ({report['device']})")
        kernels = bench_kernels(rows, cols, target, on_result=lambda r: console.print(f"  {r.case}: {r.gb_per_s:,.3g} GB/s"))
        report["kernels"] = [k.as_dict() for k in kernels]
    if what in ("all", "gemm"):
        from fp4lab.bench.kernels import bench_mx_gemm, bench_tile_gemm, training_gemm_shapes

        shapes = [shape for name in ("125m", "350m") for shape in training_gemm_shapes(name, batch_size, seq_len)]
        console.print(f"FP4 GEMM kernels vs bf16 cuBLAS ({report['device']}): MXFP4 on FP8 tensor cores, CTA-local 2D weights")
        gemms = [bench_mx_gemm(m, n, k, target, label=label) for label, m, n, k in shapes]
        report["gemm"] = [g.as_dict() for g in gemms if g is not None]
        tiles = [bench_tile_gemm(m, n, k, target, label=label) for label, m, n, k in shapes if "Wgrad" not in label]
        report["tile_gemm"] = [g.as_dict() for g in tiles if g is not None]
        if not report["gemm"]:
            console.print("  skipped: the GEMM kernels need CUDA and Triton")
    if what in ("all", "attention"):
        from fp4lab.bench.attention import ATTENTION_SHAPES, bench_attention

        console.print(f"attention fwd + bwd, fused probes vs SDPA ({report['device']})")
        results = [bench_attention(*shape, target) for shape in ATTENTION_SHAPES]
        report["attention"] = [r.as_dict() for r in results if r is not None]
        if not report["attention"]:
            console.print("  skipped: the Triton attention needs CUDA")
    if what in ("all", "fusion"):
        from fp4lab.bench.fusion import bench_producer_fusion

        tokens = batch_size * seq_len
        console.print(f"fused FP4 producers vs their torch ops, eager and compiled: {model}, {tokens} tokens ({report['device']})")
        widths = ((model_shape.dim, ("residual_rmsnorm",)), (model_shape.ffn_hidden, ("swiglu", "swiglu_backward")))
        results = [bench_producer_fusion((tokens, width), fmt, target, producers=producers)
                   for fmt in ("mxfp4", "nvfp4") for width, producers in widths]  # fmt: skip
        report["fusion"] = [r.as_dict() for r in results if r is not None]
        if not report["fusion"]:
            console.print("  skipped: the fused producers need CUDA and Triton")
    if what in ("all", "steps"):
        from fp4lab.bench.steps import bench_steps

        console.print(f"training steps: {model}, {batch_size} x {seq_len}, {steps} timed after {warmup} warm-up")
        results = bench_steps(
            names, model=model, batch_size=batch_size, seq_len=seq_len, device=target, steps=steps, warmup=warmup,
            compile=compile, cuda_graphs=cuda_graphs, attention_kernel=attention_kernel, mx_gemm=mx_gemm,
            producer_fusion=producer_fusion, optimizer=optimizer, profile_dir=profile,
            on_result=lambda r: console.print(f"  {r.name}: {r.tokens_per_s:,.0f} tokens/s"),
        )
        report["steps"] = [r.as_dict() for r in results]
        report["ratios"] = _bench_ratios(results)
    if as_json:
        _print_json(report)
        return
    _print_bench(report)


def _bench_ratios(results) -> dict:
    """The issue's figures: bf16 tokens/s over the anchor's; each FP4 step time and peak memory over bf16's."""
    by_name = {r.name: r for r in results}
    anchor, bf16 = by_name.get("anchor"), by_name.get("bf16")
    ratios: dict = {}
    if anchor and bf16:
        ratios["bf16_tokens_per_s_vs_anchor"] = bf16.tokens_per_s / anchor.tokens_per_s
    if bf16:
        for r in results:
            if r.name not in ("anchor", "bf16"):
                ratios[f"{r.name}_step_time_vs_bf16"] = r.step_ms / bf16.step_ms
                if r.peak_memory_mb and bf16.peak_memory_mb:
                    ratios[f"{r.name}_peak_memory_vs_bf16"] = r.peak_memory_mb / bf16.peak_memory_mb
    return ratios


def _print_bench(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from fp4lab.bench.fusion import PRODUCERS

    console = Console()
    if "kernels" in report:
        table = Table(title=f"Quantizers vs a device-to-device copy ({report['device']})")
        for column in ("case", "implementation", "shape", "ms", "GB/s", "copy GB/s", "fraction of copy"):
            table.add_column(column, justify="left" if column in ("case", "implementation") else "right")
        for k in report["kernels"]:
            table.add_row(k["case"], k["implementation"], f"{k['rows']}x{k['cols']}", f"{k['ms']:.3f}", f"{k['gb_per_s']:,.3g}",
                          f"{k['copy_gb_per_s']:,.3g}", f"{k['fraction_of_copy']:.2f}")
        console.print(table)
    for key, title in (("gemm", "MXFP4 GEMM on FP8 tensor cores"), ("tile_gemm", "Chunk-scaled GEMM of CTA-local 2D weights")):
        if not report.get(key):
            continue
        table = Table(title=f"{title} vs bf16 cuBLAS ({report['device']})")
        for column in ("GEMM", "m x n x k", "ms", "TFLOP/s", "bf16 ms", "bf16 TFLOP/s", "throughput vs bf16"):
            table.add_column(column, justify="left" if column == "GEMM" else "right")
        for g in report[key]:
            table.add_row(g["case"], f"{g['m']}x{g['n']}x{g['k']}", f"{g['ms']:.3f}", f"{g['tflops']:,.0f}", f"{g['bf16_ms']:.3f}",
                          f"{g['bf16_tflops']:,.0f}", f"{g['throughput_vs_bf16']:.2f}")
        console.print(table)
    if report.get("attention"):
        table = Table(title=f"Attention fwd + bwd, bf16, causal GQA ({report['device']})")
        for column in ("B x H/Hkv x T x D", "SDPA ms", "fused ms", "fused / SDPA", "poly exp2 / SDPA", "SDPA + probes ms"):
            table.add_column(column, justify="left" if column.startswith("B") else "right")
        for a in report["attention"]:
            table.add_row(f"{a['batch']} x {a['heads']}/{a['kv_heads']} x {a['seq']} x {a['head_dim']}", f"{a['sdpa_ms']:.3f}",
                          f"{a['fused_ms']:.3f}", f"{a['fused_vs_sdpa']:.2f}", f"{a['fused_poly_vs_sdpa']:.2f}", f"{a['sdpa_with_probes_ms']:.3f}")
        console.print(table)
    if report.get("fusion"):
        table = Table(title=f"Fused FP4 producers vs their torch ops ({report['device']})")
        for column in ("producer", "format", "tokens x features", "eager ms", "compiled ms", "fused ms", "eager / fused", "compiled / fused"):
            table.add_column(column, justify="left" if column in ("producer", "format") else "right")
        for bench in report["fusion"]:
            for name in PRODUCERS:
                if name in bench:
                    t = bench[name]
                    table.add_row(name, bench["fmt"], f"{bench['tokens']} x {bench['features']}", f"{t['unfused_ms']:.3f}", f"{t['compiled_ms']:.3f}",
                                  f"{t['fused_ms']:.3f}", f"{t['gain']:.2f}", f"{t['gain_over_compiled']:.2f}")
        console.print(table)
    if "steps" in report:
        steps = report["steps"]
        first = steps[0]
        table = Table(title=f"Training steps, {first['model']} {first['batch_size']} x {first['seq_len']} ({report['device']})")
        for column in ("run", "compute", "compiled", "graph", "step ms", "tokens/s", "vs anchor", "step vs bf16", "peak MB", "memory vs bf16"):
            table.add_column(column, justify="left" if column in ("run", "compute") else "right")
        by_name = {r["name"]: r for r in steps}
        anchor, bf16 = by_name.get("anchor"), by_name.get("bf16")
        for r in steps:
            vs_anchor = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}" if anchor else "-"
            vs_bf16 = f"{r['step_ms'] / bf16['step_ms']:.2f}" if bf16 else "-"
            memory = f"{r['peak_memory_mb']:,.0f}" if r["peak_memory_mb"] is not None else "-"
            memory_ratio = (f"{r['peak_memory_mb'] / bf16['peak_memory_mb']:.2f}"
                            if bf16 and r["peak_memory_mb"] and bf16["peak_memory_mb"] else "-")
            table.add_row(r["name"], r["compute"], "yes" if r["compiled"] else "no", "yes" if r["cuda_graph"] else "no", f"{r['step_ms']:.1f}",
                          f"{r['tokens_per_s']:,.0f}", vs_anchor, vs_bf16, memory, memory_ratio)
        console.print(table)


def _parse_shape(text: str, where: str) -> tuple[int, int]:
    """ROWSxCOLS of a tensor quantized along its rows: COLS must hold whole MXFP4 blocks."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        fail(f"{where} {text!r} is not ROWSxCOLS with positive sizes (e.g. 512x1024)")
    if int(parts[1]) % 32:
        fail(f"{where} {text!r} needs COLS a multiple of 32 (the MXFP4 block)")
    return int(parts[0]), int(parts[1])


def _toml_keys(path: Path) -> set[str]:
    import tomllib

    return set(tomllib.loads(path.read_text()))


def _clear_run_folder(folder: Path) -> None:
    """Remove only the files a training run writes (either kind of checkpoint, one process or sharded),
    never anything else the user keeps there."""
    from fp4lab.train.checkpoint import remove_checkpoint
    from fp4lab.train.loop import CHECKPOINT, SHARDED_CHECKPOINT

    for name in (CHECKPOINT, SHARDED_CHECKPOINT):
        remove_checkpoint(folder / name)
    for name in ("metrics.jsonl", "summary.json", "config.json"):
        (folder / name).unlink(missing_ok=True)


@app.command()
def scan(
    logs: Annotated[list[Path], typer.Argument(help="Run folders, metrics.jsonl files, fp4lab's jobs/<sweep>/logs/*.local.log, or text logs of other trainers.")],
    preset: Annotated[Optional[LogPreset], typer.Option(help="Format of text logs (default: the preset matching the most lines).")] = None,
    regex: Annotated[Optional[str], typer.Option(help="Regex with named groups step and loss (optional grad_norm, val_loss).")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option(help="NAME=VALUE threshold override, repeatable (e.g. spike_sigma=5).")] = None,
    running: Annotated[Optional[bool], typer.Option("--running/--not-running", help="Whether the job is alive (default: judge by the log's age).")] = None,
    events: Annotated[bool, typer.Option("--events", help="Print every event under its run's line.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of one line per log.")] = False,
) -> None:
    """Scan logs for NaNs, loss spikes, a vanished loss, entropy collapse and large attention logits; print a verdict per log.

    Exit code 0 when every verdict is converged or running (nothing wrong); 1 when any log raises an
    alarm (diverged, entropy_collapse, loss_vanished, no_loss, unstable, crashed, timeout, stalled),
    live jobs included; 2 on bad options or when a path cannot be scanned (each such path gets an
    error line on stderr; the other paths are still scanned and printed).
    """
    from fp4lab.lab.records.logscan import HEALTHY_VERDICTS, LogFormat, ScanThresholds, format_result
    from fp4lab.lab.records.logscan import scan as scan_log

    try:
        thresholds = ScanThresholds().with_overrides(threshold or [])
        if regex is not None:
            LogFormat.from_regex(regex)
    except ValueError as exc:
        fail(f"scan: {str(exc).splitlines()[0]}")
    results, unreadable = [], 0
    for path in logs:
        try:
            results.append(scan_log(path, thresholds, regex=regex, preset=preset, running=running))
        except (OSError, ValueError) as exc:
            unreadable += 1
            print(f"fp4lab: error: scan: {str(exc).splitlines()[0]}", file=sys.stderr)
    if as_json:
        _print_json([r.to_dict() for r in results])
    else:
        for result in results:
            print(format_result(result))
            for event in result.events if events else ():
                print(f"    {event.kind}@{event.step}: {event.detail}")
    if unreadable:
        raise typer.Exit(2)
    raise typer.Exit(0 if all(r.status in HEALTHY_VERDICTS for r in results) else 1)


@app.command()
def sweep(
    spec: Annotated[Path, typer.Argument(help="A sweep spec, e.g. sweeps/quickstart.toml (docs/SWEEPS.md).")],
    executor: Annotated[SweepExecutor, typer.Option(help="local (this machine), slurm (submitit job arrays) or sbatch (plain sbatch of the written scripts).")] = "local",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Write jobs/<sweep>/ and register the runs; start nothing.")] = False,
    workers: Annotated[int, typer.Option(help="Local executor: runs at once; with at least that many GPUs (times ranks per run), each run gets GPUs of its own.")] = 1,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Also rerun failed, cancelled and timed-out runs (they resume from their checkpoints; interrupted and preempted runs resume anyway).")] = False,
    jobs_dir: Annotated[Path, typer.Option(help="Where SBATCH scripts and run configs go.")] = Path("jobs"),
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: print the plan (runs, skipped runs, problems) as JSON.")] = False,
) -> None:
    """Expand a sweep spec into runs, write their SBATCH scripts, run what is still needed, record every run.

    Exits 1 when a run of the sweep failed (its error is shown; --dry-run too, when the catalog holds
    failed runs of the sweep), 130 after Ctrl-C (the runs in progress checkpoint and the next
    `fp4lab sweep` resumes them), 2 on a bad spec or argument."""
    from rich.markup import escape

    from fp4lab.lab.records.catalog import Catalog, CatalogError
    from fp4lab.lab.runs.executors import SweepInterrupted, make_executor
    from fp4lab.lab.runs.slurm import SubmissionError
    from fp4lab.lab.runs.sweep import needed_runs, plan_sweep, preflight, register_runs
    from fp4lab.lab.specs.sweep_spec import SpecError

    if workers < 1:
        fail(f"sweep: --workers must be >= 1, got {workers}")
    if as_json and not dry_run:
        fail("sweep: --json prints the plan of --dry-run; add --dry-run (the runs of a sweep as JSON: fp4lab status SWEEP --json)")
    console = _console()
    try:
        runner = make_executor(executor, **({"workers": workers} if executor == "local" else {}))
        runs_catalog = Catalog(catalog)
        runs_catalog.records()  # a corrupt catalog fails here, before anything is written
        plan = plan_sweep(spec, jobs_dir, catalog, runner.check)
        problems = preflight(plan, executor)
        if problems and not dry_run:
            fail(f"sweep: {problems[0]}" + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""))
        register_runs(plan, runs_catalog, runner.records_as)
        todo, skipped = needed_runs(plan, runs_catalog, retry_failed=retry_failed)
    except (SpecError, CatalogError, ValueError) as exc:
        fail(str(exc).splitlines()[0])
    optuna = plan.spec.method == "optuna"
    if as_json:
        _print_json(_sweep_plan(plan, todo, skipped, problems, runs_catalog))
        _exit_on_failures(runs_catalog, plan)
        return
    if optuna:
        from fp4lab.lab.runs.trials import trial_counts

        counts = trial_counts(plan.spec, jobs_dir)
        console.print(f"sweep [bold]{plan.spec.name}[/] (optuna, {plan.spec.optuna.objective} {plan.spec.optuna.direction}): "
                      f"{plan.spec.optuna.n_trials} trials, study {plan.spec.optuna_storage(jobs_dir)} holds "
                      f"{', '.join(f'{n} {k.lower()}' for k, n in counts.items()) or 'none yet'}; scripts in {plan.sweep_dir}")
    else:
        skipped_text = ", ".join(f"{len(runs)} {reason}" for reason, runs in skipped.items())
        console.print(f"sweep [bold]{plan.spec.name}[/]: {len(plan.runs)} runs, {len(todo)} to run"
                      f"{', skipped: ' + skipped_text if skipped_text else ''}; scripts in {plan.sweep_dir}")
        for run in skipped.get("failed", []):
            record = runs_catalog.get(run.id)
            console.print(f"  {run.id}  {run.name}: {record['state']}: {record.get('error') or record.get('verdict') or 'no error recorded'}"
                          " (--retry-failed reruns it)", markup=False)
        for run in skipped.get("in flight", []):
            record = runs_catalog.get(run.id)
            driver = record.get("owner") or f"Slurm job {record.get('slurm_job_id')}"
            console.print(f"  {run.id}  {run.name}: in flight ({record['state']}, {driver}); left to it", markup=False)
    if dry_run or (not todo and not optuna):
        for run in todo:
            console.print(f"  {run.id}  {run.name}  {plan.sweep_dir / (run.id + '.sbatch')}")
        for script in plan.scripts if optuna else ():
            console.print(f"  {script}")
        for problem in problems if dry_run else ():
            console.print(f"  [yellow]would fail:[/] {escape(problem)}")
        _exit_on_failures(runs_catalog, plan)
        return
    if not runner.waits:
        try:
            launched = runner.launch(plan, todo, runs_catalog)
        except SubmissionError as exc:
            fail(f"sweep: Slurm submission failed: {exc} (--executor local runs it here)")
        console.print(f"submitted Slurm jobs {', '.join(launched.job_ids) or '(none: the study is complete)'}; "
                      f"follow them with: fp4lab status {plan.spec.name}")
        return

    def started(run) -> None:
        if not console.is_terminal:
            console.print(f"  {run.id}  {run.name}: started", markup=False)

    def finished(record) -> None:
        if optuna:
            console.print(f"  trial {record['extra'].get('trial')}  {record['id']}  {record['extra'].get('name')}: "
                          f"{record['state']}, {record.get('verdict')}, {plan.spec.optuna.objective} {record['extra'].get('objective')}",
                          markup=False)
            return
        line = f"  {record['id']}  {record['extra'].get('name')}: {record['state']}, {record.get('verdict')}, val {record['summary'].get('final_val_loss')}"
        console.print(line + (f": {record['error']}" if record.get("error") else ""), markup=False)

    runner.on_start, runner.on_finish = started, finished
    try:
        with _sweep_progress(console, runs_catalog, plan, [] if optuna else todo):
            launched = runner.launch(plan, todo, runs_catalog)
    except SweepInterrupted as stopped:
        console.print(f"interrupted: {len(stopped.records)} run(s) stopped; `fp4lab sweep {spec}` resumes them from their last checkpoints")
        raise typer.Exit(130) from None
    if optuna and launched.started == 0:
        console.print("the study already holds every trial; raise [optuna].n_trials to run more", markup=False)
    _print_status(runs_catalog, plan.spec.name)
    _exit_on_failures(runs_catalog, plan)


def _sweep_plan(plan, todo, skipped: dict, problems: list[str], runs_catalog) -> dict:
    """`fp4lab sweep --dry-run --json`: what a sweep of this spec would start, what it would skip and why,
    and what would make it fail. Paths of files the sweep wrote are absolute; a run's run_dir is as its config says."""
    sweep_dir = plan.sweep_dir.resolve()

    def run_entry(run) -> dict:
        return {"id": run.id, "name": run.name, "params": run.params, "run_dir": run.config.get("out_dir"),
                "config": str(sweep_dir / f"{run.id}.toml"), "script": str(sweep_dir / f"{run.id}.sbatch")}

    document = {
        "sweep": plan.spec.name, "method": plan.spec.method, "spec": str(Path(plan.spec.path).resolve()), "sweep_dir": str(sweep_dir),
        "catalog": str(runs_catalog.path), "runs": [run_entry(run) for run in todo],
        "skipped": [
            {**run_entry(run), "reason": reason, "state": record["state"], "error": record.get("error")}
            for reason, runs in skipped.items() for run in runs for record in [runs_catalog.get(run.id)]
        ],
        "scripts": [str(Path(script).resolve()) for script in plan.scripts], "problems": problems,
    }  # fmt: skip
    if plan.spec.method == "optuna":
        from fp4lab.lab.runs.trials import trial_counts

        optuna = plan.spec.optuna
        document["optuna"] = {"n_trials": optuna.n_trials, "objective": optuna.objective, "direction": optuna.direction,
                              "study": str(plan.spec.optuna_storage(plan.jobs_dir)),
                              "trials": trial_counts(plan.spec, plan.jobs_dir)}  # fmt: skip
    return document


def _exit_on_failures(runs_catalog, plan) -> None:
    from fp4lab.lab.records.catalog import FAILED_STATES

    failed = [r for r in runs_catalog.records(sweep=plan.spec.name) if r["state"] in FAILED_STATES]
    if failed:
        print(f"sweep: {len(failed)} run(s) of {plan.spec.name!r} failed; see their errors above (fp4lab status {plan.spec.name})", file=sys.stderr)
        raise typer.Exit(1)


def _sweep_progress(console, runs_catalog, plan, todo):
    """On a terminal, a live view of the sweep while it runs: runs done / running / pending, each running
    run's step, loss and time left. Elsewhere nothing (lines are printed as runs start and end)."""
    import contextlib
    import time

    if not console.is_terminal or not todo:
        return contextlib.nullcontext()
    from rich.live import Live
    from rich.table import Table

    from fp4lab.lab.runs.sweep import progress_of

    from datetime import UTC, datetime

    ids = {run.id for run in todo}
    began = time.monotonic()

    def view() -> Table:
        records = [r for r in runs_catalog.records(sweep=plan.spec.name) if r["id"] in ids]
        counts = {k: sum(r["state"] == k for r in records) for k in ("completed", "running", "submitted")}
        done = len(records) - counts["running"] - counts["submitted"] - sum(r["state"] == "pending" for r in records)
        table = Table(title=f"sweep {plan.spec.name}: {done} done, {counts['running']} running, {len(ids) - done - counts['running']} pending "
                            f"({time.monotonic() - began:.0f} s)")
        for column in ("id", "run", "step", "loss", "time left"):
            table.add_column(column)
        for record in records:
            if record["state"] != "running":
                continue
            step, loss = progress_of(record, runs_catalog)
            steps = record["config"].get("steps")
            left = ""
            if step and steps and record.get("started_at"):
                started = datetime.fromisoformat(record["started_at"].replace("Z", "+00:00"))
                elapsed = (datetime.now(UTC) - started).total_seconds()
                left = f"{elapsed / (step + 1) * (steps - step - 1):.0f} s"
            table.add_row(record["id"], record["extra"].get("name", ""), f"{step}/{steps}" if step is not None else "",
                          "" if loss is None else f"{loss:.4f}", left)
        return table

    return Live(get_renderable=view, console=console, refresh_per_second=1, transient=True)


@app.command()
def trial(
    spec: Annotated[Path, typer.Argument(help="A method = \"optuna\" sweep spec (jobs/<sweep>/spec.toml in sweep jobs).")],
    jobs_dir: Annotated[Path, typer.Option(help="The jobs folder holding the study (jobs/<sweep>/optuna.journal).")] = Path("jobs"),
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    slot: Annotated[int, typer.Option(help="This job's slot (array task): offsets the sampler seed.")] = 0,
    resume: Annotated[Optional[int], typer.Option(help="Continue this RUNNING trial number instead of asking a new one.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the trial's catalog record as JSON.")] = False,
) -> None:
    """Run one trial of an Optuna sweep: ask the study, train, tell (what each optuna sweep job runs)."""
    from fp4lab.lab.records.catalog import Catalog, CatalogError
    from fp4lab.lab.specs.sweep_spec import SpecError
    from fp4lab.lab.runs.trials import run_trial
    from fp4lab.nn.recipe import RecipeError
    from fp4lab.train.config import ConfigError

    try:
        record = run_trial(spec, jobs_dir=jobs_dir, catalog_path=catalog, slot=slot, resume=resume)
        run_dir = Catalog(catalog).resolve(record["paths"]["run_dir"])
    except (SpecError, CatalogError, ConfigError, RecipeError, ValueError) as exc:
        fail(f"trial: {str(exc).splitlines()[0]}")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = None  # stopped before its first summary: the worker log ends in progress lines
    if summary is not None:  # beside the progress lines on stderr when stdout carries the JSON record
        _print_summary_block(summary, record["paths"]["run_dir"], file=sys.stderr if as_json else None)
    if as_json:
        _print_json(record)
    else:
        print(f"trial {record['extra'].get('trial')} run {record['id']} ({record['extra'].get('name')}): {record['state']}, "
              f"{record.get('verdict')}, objective {record['extra'].get('objective')}")


@app.command()
def status(
    sweep_name: Annotated[Optional[str], typer.Argument(metavar="SWEEP", help="Only this sweep (default: all).")] = None,
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    watch: Annotated[float, typer.Option(help="Refresh every N seconds until every run has ended (0: once).")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the runs as a JSON list instead of a table.")] = False,
    rescan: Annotated[bool, typer.Option(help="First judge every ended run again from its metrics with the current scanner and record the new verdicts and events (a run otherwise keeps the verdict it ended with).")] = False,
) -> None:
    """A table of the runs in the catalog: state, step, loss, verdict (refreshed from their run folders)."""
    from fp4lab.lab.records.catalog import Catalog, CatalogError

    if as_json and watch > 0:
        fail("status: --json prints the runs once; drop --watch")
    if not catalog.exists():
        fail(f"status: no catalog at {str(catalog)!r}; run fp4lab sweep SPEC first (or pass --catalog)")
    try:
        runs_catalog = Catalog(catalog)
        if rescan:
            from fp4lab.lab.records.logscan import ScanThresholds
            from fp4lab.lab.runs.sweep import rescan as rescan_runs

            changed = rescan_runs(runs_catalog, ScanThresholds(), sweep_name)
            print(f"rescanned: {changed} verdict(s) or event list(s) changed", file=sys.stderr)
        if as_json:
            _print_json(_status_rows(runs_catalog, sweep_name))
        else:
            _print_status(runs_catalog, sweep_name, watch=watch)
    except CatalogError as exc:
        fail(str(exc).splitlines()[0])


def _status_rows(runs_catalog, sweep_name: str | None) -> list[dict]:
    """The runs of `sweep_name` (all sweeps but ratchets when None), refreshed from their run folders
    and the scheduler: one dict per run, what `fp4lab status` shows."""
    from fp4lab.lab.records.catalog import TERMINAL_STATES
    from fp4lab.lab.records.logscan import ScanThresholds
    from fp4lab.lab.runs.sweep import progress_of, refresh

    if sweep_name is not None and not runs_catalog.records(sweep=sweep_name):
        known = sorted({r["sweep"] for r in runs_catalog.records(per_sweep=True) if r["sweep"]})
        fail(f"status: no sweep {sweep_name!r} in {runs_catalog.path} (sweeps: {', '.join(known) or 'none'})")
    refresh(runs_catalog, ScanThresholds(), sweep_name)
    records = runs_catalog.records(sweep=sweep_name, per_sweep=True)
    if sweep_name is None:  # ratchet iterations have their own view: fp4lab report --ratchet TAG
        records = [r for r in records if not (r["sweep"] or "").startswith("ratchet/")]
    rows = []
    for record in records:
        step, loss = progress_of(record, runs_catalog)
        if record["state"] in TERMINAL_STATES and record["summary"]:  # as the report shows it: the last finite loss
            loss = record["summary"].get("final_train_loss")
        rows.append({
            "sweep": record["sweep"], "id": record["id"], "name": record["extra"].get("name"), "state": record["state"],
            "step": step, "loss": loss, "val_loss": record["summary"].get("final_val_loss"), "verdict": record["verdict"],
            "error": record.get("error"), "slurm_job_id": record["slurm_job_id"], "slurm_array_index": record["slurm_array_index"],
            "run_dir": (record.get("paths") or {}).get("run_dir"),
        })  # fmt: skip
    return rows


def _print_status(runs_catalog, sweep_name: str | None, watch: float = 0.0) -> None:
    import time

    from rich.live import Live
    from rich.table import Table

    def table() -> tuple[Table, bool]:
        rows = _status_rows(runs_catalog, sweep_name)
        view = Table(title=f"runs{' of ' + sweep_name if sweep_name else ''} ({runs_catalog.path})")
        for column in ("sweep", "id", "run", "state", "step", "loss", "val loss", "verdict", "job"):
            view.add_column(column, no_wrap=column not in ("run", "verdict"))
        for row in rows:
            verdict = row["verdict"] or ""
            if row["error"]:
                verdict = f"{verdict + ': ' if verdict else ''}{row['error']}"
            loss, val = row["loss"], row["val_loss"]
            view.add_row(
                row["sweep"] or "", row["id"], row["name"] or "", row["state"],
                "" if row["step"] is None else str(row["step"]), "" if loss is None else f"{loss:.4f}",
                "" if val is None else f"{val:.4f}", verdict,
                str(row["slurm_job_id"] or "") + ("" if row["slurm_array_index"] is None else f"_{row['slurm_array_index']}"),
            )
        active = any(r["state"] in ("pending", "submitted", "running") for r in rows)
        return view, active

    console = _console()
    view, active = table()
    if watch <= 0 or not active:
        console.print(view)
        return
    with Live(view, console=console, refresh_per_second=1) as live:
        while active:
            time.sleep(watch)
            view, active = table()
            live.update(view)


@app.command()
def report(
    sweep_name: Annotated[Optional[str], typer.Argument(metavar="SWEEP", help="Only this sweep (default: all).")] = None,
    out: Annotated[Optional[Path], typer.Option(help="Output folder (default: reports/<SWEEP or all>/, reports/ratchet-<TAG>/).")] = None,
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    ratchet: Annotated[Optional[str], typer.Option(help="Report a ratchet run instead: its TAG (metric vs iteration).")] = None,
    claims: Annotated[Optional[Path], typer.Option(help="A TOML file of papers' claims (recipe, excess_pct or direction, versus, metric, source) to set against the ledger: claims.csv and a section of ledger.md.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the ledger rows and the files written as JSON instead of the table.")] = False,
) -> None:
    """The recipe ledger of a sweep (seeds grouped, loss excess vs bf16) as CSV, Markdown and HTML with plots."""
    from fp4lab.lab.records.report import build_report, ratchet_report, render_ledger, write_report

    console = _console()
    if ratchet is not None:
        if sweep_name is not None or claims is not None:
            fail("report: --ratchet TAG reports a ratchet run; drop the SWEEP and --claims")
        try:
            table, written = ratchet_report(catalog, ratchet, out)
        except (ValueError, OSError) as exc:
            fail(str(exc).splitlines()[0])
        if as_json:
            import pandas as pd

            rows = json.loads(pd.read_csv(written["csv"]).to_json(orient="records"))  # iterations.csv, as written
            _print_json({"ratchet": ratchet, "catalog": str(catalog), "rows": rows, "written": written})
            return
        console.print(table)
        for path in written.values():
            console.print(f"wrote {path}")
        return
    try:
        checked = None
        if claims is not None:
            from fp4lab.lab.records.claims import load_claims

            checked = load_claims(claims)  # a malformed file is refused before anything is written
        built = build_report(catalog, sweep=sweep_name, out_dir=out)
        if checked is not None:
            from fp4lab.lab.records.claims import attach_claims

            attach_claims(built, checked)
        written = write_report(built, out)
    except (ValueError, OSError) as exc:
        fail(str(exc).splitlines()[0])
    if as_json:  # the ledger as in ledger.csv; a value with no data (no bf16 reference, one seed) is null
        rows = json.loads(built.ledger.to_json(orient="records"))
        document = {"sweep": sweep_name, "catalog": str(catalog), "notes": built.notes, "rows": rows, "written": written}
        if built.claims is not None:
            document["claims"] = json.loads(built.claims.to_json(orient="records"))
        _print_json(document)
        return
    console.print(render_ledger(built))
    if built.claims is not None:
        from fp4lab.lab.records.claims import render_claims

        console.print(render_claims(built.claims))
    for path in written.values():
        console.print(f"wrote {path}")


@app.command()
def ratchet(
    program: Annotated[Optional[Path], typer.Argument(help="The goal, metric, budget, health rules and search space (default: program.md).")] = None,
    program_option: Annotated[Optional[Path], typer.Option("--program", hidden=True, help="Deprecated: pass PROGRAM as the argument.")] = None,
    iterations: Annotated[Optional[int], typer.Option(help="Proposals to decide in all for this tag (default: [stop].iterations).")] = None,
    tag: Annotated[Optional[str], typer.Option(help="Names the branch ratchet/<TAG> and its state; the same tag resumes (default: program file name).")] = None,
    agent: Annotated[Proposer, typer.Option(help="Proposer: optuna (TPE, no network), llm (OpenAI-compatible endpoint) or command (an executable).")] = "optuna",
    command: Annotated[Optional[str], typer.Option(help="--agent command: the executable and its arguments (split like a shell, never run by one).")] = None,
    base_url: Annotated[Optional[str], typer.Option(help="--agent llm: endpoint (default $FP4LAB_LLM_BASE_URL, $OPENAI_BASE_URL, http://127.0.0.1:8000/v1).")] = None,
    model: Annotated[Optional[str], typer.Option(help="--agent llm: model name (default $FP4LAB_LLM_MODEL). The key comes from $FP4LAB_LLM_API_KEY or $OPENAI_API_KEY only.")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="--agent llm/command: seconds per proposal (default 60 / 300).")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the optuna sampler and the paired bootstrap.")] = 0,
    executor: Annotated[RatchetExecutor, typer.Option(help="local (this machine) or slurm (each experiment a submitit job, as the program's [slurm] table asks).")] = "local",
    workers: Annotated[int, typer.Option(help="Proposals in flight at once, each in its own worktree.")] = 1,
    catalog: Annotated[Path, typer.Option(help="The results catalog (one record per iteration, sweep ratchet/<TAG>).")] = Path("sweep_catalog.json"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the final summary as JSON (the iterations go to stderr).")] = False,
) -> None:
    """Propose a change, run a capped experiment, keep it (git commit) only if the metric strictly improves
    and the run is healthy, otherwise revert; every iteration recorded. Works in its own git worktree.

    PROGRAM (default program.md) holds the goal in prose and a ```toml ratchet``` block: [run], [edit],
    [search_space], [health], [noise], [stop] and [slurm] (docs/RATCHET.md)."""
    from fp4lab.lab.records.catalog import CatalogError
    from fp4lab.lab.specs.program import ProgramError, load_program
    from fp4lab.lab.ratchet.loop import Ratchet, RatchetError
    from fp4lab.lab.repo import GitError

    if program is not None and program_option is not None:
        fail(f"ratchet: two programs given, {str(program)!r} and --program {str(program_option)!r}; pass one, as the argument")
    program = program or program_option or Path("program.md")  # `--program PATH`: the old spelling, still accepted
    if iterations is not None and iterations < 1:
        fail(f"ratchet: --iterations must be >= 1, got {iterations}")
    options = {k: v for k, v in {"base_url": base_url, "model": model, "command": command, "timeout_s": timeout}.items() if v is not None}
    console = _console()
    view = _RatchetView(_console(stderr=True) if as_json else console)
    try:
        loaded = load_program(program)
        loop = Ratchet(loaded, tag=tag or program.stem, proposer=agent, catalog=catalog, seed=seed,
                       proposer_options=options, executor=executor, workers=workers, on_event=view.event)
        with view:
            summary = loop.run(iterations)
    except (ProgramError, RatchetError, GitError, CatalogError, ValueError) as exc:
        fail(f"ratchet: {str(exc).splitlines()[0]}")
    if program_option is not None:  # said once it worked, so that an error stays one line
        print(f"fp4lab: note: ratchet --program is deprecated; pass the program as the argument: fp4lab ratchet {program}",
              file=sys.stderr)
    if as_json:
        _print_json(summary)
        return
    console.print(
        f"ratchet [bold]{summary['tag']}[/]: stopped after {summary['reason']}; baseline {_fmt(summary['baseline'])} "
        f"(sigma {_fmt(summary['sigma'])}), best {_fmt(summary['best'])}; kept iterations "
        f"{', '.join(map(str, summary['kept'])) or 'none'} on branch {summary['branch']} ({summary['worktree']}); "
        f"table {summary['results']}; plot: fp4lab report --ratchet {summary['tag']}"
    )


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.6g}"


class _RatchetView:
    """The ratchet's live view: a table of decided iterations under a line for the one running."""

    STYLE = {"keep": "bold green", "discard": "yellow", "crash": "red", "invalid": "red", "duplicate": "dim", "stale": "dim",
             "baseline": "cyan"}

    def __init__(self, console) -> None:
        self.console, self.rows, self.running, self.live = console, [], {}, None

    def __enter__(self):
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def event(self, kind: str, data: dict) -> None:
        if kind == "note":
            self.console.print(data["message"], style="dim", markup=False)
        elif kind == "start":
            proposal = data["proposal"]
            what = "baseline (unchanged tree)" if proposal is None else _describe_proposal(proposal.kind, proposal.params, proposal.rationale)
            self.running[data["iteration"]] = f"iteration {data['iteration']}: {what}"
            if self.live is None:
                self.console.print(f"running {self.running[data['iteration']]}", markup=False)
        elif kind == "decided":
            extra = data["extra"]
            proposal = extra.get("proposal") or {}
            what = ("baseline" if extra["iteration"] == 0 else proposal.get("error") or
                    _describe_proposal(proposal.get("kind"), proposal.get("params") or {}, proposal.get("rationale") or ""))
            self.rows.append((extra["iteration"], what, extra.get("metric"), extra.get("best_before"), extra["decision"], extra.get("note") or ""))
            self.running.pop(extra["iteration"], None)
            if self.live is None:
                self.console.print(f"iteration {extra['iteration']}: {extra['decision']}  metric {_fmt(extra.get('metric'))}  "
                                   f"best before {_fmt(extra.get('best_before'))}  {what}  {extra.get('note') or ''}".rstrip(), markup=False)
        if self.live is not None:
            self.live.update(self._render())

    def _render(self):
        from rich.console import Group
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="fp4lab ratchet", expand=False)
        for column in ("iter", "proposal", "metric", "best before", "decision", "note"):
            table.add_column(column, overflow="fold")
        for number, what, metric, best, decision, note in self.rows[-30:]:
            style = self.STYLE.get(decision, "")
            table.add_row(str(number), escape(what[:70]), _fmt(metric), _fmt(best), f"[{style}]{decision}[/]" if style else decision,
                          escape(note[:50]))
        return Group(table, *(f"[bold]running[/] {escape(line)}" for _, line in sorted(self.running.items())))


def _describe_proposal(kind, params: dict, rationale: str) -> str:
    if kind == "params":
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
    return f"diff: {rationale}" if rationale else "diff"


recipes_app = typer.Typer(cls=_Commands, help="List the FP4 recipes and show a recipe's per-operand ledger.", no_args_is_help=False)
app.add_typer(recipes_app, name="recipes")


@recipes_app.callback(invoke_without_command=True)
def recipes(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the recipes as a JSON list instead of a table.")] = False,
) -> None:
    """List the built-in recipes (`fp4lab recipes show NAME` prints one)."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    from fp4lab.nn.recipe import list_recipes, load_recipe

    recipes = [load_recipe(name) for name in list_recipes()]
    if as_json:
        _print_json([{"name": r.name, "description": r.description, "source": r.source} for r in recipes])
        return
    table = Table(title="FP4 recipes (fp4lab/recipes/*.toml)")
    for name in ("name", "description", "source"):
        table.add_column(name, overflow="fold")
    for recipe in recipes:
        table.add_row(recipe.name, recipe.description, recipe.source)
    _console().print(table)


@recipes_app.command("show")
def recipes_show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="A built-in recipe name or a path to a recipe .toml file.")],
    layers: Annotated[int, typer.Option(help="Model depth to resolve block overrides for (default: the tiny preset's, what `fp4lab train` uses on a CPU).")] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print the resolved recipe as JSON instead of tables.")] = False,
) -> None:
    """Print the resolved per-operand ledger of a recipe: every GEMM operand of every block group."""
    from dataclasses import asdict

    from rich.table import Table

    from fp4lab.nn.recipe import GEMMS, OPERANDS, RecipeError, load_recipe

    if layers <= 0:
        fail(f"recipes show: --layers must be positive, got {layers}")
    try:
        recipe = load_recipe(name)
    except RecipeError as exc:
        fail(str(exc))
    if as_json or (ctx.parent is not None and ctx.parent.params.get("as_json")):  # `recipes --json show NAME` too
        _print_json({
            "name": recipe.name, "description": recipe.description, "source": recipe.source, "path": recipe.path,
            "layers": layers, "gemms": GEMMS,
            "ledger": [{"blocks": blocks, "operands": {o: asdict(linear.operand(o)) for o in OPERANDS}}
                       for blocks, linear in recipe.ledger(layers)],
            "head": recipe.head, "embedding": recipe.embedding, "lora_svd_rank": recipe.lora_svd_rank,
            "lora_svd_every": recipe.lora_svd_every, "attention": asdict(recipe.attention), "optimizer": asdict(recipe.optimizer),
        })  # fmt: skip
        return
    table = Table(title=f"{recipe.name}: {recipe.description}", caption=f"source: {recipe.source}; {layers} blocks")
    for column in ("blocks", "GEMM", "operand", "format", "scale", "rounding", "transform", "2D tile"):
        table.add_column(column, no_wrap=True)
    for blocks, linear in recipe.ledger(layers):
        first = True
        uniform = len({linear.operand(o) for o in OPERANDS}) == 1
        rows = [("all", "all", OPERANDS[0])] if uniform else [
            (gemm, operand.split("_", 1)[1], operand) for gemm, operands in GEMMS.items() for operand in operands
        ]
        for gemm, label, operand in rows:
            spec = linear.operand(operand)
            scale = "-"
            if spec.is_fp4:
                scale = (spec.scale_mode or "e4m3") + (" adaptive" if spec.adaptive else "")
            if spec.format == "nvfp4_cta":
                scale += f" cta{spec.cta_tile or 128}"
            if spec.format == "fp8":
                scale = f"per {spec.scaling}" + (" pow2" if spec.pow2_scale else "")
            table.add_row(
                blocks if first else "", gemm, label, f"fp8 {spec.element}" if spec.format == "fp8" else spec.format,
                scale, spec.rounding if spec.is_quantized else "-", spec.transform,
                "x".join(map(str, spec.tile)) if spec.tile else "-",
            )
            first = False
        table.add_section()
    console = _console()
    console.print(table)
    opt = recipe.optimizer
    console.print(
        f"model: head {recipe.head}, embedding {recipe.embedding}, LoRA-SVD rank {recipe.lora_svd_rank}"
        + (f" (re-aligned every {recipe.lora_svd_every} steps)" if recipe.lora_svd_rank else "")
        + f"; attention: {recipe.attention.format}"
        + (f" (dS rounding {recipe.attention.ds_rounding})" if recipe.attention.format != "bf16" else "")
        + f"\noptimizer: {opt.name or '(from the train config)'}, QK-Clip {opt.qk_clip}"
        + (f" tau={opt.qk_clip_tau:g}" if opt.qk_clip == "kimi" else "")
        + (f" alpha={opt.update_cap_alpha:g} (Q/K {opt.update_cap_alpha_qk:g})" if opt.qk_clip == "update_cap" else "")
        + f", Newton-Schulz {opt.ns_polynomial} in {opt.ns_format}, AdamW v in {opt.adam_v_format}"
    )


data_app = typer.Typer(cls=_Commands, help="Build the training corpora that are made once (the embedded Shakespeare builds itself).", no_args_is_help=True)
app.add_typer(data_app, name="data")


@data_app.command("build")
def data_build(
    name: Annotated[Corpus, typer.Argument(help="The corpus to build.")],
    bundle: Annotated[Optional[Path], typer.Option("--from", help="Unpack a bundle made by `fp4lab data pack` instead of building (no network); every file must match the bundle's manifest.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Build again even if the corpus is already built.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the corpus's manifest as JSON instead of a summary.")] = False,
) -> None:
    """Build a corpus into $FP4LAB_CACHE (default ~/.cache/fp4lab): pycode downloads 21 pinned sdists
    from PyPI (157 MB), keeps their .py files, trains a 32768-token BPE and tokenizes (~3 minutes on
    2 cores). Training configs then name it as data source ("pycode")."""
    from fp4lab.train import pycode
    from fp4lab.train.data import cache_dir, status_line

    cache = cache_dir()
    try:
        if bundle is None and not force and (pycode.corpus_dir(cache) / "manifest.json").is_file():
            manifest = pycode.load(cache)[3]
        else:
            with status_line(not as_json) as status:
                manifest = pycode.unpack(cache, bundle, status=status) if bundle else pycode.build(cache, status=status)
    except pycode.CorpusError as exc:
        fail(str(exc))
    _print_corpus(name, pycode.corpus_dir(cache), manifest, as_json)


@data_app.command("pack")
def data_pack(
    name: Annotated[Corpus, typer.Argument(help="The built corpus to pack.")],
    folder: Annotated[Path, typer.Argument(help="Where the bundle goes (created if missing; its files of the same names are replaced).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the corpus's manifest as JSON instead of a summary.")] = False,
) -> None:
    """Write a built corpus as a portable bundle (its manifest, tokenizer and xz-compressed token
    files: 34 MB for pycode), for a machine without network access: `fp4lab data build NAME --from
    FOLDER` there."""
    from fp4lab.train import pycode
    from fp4lab.train.data import cache_dir, status_line

    try:
        with status_line(not as_json) as status:
            manifest = pycode.pack(cache_dir(), folder, status=status)
    except pycode.CorpusError as exc:
        fail(str(exc))
    _print_corpus(name, folder, manifest, as_json)


def _print_corpus(name: str, folder: Path, manifest: dict, as_json: bool) -> None:
    if as_json:
        _print_json({"path": str(folder), **manifest})
        return
    files = manifest["files"]
    _console().print(
        f"{name}: {files['train.bin']['tokens']:,} training and {files['val.bin']['tokens']:,} validation tokens "
        f"({manifest['documents']['train']:,} + {manifest['documents']['val']:,} documents from "
        f"{len(manifest['packages'])} packages), vocabulary {manifest['vocab_size']}\nin {folder}",
        highlight=False,
    )


def _console(stderr: bool = False):
    """A rich console on stdout (or stderr); when output is piped, wide enough that tables do not truncate."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr) if stream.isatty() else Console(stderr=stderr, width=140)


def _synthesize(dist: str, shape: str, seed: int):
    from fp4lab.numerics.survey import synthesize

    rows, cols = _parse_shape(shape, "numerics: --shape")
    return synthesize(dist, rows, cols, seed), f"--dist {dist}"


def _load_tensor(path: Path, key: str | None):
    import pickle

    import torch

    if not path.is_file():
        fail(f"numerics: --tensor {str(path)!r} is not a file")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, EOFError, RuntimeError, OSError) as exc:  # what torch.load raises for a file it cannot read
        fail(f"numerics: --tensor {str(path)!r} is not a loadable torch file ({type(exc).__name__}: {exc})".split("\n")[0])
    if isinstance(obj, dict):
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if key is None:
            fail(f"numerics: {str(path)!r} holds a dict; pick a tensor with --key (one of: {', '.join(list(tensors)[:8])})")
        if key not in tensors:
            fail(f"numerics: --key {key!r} is not a tensor in {str(path)!r}; tensors: {', '.join(list(tensors)[:8])}")
        obj = tensors[key]
    elif key is not None:
        fail(f"numerics: --key was given but {str(path)!r} holds a single tensor")
    if not isinstance(obj, torch.Tensor) or not obj.is_floating_point() or obj.dim() == 0:
        fail(f"numerics: {str(path)!r} must hold a floating-point tensor with at least one dim")
    if obj.shape[-1] % 32:
        fail(f"numerics: the last dim of the tensor ({obj.shape[-1]}) must be a multiple of 32 (the MXFP4 block)")
    label = f"{path.name}" + (f"[{key}]" if key else "")
    return obj.detach().to(torch.float32), label


def _choice_error(exc) -> str | None:
    """A value outside an option's choices, in fp4lab's words (the command, the option, the value, the
    allowed values): `sweep: --executor 'cloud' is not supported; allowed: local, slurm, sbatch`.
    None for any other usage error, which keeps typer's message."""
    param = getattr(exc, "param", None)
    choices = getattr(getattr(param, "type_descriptor", None), "choices", None)
    found = re.match(r"(?:Value error, )?(.+) is not one of ", str(getattr(exc, "message", "")))
    if not choices or found is None:
        return None
    name = param.opts[0] if param.opts and param.opts[0].startswith("-") else param.name.upper()
    names, ctx = [], exc.ctx
    while ctx is not None and ctx.parent is not None:  # the command's names under the root: "recipes show"
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    command = " ".join(names)
    return f"{command + ': ' if command else ''}{name} {found.group(1)} is not supported; allowed: {', '.join(map(str, choices))}"


def main() -> None:
    """Console entry point: one-line errors and exit code 2 for every usage or input mistake."""
    from typer.exceptions import TyperException

    try:
        code = app(standalone_mode=False, prog_name="fp4lab")
    except UserError as exc:
        print(f"fp4lab: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except TyperException as exc:  # usage errors: unknown option, bad value, missing argument
        message = exc.format_message()
        if not message:  # bare `fp4lab` (or a bare group): the help it printed is the whole answer
            sys.exit(0)
        print(f"fp4lab: error: {_choice_error(exc) or message}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("fp4lab: aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
