"""Plan a sweep and keep its records: what to run, and what became of it.

    plan_sweep(spec_path)          load + expand + write jobs/<sweep>/ (scripts, configs, manifest)
    preflight(plan, executor)      what would make runs fail at once (token files, CUDA)
    register_runs / needed_runs    one catalog record per run; which runs still need to run
    refresh(...)                   bring records up to date from run folders and `squeue`
    progress_of(record, catalog)   a run's last step and loss, from the tail of its metrics

Running the needed runs is the executors' concern (executors.py).
"""

from __future__ import annotations

import dataclasses
import os
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.lab.records.catalog import (
    FAILED_STATES,
    IN_FLIGHT_STATES,
    TERMINAL_STATES,
    Catalog,
    live_owner,
    sweeps_of,
    utc_now,
)
from fp4lab.lab.records.logscan import ScanThresholds, scan
from fp4lab.lab.repo import git_state
from fp4lab.lab.runs import slurm
from fp4lab.lab.runs.job import finish_run, pending_record, tail_lines, thresholds_from_table
from fp4lab.lab.runs.sbatch import write_scripts, write_trial_scripts
from fp4lab.lab.specs.sweep_spec import RunSpec, SweepSpec, expand, load_spec
from fp4lab.train import run_folder
from fp4lab.train.config import BUILTIN_SOURCES, PYCODE, is_corpus_name
from fp4lab.train.jsonl import metrics_records


@dataclass
class SweepPlan:
    spec: SweepSpec
    runs: list[RunSpec]
    scripts: list[Path]
    jobs_dir: Path

    @property
    def sweep_dir(self) -> Path:
        return self.spec.sweep_dir(str(self.jobs_dir))

    def log_path(self, run: RunSpec) -> Path:
        """The local worker log of a run: what its training process prints."""
        return self.sweep_dir / "logs" / f"{run.id}.local.log"


def plan_sweep(spec_path: str | Path, jobs_dir: str | Path = "jobs", catalog: str | Path = "sweep_catalog.json",
               check: Callable[[SweepSpec], None] | None = None, *, ask_slurm: bool = True) -> SweepPlan:
    """Load and expand the spec and write jobs/<sweep>/. Optuna sweeps have no runs up front (each
    trial makes its own): they get trial-array scripts instead. A run the catalog already holds (the
    same config, asked for by another sweep or an earlier version of this one) keeps its run folder,
    so it is trained once and shared. `check(spec)` (the executor's) may refuse the spec before
    anything is written. `ask_slurm`: size the job arrays by the cluster's limit (a local sweep does not
    ask; see write_scripts)."""
    spec = load_spec(spec_path)
    scan_thresholds(spec)  # fail on bad [scan] values before anything is written
    if check is not None:
        check(spec)
    if spec.method == "optuna":
        return SweepPlan(spec, [], write_trial_scripts(spec, str(jobs_dir), catalog=catalog, ask_slurm=ask_slurm), Path(jobs_dir))
    runs = [_shared_folder(run, Catalog(catalog)) for run in expand(spec)]
    scripts = write_scripts(spec, runs, str(jobs_dir), catalog=catalog, ask_slurm=ask_slurm)
    return SweepPlan(spec, runs, scripts, Path(jobs_dir))


def _shared_folder(run: RunSpec, catalog: Catalog) -> RunSpec:
    record = catalog.get(run.id)
    run_dir = catalog.resolve(record["paths"].get("run_dir")) if record else None
    if run_dir is None:
        return run
    return dataclasses.replace(run, config={**run.config, "out_dir": os.path.relpath(run_dir)})


def scan_thresholds(spec: SweepSpec) -> ScanThresholds:
    return thresholds_from_table(spec.scan, str(spec.path))


def register_runs(plan: SweepPlan, catalog: Catalog, executor: str) -> None:
    """Insert a pending record for every run the catalog does not know yet, and make every run of the
    plan a member of this sweep (a run another sweep asked for first is shared, not copied)."""
    git = git_state()
    name = plan.spec.name
    with catalog.transaction() as tx:
        for run in plan.runs:
            record = tx.get(run.id)
            if record is None:
                tx.upsert(pending_record(run, name, catalog, executor, plan.log_path(run), git))
            elif name not in sweeps_of(record):
                tx.update(run.id, sweeps=[*sweeps_of(record), name])


# Why a run is not started again (needed_runs), by state; "in flight" needs a live owner, a Slurm job
# or a trainer holding the run folder.
SKIP_REASONS = {"completed": "done", "pruned": "pruned", **dict.fromkeys(FAILED_STATES, "failed"), "in flight": "in flight"}


def needed_runs(plan: SweepPlan, catalog: Catalog, *, retry_failed: bool) -> tuple[list[RunSpec], dict[str, list[RunSpec]]]:
    """(to run, skipped by reason). Completed runs are skipped ("done"), as are Optuna trials their pruner
    stopped ("pruned"); failed, cancelled and timed-out
    ones ("failed") only run again with `retry_failed`; runs another live process or a Slurm job is
    driving, or whose folder a trainer holds, are left to it ("in flight"). Interrupted and preempted runs, and runs whose local owner
    died, resume from their checkpoint."""
    todo: list[RunSpec] = []
    skipped: dict[str, list[RunSpec]] = {}
    for run in plan.runs:
        record = catalog.get(run.id)
        if run_folder.holder(run.config["out_dir"]) is not None:
            reason = "in flight"  # a trainer holds its folder (one whose sweep died, or started by hand)
        else:
            reason = _skip_reason(record, retry_failed) if record else None
        if reason is None:
            todo.append(run)
        else:
            skipped.setdefault(reason, []).append(run)
    return todo, skipped


def _skip_reason(record: dict[str, Any], retry_failed: bool) -> str | None:
    state = record["state"]
    if state in IN_FLIGHT_STATES:
        return "in flight" if live_owner(record) or record.get("slurm_job_id") else None
    reason = SKIP_REASONS.get(state)
    return None if reason == "failed" and retry_failed else reason


def refresh(catalog: Catalog, thresholds: ScanThresholds, sweep: str | None = None) -> list[dict[str, Any]]:
    """Bring submitted/running records up to date from their run folders and from Slurm: a run whose
    summary.json exists is finished (scanned and recorded); a Slurm job that ended without one was
    cancelled, timed out or failed; one with metrics and a live job is running."""
    records = catalog.records(sweep=sweep)
    jobs = slurm.job_states([r for r in records if r["state"] in IN_FLIGHT_STATES | {"preempted"} and r["slurm_job_id"]])
    for record in records:
        if record["state"] == "preempted":
            job_state = jobs.get(slurm.job_key(record))
            if job_state in slurm.ACTIVE:
                catalog.update(record["id"], state="submitted")  # requeued: waiting to resume
            elif job_state in slurm.STATE_OF_SLURM and job_state != "PREEMPTED":
                catalog.update(record["id"], state=slurm.STATE_OF_SLURM[job_state])  # e.g. scancel: the trainer checkpointed on TERM
            continue
        if record["state"] not in IN_FLIGHT_STATES | {"pending"} or (record["sweep"] or "").startswith("ratchet/"):
            continue  # ratchet iterations are the ratchet's to record
        run_dir = catalog.resolve(record["paths"].get("run_dir")) or Path(record["config"].get("out_dir", ""))
        job_state = jobs.get(slurm.job_key(record))
        if (run_dir / "summary.json").exists() and job_state not in slurm.ACTIVE:
            run = RunSpec(record["id"], record["extra"].get("name", record["id"]), {**record["config"], "out_dir": str(run_dir)})
            finish_run(run, catalog, thresholds, returncode=0)
            if job_state in slurm.STATE_OF_SLURM:  # e.g. scancel: the trainer checkpointed, Slurm says why
                catalog.update(record["id"], state=slurm.STATE_OF_SLURM[job_state])
        elif job_state in slurm.STATE_OF_SLURM:
            verdict = scan(run_dir, thresholds, running=False).verdict if (run_dir / "metrics.jsonl").exists() else None
            catalog.update(record["id"], state=slurm.STATE_OF_SLURM[job_state], finished_at=utc_now(), verdict=verdict)
        elif (run_dir / "metrics.jsonl").exists() and record["state"] == "submitted":
            catalog.update(record["id"], state="running")
    return catalog.records(sweep=sweep)


def rescan(catalog: Catalog, thresholds: ScanThresholds, sweep: str | None = None) -> int:
    """Judge every ended run (ratchet iterations aside) again from its metrics with `thresholds`, and
    record the verdict and events: runs keep the verdict of the scanner they ended under until this is
    asked for (after a scanner rule changed). Returns how many records changed."""
    changed = 0
    for record in catalog.records(sweep=sweep):
        if record["state"] not in TERMINAL_STATES or (record["sweep"] or "").startswith("ratchet/"):
            continue
        run_dir = catalog.resolve(record["paths"].get("run_dir"))
        if run_dir is None or not (run_dir / "metrics.jsonl").exists():
            continue
        result = scan(run_dir, thresholds, running=False)
        events = result.to_dict()["events"]
        if (result.verdict, events) != (record["verdict"], record["events"]):
            catalog.update(record["id"], verdict=result.verdict, events=events)
            changed += 1
    return changed


def progress_of(record: dict[str, Any], catalog: Catalog) -> tuple[int | None, float | None]:
    """(last step, last loss) from a run's metrics.jsonl, reading only its tail."""
    run_dir = catalog.resolve(record["paths"].get("run_dir"))
    if run_dir is None:
        return None, None
    last = deque(metrics_records(tail_lines(run_dir / "metrics.jsonl")), maxlen=1)
    return (last[0]["step"], last[0].get("loss")) if last else (None, None)


def preflight(plan: SweepPlan, executor: str) -> list[str]:
    """What would make runs fail at once, found before any is launched: token files that do not
    exist (relative paths are read from the folder the runs start in), a corpus that is built once
    and is not built in this machine's cache (a Slurm cluster's nodes share it with the login node
    through the home folder or $FP4LAB_CACHE), and CUDA devices asked of a machine without them: one
    per rank (local runs only: a Slurm login node has no GPU of its own)."""
    problems: dict[str, str] = {}
    ranks = plan.spec.slurm.ranks
    for run in plan.runs:
        data = run.config.get("data") or {}
        source = data.get("source")
        if (source == PYCODE or is_corpus_name(source)) and f"corpus:{source}" not in problems:
            problem = _unbuilt_corpus(source)
            if problem:
                problems[f"corpus:{source}"] = f"run {run.id} ({run.name}): {problem}"
        for key in ("source", "val_source"):
            path = data.get(key)
            if path and path not in BUILTIN_SOURCES and not is_corpus_name(path) and not Path(path).is_file():
                problems.setdefault(f"data.{key}:{path}", f"run {run.id} ({run.name}): data.{key} {path!r} is not a file; "
                                                          "fix the path in the spec or create the token file")
        if executor == "local" and str(run.config.get("device", "")).startswith("cuda") and cuda_devices() < ranks:
            have = f"{cuda_devices()} CUDA device(s)" if cuda_devices() else "no CUDA device"
            problems.setdefault("cuda", f"run {run.id} ({run.name}): device {run.config['device']!r} on {ranks} rank(s) but "
                                        f"this machine has {have}; set device = \"cpu\" in the spec, ask [slurm] for fewer "
                                        "ranks, or submit the sweep to Slurm")
    return list(problems.values())


def _unbuilt_corpus(source: str) -> str | None:
    """Why the built corpus `source` (pycode or one of your own) cannot be loaded from this machine's
    cache; None when it can."""
    from fp4lab.train import pycode
    from fp4lab.train.corpus import CorpusError, cache_dir, load_own

    try:
        pycode.load(cache_dir()) if source == PYCODE else load_own(cache_dir(), source)
    except CorpusError as exc:
        return str(exc)
    return None


def cuda_devices() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applied); torch is imported only here."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
