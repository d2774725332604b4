"""The one kit for checking what a user wrote (run configs, recipes, optimizer settings, sweep specs,
ratchet programs): the same rules and the same words everywhere.

Each check returns the value or raises `error(message)`, the caller's own one-line error class
(ConfigError, RecipeError, SpecError, ...); `name` is how the message names the thing, e.g. "lr",
"[run].steps" or "OptimizerConfig.ns_format":

    check = Checks(ConfigError)
    check.choice("model", "huge", ("tiny", "125m"))   # ConfigError: model='huge' is not supported; allowed: tiny, 125m
    check.integer("steps", 0, minimum=1)              # ConfigError: steps=0 must be an integer >= 1
    check.number("lr", -1.0, positive=True)           # ConfigError: lr=-1.0 must be a finite number > 0
    check.known_keys({"stepz": 3}, ("steps",), "base")  # ConfigError: base.stepz: unknown key; allowed: steps

`known_keys(table, allowed, where, fail)` serves parsers that locate errors themselves: it raises
`fail(place, message)`, as the sweep-spec and program.md parsers do for every error.

Pure Python, imports nothing from fp4lab: every layer may use it.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any


def is_int(value: Any) -> bool:
    """An integer, and not a bool (True is an int in Python, never a count here)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class Checks:
    def __init__(self, error: Callable[[str], Exception], *, quote_choices: bool = False) -> None:
        self.error = error
        self.quote_choices = quote_choices

    def choice(self, name: str, value: Any, allowed: Iterable[Any], *, optional: bool = False) -> Any:
        allowed = tuple(allowed)
        if (optional and value is None) or value in allowed:
            return value
        shown = ", ".join(repr(a) if self.quote_choices else str(a) for a in allowed)
        raise self.error(f"{name}={value!r} is not supported; allowed: {shown}")

    def integer(self, name: str, value: Any, *, minimum: int, optional: bool = False) -> int | None:
        if optional and value is None:
            return None
        if not is_int(value) or value < minimum:
            raise self.error(f"{name}={value!r} must be an integer >= {minimum}")
        return value

    def number(self, name: str, value: Any, *, positive: bool, optional: bool = False) -> float | None:
        if optional and value is None:
            return None
        if not is_number(value) or value < 0 or (positive and value == 0):
            raise self.error(f"{name}={value!r} must be a finite number {'> 0' if positive else '>= 0'}")
        return value

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


def known_keys(table: Mapping[str, Any], allowed: Iterable[str], where: str, fail: Callable[[str, str], Exception]) -> None:
    """Raise fail(place, message) for the first key of `table` not in `allowed`; `where` names the table
    (`base`, `[stop]`; "" at the top level) and `place` the key in it (`base.stepz`)."""
    allowed = tuple(allowed)
    for key in table:
        if key not in allowed:
            place = f"{where}.{key}" if where else key
            raise fail(place, f"unknown key; allowed{' in ' + where if where else ''}: {', '.join(allowed)}")
