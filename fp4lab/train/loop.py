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
    summary.json    status (completed | diverged | pruned | time_limit | preempted | interrupted | stopped), the
                    step a divergence happened, final and best losses, throughput, peak memory

A NaN or Inf loss or gradient norm ends the run with status "diverged" (no traceback). SIGTERM, SIGUSR1
and SIGUSR2 (what Slurm, our SBATCH scripts and submitit send before preemption or a time limit)
checkpoint after the current step and end with status "preempted"; summary.json names the signal
(`stop_signal`), so the caller can tell a scancel (TERM) from a request to requeue (USR1/USR2).
Ctrl-C (SIGINT) stops the same way with status "interrupted"; a second Ctrl-C aborts at once
(KeyboardInterrupt, no checkpoint of the step in progress). Running `run` again resumes. A run that is an
Optuna trial (`optuna_trial`) reports each validation loss to it; when the pruner says stop, it
checkpoints and ends with status "pruned" (fp4lab.train.pruning).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fp4lab.nn.build import cuda_graph_blocker, fp4_linears
from fp4lab.nn.model import Llama
from fp4lab.nn.model_config import count_parameters, preset
from fp4lab.nn.recipe import Recipe, load_recipe
from fp4lab.optim.qk_clip import all_reduce_max_logits_, qk_clip_
from fp4lab.train import distributed, paths, run_folder
from fp4lab.train.build import build_training, qk_clip_setting, recipe_settings, resolve_device
from fp4lab.train.capture import OperandCapture
from fp4lab.train.checkpoint import MetricsLog, RunState, resume_run, save_run, write_json
from fp4lab.train.config import TrainConfig
from fp4lab.train.data import BatchSampler, load_dataset, val_batches
from fp4lab.train.environment import environment
from fp4lab.train.pruning import TrialReporter
from fp4lab.train.step import GRAPH_WARMUP_STEPS, TrainStep, clip_and_step, evaluate
from fp4lab.train.summary import run_summary
from fp4lab.train.trackers import check_installed, open_run_log


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
    check_installed(config.log_to)
    distributed.check(config, distributed.env_world())
    # Rank 0 holds the run folder for the run's whole life: a second trainer on it is refused here.
    with run_folder.hold(config.out_dir) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext():
        ranks, device = distributed.init(config, resolve_device(config.device))
        try:
            return _run(config, recipe, ranks, device, progress, stop_after)
        finally:
            distributed.close(ranks)


@dataclass
class _Run:
    """Everything one call of `run` trains with, built once by `_start`."""

    config: TrainConfig
    recipe: Recipe
    ranks: distributed.Ranks
    device: torch.device
    paths: paths.ComputePaths
    model: Llama
    optimizer: Any
    loss_fn: Any
    train_step: Any
    sampler: BatchSampler
    evaluation: list
    qk_clip: str
    tau: float
    capture: OperandCapture | None
    state: RunState
    metrics: Any
    trial: TrialReporter | None  # rank 0's line to its Optuna trial, when the run is one


def _run(config: TrainConfig, recipe: Recipe, ranks: distributed.Ranks, device: torch.device, progress, stop_after) -> dict[str, Any]:
    run = _start(config, recipe, ranks, device, progress)
    try:
        return _train(run, config, recipe, ranks, device, progress, stop_after)
    except BaseException:  # the trackers hear of a crash too: their run is marked failed, not left running
        run.metrics.close({"status": "failed"})
        raise


def _train(run: _Run, config: TrainConfig, recipe: Recipe, ranks: distributed.Ranks, device: torch.device, progress,
           stop_after) -> dict[str, Any]:
    state, status, diverged_step = run.state, "completed", None
    resumed_from_step = state.step
    started = time.monotonic()
    steps_this_call = 0
    with _stop_signals() as stop_requested, _progress(_interactive(progress), config, state.step, ranks.main) as advance:
        while state.step < config.steps:
            step = state.step
            record = _train_one_step(run, step)
            if record.get("diverged"):
                del record["diverged"]
                status, diverged_step = "diverged", step
                run.metrics.write(record)
                if state.step == step:  # the loss or gradient norm: no checkpoint, no progress
                    break
            else:
                run.metrics.write(record)
            advance(record)
            steps_this_call += 1
            if status == "diverged":
                break
            saved = state.step % config.checkpoint_every == 0 or state.step == config.steps
            if saved:
                save_run(Path(config.out_dir), config, run.model, run.optimizer, state, ranks)
            # Every eval goes to the trial (the last one too: optuna-dashboard draws the whole curve).
            pruned = run.trial is not None and "val_loss" in record and run.trial.should_stop(state.step, record["val_loss"])
            if state.step < config.steps:
                reason = _stop_reason(config, started, stop_requested, stop_after, steps_this_call, pruned)
                if ranks.world > 1:
                    reason = _agreed_stop(ranks, reason, stop_requested)
                if reason:
                    status = reason
                    if not saved:  # saving this step again would push its previous generation out
                        save_run(Path(config.out_dir), config, run.model, run.optimizer, state, ranks)
                    break
    summary = run_summary(
        status, diverged_step, config, state, recipe, device, run.paths, world_size=ranks.world,
        stop_signal=stop_requested[0] if status in ("preempted", "interrupted") else None,
        cuda_graph=run.train_step.graph is not None if isinstance(run.train_step, TrainStep) else False,
        gather_bytes_per_step=run.model.gather_bytes.per_step() if config.gather_weights == "encoded" else None,
        resumed_from_step=resumed_from_step,
    )
    run.metrics.close(summary)
    if ranks.main:
        write_json(Path(config.out_dir) / "summary.json", summary)
    return summary


def _start(config: TrainConfig, recipe: Recipe, ranks: distributed.Ranks, device: torch.device, progress) -> _Run:
    """Data, the compute paths (said on the run's first log line), model, optimizer, step, probes'
    settings, operand capture, the resumed state, config.json and the metrics log."""
    out = Path(config.out_dir)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with ranks.main_first():  # one rank builds a dataset cache, the others read it
        data = load_dataset(config.data, progress=ranks.main and _interactive(progress))
    model_config = preset(config.model, data.vocab_size, config.seq_len)
    chosen = paths.resolve(config, device, model_config.head_dim)
    model, optimizer, loss_fn = build_training(config, recipe, model_config, device, ranks, paths=chosen)
    if ranks.mode == "pp":
        train_step = loss_fn.step
        chosen = paths.with_cuda_graphs(chosen, config, None, mode_blocker="a pipeline schedule runs each step")
    else:
        mode_blocker = None
        if not distributed.graphs_possible(config):
            mode_blocker = "config cuda_graphs='off'" if config.cuda_graphs == "off" else f"parallel={config.parallel!r}: its hooks run outside any graph"
        blocker = cuda_graph_blocker(model) if mode_blocker is None else None
        chosen = paths.with_cuda_graphs(chosen, config, blocker, mode_blocker)
        warmup = distributed.DDP_GRAPH_WARMUP_STEPS if ranks.mode == "ddp" else GRAPH_WARMUP_STEPS
        train_step = TrainStep(model, loss_fn, chosen.cuda_graphs, warmup, graphed_probes=ranks.mode != "ddp")
    if ranks.main:
        _say_how_it_runs(config, device, chosen)
    qk_clip, tau = qk_clip_setting(config, recipe)
    capture = None
    if config.capture_steps and ranks.main:  # rank 0's rows stand for the batch: one record per run
        capture = OperandCapture(config, model, recipe, model_config.n_layers, chosen.compile)
    state = resume_run(out, config, model, optimizer, ranks, loss_fn.whole_optimizer_order if ranks.mode == "pp" else None)
    if ranks.main and state.step:
        print(f"resumed from step {state.step} of {config.steps} (the checkpoint in {out})", file=sys.stderr, flush=True)
    identity = {  # the resolved run: the config's "auto" and "the recipe's" as this run has them
        "config": config.to_dict() | recipe_settings(config, recipe) | {"device": str(device)},
        "recipe": {"name": recipe.name, "path": recipe.path, "source": recipe.source},
        "model": model_config.__dict__,
        "parameters": count_parameters(model_config),
        "dataset": {"name": data.name, "vocab_size": data.vocab_size, "train_tokens": len(data.train), "val_tokens": len(data.val)},
        "optimizer": {"qk_clip": qk_clip, "qk_clip_tau": tau},
    }
    identity["world_size"] = ranks.world  # this segment's: a resumed run may run on another number of ranks
    identity["environment"] = environment(device)
    if ranks.mode == "pp":
        from fp4lab.train.pipeline import schedule_name

        identity["pipeline_schedule"] = schedule_name()
    if ranks.main:
        write_json(out / "config.json", identity)
    return _Run(
        config, recipe, ranks, device, chosen, model, optimizer, loss_fn, train_step,
        sampler=BatchSampler(data.train, config.batch_size, config.seq_len, config.seed),
        evaluation=val_batches(data.val, config.batch_size, config.seq_len, config.eval_batches),
        qk_clip=qk_clip, tau=tau, capture=capture, state=state,
        metrics=open_run_log(config, identity, out, state.step, MetricsLog(out / "metrics.jsonl", resume_step=state.step))
        if ranks.main else _Silent(),
        trial=TrialReporter(config.optuna_trial) if config.optuna_trial and ranks.main else None,
    )


def _say_how_it_runs(config: TrainConfig, device: torch.device, chosen: paths.ComputePaths) -> None:
    """The run's first log lines: where it trains (and why, for device "auto"), its compute paths, and
    that compiling makes the first steps slow, so a minute of silence is not mistaken for a hang."""
    if config.device == "auto":
        found = f"a GPU is here: {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "no GPU here"
        print(f"device auto: training on {device} ({found}; --device cpu or cuda chooses)", file=sys.stderr, flush=True)
    print(chosen.describe(), file=sys.stderr, flush=True)
    if chosen.compile:
        print("compiling (torch.compile): the first steps take a while, about a minute on a fresh compile cache and "
              "10-25 s with a warm one (an H200, 125m)", file=sys.stderr, flush=True)


def _train_one_step(run: _Run, step: int) -> dict[str, Any]:
    """Step `step`: its metrics record ("diverged": True where the loss, gradient norm or validation
    loss is not finite; the state advances only past a step whose loss and gradient norm were)."""
    config, recipe, ranks, model, optimizer, state = run.config, run.recipe, run.ranks, run.model, run.optimizer, run.state
    qk_clip, tau, capture = run.qk_clip, run.tau, run.capture
    if recipe.lora_svd_rank and step % recipe.lora_svd_every == 0:
        _realign_low_rank(model)
    optimizer.set_lr_scale(lr_factor(config, step))
    probing = step % config.probe_every == 0 or step == config.steps - 1  # the final state is probed too
    _set_probes(model, probing, record_max_logits=probing or qk_clip == "kimi")

    tic = time.perf_counter()
    x, y = (ranks.rows(t).to(run.device) for t in run.sampler.batch(step))
    lr = optimizer.param_groups[0]["lr"]
    capturing = capture is not None and step in capture.steps
    with capture.recording() if capturing else contextlib.nullcontext():
        loss = run.train_step(x, y, eager=capturing, probing=probing)
    if capturing:
        capture.write(step)
    train_step = run.train_step
    grad_norm = clip_and_step(model, optimizer, config.grad_clip, keep_grads=train_step.graphed, pipelined=ranks.mode == "pp")
    if ranks.mode != "pp":  # (the pipeline's loss is the global batch's on every rank already)
        loss = ranks.mean(loss)  # every rank logs and decides on the loss of the global batch
    if ranks.world > 1 and ranks.mode != "pp" and (probing or qk_clip == "kimi"):
        _reduce_probes(model, ranks, probing)
    # Read back only now, so the GPU never waits for the host mid-step. A NaN/Inf step has
    # updated the weights, but the run ends here without a checkpoint.
    record: dict[str, Any] = {"step": step, "loss": loss.item(), "lr": lr}
    if not math.isfinite(record["loss"]):
        return record | {"diverged": True}
    record["grad_norm"] = grad_norm.item()
    if not math.isfinite(record["grad_norm"]):
        return record | {"diverged": True}
    if qk_clip == "kimi":
        clipped = _apply_qk_clip(model, tau, bool(recipe.lora_svd_rank))
        # Under pp each rank clipped the heads of its own blocks.
        record["qk_clipped_heads"] = ranks.total(clipped) if ranks.mode == "pp" else clipped
        state.qk_clip_events += record["qk_clipped_heads"]
    elapsed = time.perf_counter() - tic

    tokens_per_step = config.batch_size * config.seq_len
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
        record["val_loss"] = evaluate(model, run.loss_fn, run.evaluation, run.device, ranks)
        state.last_val_loss = record["val_loss"]
        state.best_val_loss = min(state.best_val_loss, record["val_loss"])
        if not math.isfinite(record["val_loss"]):
            record["diverged"] = True
    return record


class _Silent:
    """The metrics log of ranks other than 0: one run, one record."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self, summary: dict[str, Any] | None = None) -> None:
        pass


# --- helpers ---------------------------------------------------------------------------------------


def _interactive(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else progress


def _set_probes(model: Llama, probing: bool, record_max_logits: bool) -> None:
    for attention in model.attentions():
        attention.probe = probing
        attention.record_max_logits = record_max_logits
    for linear in fp4_linears(model).values():
        linear.probe = probing
        linear.quant_stats = {}


def _probe_record(model: Llama, ranks: distributed.Ranks) -> dict[str, Any]:
    blocks = [int(index) for index, _ in model.layers.named_children()]
    # One host read for every layer's entropy and max logits (float64 holds either dtype exactly).
    attentions = list(model.attentions())
    read = torch.stack([torch.stack([a.last_entropy, a.last_max_logits]).to(torch.float64) for a in attentions]).tolist() if attentions else []
    attention = {i: (entropy, max_logits) for i, (entropy, max_logits) in zip(blocks, read)}
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
    attentions = list(model.attentions())
    # One read of every layer's max logits: qk_clip_ computes its factors on host values, and reading
    # each layer's on its own waited for the GPU once a layer.
    max_logits = torch.stack([attention.last_max_logits for attention in attentions]).cpu()
    for attention, layer_max_logits in zip(attentions, max_logits):
        gammas = qk_clip_(
            attention.wq.weight, attention.wk.weight, layer_max_logits, tau,
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


def _stop_reason(config, started, stop_requested, stop_after, steps_this_call, pruned=False) -> str | None:
    if stop_requested:
        return "interrupted" if stop_requested[0] == "SIGINT" else "preempted"
    if pruned:
        return "pruned"
    if config.max_minutes is not None and time.monotonic() - started > 60 * config.max_minutes:
        return "time_limit"
    if stop_after is not None and steps_this_call >= stop_after:
        return "stopped"
    return None


STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)
# What ranks agree on after each step, by precedence (the largest wins): a signal, rank 0's pruner, the
# time limit, stop_after.
_SIGNAL_NAMES = tuple(s.name for s in STOP_SIGNALS)
_STOP_CODES = (None, "stopped", "time_limit", "pruned", *_SIGNAL_NAMES)


def _agreed_stop(ranks: distributed.Ranks, reason: str | None, stop_requested: list[str]) -> str | None:
    """One stop decision on every rank: a signal one rank received (torchrun or Slurm may deliver it to
    one process first) or one rank's clock passing max_minutes stops all of them after the same step."""
    code = _STOP_CODES.index(stop_requested[0] if stop_requested else reason)
    agreed = _STOP_CODES[ranks.agree(code)]
    if agreed in _SIGNAL_NAMES:
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
        step = record["step"]  # as metrics.jsonl, status, scan and the plots count: from 0 to steps - 1
        if (step + 1) % every == 0 or step == config.steps - 1 or "val_loss" in record:
            val = f" val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""
            print(f"step {step}/{config.steps - 1} loss {record['loss']:.4f}{val} lr {record['lr']:.3g} tok/s {record['tokens_per_s']:.0f}", file=sys.stderr, flush=True)

    yield advance


