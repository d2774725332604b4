"""A search space (a sweep spec's [optuna.search_space], program.md's [search_space]) and how Optuna
samples it: one validator, one suggest, one study, for Optuna sweeps and the ratchet's proposer alike.

    p = search_param("[search_space].lr", {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}, fail)
    study = open_study("name", path, direction="minimize", seed=7, offset=3)
    params = suggest(study.ask(), {"lr": p})
    value = checked_value("lr", proposed, p)     # a value someone else proposed, checked against the space

`fail(where, message)` returns the caller's one-line error (SpecError, ProgramError).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.train.pruning import make_pruner
from fp4lab.validation import Rule, boolean, checked_table, choice, entry, is_int, number

TYPES = ("float", "int", "categorical")
# Seeds of concurrent samplers: seed * SEED_STRIDE + offset (a job's slot, or the trials so far) keeps
# every (seed, offset) pair distinct for offsets below the stride.
SEED_STRIDE = 1_000_003


@dataclass(frozen=True, kw_only=True)
class SearchParam:
    """One parameter: a "float" or "int" range (low, high, log) or "categorical" choices."""

    type: str = entry(choice(TYPES))
    # An int stays an int (the bounds of an "int" parameter), a float a float.
    low: float | int | None = entry(number(as_float=False), None)
    high: float | int | None = entry(number(as_float=False), None)
    log: bool = entry(boolean(), False)
    choices: list[Any] | None = entry(Rule("a list", lambda value: isinstance(value, list), list), None)

    def as_table(self) -> dict[str, Any]:
        """The parameter as its TOML table would give it, without the keys left out."""
        return {key: value for key, value in dataclasses.asdict(self).items() if value is not None}


def search_param(where: str, param: Any, fail) -> SearchParam:
    """One validated parameter of a search space; `where` names it in errors (`optuna.search_space.lr`)."""
    if not isinstance(param, dict):
        raise fail(where, "must be a table {type = \"float\"|\"int\"|\"categorical\", low, high, log, choices}")
    p = checked_table(SearchParam, param, where, fail)
    if p.type == "categorical":
        if not p.choices or p.low is not None or p.high is not None or p.log:
            raise fail(where, "type = \"categorical\" takes choices = [non-empty list] and no low/high/log")
        for i, option in enumerate(p.choices):
            if not isinstance(option, (str, int, float, bool)) or _index(p.choices, option) != i:
                raise fail(f"{where}.choices[{i}]", f"{option!r}: choices are distinct strings, numbers or booleans")
        return p
    if p.choices is not None or p.low is None or p.high is None:
        raise fail(where, f"type = {p.type!r} takes low and high (and optional log), not choices")
    if p.type == "int" and not (is_int(p.low) and is_int(p.high)):
        raise fail(where, f"type = \"int\" needs integer low and high, got {p.low!r}, {p.high!r}")
    if not p.low < p.high:
        raise fail(where, f"low = {p.low} must be below high = {p.high}")
    if p.log and p.low <= 0:
        raise fail(where, f"log = true needs low > 0, got {p.low}")
    return p


def probe_values(p: SearchParam) -> list[Any]:
    """The values a config check should try: every choice, or both bounds."""
    return list(p.choices) if p.type == "categorical" else [p.low, p.high]


def checked_value(name: str, value: Any, p: SearchParam) -> Any:
    """`value` if it lies in the space (as the space's own choice, or a float for a float parameter);
    ValueError naming `name` otherwise."""
    if p.type == "categorical":
        i = _index(p.choices, value)
        if i is None:
            raise ValueError(f"{name}: {value!r} is not one of the choices {p.choices!r}")
        return p.choices[i]
    integral = is_int(value)
    if p.type == "int" and not integral:
        raise ValueError(f"{name}: {value!r} must be an integer")
    if p.type == "float" and not (integral or isinstance(value, float)):
        raise ValueError(f"{name}: {value!r} must be a number")
    if not (math.isfinite(value) and p.low <= value <= p.high):
        raise ValueError(f"{name}: {value!r} is outside [{p.low}, {p.high}]")
    return float(value) if p.type == "float" else value


def suggest(trial, space: dict[str, SearchParam]) -> dict[str, Any]:
    """One value per parameter from an Optuna trial."""
    params = {}
    for name, p in space.items():
        if p.type == "categorical":
            params[name] = trial.suggest_categorical(name, p.choices)
        elif p.type == "int":
            params[name] = trial.suggest_int(name, int(p.low), int(p.high), log=p.log)
        else:
            params[name] = trial.suggest_float(name, float(p.low), float(p.high), log=p.log)
    return params


def sampler(seed: int, offset: int = 0):
    """The TPE sampler of one process: `offset` (a job's slot, or the trials already asked) keeps
    concurrent and successive processes from replaying each other's start-up points."""
    import optuna

    return optuna.samplers.TPESampler(seed=seed * SEED_STRIDE + offset)


def open_study(name: str, journal: str | Path, *, direction: str, seed: int, offset: int = 0,
               pruner: dict[str, Any] | None = None):
    """The study `name` in an Optuna journal file (created if new), which processes on many machines
    sharing a filesystem open at once; Optuna's journal lock keeps their ask/tell consistent. `pruner`:
    full settings (fp4lab.train.pruning.pruner_settings); None never prunes."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    Path(journal).parent.mkdir(parents=True, exist_ok=True)
    return optuna.create_study(study_name=name, storage=JournalStorage(JournalFileBackend(str(journal))),
                               sampler=sampler(seed, offset), direction=direction, load_if_exists=True,
                               pruner=make_pruner(pruner or {"type": "none"}))


def _index(choices: list[Any], value: Any) -> int | None:
    """Where `value` is among `choices`, matching kinds too (1 == True == 1.0 in Python, not here)."""
    for i, option in enumerate(choices):
        if value == option and isinstance(value, bool) == isinstance(option, bool) and isinstance(value, str) == isinstance(option, str):
            return i
    return None
