"""fp4lab.lab.records.catalog: schema, merge rules, refusal of bad files, and safety under many writers and kills."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest

from fp4lab.lab.records.catalog import (
    FIELDS,
    SCHEMA_VERSION,
    Catalog,
    CatalogFormatError,
    CatalogLockTimeout,
    RecordError,
    RunNotFound,
    new_record,
    utc_now,
    validate_record,
)

ROOT = Path(__file__).resolve().parents[2]


def child(code: str, *args: str, **popen) -> subprocess.Popen:
    """A fresh Python process running `code` (sys.argv[1:] = args) with fp4lab importable."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, **popen)


def temp_files(path: Path) -> list[str]:
    """Temporary files of writes to the catalog: its view's, and its store's (kept in the store's tmp/)."""
    beside = [n for n in os.listdir(path.parent) if n.startswith(f".{path.name}.") and n.endswith(".tmp")]
    store_tmp = path.with_name(path.name + ".d") / "tmp"
    return sorted(beside + (os.listdir(store_tmp) if store_tmp.is_dir() else []))


def run_file(path: Path, run_id: str) -> Path:
    return path.with_name(path.name + ".d") / "runs" / f"{run_id}.json"


def load(path: Path) -> dict:
    """The file as a strict JSON reader (jq, a browser) sees it, once this process's writes are in it
    (the view is rebuilt when a process that wrote ends, or by `sync`)."""
    Catalog(path).sync()

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name} in the catalog")

    return json.loads(path.read_text(), parse_constant=no_constants)


@pytest.fixture
def cat(tmp_path) -> Catalog:
    return Catalog(tmp_path / "sweep_catalog.json")


FULL = {
    "id": "s1/nvfp4-tiny-s0",
    "sweep": "s1",
    "config": {"recipe": "nvfp4", "model": "tiny", "steps": 200, "lr": 0.02, "betas": [0.9, 0.95]},
    "recipe": "nvfp4",
    "git_commit": "aebc0261f0c3",
    "git_dirty": True,
    "executor": "slurm",
    "slurm_job_id": "123456_3",
    "slurm_array_index": 3,
    "state": "completed",
    "created_at": "2026-01-31T12:00:00.000Z",
    "submitted_at": "2026-01-31T12:00:01.500Z",
    "started_at": "2026-01-31T13:00:00+01:00",  # another offset: stored as UTC
    "finished_at": datetime(2026, 1, 31, 12, 30, tzinfo=UTC),
    "verdict": "diverged@120",
    "events": [{"kind": "loss_spike", "step": 118, "value": 9.5, "baseline": 3.1, "threshold": 6.0, "message": "x"}],
    "summary": {
        "final_train_loss": 3.25,
        "best_train_loss": 3.0,
        "final_val_loss": 3.5,
        "best_val_loss": 3.4,
        "loss_at_steps": {100: 4.0, "50": 5.0, 200: 3.25},
        "tokens_per_s": 12345.6,
        "peak_memory_mb": 2048,
    },
    "paths": {"run_dir": Path("runs/nvfp4-tiny-s0"), "log": "jobs/123456_3.out", "checkpoint": None},
    "attempts": 2,
    "requeues": 1,
    "extra": {"seed": 0, "config_hash": "abc"},
}


# ------------------------------------------------------------------------------------- schema and merge


def test_round_trip_through_the_file(cat):
    stored = cat.upsert(FULL)
    assert set(stored) == set(FIELDS)
    assert stored["started_at"] == "2026-01-31T12:00:00.000Z"
    assert stored["finished_at"] == "2026-01-31T12:30:00.000Z"
    assert stored["summary"]["loss_at_steps"] == {"50": 5.0, "100": 4.0, "200": 3.25}  # JSON keys, step order
    assert stored["summary"]["peak_memory_mb"] == 2048.0
    assert stored["paths"]["run_dir"] == "runs/nvfp4-tiny-s0"
    assert stored["updated_at"] is not None

    data = load(cat.path)
    assert data["schema_version"] == SCHEMA_VERSION == 4
    assert list(data["runs"]) == [FULL["id"]]
    again = Catalog(cat.path)  # a fresh reader
    assert again.get(FULL["id"]) == stored == data["runs"][FULL["id"]]
    assert validate_record(stored) == stored  # the stored form is a fixed point
    assert again.get("missing") is None
    assert FULL["id"] in again and len(again) == 1
    assert temp_files(cat.path) == []


def test_insert_fills_defaults_and_created_at(cat):
    before = datetime.now(UTC) - timedelta(seconds=1)
    stored = cat.upsert({"id": "r1"})
    assert stored == {**new_record("r1"), "created_at": stored["created_at"], "updated_at": stored["updated_at"]}
    assert stored["state"] == "pending" and stored["attempts"] == 0 and stored["events"] == []
    assert datetime.fromisoformat(stored["created_at"]) >= before
    assert utc_now().endswith("Z")


def test_merge_semantics(cat):
    cat.upsert(FULL)
    run_id = FULL["id"]
    merged = cat.upsert(
        {
            "id": run_id,
            "state": "failed",
            "summary": {"best_val_loss": 3.3, "loss_at_steps": {300: 3.1}},  # merge keys; loss_at_steps replaced
            "paths": {"checkpoint": "runs/x/checkpoint.pt"},
            "extra": {"note": "requeued"},
            "config": {"steps": 400},  # replaced whole: a resolved config is one value
            "events": [],  # replaced whole: the scanner re-reads the whole log
            "verdict": None,  # None clears
        }
    )
    assert merged["state"] == "failed"
    assert merged["summary"] == {**cat.get(run_id)["summary"], "best_val_loss": 3.3}
    assert merged["summary"]["final_train_loss"] == 3.25 and merged["summary"]["loss_at_steps"] == {"300": 3.1}
    assert merged["paths"] == {
        "run_dir": "runs/nvfp4-tiny-s0",
        "log": "jobs/123456_3.out",
        "checkpoint": "runs/x/checkpoint.pt",
    }
    assert merged["extra"] == {"seed": 0, "config_hash": "abc", "note": "requeued"}
    assert merged["config"] == {"steps": 400} and merged["events"] == [] and merged["verdict"] is None
    assert merged["created_at"] == "2026-01-31T12:00:00.000Z" and merged["attempts"] == 2  # untouched fields kept

    updated = cat.update(run_id, attempts=3, extra={"seed": 1})
    assert updated["attempts"] == 3 and updated["extra"] == {"seed": 1, "config_hash": "abc", "note": "requeued"}
    assert cat.get(run_id) == updated

    with pytest.raises(RunNotFound, match="'nope' is not in catalog .*sweep_catalog.json"):
        cat.update("nope", state="running")
    with pytest.raises(RecordError, match="cannot change a run's id"):
        cat.update(run_id, id="other")
    assert cat.delete(run_id) and not cat.delete(run_id) and cat.get(run_id) is None


def test_records_filters(cat):
    for i, (sweep, state) in enumerate([("a", "pending"), ("a", "running"), ("b", "running"), ("b", "failed")]):
        cat.upsert({"id": f"r{i}", "sweep": sweep, "state": state})
    assert [r["id"] for r in cat.records()] == ["r0", "r1", "r2", "r3"]
    assert [r["id"] for r in cat.records(sweep="a")] == ["r0", "r1"]
    assert [r["id"] for r in cat.records(state="running")] == ["r1", "r2"]
    assert [r["id"] for r in cat.records(sweep="b", state=["running", "failed"])] == ["r2", "r3"]
    with pytest.raises(ValueError, match="unknown state"):
        cat.records(state="done")
    cat.records()[0]["state"] = "failed"  # records are copies
    assert cat.get("r0")["state"] == "pending"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"state": "done"}, "state='done' is not one of pending, submitted"),
        ({"executor": "k8s"}, "executor='k8s' is not one of local, slurm"),
        ({"started_at": "2026-01-31T12:00:00"}, "has no timezone"),
        ({"started_at": "yesterday"}, "not an ISO 8601 timestamp"),
        ({"attempts": -1}, "attempts must be a non-negative int"),
        ({"requeues": 1.5}, "requeues must be a non-negative int"),
        ({"git_dirty": "yes"}, "git_dirty must be True, False or None"),
        ({"slurm_array_index": "3"}, "slurm_array_index must be a non-negative int"),
        ({"config": [1, 2]}, "config must be a dict"),
        ({"config": {"f": object()}}, r"config.f: object is not JSON-serialisable"),
        ({"events": [1]}, "events must be a list of dicts"),
        ({"summary": {"final_loss": 1.0}}, "summary: unknown key 'final_loss'"),
        ({"summary": {"tokens_per_s": "fast"}}, "tokens_per_s must be a number"),
        ({"summary": {"loss_at_steps": {"x": 1.0}}}, "step 'x' is not a non-negative integer"),
        ({"paths": {"ckpt": "a"}}, "paths: unknown key 'ckpt'"),
        ({"seed": 3}, "unknown field 'seed'.*put free-form data in extra"),
        ({"extra": {1: "a"}}, "key 1 is not a string"),
    ],
)
def test_invalid_fields_are_refused(cat, fields, message):
    cat.upsert({"id": "r"})
    before = cat.path.read_bytes()
    with pytest.raises(RecordError, match=message):
        cat.update("r", **fields)
    with pytest.raises(RecordError, match=message):
        cat.upsert({"id": "new", **fields})
    assert cat.path.read_bytes() == before


def test_bad_ids_are_refused(cat):
    for bad in ({}, {"id": ""}, {"id": 3}, {"run_id": "x"}):
        with pytest.raises(RecordError):
            cat.upsert(bad)
    assert not cat.path.exists()


def test_non_finite_numbers_are_stored_as_null(cat):
    nan, inf = float("nan"), float("inf")
    stored = cat.upsert(
        {
            "id": "d",
            "verdict": "diverged@120",
            "summary": {"final_train_loss": nan, "best_train_loss": 2.0, "loss_at_steps": {120: inf}},
            "events": [{"kind": "nonfinite", "step": 120, "value": nan}],
            "config": {"clip": -inf},
        }
    )
    assert stored["summary"] == {"final_train_loss": None, "best_train_loss": 2.0, "loss_at_steps": {"120": None}}
    assert stored["events"][0]["value"] is None and stored["config"]["clip"] is None
    assert load(cat.path)["runs"]["d"] == stored  # strict JSON: no NaN / Infinity literals


def test_transaction_writes_once_and_discards_on_error(cat):
    cat.upsert({"id": "shared", "extra": {"count": 0}})
    with cat.transaction() as tx:
        count = tx.get("shared")["extra"]["count"]
        tx.update("shared", extra={"count": count + 1})
        tx.upsert({"id": "new"})
        cat.update("new", state="running")  # a call on the Catalog inside the block joins the transaction
        assert cat.get("new")["state"] == "running" and "new" in tx
        assert not run_file(cat.path, "new").exists()  # nothing on disk until the block ends
        with pytest.raises(RuntimeError, match="inside a transaction"):
            cat.sync()
    assert cat.get("shared")["extra"]["count"] == 1 and cat.get("new")["state"] == "running"

    cat.sync()
    before = cat.path.read_bytes(), run_file(cat.path, "shared").read_bytes(), run_file(cat.path, "new").read_bytes()
    with pytest.raises(RuntimeError, match="boom"), cat.transaction() as tx:
        tx.update("shared", extra={"count": 99})
        tx.delete("new")
        raise RuntimeError("boom")
    cat.sync()
    assert (cat.path.read_bytes(), run_file(cat.path, "shared").read_bytes(), run_file(cat.path, "new").read_bytes()) == before

    mtime = cat.path.stat().st_mtime_ns
    with cat.transaction() as tx:  # a read-only transaction does not rewrite the file
        tx.records()
    assert cat.path.stat().st_mtime_ns == mtime


def test_existing_file_mode_is_kept(cat):
    cat.upsert({"id": "a"})
    cat.sync()
    os.chmod(cat.path, 0o640)
    cat.upsert({"id": "b"})
    cat.sync()
    assert "b" in json.loads(cat.path.read_text())["runs"] and cat.path.stat().st_mode & 0o777 == 0o640


# --------------------------------------------------------------------------------- refusing bad files


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"schema_version": 5, "runs": {}}', "schema_version 5, newer than the 4 this fp4lab reads.*upgrade fp4lab"),
        ('{"schema_version": 2, "runs": {"a": {"id": "a", "state": "pruned"}}}', "record under 'a' is malformed"),
        ('{"schema_version": 1, "runs": {"a": {"id": "a", "st', "is not valid JSON"),
        ("", "is not valid JSON"),
        ("[]", "is not a sweep catalog"),
        ('{"runs": {}}', "is not a sweep catalog"),
        ('{"schema_version": "1", "runs": {}}', "invalid schema_version '1'"),
        ('{"schema_version": 1, "runs": []}', "'runs' must be an object"),
        ('{"schema_version": 1, "runs": {"a": {"id": "b", "state": "pending"}}}', "record under 'a' is malformed"),
        ('{"schema_version": 1, "runs": {"a": {"id": "a", "state": "weird"}}}', "record under 'a' is malformed"),
    ],
)
def test_bad_files_raise_a_clear_error_and_are_never_overwritten(cat, text, message):
    cat.path.write_text(text)
    for action in (lambda: cat.get("a"), cat.records, lambda: cat.upsert({"id": "x"}), lambda: cat.update("a")):
        with pytest.raises(CatalogFormatError, match=message) as raised:
            action()
        assert str(cat.path) in str(raised.value) and "Fix:" in str(raised.value)
    assert cat.path.read_text() == text
    assert temp_files(cat.path) == []


# ------------------------------------------------------------------------------ concurrency and kills

WRITER = """
import sys
from fp4lab.lab.records.catalog import Catalog
path, worker, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cat = Catalog(path, timeout=120)
for i in range(n):
    cat.upsert({"id": f"w{worker:02d}-{i:03d}", "sweep": "load", "state": "running", "extra": {"worker": worker}})
    if i % 2 == 0:  # a read-modify-write of the shared record, racing the other workers' upserts
        with cat.transaction() as tx:
            shared = tx.get("shared")
            mine = shared["extra"].get(f"w{worker}", 0) + 1
            tx.update("shared", attempts=shared["attempts"] + 1, extra={f"w{worker}": mine})
"""


def test_many_concurrent_writer_processes(cat):
    workers, per_worker = 16, 25
    cat.upsert({"id": "shared", "sweep": "load"})
    start = time.perf_counter()
    procs = [child(WRITER, str(cat.path), str(w), str(per_worker)) for w in range(workers)]
    assert [p.wait(timeout=120) for p in procs] == [0] * workers
    elapsed = time.perf_counter() - start

    runs = load(cat.path)["runs"]
    expected = {f"w{w:02d}-{i:03d}" for w in range(workers) for i in range(per_worker)}
    assert set(runs) == expected | {"shared"}
    assert all(runs[f"w{w:02d}-000"]["extra"] == {"worker": w} for w in range(workers))
    shared = runs["shared"]
    increments = (per_worker + 1) // 2
    assert shared["attempts"] == workers * increments  # no lost read-modify-write
    assert shared["extra"] == {f"w{w}": increments for w in range(workers)}
    assert temp_files(cat.path) == []
    print(f"\n{workers} processes x ({per_worker} upserts + {increments} locked increments): "
          f"{workers * (per_worker + increments)} writes in {elapsed:.2f} s")  # fmt: skip


KILLED_AT = """
import os, signal, sys
from fp4lab.lab.records import catalog
cat = catalog.Catalog(sys.argv[1])
where = sys.argv[2]
def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
def die_at_call(number, real):
    calls = []
    def maybe_die(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            die()
        return real(*args, **kwargs)
    return maybe_die
if where == "change log":       # the change line appended, not yet on disk (the first fsync of a write)
    os.fsync = die
elif where == "fsync":          # the run file's temporary file written, not yet on disk
    os.fsync = die_at_call(2, os.fsync)
elif where == "replace":        # the run file's temporary file on disk, not yet renamed over the run's file
    os.replace = die
elif where == "write":          # the run file's temporary file half written
    real_fdopen = os.fdopen
    class HalfWriter:
        def __init__(self, handle):
            self.handle = handle
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)
        def write(self, data):
            self.handle.write(bytes(data[: len(data) // 2]))
            self.handle.flush()
            die()
        def fileno(self):
            return self.handle.fileno()
    os.fdopen = lambda fd, *args, **kwargs: HalfWriter(real_fdopen(fd, *args, **kwargs))
elif where == "transaction":    # inside a transaction, before anything is written
    with cat.transaction() as tx:
        tx.upsert({"id": "never"})
        die()
elif where == "mid-transaction":  # a transaction of two runs committed, one run file replaced, not the other
    real_replace = os.replace
    os.replace = lambda src, dst: die() if str(dst).endswith("never.json") else real_replace(src, dst)
    with cat.transaction() as tx:
        tx.update("committed", state="failed")
        tx.upsert({"id": "never"})
cat.upsert({"id": "never", "config": {"blob": "x" * 100000}})
"""


@pytest.mark.parametrize("where", ["change log", "write", "fsync", "replace", "transaction", "mid-transaction"])
def test_writer_killed_at_each_step_leaves_every_record_whole(cat, where):
    cat.upsert({"id": "committed", "state": "completed"})
    cat.sync()
    view = cat.path.read_bytes()
    proc = child(KILLED_AT, str(cat.path), where)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert cat.path.read_bytes() == view  # the view, whole: only a process that ends rebuilds it
    # A transaction whose commit point passed is seen whole, even before anyone finishes applying it.
    applied = where == "mid-transaction"
    expected = {"committed": "failed", "never": "pending"} if applied else {"committed": "completed"}
    assert {r["id"]: r["state"] for r in Catalog(cat.path).records()} == expected
    assert Catalog(cat.path).get("never") == (cat.get("never") if applied else None)
    assert len(temp_files(cat.path)) == (where in ("write", "fsync", "replace", "mid-transaction"))
    cat.upsert({"id": "after"})  # the next writer removes the orphan (under the lock nobody else writes) and
    assert temp_files(cat.path) == []  # finishes the transaction
    assert not (cat.path.with_name(cat.path.name + ".d") / "transaction.json").exists()
    assert [r["id"] for r in cat.records()] == [*expected, "after"]
    assert list(load(cat.path)["runs"]) == [*expected, "after"]


LOOPING_WRITER = """
import sys
from fp4lab.lab.records.catalog import Catalog
cat = Catalog(sys.argv[1], timeout=30)
blob = "x" * 200_000                      # large records: most of the time is spent writing
for i in range(10**9):
    run_id = f"{sys.argv[2]}-{i:05d}"
    steps = {s: 1.0 for s in range(200)}
    record = {"config": {"blob": blob, "i": i}, "summary": {"loss_at_steps": steps}, "sweep": sys.argv[2]}
    if i % 2:                             # one run
        cat.upsert({"id": run_id, **record})
    else:                                 # a transaction of two runs: both or neither, wherever a kill lands
        with cat.transaction() as tx:
            tx.upsert({"id": run_id, **record})
            tx.upsert({"id": run_id + "-pair", **record})
    print(run_id, flush=True)             # printed only after the write returned: committed
"""


def test_writer_sigkilled_at_random_moments(cat):
    rng = random.Random(0)
    committed: list[str] = []
    unconfirmed: set[str] = set()
    orphans_seen = 0
    rounds = 12
    for round_ in range(rounds):
        proc = child(LOOPING_WRITER, str(cat.path), f"k{round_}", stdout=subprocess.PIPE, text=True)
        printed = []
        for _ in range(rng.randint(2, 4)):  # let it commit a few records first (it prints each once committed)
            line = proc.stdout.readline().strip()
            assert line, "the writer died on its own"
            printed.append(line)
        # Then kill it at a random moment of the writes that follow. The pause only picks that moment:
        # every assertion below holds wherever the kill lands.
        time.sleep(rng.uniform(0.0, 0.3))
        proc.kill()
        rest, _ = proc.communicate(timeout=30)
        printed += rest.split()
        committed += printed
        orphans_seen += bool(temp_files(cat.path))

        for reader in (lambda: {r["id"]: r for r in Catalog(cat.path).records()},  # the store, as fp4lab reads it
                       lambda: load(cat.path)["runs"]):  # the view rebuilt from it: valid JSON, never a partial file
            runs = reader()
            ids = {i.removesuffix("-pair") for i in runs}
            missing = set(committed) - ids
            assert not missing, f"committed records lost after kill {round_}: {sorted(missing)[:5]}"
            # besides those, at most the one write each writer committed but was killed before printing
            assert ids <= set(committed) | unconfirmed | {f"k{round_}-{len(printed):05d}"}
            pairs = [i for i in ids if int(i[-5:]) % 2 == 0]
            assert all(i in runs and f"{i}-pair" in runs for i in pairs), "half of a transaction"
            assert all(len(r["config"]["blob"]) == 200_000 for r in runs.values())
        unconfirmed.add(f"k{round_}-{len(printed):05d}")  # ids count from 00000
        members = {r["id"] for r in Catalog(cat.path).records(sweep=f"k{round_}")}  # the sweep's index agrees
        assert members == {i for i in runs if i.startswith(f"k{round_}-")}
    assert len(committed) >= 2 * rounds  # at least 2 confirmed per round, however fast the machine writes
    cat.upsert({"id": "after"})
    assert temp_files(cat.path) == []
    print(f"\n{rounds} kills, {len(committed)} committed writes kept, {orphans_seen} kills left an orphaned temp file")


HOLDER = """
import sys, time
from fp4lab.lab.records.catalog import Catalog
with Catalog(sys.argv[1]).transaction() as tx:
    tx.upsert({"id": "holder"})
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_lock_timeout_gives_a_clear_error(cat):
    cat.upsert({"id": "a"})
    before = cat.path.read_bytes()
    holder = child(HOLDER, str(cat.path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        impatient = Catalog(cat.path, timeout=0.3)
        start = time.perf_counter()
        with pytest.raises(
            CatalogLockTimeout, match=r"could not lock catalog .*sweep_catalog.json within 0.3 s"
        ) as err:
            impatient.upsert({"id": "b"})
        # A floor only: it gave up after waiting out its timeout, not at once. No ceiling: on a loaded
        # machine giving up takes longer, which is not a fault.
        assert time.perf_counter() - start >= 0.3
        assert isinstance(err.value, TimeoutError) and str(impatient.lock_path) in str(err.value)
        assert impatient.get("a") is not None  # reads take no lock
        assert cat.path.read_bytes() == before
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    assert [r["id"] for r in Catalog(cat.path, timeout=5).records()] == ["a", "holder"]
    Catalog(cat.path, timeout=5).upsert({"id": "b"})


def test_killed_lock_holder_releases_the_lock(cat):
    holder = child(HOLDER, str(cat.path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    holder.kill()
    holder.wait(timeout=30)
    Catalog(cat.path, timeout=5).upsert({"id": "b"})  # the kernel dropped the dead holder's lock
    assert [r["id"] for r in cat.records()] == ["b"]


def test_an_update_replaces_its_run_file_alone_whatever_the_catalog_size(cat, monkeypatch):
    for i in range(100):  # a catalog of 100 runs with realistic configs
        cat.upsert(
            {
                "id": f"r{i}",
                "config": {f"k{j}": j for j in range(40)},
                "summary": {"loss_at_steps": {s: 1.0 for s in range(0, 1000, 50)}},
            }
        )
    before = load(cat.path)["runs"]
    view = cat.path.read_bytes()
    replaced: list[Path] = []
    real_replace = os.replace

    def counted_replace(src, dst, *args, **kwargs):
        replaced.append(Path(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", counted_replace)
    n = 50
    start = time.perf_counter()
    for i in range(n):
        cat.update(f"r{i}", state="completed")
    per_write = (time.perf_counter() - start) / n
    # printed, not asserted: a wall-clock bound fails on a loaded machine, not on slow code
    print(f"\nupdate on a 100-run catalog: {per_write * 1e3:.2f} ms")
    assert replaced == [run_file(cat.path, f"r{i}") for i in range(n)]  # its own file, once; not the view
    assert cat.path.read_bytes() == view  # the view is rebuilt once, when the process that wrote ends
    assert [r["state"] for r in cat.records()][:n] == ["completed"] * n  # readers see every update already
    after = load(cat.path)["runs"]
    assert list(after) == list(before)  # the rebuilt view keeps the runs' order
    assert [after[f"r{i}"]["state"] for i in range(n)] == ["completed"] * n
    assert {k: v for k, v in after.items() if int(k[1:]) >= n} == {k: v for k, v in before.items() if int(k[1:]) >= n}
    assert temp_files(cat.path) == []


def test_import_loads_neither_torch_nor_filelock():
    code = "import sys, fp4lab.lab.records.catalog; print(sorted(m for m in ('torch', 'filelock') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_timezone_offsets_are_normalised_to_utc(cat):
    stored = cat.upsert({"id": "t", "submitted_at": datetime(2026, 1, 1, 9, 0, tzinfo=timezone(timedelta(hours=-5)))})
    assert stored["submitted_at"] == "2026-01-01T14:00:00.000Z"


def test_threads_and_second_instances_in_one_process(cat, tmp_path):
    cat.upsert({"id": "shared"})
    (tmp_path / "alias").symlink_to(tmp_path, target_is_directory=True)
    alias = Catalog(tmp_path / "alias" / "sweep_catalog.json")
    with cat.transaction():  # another spelling of the same catalog in the same thread joins the transaction
        alias.update("shared", verdict="converged")
    assert cat.get("shared")["verdict"] == "converged"

    def work(instance: Catalog) -> None:
        for _ in range(20):
            with instance.transaction() as tx:
                tx.update("shared", attempts=tx.get("shared")["attempts"] + 1)

    threads = [threading.Thread(target=work, args=(c,)) for c in (cat, cat, Catalog(cat.path), alias)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert cat.get("shared")["attempts"] == 80


@pytest.mark.parametrize("version", [1, 2])
def test_an_older_catalog_is_carried_over_without_loss_and_written_back_at_the_current_version(tmp_path, version):
    path = tmp_path / "sweep_catalog.json"
    older = {"id": "a", "sweep": "s1", "state": "interrupted", "summary": {"final_val_loss": 2.5}, "extra": {"trial": 3}}
    if version == 2:
        older |= {"sweeps": ["s1", "s0"], "owner": None, "error": None}
    path.write_text(json.dumps({"schema_version": version, "runs": {"a": older}}) + "\n")
    cat = Catalog(path)
    record = cat.get("a")
    assert record["sweeps"] == ([] if version == 1 else ["s1", "s0"]) and (record["owner"], record["error"]) == (None, None)
    assert (record["state"], record["summary"], record["extra"]) == ("interrupted", {"final_val_loss": 2.5}, {"trial": 3})
    assert [r["id"] for r in cat.records(sweep="s1")] == ["a"]
    cat.update("a", state="pruned")  # the state version 3 added, on a carried-over record
    written = load(path)
    assert written["schema_version"] == SCHEMA_VERSION == 4
    assert written["runs"]["a"]["state"] == "pruned" and written["runs"]["a"]["summary"] == {"final_val_loss": 2.5}
    assert Catalog(path).get("a")["extra"] == {"trial": 3}


def test_every_older_version_has_a_migration_step():
    from fp4lab.lab.records.catalog import MIGRATIONS, STATES_OF_VERSION

    assert sorted(MIGRATIONS) == sorted(STATES_OF_VERSION) == list(range(1, SCHEMA_VERSION))


def test_a_run_shared_by_sweeps_is_selected_for_each_as_a_run_of_that_sweep(tmp_path):
    cat = Catalog(tmp_path / "c.json")
    cat.upsert({"id": "base", "sweep": "first", "sweeps": ["first", "second"]})
    cat.upsert({"id": "only", "sweep": "first", "sweeps": ["first"]})
    assert [(r["id"], r["sweep"]) for r in cat.records(sweep="second")] == [("base", "second")]
    assert [(r["id"], r["sweep"]) for r in cat.records(sweep="first")] == [("base", "first"), ("only", "first")]
    assert [(r["id"], r["sweep"]) for r in cat.records()] == [("base", "first"), ("only", "first")]
    assert [(r["id"], r["sweep"]) for r in cat.records(per_sweep=True)] == [("base", "first"), ("base", "second"), ("only", "first")]
    with pytest.raises(RecordError, match="sweeps must be a list of sweep names"):
        cat.update("base", sweeps="second")


def test_a_run_has_one_live_owner(tmp_path):
    import socket
    import subprocess
    import sys

    from fp4lab.lab.records.catalog import this_owner

    cat = Catalog(tmp_path / "c.json")
    cat.upsert({"id": "r", "state": "running"})
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = f"{socket.gethostname()}:{other.pid}"
        assert cat.claim("r", live) is None
        assert cat.claim("r", this_owner()) == live  # in flight, owned by a live process
        cat.update("r", state="interrupted")
        assert cat.claim("r", this_owner()) is None  # not in flight: free to take
        cat.update("r", state="running", owner=live)
    finally:
        other.kill()
        other.wait()
    assert cat.claim("r", this_owner()) is None  # its owner died: the claim passes on
    assert cat.get("r")["owner"] == this_owner()
