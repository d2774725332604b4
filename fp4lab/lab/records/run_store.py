"""Where the run catalog's records live on disk: one small file per run, so that recording a run costs
the same at 100 records and at 100,000, and `sweep_catalog.json` rebuilt from them as the file users
and tools read.

Beside the catalog file `sweep_catalog.json` (the *view*), the folder `sweep_catalog.json.d/` (the
*store*) holds:

    runs/<name>.json   one record each, compact JSON: the truth
    sweeps/<name>      the ids of one sweep's runs, one JSON string per line, in the order they joined
    changes            "<base> null", then "<seq> <id as JSON>" for each change since the view was rebuilt
    transaction.json   a transaction of several records: committed, being applied (or cut off by a kill)
    view.json          which view this store wrote last: its token, the last change it holds, its stat
    tmp/               temporary files of writes in progress
    refresh.lock       held while one process rebuilds the view

`<name>` is the run id or sweep name with every character except a-z, 0-9, '-' and '_' written as %XX,
so two names stay two files on a case-insensitive filesystem.

A write (under the catalog's lock, `catalog.Catalog`) appends its change lines first, then its sweep
memberships, then replaces the run files atomically: a writer killed between two steps leaves change
lines for runs that did not change, which cost a rebuild nothing. A transaction of several records is
first written whole to `transaction.json` (its commit point) and then applied; the next writer (or
`sync`) finishes one a kill cut off, and readers overlay it meanwhile, so nobody sees half of one.

The view is rebuilt by `sync` (the catalog calls it when a process that wrote ends): it copies each
line of the current view whose run did not change, writes the changed runs' files in their place and
the new runs after, and names the last change it holds in its first line. Its cost grows with the
view's size, not with the number of writes: the processes waiting to rebuild find it rebuilt by the
one before them and return.

The view carries a random token that `view.json` records with the file's stat. A view that is neither
the one this store wrote nor missing was replaced by someone else (restored from a backup, copied back
from another machine, edited): if the store holds no change missing from the last view, that file is
the catalog and the next write imports it; otherwise both hold changes and every read and write
refuses, naming both and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.train.atomic import TEMP_SUFFIX, fsync_dir, no_space_left, replace_atomically, swap_folder, temp_prefix

VIEW_VERSION = 4
"""The `schema_version` of the view files this module writes (catalog.SCHEMA_VERSION is the same
number; defined here too because the catalog imports this module)."""

_HEADER = re.compile(rb'^\{"schema_version": (\d+), "view": "([0-9a-f]+)", "through": (\d+), "runs": \{\n$')
_SAFE = frozenset("abcdefghijklmnopqrstuvwxyz0123456789-_")


class StoreConflict(Exception):
    """The view was replaced by someone else while the store holds changes it lacks (catalog turns it
    into a CatalogFormatError)."""


def file_name(name: str) -> str:
    """A run id or sweep name as a file name: distinct names stay distinct, on any filesystem."""
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in name)


def sweeps_of(record: Mapping[str, Any]) -> list[str]:
    """Every sweep a record belongs to (records written before `sweeps` existed: their `sweep`)."""
    members = list(record.get("sweeps") or ())
    first = record.get("sweep")
    return members if first is None or first in members else [first, *members]


def record_bytes(record: Mapping[str, Any]) -> bytes:
    """A record as its run file holds it and as its line of the view shows it (strict JSON)."""
    return json.dumps(record, allow_nan=False).encode()


def view_header(token: str, through: int) -> bytes:
    return f'{{"schema_version": {VIEW_VERSION}, "view": "{token}", "through": {through}, "runs": {{\n'.encode()


@dataclass(frozen=True)
class ViewState:
    kind: str  # "ours": the view this store wrote; "missing": no view file; "foreign": someone else's
    through: int  # the last change the view holds ("ours"); -1 otherwise


class RunStore:
    """The records of the catalog at `path`. `read_file(path)` parses a catalog file (any version, or
    raises); `locked()` is the catalog's write lock, held around every method marked "under the lock"."""

    def __init__(self, path: Path, read_file: Callable[[Path], dict[str, dict[str, Any]]],
                 locked: Callable[[], contextlib.AbstractContextManager[None]], timeout: float):
        self.path = path
        self.root = path.with_name(path.name + ".d")
        self._read_file = read_file
        self._locked = locked
        self._timeout = timeout

    # ---------------------------------------------------------------------------------- file names

    def _run_path(self, run_id: str) -> Path:
        return self.root / "runs" / f"{file_name(run_id)}.json"

    def _sweep_path(self, sweep: str) -> Path:
        return self.root / "sweeps" / file_name(sweep)

    @property
    def _changes(self) -> Path:
        return self.root / "changes"

    @property
    def _pending(self) -> Path:
        return self.root / "transaction.json"

    @property
    def _view_json(self) -> Path:
        return self.root / "view.json"

    @property
    def _tmp(self) -> Path:
        return self.root / "tmp"

    def exists(self) -> bool:
        return self.root.is_dir()

    # ---------------------------------------------------------------------------------- the view's state

    def _view_record(self) -> dict[str, Any] | None:
        try:
            return json.loads(self._view_json.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            raise StoreConflict(f"{self._view_json} is unreadable ({error}); move {self.root} aside to rebuild the "
                                f"store from {self.path}") from None

    def _view_state_once(self) -> ViewState:
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 (stat and header from one open file)
        except FileNotFoundError:
            return ViewState("missing", -1)
        with handle:
            stat = os.fstat(handle.fileno())
            match = _HEADER.match(handle.readline(4096))
        view = self._view_record()
        if match is None or view is None:
            return ViewState("foreign", -1)
        stamp = [stat.st_ino, stat.st_size, stat.st_mtime_ns]
        token = match.group(2).decode()
        for entry in (view, view.get("previous")):
            if entry and entry["token"] == token and entry.get("stamp") in (None, stamp):
                return ViewState("ours", int(entry["through"]))
        return ViewState("foreign", -1)

    def view_state(self) -> ViewState:
        """Whose view `path` is. A rebuild swaps the view file and `view.json` in two steps; a reader
        between them sees a mismatch, so a mismatch is looked at again before it counts."""
        for attempt in range(4):
            state = self._view_state_once()
            if state.kind != "foreign":
                return state
            time.sleep(0.005 * attempt)
        return state

    def _unsynced(self) -> list[str]:
        """Runs changed since the last view this store wrote (what a foreign view cannot hold)."""
        view = self._view_record() or {"through": -1}
        return list(dict.fromkeys(run_id for seq, run_id in self._change_lines() if run_id is not None
                                  and seq > int(view["through"])))

    def _conflict(self, unsynced: list[str]) -> StoreConflict:
        shown = ", ".join(unsynced[:3]) + (f" and {len(unsynced) - 3} more" if len(unsynced) > 3 else "")
        return StoreConflict(
            f"catalog {self.path} was replaced or edited outside fp4lab while {self.root} holds changes it lacks "
            f"(runs {shown}). Fix: to keep the store's runs, move {self.path} aside (fp4lab rebuilds it); to keep "
            f"the file, move {self.root} aside (fp4lab imports the file). Nothing was changed.")

    def source(self) -> str:
        """Where reads come from: "store", or "file" (no store yet, or a foreign view the store holds
        nothing beyond: that file is the catalog until the next write imports it)."""
        if not self.exists():
            return "file"
        if self.view_state().kind != "foreign":
            return "store"
        unsynced = self._unsynced()
        if unsynced:
            raise self._conflict(unsynced)
        return "file"

    # ---------------------------------------------------------------------------------- reads (no lock)

    def _change_lines(self) -> list[tuple[int, str | None]]:
        """The change log's complete lines: (seq, run id); the first is (base, None)."""
        try:
            data = self._changes.read_bytes()
        except FileNotFoundError:
            return []
        lines = []
        for line in data.split(b"\n")[:-1]:  # a last piece without its newline is a writer cut off: not a change
            seq, _, run_id = line.partition(b" ")
            lines.append((int(seq), json.loads(run_id)))
        return lines

    def pending(self) -> dict[str, dict[str, Any] | None]:
        """The changes of a transaction being applied (run id -> record, None: deleted), or {}."""
        try:
            data = json.loads(self._pending.read_bytes())
        except FileNotFoundError:
            return {}
        return {**data["put"], **dict.fromkeys(data["delete"])}

    def _load(self, run_id: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._run_path(run_id).read_bytes())
        except FileNotFoundError:
            return None

    def get(self, run_id: str) -> dict[str, Any] | None:
        if self.source() == "file":
            return self._read_file(self.path).get(run_id)
        pending = self.pending()
        return pending[run_id] if run_id in pending else self._load(run_id)

    def _members(self, sweep: str) -> list[str]:
        try:
            data = self._sweep_path(sweep).read_bytes()
        except FileNotFoundError:
            return []
        return list(dict.fromkeys(json.loads(line) for line in data.split(b"\n")[:-1]))

    def records_of_sweep(self, sweep: str) -> list[dict[str, Any]]:
        """The records of `sweep`'s runs, in the order they joined it: reads only that sweep's files."""
        if self.source() == "file":
            return [r for r in self._read_file(self.path).values() if sweep in sweeps_of(r)]
        pending = self.pending()
        ids = self._members(sweep) + [i for i, r in pending.items() if r is not None and sweep in sweeps_of(r)]
        records = (pending[i] if i in pending else self._load(i) for i in dict.fromkeys(ids))
        return [r for r in records if r is not None and sweep in sweeps_of(r)]

    def sweeps(self) -> list[str]:
        """Every sweep with at least one run, sorted."""
        if self.source() == "file":
            return sorted({s for r in self._read_file(self.path).values() for s in sweeps_of(r) if s})
        from urllib.parse import unquote

        pending = self.pending()
        names = {unquote(name) for name in os.listdir(self.root / "sweeps")}
        names |= {s for r in pending.values() if r is not None for s in sweeps_of(r)}
        return sorted(name for name in names if self._has_members(name, pending))

    def _has_members(self, sweep: str, pending: Mapping[str, Any]) -> bool:
        """Whether a run still belongs to `sweep` (a writer killed after joining the index may have left
        an id whose run never changed): stops at the first that does."""
        for run_id in [*self._members(sweep), *pending]:
            record = pending[run_id] if run_id in pending else self._load(run_id)
            if record is not None and sweep in sweeps_of(record):
                return True
        return False

    def all_records(self) -> dict[str, dict[str, Any]]:
        """Every record, in the order runs were first recorded: the view with the changes since laid over it."""
        if self.source() == "file":
            return self._read_file(self.path)
        for _ in range(10):
            state = self.view_state()
            if state.kind == "missing":
                runs = self._every_run_file()
                changes = []
            else:
                runs = self._read_file(self.path)
                changes = self._change_lines()
                if changes and changes[0][0] > state.through:  # rebuilt between the two reads: read again
                    continue
            for run_id in dict.fromkeys(i for seq, i in changes if i is not None and seq > state.through):
                record = self._load(run_id)
                if record is None:
                    runs.pop(run_id, None)
                else:
                    runs[run_id] = record
            for run_id, record in self.pending().items():
                if record is None:
                    runs.pop(run_id, None)
                else:
                    runs[run_id] = record
            return runs
        raise TimeoutError(f"catalog {self.path} was rebuilt 10 times while being read; try again")

    def _every_run_file(self) -> dict[str, dict[str, Any]]:
        """Every run file, oldest first (the order a rebuild without a view falls back to)."""
        records = [json.loads(p.read_bytes()) for p in (self.root / "runs").glob("*.json")]
        records.sort(key=lambda r: (r.get("created_at") or "", r["id"]))
        return {r["id"]: r for r in records}

    # ---------------------------------------------------------------------------------- writes (under the lock)

    def prepare_write(self) -> None:
        """Make the store ready for a write, under the lock: create it (importing the file's records),
        import a foreign view the store holds nothing beyond, finish a transaction a kill cut off, and
        remove temporary files of dead writers."""
        for stale in self.root.parent.glob(f"{temp_prefix(self.root)}*"):  # an import cut off by a kill
            shutil.rmtree(stale, ignore_errors=True)
        if not self.exists():
            self._import(self._read_file(self.path) if self.path.exists() else {})
            return
        for name in os.listdir(self._tmp):
            with contextlib.suppress(OSError):
                os.unlink(self._tmp / name)
        pending = self.pending()
        if pending:
            self._apply(pending)
            self._pending.unlink()
        if self.view_state().kind == "foreign":
            unsynced = self._unsynced()
            if unsynced:
                raise self._conflict(unsynced)
            self._import(self._read_file(self.path))

    def commit(self, changes: Mapping[str, dict[str, Any] | None]) -> int:
        """Store `changes` (run id -> new record, None: delete), under the lock; the last change's seq."""
        several = len(changes) > 1
        committed = False
        try:
            if several:
                intent = {"put": {i: r for i, r in changes.items() if r is not None},
                          "delete": [i for i, r in changes.items() if r is None]}
                write_atomic_in(self._pending, json.dumps(intent, allow_nan=False).encode(), self._tmp)
                committed = True
            seq = self._apply(changes)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            kept = (f"the transaction is committed ({self._pending.name}) and the next write finishes it" if committed
                    else f"{self.path.name} and its records were left as they were")
            raise no_space_left(self.path, error, kept) from error
        if several:
            self._pending.unlink()
        return seq

    def _apply(self, changes: Mapping[str, dict[str, Any] | None]) -> int:
        last = self._last_seq()
        _append(self._changes, "".join(f"{last + n} {json.dumps(i)}\n" for n, i in enumerate(changes, 1)).encode())
        joined: dict[str, list[str]] = {}
        left: dict[str, set[str]] = {}
        for run_id, record in changes.items():
            before = set(sweeps_of(self._load(run_id) or {}))
            after = set(sweeps_of(record)) if record is not None else set()
            for sweep in after - before:
                joined.setdefault(sweep, []).append(run_id)
            for sweep in before - after:
                left.setdefault(sweep, set()).add(run_id)
        for sweep, ids in joined.items():
            _append(self._sweep_path(sweep), "".join(json.dumps(i) + "\n" for i in ids).encode())
        for sweep, ids in left.items():
            kept = [i for i in self._members(sweep) if i not in ids]
            if kept:
                write_atomic_in(self._sweep_path(sweep), "".join(json.dumps(i) + "\n" for i in kept).encode(), self._tmp)
            else:
                with contextlib.suppress(FileNotFoundError):
                    self._sweep_path(sweep).unlink()
        for run_id, record in changes.items():
            if record is None:
                with contextlib.suppress(FileNotFoundError):
                    self._run_path(run_id).unlink()
            else:
                write_atomic_in(self._run_path(run_id), record_bytes(record), self._tmp)
        return last + len(changes)

    def _last_seq(self) -> int:
        with open(self._changes, "rb") as handle:
            size = handle.seek(0, os.SEEK_END)
            handle.seek(max(0, size - 4096))
            lines = handle.read().split(b"\n")[:-1]
        return int(lines[-1].partition(b" ")[0])

    def _import(self, records: Mapping[str, dict[str, Any]]) -> None:
        """Build a store holding `records` beside the old one (if any), swap it in, write its view."""
        token = secrets.token_hex(8)
        staging = self.root.with_name(f"{temp_prefix(self.root)}{token}{TEMP_SUFFIX}")
        for folder in ("runs", "sweeps", "tmp"):
            (staging / folder).mkdir(parents=True)
        members: dict[str, list[str]] = {}
        for run_id, record in records.items():
            (staging / "runs" / f"{file_name(run_id)}.json").write_bytes(record_bytes(record))
            for sweep in sweeps_of(record):
                members.setdefault(sweep, []).append(run_id)
        for sweep, ids in members.items():
            (staging / "sweeps" / file_name(sweep)).write_bytes("".join(json.dumps(i) + "\n" for i in ids).encode())
        (staging / "changes").write_bytes(b"0 null\n")
        (staging / "view.json").write_text(json.dumps({"token": "", "through": 0, "stamp": None, "previous": None}))
        _make_durable(staging, len(records))
        swap_folder(staging, self.root, self.root.with_name(f"{temp_prefix(self.root)}{token}.old"))
        self._write_view(((run_id, record_bytes(r)) for run_id, r in records.items()), through=0)

    # ---------------------------------------------------------------------------------- the view

    def _write_view(self, lines: Iterable[tuple[str, bytes]], through: int) -> None:
        """Replace the view with `lines` (run id, record bytes), holding changes through `through`. The
        token goes into view.json before the file is swapped and the stat after, so a kill anywhere
        leaves a view this store still recognises as its own."""
        token = secrets.token_hex(8)
        current = self._view_record()
        previous = None
        if current is not None and current.get("token"):
            previous = {"token": current["token"], "through": current["through"], "stamp": current.get("stamp")}
        write_atomic_in(self._view_json, json.dumps({"token": token, "through": through, "stamp": None,
                                                     "previous": previous}).encode(), self._tmp)

        def write(handle) -> None:
            handle.write(view_header(token, through))
            separator = b""
            for run_id, data in lines:
                handle.write(separator + json.dumps(run_id).encode() + b": " + data)
                separator = b",\n"
            handle.write(b"\n}}\n")

        replace_atomically(self.path, write)
        stat = os.stat(self.path)
        write_atomic_in(self._view_json, json.dumps({"token": token, "through": through, "stamp": [
            stat.st_ino, stat.st_size, stat.st_mtime_ns], "previous": previous}).encode(), self._tmp)

    def sync(self, upto: int | None = None) -> None:
        """Rebuild the view so that it holds every change (at least through `upto`; a view already
        holding it is left alone). Takes `refresh.lock`, and the write lock only to read and trim the
        change log, so writers wait for neither the copy nor the disk."""
        if not self.exists():
            return
        from filelock import FileLock, Timeout

        try:
            with FileLock(self.root / "refresh.lock", timeout=self._timeout):
                state = self.view_state()
                if upto is not None and state.kind == "ours" and state.through >= upto:
                    return
                with self._locked():
                    pending = self.pending()
                    if pending:
                        self._apply(pending)
                        self._pending.unlink()
                    state = self.view_state()
                    if state.kind == "foreign":
                        unsynced = self._unsynced()
                        if unsynced:
                            raise self._conflict(unsynced)
                        return  # the file is the catalog: the next write imports it
                    changes = self._change_lines()
                    last = changes[-1][0]
                if state.kind == "ours" and last <= state.through:
                    return
                changed = list(dict.fromkeys(i for seq, i in changes if i is not None and seq > state.through))
                self._write_view(self._rebuilt_lines(state, changed), through=last)
                with self._locked():
                    kept = [(seq, i) for seq, i in self._change_lines() if seq > last and i is not None]
                    text = f"{last} null\n" + "".join(f"{seq} {json.dumps(i)}\n" for seq, i in kept)
                    write_atomic_in(self._changes, text.encode(), self._tmp)
        except Timeout:
            raise TimeoutError(f"could not take {self.root / 'refresh.lock'} within {self._timeout:g} s to rebuild "
                               f"{self.path}; another process is rebuilding it") from None

    def _rebuilt_lines(self, state: ViewState, changed: list[str]) -> Iterator[tuple[str, bytes]]:
        """The new view's lines: the old view's, the changed runs' files in their place, new runs after."""
        todo = dict.fromkeys(changed)
        if state.kind == "missing":
            for run_id, record in self._every_run_file().items():
                yield run_id, record_bytes(record)
            return
        with open(self.path, "rb") as handle:
            handle.readline()  # the header
            for line in handle:
                line = line.rstrip(b"\n").removesuffix(b",")
                if not line.startswith(b'"'):
                    continue  # the closing "}}" (and the empty line of an empty catalog)
                run_id, end = json.decoder.scanstring(line.decode(), 1)
                if run_id in todo:
                    del todo[run_id]
                    data = self._file_bytes(run_id)
                    if data is not None:
                        yield run_id, data
                else:
                    yield run_id, line[end + 1:].lstrip(b": ")
        for run_id in todo:
            data = self._file_bytes(run_id)
            if data is not None:
                yield run_id, data

    def _file_bytes(self, run_id: str) -> bytes | None:
        try:
            return self._run_path(run_id).read_bytes()
        except FileNotFoundError:
            return None


def _make_durable(staging: Path, records: int) -> None:
    """Every file of a store being built on disk before the swap makes it the catalog. A small store
    (a new catalog, a small import) fsyncs its files one by one; a large import asks the kernel once
    (`os.sync`, which also flushes other files: cheaper than 100,000 fsyncs, too costly to pay for
    every new catalog on a busy machine)."""
    if records > 1000:
        os.sync()
        return
    for folder, _, names in os.walk(staging):
        for name in names:
            with open(Path(folder) / name, "rb") as handle:
                os.fsync(handle.fileno())
        fsync_dir(Path(folder))


def write_atomic_in(path: Path, data: bytes, temp_dir: Path) -> None:
    replace_atomically(path, lambda handle: handle.write(data), temp_dir=temp_dir)


def _append(path: Path, data: bytes) -> None:
    """Append whole lines to `path` durably, under the lock. A last line left without its newline by a
    writer killed mid-append is cut off first: that writer's change had not happened yet."""
    with open(path, "ab+") as handle:
        size = handle.seek(0, os.SEEK_END)
        if size:
            handle.seek(max(0, size - 65536))
            tail = handle.read()
            if not tail.endswith(b"\n"):
                cut = tail.rfind(b"\n")
                handle.truncate(size - len(tail) + cut + 1 if cut >= 0 else 0)
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
