"""The one kit for checking what a user wrote (run configs, recipes, optimizer settings, sweep specs,
ratchet programs): the same rules and the same words everywhere.

Values one at a time, for a caller with its own one-line error class (ConfigError, RecipeError, ...);
`name` is how the message names the thing, e.g. "lr" or "OptimizerConfig.ns_format":

    check = Checks(ConfigError)
    check.choice("model", "huge", ("tiny", "125m"))   # ConfigError: model='huge' is not supported; allowed: tiny, 125m
    check.integer("steps", 0, minimum=1)              # ConfigError: steps=0 must be an integer >= 1
    check.number("lr", -1.0, positive=True)           # ConfigError: lr=-1.0 must be a finite number > 0
    check.known_keys({"stepz": 3}, ("steps",), "base")  # ConfigError: base.stepz: unknown key; allowed in base: steps

Tables of a document (a sweep spec's [slurm], program.md's [noise]): a frozen dataclass whose fields
are `entry(rule, default)` is the table's schema, and `checked_table` reads a TOML table into it,
refusing unknown keys, missing required ones and values that break their rule:

    @dataclass(frozen=True, kw_only=True)
    class Noise:
        seeds: int = entry(integer(minimum=1), 1)
        rule: str = entry(choice(("sigma", "paired")), "sigma")

    checked_table(Noise, {"seeds": 0}, "[noise]", fail)   # fail("[noise].seeds", "0 must be an integer >= 1")

Document parsers locate errors themselves: `fail(place, message)` returns their error (SpecError,
ProgramError) with the file in front, as `known_keys(table, allowed, where, fail)` and
`Rule.check(place, value, fail)` raise it. Both styles say the same words, because Checks asks the
same rules.

Pure Python, imports nothing from fp4lab: every layer may use it.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

Fail = Callable[[str, str], Exception]  # fail(place, message) -> the caller's one-line error
REQUIRED = dataclasses.MISSING  # the default of an entry the table must give
_RULE = "fp4lab.validation.rule"  # where entry() keeps a field's rule in its metadata


def is_int(value: Any) -> bool:
    """An integer, and not a bool (True is an int in Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _unchanged(value: Any) -> Any:
    return value


def _always(value: Any) -> bool:
    return True


# --------------------------------------------------------------------------------------------- rules


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one value may be. `accepts` tests its type as TOML gives it; `store` is what a checked table
    keeps (a float for an int given as a number, a tuple for a list, so that a checked table cannot
    change); `holds` tests the stored value; `wants` completes "<value> must be ..." when either test
    fails. `items` checks each element of a list (place[i]) or each value of a table (place.key).
    A choice (`allowed`) says "<value> is not supported; allowed: ..." instead."""

    wants: str
    accepts: Callable[[Any], bool] = _always
    store: Callable[[Any], Any] = _unchanged
    holds: Callable[[Any], bool] = _always
    items: Rule | None = None
    allowed: tuple[Any, ...] | None = None
    quote: bool = False  # show the allowed values as repr (Python settings) or plain (TOML words)

    def check(self, place: str, value: Any, fail: Fail) -> Any:
        """The value as stored, or raise fail(place, message)."""
        if self.allowed is not None:
            if value in self.allowed:
                return value
            shown = ", ".join(repr(a) if self.quote else str(a) for a in self.allowed)
            raise fail(place, f"{value!r} is not supported{did_you_mean(value, self.allowed)}; allowed: {shown}")
        if not self.accepts(value):
            raise fail(place, f"{value!r} must be {self.wants}")
        if self.items is not None:
            if isinstance(value, Mapping):
                value = {key: self.items.check(f"{place}.{key}", item, fail) for key, item in value.items()}
            else:
                value = [self.items.check(f"{place}[{i}]", item, fail) for i, item in enumerate(value)]
        stored = self.store(value)
        if not self.holds(stored):
            raise fail(place, f"{stored!r} must be {self.wants}")
        return stored

    def hinted(self, hint: str) -> Rule:
        """The same rule, its message ending in `(hint)`, e.g. "(leave it out for no limit)"."""
        return dataclasses.replace(self, wants=f"{self.wants} ({hint})")


def choice(allowed: Iterable[Any], *, quote: bool = False) -> Rule:
    allowed = tuple(allowed)
    return Rule(f"one of {', '.join(map(str, allowed))}", allowed=allowed, quote=quote)


def integer(minimum: int | None = None) -> Rule:
    return Rule(f"an integer >= {minimum}" if minimum is not None else "an integer", is_int,
                holds=_always if minimum is None else (lambda value: value >= minimum))


def number(*, positive: bool | None = None, below: float | None = None, wants: str | None = None,
           as_float: bool = True) -> Rule:
    """A finite number: any (positive None), >= 0 (False) or > 0 (True), and below `below` if given.
    A checked table stores it as a float (as_float), as a TOML float field would hold it."""

    def holds(value: float) -> bool:
        lowest = positive is None or value > 0 or (not positive and value == 0)
        return lowest and (below is None or value < below)

    default = "a finite number" + {None: "", False: " >= 0", True: " > 0"}[positive]
    return Rule(wants or default, is_number, float if as_float else _unchanged, holds)


def boolean() -> Rule:
    return Rule("true or false", lambda value: isinstance(value, bool))


def string(*, wants: str = "a string", holds: Callable[[str], bool] = _always) -> Rule:
    return Rule(wants, lambda value: isinstance(value, str), holds=holds)


def list_of(items: Rule, *, wants: str | None = None) -> Rule:
    """A list, each element checked by `items`; stored as a tuple."""
    return Rule(wants or f"a list of {_plural(items.wants)}", lambda value: isinstance(value, list), tuple, items=items)


def table_of(items: Rule | None = None, *, wants: str | None = None) -> Rule:
    """A table (a dict), each value checked by `items` when given; stored as a copy."""
    wanted = wants or ("a table" + (f" of {_plural(items.wants)}" if items is not None else ""))
    return Rule(wanted, lambda value: isinstance(value, Mapping), dict, items=items)


def _plural(wants: str) -> str:
    return wants.removeprefix("a ").removeprefix("an ") + "s" if wants.startswith(("a ", "an ")) else wants


# ---------------------------------------------------------------------------------- checked tables


def entry(rule: Rule, default: Any = REQUIRED) -> Any:
    """A field of a checked table's dataclass: the rule its value must keep and its default (REQUIRED:
    the table must give it). A list or dict default is copied for each instance."""
    metadata = {_RULE: rule}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def checked_table(schema: type, table: Any, where: str, fail: Fail) -> Any:
    """`schema(**values)` from a TOML table: every key one of schema's entry() fields, every value kept
    to its rule (None stands for a field whose default is None), every REQUIRED field given;
    fail(place, message) otherwise, `place` naming the key under `where` (`[noise].seeds`)."""
    if not isinstance(table, Mapping):
        raise fail(where, "must be a table of key = value lines")
    fields = {f.name: f for f in dataclasses.fields(schema) if _RULE in f.metadata}
    known_keys(table, fields, where, fail)
    values = {}
    for name, field in fields.items():
        place = f"{where}.{name}" if where else name
        rule = field.metadata[_RULE]
        if name not in table:
            if field.default is REQUIRED and field.default_factory is REQUIRED:
                raise fail(place, f"missing; add {name} ({rule.wants})")
        elif table[name] is None and field.default is None:
            values[name] = None
        else:
            values[name] = rule.check(place, table[name], fail)
    return schema(**values)


# ------------------------------------------------------------------------------- one value at a time


class Checks:
    """Rules asked one value at a time, for a caller whose error takes one message: "name=value ..."."""

    def __init__(self, error: Callable[[str], Exception], *, quote_choices: bool = False) -> None:
        self.error = error
        self.quote_choices = quote_choices

    def _fail(self, name: str, message: str) -> Exception:
        return self.error(f"{name}={message}")

    def choice(self, name: str, value: Any, allowed: Iterable[Any], *, optional: bool = False) -> Any:
        if optional and value is None:
            return value
        return choice(allowed, quote=self.quote_choices).check(name, value, self._fail)

    def integer(self, name: str, value: Any, *, minimum: int, optional: bool = False) -> int | None:
        if optional and value is None:
            return None
        return integer(minimum).check(name, value, self._fail)

    def number(self, name: str, value: Any, *, positive: bool, optional: bool = False) -> float | None:
        if optional and value is None:
            return None
        return number(positive=positive, as_float=False).check(name, value, self._fail)

    def known_keys(self, table: Mapping[str, Any], allowed: Iterable[str], where: str = "") -> None:
        known_keys(table, allowed, where, lambda place, message: self.error(f"{place}: {message}"))


def read_toml(path: Path, error: Callable[[str], Exception], what: str) -> dict[str, Any]:
    """The table of a TOML file; error("<what> '<path>' does not exist") or error("<path>: not valid
    TOML: ...") (or not UTF-8) otherwise."""
    path = Path(path)
    if not path.is_file():
        raise error(f"{what} {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text: {exc}") from None


def did_you_mean(word: Any, candidates: Iterable[Any]) -> str:
    """" (did you mean 'batch_size'?)" when one of `candidates` is close to `word` (difflib), else ""."""
    import difflib

    names = {str(c): c for c in candidates}
    # difflib's default 0.6 offered 'recompute' for 'dropout' (0.625); the typos it is for score 0.67 and up
    # ('fp6' for 'fp8', 'mnii' for 'mini').
    close = difflib.get_close_matches(str(word), list(names), n=1, cutoff=0.65)
    return f" (did you mean {names[close[0]]!r}?)" if close else ""


def known_keys(table: Mapping[str, Any], allowed: Iterable[str], where: str, fail: Fail) -> None:
    """Raise fail(place, message) for the first key of `table` not in `allowed`; `where` names the table
    (`base`, `[stop]`; "" at the top level) and `place` the key in it (`base.stepz`)."""
    allowed = tuple(allowed)
    for key in table:
        if key not in allowed:
            place = f"{where}.{key}" if where else key
            raise fail(place, f"unknown key{did_you_mean(key, allowed)}; allowed{' in ' + where if where else ''}: {', '.join(allowed)}")
