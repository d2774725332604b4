"""Everything fp4lab knows about Slurm's client side, in one place.

    job_states(records)         one `squeue` call: each record's job state ("123" or "123_4")
    STATE_OF_SLURM, ACTIVE      what an ended or waiting job state means for a catalog record
    submit_script(path)         `sbatch --parsable`: the job id, or SubmissionError with sbatch's reason
    after_sweep(records, name)  the --dependency that starts a sweep once another sweep's jobs have ended
    max_array_size()            MaxArraySize from `scontrol show config`
    submitit_executor(...)      a submitit executor set from a [slurm] table
    identity() / task_key()     inside a job: its id, array index and restart count, from SLURM_* env

The SBATCH scripts themselves are written by `sbatch.py`; the executors that use this are in
`executors.py`.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

from fp4lab.lab.specs.sweep_spec import SlurmSpec, time_limit_seconds

DEFAULT_MAX_ARRAY_SIZE = 1001

# Slurm job states (squeue --states=all) -> catalog states, for jobs that ended without a summary.
STATE_OF_SLURM = {
    "CANCELLED": "cancelled", "TIMEOUT": "timeout", "PREEMPTED": "preempted", "FAILED": "failed",
    "NODE_FAIL": "failed", "OUT_OF_MEMORY": "failed", "BOOT_FAIL": "failed", "DEADLINE": "timeout",
}  # fmt: skip
ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


class SubmissionError(RuntimeError):
    """Slurm refused or could not be reached: the message is sbatch's (or submitit's) own reason."""


def job_key(record: dict[str, Any]) -> str:
    """How squeue names a record's job: "123", or "123_4" for an array task."""
    index = record["slurm_array_index"]
    return f"{record['slurm_job_id']}_{index}" if index is not None else str(record["slurm_job_id"])


def job_states(records: list[dict[str, Any]]) -> dict[str, str]:
    """Slurm's state of each record's job (keyed by `job_key`), from one squeue call; empty when Slurm
    is not reachable (then run folders alone decide)."""
    if not records:
        return {}
    job_ids = sorted({str(r["slurm_job_id"]) for r in records})
    try:
        done = subprocess.run(
            ["squeue", "--noheader", "--array", "--states=all", "--format=%i %T", "--jobs", ",".join(job_ids)],
            capture_output=True, text=True, timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2:
            states[parts[0]] = parts[1]
    return states


def submit_script(script: Path, dependency: str | None = None) -> str:
    """Submit one SBATCH script (with a --dependency, for a chained sweep); its job id."""
    command = ["sbatch", "--parsable", *([f"--dependency={dependency}"] if dependency else []), str(script)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise SubmissionError("sbatch is not on PATH: run on a Slurm login node, or run the sweep locally") from None
    except subprocess.TimeoutExpired:
        raise SubmissionError(f"sbatch {script} did not answer in 60 s (slurmctld down?)") from None
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit code {done.returncode}"
        raise SubmissionError(f"sbatch {script}: {reason}")
    return done.stdout.strip().split(";")[0]


def after_sweep(records: list[dict[str, Any]], name: str) -> str | None:
    """`afterany:<job>:<job>...`: wait until every job of sweep `name` still in Slurm's queue has ended,
    whatever its outcome (a diverged run must not hold the next sweep forever). `records` are the
    catalog's records of that sweep; their jobs that Slurm no longer lists (or that never reached it)
    are left out, since sbatch refuses a dependency on a job it has forgotten. None when nothing of
    the sweep is queued or running: the next sweep need not wait."""
    queued = [r for r in records if r.get("slurm_job_id") and r.get("state") in ("submitted", "running")]
    states = job_states(queued)
    jobs = sorted({str(r["slurm_job_id"]) for r in queued if not states or states.get(job_key(r)) in ACTIVE}, key=int)
    return f"afterany:{':'.join(jobs)}" if jobs else None


def max_array_size(default: int = DEFAULT_MAX_ARRAY_SIZE) -> int:
    """MaxArraySize from `scontrol show config` (tasks per array: indices 0..MaxArraySize-1), else default.
    One short try: scontrol retries a dead controller for seconds, and a live one answers at once."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=2)
    except (OSError, subprocess.TimeoutExpired):
        return default
    match = re.search(r"^\s*MaxArraySize\s*=\s*(\d+)", out.stdout, re.MULTILINE)
    return int(match.group(1)) if out.returncode == 0 and match and int(match.group(1)) > 0 else default


def submitit_executor(s: SlurmSpec, name: str, folder: Path, dependency: str | None = None):
    """A submitit SlurmExecutor set from a [slurm] table (and a --dependency, for a chained sweep).
    submitit needs a time limit to tell a timeout from a preemption: [slurm].time, else 60 minutes."""
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
    additional = s.extra_options()  # submitit quotes each value (shlex) and writes true as a bare flag
    if dependency:
        additional["dependency"] = dependency
    if additional:
        params["slurm_additional_parameters"] = additional
    executor.update_parameters(**params)
    return executor


def identity() -> dict[str, Any]:
    """This process's Slurm job id, array index and restart count (empty outside Slurm)."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return {}
    if "SLURM_ARRAY_JOB_ID" in env and "SLURM_ARRAY_TASK_ID" in env:
        fields: dict[str, Any] = {"slurm_job_id": env["SLURM_ARRAY_JOB_ID"], "slurm_array_index": int(env["SLURM_ARRAY_TASK_ID"])}
    else:
        fields = {"slurm_job_id": env["SLURM_JOB_ID"], "slurm_array_index": None}
    fields["requeues"] = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    return fields


def task_key() -> str | None:
    """"<array job>_<task>" (or the job id) of this Slurm job: stays the same across requeues."""
    job = identity()
    return job_key(job) if job else None
