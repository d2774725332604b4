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
    "iteration", "decision", "metric", "best_so_far", "improvement_pct", "healthy", "kept_commit", "proposal",
)  # fmt: skip
DECISION_STYLES = {
    "baseline": "blue", "keep": "green", "discard": "grey50", "crash": "red", "invalid": "red", "duplicate": "yellow",
}  # fmt: skip
NOISE_K = 2.0  # the shaded noise band: baseline ± NOISE_K * sigma


def ratchet_report(catalog_path: str | os.PathLike[str], tag: str, out_dir: str | os.PathLike[str] | None = None):
    """The iterations of ratchet `tag` (catalog sweep "ratchet/<tag>"): writes iterations.csv,
    iterations.md and metric.png into `out_dir` (default reports/ratchet-<tag>/), each atomically, and
    returns (rich Table, {"csv", "md", "png"} -> path). Raises ValueError for a missing catalog or tag."""
    import pandas as pd

    catalog_path = Path(catalog_path)
    rows, metric_name, sigma = _ratchet_rows(_read_iterations(catalog_path, tag))
    frame = pd.DataFrame(rows, columns=list(RATCHET_COLUMNS))
    frame["iteration"] = frame["iteration"].astype("Int64")
    headers = {"metric": metric_name, "best_so_far": "best so far", "improvement_pct": "vs baseline %"}
    shown = [[format_cell(r[c], 2 if c == "improvement_pct" else 6) for c in RATCHET_COLUMNS] for r in rows]
    for row in shown:
        row[5] = {"True": "yes", "False": "no"}.get(row[5], row[5])
    table = _iterations_table(f"fp4lab ratchet {tag} ({catalog_path})", headers, shown)

    lines = ["| " + " | ".join(headers.get(c, c) for c in RATCHET_COLUMNS) + " |", "|" + "---|" * len(RATCHET_COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in shown]
    out = Path(out_dir) if out_dir is not None else Path("reports") / f"ratchet-{tag.replace('/', '-')}"
    out.mkdir(parents=True, exist_ok=True)
    written = {"csv": out / "iterations.csv", "md": out / "iterations.md", "png": out / "metric.png"}
    write_atomic(written["csv"], frame.to_csv(index=False).encode())
    write_atomic(written["md"], (f"# fp4lab ratchet {tag}\n\n" + "\n".join(lines) + "\n").encode())
    write_atomic(written["png"], _ratchet_png(rows, tag, metric_name, sigma))
    return table, written


def _read_iterations(catalog_path: Path, tag: str) -> list[dict[str, Any]]:
    """The catalog records of ratchet `tag`; ValueError for a missing or unreadable catalog or an unknown tag."""
    from fp4lab.lab.records.catalog import Catalog, CatalogError

    if not catalog_path.exists():
        raise ValueError(f"{catalog_path}: no catalog there; run the ratchet with tag {tag!r} first, or read the catalog it wrote")
    try:
        catalog = Catalog(catalog_path)
        records = catalog.records(sweep=f"ratchet/{tag}")
        tags = sorted({str(r["sweep"])[8:] for r in catalog.records() if str(r.get("sweep")).startswith("ratchet/")})
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
        return f"invalid: {proposal['error']}"
    if proposal.get("kind") == "diff":
        return f"diff: {proposal.get('rationale') or ''}".strip()
    params = proposal.get("params") if isinstance(proposal.get("params"), dict) else {}
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def _ratchet_rows(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str, float | None]:
    """(ledger rows sorted by iteration, the metric's name, the baseline's sigma) of one ratchet's records."""
    extras = [r.get("extra") if isinstance(r.get("extra"), dict) else {} for r in records]
    extras.sort(key=lambda e: (not isinstance(e.get("iteration"), int), e.get("iteration") or 0))
    baseline = next((e for e in extras if e.get("decision") == "baseline"), {})
    base = finite_number(baseline.get("metric"))
    kept = [e for e in extras if e.get("decision") == "keep" and finite_number(e.get("metric")) is not None]
    direction = next((e["direction"] for e in extras if e.get("direction") in ("minimize", "maximize")), None)
    if direction is None:  # not recorded: a kept iteration beat the best before it, which tells the direction
        probe = next((e for e in kept if finite_number(e.get("best_before")) is not None), None)
        direction = "maximize" if probe and probe["metric"] > probe["best_before"] else "minimize"
    sign = -1.0 if direction == "minimize" else 1.0
    rows, best = [], None
    for e in extras:
        metric = finite_number(e.get("metric"))
        if e.get("decision") in ("baseline", "keep") and metric is not None:
            best = metric  # the ratchet keeps only strict improvements: the latest kept metric is the frontier
        improvement = sign * 100.0 * (metric - base) / abs(base) + 0.0 if metric is not None and base else None
        rows.append({
            "iteration": e.get("iteration"), "decision": e.get("decision") or e.get("phase") or "",
            "metric": metric, "best_so_far": best, "improvement_pct": improvement, "healthy": e.get("healthy"),
            "kept_commit": str(e.get("kept_commit") or "")[:7], "proposal": _proposal_summary(e.get("proposal")),
        })  # fmt: skip
    name = next((str(e["metric_name"]) for e in extras if e.get("metric_name")), "metric")
    return rows, name, finite_number(baseline.get("sigma"))


def _iterations_table(title: str, headers: dict[str, str], shown: list[list[str]]):
    """The iterations as a rich Table, each decision in its colour."""
    from rich.table import Table

    table = Table(title=title)
    for column in RATCHET_COLUMNS:
        table.add_column(
            headers.get(column, column), justify="right" if column in headers or column == "iteration" else "left"
        )
    for row in shown:
        style = DECISION_STYLES.get(row[1])
        table.add_row(*row[:1], f"[{style}]{row[1]}[/]" if style else row[1], *row[2:])
    return table


def _ratchet_png(rows: list[dict[str, Any]], tag: str, metric_name: str, sigma: float | None) -> bytes:
    """metric.png: each iteration's metric by decision, the best-so-far frontier and the noise gate."""
    plt = pyplot_agg()
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        points = [r for r in rows if isinstance(r["iteration"], int)]
        colours = {"baseline": "tab:blue", "keep": "tab:green", "discard": "grey", "duplicate": "silver"}
        for decision, colour in colours.items():
            pts = [
                (r["iteration"], r["metric"]) for r in points if r["decision"] == decision and r["metric"] is not None
            ]
            if pts:
                ax.scatter(*zip(*pts), color=colour, label=decision, zorder=3)
        failed = [r for r in points if r["decision"] in ("crash", "invalid")]
        measured = [(r["iteration"], r["metric"]) for r in failed if r["metric"] is not None]
        if measured:
            ax.scatter(*zip(*measured), color="red", marker="x", label="crash / invalid", zorder=3)
        unmeasured = [r["iteration"] for r in failed if r["metric"] is None]
        if unmeasured:  # no metric: a red x at the bottom of the axes (x in data, y in axes coordinates)
            ax.scatter(unmeasured, [0.03] * len(unmeasured), color="red", marker="x", zorder=3, clip_on=False,
                       transform=ax.get_xaxis_transform(), label="crash / invalid (no metric)")  # fmt: skip
        frontier = [(r["iteration"], r["best_so_far"]) for r in points if r["best_so_far"] is not None]
        if frontier:
            ax.step(*zip(*frontier), where="post", color="tab:green", linewidth=1.2, label="best so far")
        base = next((r["metric"] for r in points if r["decision"] == "baseline" and r["metric"] is not None), None)
        if base is not None and sigma:
            ax.axhspan(base - NOISE_K * sigma, base + NOISE_K * sigma, color="tab:blue", alpha=0.12,
                       label=f"noise gate ({NOISE_K:g} sigma)")  # fmt: skip
        ax.set(xlabel="iteration", ylabel=metric_name, title=f"fp4lab ratchet {tag}")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
        return png_bytes(fig)
    finally:
        plt.close(fig)
