"""fp4lab sweep end to end on this machine: spec -> scripts -> runs -> scanned catalog rows."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from fp4lab.lab.records.catalog import Catalog
from tests.distributed_helpers import gloo_unavailable

SPEC = """
name = "mini"
[base]
model = "tiny"
steps = 6
batch_size = 2
seq_len = 32
warmup_steps = 1
eval_every = 3
eval_batches = 1
probe_every = 3
checkpoint_every = 3
[base.data]
source = "synthetic"
[axes]
recipe = ["bf16", "nvfp4"]
"""


@pytest.fixture
def cli(run_cli, monkeypatch, tmp_path):
    """The CLI, run from inside tmp_path (jobs/, runs/ and the catalog land there)."""
    monkeypatch.chdir(tmp_path)
    return run_cli


def registered(folder: Path, spec_file: str) -> Catalog:
    """The spec's runs recorded as pending in folder/sweep_catalog.json, as a sweep records them before
    starting any (a dry run records nothing)."""
    from fp4lab.lab.runs.sweep import plan_sweep, register_runs

    catalog = Catalog(folder / "sweep_catalog.json")
    register_runs(plan_sweep(folder / spec_file, folder / "jobs", catalog.path, ask_slurm=False), catalog, "local")
    return catalog


def test_dry_run_writes_scripts_and_records_nothing(cli, tmp_path):
    (tmp_path / "mini.toml").write_text(SPEC)
    out = cli("sweep", "mini.toml", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "2 runs, 2 to run" in out.stdout and "dry run: nothing started or recorded" in out.stdout
    manifest = json.loads((tmp_path / "jobs" / "mini" / "manifest.json").read_text())
    ids = [r["id"] for r in manifest["runs"]]
    assert all((tmp_path / "jobs" / "mini" / f"{i}.sbatch").exists() for i in ids)
    assert not (tmp_path / "sweep_catalog.json").exists() and not (tmp_path / "runs").exists()
    # a catalog that exists stays byte for byte what it was
    (tmp_path / "other.toml").write_text(SPEC.replace('name = "mini"', 'name = "other"').replace("nvfp4", "mxfp4"))
    catalog = registered(tmp_path, "other.toml")
    before = catalog.path.read_bytes()
    assert cli("sweep", "mini.toml", "--dry-run").returncode == 0
    assert catalog.path.read_bytes() == before


def test_a_dry_runs_script_run_by_hand_records_its_run(cli, tmp_path):
    """`sbatch jobs/<sweep>/<id>.sbatch` after a dry run: the job's `train --catalog` records the run
    from the sweep's manifest, which names the catalog."""
    (tmp_path / "mini.toml").write_text(SPEC)
    assert cli("sweep", "mini.toml", "--dry-run").returncode == 0
    run = json.loads((tmp_path / "jobs" / "mini" / "manifest.json").read_text())["runs"][0]
    out = cli("train", "--config", f"jobs/mini/{run['id']}.toml", "--catalog", "sweep_catalog.json")
    assert out.returncode == 0, out.stderr
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records()
    assert (record["id"], record["sweep"], record["extra"]["name"]) == (run["id"], "mini", run["name"])
    assert (record["state"], record["attempts"], record["verdict"]) == ("completed", 1, "converged")


def test_local_sweep_runs_scans_records_and_skips_completed_runs(cli, tmp_path, monkeypatch):
    from fp4lab.lab.runs import sweep

    # two GPUs (as CUDA_VISIBLE_DEVICES names them) for two workers: each run gets one of its own
    # (device "auto": on this CPU machine the runs train on the CPU all the same)
    monkeypatch.setattr(sweep, "cuda_devices", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    (tmp_path / "mini.toml").write_text(SPEC.replace("[base]\n", '[base]\ndevice = "auto"\n'))
    out = cli("sweep", "mini.toml", "--workers", "2")
    assert out.returncode == 0, out.stderr
    records = Catalog(tmp_path / "sweep_catalog.json").records(sweep="mini")
    assert {r["recipe"] for r in records} == {"bf16", "nvfp4"}
    for record in records:
        assert record["state"] == "completed" and record["verdict"] == "converged", record
        assert record["attempts"] == 1 and record["finished_at"] and record["started_at"]
        summary = record["summary"]
        assert summary["final_val_loss"] > 0 and summary["tokens_per_s"] > 0
        assert set(summary["loss_at_steps"]) == {"0", "5"}
        assert Path(record["paths"]["run_dir"], "summary.json").exists()
    gpus = [json.loads(Path(r["paths"]["run_dir"], "summary.json").read_text())["cuda_visible_devices"] for r in records]
    assert sorted(gpus) == ["4", "6"]
    again = cli("sweep", "mini.toml")
    assert "0 to run, skipped: 2 done" in again.stdout
    status = cli("status", "mini")
    assert status.returncode == 0, status.stderr
    assert status.stdout.count("completed") == 2


def test_sweep_errors_are_one_line(cli, tmp_path):
    (tmp_path / "bad.toml").write_text(SPEC.replace('recipe = ["bf16", "nvfp4"]', 'recipe = ["bf16", "nope"]'))
    for args, fragment in [
        (("sweep", "bad.toml"), "unknown recipe 'nope'"),
        (("sweep", "missing.toml"), "missing.toml"),
        (("sweep", "bad.toml", "--executor", "cloud"), "--executor 'cloud' is not supported"),
        (("status",), "no catalog"),
    ]:
        out = cli(*args)
        assert out.returncode == 2, (args, out.stdout)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], (args, out.stderr)


# One run of 2 CPU ranks (ntasks_per_node = 2) sharing the model through DDP.
RANKS_SPEC = SPEC.replace('recipe = ["bf16", "nvfp4"]', 'recipe = ["bf16"]').replace("[base]\n", '[base]\nparallel = "ddp"\n') + """
[slurm]
ntasks_per_node = 2
"""


def test_specs_of_several_ranks_that_cannot_run_are_refused_before_anything_is_written(cli, tmp_path):
    (tmp_path / "none.toml").write_text(RANKS_SPEC.replace('parallel = "ddp"', 'parallel = "none"'))
    (tmp_path / "ranks.toml").write_text(RANKS_SPEC)
    for args, fragment in [
        (("sweep", "none.toml"), 'base.parallel: parallel = "none" trains in one process, but [slurm] ntasks_per_node = 2'),
        (("sweep", "ranks.toml", "--executor", "slurm", "--dry-run"), "gives each run 2 ranks; --executor slurm runs one process per run: use --executor sbatch"),
    ]:
        out = cli(*args)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and fragment in lines[0], (args, out.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["none.toml", "ranks.toml"]  # no jobs/, no catalog


def test_local_runs_need_a_cuda_device_per_rank(tmp_path, monkeypatch):
    from fp4lab.lab.runs import sweep

    (tmp_path / "ranks.toml").write_text(RANKS_SPEC.replace("[base]\n", '[base]\ndevice = "cuda"\n'))
    monkeypatch.chdir(tmp_path)
    plan = sweep.plan_sweep("ranks.toml")
    for devices, problem in [(2, None), (1, "on 2 rank(s) but this machine has 1 CUDA device(s)"), (0, "has no CUDA device")]:
        monkeypatch.setattr(sweep, "cuda_devices", lambda devices=devices: devices)
        problems = sweep.preflight(plan, "local")
        assert (problem in problems[0]) if problem else not problems, (devices, problems)
        assert not sweep.preflight(plan, "sbatch")


def test_gpu_slots_give_concurrent_local_runs_gpus_of_their_own():
    from fp4lab.lab.runs.executors import gpu_slots

    assert gpu_slots(2, 1, 2, None) == ["0", "1"]
    assert gpu_slots(2, 2, 4, "3,5,6,7") == ["3,5", "6,7"]  # runs of 2 ranks; ids as CUDA_VISIBLE_DEVICES names them
    assert gpu_slots(3, 1, 8, None) == ["0", "1", "2"]
    assert gpu_slots(1, 1, 8, None) is None  # one run at a time: it sees every GPU, as before
    assert gpu_slots(5, 1, 2, "4,6") == ["4", "6", "4", "6", "4"]  # more runs than GPUs: shared evenly
    assert gpu_slots(3, 1, 1, None) is None  # one GPU: every run is on it anyway
    assert gpu_slots(3, 2, 4, None) is None  # runs of 2 ranks that do not each fit: they share what they see


@pytest.mark.slow
@pytest.mark.skipif(gloo_unavailable() is not None, reason=str(gloo_unavailable()))
def test_local_sweep_runs_a_run_of_two_ranks_through_torchrun(cli, tmp_path):
    """The local executor starts torchrun --standalone of 2 processes; rank 0 alone records the run and
    writes its metrics."""
    (tmp_path / "ranks.toml").write_text(RANKS_SPEC)
    out = cli("sweep", "ranks.toml")
    assert out.returncode == 0, out.stderr
    [record] = Catalog(tmp_path / "sweep_catalog.json").records()
    log = (tmp_path / record["paths"]["log"]).read_text()
    assert record["state"] == "completed" and record["attempts"] == 1 and record["verdict"] == "converged", (record, log)
    run_dir = Path(record["paths"]["run_dir"])
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(6))
    assert log.count("status: completed") == 1  # rank 0 alone printed its summary


@pytest.mark.slow
@pytest.mark.skipif(gloo_unavailable() is not None, reason=str(gloo_unavailable()))
def test_train_with_catalog_on_two_processes_records_once(cli, tmp_path):
    """`fp4lab train --config jobs/<sweep>/<id>.toml --catalog C --nproc-per-node 2`: torchrun runs the
    same command on each rank; rank 0 alone records the start and the end."""
    (tmp_path / "ranks.toml").write_text(RANKS_SPEC)
    catalog = registered(tmp_path, "ranks.toml")
    [record] = catalog.records()
    config = f"jobs/mini/{record['id']}.toml"
    out = cli("train", "--config", config, "--catalog", "sweep_catalog.json", "--nproc-per-node", "2")
    assert out.returncode == 0, out.stderr
    record = catalog.get(record["id"])
    assert record["state"] == "completed" and record["attempts"] == 1 and record["owner"] is None, record
    assert json.loads(Path(record["paths"]["run_dir"], "summary.json").read_text())["world_size"] == 2


BASE_TABLES = "[base]" + SPEC.split("[base]", 1)[1].split("[axes]")[0]  # the mini sweep's [base] and [base.data]
OPTUNA_SPEC = 'name = "opt"\nmethod = "optuna"\nseed = 7\n' + BASE_TABLES + """
[optuna]
n_trials = 3
objective = "final_val_loss"
[optuna.search_space]
lr = { type = "float", low = 0.005, high = 0.05, log = true }
ns_steps = { type = "int", low = 3, high = 6 }
"""


def _study(tmp_path):
    import optuna

    from fp4lab.lab.runs.trials import open_study
    from fp4lab.lab.specs.sweep_spec import load_spec

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return open_study(load_spec(tmp_path / "opt.toml"), tmp_path / "jobs")


def test_optuna_sweep_asks_trains_and_tells_every_trial(cli, tmp_path):
    (tmp_path / "opt.toml").write_text(OPTUNA_SPEC)
    out = cli("sweep", "opt.toml", "--dry-run")
    assert out.returncode == 0, out.stderr
    script = (tmp_path / "jobs" / "opt" / "trials_0.sbatch").read_text()
    assert "#SBATCH --array=0-2" in script and "-m fp4lab.cli trial" in script and '--slot "$SLOT"' in script
    assert (tmp_path / "jobs" / "opt" / "spec.toml").read_text() == OPTUNA_SPEC
    out = cli("sweep", "opt.toml", "--workers", "2")
    assert out.returncode == 0, out.stderr
    records = Catalog(tmp_path / "sweep_catalog.json").records(sweep="opt")
    assert sorted(r["extra"]["trial"] for r in records) == [0, 1, 2]
    trials = {t.number: t for t in _study(tmp_path).get_trials()}
    for record in records:
        assert record["state"] == "completed" and record["verdict"] == "converged"
        trial = trials[record["extra"]["trial"]]
        assert trial.state.name == "COMPLETE"
        assert trial.value == record["summary"]["final_val_loss"] == record["extra"]["objective"]
        assert record["config"]["lr"] == trial.params["lr"] and record["config"]["ns_steps"] == trial.params["ns_steps"]
        assert 0.005 <= trial.params["lr"] <= 0.05 and 3 <= trial.params["ns_steps"] <= 6
    assert len({r["id"] for r in records}) == 3
    logs = sorted(p.name for p in (tmp_path / "jobs" / "opt" / "logs").glob("*.local.log"))
    assert logs == ["trial-slot0.local.log", "trial-slot1.local.log", "trial-slot2.local.log"]  # one per trial
    scanned = cli("scan", *(str(tmp_path / "jobs" / "opt" / "logs" / name) for name in logs), "--json")
    assert scanned.returncode == 0, scanned.stdout + scanned.stderr
    assert [r["status"] for r in json.loads(scanned.stdout)] == ["converged"] * 3
    again = cli("sweep", "opt.toml")
    assert "already holds every trial" in again.stdout and len(_study(tmp_path).get_trials()) == 3


def test_optuna_sweep_resumes_a_trial_a_killed_sweep_left_running(cli, tmp_path):
    (tmp_path / "opt.toml").write_text(OPTUNA_SPEC.replace("n_trials = 3", "n_trials = 2"))
    planned = cli("sweep", "opt.toml", "--dry-run")
    assert planned.returncode == 0, planned.stderr
    orphan = _study(tmp_path).ask()  # what a local trial process killed mid-run leaves: a RUNNING trial
    orphan.suggest_float("lr", 0.005, 0.05, log=True)
    orphan.suggest_int("ns_steps", 3, 6)
    out = cli("sweep", "opt.toml")
    assert out.returncode == 0, out.stderr
    trials = _study(tmp_path).get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]  # the orphan was finished, one new trial
    records = Catalog(tmp_path / "sweep_catalog.json").records(sweep="opt")
    assert sorted(r["extra"]["trial"] for r in records) == [0, 1]
    assert (tmp_path / "jobs" / "opt" / "logs" / f"trial-{orphan.number}-resume.local.log").stat().st_size > 0
    resumed = next(r for r in records if r["extra"]["trial"] == orphan.number)
    assert resumed["config"]["lr"] == trials[orphan.number].params["lr"]


def test_optuna_trial_that_diverges_is_told_fail(cli, tmp_path):
    spec = OPTUNA_SPEC.replace("n_trials = 3", "n_trials = 1").replace(
        "lr = { type = \"float\", low = 0.005, high = 0.05, log = true }", "lr = { type = \"float\", low = 1e30, high = 1e31 }")
    (tmp_path / "opt.toml").write_text(spec.replace("[base]\n", "[base]\noptimizer = \"adamw\"\nadam_lr = 1e30\ngrad_clip = 1e30\n"))
    out = cli("sweep", "opt.toml")
    assert out.returncode == 0, out.stderr
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records(sweep="opt")
    assert record["verdict"].startswith("diverged"), record["verdict"]
    assert [t.state.name for t in _study(tmp_path).get_trials()] == ["FAIL"]


def test_train_with_catalog_records_its_own_start_and_end(cli, tmp_path):
    (tmp_path / "mini.toml").write_text(SPEC)
    catalog = registered(tmp_path, "mini.toml")
    first = catalog.records(sweep="mini")[0]
    config = tmp_path / "jobs" / "mini" / f"{first['id']}.toml"
    out = cli("train", "--config", str(config), "--catalog", "sweep_catalog.json")
    assert out.returncode == 0, out.stderr
    record = catalog.get(first["id"])
    assert record["state"] == "completed" and record["attempts"] == 1 and record["verdict"] == "converged"
    assert record["summary"]["final_val_loss"] > 0 and record["started_at"] <= record["finished_at"]
    assert catalog.get(catalog.records(sweep="mini")[1]["id"])["state"] == "pending"  # only its own record
    for args, fragment in [
        (("train", "--config", str(config), "--catalog", "sweep_catalog.json", "--steps", "3"), "drop --steps"),
        (("train", "--steps", "3", "--catalog", "sweep_catalog.json"), "pass only --config"),
        (("train", "--config", str(config), "--catalog", "other.json"), "no run " + first["id"]),
    ]:
        bad = cli(*args)
        assert bad.returncode == 2 and fragment in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, (args, bad.stderr)


def test_git_state_names_the_commit_inside_a_checkout_and_none_elsewhere(tmp_path, monkeypatch):
    import subprocess
    import sys

    from fp4lab.lab.repo import git_state

    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parent).stdout.strip()
    monkeypatch.chdir(Path(__file__).parent)
    assert git_state()[0] == head
    monkeypatch.chdir(tmp_path)  # a copy of the tree without .git, as on a machine the tree was sent to
    assert git_state() == (None, None)
    monkeypatch.chdir(Path(__file__).parent)
    monkeypatch.setitem(sys.modules, "git", None)  # gitpython missing: import raises ImportError
    assert git_state() == (None, None)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs Slurm's client tools (scripts/local-slurm.sh installs them)")
def test_a_local_sweep_never_waits_on_slurm(cli, tmp_path, monkeypatch):
    """With Slurm's client tools but no controller (a laptop, a login node whose slurmctld is down),
    `scontrol` retries for about 9 s; a local sweep has no need to ask it anything."""
    (tmp_path / "slurm.conf").write_text(
        "ClusterName=none\nSlurmctldHost=localhost\nSlurmctldPort=6999\nNodeName=localhost CPUs=1\nPartitionName=p Nodes=localhost\n"
    )  # a controller port where nothing listens
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    (tmp_path / "mini.toml").write_text(SPEC)
    started = time.monotonic()
    out = cli("sweep", "mini.toml", "--dry-run")
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert took < 2.0, f"a local dry run took {took:.1f} s: it waited on Slurm"
    catalog = registered(tmp_path, "mini.toml")
    for record in catalog.records(sweep="mini"):  # every run done: the sweep has nothing left to do
        catalog.update(record["id"], state="completed", verdict="converged")
    started = time.monotonic()
    out = cli("sweep", "mini.toml")
    took = time.monotonic() - started
    assert out.returncode == 0, out.stderr
    assert "0 to run" in out.stdout and took < 2.0, f"a no-op local sweep took {took:.1f} s"


def test_after_names_a_sweep_of_the_catalog_and_needs_slurm(cli, tmp_path, monkeypatch):
    (tmp_path / "mini.toml").write_text(SPEC)
    registered(tmp_path, "mini.toml")  # sweep "mini": pending, no job in Slurm's queue
    (tmp_path / "next.toml").write_text(SPEC.replace('name = "mini"', 'name = "next"'))
    before = (tmp_path / "sweep_catalog.json").read_bytes()
    out = cli("sweep", "next.toml", "--after", "mini")
    assert out.returncode == 2 and "--after chains Slurm jobs; add --executor slurm" in out.stderr
    out = cli("sweep", "next.toml", "--executor", "sbatch", "--after", "mnii", "--dry-run")
    assert out.returncode == 2 and "has no sweep of that name (did you mean 'mini'?)" in out.stderr
    assert "\n" not in out.stderr.strip()
    monkeypatch.setenv("PATH", str(tmp_path / "no-slurm"))  # nothing of "mini" is queued: no squeue needed
    out = cli("sweep", "next.toml", "--executor", "sbatch", "--after", "mini", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "after sweep mini: none of its jobs is queued or running; nothing to wait for" in out.stdout
    (tmp_path / "both.toml").write_text(SPEC.replace('name = "mini"', 'name = "both"') + "[slurm.extra]\ndependency = 'afterok:1'\n")
    out = cli("sweep", "both.toml", "--executor", "sbatch", "--after", "mini", "--dry-run")
    assert out.returncode == 2 and "both set the job dependency; keep one" in out.stderr
    assert not (tmp_path / "jobs" / "both").exists()  # refused before anything was written
    assert (tmp_path / "sweep_catalog.json").read_bytes() == before
