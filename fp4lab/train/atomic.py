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
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceLeft(OSError):
    """A write that failed because its filesystem is full (or the user's quota is): the message names
    the file, says "no space left on device" and that the file it would have replaced is kept."""


def _no_space_error(exc: BaseException, seen: list[OSError]) -> OSError | None:
    """The ENOSPC / EDQUOT error behind a failed write: raised directly, chained (`__cause__`,
    `__context__`), or one the handle saw and a library turned into its own error (torch.save reports a
    short write as "unexpected pos")."""
    chain, error = [], exc
    while error is not None and len(chain) < 16:
        chain.append(error)
        error = error.__cause__ or error.__context__
    return next((e for e in [*chain, *seen] if isinstance(e, OSError) and e.errno in _NO_SPACE), None)


def no_space_left(path: Path, error: OSError, kept: str) -> NoSpaceLeft:
    """The one-line error of a write to `path` that found its filesystem full; `kept` says what survives."""
    try:
        free = shutil.disk_usage(Path(path).parent).free
        where = f" ({free / 2**20:.1f} MiB free there)"
    except OSError:
        where = ""
    return NoSpaceLeft(error.errno, f"no space left on device writing {path}{where}; {kept}. Free space on that "
                                    "filesystem (or point the run elsewhere) and run the command again")


class _WatchedHandle:
    """A file handle that remembers the OSErrors its writes raised, which a library may catch and replace."""

    def __init__(self, handle: BinaryIO, seen: list[OSError]):
        self._handle, self._seen = handle, seen

    def write(self, data) -> int:
        try:
            return self._handle.write(data)
        except OSError as error:
            self._seen.append(error)
            raise

    def __getattr__(self, name: str):
        return getattr(self._handle, name)


def temp_prefix(path: Path) -> str:
    """How the temporary files of writes to `path` begin (beside it, hidden): `.<name>.<random>.tmp`."""
    return f".{Path(path).name}."


def replace_atomically(path: Path, write: Callable[[BinaryIO], object], *, executable: bool = False,
                       keep_previous: Path | None = None, temp_dir: Path | None = None) -> None:
    """Call `write` on a temporary file beside `path`, fsync it, rename it over `path`, fsync the folder.

    The new file keeps the mode of the file it replaces; a new one gets what the umask leaves of 0o666
    (0o777 when `executable`), like any file the user creates: a catalog or a script shared with the
    group stays readable to it (mkstemp would make it private). `keep_previous`: the file being replaced
    is first renamed there (a second generation), once the new one is whole; a kill between the two
    renames leaves the previous generation and no `path`. A filesystem that fills up raises NoSpaceLeft
    naming `path`; `path` (and `keep_previous`) are then as they were. `temp_dir` (on the same
    filesystem) holds the temporary file instead of `path`'s folder: where that folder is large, a writer
    cleaning up after a killed one lists only `temp_dir`."""
    path = Path(path)
    directory = path.parent
    directory.mkdir(parents=True, exist_ok=True)
    temp = (temp_dir or directory) / f"{temp_prefix(path)}{secrets.token_hex(8)}{TEMP_SUFFIX}"
    seen: list[OSError] = []
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o777 if executable else 0o666)
        try:
            with os.fdopen(fd, "wb") as handle:
                with contextlib.suppress(FileNotFoundError, PermissionError):
                    os.fchmod(handle.fileno(), path.stat().st_mode & 0o7777)
                write(_WatchedHandle(handle, seen))
                handle.flush()
                os.fsync(handle.fileno())
            if keep_previous is not None and path.exists():
                os.replace(path, keep_previous)
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
    except Exception as exc:
        full = _no_space_error(exc, seen)
        if full is not None:
            raise no_space_left(path, full, f"{path.name} was left as it was") from exc
        raise
    fsync_dir(directory)


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
            fsync_dir(Path(folder))
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
    fsync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)


def fsync_dir(directory: Path) -> None:
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
