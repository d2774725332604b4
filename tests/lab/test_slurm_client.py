"""The Slurm client (fp4lab.lab.runs.slurm), `refresh` and the sbatch executor, without a cluster.

Fake `squeue`, `sbatch` and `scontrol` executables (small Python scripts in tmp_path, put first on PATH)
answer as Slurm would and record the arguments of every call; the catalogs, sweep plans, SBATCH
scripts and run folders are real. The same paths against the real local cluster are in
tests/lab/test_sweep_slurm.py (skipped without one).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from fp4lab.lab.records.catalog import Catalog
from fp4lab.lab.runs import slurm
from fp4lab.lab.runs.executors import make_executor
from fp4lab.lab.runs.sweep import plan_sweep, refresh, register_runs, scan_thresholds
from tests.lab.test_sweep import SPEC

# One fake Slurm command: appends its argv (one JSON list per call) to <name>.calls, then answers with
# the next entry of <name>.answers ([stdout, stderr, exit code]; the last one repeats).
FAKE = f"""#!{sys.executable} -S
import json, sys
from pathlib import Path
me = Path(sys.argv[0])
calls = me.with_name(me.name + ".calls")
with open(calls, "a") as handle:
    handle.write(json.dumps(sys.argv[1:]) + "\\n")
answers = json.loads(me.with_name(me.name + ".answers").read_text())
stdout, stderr, code = answers[min(len(calls.read_text().splitlines()), len(answers)) - 1]
sys.stdout.write(stdout)
sys.stderr.write(stderr)
sys.exit(code)
"""


class FakeSlurm:
    """Fake Slurm commands in one folder, first on PATH. Until a test says what one answers, each fails
    with "not faked", so no test reaches a real cluster by accident."""

    COMMANDS = ("sbatch", "squeue", "scontrol", "scancel", "sinfo", "sacct")

    def __init__(self, folder: Path) -> None:
        self.bin = folder
        self.bin.mkdir()
        for name in self.COMMANDS:
            self.answer(name, ("", f"{name}: not faked in this test\n", 2))

    def answer(self, name: str, *answers: tuple[str, str, int] | str) -> None:
        """What `name` answers, call by call: stdout alone, or (stdout, stderr, exit code)."""
        full = [[a, "", 0] if isinstance(a, str) else list(a) for a in answers]
        (self.bin / f"{name}.answers").write_text(json.dumps(full))
        script = self.bin / name
        script.write_text(FAKE)
        script.chmod(0o755)

    def calls(self, name: str) -> list[list[str]]:
        path = self.bin / f"{name}.calls"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch) -> FakeSlurm:
    fake = FakeSlurm(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{fake.bin}{os.pathsep}{os.environ['PATH']}")
    fake.answer("scontrol", ("", "scontrol: error: not a cluster\n", 1))  # plan_sweep asks for MaxArraySize
    return fake


@pytest.fixture
def no_slurm(tmp_path, monkeypatch) -> None:
    """No Slurm command on PATH at all."""
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))


def record(job_id: str, index: int | None) -> dict:
    return {"slurm_job_id": job_id, "slurm_array_index": index}


def jobs_asked(argv: list[str]) -> set[str]:
    """The job ids one squeue call asked for (--jobs A,B or --jobs=A,B)."""
    for k, arg in enumerate(argv):
        if arg == "--jobs":
            return set(argv[k + 1].split(","))
        if arg.startswith("--jobs="):
            return set(arg.partition("=")[2].split(","))
    raise AssertionError(f"squeue was not asked for particular jobs: {argv}")


# ----------------------------------------------------------------------------------------- job_states


def test_job_states_reads_array_tasks_and_plain_jobs_from_one_squeue_call(fake_slurm):
    fake_slurm.answer("squeue", "123_4 RUNNING\n123_5 PENDING\n\n77 COMPLETED\n")
    records = [record("123", 4), record("123", 5), record("77", None)]
    states = slurm.job_states(records)
    assert states == {"123_4": "RUNNING", "123_5": "PENDING", "77": "COMPLETED"}
    assert [states[slurm.job_key(r)] for r in records] == ["RUNNING", "PENDING", "COMPLETED"]
    (argv,) = fake_slurm.calls("squeue")  # one call for all records, each job asked once
    assert jobs_asked(argv) == {"123", "77"}
    # finished jobs too (--states=all), one line per array task (--array), no header line to misread
    assert {"--states=all", "--array", "--noheader"} <= set(argv), argv


def test_job_states_asks_nothing_for_no_records(fake_slurm):
    fake_slurm.answer("squeue", "123 RUNNING\n")
    assert slurm.job_states([]) == {}
    assert fake_slurm.calls("squeue") == []


def test_job_states_is_empty_when_squeue_is_missing_or_fails(fake_slurm, monkeypatch, tmp_path):
    fake_slurm.answer("squeue", ("", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)\n", 1))
    assert slurm.job_states([record("123", None)]) == {}
    assert len(fake_slurm.calls("squeue")) == 1
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    assert slurm.job_states([record("123", None)]) == {}


# ---------------------------------------------------------------------------------------- submit_script


def test_submit_script_returns_the_job_id(fake_slurm, tmp_path):
    script = tmp_path / "run.sbatch"
    script.write_text("#!/bin/bash\n")
    fake_slurm.answer("sbatch", "123;fp4lab-local\n", "456\n")
    assert slurm.submit_script(script) == "123"  # --parsable on a multi-cluster setup: "id;cluster"
    assert slurm.submit_script(script) == "456"
    assert fake_slurm.calls("sbatch") == [["--parsable", str(script)]] * 2


def test_submit_script_failure_says_sbatch_s_reason(fake_slurm, tmp_path):
    script = tmp_path / "run.sbatch"
    script.write_text("#!/bin/bash\n")
    reason = "sbatch: error: Batch job submission failed: Invalid account or account/partition combination specified"
    fake_slurm.answer("sbatch", ("", f"sbatch: warning: can't honor --mem\n{reason}\n", 1), ("", "", 1))
    with pytest.raises(slurm.SubmissionError) as refused:
        slurm.submit_script(script)
    assert str(refused.value) == f"sbatch {script}: {reason}"  # the last line: the reason, not the warning
    with pytest.raises(slurm.SubmissionError, match="exit code 1$"):
        slurm.submit_script(script)


def test_submit_script_without_sbatch_says_so(no_slurm, tmp_path):
    with pytest.raises(slurm.SubmissionError, match="sbatch is not on PATH.*run the sweep locally"):
        slurm.submit_script(tmp_path / "run.sbatch")


# --------------------------------------------------------------------------------------- SbatchExecutor

THREE = SPEC.replace('recipe = ["bf16", "nvfp4"]', 'recipe = ["bf16", "nvfp4", "mxfp4"]')


@pytest.fixture
def planned(tmp_path, monkeypatch, fake_slurm):
    """The mini sweep of tests/lab/test_sweep.py with three runs, planned (scripts written) and registered."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mini.toml").write_text(THREE)
    plan = plan_sweep("mini.toml")
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    register_runs(plan, catalog, "slurm")
    return plan, catalog


def test_sbatch_executor_submits_the_array_and_records_each_task(planned, fake_slurm):
    plan, catalog = planned
    fake_slurm.answer("sbatch", "4242;fp4lab-local\n")
    launched = make_executor("sbatch").launch(plan, plan.runs, catalog)
    assert launched.job_ids == ["4242"] and launched.started == 3 and launched.records == []
    assert fake_slurm.calls("sbatch") == [["--parsable", str(plan.sweep_dir / "array_0.sbatch")]]
    listed = (plan.sweep_dir / "array_0.runs").read_text().split()  # task i runs line i + 1
    assert sorted(listed) == sorted(run.id for run in plan.runs)
    for run in plan.runs:
        submitted = catalog.get(run.id)
        assert submitted["state"] == "submitted" and submitted["executor"] == "slurm" and submitted["submitted_at"]
        assert (submitted["slurm_job_id"], submitted["slurm_array_index"]) == ("4242", listed.index(run.id))


def test_sbatch_executor_submits_one_script_per_run_when_only_some_are_needed(planned, fake_slurm):
    plan, catalog = planned
    fake_slurm.answer("sbatch", "501\n", "502\n")
    first, _, third = plan.runs
    launched = make_executor("sbatch").launch(plan, [first, third], catalog)
    assert launched.job_ids == ["501", "502"]
    assert fake_slurm.calls("sbatch") == [["--parsable", str(plan.sweep_dir / f"{run.id}.sbatch")] for run in (first, third)]
    assert [(r["state"], r["slurm_job_id"], r["slurm_array_index"]) for r in catalog.records(sweep="mini")] == [
        ("submitted", "501", None), ("pending", None, None), ("submitted", "502", None)]


def test_a_refused_submission_records_nothing(planned, fake_slurm):
    plan, catalog = planned
    fake_slurm.answer("sbatch", ("", "sbatch: error: invalid partition specified: gpu\n", 1))
    before = catalog.records()
    with pytest.raises(slurm.SubmissionError, match="invalid partition specified: gpu"):
        make_executor("sbatch").launch(plan, plan.runs, catalog)
    assert catalog.records() == before


# ---------------------------------------------------------------------------------------------- refresh


def submitted(planned, fake_slurm) -> tuple[list[dict], Catalog]:
    """The planned runs submitted as job array 4242 (through the fake sbatch), in array order."""
    plan, catalog = planned
    fake_slurm.answer("sbatch", "4242\n")
    make_executor("sbatch").launch(plan, plan.runs, catalog)
    return sorted(catalog.records(sweep="mini"), key=lambda r: r["slurm_array_index"]), catalog


def run_folder(catalog: Catalog, rec: dict, *, summary: dict | None = None, steps: int = 6) -> Path:
    """What the trainer leaves in a run folder: metrics.jsonl, and summary.json once it has ended."""
    run_dir = catalog.resolve(rec["paths"]["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 4.0 - 0.1 * s}) + "\n" for s in range(steps)))
    if summary is not None:
        (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_refresh_records_jobs_that_ended_without_a_summary(planned, fake_slurm):
    (a, b, c), catalog = submitted(planned, fake_slurm)
    run_folder(catalog, c)  # it trained a few steps before it failed
    fake_slurm.answer("squeue", "4242_0 CANCELLED\n4242_1 TIMEOUT\n4242_2 FAILED\n")
    refreshed = {r["id"]: r for r in refresh(catalog, scan_thresholds(planned[0].spec), "mini")}
    assert [refreshed[r["id"]]["state"] for r in (a, b, c)] == ["cancelled", "timeout", "failed"]
    assert all(refreshed[r["id"]]["finished_at"] for r in (a, b, c))
    assert refreshed[a["id"]]["verdict"] is None and refreshed[c["id"]]["verdict"] is not None  # scanned metrics
    (argv,) = fake_slurm.calls("squeue")
    assert jobs_asked(argv) == {"4242"}
    assert {r["id"]: r["state"] for r in catalog.records(sweep="mini")} == {i: r["state"] for i, r in refreshed.items()}


def test_refresh_sends_a_requeued_preempted_run_back_to_submitted(planned, fake_slurm):
    (a, b, c), catalog = submitted(planned, fake_slurm)
    for rec in (a, b, c):  # what the trainer records when it checkpoints on the preemption signal
        catalog.update(rec["id"], state="preempted")
    fake_slurm.answer("squeue", "4242_0 PENDING\n4242_1 PREEMPTED\n4242_2 CANCELLED\n")
    refresh(catalog, scan_thresholds(planned[0].spec), "mini")
    assert [catalog.get(r["id"])["state"] for r in (a, b, c)] == [
        "submitted",  # requeued: waiting to resume from its checkpoint
        "preempted",  # not requeued (yet)
        "cancelled",  # scancel after the checkpoint
    ]


def test_refresh_finishes_a_run_whose_summary_exists_once_its_job_has_ended(planned, fake_slurm):
    (a, b, c), catalog = submitted(planned, fake_slurm)
    summary = {"status": "completed", "final_loss": 3.5, "best_loss": 3.5, "final_val_loss": 3.6, "steps_completed": 6}
    run_folder(catalog, a, summary=summary)
    run_folder(catalog, b, summary=summary)  # written, but its job is still ending
    run_folder(catalog, c)  # training
    fake_slurm.answer("squeue", "4242_0 COMPLETED\n4242_1 COMPLETING\n4242_2 RUNNING\n")
    refresh(catalog, scan_thresholds(planned[0].spec), "mini")
    done = catalog.get(a["id"])
    assert done["state"] == "completed" and done["finished_at"] and done["verdict"] is not None
    assert done["summary"]["final_train_loss"] == 3.5 and done["summary"]["final_val_loss"] == 3.6
    assert [catalog.get(r["id"])["state"] for r in (b, c)] == ["running", "running"]


def test_refresh_goes_by_the_run_folders_when_slurm_does_not_answer(planned, fake_slurm, monkeypatch, tmp_path):
    (a, b, c), catalog = submitted(planned, fake_slurm)
    run_folder(catalog, a, summary={"status": "completed", "final_loss": 3.5})
    run_folder(catalog, b)
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    refresh(catalog, scan_thresholds(planned[0].spec), "mini")
    assert [catalog.get(r["id"])["state"] for r in (a, b, c)] == ["completed", "running", "submitted"]


# ----------------------------------------------------------------------------------- chained sweeps


def test_after_sweep_waits_for_the_jobs_slurm_still_lists(fake_slurm):
    records = [{**record("120", 0), "state": "running"}, {**record("120", 1), "state": "submitted"},
               {**record("9", None), "state": "submitted"}, {**record("15", None), "state": "running"},
               {**record("7", None), "state": "completed"}, {**record(None, None), "state": "pending"}]
    fake_slurm.answer("squeue", "120_0 RUNNING\n120_1 PENDING\n15 REQUEUED\n9 COMPLETED\n")
    assert slurm.after_sweep(records, "first") == "afterany:15:120"  # numeric order; the ended job 9 is left out
    (argv,) = fake_slurm.calls("squeue")
    assert jobs_asked(argv) == {"120", "9", "15"}  # ended records are not asked about


def test_after_sweep_needs_no_dependency_when_nothing_is_queued(fake_slurm):
    fake_slurm.answer("squeue", "5 COMPLETED\n")
    assert slurm.after_sweep([{**record("5", None), "state": "running"}], "first") is None
    assert slurm.after_sweep([{**record("8", None), "state": "completed"}], "first") is None


def test_after_sweep_keeps_every_queued_job_when_squeue_cannot_answer(no_slurm):
    records = [{**record("31", None), "state": "submitted"}, {**record("4", 2), "state": "running"}]
    assert slurm.after_sweep(records, "first") == "afterany:4:31"


def test_sbatch_executor_passes_the_dependency_to_every_submission(planned, fake_slurm):
    plan, catalog = planned
    fake_slurm.answer("sbatch", "601\n", "602\n")
    first, _, third = plan.runs
    make_executor("sbatch", dependency="afterany:40:41").launch(plan, [first, third], catalog)
    assert fake_slurm.calls("sbatch") == [["--parsable", "--dependency=afterany:40:41", str(plan.sweep_dir / f"{run.id}.sbatch")]
                                          for run in (first, third)]
