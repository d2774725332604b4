"""Run a sweep: expand the spec, write its SBATCH scripts, run what is still needed, record every run.

    plan_sweep(spec_path)          load + expand + write jobs/<sweep>/ (scripts, configs, manifest)
    register_runs / needed_runs    one catalog record per run; which runs still need to run
    run_local(...)                 run them on this machine, `workers` at a time, each as its own
                                   `fp4lab train --config jobs/<sweep>/<id>.toml --catalog ...` process
    run_trials_local(...)          the same for optuna sweeps: `fp4lab trial` processes (trials.py)
    submit_submitit(...)           Slurm through submitit: job arrays, signal + requeue, resume
    submit_sbatch(...)             Slurm with plain `sbatch` of the written scripts
    refresh(...)                   bring records up to date from run folders and `squeue`

Each job records its own start and end in sweep_catalog.json (job.py), so a sweep that is killed loses
nothing, `fp4lab status` sees finished runs at once, and re-running a sweep skips what completed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.lab.catalog import IN_FLIGHT_STATES, Catalog, live_owner, sweeps_of, this_owner, utc_now
from fp4lab.lab.job import finish_run, last_error_line, tail_lines, thresholds_from_table
from fp4lab.lab.logscan import ScanThresholds, scan
from fp4lab.lab.sbatch import write_scripts, write_trial_scripts
from fp4lab.lab.spec import RunSpec, SlurmSpec, SweepSpec, expand, load_spec, time_limit_seconds
from fp4lab.train.jsonl import read_json_line

@dataclass
class SweepPlan:
    spec: SweepSpec
    runs: list[RunSpec]
    scripts: list[Path]
    jobs_dir: Path

    @property
    def sweep_dir(self) -> Path:
        return self.spec.sweep_dir(str(self.jobs_dir))


def plan_sweep(spec_path: str | Path, jobs_dir: str | Path = "jobs", catalog: str | Path = "sweep_catalog.json") -> SweepPlan:
    """Load and expand the spec and write jobs/<sweep>/. Optuna sweeps have no runs up front (each
    trial makes its own): they get trial-array scripts instead. A run the catalog already holds (the
    same config, asked for by another sweep or an earlier version of this one) keeps its run folder,
    so it is trained once and shared."""
    spec = load_spec(spec_path)
    scan_thresholds(spec)  # fail on bad [scan] values before anything is written
    if spec.method == "optuna":
        return SweepPlan(spec, [], write_trial_scripts(spec, str(jobs_dir), catalog=catalog), Path(jobs_dir))
    runs = [_shared_folder(run, Catalog(catalog)) for run in expand(spec)]
    scripts = write_scripts(spec, runs, str(jobs_dir), catalog=catalog)
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
    commit, dirty = git_state()
    name = plan.spec.name
    with catalog.transaction() as tx:
        for run in plan.runs:
            record = tx.get(run.id)
            if record is None:
                tx.upsert({
                    "id": run.id, "sweep": name, "sweeps": [name], "config": run.config, "recipe": run.config["recipe"],
                    "git_commit": commit, "git_dirty": dirty, "executor": executor,
                    "paths": {"run_dir": catalog.relative(run.config["out_dir"]), "log": catalog.relative(_log_path(plan, run))},
                    "extra": {"name": run.name, "params": run.params},
                })  # fmt: skip
            elif name not in sweeps_of(record):
                tx.update(run.id, sweeps=[*sweeps_of(record), name])


# Why a run is not started again (needed_runs), by state; "in flight" needs a live owner or a Slurm job.
SKIP_REASONS = {"completed": "done", "failed": "failed", "cancelled": "failed", "timeout": "failed", "in flight": "in flight"}


def needed_runs(plan: SweepPlan, catalog: Catalog, *, retry_failed: bool) -> tuple[list[RunSpec], dict[str, list[RunSpec]]]:
    """(to run, skipped by reason). Completed runs are skipped ("done"); failed, cancelled and timed-out
    ones ("failed") only run again with `retry_failed`; runs another live process or a Slurm job is
    driving are left to it ("in flight"). Interrupted and preempted runs, and runs whose local owner
    died, resume from their checkpoint."""
    todo: list[RunSpec] = []
    skipped: dict[str, list[RunSpec]] = {}
    for run in plan.runs:
        record = catalog.get(run.id)
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


class SweepInterrupted(Exception):
    """Ctrl-C stopped a local sweep: the runs in progress checkpointed and were recorded "interrupted"."""

    def __init__(self, records: list[dict[str, Any]]):
        super().__init__(f"{len(records)} run(s) interrupted")
        self.records = records


def run_local(
    plan: SweepPlan,
    runs: list[RunSpec],
    catalog: Catalog,
    *,
    workers: int = 1,
    on_start: Callable[[RunSpec], None] | None = None,
    on_finish: Callable[[RunSpec, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run `runs` as separate training processes, at most `workers` at once; return their records.

    This process owns each run while it trains (`Catalog.claim`): a run another live process owns is
    left to it (recorded by that process, returned here as is). Each training process records its own
    start and end (`train --catalog`); one that dies without doing so (killed, out of memory) is
    recorded here as failed, with the last line of its log as the error. Ctrl-C (KeyboardInterrupt)
    starts nothing more, passes one SIGINT to each training process (they run in their own session,
    so a terminal's Ctrl-C reaches them only this way, once), waits while they checkpoint, and raises
    SweepInterrupted."""
    thresholds = scan_thresholds(plan.spec)
    lock = threading.Lock()
    owner = this_owner()
    stopping = threading.Event()
    children: dict[str, subprocess.Popen] = {}

    def one(run: RunSpec) -> dict[str, Any] | None:
        if stopping.is_set():
            return None
        log = _log_path(plan, run)
        log.parent.mkdir(parents=True, exist_ok=True)
        other = catalog.claim(run.id, owner, state="submitted", submitted_at=utc_now(), executor="local",
                              error=None, paths={"log": catalog.relative(log)})
        if other is not None:
            return catalog.get(run.id)
        command = [sys.executable, "-m", "fp4lab.cli", "train", "--config", str(plan.sweep_dir / f"{run.id}.toml"),
                   "--catalog", str(catalog.path)]
        if on_start is not None:
            with lock:
                on_start(run)
        with open(log, "ab") as out:
            child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=worker_env(workers), start_new_session=True)
            with lock:
                children[run.id] = child
            returncode = child.wait()
            with lock:
                children.pop(run.id, None)
        finished = catalog.get(run.id)
        if finished["state"] in IN_FLIGHT_STATES:
            finished = finish_run(run, catalog, thresholds, returncode=returncode or 1)
            if finished["state"] == "failed" and not finished.get("error"):
                finished = catalog.update(run.id, error=last_error_line(log) or f"the training process exited with {_exit_text(returncode)}")
        if on_finish is not None:
            with lock:
                on_finish(run, finished)
        return finished

    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    futures = [pool.submit(one, run) for run in runs]
    try:
        return [record for record in (future.result() for future in futures) if record is not None]
    except KeyboardInterrupt:
        stopping.set()
        with lock:
            for child in children.values():
                child.send_signal(signal.SIGINT)
        pool.shutdown(wait=True, cancel_futures=True)
        done = [f.result() for f in futures if f.done() and not f.cancelled() and f.exception() is None]
        raise SweepInterrupted([r for r in done if r is not None and r["state"] == "interrupted"]) from None
    finally:
        pool.shutdown(wait=True)


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def worker_env(workers: int) -> dict[str, str]:
    """The environment of a local training process: with several at once, each gets its share of the
    cores (unless OMP_NUM_THREADS is set), since oversubscribed OpenMP threads slow every run down
    several times over."""
    env = dict(os.environ)
    if workers > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
    return env


def run_trials_local(
    plan: SweepPlan,
    catalog: Catalog,
    *,
    workers: int = 1,
    on_finish: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Optuna sweep on this machine: first resume the trials a killed sweep left RUNNING, then run new
    trials until the study holds [optuna].n_trials finished ones; each trial is its own `fp4lab trial`
    process (ask, train, tell), `workers` at once. Returns how many trials ran."""
    from fp4lab.lab.trials import orphaned_trials, trial_counts

    counts = trial_counts(plan.spec, plan.jobs_dir)
    done = sum(counts.get(state, 0) for state in ("COMPLETE", "FAIL", "PRUNED"))
    resumes = orphaned_trials(plan.spec, plan.jobs_dir)
    fresh = max(0, plan.spec.optuna.n_trials - done - len(resumes) - counts.get("WAITING", 0))
    spec_copy = plan.sweep_dir / "spec.toml"
    base = [sys.executable, "-m", "fp4lab.cli", "trial", str(spec_copy), "--jobs-dir", str(plan.jobs_dir), "--catalog", str(catalog.path)]
    # One log per launch: concurrent trials sharing a file would interleave their lines.
    logs = plan.sweep_dir / "logs"
    launches = [(base + ["--resume", str(n)], logs / f"trial-{n}-resume.local.log") for n in resumes]
    for slot in range(done + len(resumes), done + len(resumes) + fresh):
        launches.append((base + ["--slot", str(slot)], logs / f"trial-slot{slot}.local.log"))
    logs.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def one(launch: tuple[list[str], Path]) -> None:
        command, log = launch
        with open(log, "ab") as out:
            trial = subprocess.run(command + ["--json"], stdout=subprocess.PIPE, stderr=out, text=True, env=worker_env(workers))
        if trial.returncode == 0 and on_finish is not None:
            with lock:
                on_finish(json.loads(trial.stdout))

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        list(pool.map(one, launches))
    return len(launches)


def _log_path(plan: SweepPlan, run: RunSpec) -> Path:
    return plan.sweep_dir / "logs" / f"{run.id}.local.log"


def git_state() -> tuple[str | None, bool | None]:
    """The checkout's commit and whether it has uncommitted changes (None outside a git checkout)."""
    try:
        import git

        repo = git.Repo(search_parent_directories=True)
        return repo.head.commit.hexsha, repo.is_dirty(untracked_files=False)
    except Exception:  # not a checkout, no git binary, or an empty repo: record the unknown honestly
        return None, None


def submit_sbatch(plan: SweepPlan, runs: list[RunSpec], catalog: Catalog) -> list[str]:
    """Submit with plain `sbatch` the scripts written into jobs/<sweep>/ (the same ones a user can
    resubmit by hand): the job arrays when every run is needed, else one script per run. Records
    each run's job id and state "submitted"; returns the job ids."""
    manifest = json.loads((plan.sweep_dir / "manifest.json").read_text())
    if plan.spec.method == "optuna":
        return [_sbatch(plan.sweep_dir / a["script"]) for a in manifest["arrays"]]
    ids = {run.id for run in runs}
    submissions: list[tuple[Path, list[str]]]
    if manifest["arrays"] and ids == {run.id for run in plan.runs}:
        submissions = [(plan.sweep_dir / a["script"], a["run_ids"]) for a in manifest["arrays"]]
    else:
        submissions = [(plan.sweep_dir / f"{run.id}.sbatch", [run.id]) for run in runs]
    job_ids = []
    for script, run_ids in submissions:
        job_id = _sbatch(script)
        job_ids.append(job_id)
        with catalog.transaction() as tx:
            for index, run_id in enumerate(run_ids):
                array_index = index if len(run_ids) > 1 or script.name.startswith("array_") else None
                tx.update(run_id, state="submitted", submitted_at=utc_now(), slurm_job_id=job_id,
                          slurm_array_index=array_index, executor="slurm")
    return job_ids


def _sbatch(script: Path) -> str:
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"sbatch {script} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
    return done.stdout.strip().split(";")[0]


def submitit_executor(s: SlurmSpec, name: str, folder: Path):
    """A submitit SlurmExecutor set from a [slurm] table. submitit needs a time limit to tell a timeout
    from a preemption: [slurm].time, else 60 minutes."""
    import submitit

    limit = time_limit_seconds(s.time)
    executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm", slurm_max_num_timeout=s.max_requeues)
    params: dict[str, Any] = {
        "name": name, "timeout_min": -(-limit // 60) if limit else 60, "nodes": s.nodes,
        "tasks_per_node": 1, "slurm_signal_delay_s": s.signal_before_timeout_s,
    }
    for key in ("gpus_per_node", "cpus_per_task"):
        if getattr(s, key):
            params[key] = getattr(s, key)
    for key in ("partition", "account", "qos", "mem", "constraint", "exclude", "array_parallelism"):
        if getattr(s, key):
            params[f"slurm_{key}"] = getattr(s, key)
    if s.setup:
        params["slurm_setup"] = list(s.setup)
    executor.update_parameters(**params)
    return executor


def submit_submitit(plan: SweepPlan, runs: list[RunSpec], catalog: Catalog) -> list[str]:
    """Submit through submitit: job arrays (split at MaxArraySize) of `job.SweepTask` (grid/random) or
    `trials.TrialTask` (optuna) with --signal before the time limit and requeue on preemption and
    timeout. Records each run's job id; returns the array job ids."""
    from fp4lab.lab.job import SweepTask
    from fp4lab.lab.trials import TrialTask, trial_counts

    manifest = json.loads((plan.sweep_dir / "manifest.json").read_text())
    size = int(manifest["max_array_size"])
    executor = submitit_executor(plan.spec.slurm, f"fp4lab-{plan.spec.name}", plan.sweep_dir.absolute() / "submitit")
    catalog_path = Path(catalog.path).absolute()
    if plan.spec.method == "optuna":
        counts = trial_counts(plan.spec, plan.jobs_dir)
        first = sum(counts.values())
        slots = list(range(first, first + max(0, plan.spec.optuna.n_trials - first)))
        task = TrialTask((plan.sweep_dir / "spec.toml").absolute(), plan.jobs_dir.absolute(), catalog_path)
        jobs = [job for start in range(0, len(slots), size) for job in executor.map_array(task, slots[start:start + size])]
        return sorted({job.job_id.split("_")[0] for job in jobs})
    task = SweepTask(plan.sweep_dir.absolute(), catalog_path)
    array_ids = []
    for start in range(0, len(runs), size):
        chunk = runs[start:start + size]
        jobs = executor.map_array(task, [run.id for run in chunk])
        with catalog.transaction() as tx:
            for run, job in zip(chunk, jobs):
                job_id, _, index = job.job_id.partition("_")
                tx.update(run.id, state="submitted", submitted_at=utc_now(), slurm_job_id=job_id, executor="slurm",
                          slurm_array_index=int(index) if index else None, paths={"log": str(job.paths.stdout)})
                array_ids.append(job_id)
    return sorted(set(array_ids))


# Slurm job states (squeue --states=all) -> catalog states, for jobs that ended without a summary.
_STATE_OF_SLURM = {
    "CANCELLED": "cancelled", "TIMEOUT": "timeout", "PREEMPTED": "preempted", "FAILED": "failed",
    "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed", "DEADLINE": "timeout",
}  # fmt: skip
_SLURM_ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def refresh(catalog: Catalog, thresholds: ScanThresholds, sweep: str | None = None) -> list[dict[str, Any]]:
    """Bring submitted/running records up to date from their run folders and from Slurm: a run whose
    summary.json exists is finished (scanned and recorded); a Slurm job that ended without one was
    cancelled, timed out or failed; one with metrics and a live job is running."""
    records = catalog.records(sweep=sweep)
    jobs = slurm_job_states([r for r in records if r["state"] in ("submitted", "running", "preempted") and r["slurm_job_id"]])
    for record in records:
        if record["state"] == "preempted":
            job_state = jobs.get(_job_key(record))
            if job_state in _SLURM_ACTIVE:
                catalog.update(record["id"], state="submitted")  # requeued: waiting to resume
            elif job_state in _STATE_OF_SLURM and job_state != "PREEMPTED":
                catalog.update(record["id"], state=_STATE_OF_SLURM[job_state])  # e.g. scancel: the trainer checkpointed on TERM
            continue
        if record["state"] not in ("submitted", "running", "pending") or (record["sweep"] or "").startswith("ratchet/"):
            continue  # ratchet iterations are the ratchet's to record
        run_dir = catalog.resolve(record["paths"].get("run_dir")) or Path(record["config"].get("out_dir", ""))
        job_state = jobs.get(_job_key(record))
        if (run_dir / "summary.json").exists() and job_state not in _SLURM_ACTIVE:
            run = RunSpec(record["id"], record["extra"].get("name", record["id"]), {**record["config"], "out_dir": str(run_dir)})
            finish_run(run, catalog, thresholds, returncode=0)
            if job_state in _STATE_OF_SLURM:  # e.g. scancel: the trainer checkpointed, Slurm says why
                catalog.update(record["id"], state=_STATE_OF_SLURM[job_state])
        elif job_state in _STATE_OF_SLURM:
            verdict = scan(run_dir, thresholds, running=False).verdict if (run_dir / "metrics.jsonl").exists() else None
            catalog.update(record["id"], state=_STATE_OF_SLURM[job_state], finished_at=utc_now(), verdict=verdict)
        elif (run_dir / "metrics.jsonl").exists() and record["state"] == "submitted":
            catalog.update(record["id"], state="running")
    return catalog.records(sweep=sweep)


def _job_key(record: dict[str, Any]) -> str:
    index = record["slurm_array_index"]
    return f"{record['slurm_job_id']}_{index}" if index is not None else str(record["slurm_job_id"])


def slurm_job_states(records: list[dict[str, Any]]) -> dict[str, str]:
    """Slurm's state of each record's job ("123" or "123_4" for array tasks), from one squeue call;
    empty when Slurm is not reachable (then run folders alone decide)."""
    if not records:
        return {}
    job_ids = sorted({str(r["slurm_job_id"]) for r in records})
    try:
        done = subprocess.run(
            ["squeue", "--noheader", "--array", "--states=all", "--format=%i %T", "--jobs", ",".join(job_ids)],
            capture_output=True, text=True, timeout=30,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def progress_of(record: dict[str, Any], catalog: Catalog) -> tuple[int | None, float | None]:
    """(last step, last loss) from a run's metrics.jsonl, reading only its tail."""
    run_dir = catalog.resolve(record["paths"].get("run_dir"))
    if run_dir is None:
        return None, None
    for line in reversed(tail_lines(run_dir / "metrics.jsonl")):
        try:
            last = read_json_line(line)
        except json.JSONDecodeError:
            continue
        if isinstance(last, dict) and isinstance(last.get("step"), int):
            return last["step"], last.get("loss")
    return None, None


def preflight(plan: SweepPlan, executor: str) -> list[str]:
    """What would make runs fail at once, found before any is launched: token files that do not
    exist (relative paths are read from the folder the runs start in), and a CUDA device asked of a
    machine without one (local runs only: a Slurm login node has no GPU of its own)."""
    problems: dict[str, str] = {}
    for run in plan.runs:
        data = run.config.get("data") or {}
        for key in ("source", "val_source"):
            path = data.get(key)
            if path and path not in ("shakespeare", "synthetic") and not Path(path).is_file():
                problems.setdefault(f"data.{key}:{path}", f"run {run.id} ({run.name}): data.{key} {path!r} is not a file; "
                                                          "fix the path in the spec or create the token file")
        if executor == "local" and str(run.config.get("device", "")).startswith("cuda") and not _cuda_available():
            problems.setdefault("cuda", f"run {run.id} ({run.name}): device {run.config['device']!r} but this machine has "
                                        "no CUDA device; set device = \"cpu\" in the spec, or submit with --executor slurm")
    return list(problems.values())


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
