"""Atomic file writes: readers (and a run resumed after a kill) see the old file or the whole new one.

Torch-free, so the orchestration layer uses it too without slowing `fp4lab --help`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def replace_atomically(path: Path, write: Callable[[BinaryIO], object], mode: int = 0o644) -> None:
    """Call `write` on a temporary file beside `path`, fsync it, give it `mode` (mkstemp makes files
    private; jobs of other users may share these folders), then rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def write_atomic(path: Path, data: bytes | str, mode: int = 0o644) -> None:
    """Write `data` (text is UTF-8 encoded) to `path` atomically."""
    payload = data.encode() if isinstance(data, str) else data
    replace_atomically(path, lambda handle: handle.write(payload), mode)
