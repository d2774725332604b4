"""Tables of runs that read in an 80-column terminal, one implementation for `fp4lab sweep`, `status`,
`scan` and `report`: a column that is empty for every row shown is dropped, one that is constant moves
into the caption ("all rows: sweep quickstart"), runs are named by the values of the axes that vary
between them (the axes in the header, no `key=` on every cell), ids are cut to their shortest unique
prefix, and the columns that say which run it is and how it ended never shrink: long text wraps.

    table = runs_table("runs of quickstart", [Column("run", identifies=True), Column("loss", right=True)], rows)
    console.print(table)

rich is imported lazily; this module never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

SHORT_ID = 7  # as git's short hashes: unique among a few thousand runs, extended where two rows share it


@dataclass(frozen=True)
class Column:
    header: str
    right: bool = False  # numbers, aligned on the right
    wraps: bool = False  # long free text (errors, configs) may wrap onto more lines
    identifies: bool = False  # names a run or its outcome: kept when constant, never shrunk below its longest word


def short_ids(ids: Sequence[str]) -> dict[str, str]:
    """id -> its first characters, as many for every id (SHORT_ID, more where two ids would share them)."""
    unique = sorted(set(ids))
    length = SHORT_ID
    for a, b in zip(unique, unique[1:]):  # sorted: an id shares its longest prefix with a neighbour
        while length < max(len(a), len(b)) and a[:length] == b[:length]:
            length += 1
    return {run_id: run_id[:length] for run_id in unique}


def varying_axes(params: Sequence[dict[str, Any] | None]) -> list[str]:
    """The axes whose values differ between the runs (recipe first, then in the order they appear); all
    the runs' axes when none differ (one run: its recipe still names it)."""
    keys: list[str] = []
    for p in params:
        keys += [k for k in (p or {}) if k not in keys]
    keys.sort(key=lambda k: k != "recipe")
    varying = [k for k in keys if len({_text((p or {}).get(k, "")) for p in params}) > 1]
    return varying or keys


def run_names(params: Sequence[dict[str, Any] | None], fallback: Sequence[str]) -> tuple[str, list[str]]:
    """(header, one name per run): "run (recipe, lr)" over "nvfp4 0.001"; a run without parameters keeps
    its given name (fallback) with any `key=` prefixes dropped."""
    axes = varying_axes(params)
    names = []
    for p, given in zip(params, fallback):
        if p and axes:
            names.append(" ".join(_text(p.get(k, "-")) for k in axes))
        else:
            names.append(" ".join(part.split("=", 1)[-1] for part in str(given or "").split()))
    header = f"run ({', '.join(axes)})" if axes and any(params) else "run"
    return header, names


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    return "" if value is None else str(value)


def runs_table(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str]], caption: Sequence[str] = (),
               fold_constant: bool = True):
    """A rich Table of `rows` (cells as text, one per column): empty columns dropped, constant ones
    (over two rows or more, unless they identify the run; where `fold_constant`: a live view keeps its
    columns still) named once in the caption, identifying
    columns as wide as their longest word so rich never squeezes them to nothing."""
    from rich.table import Table
    from rich.text import Text

    plain = [[Text.from_markup(cell).plain if "[" in cell else cell for cell in row] for row in rows]  # cells may carry markup
    shown, constant = [], []
    for i, column in enumerate(columns):
        values = {row[i] for row in plain}
        if values <= {""}:
            continue
        if fold_constant and len(rows) > 1 and len(values) == 1 and not column.identifies:
            constant.append(f"{column.header.replace(chr(10), ' ')} {values.pop()}")
            continue
        shown.append(i)
    notes = ([f"all rows: {', '.join(constant)}"] if constant else []) + list(caption)
    table = Table(title=title, caption="\n".join(notes) or None)
    for i in shown:
        column = columns[i]
        longest_word = max((len(w) for row in plain for w in row[i].split()), default=0)
        table.add_column(column.header, justify="right" if column.right else "left",
                         no_wrap=not (column.wraps or column.identifies), overflow="fold",
                         min_width=min(longest_word, 24) if column.identifies else None)  # fmt: skip
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table
