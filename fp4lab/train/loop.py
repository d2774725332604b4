"""The training loop: `run(config)` trains one model with one recipe and writes everything the
orchestrator reads into `config.out_dir`:

    config.json     the resolved run (train config, recipe, model shape, parameter count)
    metrics.jsonl   one object per step: step, loss, lr, grad_norm, tokens_per_s; val_loss every
                    eval_every steps; probe fields every probe_every steps (attention entropy and max
                    logit per layer and head, saturated / flushed fractions per FP4 operand)
    checkpoint.pt   model, optimizer, step, and every random stream (SR and Hadamard generators
                    included): a run started again in the same out_dir resumes bit for bit
                    (checkpoint.dcp/ instead for a run on several ranks; either kind resumes on any
                    number of ranks or in one process: _resume)
    captures/       step-<n>/<layer>.pt: the GEMM operands of the capture_steps and capture_layers
                    (fp4lab.train.capture), for `fp4lab numerics --capture`
    summary.json    status (completed | diverged | time_limit | preempted | interrupted | stopped), the
                    step a divergence happened, final and best losses, throughput, peak memory

A NaN or Inf loss or gradient norm ends the run with status "diverged" (no traceback). SIGTERM, SIGUSR1
and SIGUSR2 (what Slurm, our SBATCH scripts and submitit send before preemption or a time limit)
checkpoint after the current step and end with status "preempted"; summary.json names the signal
(`stop_signal`), so the caller can tell a scancel (TERM) from a request to requeue (USR1/USR2).
Ctrl-C (SIGINT) stops the same way with status "interrupted"; a second Ctrl-C aborts at once
(KeyboardInterrupt, no checkpoint of the step in progress). Running `run` again resumes.
"""

from __future__ import annotations

import contextlib
import math
import os
import resource
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fp4lab.nn.build import attention_generators, build_model, cuda_graph_blocker, fp4_linears
from fp4lab.nn.model import Llama, ModelConfig, count_parameters, preset
from fp4lab.nn.recipe import Recipe, load_recipe
from fp4lab.numerics.fast import triton_available
from fp4lab.optim.build import OptimizerConfig, build_optimizer
from fp4lab.optim.muon import NS_POLYNOMIALS
from fp4lab.optim.qk_clip import all_reduce_max_logits_, qk_clip_
from fp4lab.optim.sharding import clip_grad_norm_
from fp4lab.train import distributed
from fp4lab.train.capture import OperandCapture
from fp4lab.train.checkpoint import (
    MetricsLog,
    finite_or_none,
    load_checkpoint,
    load_sharded,
    load_whole,
    newest_checkpoint,
    remove_checkpoint,
    save_checkpoint,
    save_sharded,
    write_json,
)
from fp4lab.train.config import RESULT_NEUTRAL, CheckpointMismatch, ConfigError, TrainConfig
from fp4lab.train.data import BatchSampler, load_dataset, val_batches

CHECKPOINT = "checkpoint.pt"
# A run of several ranks (parallel != "none") checkpoints here instead: fp4lab.train.checkpoint.save_sharded.
# Either resumes in the other kind of run, on any number of ranks (_resume).
SHARDED_CHECKPOINT = "checkpoint.dcp"
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


def lr_factor(config: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine to min_lr_ratio, constant, or WSD (stable, then a linear decay over
    the last 20% of steps)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    floor = config.min_lr_ratio
    if config.lr_schedule == "constant":
        return 1.0
    if config.lr_schedule == "wsd":
        decay_start = int(config.steps * 0.8)
        if step < decay_start:
            return 1.0
        return 1.0 - (1.0 - floor) * (step - decay_start + 1) / max(1, config.steps - decay_start)
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def run(config: TrainConfig, *, progress: bool | None = None, stop_after: int | None = None) -> dict[str, Any]:
    """Train per `config`, resuming from `out_dir/checkpoint.pt` when it exists; return the summary.

    progress: a rich progress bar (None: when stderr is a terminal; plain lines otherwise).
    stop_after: end cleanly (status "stopped", checkpoint written) after this many steps of this call,
    as a preemption would; for drills and tests.
    """
    recipe = load_recipe(config.recipe)
    distributed.check(config, distributed.env_world())
    ranks, device = distributed.init(config, _device(config.device))
    try:
        return _run(config, recipe, ranks, device, progress, stop_after)
    finally:
        distributed.close(ranks)


def _run(config: TrainConfig, recipe: Recipe, ranks: distributed.Ranks, device: torch.device, progress, stop_after) -> dict[str, Any]:
    out = Path(config.out_dir)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with ranks.main_first():  # one rank builds a dataset cache, the others read it
        data = load_dataset(config.data, progress=ranks.main and _interactive(progress))
    model_config = preset(config.model, data.vocab_size, config.seq_len)
    model, optimizer, loss_fn = build_training(config, recipe, model_config, device, ranks)
    if ranks.mode == "pp":
        train_step = loss_fn.step
    else:
        graphed = distributed.graphs_possible(config) and cuda_graph(config, model, device)
        warmup = distributed.DDP_GRAPH_WARMUP_STEPS if ranks.mode == "ddp" else GRAPH_WARMUP_STEPS
        train_step = TrainStep(model, loss_fn, graphed, warmup)
    sampler = BatchSampler(data.train, config.batch_size, config.seq_len, config.seed)
    evaluation = val_batches(data.val, config.batch_size, config.seq_len, config.eval_batches)
    qk_clip, tau = _qk_clip(config, recipe)
    capture = None
    if config.capture_steps and ranks.main:  # rank 0's rows stand for the batch: one record per run
        capture = OperandCapture(config, model, recipe, model_config.n_layers, compiled(config, device))

    state = _resume(out, config, model, optimizer, ranks, loss_fn.whole_optimizer_order if ranks.mode == "pp" else None)
    identity = {
        "config": config.to_dict(),
        "recipe": {"name": recipe.name, "path": recipe.path, "source": recipe.source},
        "model": model_config.__dict__,
        "parameters": count_parameters(model_config),
        "dataset": {"name": data.name, "vocab_size": data.vocab_size, "train_tokens": len(data.train), "val_tokens": len(data.val)},
        "optimizer": {"qk_clip": qk_clip, "qk_clip_tau": tau},
    }
    identity["world_size"] = ranks.world  # this segment's: a resumed run may run on another number of ranks
    if ranks.mode == "pp":
        from fp4lab.train.pipeline import schedule_name

        identity["pipeline_schedule"] = schedule_name()
    if ranks.main:
        write_json(out / "config.json", identity)
    metrics = MetricsLog(out / "metrics.jsonl", resume_step=state.step) if ranks.main else _Silent()
    status, diverged_step = "completed", None
    started = time.monotonic()
    steps_this_call = 0
    tokens_per_step = config.batch_size * config.seq_len

    with _stop_signals() as stop_requested, _progress(_interactive(progress), config, state.step, ranks.main) as advance:
        while state.step < config.steps:
            step = state.step
            if recipe.lora_svd_rank and step % recipe.lora_svd_every == 0:
                _realign_low_rank(model)
            optimizer.set_lr_scale(lr_factor(config, step))
            probing = step % config.probe_every == 0 or step == config.steps - 1  # the final state is probed too
            _set_probes(model, probing, record_max_logits=probing or qk_clip == "kimi")

            tic = time.perf_counter()
            x, y = (ranks.rows(t).to(device) for t in sampler.batch(step))
            lr = optimizer.param_groups[0]["lr"]
            capturing = capture is not None and step in capture.steps
            with capture.recording() if capturing else contextlib.nullcontext():
                loss = train_step(x, y, eager=probing or capturing)
            if capturing:
                capture.write(step)
            grad_norm = clip_and_step(model, optimizer, config.grad_clip, keep_grads=train_step.graphed, pipelined=ranks.mode == "pp")
            if ranks.mode != "pp":  # (the pipeline's loss is the global batch's on every rank already)
                loss = ranks.mean(loss)  # every rank logs and decides on the loss of the global batch
            if ranks.world > 1 and ranks.mode != "pp" and (probing or qk_clip == "kimi"):
                _reduce_probes(model, ranks, probing)
            # Read back only now, so the GPU never waits for the host mid-step. A NaN/Inf step has
            # updated the weights, but the run ends here without a checkpoint.
            record: dict[str, Any] = {"step": step, "loss": loss.item(), "lr": lr}
            if not math.isfinite(record["loss"]):
                status, diverged_step = "diverged", step
                metrics.write(record)
                break
            record["grad_norm"] = grad_norm.item()
            if not math.isfinite(record["grad_norm"]):
                status, diverged_step = "diverged", step
                metrics.write(record)
                break
            if qk_clip == "kimi":
                clipped = _apply_qk_clip(model, tau, bool(recipe.lora_svd_rank))
                # Under pp each rank clipped the heads of its own blocks.
                record["qk_clipped_heads"] = ranks.total(clipped) if ranks.mode == "pp" else clipped
                state.qk_clip_events += record["qk_clipped_heads"]
            elapsed = time.perf_counter() - tic

            state.train_seconds += elapsed
            state.tokens_seen += tokens_per_step
            state.last_loss = record["loss"]
            state.best_loss = min(state.best_loss, record["loss"])
            record["tokens_per_s"] = tokens_per_step / elapsed
            if probing:
                record.update(_probe_record(model, ranks))
            _set_probes(model, False, record_max_logits=False)
            state.step = step + 1
            if state.step % config.eval_every == 0 or state.step == config.steps:
                record["val_loss"] = evaluate(model, loss_fn, evaluation, device, ranks)
                state.last_val_loss = record["val_loss"]
                state.best_val_loss = min(state.best_val_loss, record["val_loss"])
                if not math.isfinite(record["val_loss"]):
                    status, diverged_step = "diverged", step
            metrics.write(record)
            advance(record)
            steps_this_call += 1
            if status == "diverged":
                break
            if state.step % config.checkpoint_every == 0 or state.step == config.steps:
                _save(out, config, model, optimizer, state, ranks)
            if state.step < config.steps:
                reason = _stop_reason(config, started, stop_requested, stop_after, steps_this_call)
                if ranks.world > 1:
                    reason = _agreed_stop(ranks, reason, stop_requested)
                if reason:
                    status = reason
                    _save(out, config, model, optimizer, state, ranks)
                    break
    metrics.close()
    summary = _summary(status, diverged_step, config, state, recipe, device)
    summary["stop_signal"] = stop_requested[0] if status in ("preempted", "interrupted") else None
    summary["world_size"] = ranks.world
    summary["cuda_graph"] = train_step.graph is not None  # whether this segment's steps replayed a captured graph
    if config.gather_weights == "encoded":  # this segment's all-gathers (fp4lab.train.encoded_gather)
        summary["gather_bytes_per_step"] = model.gather_bytes.per_step()
    if ranks.main:
        write_json(out / "summary.json", summary)
    return summary


class _Silent:
    """The metrics log of ranks other than 0: one run, one record."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def clip_and_step(model: torch.nn.Module, optimizer, grad_clip: float, keep_grads: bool = False, pipelined: bool = False) -> torch.Tensor:
    """Clip the gradient norm, step, drop the gradients (or keep their memory for a CUDA graph that
    zeroes and refills them); returns the norm as a tensor: nothing is read back. FSDP2 DTensor
    gradient shards, or `pipelined` stages (each rank its own parameters): the global norm
    (fp4lab.optim.sharding.clip_grad_norm_)."""
    grad_norm = clip_grad_norm_(model.parameters(), grad_clip, split_over_ranks=pipelined)
    optimizer.step()
    if not keep_grads:
        optimizer.zero_grad(set_to_none=True)
    return grad_norm


# Eager steps before the capture: the compiler, cuBLAS and the Triton kernels initialise on them.
GRAPH_WARMUP_STEPS = 2


class TrainStep:
    """One step's forward and backward: `step(x, y)` returns the loss with the gradients in `.grad`.

    With `graphed`, the first `warmup` calls run eagerly on a side stream, the next one
    captures zeroing the gradients, the forward and the backward into a CUDA graph, and every later
    call copies the batch into the captured input tensors and replays it: the same kernels on the
    same data, without the host launching each one (the FP4 path launches several per linear).
    `eager=True` runs a step eagerly (probe steps, which read values back on the host); it
    accumulates into the same gradient tensors, so both kinds of step interleave freely.
    """

    def __init__(self, model: Llama, loss_fn: LossFn, graphed: bool, warmup: int = GRAPH_WARMUP_STEPS):
        self.model, self.loss_fn, self.graphed, self.warmup = model, loss_fn, graphed, warmup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.warmed = 0

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor, eager: bool = False) -> torch.Tensor:
        if not self.graphed or eager:
            self._zero_grads()
            return self._forward_backward(tokens, targets)
        if self.graph is None and self.warmed < self.warmup:
            self.warmed += 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._zero_grads()
                loss = self._forward_backward(tokens, targets)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None:
            self._capture(tokens, targets)
        self.static_tokens.copy_(tokens)
        self.static_targets.copy_(targets)
        self.graph.replay()
        for attention, logits in self.captured_logits:  # an eager step may have replaced them
            attention.last_max_logits = logits
        return self.static_loss

    def _forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(tokens, targets)
        loss.backward()
        return loss.detach()

    def _zero_grads(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def _capture(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.static_tokens, self.static_targets = tokens.clone(), targets.clone()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._zero_grads()
            self.static_loss = self._forward_backward(self.static_tokens, self.static_targets)
        self.captured_logits = [(a, a.last_max_logits) for a in self.model.attentions() if a.record_max_logits]


def cuda_graph(config: TrainConfig, model: Llama, device: torch.device) -> bool:
    """Whether steps replay from a CUDA graph (config.cuda_graphs; "auto": on the fast path on CUDA
    when nothing on the step's path draws from a torch.Generator)."""
    if config.cuda_graphs == "off" or device.type != "cuda" or not fast_compute(config, device):
        if config.cuda_graphs == "on":
            raise ConfigError("cuda_graphs='on' needs the fast path on CUDA (device='cuda', compute='fast' or 'auto')")
        return False
    blocker = cuda_graph_blocker(model, config.batch_size * config.seq_len)
    if blocker is not None and config.cuda_graphs == "on":
        raise ConfigError(f"cuda_graphs='on' but {blocker}; use cuda_graphs='auto' or 'off'")
    return blocker is None


@torch.no_grad()
def evaluate(model: Llama, loss_fn: LossFn, batches: list, device: torch.device, ranks: distributed.Ranks | None = None) -> float:
    """Mean validation loss (`loss_fn`: the training forward, see `build_training`). The evaluation
    forward draws random bits (random Hadamard signs, SR), so every generator is put back afterwards:
    evaluating never changes the training trajectory.

    On several ranks each evaluates its rows of every batch (every rank runs every forward: FSDP's
    all-gathers are collectives), and the mean over ranks of the per-rank means is the one-process
    value up to summation order. A batch whose rows do not split (a split shorter than one batch) is
    evaluated whole on every rank. Under pp, `loss_fn` runs the pipeline and returns the whole batch's
    loss on every rank."""
    if ranks is None or ranks.world == 1 or ranks.mode == "pp":
        with _generators_restored(model):
            losses = [loss_fn(x.to(device), y.to(device)).item() for x, y in batches]
        return sum(losses) / len(losses)
    total = torch.zeros((), device=device)
    with _generators_restored(model):
        for x, y in batches:
            if len(x) % ranks.world == 0:
                x, y = ranks.rows(x), ranks.rows(y)
            total += loss_fn(x.to(device), y.to(device)).float()
    return ranks.mean(total).item() / len(batches)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def fast_compute(config: TrainConfig, device: torch.device) -> bool:
    """Whether the run takes the fast path (config.compute; "auto" means: on CUDA)."""
    return config.compute == "fast" or (config.compute == "auto" and device.type == "cuda")


def attention_kernel(config: TrainConfig, device: torch.device, head_dim: int) -> str:
    """Which kernel runs unquantized attention (config.attention_kernel): "triton" (flash attention
    with the probes' statistics computed online) or "sdpa"; "auto" means triton on the fast path on
    CUDA where Triton is installed and the kernel takes the model's head_dim."""
    usable = device.type == "cuda" and fast_compute(config, device) and triton_available()
    if config.attention_kernel == "triton" and not usable:
        raise ConfigError("attention_kernel='triton' needs the fast path on CUDA with Triton installed; use attention_kernel='auto' or 'sdpa'")
    if usable:
        from fp4lab.nn.triton_attention import HEAD_DIMS

        if head_dim not in HEAD_DIMS:
            if config.attention_kernel == "triton":
                raise ConfigError(f"attention_kernel='triton' takes head dims {', '.join(map(str, HEAD_DIMS))}; this model's is {head_dim}: use attention_kernel='auto' or 'sdpa'")
            usable = False
    return "triton" if config.attention_kernel == "triton" or (config.attention_kernel == "auto" and usable) else "sdpa"


def mx_gemm(config: TrainConfig, device: torch.device) -> str:
    """Where MXFP4 x MXFP4 GEMMs run (config.mx_gemm): "fp8" (FP8 tensor cores, per-block fp32
    promotion; on the fast path on CUDA devices with FP8 tensor cores, compute capability 8.9 and up) or
    "bf16" (decoded values on bf16 tensor cores, and every reference-path GEMM); "auto" means bf16, the
    faster wherever measured (fp4lab.train.config.MX_GEMMS)."""
    usable = (
        device.type == "cuda" and fast_compute(config, device) and triton_available()
        and torch.cuda.get_device_capability(device) >= (8, 9)
    )
    if config.mx_gemm == "fp8" and not usable:
        raise ConfigError("mx_gemm='fp8' needs the fast path on a CUDA device with FP8 tensor cores (compute capability 8.9+) and Triton; use mx_gemm='auto' or 'bf16'")
    return "fp8" if config.mx_gemm == "fp8" else "bf16"


def producer_fusion(config: TrainConfig, device: torch.device) -> str:
    """config.producer_fusion, checked: "on" fuses each feed-forward's SwiGLU into its W2's GEMMs, "all"
    also the residual add and RMSNorm into W1's and W3's x operands (fp4lab.nn.build.build_model);
    either needs the fast path on CUDA with Triton."""
    usable = device.type == "cuda" and fast_compute(config, device) and triton_available()
    if config.producer_fusion != "off" and not usable:
        raise ConfigError(f"producer_fusion={config.producer_fusion!r} needs the fast path on CUDA with Triton installed; use producer_fusion='off'")
    return config.producer_fusion


def compiled(config: TrainConfig, device: torch.device) -> bool:
    """Whether the forward and loss run under torch.compile (config.compile; "auto" means: on CUDA)."""
    return config.compile == "on" or (config.compile == "auto" and device.type == "cuda")


def build_training(
    config: TrainConfig, recipe: Recipe, model_config: ModelConfig, device: torch.device,
    ranks: distributed.Ranks | None = None,
) -> tuple[Llama, Any, LossFn]:
    """The model, its optimizer and the loss function one training step calls, as `config` asks:
    the fast path (bf16 autocast, tensor-core GEMMs, fused AdamW on CUDA) or the fp32 reference, and
    torch.compile or not. The training loop and `fp4lab bench` both build a run through here.
    `ranks`: the model wrapped for data parallelism (DDP, FSDP2); the returned model is the Llama
    itself (its parameters DTensor shards under FSDP2), the loss function runs the wrapper. Under pp
    the model keeps this rank's blocks only and the loss function is the train.pipeline.Pipeline
    (evaluation's forward; its `step` trains)."""
    ranks = ranks or distributed.Ranks()
    fast = fast_compute(config, device)
    if fast and device.type == "cuda":
        # bf16-output GEMMs must reduce in fp32 (no bf16 split-K partial sums): the fast path claims
        # fp32 accumulation, exactly what an FP4 tensor core does.
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.manual_seed(config.seed)
    model = build_model(
        model_config, recipe, seed=config.seed, device=device, tensor_cores=fast,
        attention_kernel=attention_kernel(config, device, model_config.head_dim), mx_gemm=mx_gemm(config, device),
        producer_fusion=producer_fusion(config, device),
    )
    optimizer_config = _optimizer_config(config, recipe, fused=fast and device.type == "cuda")
    if ranks.mode == "pp":
        # Every block lives on one rank and sees the whole batch: its random streams stay the one-process ones.
        from fp4lab.train.pipeline import DUALPIPE_V, Pipeline

        # A one-process checkpoint keys optimizer state by position in the whole model's optimizer: its
        # names in that order, while the model is whole (an optimizer allocates no state until it steps).
        names = {id(p): n for n, p in model.named_parameters()}
        whole = build_optimizer(model.named_parameters(), optimizer_config).optimizers
        whole_order = {key: [names[id(p)] for g in opt.param_groups for p in g["params"]] for key, opt in whole.items()}
        microbatch = (config.batch_size // config.pp_microbatches, config.seq_len)
        loss_fn: LossFn = Pipeline(model, ranks.world, ranks.rank, device, microbatch, config.pp_microbatches, fast, DUALPIPE_V is not None)
        loss_fn.whole_optimizer_order = whole_order
    else:
        distributed.offset_random_streams(model, ranks)
        model_loss = distributed.wrap(model, ranks, device, config.gather_weights)

        def loss_fn(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=fast):
                return model_loss(tokens, targets)

    optimizer = build_optimizer(model.named_parameters(), optimizer_config)

    if not compiled(config, device):
        return model, optimizer, loss_fn
    if ranks.mode == "none":
        return model, optimizer, torch.compile(loss_fn)
    # Under DDP, FSDP2 and pp each transformer block is compiled on its own (torchtitan's pattern): their
    # hooks (gradient buckets, all-gathers, reshards) and the pipeline's stage boundaries then run
    # between compiled graphs instead of breaking a whole-model graph into pieces (H200 figures in
    # docs/BENCHMARKS.md). Replacing `forward` keeps parameter names, so checkpoints stay
    # interchangeable with one-process runs.
    for block in model.layers:
        block.forward = torch.compile(block.forward)
    return model, optimizer, loss_fn


# --- helpers ---------------------------------------------------------------------------------------


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but CUDA is not available here; use device='cpu'")
    return torch.device(name)


def _interactive(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def _optimizer_config(config: TrainConfig, recipe: Recipe, fused: bool) -> OptimizerConfig:
    opt = recipe.optimizer
    cap = (opt.update_cap_alpha, opt.update_cap_alpha_qk) if _qk_clip(config, recipe)[0] == "update_cap" else None
    return OptimizerConfig(
        name=config.optimizer or opt.name or "muon",
        lr=config.lr,
        adam_lr=config.adam_lr,
        weight_decay=config.weight_decay,
        ns_steps=config.ns_steps,
        ns_coefficients=NS_POLYNOMIALS[config.ns_polynomial or opt.ns_polynomial],
        lr_scaling=config.lr_scaling,
        ns_format=opt.ns_format,
        adam_v_format=opt.adam_v_format,
        update_cap=cap,
        fused=fused,
    )


def _qk_clip(config: TrainConfig, recipe: Recipe) -> tuple[str, float]:
    return config.qk_clip or recipe.optimizer.qk_clip, config.qk_clip_tau or recipe.optimizer.qk_clip_tau


def _set_probes(model: Llama, probing: bool, record_max_logits: bool) -> None:
    for attention in model.attentions():
        attention.probe = probing
        attention.record_max_logits = record_max_logits
    for linear in fp4_linears(model).values():
        linear.probe = probing
        linear.quant_stats = {}


def _probe_record(model: Llama, ranks: distributed.Ranks) -> dict[str, Any]:
    blocks = [int(index) for index, _ in model.layers.named_children()]
    attention = {i: (a.last_entropy.tolist(), a.last_max_logits.tolist()) for i, a in zip(blocks, model.attentions())}
    recorded = [(name, op, v) for name, linear in fp4_linears(model).items() for op, v in linear.quant_stats.items()]
    values = torch.stack([v for _, _, v in recorded]).tolist() if recorded else []  # one host sync for them all
    quant: dict[str, dict[str, list[float]]] = {}
    for (name, op, _), pair in zip(recorded, values):
        quant.setdefault(name, {})[op] = pair
    if ranks.mode == "pp":  # every rank probed its own blocks; rank 0 writes them all, in block order
        parts: list[Any] = [None] * ranks.world
        torch.distributed.all_gather_object(parts, (attention, quant))
        attention = {i: probes for part, _ in parts for i, probes in part.items()}
        quant = {name: stats for _, part in parts for name, stats in part.items()}
    entropy = [attention[i][0] for i in sorted(attention)]
    max_logit = [attention[i][1] for i in sorted(attention)]
    return {
        "attn_entropy": entropy,
        "attn_entropy_mean": [sum(h) / len(h) for h in entropy],
        "max_logit": max_logit,
        "max_logit_max": max(max(h) for h in max_logit),
        "quant": quant,
    }


@torch.no_grad()
def _apply_qk_clip(model: Llama, tau: float, realign: bool) -> int:
    clipped = 0
    for attention in model.attentions():
        gammas = qk_clip_(
            attention.wq.weight, attention.wk.weight, attention.last_max_logits, tau,
            attention.n_heads, attention.n_kv_heads, attention.head_dim,
        )
        hit = int((gammas < 1).sum())
        clipped += hit
        if hit and realign:  # LoRA-SVD factors must follow the rescaled weights
            attention.wq.realign_low_rank()
            attention.wk.realign_low_rank()
    return clipped


def _realign_low_rank(model: Llama) -> None:
    for linear in fp4_linears(model).values():
        if linear.lora_rank:
            linear.realign_low_rank()


@contextlib.contextmanager
def _generators_restored(model: Llama) -> Iterator[None]:
    linears = list(fp4_linears(model).values())
    saved = [linear.get_extra_state() for linear in linears]
    attention = [(g, g.get_state()) for g in attention_generators(model)]
    try:
        yield
    finally:
        for linear, state in zip(linears, saved):
            linear.set_extra_state(state)
        for generator, state in attention:
            generator.set_state(state)


def _save(out: Path, config: TrainConfig, model: Llama, optimizer, state: RunState, ranks: distributed.Ranks) -> None:
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
            {
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


def _resume(out: Path, config: TrainConfig, model: Llama, optimizer, ranks: distributed.Ranks,
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
    if ranks.mode == "none":
        return _restore(source, config, model, optimizer)
    checkpoint = load_checkpoint(source)
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


def _restore(path: Path, config: TrainConfig, model: Llama, optimizer) -> RunState:
    checkpoint = load_checkpoint(path)
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


def _stop_reason(config, started, stop_requested, stop_after, steps_this_call) -> str | None:
    if stop_requested:
        return "interrupted" if stop_requested[0] == "SIGINT" else "preempted"
    if config.max_minutes is not None and time.monotonic() - started > 60 * config.max_minutes:
        return "time_limit"
    if stop_after is not None and steps_this_call >= stop_after:
        return "stopped"
    return None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
# What ranks agree on after each step, by precedence (the largest wins): a signal, the time limit, stop_after.
_STOP_CODES = (None, "stopped", "time_limit", *(s.name for s in STOP_SIGNALS))


def _agreed_stop(ranks: distributed.Ranks, reason: str | None, stop_requested: list[str]) -> str | None:
    """One stop decision on every rank: a signal one rank received (torchrun or Slurm may deliver it to
    one process first) or one rank's clock passing max_minutes stops all of them after the same step."""
    code = _STOP_CODES.index(stop_requested[0] if stop_requested else reason)
    agreed = _STOP_CODES[ranks.agree(code)]
    if agreed in _STOP_CODES[3:]:
        if not stop_requested:
            stop_requested.append(agreed)
        return "interrupted" if agreed == "SIGINT" else "preempted"
    return agreed


def _reduce_probes(model: Llama, ranks: distributed.Ranks, probing: bool) -> None:
    """Per-head max logits of the global batch (QK-Clip rescales every replica alike) and mean entropies."""
    for attention in model.attentions():
        all_reduce_max_logits_(attention.last_max_logits)
        if probing:
            attention.last_entropy = ranks.mean(attention.last_entropy)


@contextlib.contextmanager
def _stop_signals() -> Iterator[list[str]]:
    """The stop signals append their name to a list the loop checks after each step (a handler must not
    checkpoint mid-step); a second SIGINT raises KeyboardInterrupt at once. Handlers can only be
    installed from the main thread; elsewhere the list stays empty. The previous handlers (e.g.
    submitit's) come back on exit."""
    received: list[str] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def handle(signum, _frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and "SIGINT" in received:
            raise KeyboardInterrupt
        received.append(name)
        if name == "SIGINT":
            print("\nCtrl-C: stopping after this step with a checkpoint (Ctrl-C again to abort at once)", file=sys.stderr, flush=True)

    previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def _progress(interactive: bool, config: TrainConfig, start: int, shown: bool = True):
    """A rich progress bar on a terminal; otherwise about twenty plain lines per run; nothing where not `shown`."""
    if not shown:
        yield lambda record: None
        return
    if interactive:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task(f"train {config.recipe}", total=config.steps, completed=start, info="")

            def advance(record: dict) -> None:
                info = f"loss {record['loss']:.4f}" + (f" val {record['val_loss']:.4f}" if "val_loss" in record else "")
                bar.update(task, advance=1, info=info)

            yield advance
        return
    every = max(1, config.steps // 20)

    def advance(record: dict) -> None:
        step = record["step"] + 1
        if step % every == 0 or step == config.steps or "val_loss" in record:
            val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
            print(f"step {step}/{config.steps} loss {record['loss']:.4f}{val} lr {record['lr']:.3g} tok/s {record['tokens_per_s']:.0f}", file=sys.stderr, flush=True)

    yield advance


def _summary(status, diverged_step, config: TrainConfig, state: RunState, recipe: Recipe, device) -> dict[str, Any]:
    if device.type == "cuda":
        peak_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return {
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
    }
