"""One training step and the evaluation: forward and backward (eager, or replayed from a CUDA graph),
gradient clipping and the optimizer step, and the validation loss with every random stream put back."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from fp4lab.nn.build import attention_generators, fp4_linears, graph_generators
from fp4lab.nn.model import Llama
from fp4lab.optim.sharding import clip_grad_norm_
from fp4lab.train import distributed

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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
    `probing=True` (the model's probes switched on) replays a second graph, captured at the first
    probing call after an eager probing step has compiled its kernels and sharing the first graph's
    memory pool (the two never run at once); after each replay the probes' tensors the capture
    recorded (attention entropies and max logits, the linears' saturated and flushed fractions) are
    put back on the modules, so a probe step costs about what a normal step does; with
    `graphed_probes=False` (DDP, whose reducer settles over many eager steps before a capture) probe
    steps run eagerly. `eager=True` runs a step eagerly (operand capture, whose hooks run on the
    host); every kind of step accumulates into the same gradient tensors, so they interleave freely.
    """

    def __init__(self, model: Llama, loss_fn: LossFn, graphed: bool, warmup: int = GRAPH_WARMUP_STEPS, graphed_probes: bool = True):
        self.model, self.loss_fn, self.graphed, self.warmup = model, loss_fn, graphed, warmup
        self.graphed_probes = graphed_probes
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.graphs: dict[bool, _Captured] = {}  # by probing
        self.probed_eagerly = False
        self.warmed = 0

    @property
    def graph(self) -> torch.cuda.CUDAGraph | None:
        """A captured graph (the normal steps', else the probing steps'), or None before the capture."""
        captured = self.graphs.get(False) or self.graphs.get(True)
        return captured.graph if captured is not None else None

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor, eager: bool = False, probing: bool = False) -> torch.Tensor:
        if not self.graphed or eager or (probing and not (self.graphed_probes and self.probed_eagerly)):
            self.probed_eagerly |= probing
            self._zero_grads()
            return self._forward_backward(tokens, targets)
        if not self.graphs and self.warmed < self.warmup:
            self.warmed += 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._zero_grads()
                loss = self._forward_backward(tokens, targets)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if probing not in self.graphs:
            self.graphs[probing] = self._capture(tokens, targets)
        captured = self.graphs[probing]
        self.static_tokens.copy_(tokens)
        self.static_targets.copy_(targets)
        captured.graph.replay()
        captured.restore()  # an eager step, or the other graph's capture, may have replaced them
        return captured.loss

    def _forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(tokens, targets)
        loss.backward()
        return loss.detach()

    def _zero_grads(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def _capture(self, tokens: torch.Tensor, targets: torch.Tensor) -> _Captured:
        if not self.graphs:
            self.static_tokens, self.static_targets = tokens.clone(), targets.clone()
        pool = next(iter(self.graphs.values())).graph.pool() if self.graphs else None
        graph = torch.cuda.CUDAGraph()
        for generator in graph_generators(self.model):
            graph.register_generator_state(generator)
        with torch.cuda.graph(graph, pool=pool):
            self._zero_grads()
            loss = self._forward_backward(self.static_tokens, self.static_targets)
        return _Captured(graph, loss, _recorded_probes(self.model))


class _Captured:
    """A captured step: its graph, its loss tensor and the probe tensors its replays refresh."""

    def __init__(self, graph: torch.cuda.CUDAGraph, loss: torch.Tensor, probes: list[tuple[object, str, object]]):
        self.graph, self.loss, self.probes = graph, loss, probes

    def restore(self) -> None:
        for module, name, value in self.probes:
            setattr(module, name, dict(value) if isinstance(value, dict) else value)


def _recorded_probes(model: Llama) -> list[tuple[object, str, object]]:
    """(module, attribute, value) of what the probes recorded in the step just run: each attention's
    max logits (where recorded) and entropies (where probing), each FP4 linear's fractions."""
    recorded = []
    for attention in model.attentions():
        if attention.record_max_logits:
            recorded.append((attention, "last_max_logits", attention.last_max_logits))
        if attention.probe:
            recorded.append((attention, "last_entropy", attention.last_entropy))
    for linear in fp4_linears(model).values():
        if linear.probe:
            recorded.append((linear, "quant_stats", dict(linear.quant_stats)))
    return recorded


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
