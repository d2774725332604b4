"""Runs of two ranks on the REAL local Slurm: `fp4lab sweep --executor sbatch` writes a script that starts
`srun torchrun` (2 CPU ranks over gloo, ddp); the job is stopped mid-run, requeued, resumes from its
sharded checkpoint and completes, and rank 0 alone wrote the metrics, the summary and the catalog record.

Needs the local single-node cluster (`sudo scripts/local-slurm.sh start`, the `slurm` marker) and gloo.
Each job asks for the node's 2 CPUs (ntasks_per_node = 2), so the two tests run one after the other;
each takes two torch start-ups of 2 ranks plus Slurm's requeue delay (10 s after `cred_expire`):
60-70 s each, measured on a 2-core machine shared with other work (load 4-7).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fp4lab.lab.records.catalog import Catalog
from tests.distributed_helpers import gloo_unavailable

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.skipif(gloo_unavailable() is not None, reason=str(gloo_unavailable()))]

STEPS = 24
SPEC = f"""
name = "{{name}}"
[base]
model = "tiny"
steps = {STEPS}
batch_size = 2
seq_len = 32
warmup_steps = 1
eval_every = 12
eval_batches = 1
probe_every = 12
checkpoint_every = 12
parallel = "ddp"
[base.data]
source = "synthetic"
[slurm]
ntasks_per_node = 2
cpus_per_task = 1        # sbatch exports SLURM_CPUS_PER_TASK=1; the srun step still asks for both CPUs
time = 10
signal_before_timeout_s = 60
"""


def _submit(tmp_path: Path, name: str) -> tuple[str, dict, Path]:
    """`fp4lab sweep --executor sbatch` of a one-run sweep of 2 ranks: the Slurm job id, the run's
    record, its run folder."""
    (tmp_path / "spec.toml").write_text(textwrap.dedent(SPEC.format(name=name)))
    out = subprocess.run([sys.executable, "-m", "fp4lab.cli", "sweep", "spec.toml", "--executor", "sbatch"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    [record] = Catalog(tmp_path / "sweep_catalog.json").records()
    return record["slurm_job_id"], record, tmp_path / record["paths"]["run_dir"]


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"{what} not reached within {timeout:.0f} s")


def _job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30, check=False)
    match = re.search(r"JobState=(\S+)", out.stdout)
    return match.group(1) if match else "UNKNOWN"


def _training(run_dir: Path) -> bool:
    """The ranks have met and trained a step (rank 0 has written a metrics line)."""
    metrics = run_dir / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0


def _finish(tmp_path: Path, job_id: str, run_id: str, run_dir: Path) -> tuple[dict, str]:
    """Wait for the run to complete; check what both tests check; return its record and job log."""
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _wait(lambda: catalog.get(run_id)["state"] == "completed" and _job_state(job_id) == "COMPLETED", 150,
          f"job {job_id} completed (now {_job_state(job_id)}, run {catalog.get(run_id)['state']})")
    [record] = catalog.records()  # one record, however many ranks and attempts
    log = "".join(p.read_text() for p in sorted((tmp_path / "jobs").glob("*/logs/*.out")))
    assert record["attempts"] == 2 and record["requeues"] == 1 and record["verdict"] == "converged", (record, log)
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(STEPS)), steps  # rank 0 alone wrote, and the resume was exact
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    # rank 0 alone printed a summary block: one for the stopped attempt, one for the completed one
    assert log.count("status: preempted") == 1 and log.count("status: completed") == 1, log
    return record, log


def test_two_rank_job_requeued_by_scontrol_resumes_from_its_checkpoint(tmp_path):
    """`scontrol requeue`: Slurm sends TERM to every process of the job; the ranks agree to stop,
    write their checkpoint within KillWait, rank 0 records "preempted"; Slurm starts the job again and
    it resumes at the step after the stop."""
    job_id, record, run_dir = _submit(tmp_path, "ranks-scontrol")
    _wait(lambda: _training(run_dir), 90, f"job {job_id} training")
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
    _, log = _finish(tmp_path, job_id, record["id"], run_dir)
    assert "requeueing job" not in log  # Slurm requeued it, not the script


def test_two_rank_job_checkpoints_on_usr1_and_requeues_itself(tmp_path):
    """USR1 to the batch shell (what --signal=B:USR1@N sends before the time limit): srun passes it to
    torchrun's agent, the agent to both ranks; they checkpoint, the agent exits 1, and the script
    requeues the job because rank 0's summary of this attempt says "preempted"."""
    job_id, record, run_dir = _submit(tmp_path, "ranks-usr1")
    _wait(lambda: _training(run_dir), 90, f"job {job_id} training")
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
    _, log = _finish(tmp_path, job_id, record["id"], run_dir)
    assert log.count(f"requeueing job {job_id}") == 1, log
