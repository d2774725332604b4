"""metrics.jsonl lines in strict JSON, torch-free (the orchestrator reads them without importing torch)."""

from __future__ import annotations

import json
import math
from typing import Any

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def json_line(record: dict[str, Any]) -> str:
    """One metrics line in strict JSON: non-finite floats are written as the strings "nan", "inf" and
    "-inf" (`read_json_line` turns them back into floats), so any JSON reader can parse the file."""
    return json.dumps(_strict(record), allow_nan=False)


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_strict(v) for v in value]
    return value


def read_json_line(line: str) -> Any:
    """A metrics line as written by `json_line` (or by older versions, with bare NaN / Infinity), with
    non-finite values as floats again. Raises json.JSONDecodeError on a line that is not JSON."""
    return _floats(json.loads(line))


def _floats(value: Any) -> Any:
    if isinstance(value, str):
        return _NONFINITE.get(value, value)
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_floats(v) for v in value]
    return value
