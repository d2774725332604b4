"""Numbers as the ledger reads and shows them: a catalog or metrics value as a finite number, the mean and
sample spread of a column (NaN where too few values), and the text of a table cell.

pandas is imported lazily (only to recognise its missing values); this module never imports torch.
"""

from __future__ import annotations

import math
from typing import Any


def finite_number(value: Any) -> float | None:
    """A JSON int or float as a float when finite; None for NaN, infinities, booleans, strings and the rest."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def mean_or_nan(values: list[float]) -> float:
    """The arithmetic mean; NaN for no values (an empty ledger cell)."""
    return sum(values) / len(values) if values else math.nan


def sample_std(values: list[float]) -> float:
    """Sample standard deviation (ddof=1); NaN for fewer than two values."""
    if len(values) < 2:
        return math.nan
    m = mean_or_nan(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def format_cell(value: Any, digits: int = 4) -> str:
    """A table cell's text: floats with `digits` decimals, None, NaN and pandas' missing values empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.{digits}f}"
    try:
        import pandas as pd

        if pd.isna(value):
            return ""
    except (TypeError, ValueError):
        pass
    return str(value)


def signed_cell(value: Any, digits: int = 2) -> str:
    """`format_cell` with a "+" before a positive or zero number, so a change reads as one."""
    text = format_cell(value, digits)
    return text if not text or text.startswith("-") else "+" + text
