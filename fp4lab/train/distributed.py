"""Data-parallel training on torch.distributed: the process group torchrun describes, the rank's
slice of each global batch, collectives over the loop's numbers, and the model wrapped for
`TrainConfig.parallel`:

    none   one process (WORLD_SIZE unset or 1): the loop runs exactly as without this module
    ddp    DistributedDataParallel: replicated parameters, gradients averaged by all-reduce
    fsdp   FSDP2 `fully_shard` on every transformer block, then the root (torchtitan's pattern)
    hsdp   FSDP2 on a 2D mesh ("replicate", "shard") = (nodes, LOCAL_WORLD_SIZE): shards within a
           node, replicas across nodes
    pp     pipeline stages of transformer blocks (fp4lab.train.pipeline): every rank trains the whole
           global batch through its blocks, in microbatches

Every rank draws the same global batch of the step (the sampler is a pure function of seed and
step) and, data-parallel, trains on its rows [r*B/N, (r+1)*B/N); the loss of a rank is the mean over its rows, and
the gradient average over ranks is the mean over the global batch, as in one process.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fp4lab.nn.build import attention_generators, derive_seed, fp4_linears
from fp4lab.nn.model import Llama
from fp4lab.train.config import ConfigError, TrainConfig

LAUNCH_HINT = "launch it with `fp4lab train --nproc-per-node N` (or torchrun -m fp4lab.cli train ...)"


@dataclass(frozen=True)
class Ranks:
    """Where this process stands: `world` processes, this one `rank`, `local_rank` of `local_world`
    on its node. One process: Ranks(0, 1, 0, 1, "none")."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    mode: str = "none"

    @property
    def main(self) -> bool:
        """Rank 0 writes the run's files and prints its progress; the others stay silent."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.mode in ("fsdp", "hsdp")

    def rows(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a global batch (all of them under pp: the stages pass the whole batch on)."""
        if self.world == 1 or self.mode == "pp":
            return t
        per_rank = t.shape[0] // self.world
        return t[self.rank * per_rank : (self.rank + 1) * per_rank]

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of a per-rank scalar over ranks (gloo has no AVG: sum, then divide)."""
        if self.world == 1:
            return t
        total = t.detach().float().clone()
        dist.all_reduce(total)
        return total / self.world

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (it may build a cache), then the others."""
        if self.world > 1 and not self.main:
            dist.barrier()
        yield
        if self.world > 1 and self.main:
            dist.barrier()

    def total(self, count: int) -> int:
        """The sum of every rank's `count` (under pp, of what each rank's blocks counted)."""
        if self.world == 1:
            return count
        flag = torch.tensor([count], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(flag)
        return int(flag.item())

    def agree(self, code: int) -> int:
        """The largest of every rank's `code`: one decision (stop, and why) on every rank."""
        if self.world == 1:
            return code
        flag = torch.tensor([code], dtype=torch.int64, device=_collective_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())


def env_world() -> int:
    """WORLD_SIZE as torchrun sets it (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check(config: TrainConfig, world: int) -> None:
    """Refuse what this process cannot train, before anything is built or written."""
    if config.parallel == "none":
        if world > 1:
            raise ConfigError(
                f"parallel='none' but torchrun started {world} processes: each would train the whole run alone "
                "into the same folder; pass --parallel ddp, fsdp, hsdp or pp"
            )
        return
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ConfigError(f"parallel={config.parallel!r} needs one process per rank from torchrun: {LAUNCH_HINT}")
    if config.cuda_graphs == "on" and config.parallel != "ddp":
        why = "the pipeline's sends and receives" if config.parallel == "pp" else "FSDP2's all-gathers"
        raise ConfigError(
            f"cuda_graphs='on' is not supported with parallel={config.parallel!r} ({why} are not "
            "captured); use cuda_graphs='auto' or 'off', or parallel='ddp'"
        )
    if config.parallel == "pp":
        _check_pipeline(config, world)
        return
    if config.batch_size % world:
        raise ConfigError(
            f"batch_size={config.batch_size} does not split over {world} ranks (every rank trains batch_size / ranks "
            f"rows of each global batch): use a multiple of {world}, or, resuming a run, a number of ranks that "
            f"divides {config.batch_size}"
        )


def _check_pipeline(config: TrainConfig, world: int) -> None:
    from fp4lab.train.pipeline import schedule_name, stages_per_rank

    if config.capture_steps:
        raise ConfigError("capture_steps is not supported with parallel='pp' (each rank holds only its blocks' GEMMs); capture in a run with parallel none, ddp or fsdp")
    stages = world * stages_per_rank()
    if config.pp_microbatches < stages:
        raise ConfigError(
            f"pp_microbatches={config.pp_microbatches} is fewer than the {stages} pipeline stages of {schedule_name()} on "
            f"{world} ranks; use pp_microbatches >= {stages} (and a batch_size that splits into them)"
        )


def init(config: TrainConfig, device: torch.device) -> tuple[Ranks, torch.device]:
    """Join torchrun's process group (nccl on CUDA, each rank on cuda:LOCAL_RANK; gloo on the CPU)."""
    if config.parallel == "none":
        return Ranks(), device
    rank, world = int(os.environ["RANK"]), env_world()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if world % local_world:
        raise ConfigError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}: give every node the same --nproc-per-node")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        if graphs_possible(config):
            # A captured gradient all-reduce must not be polled by NCCL's watchdog (PyTorch's "CUDA Graphs
            # with DistributedDataParallel" recipe); a failing collective then hangs instead of aborting.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Ranks(rank, world, local_rank, local_world, config.parallel), device


def graphs_possible(config: TrainConfig) -> bool:
    """Whether steps may replay from a CUDA graph in this mode: one process, or DDP (the gradient
    all-reduce is captured with the step); FSDP2's hooks gather and reshard outside any graph."""
    return config.cuda_graphs != "off" and config.parallel in ("none", "ddp")


# DDP must have run this many eager steps before its backward is captured (its reducer rebuilds its
# buckets and settles its state in the first iterations; PyTorch's CUDA-graph notes ask for 11).
DDP_GRAPH_WARMUP_STEPS = 11


def close(ranks: Ranks) -> None:
    if ranks.mode != "none" and dist.is_initialized():
        dist.destroy_process_group()


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def offset_random_streams(model: Llama, ranks: Ranks) -> None:
    """Give ranks other than 0 their own stochastic-rounding and random-Hadamard streams.

    In one process every row of the batch draws its own bits; with one shared seed, rank r would
    reuse rank 0's bits on its rows, so the rounding errors the gradient all-reduce averages would be
    correlated across ranks instead of independent. Rank 0 keeps the seeds of a one-process run.
    Called before the first forward: the generators are created from `seed` on first use."""
    if ranks.rank != 0:
        _rederive_streams(model, f"rank{ranks.rank}")


def fresh_random_streams(model: Llama, step: int) -> None:
    """New streams for a rank that the world which wrote the resumed checkpoint lacked (it had fewer
    ranks): this rank's own seeds (offset_random_streams) derived once more from the resume step.
    Deterministic, so every resume of that checkpoint on this many ranks draws the same bits; and not
    the bits this rank drew at step 0 of an earlier segment on more ranks."""
    _rederive_streams(model, f"resumed{step}")


def _rederive_streams(model: Llama, name: str) -> None:
    for linear in fp4_linears(model).values():
        linear.seed = derive_seed(linear.seed, name)
    for generator in attention_generators(model):
        generator.manual_seed(derive_seed(generator.initial_seed(), name))


class _LossModule(torch.nn.Module):
    """DDP hooks forward(): the loss, not the logits, is what each step calls."""

    def __init__(self, model: Llama):
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.model.loss(tokens, targets)


def wrap(model: Llama, ranks: Ranks, device: torch.device, gather_weights: str = "dense"):
    """The callable a step runs, loss = f(tokens, targets), with the model wrapped for `ranks.mode`;
    fsdp/hsdp replace the parameters by DTensor shards in place (build the optimizer after this).
    gather_weights="encoded": FSDP2 all-gathers FP4 weights in their GEMMs' encoding where that is exact
    (train.encoded_gather; its byte ledger is `model.gather_bytes`)."""
    if ranks.mode == "none":
        return model.loss
    if ranks.mode == "ddp":
        # Buffers (RoPE tables, LoRA factors realigned from replicated weights) are equal on every rank:
        # no broadcast, which would also make each evaluation forward a collective.
        if device.type != "cuda":
            return torch.nn.parallel.DistributedDataParallel(_LossModule(model), broadcast_buffers=False)
        # Built on a side stream, so that its backward can later be captured in a CUDA graph (PyTorch's
        # CUDA-graph notes on DDP); harmless when it never is.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            wrapped = torch.nn.parallel.DistributedDataParallel(_LossModule(model), device_ids=[device.index], broadcast_buffers=False)
        torch.cuda.current_stream(device).wait_stream(side)
        return wrapped
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    if ranks.mode == "hsdp":
        shape, names = (ranks.world // ranks.local_world, ranks.local_world), ("replicate", "shard")
    else:
        shape, names = (ranks.world,), ("shard",)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model, "loss")
    if gather_weights == "encoded":
        from fp4lab.train.encoded_gather import install

        model.gather_bytes = install(model)
        if ranks.main:
            print(model.gather_bytes.describe(), file=sys.stderr, flush=True)
    return model.loss
