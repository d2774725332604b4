"""A run folder has one trainer. The trainer holds an exclusive lock on `<out_dir>/trainer.lock` for its
whole life and writes "<host>:<pid>" into it; a second trainer on the same folder is refused before it
writes anything. The kernel drops the lock when the process ends, however it ends (SIGKILL included),
so a lock is never stale. On a shared filesystem the lock spans nodes: Linux's NFS client turns flock
into a byte-range lock the server holds. Torch-free: a sweep or `fp4lab status` asks `holder` whether a
run is being trained.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = "trainer.lock"

# Folders this process holds: folder -> (descriptor, depth). `fp4lab train --catalog` takes the lock
# before it records the start, then the loop takes it again.
_held: dict[Path, list[int]] = {}


class RunFolderBusy(RuntimeError):
    """Another live process is training in this run folder."""


@contextlib.contextmanager
def hold(out_dir: str | os.PathLike[str]) -> Iterator[None]:
    """Hold `out_dir`'s trainer lock while the block runs (re-entrant in one process); RunFolderBusy,
    with nothing written, when another process holds it."""
    folder = Path(out_dir).resolve()
    if folder in _held:
        _held[folder][1] += 1
        try:
            yield
        finally:
            _held[folder][1] -= 1
        return
    folder.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    if not _lock(descriptor):
        os.close(descriptor)
        raise RunFolderBusy(
            f"{folder} is being trained by process {holder(folder) or '(unknown)'}: one trainer per run "
            "folder; wait for it to finish (fp4lab status) or stop that process first"
        )
    os.ftruncate(descriptor, 0)
    os.write(descriptor, f"{socket.gethostname()}:{os.getpid()}\n".encode())
    _held[folder] = [descriptor, 1]
    try:
        yield
    finally:
        del _held[folder]
        os.ftruncate(descriptor, 0)  # the next reader sees no holder even before the kernel drops the lock
        os.close(descriptor)  # closing drops the lock


def _lock(descriptor: int, attempts: int = 10) -> bool:
    """Take the exclusive lock, retrying for about a second: `holder` takes a shared lock for an instant."""
    for attempt in range(attempts):
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if attempt + 1 < attempts:
                time.sleep(0.1)
    return False


def holder(out_dir: str | os.PathLike[str]) -> str | None:
    """"<host>:<pid>" of the process training in `out_dir` (this one included), None when no process is."""
    path = Path(out_dir) / LOCK_NAME
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(descriptor, 256).decode(errors="replace").strip() or "(unknown)"
        fcntl.flock(descriptor, fcntl.LOCK_UN)
        return None
    finally:
        os.close(descriptor)
