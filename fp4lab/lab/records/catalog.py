"""`sweep_catalog.json`: one record per run, safe under many writers at once, at any size.

Many Slurm jobs finish together on a shared filesystem and each one writes its own record; a lab's
catalog grows to 100,000 runs. So a write touches only the runs it changes (`run_store`):

1. take an exclusive lock on `<catalog>.lock` beside the catalog (`filelock.FileLock`: `flock(2)`);
2. read the records it changes inside the lock, so no other writer's change is lost;
3. apply the change in memory and validate the records it touched;
4. append the change to the store's log, then replace each run's own file atomically (temporary file,
   `fsync`, `os.replace`, `fsync` of the folder); several records: first their whole transaction in one
   file, the commit point;
5. release the lock.

The records live in `sweep_catalog.json.d/` (one file per run, one membership file per sweep). The
file `sweep_catalog.json` is the view users and tools read: `{"schema_version": 4, "view": ...,
"through": ..., "runs": {id: record, ...}}`, strict JSON (non-finite numbers are stored as null), one
run per line so `grep` and `diff` work on it, runs in the order they were first recorded. **It is
brought up to date when a process that wrote ends** (every fp4lab command and job that writes, at its
exit; `Catalog.sync()` on demand), so a script reading it after a command sees everything that command
did. A process killed before its end leaves that to the next process that writes. fp4lab itself
reads the store, never a stale view: `fp4lab status SWEEP` reads only that sweep's files.

A reader (`get`, `records`) takes no lock: files are swapped in by rename, so it never sees a partial
one. A process killed at any point leaves every record old or new, never half of one (and a
transaction of several records all old or all new: the next writer finishes one a kill cut off); at
most an orphaned temporary file stays behind, which the next writer deletes. An older catalog file
(`MIGRATIONS`) is read as it is and carried into a store by the first write. A file that is not a
valid catalog, or that has a newer `schema_version`, raises CatalogFormatError naming the file and the
fix, for reads and writes alike; it is never overwritten. A `sweep_catalog.json` replaced by hand
(restored, copied back from another machine) is the catalog from then on, unless the store holds
changes the file lacks: then both are kept and every command refuses, naming the fix.

Records are plain dicts (`RunRecord` documents every field). `upsert` and `update` merge: the fields
given replace the stored ones, except the dicts `summary`, `paths` and `extra`, which merge key by key;
`config`, `events` and `summary.loss_at_steps` are replaced whole; passing None clears a field.

Example::

    cat = Catalog("sweeps/s1/sweep_catalog.json")
    cat.upsert({"id": "3f2a9c1b7d40", "sweep": "s1", "recipe": "nvfp4", "state": "pending"})
    cat.update("3f2a9c1b7d40", state="running", started_at=utc_now())
    with cat.transaction() as tx:                      # several records, one lock, one write
        run = tx.get("3f2a9c1b7d40")
        tx.update(run["id"], attempts=run["attempts"] + 1, state="submitted")

Limits of the locking (what `filelock` can and cannot do):

- Local filesystems: `flock` is exact across processes; the kernel drops the lock of a process that
  dies (even by SIGKILL), so a crashed writer never leaves the catalog locked.
- NFS: Linux emulates `flock` with POSIX byte-range locks sent to the server (NLM for NFSv3, built in
  for NFSv4), so the lock works across nodes as long as the mount has working locking. With
  `-o nolock` or `local_lock=flock|all` the lock is local to each node and two nodes can write at
  once (each write is still atomic, but one of two simultaneous updates can be lost). After a client
  crash the server holds the lock until its lease or grace period ends (about 90 s on NFSv4), which
  shows up here as a lock timeout.
- Lustre mounted with `noflock` (the default on older releases), and some FUSE filesystems, return ENOSYS for `flock`; filelock
  then warns "falling back to SoftFileLock" and uses an `O_CREAT|O_EXCL` marker file. That is
  exclusive across nodes, and a marker left by a dead process is broken automatically when the
  holder ran on the same host; a marker left by a process that died on another host blocks writers
  until it is removed by hand (the lock timeout error says so).
- Writes are serialised, but each one writes only its own runs' files (a few ms at any catalog size:
  `scripts/bench_catalog.py`); rebuilding the view copies it once per process that wrote, outside
  the write lock, and processes ending together share one rebuild.
- The lock file stays in place after release on purpose (waiters must share one inode): do not delete
  it while jobs may be writing.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import json
import math
import os
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypedDict

from fp4lab.lab.records.run_store import VIEW_VERSION, RunStore, StoreConflict, sweeps_of

SCHEMA_VERSION = VIEW_VERSION  # 4
"""Version of the file layout this module reads and writes. Bump it (and add a migration to MIGRATIONS)
whenever a field or state is added or changes meaning; readers refuse files with a newer version instead
of silently dropping fields or failing on a state they do not know. Version 2 added the fields `sweeps`,
`owner` and `error` and the state `interrupted`; version 3 the state `pruned`. An older file is carried
over record by record on reading and written back at this version by the next write."""

STATES = ("pending", "submitted", "running", "completed", "pruned", "failed", "cancelled", "timeout", "preempted",
          "interrupted")
"""Run states, in lifecycle order. `pending`: recorded, not yet handed to an executor; `submitted`: handed
to Slurm or the local executor, not started; `running`: the trainer has started; `completed`: finished its
steps (it may still have diverged: see `verdict`); `pruned`: an Optuna trial its pruner stopped early (ended
as designed: never retried); `failed`: crashed or exited non-zero (see `error`);
`cancelled`: cancelled by a user or `scancel`; `timeout`: hit its wall-clock limit; `preempted`: stopped by
preemption (and possibly requeued: see `requeues`); `interrupted`: stopped by Ctrl-C (SIGINT) after a
checkpoint, resumed by the next `fp4lab sweep`."""

TERMINAL_STATES = frozenset({"completed", "pruned", "failed", "cancelled", "timeout", "preempted", "interrupted"})
IN_FLIGHT_STATES = frozenset({"submitted", "running"})
FAILED_STATES = frozenset({"failed", "cancelled", "timeout"})  # ended without a result: a re-run skips them unless asked
EXECUTORS = ("local", "slurm")

RunState = Literal["pending", "submitted", "running", "completed", "pruned", "failed", "cancelled", "timeout", "preempted",
                   "interrupted"]


class Summary(TypedDict, total=False):
    """Summary metrics of one run (all optional; null when unknown or non-finite)."""

    final_train_loss: float | None  # train loss at the last step
    best_train_loss: float | None  # lowest train loss seen
    final_val_loss: float | None  # validation loss at the last evaluation
    best_val_loss: float | None  # lowest validation loss seen
    loss_at_steps: dict[str, float | None]  # train loss at matched steps, keyed by the step as a decimal string
    tokens_per_s: float | None  # steady training throughput (median over the second half of the steps)
    startup_seconds: float | None  # training time beyond the steady pace: compiling, CUDA-graph capture
    peak_memory_mb: float | None  # peak accelerator (or host) memory in MiB


class Paths(TypedDict, total=False):
    """Where the run's files are (strings; relative paths are relative to the catalog's directory)."""

    run_dir: str | None  # the run's output directory (config.json, metrics.jsonl, summary.json)
    log: str | None  # stdout/stderr log the scanner reads (e.g. the Slurm .out file)
    checkpoint: str | None  # the checkpoint a resume starts from


class RunRecord(TypedDict, total=False):
    """One run of the catalog. Only `id` is required from the caller; every other field has a default
    (see `new_record`). Unknown top-level keys are rejected: put free-form data in `extra`."""

    id: str  # the dict key too: a sweep run's 12 hex digits of its config hash (specs.sweep_spec.run_id), a ratchet iteration's "ratchet-<tag>-<nnnn>"
    sweep: str | None  # name of the sweep that first asked for the run
    sweeps: list[str]  # every sweep that asks for it (runs are keyed by config, so sweeps share them)
    config: dict[str, Any]  # the resolved train config (TrainConfig as a dict)
    recipe: str | None  # recipe name or path
    git_commit: str | None  # code commit the run was launched from (full or short hash)
    git_dirty: bool | None  # whether the work tree had uncommitted changes at launch
    executor: Literal["local", "slurm"] | None  # which executor runs it
    slurm_job_id: str | None  # Slurm job id ("123456"; for an array task, the array's job id)
    slurm_array_index: int | None  # index within a Slurm job array (squeue names the task "123456_7")
    state: RunState  # lifecycle state, one of STATES (default "pending")
    created_at: str | None  # ISO 8601 UTC ("2026-01-31T12:00:00.000Z"); set on insert if not given
    submitted_at: str | None  # when handed to the executor
    started_at: str | None  # when the trainer started
    finished_at: str | None  # when it reached a terminal state
    updated_at: str | None  # set by the catalog on every write of the record
    verdict: str | None  # the log scanner's verdict: "converged", "diverged@120", ...
    events: list[dict[str, Any]]  # the log scanner's events (logscan.ScanEvent.to_dict): {kind, step, value, threshold, steps, peak, detail}
    summary: Summary  # summary metrics
    paths: Paths  # run dir, log, checkpoint
    attempts: int  # how many times the run was launched (first submission counts 1; resubmits add 1)
    requeues: int  # how many times Slurm requeued it (preemption / timeout requeue)
    owner: str | None  # "<host>:<pid>" of the process driving the run while it is in flight (one owner per run)
    error: str | None  # why a failed run failed: the last line of its error or log
    extra: dict[str, Any]  # free-form, JSON-serialisable data (e.g. seed, config_hash, notes)


_SUMMARY_FLOATS = (
    "final_train_loss",
    "best_train_loss",
    "final_val_loss",
    "best_val_loss",
    "tokens_per_s",
    "startup_seconds",
    "peak_memory_mb",
)
_SUMMARY_STEPS = ("steps_completed", "resumed_from_step")  # where the run stopped; where its last segment began
_SUMMARY_KEYS = (*_SUMMARY_FLOATS, *_SUMMARY_STEPS, "loss_at_steps")
_PATH_KEYS = ("run_dir", "log", "checkpoint")
_TIMESTAMPS = ("created_at", "submitted_at", "started_at", "finished_at", "updated_at")
_OPTIONAL_STRINGS = ("sweep", "recipe", "git_commit", "slurm_job_id", "verdict", "owner", "error")
_COUNTERS = ("attempts", "requeues")
_MERGED_DICTS = ("summary", "paths", "extra")
"""Fields an upsert/update merges key by key (one level deep). All other fields, `config`, `events` and
`summary.loss_at_steps` included, are replaced whole by a new value."""

FIELDS = (
    "id", "sweep", "sweeps", "config", "recipe", "git_commit", "git_dirty", "executor", "slurm_job_id",
    "slurm_array_index", "state", *_TIMESTAMPS, "verdict", "events", "summary", "paths", *_COUNTERS, "owner",
    "error", "extra",
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- errors


class CatalogError(Exception):
    """Base class of every catalog error."""


class CatalogFormatError(CatalogError):
    """The catalog file is malformed or was written by a newer fp4lab. It is never overwritten."""


class CatalogLockTimeout(CatalogError, TimeoutError):
    """The catalog's lock could not be taken within the timeout."""


class RecordError(CatalogError, ValueError):
    """A record (or an update to one) does not match the schema."""


class RunNotFound(CatalogError, KeyError):
    """`update` of a run id that is not in the catalog."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


# ------------------------------------------------------------------------------------------ validation


def utc_now() -> str:
    """The current time as the catalog writes timestamps: ISO 8601, UTC, milliseconds, "Z" suffix."""
    return _format_time(datetime.now(UTC))


def _format_time(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _timestamp(field: str, value: Any, run_id: str) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            moment = datetime.fromisoformat(value)
        except ValueError:
            raise RecordError(f"run {run_id!r}: {field}={value!r} is not an ISO 8601 timestamp") from None
    elif isinstance(value, datetime):
        moment = value
    else:
        raise RecordError(
            f"run {run_id!r}: {field} must be an ISO 8601 string or a datetime, not {type(value).__name__}"
        )
    if moment.tzinfo is None or moment.utcoffset() is None:
        raise RecordError(
            f"run {run_id!r}: {field}={value!r} has no timezone; pass UTC times (fp4lab.lab.records.catalog.utc_now())"
        )
    return _format_time(moment)


def _finite_json(value: Any, where: str) -> Any:
    """A deep copy of a JSON-compatible value with non-finite floats replaced by None (the file is strict
    JSON, readable by jq and browsers), tuples turned into lists and Paths into strings."""
    if value is None or isinstance(value, (bool, str, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise RecordError(f"{where}: key {key!r} is not a string (JSON objects have string keys)")
            out[key] = _finite_json(item, f"{where}.{key}")
        return out
    if isinstance(value, (list, tuple)):
        return [_finite_json(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return _finite_json(value.item(), where)
    raise RecordError(f"{where}: {type(value).__name__} is not JSON-serialisable")


def _number(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if hasattr(value, "item") and callable(value.item) and not isinstance(value, (int, float)):
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RecordError(f"{where} must be a number or None, not {value!r}")
    value = float(value)
    return value if math.isfinite(value) else None


def _validate_field(run_id: str, field: str, value: Any) -> Any:
    """Check one top-level field and return its normalised value."""
    where = f"run {run_id!r}: {field}"
    if field == "id":
        if not isinstance(value, str) or not value:
            raise RecordError(f"run id must be a non-empty string, not {value!r}")
        return value
    if field in _OPTIONAL_STRINGS:
        if value is not None and not isinstance(value, str):
            raise RecordError(f"{where} must be a string or None, not {value!r}")
        return value
    if field in _TIMESTAMPS:
        return _timestamp(field, value, run_id)
    if field == "sweeps":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
            raise RecordError(f"{where} must be a list of sweep names, not {value!r}")
        return list(dict.fromkeys(value))
    if field == "state":
        if value not in STATES:
            raise RecordError(f"{where}={value!r} is not one of {', '.join(STATES)}")
        return value
    if field == "executor":
        if value is not None and value not in EXECUTORS:
            raise RecordError(f"{where}={value!r} is not one of {', '.join(EXECUTORS)} (or None)")
        return value
    if field == "git_dirty":
        if value is not None and not isinstance(value, bool):
            raise RecordError(f"{where} must be True, False or None, not {value!r}")
        return value
    if field == "slurm_array_index":
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise RecordError(f"{where} must be a non-negative int or None, not {value!r}")
        return value
    if field in _COUNTERS:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise RecordError(f"{where} must be a non-negative int, not {value!r}")
        return value
    if field in ("config", "extra"):
        if not isinstance(value, Mapping):
            raise RecordError(f"{where} must be a dict, not {type(value).__name__}")
        return _finite_json(value, where)
    if field == "events":
        if not isinstance(value, (list, tuple)) or not all(isinstance(e, Mapping) for e in value):
            raise RecordError(f"{where} must be a list of dicts")
        return _finite_json(value, where)
    if field == "summary":
        return _validate_summary(run_id, value)
    if field == "paths":
        if not isinstance(value, Mapping):
            raise RecordError(f"{where} must be a dict with keys {', '.join(_PATH_KEYS)}")
        out = {}
        for key, item in value.items():
            if key not in _PATH_KEYS:
                raise RecordError(f"{where}: unknown key {key!r} (known: {', '.join(_PATH_KEYS)}; use extra)")
            if item is not None and not isinstance(item, (str, os.PathLike)):
                raise RecordError(f"{where}.{key} must be a path string or None, not {item!r}")
            out[key] = None if item is None else os.fspath(item)
        return out
    raise RecordError(
        f"run {run_id!r}: unknown field {field!r} (known: {', '.join(FIELDS)}; put free-form data in extra)"
    )


def _validate_summary(run_id: str, value: Any) -> dict[str, Any]:
    where = f"run {run_id!r}: summary"
    if not isinstance(value, Mapping):
        raise RecordError(f"{where} must be a dict with keys {', '.join(_SUMMARY_KEYS)}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key in _SUMMARY_FLOATS:
            out[key] = _number(item, f"{where}.{key}")
        elif key in _SUMMARY_STEPS:
            if item is not None and (isinstance(item, bool) or not isinstance(item, int) or item < 0):
                raise RecordError(f"{where}.{key} must be a non-negative integer or null, got {item!r}")
            out[key] = item
        elif key == "loss_at_steps":
            if not isinstance(item, Mapping):
                raise RecordError(f"{where}.loss_at_steps must be a dict step -> loss")
            steps = {}
            for step, loss in item.items():
                try:
                    step_int = int(step)
                except (TypeError, ValueError):
                    step_int = None
                if isinstance(step, bool) or step_int is None or step_int < 0 or str(step).strip() != str(step_int):
                    raise RecordError(f"{where}.loss_at_steps: step {step!r} is not a non-negative integer")
                steps[str(step_int)] = _number(loss, f"{where}.loss_at_steps[{step_int}]")
            out[key] = dict(sorted(steps.items(), key=lambda kv: int(kv[0])))
        else:
            raise RecordError(f"{where}: unknown key {key!r} (known: {', '.join(_SUMMARY_KEYS)}; use extra)")
    return out


def new_record(run_id: str, **fields: Any) -> RunRecord:
    """A complete, validated record: the defaults for `run_id` with `fields` applied."""
    record: dict[str, Any] = {
        "id": run_id, "sweep": None, "config": {}, "recipe": None, "git_commit": None, "git_dirty": None,
        "executor": None, "slurm_job_id": None, "slurm_array_index": None, "state": "pending",
        "created_at": None, "submitted_at": None, "started_at": None, "finished_at": None, "updated_at": None,
        "verdict": None, "events": [], "summary": {}, "paths": {}, "attempts": 0, "requeues": 0, "owner": None,
        "error": None, "extra": {}, "sweeps": [],
    }  # fmt: skip
    return _merge(record, {"id": run_id, **fields})  # type: ignore[return-value]


def validate_record(record: Mapping[str, Any]) -> RunRecord:
    """Check a complete record and return its normalised copy (defaults filled in). Raises RecordError."""
    if not isinstance(record, Mapping):
        raise RecordError(f"a record must be a dict, not {type(record).__name__}")
    if "id" not in record:
        raise RecordError(f"a record needs an 'id' (got keys {sorted(record)})")
    return new_record(**{"run_id": record["id"], **{k: v for k, v in record.items() if k != "id"}})


def _merge(existing: dict[str, Any], fields: Mapping[str, Any]) -> dict[str, Any]:
    """`existing` (a valid record, left untouched) with `fields` validated and merged in: the dicts
    `summary`, `paths` and `extra` key by key, every other field replaced."""
    run_id = existing["id"]
    merged = dict(existing)
    for field, value in fields.items():
        if field == "run_id":
            raise RecordError(f"run {run_id!r}: unknown field 'run_id' (the field is called 'id')")
        normalised = _validate_field(run_id, field, value)
        if field == "id" and normalised != run_id:
            raise RecordError(f"cannot change a run's id ({run_id!r} -> {normalised!r})")
        if field in _MERGED_DICTS:
            merged[field] = {**existing.get(field, {}), **normalised}
        else:
            merged[field] = normalised
    return merged


# ------------------------------------------------------------------------------------------- the file


def _fix_hint(path: Path) -> str:
    return (
        f"Fix: fp4lab writes catalogs only whole, so something else wrote this file; repair it by hand "
        f"(`python -m json.tool {path}` shows where it breaks) or move it aside to start an empty catalog. "
        f"fp4lab never overwrites a catalog it cannot read."
    )


def _parse(path: Path, text: str) -> dict[str, dict[str, Any]]:
    """The runs of a catalog file's text. Raises CatalogFormatError naming the file and the fix."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise CatalogFormatError(f"catalog {path} is not valid JSON ({error}). {_fix_hint(path)}") from None
    if not isinstance(data, dict) or "schema_version" not in data or "runs" not in data:
        raise CatalogFormatError(
            f"catalog {path} is not a sweep catalog: expected an object with 'schema_version' and 'runs'. "
            f"{_fix_hint(path)}"
        )
    version = data["schema_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CatalogFormatError(f"catalog {path} has an invalid schema_version {version!r}. {_fix_hint(path)}")
    if version > SCHEMA_VERSION:
        raise CatalogFormatError(
            f"catalog {path} has schema_version {version}, newer than the {SCHEMA_VERSION} this fp4lab reads. "
            f"Fix: upgrade fp4lab (pip install -U fp4lab, or pull the repo) in every environment that writes "
            f"this catalog; it was left untouched."
        )
    runs = data["runs"]
    if not isinstance(runs, dict):
        raise CatalogFormatError(f"catalog {path}: 'runs' must be an object keyed by run id. {_fix_hint(path)}")
    states = STATES_OF_VERSION.get(version, STATES)
    for run_id, record in runs.items():
        if not isinstance(record, dict) or record.get("id") != run_id or record.get("state") not in states:
            raise CatalogFormatError(
                f"catalog {path}: the record under {run_id!r} is malformed (it must be an object whose 'id' is "
                f"{run_id!r} and whose 'state' is one of {', '.join(states)}). {_fix_hint(path)}"
            )
        for step in range(version, SCHEMA_VERSION):
            MIGRATIONS[step](record)
    return runs


def _version_1_to_2(record: dict[str, Any]) -> None:
    """Version 2 added `sweeps`, `owner` and `error`: a record from before has their defaults."""
    for field, default in {"sweeps": [], "owner": None, "error": None}.items():
        record.setdefault(field, copy.copy(default))


def _version_2_to_3(record: dict[str, Any]) -> None:
    """Version 3 added the state `pruned`: a record from before keeps its state; an Optuna trial that
    version 2 told FAIL was never stopped by a pruner (version 2 had none), so nothing becomes pruned."""


def _version_3_to_4(record: dict[str, Any]) -> None:
    """Version 4 keeps each record in a file of its own (run_store) and the catalog file as the view
    rebuilt from them, with a header naming that view: a record itself is unchanged."""


# MIGRATIONS[v] carries a record of version v over to version v + 1, in place.
MIGRATIONS = {1: _version_1_to_2, 2: _version_2_to_3, 3: _version_3_to_4}
# The states a file of an older version may hold (a `pruned` record in a version 2 file was not written
# by fp4lab).
STATES_OF_VERSION = {**dict.fromkeys((1, 2), tuple(state for state in STATES if state != "pruned")), 3: STATES}


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except UnicodeDecodeError as error:
        raise CatalogFormatError(f"catalog {path} is not UTF-8 text ({error}). {_fix_hint(path)}") from None
    return _parse(path, text)


@contextlib.contextmanager
def _plain_errors() -> Iterator[None]:
    """The store's refusals as the catalog's own errors (one line naming both files and the fix)."""
    try:
        yield
    except StoreConflict as error:
        raise CatalogFormatError(str(error)) from None


# --------------------------------------------------------------------------------------- the catalog


_ACTIVE: dict[tuple[str, int, int], Transaction] = {}
"""The open transaction of each (lock path, process, thread): calls made inside one join it instead of taking the
lock again and writing a file the outer transaction would then overwrite."""


class Transaction:
    """A read-modify-write of several records under one lock (from `Catalog.transaction()`). Reads see
    the catalog as it is inside the lock plus this transaction's own changes. Nothing is written until
    the `with` block exits normally, then all of it at once; an exception discards every change."""

    def __init__(self, catalog: Catalog):
        self.path = catalog.path
        self._catalog = catalog
        self._changes: dict[str, dict[str, Any] | None] = {}  # run id -> new record (None: deleted)

    def _stored(self, run_id: str) -> dict[str, Any] | None:
        if run_id in self._changes:
            return self._changes[run_id]
        with _plain_errors():
            return self._catalog._store.get(run_id)

    def get(self, run_id: str) -> RunRecord | None:
        record = self._stored(run_id)
        return copy.deepcopy(record) if record is not None else None  # type: ignore[return-value]

    def __contains__(self, run_id: str) -> bool:
        return self._stored(run_id) is not None

    def records(self, sweep: str | None = None, state: str | Iterable[str] | None = None) -> list[RunRecord]:
        runs = self._catalog._stored_runs(sweep)
        for run_id, record in self._changes.items():
            if record is None:
                runs.pop(run_id, None)
            else:
                runs[run_id] = record
        return _select(runs, sweep, state)

    def upsert(self, record: Mapping[str, Any]) -> RunRecord:
        if not isinstance(record, Mapping) or "id" not in record:
            raise RecordError(f"upsert needs a dict with an 'id', not {record!r}")
        run_id = _validate_field("", "id", record["id"])
        existing = self._stored(run_id)
        if existing is None:
            merged = new_record(run_id, **{k: v for k, v in record.items() if k != "id"})
            if merged["created_at"] is None:
                merged["created_at"] = utc_now()
        else:
            merged = _merge(existing, record)
        return self._store(merged)

    def update(self, run_id: str, **fields: Any) -> RunRecord:
        existing = self._stored(run_id)
        if existing is None:
            raise RunNotFound(f"run {run_id!r} is not in catalog {self.path}; upsert() it first")
        return self._store(_merge(existing, fields))

    def delete(self, run_id: str) -> bool:
        """Remove a run; returns whether it was there."""
        found = self._stored(run_id) is not None
        if found:
            self._changes[run_id] = None
        return found

    def _store(self, record: dict[str, Any]) -> RunRecord:
        record["updated_at"] = utc_now()
        self._changes[record["id"]] = record
        return copy.deepcopy(record)  # type: ignore[return-value]


def _select(runs: Mapping[str, dict[str, Any]], sweep: str | None, state: Any, per_sweep: bool = False) -> list[RunRecord]:
    states = {state} if isinstance(state, str) else (set(state) if state is not None else None)
    if states is not None and not states <= set(STATES):
        raise ValueError(f"unknown state(s) {sorted(states - set(STATES))}; states are {', '.join(STATES)}")
    selected = []
    for record in runs.values():
        if states is not None and record.get("state") not in states:
            continue
        members = sweeps_of(record)
        if sweep is not None:
            members = [sweep] if sweep in members else []
        elif not per_sweep:
            members = [record.get("sweep")]
        for member in members:  # a shared run is seen as a run of the sweep it is selected for
            selected.append({**copy.deepcopy(record), "sweep": member})
    return selected  # type: ignore[return-value]


class Catalog:
    """The run catalog at `path` (conventionally `sweep_catalog.json`).

    `timeout` is how long a write waits for the lock, in seconds (negative: forever); a write that
    cannot get it raises CatalogLockTimeout. Reads take no lock. Instances are cheap, hold no open
    files between calls, and may be created in any process (fork included).
    """

    def __init__(self, path: str | os.PathLike[str], *, timeout: float = 60.0):
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")
        self.timeout = timeout
        self._key = os.path.realpath(self.lock_path)  # one catalog, however it is spelled (symlinks, cwd)
        self._locks: dict[int, Any] = {}  # pid -> FileLock, so a forked child never reuses its parent's
        self._store = RunStore(self.path, _read, self._locked, timeout)

    def __repr__(self) -> str:
        return f"Catalog({str(self.path)!r})"

    # reads (no lock) ---------------------------------------------------------------------------------

    def _active(self) -> Transaction | None:
        return _ACTIVE.get((self._key, os.getpid(), threading.get_ident()))

    def _stored_runs(self, sweep: str | None) -> dict[str, dict[str, Any]]:
        """The stored records (of `sweep` only, when given: read from that sweep's files alone)."""
        with _plain_errors():
            if sweep is not None:
                return {record["id"]: record for record in self._store.records_of_sweep(sweep)}
            return self._store.all_records()

    def get(self, run_id: str) -> RunRecord | None:
        """The record of `run_id`, or None if the catalog has no such run."""
        active = self._active()
        if active is not None:
            return active.get(run_id)
        with _plain_errors():
            record = self._store.get(run_id)
        return copy.deepcopy(record) if record is not None else None  # type: ignore[return-value]

    def __contains__(self, run_id: str) -> bool:
        return self.get(run_id) is not None

    def __len__(self) -> int:
        return len(self.records())

    def records(
        self, sweep: str | None = None, state: str | Iterable[str] | None = None, *, per_sweep: bool = False
    ) -> list[RunRecord]:
        """Every record, in insertion order, optionally only those of `sweep` and/or in `state` (one state
        or several). A run several sweeps share comes back with `sweep` set to the sweep asked for; with
        `per_sweep` and no sweep, once for each sweep it belongs to. With `sweep`, only that sweep's runs
        are read, in the order they joined it. Records read outside a transaction are each whole, but
        together they are not one snapshot: a writer may change one run between the reads of two."""
        active = self._active()
        if active is not None:
            return _select({r["id"]: r for r in active.records(sweep)}, sweep, state, per_sweep)
        return _select(self._stored_runs(sweep), sweep, state, per_sweep)

    def sweeps(self) -> list[str]:
        """The name of every sweep with a run in the catalog, sorted (read from the sweeps' index alone)."""
        with _plain_errors():
            return self._store.sweeps()

    def resolve(self, path: str | os.PathLike[str] | None) -> Path | None:
        """A path stored in a record (`paths.*`): relative paths are relative to the catalog's folder."""
        if path is None or str(path) == "":
            return None
        path = Path(path)
        return path if path.is_absolute() else self.path.parent / path

    def run_dir(self, run_id: str) -> Path | None:
        """The run folder of `run_id` as its record names it, or None (no such run, or no folder recorded)."""
        record = self.get(run_id)
        return self.resolve((record.get("paths") or {}).get("run_dir")) if record is not None else None

    def relative(self, path: str | os.PathLike[str]) -> str:
        """How a record stores `path` (relative to the current folder): relative to the catalog's folder."""
        return os.path.relpath(os.path.abspath(path), os.path.abspath(self.path.parent))

    # writes (locked) ---------------------------------------------------------------------------------

    def claim(self, run_id: str, owner: str, **fields: Any) -> str | None:
        """Make `owner` the run's owner (and merge `fields`) unless another live process owns it while
        it is in flight; returns that other owner, or None once the claim is made. One lock for the
        check and the write, so two processes never both claim a run."""
        with self.transaction() as tx:
            record = tx.get(run_id)
            if record is None:
                raise RunNotFound(f"run {run_id!r} is not in catalog {self.path}; upsert() it first")
            current = live_owner(record, owner)
            if current is not None:
                return current
            tx.update(run_id, owner=owner, **fields)
            return None

    def upsert(self, record: Mapping[str, Any]) -> RunRecord:
        """Insert `record` (a new id: missing fields get defaults, `created_at` defaults to now) or merge
        it into the stored one (given fields replace stored ones, except `summary`, `paths` and `extra`,
        which merge key by key). Returns the stored record."""
        with self.transaction() as tx:
            return tx.upsert(record)

    def update(self, run_id: str, **fields: Any) -> RunRecord:
        """Merge `fields` into an existing run (same rules as upsert); RunNotFound if it is missing."""
        with self.transaction() as tx:
            return tx.update(run_id, **fields)

    def delete(self, run_id: str) -> bool:
        """Remove a run; returns whether it was there."""
        with self.transaction() as tx:
            return tx.delete(run_id)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Transaction]:
        """Hold the lock, yield a Transaction to read and change records, store its changes at once on exit."""
        key = (self._key, os.getpid(), threading.get_ident())
        if (active := _ACTIVE.get(key)) is not None:  # nested: join the outer transaction
            yield active
            return
        with self._locked():
            tx = Transaction(self)
            _ACTIVE[key] = tx
            try:
                yield tx
            finally:
                del _ACTIVE[key]
            if tx._changes:
                with _plain_errors():
                    self._store.prepare_write()
                    _remember_write(self._key, self._store, self._store.commit(tx._changes))

    def sync(self) -> None:
        """Bring `sweep_catalog.json` up to date with every change (each process that wrote does this
        when it ends; call it to read the file while this process keeps writing)."""
        if self._active() is not None:
            raise RuntimeError(f"Catalog.sync() inside a transaction of {self.path}: the transaction's changes are "
                               "stored when its block ends; call sync() after it")
        with _plain_errors():
            self._store.sync()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        from filelock import FileLock, Timeout  # here, not at import: `fp4lab --help` stays fast

        lock = self._locks.get(os.getpid())
        if lock is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            lock = self._locks[os.getpid()] = FileLock(self.lock_path, timeout=self.timeout)
        try:
            lock.acquire()
        except Timeout:
            raise CatalogLockTimeout(
                f"could not lock catalog {self.path} within {self.timeout:g} s: another process holds "
                f"{self.lock_path}. A long transaction or a hung job may hold it (find it with "
                f"`fuser -v {self.lock_path}` on each node); a process that died holds no lock, except on NFS "
                f"until the server's lease expires (~90 s). If a stale soft-lock marker from a dead host is "
                f"left (Lustre without -o flock), delete {self.lock_path} once no job is writing. Or pass a "
                f"longer timeout: Catalog(path, timeout=...)."
            ) from None
        try:
            yield
        finally:
            lock.release()


_WRITTEN: dict[str, tuple[int, RunStore, int]] = {}
"""The catalogs this process wrote: lock key -> (process id, store, its last change)."""


def _remember_write(key: str, store: RunStore, seq: int) -> None:
    if not any(pid == os.getpid() for pid, _, _ in _WRITTEN.values()):
        atexit.register(_sync_written)  # once per process (a forked child inherits the parent's entries)
    _WRITTEN[key] = (os.getpid(), store, seq)


def _sync_written() -> None:
    """At the end of a process that wrote: bring each catalog's view up to date, unless another process
    already did (those waiting at once mostly find the one before them rebuilt it for them)."""
    for pid, store, seq in list(_WRITTEN.values()):
        if pid != os.getpid():
            continue
        try:
            store.sync(upto=seq)
        except Exception as error:  # noqa: BLE001 (the records are stored; only the view lags)
            print(f"warning: {store.path} was not brought up to date ({str(error).splitlines()[0]}); "
                  f"the runs are recorded in {store.root} and the next process that writes them rebuilds it",
                  file=sys.stderr)


def this_owner() -> str:
    """This process as a run owner: "<host>:<pid>"."""
    import socket

    return f"{socket.gethostname()}:{os.getpid()}"


def live_owner(record: Mapping[str, Any], *mine: str) -> str | None:
    """The owner driving an in-flight run, if it is a live process other than `mine`; else None."""
    owner = record.get("owner")
    if owner and owner not in mine and record.get("state") in IN_FLIGHT_STATES and owner_alive(owner):
        return owner
    return None


def owner_alive(owner: str) -> bool:
    """Whether the owning process still runs: checked on this host; another host's owner is assumed
    alive (a dead job there is corrected by `fp4lab status` from Slurm)."""
    import socket

    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return host != socket.gethostname()
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True
