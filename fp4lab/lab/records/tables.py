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
    identifies: bool = False  # names a run or its outcome: kept when constant


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
               fold_constant: bool = True) -> "FittedTable":
    """A table of `rows` (cells as text, one per column) for rich to print: empty columns dropped, constant
    ones (over two rows or more, unless they identify the run; where `fold_constant`: a live view keeps
    its columns still) named once in the caption, and laid out at print time for the console's width."""
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
    return FittedTable(title, [columns[i] for i in shown], [[row[i] for i in shown] for row in rows],
                       [[row[i] for i in shown] for row in plain], "\n".join(notes) or None)


@dataclass
class FittedTable:
    """A rich renderable that sizes its columns for the width it is printed at: every column as wide as
    its longest line where that fits; otherwise the wrapping columns give up width (down to their
    longest word) in proportion to what they can spare, and the others keep theirs, so a run's name
    and verdict never shrink to nothing while a note column keeps its room."""

    title: str
    columns: list[Column]
    rows: list[list[str]]
    plain: list[list[str]]
    caption: str | None

    def widths(self, available: int) -> tuple[list[int | None], bool]:
        """(each column's content width at `available` characters in all, None for rich's own; whether
        every column may wrap at its words, where the wrapping columns alone cannot make it fit)."""
        natural, longest_word = [], []
        for i, column in enumerate(self.columns):
            lines = [line for row in self.plain for line in row[i].splitlines()] + column.header.splitlines()
            natural.append(max((len(line) for line in lines), default=1))
            longest_word.append(max([len(word) for line in lines for word in line.split()] or [1]))
        room = available - 3 * len(self.columns) - 1  # a border and a space either side of each cell
        least = [w if column.wraps else n for column, n, w in zip(self.columns, natural, longest_word)]
        every_column_wraps = sum(least) > room
        if every_column_wraps:
            least = longest_word
        if sum(natural) <= room or sum(least) > room:
            return [None] * len(self.columns), every_column_wraps
        spare = [n - m for n, m in zip(natural, least)]
        cut = sum(natural) - room
        shares = [cut * s // sum(spare) for s in spare]
        for i in sorted(range(len(spare)), key=lambda i: -spare[i])[: cut - sum(shares)]:  # the remainder, widest first
            shares[i] += 1
        return [n - share for n, share in zip(natural, shares)], every_column_wraps

    def __rich_console__(self, console, options):
        from rich.table import Table

        table = Table(title=self.title, caption=self.caption)
        widths, every_column_wraps = self.widths(options.max_width)
        for column, width in zip(self.columns, widths):
            table.add_column(column.header, justify="right" if column.right else "left",
                             no_wrap=not (column.wraps or every_column_wraps), overflow="fold", width=width)  # fmt: skip
        for row in self.rows:
            table.add_row(*row)
        yield table
