"""The optimizers' view of FSDP2-sharded parameters (DTensors), in one place.

`fully_shard` (FSDP2) turns every parameter into a DTensor sharded along dim 0 (`Shard(0)`; HSDP adds a
`Replicate()` mesh dim), and its gradient is a DTensor with the same placements. Elementwise optimizer
math is correct on the local shard as it is; what needs the whole tensor (Newton-Schulz, norms, a
tensor-wide amax, per-head rows) goes through the helpers here. A plain tensor passes through every
helper unchanged, so the single-process and DDP paths run exactly the code they ran before.
"""

from __future__ import annotations

import math

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
    rows = _row_sharding(like)
    if rows is not None:  # a slice: no DTensor is built (this runs once per matrix per optimizer step)
        start, count = _rows_of(like.shape[0], *rows[:2])
        return full[start : start + count]
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def gather_whole(parts: list[torch.Tensor], likes: list[torch.Tensor]) -> list[torch.Tensor]:
    """The whole tensors of which `parts[i]` is this rank's local shard, placed as `likes[i]` (a DTensor);
    where `likes[i]` is a plain tensor, `parts[i]` is already whole and passes through.

    Tensors sharded along dim 0 over one mesh dim (fully_shard's placement; HSDP adds a Replicate dim,
    which needs no gathering) of one dtype travel in ONE all-gather: each shard padded to the chunk
    length torch.chunk gives, flattened, concatenated. One collective per step instead of one
    `full_tensor()` per matrix, and no DTensor dispatch, which is what a step of small matrices spends
    its time on. Anything else falls back to `full_tensor()`."""
    whole = list(parts)
    batch = [i for i, like in enumerate(likes) if is_sharded(like)]
    rows = {i: _row_sharding(likes[i]) for i in batch}
    groups: dict[tuple, list[int]] = {}
    for i in batch:
        if rows[i] is None:
            whole[i] = DTensor.from_local(parts[i], likes[i].device_mesh, likes[i].placements, run_check=False,
                                          shape=likes[i].shape, stride=likes[i].stride()).full_tensor()
        else:
            groups.setdefault((rows[i][2], parts[i].dtype, parts[i].device), []).append(i)
    for (group, dtype, device), members in groups.items():
        world = dist.get_world_size(group)
        chunks = {i: _chunk_rows(likes[i].shape[0], world) for i in members}
        padded = []
        for i in members:
            part = parts[i].reshape(parts[i].shape[0], -1)
            padded.append(torch.nn.functional.pad(part, (0, 0, 0, chunks[i] - part.shape[0])).reshape(-1))
        send = torch.cat(padded)
        received = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(received, send, group=group)
        offset = 0
        for i in members:
            width = math.prod(likes[i].shape[1:])
            length = chunks[i] * width
            pieces = [r[offset : offset + length].view(chunks[i], width)[: _rows_of(likes[i].shape[0], rank, world)[1]]
                      for rank, r in enumerate(received)]
            whole[i] = torch.cat(pieces).view(likes[i].shape)
            offset += length
    return whole


def _row_sharding(t: torch.Tensor) -> tuple[int, int, object] | None:
    """(this rank's coordinate, ranks, process group) of a DTensor sharded along dim 0 over exactly one
    mesh dim and replicated over any other; None for any other placement."""
    shards = [(d, p) for d, p in enumerate(t.placements) if isinstance(p, Shard)]
    if len(shards) != 1 or shards[0][1].dim != 0 or any(not p.is_replicate() for p in t.placements if not isinstance(p, Shard)):
        return None
    mesh_dim = shards[0][0]
    mesh = t.device_mesh
    return mesh.get_local_rank(mesh_dim), mesh.size(mesh_dim), mesh.get_group(mesh_dim)


def _chunk_rows(rows: int, world: int) -> int:
    return -(-rows // world)  # torch.chunk's chunk length, which DTensor's Shard(0) uses


def _rows_of(rows: int, rank: int, world: int) -> tuple[int, int]:
    """(first row, row count) of `rank`'s Shard(0) piece of `rows` rows (trailing ranks may hold fewer or none)."""
    chunk = _chunk_rows(rows, world)
    start = min(rank * chunk, rows)
    return start, min(chunk, rows - start)


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


def clip_grad_norm_(parameters, max_norm: float, split_over_ranks: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm, the same clip coefficient), also for gradients that are
    FSDP2 DTensor shards, and then on the local shards: the squares of a rank's shard norms are summed
    over the ranks holding the other shards (not over replicas) and the root is the global norm, equal
    to the unsharded one to rounding. torch's own function gets there through DTensor dispatch on every
    gradient, which costs more than the rest of a small model's optimizer step. `split_over_ranks`:
    every rank holds other whole parameters (pipeline stages), so the squares of all ranks' norms are
    summed. Returns a plain tensor."""
    parameters = list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    sharded = [g for g in grads if is_sharded(g)]
    if not sharded and not split_over_ranks:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    plain = [g for g in grads if not is_sharded(g)]
    squares = torch.stack(torch._foreach_norm(plain)).square().sum() if plain else None
    if sharded:
        shard_squares = torch.stack(torch._foreach_norm([g.to_local() for g in sharded])).square().sum()
        _all_reduce_sum_over_shards_(shard_squares, sharded[0])
        squares = shard_squares if squares is None else shard_squares + squares
    if split_over_ranks:
        dist.all_reduce(squares)
    norm = squares.sqrt()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_([local(g) for g in grads], coefficient)
    return norm


def _all_reduce_sum_over_shards_(value: torch.Tensor, like: torch.Tensor) -> None:
    mesh = like.device_mesh
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            dist.all_reduce(value, group=mesh.get_group(mesh_dim))


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
