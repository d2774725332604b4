"""The orchestrator's contract with a REAL Slurm: sbatch, arrays, MaxArraySize, scancel, requeue on a
time-limit warning, and submitit (AutoExecutor, map_array, Checkpointable requeue).

Needs the local single-node cluster: `sudo scripts/local-slurm.sh start` (CI starts it before pytest).
Without it each test is skipped (the `slurm` marker, tests/conftest.py). The slow parts are Slurm's own clocks: time limits and
`--signal=SIG@N` warnings are checked about every 30 s, and a requeued job waits `cred_expire` (10 s in
our slurm.conf) before it runs again. The two requeue tests therefore overlap: the sbatch one is
submitted when the module starts and checked at the end.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import cloudpickle  # submitit's dependency
import pytest
import submitit

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

MAX_ARRAY_SIZE = 64  # scripts/local-slurm.sh writes MaxArraySize=64: indices 0..63
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
            "DEADLINE"}


# ----------------------------------------------------------------------------------------------- helpers

def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30, check=False)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _sbatch(*args: str, cwd: Path) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, timeout=30, cwd=cwd,
                         check=False)
    assert out.returncode == 0, f"sbatch {' '.join(args)} failed: {out.stderr.strip()}"
    return out.stdout.strip().split(";")[0]


def _job_records(job_id: str) -> list[dict[str, str]]:
    """`scontrol show job -o ID` as dicts: one per job, or one per array task. Empty when unknown."""
    out = _run("scontrol", "show", "job", "-o", job_id, check=False)
    if out.returncode != 0:
        return []
    records = []
    for line in out.stdout.splitlines():
        if line.strip():
            records.append(dict(m.groups() for m in re.finditer(r"(\w+)=(\S*)", line)))
    return records


def _wait(job_id: str, done, timeout: float, what: str) -> list[dict[str, str]]:
    deadline = time.monotonic() + timeout
    records: list[dict[str, str]] = []
    while time.monotonic() < deadline:
        records = _job_records(job_id)
        if records and done(records):
            return records
        time.sleep(0.2)
    states = [(r.get("JobId"), r.get("ArrayTaskId"), r.get("JobState"), r.get("Reason")) for r in records]
    raise AssertionError(f"job {job_id}: {what} not reached within {timeout:.0f} s; now {states}")


def _wait_finished(job_id: str, timeout: float = 120) -> list[dict[str, str]]:
    # A bound on a hang, not a speed check: on a busy 2-core CI machine, array tasks wait their turn for CPUs.
    return _wait(job_id, lambda rs: all(r["JobState"] in FINISHED for r in rs), timeout, "all finished")


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/bash\n" + body)
    return path


# ---------------------------------------------------------- requeue after a time-limit warning (sbatch)
# Submitted as soon as the module starts (it needs ~30-45 s of wall time, mostly waiting on Slurm's clocks)
# and checked by the last test. The first attempt sleeps past its 1-minute limit; `--signal=B:USR1@25`
# warns the batch shell before the limit, the handler leaves a marker and requeues the job itself.
# The second attempt (SLURM_RESTART_COUNT=1) finishes at once.

REQUEUE_SCRIPT = """\
#SBATCH --time=1
#SBATCH --signal=B:USR1@25
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=requeue.out
attempt=${SLURM_RESTART_COUNT:-0}
echo "attempt $attempt" >> attempts.txt
if [ "$attempt" -ge 1 ]; then echo done > done.txt; exit 0; fi
on_warning() {
    echo "USR1 in attempt $attempt" >> warned.txt
    kill "$sleeper" 2>/dev/null
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
}
trap on_warning USR1
sleep 150 &   # well past the time limit
sleeper=$!
wait
echo "not warned: ran to the end" >> attempts.txt
"""


@pytest.fixture(scope="module")
def requeue_job(tmp_path_factory) -> tuple[str, Path]:
    workdir = tmp_path_factory.mktemp("requeue")
    script = _script(workdir / "requeue.sh", REQUEUE_SCRIPT)
    job_id = _sbatch(str(script), cwd=workdir)
    yield job_id, workdir
    _run("scancel", job_id, check=False)


@pytest.fixture(scope="module", autouse=True)
def _start_requeue_job_early(requeue_job):
    return requeue_job


# ----------------------------------------------------------------------------------------------- tests

def test_cluster_settings_the_orchestrator_relies_on():
    config = _run("scontrol", "show", "config").stdout
    settings = dict(re.findall(r"^(\w+)\s*=\s*(.*?)\s*$", config, flags=re.MULTILINE))
    assert settings["MaxArraySize"] == str(MAX_ARRAY_SIZE)
    assert settings["JobRequeue"] == "1"
    partitions = _run("sinfo", "-h", "-o", "%P").stdout.split()
    assert partitions, "no partition"


def test_sbatch_script_runs_and_writes_its_output(tmp_path):
    script = _script(tmp_path / "hello.sh", 'echo "hello from $SLURM_JOB_ID on $(hostname -s)"\nexit 0\n')
    job_id = _sbatch("--output=hello-%j.out", "--time=1", str(script), cwd=tmp_path)
    (record,) = _wait_finished(job_id)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", record
    out = (tmp_path / f"hello-{job_id}.out").read_text()
    assert out.strip() == f"hello from {job_id} on {_run('hostname', '-s').stdout.strip()}"


def test_failing_script_is_reported_failed(tmp_path):
    job_id = _sbatch("--output=/dev/null", "--time=1", "--wrap", "exit 3", cwd=tmp_path)
    (record,) = _wait_finished(job_id)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "3:0", record


def test_job_array_runs_every_task(tmp_path):
    job_id = _sbatch("--array=0-4", "--output=/dev/null", "--time=1", "--wrap",
                     'echo "$SLURM_ARRAY_JOB_ID $SLURM_ARRAY_TASK_COUNT" > task-$SLURM_ARRAY_TASK_ID.txt',
                     cwd=tmp_path)
    records = _wait_finished(job_id)
    assert sorted(int(r["ArrayTaskId"]) for r in records) == [0, 1, 2, 3, 4]
    assert all(r["JobState"] == "COMPLETED" for r in records), records
    for task in range(5):
        assert (tmp_path / f"task-{task}.txt").read_text().split() == [job_id, "5"]


def test_array_larger_than_max_array_size_is_refused(tmp_path):
    """Slurm refuses a too-large array at submission, so the orchestrator has to split sweeps into chunks."""
    too_big = _run("sbatch", "--parsable", f"--array=0-{MAX_ARRAY_SIZE}", "--output=/dev/null", "--wrap", "true",
                   check=False)
    assert too_big.returncode != 0
    assert "Invalid job array specification" in too_big.stderr, too_big.stderr
    # the largest allowed array is accepted (held and cancelled so that its 64 tasks never run)
    job_id = _sbatch("--hold", f"--array=0-{MAX_ARRAY_SIZE - 1}", "--output=/dev/null", "--wrap", "true",
                     cwd=tmp_path)
    try:
        (record,) = _job_records(job_id)  # a pending array is one record until its tasks start
        assert record["ArrayTaskId"] == f"0-{MAX_ARRAY_SIZE - 1}", record
    finally:
        _run("scancel", job_id)


def test_scancel_stops_a_running_job(tmp_path):
    script = _script(tmp_path / "long.sh", "echo started > started.txt\nsleep 120\necho finished > finished.txt\n")
    job_id = _sbatch("--output=long.out", "--time=3", str(script), cwd=tmp_path)
    deadline = time.monotonic() + 30
    while not (tmp_path / "started.txt").exists():
        assert time.monotonic() < deadline, f"job {job_id} never started: {_job_records(job_id)}"
        time.sleep(0.2)
    _run("scancel", job_id)
    # MinJobAge=3600 keeps the finished job in slurmctld's table, so its final state stays queryable
    (record,) = _wait_finished(job_id, timeout=20)
    assert record["JobState"] == "CANCELLED", record
    sacct = _run("sacct", "-X", "-n", "-P", "-o", "JobID,State", "-j", job_id, check=False)
    if sacct.returncode == 0:  # real accounting or the sacct stand-in: what submitit reads
        rows = [line.split("|") for line in sacct.stdout.splitlines() if line.strip()]
        assert [row[1].split()[0] for row in rows if row[0] == job_id] == ["CANCELLED"], sacct.stdout
    assert not (tmp_path / "finished.txt").exists()


# --------------------------------------------------------------------------------------------- submitit

# Ship this module's functions to the job by value: the job need not be able to import `tests`.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _square(x: int) -> int:
    return x * x


def _job_info(x: int) -> tuple[int, str, str]:
    return x + 1, os.environ["SLURM_JOB_ID"], os.environ.get("SLURM_ARRAY_TASK_ID", "")


def _wait_result(job, timeout: float):
    deadline = time.monotonic() + timeout
    while not job.done(force_check=True):
        assert time.monotonic() < deadline, f"submitit job {job.job_id} not done in {timeout:.0f} s: {job.state}"
        time.sleep(0.5)
    return job.result()


@pytest.fixture()
def executor(tmp_path):
    ex = submitit.AutoExecutor(folder=tmp_path / "%j")
    assert ex.cluster == "slurm"
    ex.update_parameters(timeout_min=5, slurm_signal_delay_s=30, cpus_per_task=1)
    return ex


def test_submitit_submit_and_map_array(executor):
    job = executor.submit(_job_info, 41)
    assert _wait_result(job, 120)[0] == 42
    # the result file is written just before the job ends: Slurm's final state follows a moment later
    assert _wait_finished(job.job_id)[0]["JobState"] == "COMPLETED"
    jobs = executor.map_array(_square, [1, 2, 3])
    assert len({j.job_id.split("_")[0] for j in jobs}) == 1, "map_array must be one Slurm array"
    # the array's tasks wait for free CPUs: on a 2-core CI machine busy with other tests that can take a while
    assert [_wait_result(j, 120) for j in jobs] == [1, 4, 9]


def test_submitit_reports_a_failing_function(executor):
    job = executor.submit(_square, "not a number")
    with pytest.raises(submitit.core.utils.FailedJobError, match="TypeError"):
        _wait_result(job, 120)


class _Counter(submitit.helpers.Checkpointable):
    """A 'training loop' longer than its time limit: counts 0.5 s steps until warned. On the warning
    submitit calls checkpoint() (default: pickle self, step included) and requeues the job; the requeued
    attempt starts from the pickled step, runs a few more steps and returns."""

    def __init__(self) -> None:
        self.step = 0
        self.resumed_at: int | None = None

    def __call__(self) -> dict:
        if self.step > 0:
            self.resumed_at = self.step
            for _ in range(3):
                self.step += 1
            return {"step": self.step, "resumed_at": self.resumed_at,
                    "restarts": int(os.environ.get("SLURM_RESTART_COUNT", "0"))}
        while self.step < 180:  # 90 s: longer than the 60 s time limit
            time.sleep(0.5)
            self.step += 1
        return {"step": self.step, "resumed_at": None, "restarts": 0}  # never warned


def test_submitit_checkpointable_is_requeued_and_resumes(executor):
    # Slurm sends the warning at its first time check (every ~30 s) once less than delay + 30 s remain:
    # with a 1-minute limit and a 20 s delay that is 10-40 s into the job, so never before submitit has
    # installed its handler (a delay >= 30 s could fire within the first second and kill Python).
    executor.update_parameters(timeout_min=1, slurm_signal_delay_s=20)
    job = executor.submit(_Counter())
    result = _wait_result(job, 90)
    assert result["resumed_at"] is not None and result["resumed_at"] > 0, result
    assert result["step"] == result["resumed_at"] + 3
    assert result["restarts"] >= 1
    # submitit reads the result file the job wrote, which can be before Slurm marks the job ended.
    (record,) = _wait_finished(job.job_id, 60)
    assert int(record["Restarts"]) >= 1 and record["JobState"] == "COMPLETED", record


# ----------------------------------------------------------------------------------------- requeue check

def test_time_limit_warning_requeues_and_second_attempt_completes(requeue_job):
    job_id, workdir = requeue_job
    (record,) = _wait(job_id, lambda rs: rs[0]["JobState"] in FINISHED and rs[0]["JobState"] != "REQUEUED",
                      timeout=90, what="finished after a requeue")
    assert record["JobState"] == "COMPLETED", record
    assert record["Restarts"] == "1", record
    assert (workdir / "warned.txt").read_text().splitlines() == ["USR1 in attempt 0"]
    assert (workdir / "attempts.txt").read_text().splitlines() == ["attempt 0", "attempt 1"]
    assert (workdir / "done.txt").exists()
