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
        for generator in graph_generators(self.model):
            self.graph.register_generator_state(generator)
        with torch.cuda.graph(self.graph):
            self._zero_grads()
            self.static_loss = self._forward_backward(self.static_tokens, self.static_targets)
        self.captured_logits = [(a, a.last_max_logits) for a in self.model.attentions() if a.record_max_logits]


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
