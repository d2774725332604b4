"""fp4lab sweep on the real local cluster (scripts/local-slurm.sh): submitit job arrays whose jobs record
their own results in the catalog, a job that times out and is requeued and resumes, a cancelled job,
plain sbatch of the written scripts, and Optuna trials asked and told from inside Slurm jobs."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from fp4lab.lab.records.catalog import Catalog
from tests.lab.test_sweep import OPTUNA_SPEC, SPEC, cli  # noqa: F401 (the fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # each test is skipped without the local cluster (tests/conftest.py)

SLURM = '\n[slurm]\ncpus_per_task = 1\ntime = "00:10:00"\n'
LONG = SPEC.replace("steps = 6", "steps = 100000").replace('recipe = ["bf16", "nvfp4"]', 'recipe = ["bf16"]')


def wait_for(catalog, predicate, timeout=240, refresh=None):
    """Poll the catalog until predicate(records); `refresh` (e.g. `fp4lab status`) runs before each look."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if refresh is not None:
            refresh()
        records = catalog.records()
        if records and predicate(records):
            return records
        time.sleep(2)
    raise AssertionError(f"timed out; records: {[(r['id'], r['state'], r['slurm_job_id'], r['attempts']) for r in catalog.records()]}")


def test_submitit_sweep_jobs_record_their_own_results(cli, tmp_path):  # noqa: F811
    (tmp_path / "mini.toml").write_text(SPEC + SLURM)
    out = cli("sweep", "mini.toml", "--executor", "slurm")
    assert out.returncode == 0, out.stderr
    assert "submitted Slurm jobs" in out.stdout
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    submitted = catalog.records()
    assert len({r["slurm_job_id"] for r in submitted}) == 1  # one array
    assert sorted(r["slurm_array_index"] for r in submitted) == [0, 1]
    # No `fp4lab status` here: the jobs themselves write their end into the catalog.
    records = wait_for(catalog, lambda rs: all(r["state"] == "completed" for r in rs))
    for record in records:
        assert record["verdict"] == "converged" and record["summary"]["final_val_loss"] > 0
        assert record["executor"] == "slurm" and record["finished_at"] and record["attempts"] == 1
        assert Path(record["paths"]["log"]).name.endswith("_log.out")
    assert list((tmp_path / "jobs" / "mini" / "submitit").glob("*_result.pkl"))


def test_a_timed_out_job_is_requeued_resumes_and_ends_as_timeout(cli, tmp_path):  # noqa: F811
    # 2-minute limit, signal 60 s before it: each attempt is warned 60-90 s after Slurm allocates it
    # (Slurm checks every ~30 s), checkpoints, and submitit requeues it once (max_requeues = 1); the
    # second warning ends it. Not sooner: a warning that lands before the trainer runs (the job still
    # launching or importing torch: a CI machine once took 30 s from allocation to Python, half the
    # 60 s here) reaches submitit alone, which spends the one requeue on an attempt that never counts
    # as started.
    (tmp_path / "long.toml").write_text(LONG + "\n[slurm]\ncpus_per_task = 1\ntime = 2\nsignal_before_timeout_s = 60\nmax_requeues = 1\n")
    out = cli("sweep", "long.toml", "--executor", "slurm")
    assert out.returncode == 0, out.stderr
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    (record,) = wait_for(catalog, lambda rs: rs[0]["state"] == "timeout", timeout=600)
    assert record["attempts"] == 2 and record["requeues"] == 1, record
    run_dir = Path(record["paths"]["run_dir"])
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(len(steps))) and len(steps) > 2  # resumed where attempt 1 stopped: no gap, no repeat
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["stop_signal"] == "SIGUSR2"
    assert summary["steps_completed"] == len(steps)


def test_a_cancelled_slurm_run_is_recorded_as_cancelled(cli, tmp_path):  # noqa: F811
    (tmp_path / "long.toml").write_text(LONG + SLURM)
    out = cli("sweep", "long.toml", "--executor", "slurm")
    assert out.returncode == 0, out.stderr
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    running = wait_for(catalog, lambda rs: rs[0]["state"] == "running")
    subprocess.run(["scancel", f"{running[0]['slurm_job_id']}_{running[0]['slurm_array_index']}"
                    if running[0]["slurm_array_index"] is not None else running[0]["slurm_job_id"]], check=True)
    cancelled = wait_for(catalog, lambda rs: rs[0]["state"] == "cancelled", refresh=lambda: cli("status"))
    assert cancelled[0]["finished_at"], cancelled[0]


def test_plain_sbatch_executor_submits_the_written_array(cli, tmp_path):  # noqa: F811
    (tmp_path / "mini.toml").write_text(SPEC + SLURM)
    out = cli("sweep", "mini.toml", "--executor", "sbatch")
    assert out.returncode == 0, out.stderr
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    records = wait_for(catalog, lambda rs: all(r["state"] == "completed" for r in rs))
    assert len({r["slurm_job_id"] for r in records}) == 1
    assert all(r["verdict"] == "converged" and r["attempts"] == 1 for r in records)


def test_optuna_trials_run_as_a_slurm_array_through_submitit(cli, tmp_path):  # noqa: F811
    (tmp_path / "opt.toml").write_text(OPTUNA_SPEC.replace("n_trials = 3", "n_trials = 2") + SLURM)
    out = cli("sweep", "opt.toml", "--executor", "slurm")
    assert out.returncode == 0, out.stderr
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    records = wait_for(catalog, lambda rs: len(rs) == 2 and all(r["extra"].get("objective") for r in rs))
    assert sorted(r["extra"]["trial"] for r in records) == [0, 1]
    assert all(r["state"] == "completed" and r["executor"] == "slurm" and r["slurm_job_id"] for r in records)
    from tests.lab.test_sweep import _study

    assert [t.state.name for t in _study(tmp_path).get_trials()] == ["COMPLETE", "COMPLETE"]


def _job(job_id: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, check=True).stdout


def test_extra_options_reach_slurm_and_a_chained_sweep_waits_for_the_first(cli, tmp_path):  # noqa: F811
    # The first sweep, through plain sbatch: its extra options as Slurm itself read them.
    extra = "\n[slurm.extra]\ncomment = \"two words # $(touch PWNED) `id`; 'q'\"\nnice = 5\ncontiguous = true\n"
    (tmp_path / "first.toml").write_text(LONG.replace('name = "mini"', 'name = "first"') + SLURM + extra)
    out = cli("sweep", "first.toml", "--executor", "sbatch")
    assert out.returncode == 0, out.stderr
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    (first,) = catalog.records(sweep="first")
    job = _job(first["slurm_job_id"])
    assert "Comment=two words # $(touch PWNED) `id`; 'q'" in job and "Nice=5" in job and "Contiguous=1" in job, job
    assert not list(tmp_path.rglob("PWNED"))
    # The second, through submitit, after the first: its jobs wait while the first runs, then run.
    (tmp_path / "second.toml").write_text(SPEC.replace('name = "mini"', 'name = "second"') + SLURM
                                          + "\n[slurm.extra]\ncomment = \"second sweep\"\n")
    out = cli("sweep", "second.toml", "--executor", "slurm", "--after", "first")
    assert out.returncode == 0, out.stderr
    assert f"after sweep first: the jobs wait for its Slurm jobs {first['slurm_job_id']} to end" in out.stdout
    second = catalog.records(sweep="second")
    for job_id in {r["slurm_job_id"] for r in second}:
        job = _job(job_id)
        assert f"Dependency=afterany:{first['slurm_job_id']}" in job and "Comment=second sweep" in job, job
    time.sleep(3)
    assert all(r["state"] == "submitted" for r in catalog.records(sweep="second"))  # still held back
    subprocess.run(["scancel", first["slurm_job_id"]], check=True)
    done = wait_for(catalog, lambda rs: all(r["state"] == "completed" for r in rs if "second" in r["sweeps"] + [r["sweep"]]))
    assert sum(r["sweep"] == "second" for r in done) == 2


def test_optuna_trials_in_slurm_jobs_ask_the_pruner_through_the_journal(cli, tmp_path):  # noqa: F811
    import optuna

    spec = OPTUNA_SPEC.replace('objective = "final_val_loss"', 'objective = "final_val_loss"\npruner = { type = "median", n_startup_trials = 1 }')
    (tmp_path / "opt.toml").write_text(spec + SLURM)
    from tests.lab.test_sweep import _study

    # A finished trial whose loss no run reaches: each job's trial falls behind its median at the first eval.
    study = _study(tmp_path)
    space = {"lr": optuna.distributions.FloatDistribution(0.005, 0.05, log=True), "ns_steps": optuna.distributions.IntDistribution(3, 6)}
    study.add_trial(optuna.trial.create_trial(params={"lr": 0.01, "ns_steps": 4}, distributions=space, value=0.0,
                                              intermediate_values={3: 0.0, 6: 0.0}))
    out = cli("sweep", "opt.toml", "--executor", "slurm")
    assert out.returncode == 0, out.stderr
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    records = wait_for(catalog, lambda rs: len(rs) == 2 and all(r["state"] == "pruned" for r in rs))
    assert all(r["executor"] == "slurm" and r["slurm_job_id"] and r["summary"]["steps_completed"] == 3 for r in records)
    assert sorted(t.state.name for t in _study(tmp_path).get_trials()) == ["COMPLETE", "PRUNED", "PRUNED"]
