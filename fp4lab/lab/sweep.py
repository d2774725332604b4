"""Run a sweep: expand the spec, write its SBATCH scripts, run what is still needed, record every run.

    plan_sweep(spec_path)          load + expand + write jobs/<sweep>/ (scripts, configs, manifest)
    needed_runs(...)               which runs to start: never completed ones (and failed ones on retry)
    run_local(...)                 run them on this machine, `workers` at a time, each as its own
                                   `python -m fp4lab.cli train --config jobs/<sweep>/<id>.toml` process
    finish_run(...)                scan the run folder and write its catalog record

Every run's record in sweep_catalog.json is written before it starts (state "running") and again
when it ends (state, verdict, events, summary metrics), so a sweep that is killed loses nothing and
re-running it skips what already completed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.lab.catalog import Catalog, utc_now
from fp4lab.lab.logscan import ScanThresholds, scan
from fp4lab.lab.sbatch import write_scripts
from fp4lab.lab.spec import RunSpec, SweepSpec, expand, load_spec

# Summary status of a finished training process -> catalog state.
_STATE_OF_STATUS = {
    "completed": "completed",
    "diverged": "completed",  # the run ended as designed; the verdict says it diverged
    "time_limit": "timeout",
    "preempted": "preempted",
    "stopped": "preempted",
}
# Spec [scan] keys -> log scanner thresholds.
_SCAN_KEYS = {
    "spike_sigma": "spike_k",
    "spike_window": "spike_window",
    "spike_ratio": "spike_ratio",
    "entropy_floor": "entropy_floor",
    "entropy_drop_factor": "entropy_drop_factor",
    "max_logit_tau": "max_logit_tau",
    "stall_seconds": "stall_seconds",
}


@dataclass
class SweepPlan:
    spec: SweepSpec
    runs: list[RunSpec]
    scripts: list[Path]
    jobs_dir: Path

    @property
    def sweep_dir(self) -> Path:
        return self.spec.sweep_dir(str(self.jobs_dir))


def plan_sweep(spec_path: str | Path, jobs_dir: str | Path = "jobs") -> SweepPlan:
    spec = load_spec(spec_path)
    if spec.method == "optuna":
        raise ValueError(f"{spec_path}: method = \"optuna\" sweeps are not run by `fp4lab sweep` yet; use grid or random")
    scan_thresholds(spec)  # fail on bad [scan] values before anything is written
    runs = expand(spec)
    scripts = write_scripts(spec, runs, str(jobs_dir))
    return SweepPlan(spec, runs, scripts, Path(jobs_dir))


def scan_thresholds(spec: SweepSpec) -> ScanThresholds:
    overrides = {_SCAN_KEYS[k]: v for k, v in spec.scan.items() if k in _SCAN_KEYS}
    if "spike_window" in overrides:  # a short window must not demand more history than it holds
        overrides["spike_min_count"] = min(ScanThresholds().spike_min_count, max(2, int(overrides["spike_window"])))
    try:
        return ScanThresholds().with_overrides(overrides)
    except ValueError as exc:
        raise ValueError(f"{spec.path}: [scan]: {exc}") from None


def register_runs(plan: SweepPlan, catalog: Catalog, executor: str) -> None:
    """Insert a pending record for every run the catalog does not know yet."""
    commit, dirty = git_state()
    with catalog.transaction() as tx:
        for run in plan.runs:
            if tx.get(run.id) is None:
                tx.upsert({
                    "id": run.id, "sweep": plan.spec.name, "config": run.config, "recipe": run.config["recipe"],
                    "git_commit": commit, "git_dirty": dirty, "executor": executor,
                    "paths": {"run_dir": run.config["out_dir"], "log": str(_log_path(plan, run))},
                    "extra": {"name": run.name, "params": run.params},
                })  # fmt: skip


def needed_runs(plan: SweepPlan, catalog: Catalog, *, retry_failed: bool) -> tuple[list[RunSpec], list[RunSpec]]:
    """(to run, skipped): completed runs are skipped; failed, cancelled, timed-out and preempted
    ones only run again with `retry_failed` (they resume from their checkpoint)."""
    todo, skipped = [], []
    for run in plan.runs:
        record = catalog.get(run.id)
        state = record["state"] if record else "pending"
        if state == "completed" or (state in ("failed", "cancelled", "timeout", "preempted") and not retry_failed):
            skipped.append(run)
        else:
            todo.append(run)
    return todo, skipped


def run_local(
    plan: SweepPlan,
    runs: list[RunSpec],
    catalog: Catalog,
    *,
    workers: int = 1,
    on_finish: Callable[[RunSpec, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run `runs` as separate training processes, at most `workers` at once; return their records."""
    thresholds = scan_thresholds(plan.spec)
    lock = threading.Lock()

    def one(run: RunSpec) -> dict[str, Any]:
        log = _log_path(plan, run)
        log.parent.mkdir(parents=True, exist_ok=True)
        record = catalog.get(run.id)
        catalog.update(run.id, state="running", started_at=utc_now(), attempts=(record["attempts"] if record else 0) + 1)
        command = [sys.executable, "-m", "fp4lab.cli", "train", "--config", str(plan.sweep_dir / f"{run.id}.toml")]
        with open(log, "ab") as out:
            returncode = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode
        finished = finish_run(run, catalog, thresholds, returncode=returncode)
        if on_finish is not None:
            with lock:
                on_finish(run, finished)
        return finished

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        return list(pool.map(one, runs))


def finish_run(run: RunSpec, catalog: Catalog, thresholds: ScanThresholds, *, returncode: int) -> dict[str, Any]:
    """Scan a finished run's folder and write state, verdict, events and summary metrics."""
    run_dir = Path(run.config["out_dir"])
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    state = _STATE_OF_STATUS.get(summary["status"], "failed") if summary and returncode == 0 else "failed"
    fields: dict[str, Any] = {"state": state, "finished_at": utc_now()}
    if (run_dir / "metrics.jsonl").exists():
        result = scan(run_dir, thresholds, running=False)
        fields["verdict"] = result.verdict
        fields["events"] = result.to_dict()["events"]
    else:
        fields["verdict"] = "crashed"
    if summary:
        fields["summary"] = {
            "final_train_loss": summary.get("final_loss"),
            "best_train_loss": summary.get("best_loss"),
            "final_val_loss": summary.get("final_val_loss"),
            "best_val_loss": summary.get("best_val_loss"),
            "tokens_per_s": summary.get("tokens_per_s"),
            "peak_memory_mb": summary.get("peak_memory_mb"),
            "loss_at_steps": _loss_at_steps(run_dir / "metrics.jsonl"),
        }
        fields["paths"] = {"checkpoint": str(run_dir / "checkpoint.pt")}
    return catalog.update(run.id, **fields)


def _loss_at_steps(metrics: Path, every: int = 10) -> dict[str, float]:
    """Train loss every `every` steps (and the last step), for comparisons at matched steps."""
    losses: dict[str, float] = {}
    if not metrics.exists():
        return losses
    last = None
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        step, loss = record.get("step"), record.get("loss")
        if isinstance(step, int) and isinstance(loss, float) and loss == loss and abs(loss) != float("inf"):
            last = (step, loss)
            if step % every == 0:
                losses[str(step)] = loss
    if last is not None:
        losses[str(last[0])] = last[1]
    return losses


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


def submit_slurm(plan: SweepPlan, runs: list[RunSpec], catalog: Catalog) -> list[str]:
    """Submit with plain `sbatch` the scripts written into jobs/<sweep>/ (the same ones a user can
    resubmit by hand): the job arrays when every run is needed, else one script per run. Records
    each run's job id and state "submitted"; returns the job ids."""
    manifest = json.loads((plan.sweep_dir / "manifest.json").read_text())
    ids = {run.id for run in runs}
    submissions: list[tuple[Path, list[str]]]
    if manifest["arrays"] and ids == {run.id for run in plan.runs}:
        submissions = [(plan.sweep_dir / a["script"], a["run_ids"]) for a in manifest["arrays"]]
    else:
        submissions = [(plan.sweep_dir / f"{run.id}.sbatch", [run.id]) for run in runs]
    job_ids = []
    for script, run_ids in submissions:
        done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {script} failed: {done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode}")
        job_id = done.stdout.strip().split(";")[0]
        job_ids.append(job_id)
        with catalog.transaction() as tx:
            for index, run_id in enumerate(run_ids):
                array_index = index if len(run_ids) > 1 or script.name.startswith("array_") else None
                tx.update(run_id, state="submitted", submitted_at=utc_now(), slurm_job_id=job_id, slurm_array_index=array_index)
    return job_ids


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
    jobs = slurm_job_states([r for r in records if r["state"] in ("submitted", "running") and r["slurm_job_id"]])
    for record in records:
        if record["state"] not in ("submitted", "running", "pending"):
            continue
        run_dir = Path(record["paths"].get("run_dir", ""))
        job_state = jobs.get(_job_key(record))
        if (run_dir / "summary.json").exists() and job_state not in _SLURM_ACTIVE:
            run = RunSpec(record["id"], record["extra"].get("name", record["id"]), record["config"])
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


def progress_of(record: dict[str, Any]) -> tuple[int | None, float | None]:
    """(last step, last loss) from a run's metrics.jsonl, reading only its tail."""
    metrics = Path(record["paths"].get("run_dir", "")) / "metrics.jsonl"
    if not metrics.exists():
        return None, None
    with open(metrics, "rb") as handle:
        handle.seek(0, 2)
        handle.seek(max(0, handle.tell() - 65536))
        lines = handle.read().decode(errors="replace").splitlines()
    for line in reversed(lines):
        try:
            last = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(last, dict) and isinstance(last.get("step"), int):
            return last["step"], last.get("loss")
    return None, None
