"""Early stopping of Optuna trials: pruner settings, the training loop's report-and-ask at each eval, a
pruned run in the catalog, Optuna sweeps and the ratchet's Optuna proposer."""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path

import pytest

from fp4lab.lab.records.catalog import Catalog
from fp4lab.train.pruning import pruner_settings

RUN = dict(model="tiny", steps=9, batch_size=2, seq_len=16, warmup_steps=1, eval_every=3, eval_batches=1,
           probe_every=3, checkpoint_every=3, device="cpu", data={"source": "synthetic"})


def _fail(place, message):
    return ValueError(f"{place}: {message}")


@pytest.mark.parametrize("written, settings", [
    ("none", {"type": "none"}),
    ("median", {"type": "median", "n_startup_trials": 5, "n_warmup_steps": 0, "interval_steps": 1}),
    ({"type": "median", "n_warmup_steps": 20}, {"type": "median", "n_startup_trials": 5, "n_warmup_steps": 20, "interval_steps": 1}),
    ("hyperband", {"type": "hyperband", "min_resource": 1, "max_resource": "auto", "reduction_factor": 3}),
    ({"type": "hyperband", "min_resource": 10, "max_resource": 40}, {"type": "hyperband", "min_resource": 10, "max_resource": 40, "reduction_factor": 3}),
])
def test_pruner_settings_as_written(written, settings):
    assert pruner_settings(written, "optuna.pruner", _fail) == settings


@pytest.mark.parametrize("written, message", [
    ("mean", "optuna.pruner: 'mean' is not supported (did you mean 'median'?); allowed: none, median, hyperband"),
    ({"type": "median", "min_resource": 3}, "optuna.pruner.min_resource: unknown key"),
    ({"n_warmup_steps": 3}, "optuna.pruner: None is not supported"),
    ({"type": "median", "n_warmup_steps": -1}, "optuna.pruner.n_warmup_steps: -1 must be an integer >= 0"),
    ({"type": "hyperband", "max_resource": "all"}, 'optuna.pruner.max_resource: \'all\' must be an integer >= 1 (or "auto"'),
    ({"type": "hyperband", "min_resource": 10, "max_resource": 5}, "optuna.pruner.max_resource: 5 must be at least min_resource = 10"),
    (3, "optuna.pruner: 3: must be \"median\""),
])
def test_a_wrong_pruner_is_one_line_naming_the_key(written, message):
    with pytest.raises(ValueError) as error:
        pruner_settings(written, "optuna.pruner", _fail)
    assert str(error.value).startswith(message) and "\n" not in str(error.value), str(error.value)


SPEC = """
name = "prune"
method = "optuna"
seed = 3
[base]
model = "tiny"
optimizer = "muon"
steps = 20
batch_size = 4
seq_len = 32
warmup_steps = 2
eval_every = 5
eval_batches = 2
probe_every = 10
checkpoint_every = 5
device = "cpu"
[base.data]
source = "synthetic"
[optuna]
n_trials = 6
objective = "final_val_loss"
pruner = {type = "median", n_startup_trials = 1}
[optuna.search_space]
lr = { type = "float", low = 0.003, high = 0.12, log = true }
"""


def test_a_spec_takes_a_pruner_and_refuses_one_it_cannot_serve(tmp_path):
    from fp4lab.lab.specs.sweep_spec import SpecError, load_spec

    (tmp_path / "s.toml").write_text(SPEC)
    assert load_spec(tmp_path / "s.toml").optuna.pruner == {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0, "interval_steps": 1}
    (tmp_path / "s.toml").write_text(SPEC.replace("pruner = {type = \"median\", n_startup_trials = 1}\n", ""))
    assert load_spec(tmp_path / "s.toml").optuna.pruner == {"type": "none"}
    for change, message in [
        (("objective = \"final_val_loss\"", "objective = \"tokens_per_s\"\ndirection = \"maximize\""), "the objective 'tokens_per_s' is not one"),
        (("pruner = {type = \"median\", n_startup_trials = 1}", "pruner = \"successive\""), "optuna.pruner: 'successive' is not supported"),
        (("n_startup_trials = 1", "n_startup = 1"), "optuna.pruner.n_startup: unknown key"),
    ]:
        (tmp_path / "s.toml").write_text(SPEC.replace(*change))
        with pytest.raises(SpecError) as error:
            load_spec(tmp_path / "s.toml")
        assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_a_ratchet_program_takes_a_pruner_for_validation_losses_only(tmp_path):
    from fp4lab.lab.specs.program import ProgramError, parse_program

    program = PROGRAM.format(pruner='pruner = {type = "median", n_warmup_steps = 3}')
    assert parse_program(program).pruner == {"type": "median", "n_startup_trials": 5, "n_warmup_steps": 3, "interval_steps": 1}
    assert parse_program(PROGRAM.format(pruner="")).pruner == {"type": "none"}
    with pytest.raises(ProgramError, match="pruner: a pruner compares the validation losses.*'tokens_per_s' is not one"):
        parse_program(program.replace('metric = "val_loss"', 'metric = "tokens_per_s"').replace("minimize", "maximize"))
    command = program.split("[run]")[0] + '[run]\nkind = "command"\ncommand = ["python", "bench.py"]\nmetric_regex = "ms (\\\\S+)"\ntimeout_minutes = 1\n```\n'
    with pytest.raises(ProgramError, match="pruner: .*a command run reports none .or leave pruner out.$"):
        parse_program(command)


def test_the_trial_link_is_checked_and_changes_no_run_id():
    from fp4lab.lab.specs.sweep_spec import run_id
    from fp4lab.train.config import ConfigError, TrainConfig

    link = {"storage": "jobs/s/optuna.journal", "study": "s", "trial": 4, "pruner": "median"}
    linked = TrainConfig(**RUN, optuna_trial=link)
    assert linked.optuna_trial["pruner"]["type"] == "median" and linked.optuna_trial["trial"] == 4
    assert run_id(linked.to_dict()) == run_id(TrainConfig(**RUN).to_dict())
    with pytest.raises(ConfigError, match=r"optuna_trial.trial: -1 must be an integer >= 0"):
        TrainConfig(**RUN, optuna_trial=link | {"trial": -1})
    with pytest.raises(ConfigError, match=r"optuna_trial.study: is missing"):
        TrainConfig(**RUN, optuna_trial={k: v for k, v in link.items() if k != "study"})


def _study_with_a_finished_trial(journal: Path, name: str, loss: float, steps=(3, 6, 9), pruner=None):
    """A study whose one finished trial reported `loss` at every eval, and a new RUNNING trial's number."""
    import optuna

    from fp4lab.lab.specs.search_space import open_study

    study = open_study(name, journal, direction="minimize", seed=0, pruner=pruner)
    study.add_trial(optuna.trial.create_trial(value=loss, intermediate_values=dict.fromkeys(steps, loss)))
    return study, study.ask().number


def _train(tmp_path, link, **changes):
    from fp4lab.train.config import TrainConfig
    from fp4lab.train.loop import run

    return run(TrainConfig(**(RUN | {"out_dir": str(tmp_path / "run"), "optuna_trial": link} | changes)), progress=False)


def test_a_run_reports_each_eval_and_stops_cleanly_when_its_pruner_says(tmp_path, one_thread):
    median = {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0, "interval_steps": 1}
    study, number = _study_with_a_finished_trial(tmp_path / "j.journal", "s", 0.0, pruner=median)
    link = {"storage": str(tmp_path / "j.journal"), "study": "s", "trial": number, "pruner": median}
    summary = _train(tmp_path, link)
    assert summary["status"] == "pruned" and summary["steps_completed"] == 3  # stopped at its first eval
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2]
    [trial] = [t for t in study.get_trials() if t.number == number]
    assert trial.intermediate_values == {3: metrics[-1]["val_loss"]} and trial.state.name == "RUNNING"
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "pruned"
    import torch

    assert torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)["state"]["step"] == 3  # checkpointed where it stopped


def test_a_run_its_pruner_keeps_trains_to_the_end_and_reports_every_eval_once_across_a_resume(tmp_path, one_thread):
    import shutil
    import warnings

    from fp4lab.train.config import TrainConfig
    from fp4lab.train.loop import run

    median = {"type": "median", "n_startup_trials": 1, "n_warmup_steps": 0, "interval_steps": 1}
    study, number = _study_with_a_finished_trial(tmp_path / "j.journal", "s", 1e9, pruner=median)
    link = {"storage": str(tmp_path / "j.journal"), "study": "s", "trial": number, "pruner": median}
    config = TrainConfig(**(RUN | {"out_dir": str(tmp_path / "run"), "optuna_trial": link}))
    assert run(config, progress=False, stop_after=4)["status"] == "stopped"  # step 3's eval reported, checkpoint at 4
    shutil.copytree(tmp_path / "run", tmp_path / "at-4")
    run(config, progress=False, stop_after=3)  # step 6's eval reported; then, as if killed before checkpointing
    first_report = study.get_trials()[number].intermediate_values[6]
    shutil.rmtree(tmp_path / "run")
    shutil.move(tmp_path / "at-4", tmp_path / "run")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert run(config, progress=False)["status"] == "completed"  # replays steps 4-5 and evaluates step 6 again
    assert not [w for w in said if "already reported" in str(w.message)]  # Optuna's warning on a second report
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {m["step"] + 1: m["val_loss"] for m in metrics if "val_loss" in m}
    [trial] = [t for t in study.get_trials() if t.number == number]
    assert trial.intermediate_values == evals and sorted(evals) == [3, 6, 9] and evals[6] == first_report


def test_a_run_whose_trial_is_gone_or_finished_says_so_and_trains_to_the_end(tmp_path, one_thread, capfd):
    link = {"storage": str(tmp_path / "missing.journal"), "study": "s", "trial": 0, "pruner": "median"}
    assert _train(tmp_path, link)["status"] == "completed"
    assert "the journal file is not there; training without early stopping" in capfd.readouterr().err
    assert not (tmp_path / "missing.journal").exists()
    study, number = _study_with_a_finished_trial(tmp_path / "j.journal", "s", 0.0)
    study.tell(number, 1.0)
    link = {"storage": str(tmp_path / "j.journal"), "study": "s", "trial": number, "pruner": "median"}
    assert _train(tmp_path, link, out_dir=str(tmp_path / "again"))["status"] == "completed"
    assert f"Optuna trial {number} of study 's'" in capfd.readouterr().err


@pytest.fixture
def cli(run_cli, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    return run_cli


def test_an_optuna_sweep_prunes_trials_records_them_pruned_and_never_runs_them_again(cli, tmp_path):
    import optuna

    (tmp_path / "prune.toml").write_text(SPEC)
    out = cli("sweep", "prune.toml")
    assert out.returncode == 0, out.stderr
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend("jobs/prune/optuna.journal"))
    trials = {t.number: t for t in optuna.load_study(study_name="prune", storage=storage).get_trials()}
    records = {r["extra"]["trial"]: r for r in Catalog(tmp_path / "sweep_catalog.json").records(sweep="prune")}
    assert sorted(records) == sorted(trials) == list(range(6))
    pruned = [n for n, t in trials.items() if t.state.name == "PRUNED"]
    assert pruned, {n: (t.state.name, t.params) for n, t in trials.items()}
    for n, trial in trials.items():
        record = records[n]
        assert record["state"] == {"PRUNED": "pruned", "COMPLETE": "completed"}[trial.state.name], (record, trial)
        evals = {m["step"] + 1: m["val_loss"] for m in map(json.loads, Path(record["paths"]["run_dir"], "metrics.jsonl").read_text().splitlines()) if "val_loss" in m}
        assert trial.intermediate_values == evals  # every eval reported, once
        if trial.state.name == "PRUNED":
            step = record["summary"]["steps_completed"]
            assert step < 20 and max(evals) == step
            # the median rule held: worse than the median of the trials finished before, at that step
            earlier = [t.intermediate_values[step] for t in trials.values()
                       if t.state.name == "COMPLETE" and t.datetime_complete < trial.datetime_complete]
            assert evals[step] > statistics.median(earlier)
    status = cli("status", "prune")
    assert status.returncode == 0 and status.stdout.count("pruned") >= len(pruned), status.stdout
    again = cli("sweep", "prune.toml")
    assert "already holds every trial" in again.stdout and "complete" in again.stdout and "pruned" in again.stdout
    assert {r["extra"]["trial"]: r["attempts"] for r in Catalog(tmp_path / "sweep_catalog.json").records(sweep="prune")} == \
        {n: r["attempts"] for n, r in records.items()}


def test_a_pruned_run_is_not_started_again_even_when_retrying_failed_runs(tmp_path):
    from fp4lab.lab.runs.sweep import needed_runs, plan_sweep, register_runs

    (tmp_path / "grid.toml").write_text('name = "grid"\n[base]\nmodel = "tiny"\nsteps = 4\n[base.data]\nsource = "synthetic"\n[axes]\nlr = [0.01, 0.02]\n')
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    plan = plan_sweep(tmp_path / "grid.toml", tmp_path / "jobs", catalog.path, ask_slurm=False)
    register_runs(plan, catalog, "local")
    catalog.update(plan.runs[0].id, state="pruned")
    todo, skipped = needed_runs(plan, catalog, retry_failed=True)
    assert [r.id for r in todo] == [plan.runs[1].id] and [r.id for r in skipped["pruned"]] == [plan.runs[0].id]


PROGRAM = textwrap.dedent("""
    Lowest validation loss of the tiny model.

    ```toml ratchet
    metric = "val_loss"
    direction = "minimize"
    {pruner}
    [run]
    kind = "fp4lab"
    steps = 9
    base = {{ model = "tiny", batch_size = 2, seq_len = 16, warmup_steps = 1, eval_every = 3, eval_batches = 1, probe_every = 3, checkpoint_every = 3, device = "cpu", data = {{ source = "synthetic" }} }}
    [search_space]
    lr = {{ type = "float", low = 0.005, high = 0.05, log = true }}
    [noise]
    seeds = 2
    rule = "paired"
    ```
""")


def test_the_ratchets_optuna_proposer_prunes_a_trial_and_records_it(tmp_path, one_thread):
    from fp4lab.lab.ratchet.loop import Ratchet
    from fp4lab.lab.ratchet.proposers import make_proposer
    from fp4lab.lab.specs.program import load_program
    from tests.lab.test_ratchet import git, make_repo

    repo = make_repo(tmp_path)
    (repo / "train.md").write_text(PROGRAM.format(pruner='pruner = {type = "median", n_startup_trials = 1}'))
    git(repo, "add", "train.md")
    git(repo, "commit", "-q", "-m", "training program")
    program = load_program(repo / "train.md")
    # A finished trial that reported a loss no run reaches: the next proposal is worse than its median.
    proposer = make_proposer("optuna", program, state_dir=repo / ".fp4lab" / "ratchet" / "pr")
    import optuna

    proposer.study.add_trial(optuna.trial.create_trial(params={"lr": 0.01}, distributions={"lr": optuna.distributions.FloatDistribution(0.005, 0.05, log=True)},
                                                      value=0.0, intermediate_values={3: 0.0, 6: 0.0, 9: 0.0}))
    Ratchet(program, tag="pr", catalog=repo / "sweep_catalog.json").run(iterations=1)
    records = Catalog(repo / "sweep_catalog.json").records(sweep="ratchet/pr")
    baseline, proposal = (r for r in records)
    assert baseline["extra"]["decision"] == "baseline" and baseline["state"] == "completed"
    assert proposal["extra"]["decision"] == "pruned" and proposal["state"] == "pruned", proposal["extra"]
    assert "pruned after 3 steps by the median pruner" in proposal["extra"]["reason"]
    runs = repo / ".fp4lab" / "ratchet" / "pr" / "runs"
    assert json.loads((runs / "iter-0001-s0" / "summary.json").read_text())["status"] == "pruned"
    assert not (runs / "iter-0001-s1").exists()  # the trial is over: its second seed never ran
    trial = proposer.study.get_trials()[proposal["extra"]["proposal"]["trial"]]
    assert trial.state.name == "PRUNED" and list(trial.intermediate_values) == [3]
    assert (runs / "iter-0000-s1" / "summary.json").exists()  # the baseline is no trial: both seeds, never pruned


def test_a_trial_stopped_by_ctrl_c_stays_running_and_is_resumed_not_failed(tmp_path):
    """Ctrl-C on an Optuna sweep: the trial in progress checkpoints, is recorded interrupted and stays
    RUNNING in the study, so the next sweep resumes it (it was told FAIL, and never resumed, before)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "s.toml").write_text(SPEC.replace("steps = 20", "steps = 5000").replace("n_trials = 6", "n_trials = 1"))
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    sweep = subprocess.Popen([sys.executable, "-m", "fp4lab.cli", "sweep", "s.toml"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not any(p.stat().st_size for p in tmp_path.glob("runs/prune/*/metrics.jsonl")):
        assert time.monotonic() < deadline and sweep.poll() is None, sweep.communicate()
        time.sleep(0.2)
    os.killpg(sweep.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole process group
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, err
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records(sweep="prune")
    assert record["state"] == "interrupted"
    from fp4lab.lab.runs.trials import orphaned_trials, trial_counts
    from fp4lab.lab.specs.sweep_spec import load_spec

    spec = load_spec(tmp_path / "s.toml")
    assert trial_counts(spec, tmp_path / "jobs") == {"RUNNING": 1}
    assert orphaned_trials(spec, tmp_path / "jobs") == [record["extra"]["trial"]]  # the next sweep resumes it
