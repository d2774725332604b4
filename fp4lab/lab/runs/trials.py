"""Optuna sweeps (`method = "optuna"`): every job asks the study for a trial, trains it, and tells the result.

There is no central controller: the study lives in a JournalFileBackend file (default
jobs/<sweep>/optuna.journal) that many processes, on one machine or many Slurm nodes sharing a
filesystem, open at once; Optuna's journal lock keeps concurrent ask/tell consistent. One trial:

1. open the study (TPE, seeded with the spec's `seed` and the job's slot, so concurrent jobs draw
   different start-up points and the same sweep proposes the same points again);
2. a requeued Slurm task finds the RUNNING trial it started before (user attribute `task` = its
   array job/task id) and continues it; otherwise it asks a new trial;
3. the trial's parameters become a run like any grid run (`make_run`: same id rule, config written to
   jobs/<sweep>/<id>.toml, one catalog record with `extra.trial`), trained by `train_recorded`, which
   resumes from the run's checkpoint when there is one; a run already completed is not trained again;
4. while it trains, the run reports its validation loss to the trial at each eval (its config's
   `optuna_trial`) and stops when [optuna].pruner says so (fp4lab.train.pruning): recorded `pruned`,
   told PRUNED;
5. the objective (a summary.json key, [optuna].objective) is told; a run that failed, diverged or has
   no finite objective is told FAIL; a run stopped by a signal is told nothing (it resumes later).

`fp4lab trial SPEC` does one trial; `fp4lab sweep` runs `n_trials` of them locally (`--workers` at a
time, resuming trials a killed sweep left RUNNING first) or as a Slurm array (SBATCH or submitit).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from fp4lab.lab.records.catalog import Catalog
from fp4lab.lab.repo import git_state
from fp4lab.lab.runs import slurm
from fp4lab.lab.runs.job import hand_back_preemption, train_recorded
from fp4lab.lab.runs.sbatch import config_toml
from fp4lab.lab.specs import search_space
from fp4lab.lab.specs.sweep_spec import SpecError, SweepSpec, load_spec, make_run
from fp4lab.train.atomic import write_atomic
from fp4lab.train.config import summary_value


def open_study(spec: SweepSpec, jobs_dir: str | Path, slot: int = 0):
    """The sweep's study, with this job's sampler (seeded by the spec's seed and the job's slot)."""
    return search_space.open_study(spec.name, spec.optuna_storage(jobs_dir), direction=spec.optuna.direction,
                                   seed=spec.seed, offset=slot, pruner=spec.optuna.pruner)


def trial_counts(spec: SweepSpec, jobs_dir: str | Path) -> dict[str, int]:
    """How many trials the study holds in each state (COMPLETE, FAIL, RUNNING, ...)."""
    if not Path(spec.optuna_storage(jobs_dir)).exists():
        return {}
    counts: dict[str, int] = {}
    for trial in open_study(spec, jobs_dir).get_trials(deepcopy=False):
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return counts


def orphaned_trials(spec: SweepSpec, jobs_dir: str | Path) -> list[int]:
    """RUNNING trials started outside Slurm: left by a local sweep that was killed; resumable."""
    if not Path(spec.optuna_storage(jobs_dir)).exists():
        return []
    from optuna.trial import TrialState

    trials = open_study(spec, jobs_dir).get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    return [t.number for t in trials if t.user_attrs.get("task") is None]


def run_trial(spec_path: str | Path, *, jobs_dir: str | Path, catalog_path: str | Path, slot: int = 0,
              resume: int | None = None, executor: str = "local") -> dict[str, Any]:
    """Ask (or resume) one trial, train it, tell its objective; return its catalog record."""
    from optuna.trial import TrialState

    spec = load_spec(spec_path)
    if spec.method != "optuna":
        raise SpecError(f"{spec_path}: method = {spec.method!r}; `fp4lab trial` runs trials of method = \"optuna\" sweeps")
    study = open_study(spec, jobs_dir, slot)
    task = slurm.task_key()
    number, params = _resumable(study, task, resume)
    if number is None:
        trial = study.ask()
        params = search_space.suggest(trial, spec.optuna.search_space)
        number = trial.number
        if task is not None:
            trial.set_user_attr("task", task)
    try:
        run = make_run(spec, params)
    except SpecError:
        study.tell(number, state=TrialState.FAIL)
        raise
    run.config["optuna_trial"] = {"storage": spec.optuna_storage(jobs_dir), "study": spec.name, "trial": number,
                                  "pruner": spec.optuna.pruner}
    catalog = Catalog(catalog_path)
    sweep_dir = spec.sweep_dir(jobs_dir)
    config_path = sweep_dir / f"{run.id}.toml"
    write_atomic(config_path, config_toml(run, spec))
    _write_manifest(spec, sweep_dir)
    with catalog.transaction() as tx:
        if tx.get(run.id) is None:
            commit, dirty = git_state()
            tx.upsert({"id": run.id, "sweep": spec.name, "config": run.config, "recipe": run.config["recipe"],
                       "git_commit": commit, "git_dirty": dirty, "executor": executor,
                       "paths": {"run_dir": catalog.relative(run.config["out_dir"])},
                       "extra": {"name": run.name, "params": run.params, "trial": number}})
    if catalog.get(run.id)["state"] not in ("completed", "pruned"):
        train_recorded(config_path, catalog, progress=False)
    record = catalog.get(run.id)
    if record["state"] in ("preempted", "interrupted", "running"):
        return record  # stopped by a signal or Ctrl-C: the trial stays RUNNING and resumes with its job
    value = _objective(run.config["out_dir"], spec.optuna.objective)
    if record["state"] == "pruned":
        study.tell(number, state=TrialState.PRUNED)  # Optuna keeps its last reported value
    elif record["state"] == "completed" and not str(record["verdict"]).startswith("diverged") and value is not None:
        study.tell(number, value)
    else:
        study.tell(number, state=TrialState.FAIL)
    return catalog.update(run.id, extra={"trial": number, "objective": value})


def _resumable(study, task: str | None, resume: int | None) -> tuple[int | None, dict[str, Any]]:
    from optuna.trial import TrialState

    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if (resume is not None and trial.number == resume) or (task is not None and trial.user_attrs.get("task") == task):
            return trial.number, dict(trial.params)
    return None, {}


def _objective(out_dir: str, key: str) -> float | None:
    path = Path(out_dir) / "summary.json"
    if not path.exists():
        return None
    value = summary_value(json.loads(path.read_text()), key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _write_manifest(spec: SweepSpec, sweep_dir: Path) -> None:
    """The [scan] thresholds the job-side scanner reads (grid sweeps get them from write_scripts)."""
    path = sweep_dir / "manifest.json"
    if not path.exists():
        write_atomic(path, json.dumps({"sweep": spec.name, "spec": str(spec.path), "method": spec.method,
                                        "scan": spec.scan}, indent=1) + "\n")


class TrialTask:
    """A submitit callable for one array task of an optuna sweep (see job.SweepTask for the requeue
    path: the requeued task resumes the same trial by its Slurm task key)."""

    def __init__(self, spec_path: str | Path, jobs_dir: str | Path, catalog_path: str | Path) -> None:
        self.spec_path, self.jobs_dir, self.catalog_path = Path(spec_path), Path(jobs_dir), Path(catalog_path)

    def __call__(self, slot: int) -> dict[str, Any]:
        record = run_trial(self.spec_path, jobs_dir=self.jobs_dir, catalog_path=self.catalog_path, slot=slot, executor="slurm")
        summary_path = Catalog(self.catalog_path).resolve(record["paths"]["run_dir"]) / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        hand_back_preemption(summary, Catalog(self.catalog_path), record["id"])
        return record

    def checkpoint(self, slot: int):
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, slot)
