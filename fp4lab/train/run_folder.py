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
CHECKPOINT = "checkpoint.pt"
# The generation before it: a one-process save renames the checkpoint it replaces to this name, so a
# damaged newest one (a truncated copy, a full quota) falls back to it (checkpoint.load_newest).
PREVIOUS_CHECKPOINT = "checkpoint.prev.pt"
# A run of several ranks (parallel != "none") checkpoints here instead: fp4lab.train.checkpoint.save_sharded.
# Either resumes in the other kind of run, on any number of ranks (checkpoint.resume_run).
SHARDED_CHECKPOINT = "checkpoint.dcp"

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
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    descriptor = _lock(path)
    if descriptor is None:
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
        # Removed while still held (a process waiting on the old file sees it gone and opens the new
        # one: _lock), so a finished run leaves no lock file, and a refused command no folder it made.
        path.unlink(missing_ok=True)
        if created and not any(folder.iterdir()):
            folder.rmdir()
        os.close(descriptor)  # closing drops the lock


def _lock(path: Path, attempts: int = 10) -> int | None:
    """A descriptor of `path` holding its exclusive lock, or None after about a second of trying (`holder`
    takes a shared lock for an instant). A lock won on a file that was unlinked meanwhile (its holder
    finished) does not count: the path's current file is tried again."""
    for attempt in range(attempts):
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            if attempt + 1 < attempts:
                time.sleep(0.1)
            continue
        try:
            if os.stat(path).st_ino == os.fstat(descriptor).st_ino:
                return descriptor
        except FileNotFoundError:
            pass
        os.close(descriptor)
    return None


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


def has_checkpoint(out_dir: str | Path) -> bool:
    """Whether a run in `out_dir` resumes (a one-process checkpoint or a sharded one) rather than starts."""
    folder = Path(out_dir)
    return any((folder / name).exists() for name in (CHECKPOINT, PREVIOUS_CHECKPOINT)) or (folder / SHARDED_CHECKPOINT).is_dir()
