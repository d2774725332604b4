"""Building a run: the model, its optimizer and the loss function one training step calls, on the
compute paths the run's `train.paths.ComputePaths` chose (the training loop and `fp4lab bench` both
build here)."""

from __future__ import annotations

import os
from typing import Any

import torch

from fp4lab.nn.build import build_model
from fp4lab.nn.model import Llama
from fp4lab.nn.model_config import ModelConfig
from fp4lab.nn.recipe import Recipe
from fp4lab.optim.build import OptimizerConfig, build_optimizer
from fp4lab.optim.muon import NS_POLYNOMIALS
from fp4lab.train import distributed
from fp4lab.train.config import ConfigError, TrainConfig
from fp4lab.train.paths import ComputePaths, resolve
from fp4lab.train.step import LossFn


def resolve_device(name: str) -> torch.device:
    """The torch device a config's `device` names: "auto" is the GPU when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but CUDA is not available here; use device='cpu' (or 'auto')")
    return torch.device(name)


def build_training(
    config: TrainConfig, recipe: Recipe, model_config: ModelConfig, device: torch.device,
    ranks: distributed.Ranks | None = None, *, paths: ComputePaths | None = None,
) -> tuple[Llama, Any, LossFn]:
    """The model, its optimizer and the loss function one training step calls, on `paths` (the run's
    record; `train.paths.resolve` of config and device when not given): the fast path (bf16 autocast,
    tensor-core GEMMs, fused kernels and AdamW on CUDA) or the fp32 reference, and torch.compile or
    not. `ranks`: the model wrapped for data parallelism (DDP, FSDP2); the returned
    model is the Llama itself (its parameters DTensor shards under FSDP2), the loss function runs the
    wrapper. Under pp the model keeps this rank's blocks only and the loss function is the
    train.pipeline.Pipeline (evaluation's forward; its `step` trains)."""
    ranks = ranks or distributed.Ranks()
    paths = paths or resolve(config, device, model_config.head_dim)
    fast = paths.tensor_cores
    if fast and device.type == "cuda":
        fast_path_process_settings()
    torch.manual_seed(config.seed)
    model = build_model(
        model_config, recipe, seed=config.seed, device=device, tensor_cores=fast, fused_quantizers=paths.fused_quantizers,
        attention_kernel=paths.attention_kernel, mx_gemm=paths.mx_gemm, producer_fusion=paths.producer_fusion,
        recompute_gate_up=("compiled" if paths.compile else "eager") if paths.recompute == "gate-up" else "off",
    )
    settings = optimizer_config(config, recipe, fused=paths.fused_optimizer)
    if ranks.mode == "pp":
        # Every block lives on one rank and sees the whole batch: its random streams stay the one-process ones.
        from fp4lab.train.pipeline import DUALPIPE_V, Pipeline

        # A one-process checkpoint keys optimizer state by position in the whole model's optimizer: its
        # names in that order, while the model is whole (an optimizer allocates no state until it steps).
        names = {id(p): n for n, p in model.named_parameters()}
        whole = build_optimizer(model.named_parameters(), settings).optimizers
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

    optimizer = build_optimizer(model.named_parameters(), settings)

    if not paths.compile:
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


# PyTorch's process settings as they were before the first fast-path build changed them.
_PLAIN_SETTINGS: dict[str, bool] = {}


def fast_path_process_settings() -> None:
    """The process settings a fast-path run on CUDA needs. bf16-output GEMMs reduce in fp32 (no bf16
    split-K partial sums): the fast path claims fp32 accumulation, exactly what an FP4 tensor core
    does. And deterministic algorithms (`deterministic_cuda`). `plain_pytorch_settings` undoes both."""
    _PLAIN_SETTINGS.setdefault("bf16_reduction", torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    _PLAIN_SETTINGS.setdefault("deterministic", torch.are_deterministic_algorithms_enabled())
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    deterministic_cuda()


def plain_pytorch_settings() -> None:
    """The settings this process had before `fast_path_process_settings`, so a plain PyTorch loop timed
    after an fp4lab run in the same process (`bench steps`' anchors) runs as it would alone."""
    if _PLAIN_SETTINGS:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = _PLAIN_SETTINGS["bf16_reduction"]
        torch.use_deterministic_algorithms(_PLAIN_SETTINGS["deterministic"])


def deterministic_cuda() -> None:
    """Make two identical runs on CUDA give the same bits, for this whole process.

    PyTorch's SDPA backward (flash and memory-efficient), the attention of the fast path wherever the
    Triton kernel does not run it, adds the key blocks' shares of dQ with float atomic adds, in
    whatever order the blocks finish; with deterministic algorithms on (not warn-only, which keeps
    the atomics) it reduces in a fixed order. Under torch.compile (torch 2.11) Inductor then also
    runs index_put's accumulation (the embedding's backward) as the eager sort-based kernel instead of
    atomic adds, and picks reduction configs without benchmarking them. An op with no deterministic
    implementation raises, naming itself, rather than changing bits silently. Torch insists on a
    fixed cuBLAS workspace setting (CUBLAS_WORKSPACE_CONFIG) in this mode. The NaN fill of every
    uninitialised allocation that the mode also turns on makes nothing reproducible, only slower: it
    stays off. The Triton kernels add nothing with float atomics (their amaxes fold int32 bits with
    atomic max, which no order changes)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def recipe_settings(config: TrainConfig, recipe: Recipe) -> dict[str, Any]:
    """The config fields whose None means "what the recipe says", as this run has them."""
    qk_clip, tau = qk_clip_setting(config, recipe)
    opt = recipe.optimizer
    return {"optimizer": config.optimizer or opt.name or "muon", "ns_polynomial": config.ns_polynomial or opt.ns_polynomial,
            "qk_clip": qk_clip, "qk_clip_tau": tau}  # fmt: skip


def optimizer_config(config: TrainConfig, recipe: Recipe, fused: bool) -> OptimizerConfig:
    """The optimizer settings of a run: the config's over the recipe's [optimizer] table."""
    opt = recipe.optimizer
    settings = recipe_settings(config, recipe)
    cap = (opt.update_cap_alpha, opt.update_cap_alpha_qk) if settings["qk_clip"] == "update_cap" else None
    return OptimizerConfig(
        name=settings["optimizer"],
        lr=config.lr,
        adam_lr=config.adam_lr,
        weight_decay=config.weight_decay,
        ns_steps=config.ns_steps,
        ns_coefficients=NS_POLYNOMIALS[settings["ns_polynomial"]],
        lr_scaling=config.lr_scaling,
        ns_format=opt.ns_format,
        adam_v_format=opt.adam_v_format,
        update_cap=cap,
        fused=fused,
    )


def qk_clip_setting(config: TrainConfig, recipe: Recipe) -> tuple[str, float]:
    """The run's QK-Clip ("none", "kimi", "update_cap") and tau: the config's over the recipe's."""
    return config.qk_clip or recipe.optimizer.qk_clip, config.qk_clip_tau or recipe.optimizer.qk_clip_tau
