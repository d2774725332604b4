"""metrics.jsonl: lines in strict JSON, and the one reader of them. Torch-free: the orchestrator reads
metrics without importing torch.

One rule for every reader (scanner, report, catalog, resume, live progress): a line that is not a
JSON object with an integer `step` (the torn last line of a killed run, or a corrupt one) is skipped
and counted, never fatal, and never hides the lines around it.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def json_line(record: dict[str, Any]) -> str:
    """One metrics line in strict JSON: non-finite floats are written as the strings "nan", "inf" and
    "-inf" (`read_json_line` turns them back into floats), so any JSON reader can parse the file."""
    return json.dumps(nonfinite_as_strings(record), allow_nan=False)


def nonfinite_as_strings(value: Any) -> Any:
    """`value` as strict JSON can hold it: each non-finite float becomes the string "nan", "inf" or
    "-inf", dict keys strings, tuples lists (the one rule of metrics.jsonl and of `fp4lab ... --json`)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {str(k): nonfinite_as_strings(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [nonfinite_as_strings(v) for v in value]
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


def metrics_records(lines: Iterable[str], counts: dict[str, int] | None = None) -> Iterator[dict[str, Any]]:
    """The step records among `lines` (an open metrics.jsonl, or some of its lines), in order.
    counts, when given, gains "lines" (non-blank lines read) and "skipped_lines" (lines skipped)."""
    counts = {} if counts is None else counts
    counts.setdefault("lines", 0)
    counts.setdefault("skipped_lines", 0)
    for line in lines:
        if not line.strip():
            continue
        counts["lines"] += 1
        try:
            record = read_json_line(line)
        except ValueError:
            counts["skipped_lines"] += 1
            continue
        if not isinstance(record, dict) or type(record.get("step")) is not int:  # a bool or float step: corrupt
            counts["skipped_lines"] += 1
            continue
        yield record


def read_metrics_file(path: Path, counts: dict[str, int] | None = None) -> Iterator[dict[str, Any]]:
    """`metrics_records` of a whole file (undecodable bytes replaced, so they count as a skipped line)."""
    with open(path, errors="replace") as handle:
        yield from metrics_records(handle, counts)


def steady_rate(throughput: Iterable[tuple[int, float]]) -> float | None:
    """The median of per-step rates (step, value) over the second half of the steps recorded, None
    without any: the pace once compiled and captured, which the few slow probe and evaluation steps do
    not move. A run's summary.json and the report's ledger both take tokens/s this way."""
    rates = list(throughput)
    if not rates:
        return None
    last = rates[-1][0]
    return statistics.median(value for step, value in rates if 2 * step >= last)
