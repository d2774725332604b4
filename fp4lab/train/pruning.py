"""Early stopping of Optuna trials: the pruner a sweep spec or ratchet program names, and the link through
which a training process reports its validation loss to its trial at each eval and asks whether to stop.

    pruner = "median"                                            # or "hyperband", "none" (the default)
    pruner = {type = "median", n_startup_trials = 5, n_warmup_steps = 20}
    pruner = {type = "hyperband", min_resource = 10, reduction_factor = 3}

The study lives in a journal file that many processes share (fp4lab.lab.specs.search_space.open_study);
Optuna keeps no pruner there, so each process that asks builds it from the same settings. The run config
carries them with the trial (`optuna_trial`, result-neutral), so a local worker, a Slurm array task and
the ratchet's training subprocess all ask the same question of the same journal. Steps are counted as
training steps done (an eval after step 19 of 0..39 reports step 20), so `n_warmup_steps` and Hyperband's
resources are in training steps.

Torch-free; Optuna is imported only when a trial is opened.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from fp4lab.validation import Fail, choice, integer, is_int, known_keys

PRUNERS = ("none", "median", "hyperband")
# Each pruner's settings and their defaults (Optuna's own defaults).
PRUNER_SETTINGS: dict[str, dict[str, Any]] = {
    "none": {},
    "median": {"n_startup_trials": 5, "n_warmup_steps": 0, "interval_steps": 1},
    "hyperband": {"min_resource": 1, "max_resource": "auto", "reduction_factor": 3},
}
_MINIMUM = {"n_startup_trials": 0, "n_warmup_steps": 0, "interval_steps": 1, "min_resource": 1, "max_resource": 1,
            "reduction_factor": 2}
PRUNER_WANTS = ('"median", "hyperband", "none", or a table {type = "median", n_startup_trials, n_warmup_steps, '
                'interval_steps} / {type = "hyperband", min_resource, max_resource, reduction_factor}')
TRIAL_KEYS = ("storage", "study", "trial", "pruner")


def pruner_settings(value: Any, where: str, fail: Fail) -> dict[str, Any]:
    """A pruner as written (a name or a table) -> its full settings {"type": ..., setting: value}, each
    setting given or its default; fail(where, message) names the place of a mistake."""
    named = isinstance(value, str)
    if named:
        value = {"type": value}
    if not isinstance(value, dict):
        raise fail(where, f"{value!r}: must be {PRUNER_WANTS}")
    kind = choice(PRUNERS).check(where if named or "type" not in value else f"{where}.type", value.get("type"), fail)
    defaults = PRUNER_SETTINGS[kind]
    known_keys(value, ("type", *defaults), where, fail)
    settings = {"type": kind} | defaults
    for key, given in value.items():
        if key != "type" and not (key == "max_resource" and given == "auto"):
            rule = integer(minimum=_MINIMUM[key])
            if key == "max_resource":
                rule = rule.hinted('or "auto": the steps of the first trial to finish')
            settings[key] = rule.check(f"{where}.{key}", given, fail)
    if kind == "hyperband" and is_int(settings["max_resource"]) and settings["max_resource"] < settings["min_resource"]:
        raise fail(f"{where}.max_resource", f"{settings['max_resource']} must be at least min_resource = {settings['min_resource']}")
    return settings


# The summary keys a pruner may stand in for: it judges a trial by the validation losses it reports.
PRUNABLE_OBJECTIVES = ("final_val_loss", "best_val_loss")


def pruning_problem(objective: str | None, direction: str) -> str | None:
    """Why a pruner cannot serve this objective (None when it can): pruners compare the validation
    losses trials report at each eval, so the objective must be one, minimized."""
    if objective is None:
        return "a pruner compares the validation losses fp4lab runs report at each eval; a command run reports none"
    if objective not in PRUNABLE_OBJECTIVES:
        return (f"a pruner compares the validation losses trials report at each eval, and the objective {objective!r} "
                f"is not one; use {' or '.join(PRUNABLE_OBJECTIVES)}")
    if direction != "minimize":
        return f"a pruner stops trials whose validation loss is high; direction = {direction!r} must be \"minimize\""
    return None


def make_pruner(settings: dict[str, Any]):
    """The Optuna pruner of full settings (pruner_settings' result)."""
    import optuna

    options = {key: value for key, value in settings.items() if key != "type"}
    if settings["type"] == "median":
        return optuna.pruners.MedianPruner(**options)
    if settings["type"] == "hyperband":
        return optuna.pruners.HyperbandPruner(**options)
    return optuna.pruners.NopPruner()


def check_trial_link(link: Any, fail: Fail, where: str = "optuna_trial") -> dict[str, Any]:
    """A run config's `optuna_trial`: {storage = journal file, study = name, trial = number, pruner = ...}."""
    if not isinstance(link, dict):
        raise fail(where, "must be a table {storage, study, trial, pruner} (an Optuna sweep or the ratchet writes it)")
    known_keys(link, TRIAL_KEYS, where, fail)
    for key in TRIAL_KEYS:
        if key not in link:
            raise fail(f"{where}.{key}", "is missing")
    for key in ("storage", "study"):
        if not isinstance(link[key], str) or not link[key] or not link[key].isprintable():
            raise fail(f"{where}.{key}", f"{link[key]!r} must be a non-empty string")
    integer(minimum=0).check(f"{where}.trial", link["trial"], fail)
    return {**link, "pruner": pruner_settings(link["pruner"], f"{where}.pruner", fail)}


class TrialReporter:
    """One training process's line to its Optuna trial: `should_stop(step, val_loss)` reports the value
    (once per step: a resumed run does not report a step twice) and asks the pruner.

    A journal that is gone or a trial that has already finished (a run trained again by hand from its
    config) is said once on stderr; the run then trains to its end, as without a pruner."""

    def __init__(self, link: dict[str, Any]):
        self.link, self.trial = link, None
        where = f"Optuna trial {link['trial']} of study {link['study']!r} ({link['storage']})"
        if not Path(link["storage"]).exists():
            self._say(f"{where}: the journal file is not there; training without early stopping")
            return
        import optuna
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend
        from optuna.trial import TrialState

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        storage = JournalStorage(JournalFileBackend(link["storage"]))
        try:
            study = optuna.load_study(study_name=link["study"], storage=storage, pruner=make_pruner(link["pruner"]))
            trial_id = storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(link["study"]), link["trial"])
        except KeyError:
            self._say(f"{where}: no such study or trial in the journal; training without early stopping")
            return
        state = storage.get_trial(trial_id).state
        if state != TrialState.RUNNING:
            self._say(f"{where} is {state.name}, not running; training without early stopping")
            return
        self.trial, self._storage, self._trial_id = optuna.trial.Trial(study, trial_id), storage, trial_id

    def should_stop(self, step: int, value: float) -> bool:
        """Report `value` at `step` (unless reported before) and whether the pruner stops the trial here."""
        if self.trial is None:
            return False
        if step not in self._storage.get_trial(self._trial_id).intermediate_values:
            self.trial.report(value, step)
        return self.trial.should_prune()

    @staticmethod
    def _say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
