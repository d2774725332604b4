"""Run a function on real gloo process groups (CPU) from a test: `run_gloo(fn, *args)`.

`fn(rank, world_size, *args)` runs in each of `world_size` spawned processes after
`dist.init_process_group("gloo")` (rendezvous through a file, so no port can collide); what it returns
(picklable, tensors included) comes back as one list, indexed by rank. `fn` must be a module-level
function of an importable module (the spawned interpreter imports it by name).
`gloo_unavailable()` says why this machine cannot run them (None when it can), for a skip.
`rank_threads()` puts this process on a rank's thread count, for a reference a rank must equal bit for bit.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Spawned ranks compete for the CPU with pytest and each other: one thread each keeps a step fast.
RANK_THREADS = 1


def gloo_unavailable() -> str | None:
    if not dist.is_available():
        return "this torch build has no torch.distributed"
    if not dist.is_gloo_available():
        return "this torch build has no gloo backend"
    return None


@contextmanager
def rank_threads() -> Iterator[None]:
    """This process's intra-op threads set to a spawned rank's while inside: a CPU GEMM may split its
    work by thread, and another split can be another summation order, so a reference computed on other
    threads is not the ranks' arithmetic."""
    threads = torch.get_num_threads()
    torch.set_num_threads(RANK_THREADS)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_gloo(fn, *args, world_size: int = 2) -> list:
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank_main, args=(world_size, tmp, fn, args), nprocs=world_size, join=True, start_method="spawn"
        )
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _rank_main(rank: int, world_size: int, tmp: str, fn, args: tuple) -> None:
    torch.set_num_threads(RANK_THREADS)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(tmp) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
