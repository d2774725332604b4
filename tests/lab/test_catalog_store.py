"""fp4lab.lab.records.run_store: the catalog's records one file per run, and sweep_catalog.json as the
view rebuilt from them (issue 42): reads of one sweep touch only its files, the view is brought up to
date when a process that wrote ends, and a view replaced by hand is adopted or refused, never lost."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fp4lab.lab.records import run_store
from fp4lab.lab.records.catalog import Catalog, CatalogFormatError

ROOT = Path(__file__).resolve().parents[2]


def run_in_child(code: str, *args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, check=True, timeout=120)


def view(path: Path) -> dict:
    """The view as a script reads it: the file alone, no fp4lab."""
    return json.loads(path.read_text())["runs"]


@pytest.fixture
def cat(tmp_path) -> Catalog:
    return Catalog(tmp_path / "sweep_catalog.json")


def test_a_process_that_wrote_brings_the_view_up_to_date_when_it_ends(cat):
    run_in_child("""
        import sys
        from fp4lab.lab.records.catalog import Catalog
        cat = Catalog(sys.argv[1])
        for i in range(3):
            cat.upsert({"id": f"r{i}", "sweep": "s"})
        cat.update("r1", state="running")
    """, str(cat.path))
    runs = view(cat.path)  # no sync here: the child rebuilt it as it exited
    assert list(runs) == ["r0", "r1", "r2"] and runs["r1"]["state"] == "running"
    assert json.loads(cat.path.read_text())["schema_version"] == 4


def test_many_processes_ending_together_leave_a_view_with_every_write(cat):
    code = """
        import sys
        from fp4lab.lab.records.catalog import Catalog
        cat = Catalog(sys.argv[1], timeout=-1)
        for i in range(20):
            cat.upsert({"id": f"{sys.argv[2]}-{i}", "sweep": sys.argv[2]})
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), str(cat.path), f"w{w}"], env=env) for w in range(8)]
    assert [p.wait(timeout=120) for p in procs] == [0] * 8
    assert set(view(cat.path)) == {f"w{w}-{i}" for w in range(8) for i in range(20)}
    assert cat.sweeps() == [f"w{w}" for w in range(8)]


def test_a_sweeps_reads_open_only_its_own_runs_files(cat, monkeypatch):
    for i in range(30):
        cat.upsert({"id": f"r{i:02d}", "sweep": f"s{i % 3}"})
    cat.update("r05", sweeps=["s2", "extra"])  # joins a second sweep later
    cat.sync()
    opened: list[str] = []
    real_load = run_store.RunStore._load
    monkeypatch.setattr(run_store.RunStore, "_load", lambda self, run_id: opened.append(run_id) or real_load(self, run_id))
    monkeypatch.setattr(run_store.RunStore, "all_records", lambda self: pytest.fail("read every record"))
    assert [r["id"] for r in cat.records(sweep="extra")] == ["r05"]
    assert opened == ["r05"]
    opened.clear()
    assert [r["id"] for r in cat.records(sweep="s2")] == [f"r{i:02d}" for i in range(2, 30, 3)]
    assert sorted(opened) == [f"r{i:02d}" for i in range(2, 30, 3)]
    assert cat.sweeps() == ["extra", "s0", "s1", "s2"]


def test_membership_follows_runs_that_leave_a_sweep_or_are_deleted(cat):
    cat.upsert({"id": "a", "sweep": "s1", "sweeps": ["s1", "s2"]})
    cat.upsert({"id": "b", "sweep": "s2", "sweeps": ["s2"]})
    cat.update("a", sweeps=["s1"])
    assert [r["id"] for r in cat.records(sweep="s2")] == ["b"]
    cat.delete("b")
    assert cat.sweeps() == ["s1"] and cat.records(sweep="s2") == []
    assert not (cat._store.root / "sweeps" / "s2").exists()


def test_names_stay_distinct_files_on_a_case_insensitive_filesystem():
    names = ["A", "a", "ratchet/x", "ratchet%2Fx", ".", "..", "é"]
    files = [run_store.file_name(n) for n in names]
    assert len({f.lower() for f in files}) == len(names)
    assert all("/" not in f and f not in (".", "..") for f in files)


def test_a_view_replaced_by_hand_is_the_catalog_when_the_store_holds_nothing_more(cat):
    cat.upsert({"id": "a", "state": "completed"})
    cat.upsert({"id": "b"})
    cat.sync()
    backup = cat.path.read_text()
    cat.update("b", state="failed")
    cat.delete("a")
    cat.sync()
    cat.path.write_text(backup)  # e.g. a copy carried back from another machine, or restored
    assert [r["id"] for r in cat.records()] == ["a", "b"] and cat.get("b")["state"] == "pending"
    cat.upsert({"id": "c"})  # the next write carries the file into the store
    cat.sync()
    assert list(view(cat.path)) == ["a", "b", "c"] and cat.get("a")["state"] == "completed"


def test_a_view_replaced_while_the_store_holds_more_is_refused_naming_both(cat):
    cat.upsert({"id": "a"})
    cat.sync()
    cat.upsert({"id": "b"})  # in the store, not yet in the view
    cat.path.write_text(json.dumps({"schema_version": 3, "runs": {}}))
    before = sorted(p.name for p in cat._store.root.rglob("*")), cat.path.read_bytes()
    for action in (lambda: cat.records(), lambda: cat.get("a"), lambda: cat.upsert({"id": "c"}), cat.sync):
        with pytest.raises(CatalogFormatError, match=r"replaced or edited outside fp4lab.*runs b\b.*move .* aside"):
            action()
    assert (sorted(p.name for p in cat._store.root.rglob("*")), cat.path.read_bytes()) == before
    cat.path.unlink()  # the fix the message names, keeping the store's runs
    cat.sync()
    assert list(view(cat.path)) == ["a", "b"]


def test_a_deleted_view_is_rebuilt_from_the_store(cat):
    for run_id in ("x", "y", "z"):
        cat.upsert({"id": run_id})
    cat.sync()
    cat.path.unlink()
    assert [r["id"] for r in cat.records()] == ["x", "y", "z"]  # oldest first
    cat.sync()
    assert list(view(cat.path)) == ["x", "y", "z"]


def test_a_catalog_file_is_carried_into_a_store_by_its_first_write_with_sweeps_and_order(tmp_path):
    path = tmp_path / "sweep_catalog.json"
    runs = {f"r{i}": {"id": f"r{i}", "sweep": f"s{i % 2}", "sweeps": [f"s{i % 2}"], "state": "completed"} for i in range(6)}
    path.write_text(json.dumps({"schema_version": 3, "runs": runs}))
    cat = Catalog(path)
    assert not cat._store.exists() and cat.sweeps() == ["s0", "s1"]  # read as it is...
    cat.update("r3", state="failed")  # ...and carried over by the first write
    assert cat._store.exists() and [r["id"] for r in cat.records(sweep="s1")] == ["r1", "r3", "r5"]
    cat.sync()
    carried = view(path)
    assert list(carried) == list(runs) and carried["r3"]["state"] == "failed"
    assert all(carried[i]["state"] == "completed" for i in runs if i != "r3")


def test_a_change_line_cut_off_by_a_kill_is_dropped_by_the_next_writer(cat):
    cat.upsert({"id": "a"})
    cat.sync()
    with open(cat._store.root / "changes", "ab") as log:
        log.write(b'7 "gho')  # a writer killed in the middle of appending its change line
    assert [r["id"] for r in cat.records()] == ["a"]  # readers skip the piece
    cat.upsert({"id": "b"})
    lines = (cat._store.root / "changes").read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(re.fullmatch(rb'\d+ (null|"[a-z]+")', line) for line in lines[:-1])
    cat.sync()
    assert list(view(cat.path)) == ["a", "b"]
