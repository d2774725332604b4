"""TrainConfig and DataConfig: everything that defines one training run, validated, serializable to
JSON/TOML. Torch-free: the orchestrator validates run configs without importing torch."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fp4lab.nn.model_config import PRESETS
from fp4lab.nn.recipe import NS_POLYNOMIALS
from fp4lab.train.pruning import check_trial_link
from fp4lab.validation import Checks, read_toml

MODEL_PRESETS = tuple(PRESETS)
OPTIMIZERS = ("muon", "adamw")
LR_SCHEDULES = ("cosine", "constant", "wsd")
QK_CLIPS = ("none", "kimi", "update_cap")
LR_SCALINGS = ("original", "moonlight")
DEVICES = ("cpu", "cuda", "auto")
# "reference": fp32 activations and fp32 GEMMs on decoded operands (the exact emulation CI checks).
# "fast": bf16 activations (autocast), GEMMs on bf16 tensor cores with fp32 accumulation and the
# outer scales in the epilogue, fused optimizers. "auto": fast on CUDA, reference on the CPU.
COMPUTES = ("auto", "reference", "fast")
# torch.compile of the forward and loss ("auto": on CUDA only); it changes only summation order.
COMPILES = ("auto", "on", "off")
# Replay each step's forward and backward from a CUDA graph ("auto": on the fast path on CUDA when
# nothing on the path draws from a torch.Generator); it changes nothing but the launch cost.
CUDA_GRAPHS = ("auto", "on", "off")
# Attention (unquantized) on the fast path: the Triton flash attention whose online softmax also yields
# each head's max logit and entropy (fp4lab.numerics.kernels.attention: probes and QK-Clip cost nothing), or
# PyTorch's SDPA beside the chunked fp32 probes. "auto": triton on CUDA where Triton is installed.
# Summation order is all that changes. FP4 attention (fullstack) keeps its own path either way.
ATTENTION_KERNELS = ("auto", "triton", "sdpa")
# MXFP4 x MXFP4 GEMMs on the fast path: FP8 tensor cores with each 32-block's partial sum promoted
# to fp32 and scaled there (fp4lab.numerics.kernels.mx_gemm), or the decoded values on bf16 tensor
# cores. "auto": bf16, the faster of the two wherever measured (on an H200 the FP8 kernel runs at about
# 0.2x of cuBLAS's bf16 rate: docs/BENCHMARKS.md); "fp8" is opt-in. Both are exact products;
# summation order is all that changes.
MX_GEMMS = ("auto", "fp8", "bf16")
# Format-aware producer fusion (fp4lab.nn.fp4_linear.FP4Linear.swiglu): "on" fuses each feed-forward's
# SwiGLU into its W2's GEMMs: the forward writes W2's quantized x operands straight from gate and up
# (h never reaches memory), the backward makes d_gate and d_up from Dgrad's dh in one pass. The same
# bits as "off" without torch.compile (stochastic rounding included: the same Philox seeds); compiled,
# the unfused SiLU is Inductor's, whose exp may round a rare element differently. Off by default until
# its step-time gain is measured on a GPU (docs/BENCHMARKS.md). "all" also fuses the residual add and
# RMSNorm before each feed-forward into its W1's and W3's x operands (FP4Linear.residual_rmsnorm),
# where those are deterministic (shared by W1 and W3): the norm's sum of squares then runs in a fixed
# order, so the normed activations are within a few ulps of nn.RMSNorm's, not the same bits.
PRODUCER_FUSIONS = ("off", "on", "all")
# "gate-up": each FP4 feed-forward makes gate and up again in its backward instead of keeping them.
RECOMPUTES = ("off", "gate-up")
# Parallelism over torchrun's processes (fp4lab.train.distributed): none, DistributedDataParallel,
# FSDP2, FSDP2 sharded within a node and replicated across nodes, or pipeline stages of transformer
# blocks (fp4lab.train.pipeline). Not result-neutral: the gradient all-reduce sums in another order,
# and SR ranks draw their own random bits.
PARALLELS = ("none", "ddp", "fsdp", "hsdp", "pp")
# parallel='pp': the microbatches each global batch is cut into by default (DualPipeV needs at least as
# many as stages, 2 per rank: 4 suits 2 ranks).
PP_MICROBATCHES = 4
# What FSDP2's weight all-gathers move: the fp32 (param dtype) rows, or where it is exact, the FP4
# encoding the GEMMs consume (fp4lab.train.encoded_gather). Result-neutral: the same bits either way.
GATHER_WEIGHTS = ("dense", "encoded")
# DataConfig.token_dtype: the id width of .bin token files (fp4lab.train.data reads them little-endian).
TOKEN_DTYPES = ("uint16", "uint32")
# Experiment trackers a run can also log to (fp4lab.train.trackers); metrics.jsonl is always written.
TRACKERS = ("tensorboard", "wandb", "mlflow")
# The corpus fp4lab.train.pycode builds once into the cache (`fp4lab data build pycode`), then a
# DataConfig.source by that name; CORPORA: the built-in corpora `fp4lab data build` makes (and `fp4lab
# data pack` packs). Any other name it builds is a corpus of your own (fp4lab.train.user_corpus).
PYCODE = "pycode"
CORPORA = (PYCODE,)
# The DataConfig.source names fp4lab knows; any other source is a path to a .bin token file or the name
# of a corpus of your own (fp4lab.train.user_corpus), which CORPUS_NAME matches: lowercase letters,
# digits, "-" and "_", first a letter. With no "." or "/" it never reads as a path.
BUILTIN_SOURCES = ("shakespeare", "synthetic", PYCODE)
CORPUS_NAME = re.compile(r"[a-z][a-z0-9_-]{0,63}")
# `fp4lab export` (fp4lab.train.export): the checkpoint formats it writes, and the dtypes it stores the
# master weights in ("float32" keeps them bit for bit; "bfloat16" rounds each one, halving the files).
EXPORT_FORMATS = ("hf",)
EXPORT_DTYPES = ("float32", "bfloat16")
# A run's summary.json "status": it ended as designed (its steps done, a NaN, or its Optuna trial pruned),
# or it stopped early with a checkpoint to resume from (time budget, Slurm's preemption signals, Ctrl-C, a `stop_after` call).
ENDED_STATUSES = ("completed", "diverged", "pruned")
STOPPED_STATUSES = ("time_limit", "preempted", "stopped", "interrupted")
# summary.json keys under their earlier names, still read from runs written before the rename.
RENAMED_SUMMARY_KEYS = {"final_loss": "final_train_loss", "best_loss": "best_train_loss"}


def corpus_name_problem(name: str) -> str | None:
    """Why `name` cannot name a corpus of your own; None when it can."""
    if name in BUILTIN_SOURCES:
        return f"{name!r} is a built-in data source; choose another name"
    if not CORPUS_NAME.fullmatch(name):
        return (f"{name!r} is not a corpus name: use up to 64 lowercase letters, digits, '-' and '_', "
                "starting with a letter (no '.' or '/': those make a path)")
    return None


def is_corpus_name(source: object) -> bool:
    """Whether a DataConfig.source names a corpus of your own (built with `fp4lab data build NAME`)."""
    return isinstance(source, str) and corpus_name_problem(source) is None


def summary_value(summary: dict[str, Any], key: str) -> Any:
    """summary[key] of a run's summary.json, also from a summary written under the earlier names."""
    key = RENAMED_SUMMARY_KEYS.get(key, key)
    if key in summary:
        return summary[key]
    return next((summary[old] for old, new in RENAMED_SUMMARY_KEYS.items() if new == key and old in summary), None)
# The one list of fields that do not change what a run computes: where it writes, how long a segment
# may take, how often it checkpoints, and the device and launch mechanics. A resumed run may change
# them; a sweep's run id leaves them out; the report groups runs regardless of them.
# Capturing GEMM operands only copies tensors a step already made (fp4lab.train.capture).
RESULT_NEUTRAL = (
    "out_dir", "device", "max_minutes", "checkpoint_every", "compile", "cuda_graphs", "capture_steps", "capture_layers",
    "gather_weights", "attention_kernel", "mx_gemm", "producer_fusion", "recompute", "log_to", "tracker_group", "tracker_run",
    "optuna_trial",
)

# Fields added after catalogs already held runs, with the value every earlier run had: a run id leaves
# such a field out while it holds that value, so the runs a catalog already has keep their ids and are
# not trained again; any other value changes what the run computes and enters the id.
HASHED_UNLESS_DEFAULT = {"parallel": "none", "pp_microbatches": PP_MICROBATCHES}


def toml_text(table: dict[str, Any], comments: Iterable[str] = ()) -> str:
    """`table` as TOML under `# comment` lines, the one TOML writer (tomli_w: tables, arrays, nan and
    inf, escapes all as the spec says). None values are left out: TOML has no null."""
    import tomli_w

    def present(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: present(v) for k, v in value.items() if v is not None}
        return value

    head = "".join(f"# {line}\n" for line in comments)
    return head + tomli_w.dumps(present(table))


class ConfigError(ValueError):
    """A config value that does not validate; the message names the field and the allowed values."""


class CheckpointMismatch(ConfigError):
    """The run folder's checkpoint belongs to a different run: resuming it would not continue that run.
    Starting afresh (deleting the checkpoint) or training into another out_dir are the ways out."""


@dataclass
class DataConfig:
    """What to train on.

    source: "shakespeare", "synthetic", "pycode" (built once: `fp4lab data build pycode`), the name of a
        corpus of your own (built once: `fp4lab data build NAME --text ... --tokenizer ...`), or a path
        to a .bin token file.
    val_source: a .bin validation file (only with a .bin source); without it the last `val_fraction`
        of the source is held out.
    token_dtype: "uint16" or "uint32", the id width of .bin files.
    vocab_size: the model's vocabulary. Shakespeare: the BPE size (default 4096, 257..65536); pycode
        and your own corpora: their tokenizer's (pycode 32768), leave it unset;
        synthetic: default 256; .bin: default max id + 1 over train and val, which is smaller than the
        tokenizer's vocabulary when its top ids never occur, so pass it when you know it.
    seed: generates the synthetic task (the loop may pass it to BatchSampler too).
    """

    source: str = "shakespeare"
    val_source: str | None = None
    token_dtype: str = "uint16"
    vocab_size: int | None = None
    val_fraction: float = 0.1
    seed: int = 0


@dataclass
class TrainConfig:
    """One training run. `None` for optimizer / ns_polynomial / qk_clip / qk_clip_tau means: what the recipe says."""

    recipe: str = "bf16"
    model: str = "tiny"
    data: DataConfig = field(default_factory=DataConfig)
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 200
    max_minutes: float | None = None
    optimizer: str | None = None
    lr: float = 0.02
    adam_lr: float = 1e-2
    weight_decay: float = 0.0
    lr_scaling: str = "original"
    warmup_steps: int = 20
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    ns_steps: int = 5
    ns_polynomial: str | None = None
    qk_clip: str | None = None
    qk_clip_tau: float | None = None
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 8
    probe_every: int = 25
    checkpoint_every: int = 50
    out_dir: str = "runs/default"
    device: str = "auto"  # the GPU when there is one
    compute: str = "auto"
    compile: str = "auto"
    cuda_graphs: str = "auto"
    attention_kernel: str = "auto"
    mx_gemm: str = "auto"
    producer_fusion: str = "off"
    recompute: str = "off"
    parallel: str = "none"
    gather_weights: str = "dense"
    # parallel='pp': the microbatches each global batch is cut into (batch_size must split into them).
    # Not result-neutral,
    # as `parallel` is not: round-to-nearest recipes whose scales are per block of a row change only
    # by the summation order of the accumulated gradients, but a per-tensor scale (NVFP4's) is the
    # amax of the rows one GEMM sees, and SR draws per GEMM call.
    pp_microbatches: int = PP_MICROBATCHES
    # Save the real operands of the GEMMs (x, W, dY) of the FP4 linears whose names match one of the
    # fnmatch patterns `capture_layers`, at the steps `capture_steps`, for `fp4lab numerics --capture`.
    capture_steps: list[int] = field(default_factory=list)
    capture_layers: list[str] = field(default_factory=list)
    # Trackers the metrics also go to (TRACKERS), and how they file the run: the group is a W&B group,
    # an MLflow experiment and a TensorBoard folder (a sweep sets its name), the run is the tracker
    # run's name (a sweep sets the run id; default: the run folder's name).
    log_to: list[str] = field(default_factory=list)
    tracker_group: str | None = None
    tracker_run: str | None = None
    # The Optuna trial this run is (an Optuna sweep or the ratchet sets it): the run reports its
    # validation loss to the trial at each eval and stops as "pruned" when the pruner says so
    # (fp4lab.train.pruning). {storage = journal file, study, trial = number, pruner = settings}.
    optuna_trial: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.data, dict):
            self.data = _data_config(self.data)
        _check.choice("model", self.model, MODEL_PRESETS)
        _check.choice("optimizer", self.optimizer, OPTIMIZERS, optional=True)
        _check.choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        _check.choice("qk_clip", self.qk_clip, QK_CLIPS, optional=True)
        _check.choice("ns_polynomial", self.ns_polynomial, NS_POLYNOMIALS, optional=True)
        _check.choice("lr_scaling", self.lr_scaling, LR_SCALINGS)
        _check.choice("device", self.device, DEVICES)
        _check.choice("compute", self.compute, COMPUTES)
        _check.choice("compile", self.compile, COMPILES)
        _check.choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPHS)
        _check.choice("attention_kernel", self.attention_kernel, ATTENTION_KERNELS)
        _check.choice("mx_gemm", self.mx_gemm, MX_GEMMS)
        _check.choice("producer_fusion", self.producer_fusion, PRODUCER_FUSIONS)
        _check.choice("recompute", self.recompute, RECOMPUTES)
        _check.choice("parallel", self.parallel, PARALLELS)
        _check.choice("gather_weights", self.gather_weights, GATHER_WEIGHTS)
        if self.recompute != "off" and self.parallel in ("fsdp", "hsdp"):
            raise ConfigError(f"recompute={self.recompute!r} keeps W1's and W3's Fprop weight operands for the backward, which under "
                              f"parallel={self.parallel!r} holds each all-gathered weight until then; use recompute='off'")
        if self.recompute != "off" and self.producer_fusion != "off":
            raise ConfigError(f"recompute={self.recompute!r} and producer_fusion={self.producer_fusion!r} both take gate and up: the fused "
                              "SwiGLU keeps them for its own backward, so nothing would be recomputed; use one of the two")
        if self.gather_weights == "encoded" and self.parallel not in ("fsdp", "hsdp"):
            raise ConfigError(f"gather_weights='encoded' changes FSDP2's all-gathers; parallel={self.parallel!r} has none (use fsdp or hsdp)")
        _check.integer("pp_microbatches", self.pp_microbatches, minimum=1)
        if self.parallel == "pp" and self.batch_size % self.pp_microbatches:
            raise ConfigError(f"batch_size={self.batch_size} does not split into pp_microbatches={self.pp_microbatches}; use a batch size that is a multiple of it")
        if self.parallel != "pp" and self.pp_microbatches != PP_MICROBATCHES:
            raise ConfigError(f"pp_microbatches={self.pp_microbatches} cuts the batch for pipeline stages; parallel={self.parallel!r} has none (use parallel='pp')")
        for name in ("seq_len", "batch_size", "steps", "ns_steps", "eval_every", "eval_batches", "probe_every", "checkpoint_every"):
            _check.integer(name, getattr(self, name), minimum=1)
        _check.integer("warmup_steps", self.warmup_steps, minimum=0)
        _check.integer("seed", self.seed, minimum=0)
        for name in ("lr", "adam_lr", "grad_clip"):
            _check.number(name, getattr(self, name), positive=True)
        _check.number("weight_decay", self.weight_decay, positive=False)
        _check.number("min_lr_ratio", self.min_lr_ratio, positive=False)
        if self.min_lr_ratio > 1:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.max_minutes is not None:
            _check.number("max_minutes", self.max_minutes, positive=True)
        if self.qk_clip_tau is not None:
            _check.number("qk_clip_tau", self.qk_clip_tau, positive=True)
        if not isinstance(self.recipe, str) or not self.recipe:
            raise ConfigError(f"recipe={self.recipe!r} must be a recipe name or a path to a .toml file")
        self._check_capture()
        self._check_trackers()
        if self.optuna_trial is not None:
            self.optuna_trial = check_trial_link(self.optuna_trial, lambda place, message: ConfigError(f"{place}: {message}"))
        if self.gather_weights == "encoded" and self.capture_steps:
            raise ConfigError("capture_steps reads each layer's weight, which gather_weights='encoded' does not gather; use gather_weights='dense' to capture")

    def _check_capture(self) -> None:
        if not isinstance(self.capture_steps, (list, tuple)):
            raise ConfigError(f"capture_steps={self.capture_steps!r} must be a list of step numbers, e.g. [0, 100]")
        if not isinstance(self.capture_layers, (list, tuple)):
            raise ConfigError(f"capture_layers={self.capture_layers!r} must be a list of layer-name patterns, e.g. [\"layers.0.*\"]")
        self.capture_steps, self.capture_layers = list(self.capture_steps), list(self.capture_layers)
        for index, step in enumerate(self.capture_steps):
            _check.integer(f"capture_steps[{index}]", step, minimum=0)
            if step >= self.steps:
                raise ConfigError(f"capture_steps has step {step}, but the run's steps are 0..{self.steps - 1}")
        for pattern in self.capture_layers:
            if not isinstance(pattern, str) or not pattern:
                raise ConfigError(f"capture_layers has {pattern!r}; each must be a layer-name pattern such as \"layers.*.feed_forward.w2\"")
        if bool(self.capture_steps) != bool(self.capture_layers):
            given, missing = ("capture_steps", "capture_layers") if self.capture_steps else ("capture_layers", "capture_steps")
            raise ConfigError(f"{given} is set but {missing} is empty; set both to capture GEMM operands (or neither)")

    def _check_trackers(self) -> None:
        if not isinstance(self.log_to, (list, tuple)):
            raise ConfigError(f"log_to={self.log_to!r} must be a list of trackers, e.g. [\"tensorboard\", \"mlflow\"]")
        self.log_to = list(self.log_to)
        for index, tracker in enumerate(self.log_to):
            _check.choice(f"log_to[{index}]", tracker, TRACKERS)
        if len(set(self.log_to)) != len(self.log_to):
            raise ConfigError(f"log_to={self.log_to!r} names a tracker twice; name each once")
        for name in ("tracker_group", "tracker_run"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.strip() and value.isprintable() and "/" not in value):
                raise ConfigError(f"{name}={value!r} must be a non-empty name of printable characters without '/'")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "config") -> TrainConfig:
        known = {f.name for f in fields(cls)}
        for key in values:
            if key not in known:
                raise ConfigError(f"{where}: unknown key {key!r}; allowed: {', '.join(sorted(known))}")
        try:
            return cls(**values)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except TypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None

    @classmethod
    def from_toml(cls, path: str | Path) -> TrainConfig:
        return cls.from_dict(read_toml(path, ConfigError, "config file"), str(path))


def _data_config(values: dict[str, Any]) -> DataConfig:
    known = {f.name for f in fields(DataConfig)}
    for key in values:
        if key not in known:
            raise ConfigError(f"unknown key data.{key}; allowed: {', '.join(sorted(known))}")
    return DataConfig(**values)


_check = Checks(ConfigError)
