"""What one training step keeps for its backward pass, counted on any machine (no GPU needed).

Builds a run's model, optimizer and loss exactly as `fp4lab train` does (`train.build.build_training`;
`--compute fast` is the GPU's path of bf16 autocast and tensor-core GEMMs, run on the CPU), runs one
forward, and adds up every distinct tensor storage kept for the backward: what ops save (compiled
graphs and eager ops alike, seen by a saved-tensors hook) and FP4Linear's operands kept on its
context (codes and scales, or values), found by walking the autograd graph from the loss. Weights and buffers are left out. The sum is the
activation memory a step holds at the end of its forward, which on a GPU sits under the peak with
the weights, gradients and optimizer state. On the CPU the fused Triton quantizers do not run, so
an FP4 linear keeps bf16 values where on CUDA it keeps packed codes and scales.

    python scripts/saved_for_backward.py nvfp4 --model 125m --seq-len 1024 --vocab 32768
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fp4lab.nn.model_config import preset  # noqa: E402
from fp4lab.nn.recipe import load_recipe  # noqa: E402
from fp4lab.train import paths  # noqa: E402
from fp4lab.train.build import build_training  # noqa: E402
from fp4lab.train.config import TrainConfig  # noqa: E402


def tensors_in(value, depth: int = 0):
    """The tensors inside a node's attribute: directly, or in dataclasses, sequences and dicts."""
    if depth > 4:
        return
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            yield from tensors_in(getattr(value, field.name), depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors_in(item, depth + 1)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item, depth + 1)


def kept_for_backward(run: Callable[[], torch.Tensor], excluded: set[int]) -> tuple[torch.Tensor, collections.Counter]:
    """`run()`'s loss, and bytes by (what keeps it, dtype, shape) of the distinct storages its graph
    holds for the backward: every tensor an op saves (seen by a saved-tensors hook around `run`, so a
    tensor that an inner hook gives up for recomputation is not counted, nor made again), and what
    custom Functions keep on their context (FP4Linear's operands). Storages in `excluded` are left out."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = run()
    found = [("saved", t) for t in saved]
    seen_nodes, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        found += [(type(node).__name__, t) for t in tensors_in(getattr(node, "__dict__", {}))]  # a custom Function's context
        stack += [next_node for next_node, _ in node.next_functions]
    kept: collections.Counter = collections.Counter()
    seen_storages = set(excluded)
    for holder, tensor in found:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen_storages or storage.nbytes() == 0:
            continue
        seen_storages.add(storage.data_ptr())
        kept[(holder, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))] += storage.nbytes()
    return loss, kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--compute", default="fast", choices=("fast", "reference"))
    parser.add_argument("--compile", default="on", choices=("on", "off"))
    parser.add_argument("--recompute", default="off", choices=("off", "gate-up"))
    parser.add_argument("--top", type=int, default=12, help="rows of the table")
    args = parser.parse_args()

    device = torch.device("cpu")
    config = TrainConfig(recipe=args.recipe, model=args.model, batch_size=args.batch_size, seq_len=args.seq_len, device="cpu",
                         compute=args.compute, compile=args.compile, recompute=args.recompute, optimizer="adamw")
    model_config = preset(args.model, args.vocab, args.seq_len)
    model, _, loss_fn = build_training(config, load_recipe(args.recipe), model_config, device,
                                       paths=paths.resolve(config, device, model_config.head_dim))
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(args.vocab, (args.batch_size, args.seq_len), generator=g) for _ in range(2))
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    _, kept = kept_for_backward(lambda: loss_fn(tokens, targets), excluded)

    total, tokens_n = sum(kept.values()), args.batch_size * args.seq_len
    print(f"{args.recipe} {args.model} ({args.batch_size} x {args.seq_len} tokens, vocab {args.vocab}, compute {args.compute}, "
          f"compile {args.compile}, recompute {args.recompute}): {total / 2**20:,.1f} MiB kept for the backward, {total / tokens_n:,.0f} bytes a token")
    for (holder, dtype, shape), size in kept.most_common(args.top):
        print(f"  {size / 2**20:9.2f} MiB  {holder} {dtype} {list(shape)}")


if __name__ == "__main__":
    main()
