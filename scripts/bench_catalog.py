"""How the run catalog's costs grow with its size (issue 42): a benchmark script, not a timed test.

For each size it builds a catalog of that many records shaped like the ledger's (about 3 KB each: the
first record of docs/ledger/sweep_catalog.json with a new id, spread over sweeps of 100 runs), then
measures, on this machine:

- carrying it over: the first write, which moves a catalog file of the old format into the store, and
  the first rebuild of `sweep_catalog.json` from it;
- one update: `Catalog.update` of one run's state (median of --repeats, and the slowest), and the
  rebuild of `sweep_catalog.json` after them (what a process that wrote pays when it ends);
- a sweep's status: `fp4lab status SWEEP --json` in a fresh process (wall time, Python start included);
- a sweep's report: `fp4lab report SWEEP` in a fresh process (wall time; the report's own tables and plots);
- concurrent writers: --writers processes each making --updates updates of their own runs at once,
  then every update checked present (nothing lost).

    python scripts/bench_catalog.py                      # sizes 1000,10000,100000
    python scripts/bench_catalog.py --sizes 1000 --writers 4 --updates 20 --out /tmp/catalog-bench

Where a measurement would take longer than --budget seconds (extrapolated from one update), it is
reported as skipped with its estimate instead of run. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fp4lab.lab.records.catalog import Catalog  # noqa: E402

RUNS_PER_SWEEP = 100


def template() -> dict:
    ledger = json.loads((ROOT / "docs" / "ledger" / "sweep_catalog.json").read_text())
    return next(iter(ledger["runs"].values()))


def build(path: Path, size: int) -> list[str]:
    """A catalog file of `size` records at `path` in the format before the store (schema 3, one file),
    as a lab's catalog was; their ids in order. The first write carries it into a store."""
    base = template()
    with open(path, "w") as handle:
        handle.write('{"schema_version": 3, "runs": {\n')
        for index in range(size):
            record = copy.deepcopy(base)
            run_id = f"{index:012x}"
            sweep = f"sweep{index // RUNS_PER_SWEEP:05d}"
            record.update(id=run_id, sweep=sweep, sweeps=[sweep], owner=None, state="completed")
            handle.write(("" if index == 0 else ",\n") + f"{json.dumps(run_id)}: {json.dumps(record)}")
        handle.write("\n}}\n")
    return [f"{index:012x}" for index in range(size)]


def timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def time_updates(catalog: Catalog, ids: list[str], repeats: int) -> list[float]:
    seconds = []
    for index in range(repeats):
        started = time.perf_counter()
        catalog.update(ids[(index * 7919) % len(ids)], state="running" if index % 2 else "completed")
        seconds.append(time.perf_counter() - started)
    return seconds


def time_command(args: list[str], cwd: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fp4lab.cli", *args], cwd=cwd, capture_output=True, text=True, check=False,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if done.returncode != 0:
        raise RuntimeError(f"fp4lab {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    return time.perf_counter() - started


def _writer(path: str, ids: list[str], updates: int, start) -> None:
    catalog = Catalog(path, timeout=-1)
    start.wait()
    for count in range(1, updates + 1):
        catalog.update(ids[count % len(ids)], attempts=count, extra={f"writer-{os.getpid()}-{count}": count})


def concurrent_writers(path: Path, ids: list[str], writers: int, updates: int) -> dict:
    """`writers` processes, each updating its own 10 runs `updates` times; then every update's mark is
    looked for in the catalog (each update adds one extra key, so a lost update is a missing key)."""
    context = multiprocessing.get_context("fork")
    start = context.Event()
    own = [ids[w * 10:(w + 1) * 10] for w in range(writers)]
    processes = [context.Process(target=_writer, args=(str(path), own[w], updates, start)) for w in range(writers)]
    for process in processes:
        process.start()
    started = time.perf_counter()
    start.set()
    for process in processes:
        process.join()
    seconds = time.perf_counter() - started
    catalog = Catalog(path)
    marks = sum(1 for run_ids in own for run_id in run_ids for key in (catalog.get(run_id).get("extra") or {}) if key.startswith("writer-"))
    return {"writers": writers, "updates_each": updates, "seconds": round(seconds, 2), "updates_found": marks,
            "updates_made": writers * updates, "lost": writers * updates - marks,
            "exit_codes": sorted({p.exitcode for p in processes})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1000,10000,100000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--writers", type=int, default=32)
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--budget", type=float, default=600.0, help="skip a measurement estimated to take longer (s)")
    parser.add_argument("--out", type=Path, default=None, help="where to build the catalogs (default: a temporary folder)")
    options = parser.parse_args()
    folder = options.out or Path(tempfile.mkdtemp(prefix="catalog-bench-"))
    results = []
    for size in (int(s) for s in options.sizes.split(",")):
        path = folder / str(size) / "sweep_catalog.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        ids = build(path, size)
        row = {"records": size, "file_mb": round(path.stat().st_size / 2**20, 1), "build_s": round(time.perf_counter() - started, 1)}
        catalog = Catalog(path, timeout=-1)
        row["migrate_s"] = round(timed(lambda: catalog.update(ids[0], state="completed")), 2)
        row["first_view_s"] = round(timed(catalog.sync), 2)
        updates = time_updates(catalog, ids, options.repeats)
        row["view_after_updates_s"] = round(timed(catalog.sync), 2)
        row["update_s_median"], row["update_s_max"] = round(statistics.median(updates), 4), round(max(updates), 4)
        sweep = "sweep00000"
        row["status_sweep_s"] = round(time_command(["status", sweep, "--json", "--catalog", str(path)], path.parent), 2)
        row["report_sweep_s"] = round(time_command(["report", sweep, "--catalog", str(path), "--out", str(path.parent / "report")],
                                                   path.parent), 2)
        estimate = options.writers * options.updates * statistics.median(updates)
        if estimate > options.budget:
            row["concurrent"] = f"skipped: about {estimate / 60:.0f} minutes at one update at a time"
        else:
            row["concurrent"] = concurrent_writers(path, ids, options.writers, options.updates)
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps({"machine": f"{os.cpu_count()} CPUs", "results": results}, indent=1))


if __name__ == "__main__":
    main()
