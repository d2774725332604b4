"""Pipeline parallelism (`TrainConfig.parallel = "pp"`) on torch.distributed.pipelining, torchtitan's
split: each rank keeps the Llama it built with the transformer blocks of the other ranks removed (and
the embedding, or the final norm and head, where another rank holds them), so every parameter keeps
its one-process name (`layers.3.attention.wq.weight`) and DCP checkpoints load across layouts.

Schedule: ScheduleDualPipeV where this torch has it (DeepSeek's DualPipe in its V form: 2 stages per
rank, rank r holding stages r and 2N-1-r, so rank 0 holds both the embedding and the head), else
Schedule1F1B (one stage per rank, the head on the last rank). The blocks split into the stages in
order, as evenly as they go.

Every rank draws the whole global batch (`Ranks.rows`); the schedule cuts it into `pp_microbatches`
equal microbatches. The loss of a microbatch is its mean cross entropy and the schedule divides the
accumulated gradients by the number of microbatches (`scale_grads`), so the gradient is that of the
global batch's mean loss, and the logged loss, the mean of the microbatch losses, is the global
batch's mean, broadcast from the rank of the last stage: one process's values up to summation order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, schedules

from fp4lab.nn.attention import Attention
from fp4lab.nn.model import Llama
from fp4lab.train.config import ConfigError

# DualPipeV came with torch 2.8; earlier versions run 1F1B.
DUALPIPE_V = getattr(schedules, "ScheduleDualPipeV", None)


def schedule_name(dualpipe: bool = DUALPIPE_V is not None) -> str:
    return "ScheduleDualPipeV" if dualpipe else "Schedule1F1B"


def stages_per_rank(dualpipe: bool = DUALPIPE_V is not None) -> int:
    return 2 if dualpipe else 1


def stage_blocks(n_layers: int, n_stages: int) -> list[range]:
    """The blocks of each stage: contiguous, the first n_layers % n_stages stages one more."""
    size, extra = divmod(n_layers, n_stages)
    starts = [s * size + min(s, extra) for s in range(n_stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(n_stages)]


def rank_stages(rank: int, world: int, dualpipe: bool) -> list[int]:
    """The stages rank `rank` holds: r, and under DualPipeV's V also 2N-1-r."""
    return [rank, 2 * world - 1 - rank] if dualpipe else [rank]


class _Blocks(nn.ModuleDict):
    """A rank's transformer blocks under their one-process indices (`layers.3.` stays `layers.3.`);
    iterates the blocks in order, as the Llama's ModuleList does, so the loop's walks over
    `model.layers` (probes, QK-Clip, compile per block) see this rank's blocks."""

    def __iter__(self):
        return iter(self.values())


class _Stage(nn.Module):
    """One stage's part of Llama.forward (embedding on the first, final norm and head on the last),
    sharing the rank's modules; the fast path's autocast is entered here, per microbatch forward."""

    def __init__(self, model: Llama, blocks: range, first: bool, last: bool, fast: bool):
        super().__init__()
        self.tok_embeddings = model.tok_embeddings if first else None
        self.blocks = nn.ModuleList(model.layers[str(i)] for i in blocks)
        self.norm, self.output = (model.norm, model.output) if last else (None, None)
        self.embedding_dtype, self.fast = model.embedding_dtype, fast
        self.rope = (model.rope_cos, model.rope_sin)  # not registered: the model's buffers, shared

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.autocast(h.device.type, dtype=torch.bfloat16, enabled=self.fast):
            if self.tok_embeddings is not None:  # as Llama.forward
                h = self.tok_embeddings(h).to(self.embedding_dtype).float()
            seq = h.shape[1]
            for block in self.blocks:
                h = block(h, self.rope[0][:seq], self.rope[1][:seq])
            if self.output is not None:
                h = self.output(self.norm(h)).float()
        return h


def _microbatch_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Llama.loss on one microbatch's logits: the mean cross entropy of its tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class Pipeline:
    """The rank's stages and their schedule. `pipeline(tokens, targets)` is the loss function of
    evaluation (forward only, no gradient, the whole batch at once); `pipeline.step` is the training
    step. Both take the whole global batch on every rank and return its mean loss on every rank.
    Attention probes cover every microbatch; the FP4 linears' saturation and flush fractions are those
    of the last microbatch each linear ran (they are overwritten per call, as rank 0's rows stand for
    the batch under DDP)."""

    # Set by train.loop.build_training before the split: the whole model's optimizers' parameter names in
    # position order, which a one-process checkpoint's optimizer state is keyed by.
    whole_optimizer_order: dict[str, list[str]]

    def __init__(self, model: Llama, world: int, rank: int, device: torch.device, microbatch: tuple[int, int], microbatches: int,
                 fast: bool, dualpipe: bool):
        """`microbatch`: its (rows, seq_len)."""
        n_stages = world * stages_per_rank(dualpipe)
        blocks = stage_blocks(model.config.n_layers, n_stages)
        if any(len(b) == 0 for b in blocks):
            raise ConfigError(
                f"parallel='pp' with {schedule_name(dualpipe)} on {world} ranks needs {n_stages} stages of at least one "
                f"transformer block, but the model has {model.config.n_layers}; use fewer ranks or a deeper model"
            )
        mine = rank_stages(rank, world, dualpipe)
        self.owners = [r for s in range(n_stages) for r in range(world) if s in rank_stages(r, world, dualpipe)]
        self.rank, self.dim = rank, model.config.dim
        self.first, self.last = 0 in mine, n_stages - 1 in mine
        self.last_rank = 0 if dualpipe else world - 1
        # The model was built whole, so its weights are those of one process (the same initialisation
        # order); the other ranks' parts go now.
        model.layers = _Blocks({str(i): model.layers[i] for s in sorted(mine, key=lambda s: blocks[s].start) for i in blocks[s]})
        if not self.first:
            model.tok_embeddings = None
        if not self.last:
            model.norm = model.output = None
        self.modules = {s: _Stage(model, blocks[s], s == 0, s == n_stages - 1, fast) for s in mine}
        # Static shapes: without them the schedule's first step infers them by running each stage on
        # stand-in inputs, which draws from the layers' SR and Hadamard streams (a resumed run would
        # draw other bits than an uninterrupted one) and records their probes.
        tokens = torch.empty(microbatch, dtype=torch.int64, device="meta")
        hidden = torch.empty(*microbatch, self.dim, device="meta", requires_grad=True)  # the fp32 residual stream
        logits = torch.empty(*microbatch, model.config.vocab_size, device="meta")
        self.stages = [
            PipelineStage(self.modules[s], s, n_stages, device, input_args=tokens if s == 0 else hidden,
                          output_args=logits if s == n_stages - 1 else hidden,
                          input_grads=None if s == 0 else hidden, output_grads=None if s == n_stages - 1 else hidden)
            for s in mine
        ]
        schedule = DUALPIPE_V if dualpipe else Schedule1F1B
        self.schedule = schedule(self.stages if dualpipe else self.stages[0], n_microbatches=microbatches,
                                 loss_fn=_microbatch_loss, scale_grads=True)
        self.device = device
        self.attentions = model.attentions()
        for attention in self.attentions:
            attention.register_forward_hook(self._accumulate_probes)
        self._max_logits: dict[Attention, torch.Tensor] = {}
        self._entropy: dict[Attention, list[torch.Tensor]] = {}
        self.step = PipelineStep(self)

    @torch.no_grad()
    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The whole batch through the stages in order, each activation sent to the next stage's rank.
        Not through the schedule: DualPipeV's runtime has no forward-only mode (its eval() runs the
        backward actions too), and without microbatches the GEMMs see the rows one process's do."""
        h = tokens
        for s, owner in enumerate(self.owners):
            if owner != self.rank:
                continue
            if s > 0 and self.owners[s - 1] != owner:
                h = torch.empty(*tokens.shape, self.dim, device=self.device)
                dist.recv(h, src=self.owners[s - 1])
            h = self.modules[s](h)
            if s < len(self.owners) - 1 and self.owners[s + 1] != owner:
                dist.send(h, dst=self.owners[s + 1])
        return self._on_every_rank([_microbatch_loss(h, targets)] if self.last else [])

    def train(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every microbatch; the gradients of the global batch's mean loss in
        `.grad`; the attention probes of this rank's blocks over all microbatches."""
        self._max_logits, self._entropy = {}, {}
        losses: list[torch.Tensor] = []
        self.schedule.step(*self._inputs(tokens), target=self._target(targets), losses=losses)
        for attention in self.attentions:
            if attention in self._max_logits:  # QK-Clip acts on the max over the whole batch
                attention.last_max_logits = self._max_logits[attention]
            if attention in self._entropy:  # the mean over microbatches of each one's probe rows
                attention.last_entropy = torch.stack(self._entropy[attention]).mean(0)
        return self._on_every_rank(losses)

    def _inputs(self, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (tokens,) if self.first else ()

    def _target(self, targets: torch.Tensor) -> torch.Tensor | None:
        return targets if self.last else None

    def _accumulate_probes(self, attention: Attention, _args, _output) -> None:
        # Each microbatch's forward overwrites the attention's probes; keep what every one recorded.
        if attention.record_max_logits:
            seen = self._max_logits.get(attention)
            logits = attention.last_max_logits
            self._max_logits[attention] = logits if seen is None else torch.maximum(seen, logits)
        if attention.probe:
            self._entropy.setdefault(attention, []).append(attention.last_entropy)

    def _on_every_rank(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the microbatch losses (equal sizes: the global batch's mean), from the last
        stage's rank to every rank, so that all log and decide alike."""
        loss = torch.stack(losses).detach().float().mean() if self.last else torch.zeros((), device=self.device)
        dist.broadcast(loss, src=self.last_rank)
        return loss


class PipelineStep:
    """The training step under pp, with TrainStep's interface (no CUDA graph: steps run eagerly)."""

    graphed = False
    graph = None

    def __init__(self, pipeline: Pipeline):
        self.pipeline = pipeline

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor, eager: bool = False, probing: bool = False) -> torch.Tensor:
        return self.pipeline.train(tokens, targets)
