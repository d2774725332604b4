"""fp4lab ratchet --executor slurm on the real local cluster: every experiment is a submitit job, and a
ratchet killed while its job runs re-attaches to that job when started again instead of running twice."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp4lab.lab.records.catalog import Catalog
from tests.lab.test_ratchet import git, repo  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # each test is skipped without the local cluster (tests/conftest.py)

SLURM = '\n[slurm]\ncpus_per_task = 1\ntime = "00:05:00"\n'


def add_slurm_table(root: Path) -> None:
    text = (root / "program.md").read_text()
    (root / "program.md").write_text(text.replace("\n[noise]", SLURM + "\n[noise]"))
    git(root, "commit", "-q", "-am", "run on slurm")


def test_ratchet_runs_each_experiment_as_a_slurm_job_and_reattaches_after_a_kill(repo, tmp_path):  # noqa: F811
    add_slurm_table(repo)
    calls = tmp_path / "calls.txt"
    Path(f"{calls}.block").write_text("")
    env = os.environ | {"CALLS_FILE": str(calls), "BLOCK_AT": "3", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "fp4lab.cli", "ratchet", "--iterations", "2", "--tag", "s", "--executor", "slurm"]
    first = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while not (calls.exists() and len(calls.read_text().splitlines()) >= 3):  # iteration 1's job is held
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read().decode()
        time.sleep(0.5)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    catalog = Catalog(repo / "sweep_catalog.json")
    held = catalog.get("ratchet-s-0001")["extra"]["jobs"]["0"]
    assert subprocess.run(["squeue", "-h", "-j", held, "-o", "%T"], capture_output=True, text=True).stdout.strip() == "RUNNING"

    Path(f"{calls}.block").unlink()
    second = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    records = catalog.records(sweep="ratchet/s")
    assert [r["extra"]["iteration"] for r in records] == [0, 1, 2]
    assert records[1]["extra"]["jobs"]["0"] == held  # the same job, waited for, not submitted again
    assert len(calls.read_text().splitlines()) == 4  # baseline x2, iteration 1 once, iteration 2
    for record in records:
        assert record["executor"] == "slurm" and record["extra"]["healthy"] and record["extra"]["metric"] is not None
    jobs = {job for r in records for job in r["extra"]["jobs"].values()}
    assert len(jobs) == 4
    kept = [r["extra"]["kept_commit"] for r in records if r["extra"]["decision"] == "keep"]
    assert git(repo, "log", "--format=%H", "main..ratchet/s").splitlines()[::-1] == kept


def test_parallel_workers_on_slurm(repo):  # noqa: F811
    from fp4lab.lab.ratchet.loop import Ratchet
    from fp4lab.lab.specs.program import load_program

    add_slurm_table(repo)
    catalog = repo / "sweep_catalog.json"
    Ratchet(load_program(repo / "program.md"), tag="ps", catalog=catalog, executor="slurm", workers=2).run(iterations=4)
    records = Catalog(catalog).records(sweep="ratchet/ps")
    assert [r["extra"]["iteration"] for r in records] == [0, 1, 2, 3, 4]
    assert all(r["extra"]["phase"] == "done" and r["executor"] == "slurm" for r in records)
    assert len({job for r in records for job in r["extra"]["jobs"].values()}) == 6  # 2 baseline seeds + 4
    assert {r["extra"]["tree_dir"] for r in records[1:]} == {str(repo / ".fp4lab" / "ratchet" / "ps" / f"worker-{k}") for k in (0, 1)}
    kept = [r for r in records if r["extra"]["decision"] == "keep"]
    assert sorted(git(repo, "log", "--format=%H", "main..ratchet/ps").splitlines()) == sorted(r["extra"]["kept_commit"] for r in kept)
