"""The optimizers' view of FSDP2-sharded parameters (DTensors), in one place.

`fully_shard` (FSDP2) turns every parameter into a DTensor sharded along dim 0 (`Shard(0)`; HSDP adds a
`Replicate()` mesh dim), and its gradient is a DTensor with the same placements. Elementwise optimizer
math is correct on the local shard as it is; what needs the whole tensor (Newton-Schulz, norms, a
tensor-wide amax, per-head rows) goes through the helpers here. A plain tensor passes through every
helper unchanged, so the single-process and DDP paths run exactly the code they ran before.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

if dist.is_available():
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
else:  # a torch build without torch.distributed has no DTensors to meet
    DTensor = Shard = distribute_tensor = None


def is_sharded(t: torch.Tensor) -> bool:
    """Whether t is a DTensor (an FSDP2 parameter, its gradient, or optimizer state made like them)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The part of t this rank holds: the local shard of a DTensor (same storage), t itself otherwise."""
    return t.to_local() if is_sharded(t) else t


def local_part(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of `full` (a whole tensor of like's global shape, equal on every rank), cut as
    `like` is cut: DTensor's own chunking (torch.chunk along the sharded dim, as fully_shard's), no
    communication."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def like_sharded(local_tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A DTensor from this rank's `local_tensor`, placed as `like`, for state whose dims other than the
    last match `like` (so it is cut like `like` along them) and whose last dim is whole on every rank."""
    shape = (*like.shape[:-1], local_tensor.shape[-1])
    stride = torch.empty(shape, device="meta").stride()
    mesh, placements = like.device_mesh, like.placements
    return DTensor.from_local(local_tensor, mesh, placements, run_check=False, shape=shape, stride=stride)


def global_norm(t: torch.Tensor) -> torch.Tensor:
    """||t||_2 over the whole tensor (all shards): DTensor's norm reduces the shards' partial sums."""
    norm = torch.linalg.vector_norm(t)
    return norm.full_tensor() if is_sharded(norm) else norm


def all_reduce_max_over_shards_(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """In place, the MAX of `value` (a plain tensor) over the ranks holding different shards of `like`."""
    mesh = like.device_mesh
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mesh.get_group(mesh_dim))
    return value


def check_last_dim_whole(t: torch.Tensor, what: str) -> None:
    """Refuse a DTensor cut along its last dim, for math that blocks or averages along that dim."""
    if is_sharded(t) and any(isinstance(p, Shard) and p.dim in (-1, t.ndim - 1) for p in t.placements):
        raise ValueError(
            f"{what}: a parameter of shape {list(t.shape)} is sharded along its last dim ({t.placements}); "
            "shard it along dim 0 (fully_shard's default shard_placement_fn)"
        )
