"""The iterations of a ratchet run as people read them (`fp4lab report --ratchet TAG`): a rich table, and
iterations.csv, iterations.md and metric.png (the metric per iteration, the best-so-far frontier and the
baseline's noise gate).

    table, written = ratchet_report("sweep_catalog.json", "t1")   # reports/ratchet-t1/

pandas, rich and matplotlib (Agg) are imported lazily inside functions; this module never imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fp4lab.lab.records.plots import png_bytes, pyplot_agg
from fp4lab.lab.records.values import finite_number, format_cell
from fp4lab.train.atomic import write_atomic

RATCHET_COLUMNS = (
    "iteration", "decision", "metric", "compared_with", "gain", "gate", "excess_pct", "best_so_far", "healthy",
    "kept_commit", "proposal", "reason",
)  # fmt: skip
# column -> header of the table and iterations.md (the others keep their names); the CSV has every column
HEADERS = {
    "iteration": "iter", "compared_with": "compared\nwith", "excess_pct": "vs baseline %\n(+ = worse)",
    "best_so_far": "best so far", "kept_commit": "commit", "reason": "why",
}  # fmt: skip
SHOWN = ("iteration", "decision", "metric", "compared_with", "gain", "gate", "excess_pct", "kept_commit", "proposal", "reason")
DECISION_STYLES = {
    "baseline": "blue", "keep": "green", "discard": "grey50", "crash": "red", "invalid": "red", "duplicate": "yellow",
    "pruned": "magenta",
}  # fmt: skip


def ratchet_report(catalog_path: str | os.PathLike[str], tag: str, out_dir: str | os.PathLike[str] | None = None):
    """The iterations of ratchet `tag` (catalog sweep "ratchet/<tag>"): writes iterations.csv,
    iterations.md and metric.png into `out_dir` (default reports/ratchet-<tag>/), each atomically, and
    returns (rich Table, {"csv", "md", "png"} -> path). Raises ValueError for a missing catalog or tag."""
    import pandas as pd

    catalog_path = Path(catalog_path)
    rows, metric_name = _ratchet_rows(_read_iterations(catalog_path, tag))
    frame = pd.DataFrame(rows, columns=list(RATCHET_COLUMNS))
    frame["iteration"] = frame["iteration"].astype("Int64")
    headers = HEADERS | {"metric": metric_name}
    shown = [[_cell(r, c) for c in SHOWN] for r in rows]
    table = _iterations_table(f"fp4lab ratchet {tag} ({catalog_path})", [headers.get(c, c) for c in SHOWN], shown)

    lines = ["| " + " | ".join(headers.get(c, c).replace("\n", " ") for c in SHOWN) + " |", "|" + "---|" * len(SHOWN)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|").replace("\n", " ") for cell in row) + " |" for row in shown]
    out = Path(out_dir) if out_dir is not None else Path("reports") / f"ratchet-{tag.replace('/', '-')}"
    out.mkdir(parents=True, exist_ok=True)
    written = {"csv": out / "iterations.csv", "md": out / "iterations.md", "png": out / "metric.png"}
    write_atomic(written["csv"], frame.to_csv(index=False).encode())
    legend = ("compared with: the value the gate compared the iteration with (rule sigma: the best's seed-0 run; "
              "rule paired: the mean of the best's seeds); gain: how much better, in metric units; gate: k x sigma, "
              "or P(better) against the confidence; vs baseline %: 100 x (metric - baseline) / baseline, + = worse")
    write_atomic(written["md"], (f"# fp4lab ratchet {tag}\n\n" + "\n".join(lines) + "\n\n" + legend + "\n").encode())
    write_atomic(written["png"], _ratchet_png(rows, tag, metric_name))
    return table, written


def _cell(row: dict[str, Any], column: str) -> str:
    value = row[column]
    if column == "gain":
        return "" if value is None else f"{value:+.4g}"
    if column == "excess_pct":
        return "" if value is None else f"{value:+.2f}"
    return format_cell(value, 6)


def _read_iterations(catalog_path: Path, tag: str) -> list[dict[str, Any]]:
    """The catalog records of ratchet `tag`; ValueError for a missing or unreadable catalog or an unknown tag."""
    from fp4lab.lab.records.catalog import Catalog, CatalogError

    if not catalog_path.exists():
        raise ValueError(f"{catalog_path}: no catalog there; run the ratchet with tag {tag!r} first, or read the catalog it wrote")
    try:
        catalog = Catalog(catalog_path)
        records = catalog.records(sweep=f"ratchet/{tag}")
        tags = [name[8:] for name in catalog.sweeps() if name.startswith("ratchet/")]
    except CatalogError as exc:
        raise ValueError(f"{catalog_path}: {str(exc).splitlines()[0]}") from None
    if not records:
        raise ValueError(f"{catalog_path}: no ratchet iterations for tag {tag!r}; run the ratchet with tag {tag!r} "
                         f"first (tags here: {', '.join(tags) or 'none'})")  # fmt: skip
    return [dict(r) for r in records]


def _proposal_summary(proposal: Any) -> str:
    if not isinstance(proposal, dict):
        return ""
    if proposal.get("error"):
        return "(rejected)"
    if proposal.get("kind") == "diff":
        return f"diff: {proposal.get('rationale') or ''}".strip()
    params = proposal.get("params") if isinstance(proposal.get("params"), dict) else {}
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _ratchet_rows(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """(ledger rows sorted by iteration, the metric's name) of one ratchet's records."""
    extras = [r.get("extra") if isinstance(r.get("extra"), dict) else {} for r in records]
    extras.sort(key=lambda e: (not isinstance(e.get("iteration"), int), e.get("iteration") or 0))
    baseline = next((e for e in extras if e.get("decision") == "baseline"), {})
    base = finite_number(baseline.get("metric"))
    kept = [e for e in extras if e.get("decision") == "keep" and finite_number(e.get("metric")) is not None]
    direction = next((e["direction"] for e in extras if e.get("direction") in ("minimize", "maximize")), None)
    if direction is None:  # not recorded: a kept iteration beat the best before it, which tells the direction
        probe = next((e for e in kept if finite_number(e.get("best_before")) is not None), None)
        direction = "maximize" if probe and probe["metric"] > probe["best_before"] else "minimize"
    sign = 1.0 if direction == "minimize" else -1.0  # + = worse, as every excess fp4lab shows
    rows, best = [], None
    for e in extras:
        metric = finite_number(e.get("metric"))
        if e.get("decision") in ("baseline", "keep") and metric is not None:
            best = metric  # the ratchet keeps only strict improvements: the latest kept metric is the frontier
        # a pruned iteration's metric is from the step it stopped at: no excess against a full-length run
        comparable = metric is not None and base and e.get("decision") != "pruned"
        excess = sign * 100.0 * (metric - base) / abs(base) + 0.0 if comparable else None
        rows.append({
            "iteration": e.get("iteration"), "decision": e.get("decision") or e.get("phase") or "",
            "metric": metric, "compared_with": finite_number(e.get("compared_with")), "gain": finite_number(e.get("gain")),
            "gate": _gate_text(e), "gate_value": finite_number(e.get("gate")), "excess_pct": excess, "best_so_far": best,
            "healthy": {True: "yes", False: "no"}.get(e.get("healthy"), ""), "kept_commit": str(e.get("kept_commit") or "")[:7],
            "proposal": _proposal_summary(e.get("proposal")), "reason": decision_reason(e),
        })  # fmt: skip
    name = next((str(e["metric_name"]) for e in extras if e.get("metric_name")), "metric")
    return rows, name


def _gate_text(extra: dict[str, Any]) -> str:
    if extra.get("rule") == "paired" and finite_number(extra.get("probability")) is not None:
        return f"P {extra['probability']:.3f} vs {extra.get('confidence')}"
    gate = finite_number(extra.get("gate"))
    return "" if gate is None else f"{gate:.4g}"


def decision_reason(extra: dict[str, Any]) -> str:
    """Why the iteration was decided so (recorded since the gate is; an older record: its note or the
    proposal's error)."""
    reason, note = extra.get("reason") or "", extra.get("note") or ""
    error = (extra.get("proposal") or {}).get("error") if isinstance(extra.get("proposal"), dict) else None
    return "; ".join(part for part in (reason, note if note not in reason else "", error if not reason and error else "") if part)


def _iterations_table(title: str, headers: list[str], shown: list[list[str]]):
    """The iterations as a table that reads at 80 columns (tables.runs_table), each decision in its colour."""
    from rich.markup import escape

    from fp4lab.lab.records.tables import Column, runs_table

    numeric = {"iteration", "metric", "compared_with", "gain", "gate", "excess_pct"}
    columns = [Column(h, right=c in numeric, wraps=c in ("proposal", "reason"), identifies=c in ("iteration", "decision", "reason"))
               for c, h in zip(SHOWN, headers)]  # fmt: skip
    styled = []
    for row in shown:
        style = DECISION_STYLES.get(row[1])
        styled.append([escape(cell) if i != 1 or not style else f"[{style}]{cell}[/]" for i, cell in enumerate(row)])
    return runs_table(title, columns, styled)


def _ratchet_png(rows: list[dict[str, Any]], tag: str, metric_name: str) -> bytes:
    """metric.png: each iteration's metric by decision, the best-so-far frontier, and at each judged
    iteration the value the gate compared it with and the gate around it (rule sigma: ± k x sigma), so a
    point outside its own band is one the gate let through."""
    plt = pyplot_agg()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        points = [r for r in rows if isinstance(r["iteration"], int)]
        judged = [r for r in points if r["compared_with"] is not None]
        for n, r in enumerate(judged):
            x, centre, gate = r["iteration"], r["compared_with"], r["gate_value"] or 0.0
            first = n == 0
            if gate:
                ax.fill_between([x - 0.4, x + 0.4], centre - gate, centre + gate, color="tab:blue", alpha=0.15, linewidth=0,
                                label="gate around what it was compared with" if first else None)  # fmt: skip
            ax.hlines(centre, x - 0.4, x + 0.4, color="tab:blue", linewidth=1.5, label="compared with" if first else None)
        colours = {"baseline": "tab:blue", "keep": "tab:green", "discard": "grey", "duplicate": "silver", "stale": "tab:orange"}
        for decision, colour in colours.items():
            pts = [(r["iteration"], r["metric"]) for r in points if r["decision"] == decision and r["metric"] is not None]
            if pts:
                ax.scatter(*zip(*pts), color=colour, label=decision, zorder=3, s=36)
        failed = [r for r in points if r["decision"] in ("crash", "invalid")]
        measured = [(r["iteration"], r["metric"]) for r in failed if r["metric"] is not None]
        if measured:
            ax.scatter(*zip(*measured), color="red", marker="x", label="crash / invalid", zorder=3)
        unmeasured = [r["iteration"] for r in failed if r["metric"] is None]
        if unmeasured:  # no metric: a red x at the bottom of the axes (x in data, y in axes coordinates)
            ax.scatter(unmeasured, [0.03] * len(unmeasured), color="red", marker="x", zorder=3, clip_on=False,
                       transform=ax.get_xaxis_transform(), label="crash / invalid (no metric)")  # fmt: skip
        pruned = [r["iteration"] for r in points if r["decision"] == "pruned"]
        if pruned:  # stopped early: its metric is from an earlier step than the others', so not on the scale
            ax.scatter(pruned, [0.03] * len(pruned), color="tab:purple", marker="v", zorder=3, clip_on=False,
                       transform=ax.get_xaxis_transform(), label="pruned (stopped early)")  # fmt: skip
        frontier = [(r["iteration"], r["best_so_far"]) for r in points if r["best_so_far"] is not None]
        if frontier:
            ax.step(*zip(*frontier), where="post", color="tab:green", linewidth=1.2, label="best so far (mean over seeds)")
        ax.set(xlabel="iteration (0 = baseline)", ylabel=metric_name, title=f"fp4lab ratchet {tag}")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
        return png_bytes(fig)
    finally:
        plt.close(fig)
