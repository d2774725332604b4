"""The input-checking kit: one value at a time (Checks) and whole tables (checked_table) say the same
words; a checked table refuses unknown keys, missing required keys and values that break their rule,
naming the place; it stores floats for numbers and tuples for lists."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fp4lab.validation import Checks, boolean, checked_table, choice, entry, integer, list_of, number, string, table_of


class Bad(ValueError):
    pass


def fail(place: str, message: str) -> Bad:
    return Bad(f"doc.toml: {place}: {message}")


@dataclass(frozen=True, kw_only=True)
class Table:
    trials: int = entry(integer(minimum=1))
    rule: str = entry(choice(("sigma", "paired")), "sigma")
    k: float = entry(number(positive=False), 2.0)
    cap: float | None = entry(number(positive=True).hinted("leave it out for none"), None)
    strict: bool = entry(boolean(), True)
    files: tuple[str, ...] = entry(list_of(string()), ())
    env: dict[str, str] = entry(table_of(string()), {})


def message(table) -> str:
    with pytest.raises(Bad) as exc:
        checked_table(Table, table, "[t]", fail)
    return str(exc.value)


def test_a_checked_table_fills_defaults_and_stores_floats_and_tuples():
    t = checked_table(Table, {"trials": 3, "k": 1, "files": ["a", "b"], "env": {"A": "x"}, "cap": None}, "[t]", fail)
    assert t == Table(trials=3, k=1.0, files=("a", "b"), env={"A": "x"})
    assert type(t.k) is float and t.cap is None and t.rule == "sigma" and t.strict is True
    assert checked_table(Table, {"trials": 1}, "[t]", fail).env == {}  # each instance its own default


@pytest.mark.parametrize("table, expected", [
    ({"trials": 1, "colour": 2}, "doc.toml: [t].colour: unknown key; allowed in [t]: trials, rule, k, cap, strict, files, env"),
    ({}, "doc.toml: [t].trials: missing; add trials (an integer >= 1)"),
    ({"trials": 0}, "doc.toml: [t].trials: 0 must be an integer >= 1"),
    ({"trials": 1.5}, "doc.toml: [t].trials: 1.5 must be an integer >= 1"),
    ({"trials": True}, "doc.toml: [t].trials: True must be an integer >= 1"),
    ({"trials": 1, "rule": "vibes"}, "doc.toml: [t].rule: 'vibes' is not supported; allowed: sigma, paired"),
    ({"trials": 1, "k": -1}, "doc.toml: [t].k: -1.0 must be a finite number >= 0"),
    ({"trials": 1, "k": float("nan")}, "doc.toml: [t].k: nan must be a finite number >= 0"),
    ({"trials": 1, "cap": 0}, "doc.toml: [t].cap: 0.0 must be a finite number > 0 (leave it out for none)"),
    ({"trials": 1, "strict": "yes"}, "doc.toml: [t].strict: 'yes' must be true or false"),
    ({"trials": 1, "files": "a"}, "doc.toml: [t].files: 'a' must be a list of strings"),
    ({"trials": 1, "files": ["a", 2]}, "doc.toml: [t].files[1]: 2 must be a string"),
    ({"trials": 1, "env": {"A": 1}}, "doc.toml: [t].env.A: 1 must be a string"),
    (3, "doc.toml: [t]: must be a table of key = value lines"),
])
def test_a_checked_table_names_the_place_and_the_fix(table, expected):
    assert message(table) == expected


def test_checks_say_the_words_of_the_rules():
    check = Checks(Bad)
    cases = [
        (lambda: check.choice("model", "huge", ("tiny", "125m")), "model='huge' is not supported; allowed: tiny, 125m"),
        (lambda: check.integer("steps", 0, minimum=1), "steps=0 must be an integer >= 1"),
        (lambda: check.number("lr", -1, positive=True), "lr=-1 must be a finite number > 0"),  # as written
        (lambda: check.known_keys({"stepz": 3}, ("steps",), "base"), "base.stepz: unknown key (did you mean 'steps'?); allowed in base: steps"),
        (lambda: check.known_keys({"batchsize": 3}, ("batch_size", "steps"), "base"),
         "base.batchsize: unknown key (did you mean 'batch_size'?); allowed in base: batch_size, steps"),
        (lambda: check.choice("model", "125", ("tiny", "125m")), "model='125' is not supported (did you mean '125m'?); allowed: tiny, 125m"),
        (lambda: Checks(Bad, quote_choices=True).choice("fmt", "fp8", ("bf16",)), "fmt='fp8' is not supported; allowed: 'bf16'"),
    ]
    for call, expected in cases:
        with pytest.raises(Bad) as exc:
            call()
        assert str(exc.value) == expected
    assert check.number("lr", 0, positive=False) == 0 and check.integer("n", None, minimum=1, optional=True) is None
    with pytest.raises(Bad, match="must be an integer >= 1"):  # the same words as a checked table's
        checked_table(Table, {"trials": 0}, "[t]", fail)
