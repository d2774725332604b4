"""What data parallelism costs at world size 1: one rank of DDP or FSDP2 (NCCL) against the same step
in one process, forward+backward and clipping+optimizer timed apart (CUDA).

    python scripts/parallel_overhead.py nvfp4 fsdp on            # recipe, parallel, compile
    python scripts/parallel_overhead.py bf16 fsdp whole          # the whole loss compiled (before per-block)
    FP4LAB_GATHER=encoded python scripts/parallel_overhead.py nvfp4 fsdp on

One rank moves no bytes between GPUs, so what it adds over `parallel=none` is the wrappers' own work
(hooks, copies, DTensor dispatch, compile graph breaks): the floor under any multi-GPU scaling figure.
Random tokens, 16 x 1024, 4 warm-up steps, mean of 10. Figures: docs/BENCHMARKS.md.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from fp4lab.nn.model_config import preset
from fp4lab.nn.recipe import load_recipe
from fp4lab.train import distributed
from fp4lab.train.build import build_training
from fp4lab.train.config import TrainConfig
from fp4lab.train.step import clip_and_step

BATCH, SEQ, VOCAB, WARMUP, TIMED = 16, 1024, 50304, 4, 10


def main(recipe_name: str, parallel: str, compile_mode: str, model: str = "125m") -> None:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    whole = compile_mode == "whole"
    config = TrainConfig.from_dict({
        "recipe": recipe_name, "model": model, "device": "cuda", "batch_size": BATCH, "seq_len": SEQ,
        "parallel": parallel, "compile": "off" if whole else compile_mode, "out_dir": "unused",
        "gather_weights": os.environ.get("FP4LAB_GATHER", "dense"),
    })
    ranks, device = distributed.init(config, torch.device("cuda"))
    model_, optimizer, loss_fn = build_training(config, load_recipe(recipe_name), preset(model, VOCAB, SEQ), device, ranks)
    if whole:
        loss_fn = torch.compile(loss_fn)
    x, y = (torch.randint(0, VOCAB, (BATCH, SEQ), device=device) for _ in range(2))

    def forward_backward() -> torch.Tensor:
        loss = loss_fn(x, y)
        loss.backward()
        return loss

    for _ in range(WARMUP):
        forward_backward()
        clip_and_step(model_, optimizer, 1.0)
    torch.cuda.synchronize()
    compute = update = 0.0
    for _ in range(TIMED):
        t0 = time.perf_counter()
        loss = forward_backward()
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        clip_and_step(model_, optimizer, 1.0)
        ranks.mean(loss).item()
        torch.cuda.synchronize()
        compute, update = compute + t1 - t0, update + time.perf_counter() - t1
    print(f"{recipe_name} {parallel} gather={config.gather_weights} compile={compile_mode} {model}: "
          f"fwd+bwd {1e3 * compute / TIMED:.2f} ms, clip+optimizer {1e3 * update / TIMED:.2f} ms, "
          f"{BATCH * SEQ * TIMED / (compute + update):.0f} tokens/s", flush=True)
    distributed.close(ranks)


if __name__ == "__main__":
    main(*sys.argv[1:])
