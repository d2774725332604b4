"""A search space (a sweep spec's [optuna.search_space], program.md's [search_space]) and how Optuna
samples it: one validator, one suggest, one study, for Optuna sweeps and the ratchet's proposer alike.

    p = search_param("[search_space].lr", {"type": "float", "low": 1e-3, "high": 1e-1, "log": True}, fail)
    study = open_study("name", path, direction="minimize", seed=7, offset=3)
    params = suggest(study.ask(), {"lr": p})
    value = checked_value("lr", proposed, p)     # a value someone else proposed, checked against the space

`fail(where, message)` returns the caller's one-line error (SpecError, ProgramError).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from fp4lab.validation import is_int, known_keys

TYPES = ("float", "int", "categorical")
# Seeds of concurrent samplers: seed * SEED_STRIDE + offset (a job's slot, or the trials so far) keeps
# every (seed, offset) pair distinct for offsets below the stride.
SEED_STRIDE = 1_000_003


class SearchParam(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["float", "int", "categorical"]
    low: float | int | None = None
    high: float | int | None = None
    log: bool = False
    choices: list[Any] | None = None


def search_param(where: str, param: Any, fail) -> SearchParam:
    """One validated parameter of a search space; `where` names it in errors (`optuna.search_space.lr`)."""
    if not isinstance(param, dict):
        raise fail(where, "must be a table {type = \"float\"|\"int\"|\"categorical\", low, high, log, choices}")
    known_keys(param, SearchParam.model_fields, where, fail)
    if "type" not in param:
        raise fail(f"{where}.type", "missing; add type = \"float\", \"int\" or \"categorical\"")
    if param["type"] not in TYPES:
        raise fail(f"{where}.type", f"{param['type']!r} is not supported; allowed: {', '.join(TYPES)}")
    try:
        p = SearchParam.model_validate(param)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise fail(f"{where}.{error['loc'][0]}", f"{error.get('input')!r}: {error['msg'].lower()}") from None
    if p.type == "categorical":
        if not p.choices or p.low is not None or p.high is not None or p.log:
            raise fail(where, "type = \"categorical\" takes choices = [non-empty list] and no low/high/log")
        for i, choice in enumerate(p.choices):
            if not isinstance(choice, (str, int, float, bool)) or _index(p.choices, choice) != i:
                raise fail(f"{where}.choices[{i}]", f"{choice!r}: choices are distinct strings, numbers or booleans")
        return p
    if p.choices is not None or p.low is None or p.high is None:
        raise fail(where, f"type = {p.type!r} takes low and high (and optional log), not choices")
    if p.type == "int" and not (is_int(p.low) and is_int(p.high)):
        raise fail(where, f"type = \"int\" needs integer low and high, got {p.low!r}, {p.high!r}")
    if not (math.isfinite(p.low) and math.isfinite(p.high) and p.low < p.high):
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


def open_study(name: str, journal: str | Path, *, direction: str, seed: int, offset: int = 0):
    """The study `name` in an Optuna journal file (created if new), which processes on many machines
    sharing a filesystem open at once; Optuna's journal lock keeps their ask/tell consistent."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    Path(journal).parent.mkdir(parents=True, exist_ok=True)
    return optuna.create_study(study_name=name, storage=JournalStorage(JournalFileBackend(str(journal))),
                               sampler=sampler(seed, offset), direction=direction, load_if_exists=True)


def _index(choices: list[Any], value: Any) -> int | None:
    """Where `value` is among `choices`, matching kinds too (1 == True == 1.0 in Python, not here)."""
    for i, choice in enumerate(choices):
        if value == choice and isinstance(value, bool) == isinstance(choice, bool) and isinstance(value, str) == isinstance(choice, str):
            return i
    return None
