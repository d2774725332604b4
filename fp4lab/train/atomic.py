"""Atomic file writes, the one home for them: readers (and a run resumed after a kill) see the old file
or the whole new one, and the rename survives a crash of the machine.

Torch-free, so the orchestration layer (the catalog, scripts, reports) uses it too without slowing
`fp4lab --help`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMP_SUFFIX = ".tmp"


def temp_prefix(path: Path) -> str:
    """How the temporary files of writes to `path` begin (beside it, hidden): `.<name>.<random>.tmp`."""
    return f".{Path(path).name}."


def replace_atomically(path: Path, write: Callable[[BinaryIO], object], *, executable: bool = False) -> None:
    """Call `write` on a temporary file beside `path`, fsync it, rename it over `path`, fsync the folder.

    The new file keeps the mode of the file it replaces; a new one gets what the umask leaves of 0o666
    (0o777 when `executable`), like any file the user creates: a catalog or a script shared with the
    group stays readable to it (mkstemp would make it private)."""
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    temp = directory / f"{temp_prefix(path)}{secrets.token_hex(8)}{TEMP_SUFFIX}"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o777 if executable else 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            with contextlib.suppress(FileNotFoundError, PermissionError):
                os.fchmod(handle.fileno(), path.stat().st_mode & 0o7777)
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_dir(directory)


def write_atomic(path: Path, data: bytes | str, *, executable: bool = False) -> None:
    """Write `data` (text is UTF-8 encoded) to `path` atomically."""
    payload = data.encode() if isinstance(data, str) else data
    replace_atomically(path, lambda handle: handle.write(payload), executable=executable)


def replace_folder(target: Path, write: Callable[[Path], object]) -> None:
    """Call `write` on a fresh hidden folder beside `target`, fsync what it wrote, then put it in target's
    place: never a partial folder at target, and a failed `write` leaves target as it was and no folder
    behind. Replacing an existing folder takes two renames (the old one aside, the new one in): between
    them target is missing for an instant, and a crash there leaves the old one as `.<name>.<random>.old`."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(8)
    staging = target.with_name(f"{temp_prefix(target)}{token}{TEMP_SUFFIX}")
    old = target.with_name(f"{temp_prefix(target)}{token}.old")
    staging.mkdir()
    try:
        write(staging)
        for folder, _, files in os.walk(staging):
            for name in files:
                with open(Path(folder) / name, "rb") as handle:
                    os.fsync(handle.fileno())
            _fsync_dir(Path(folder))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    swap_folder(staging, target, old)


def swap_folder(built: Path, target: Path, old: Path) -> None:
    """Put the finished folder `built` in `target`'s place (the old one aside at `old`, then removed),
    durably: the one way a folder built beside its target replaces it (exports, corpora)."""
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(built, target)
    _fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable. Some network filesystems cannot fsync a directory; the rename is already
    atomic there, so that refusal is ignored."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EBADF, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES):
            raise
    finally:
        os.close(fd)
