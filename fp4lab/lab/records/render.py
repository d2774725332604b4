"""The ledger as people read it: a rich table for the terminal, Markdown (ledger.md, the same bytes for the
same catalog, so docs can embed it), an HTML page with the plots embedded, and `write_report`, which
writes them all with ledger.csv and the PNGs.

    paths = write_report(report, "reports/mini")   # ledger.csv, ledger.md, report.html, *.png
    console.print(render_ledger(report))           # a rich Table that fits 100 columns

pandas and rich are imported lazily inside functions; this module never imports torch.
"""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path
from typing import Any

from fp4lab.lab.records.ledger import BASELINE, COLUMN_DOCS, COLUMNS, Report, config_label
from fp4lab.lab.records.plots import (
    PLOT_CAPTIONS,
    PLOTS,
    group_label,
    horizon_curves,
    plot_png,
    run_label,
    smoothing_window,
    trend_text,
)  # fmt: skip
from fp4lab.lab.records.values import format_cell, signed_cell
from fp4lab.train.atomic import write_atomic

_HEADERS = {  # column -> (header, digits) of the full table (Markdown, HTML)
    "sweep": ("sweep", 0), "recipe": ("recipe", 0), "config": ("config", 0), "n_seeds": ("seeds", 0),
    "n_completed": ("completed", 0), "seeds": ("seed list", 0), "final_val_loss_mean": ("val loss", 4), "final_val_loss_std": ("± std", 4),
    "final_train_loss_mean": ("train loss", 4), "final_train_loss_std": ("± std", 4),
    "excess_pct_mean": ("excess % (mean)", 2), "excess_pct_std": ("± std", 2),
    "excess_pct_last": ("excess % (last)", 2), "excess_pct_last_std": ("± std", 2), "excess_last_step": ("@step", 0),
    "val_excess_pct_mean": ("val excess %", 2), "val_excess_pct_std": ("± std", 2),
    "val_excess_ci95": ("val excess 95 % CI", 0), "ci_test": ("ci test", 0), "vs_bf16": ("vs bf16", 0), "baseline_runs": ("bf16 runs", 0),
    "tokens_per_s_mean": ("tok/s", 1), "steady_tokens_per_s_mean": ("steady tok/s", 1),
    "verdicts": ("verdicts", 0), "first_bad_event": ("first event", 0), "runs": ("runs", 0),
}  # fmt: skip


def _full_columns(report: Report) -> list[str]:
    """Every ledger column; the sweep column only for a report over every sweep."""
    return [c for c in COLUMNS if c != "sweep" or report.sweep is None]


def _full_rows(report: Report) -> list[list[str]]:
    columns = _full_columns(report)
    return [[format_cell(row[c], _HEADERS[c][1]) if _HEADERS[c][1] else format_cell(row[c]) for c in columns]
            for _, row in report.ledger.iterrows()]  # fmt: skip


def _console_columns(report: Report):
    from fp4lab.lab.records.tables import Column

    return [
        Column("sweep", wraps=True), Column("recipe", identifies=True), Column("config", wraps=True),
        Column("val\nexcess %", right=True, identifies=True), Column("vs bf16\n(95 % CI)", wraps=True),
        Column("val loss", right=True), Column("train\nexcess %", right=True), Column("steady\ntok/s", right=True),
        Column("verdicts", wraps=True, identifies=True),
    ]  # fmt: skip


def _console_rows(report: Report) -> list[list[str]]:
    rows = []
    for _, row in report.ledger.iterrows():
        val_std = format_cell(row["final_val_loss_std"], 4)
        excess_std = format_cell(row["excess_pct_std"], 2)
        val_excess_std = format_cell(row["val_excess_pct_std"], 2)
        first_bad = row["first_bad_event"]
        verdicts = row["verdicts"].removesuffix(" x1") if row["n_seeds"] == 1 else row["verdicts"]
        reference = row["recipe"] == BASELINE  # the row the excess is measured against
        val_excess = signed_cell(row["val_excess_pct_mean"])
        if reference:
            val_excess = "ref"
        elif val_excess and int(row["n_completed"]) == 1:
            val_excess += "\n1 seed"  # one value, no spread: what the CI column cannot judge yet
        elif val_excess_std:
            val_excess += f"\n±{val_excess_std}"
        versus = row["vs_bf16"] if row["vs_bf16"] != "n/a" or not val_excess else "needs 2 seeds"
        versus = "\n".join(v for v in (format_cell(versus), format_cell(row["val_excess_ci95"])) if v)
        rows.append([
            row["sweep"], row["recipe"] + (f"\n{_seed_count(row)}" if int(row["n_seeds"]) > 1 else ""), row["config"], val_excess, versus,
            format_cell(row["final_val_loss_mean"], 4) + (f"\n±{val_std}" if val_std else ""),
            "ref" if reference else signed_cell(row["excess_pct_mean"]) + (f"\n±{excess_std}" if excess_std else ""),
            format_cell(row["steady_tokens_per_s_mean"], 0), verdicts + (f"\nfirst: {first_bad}" if first_bad else ""),
        ])  # fmt: skip
    return rows


def _seed_count(row) -> str:
    """"3 seeds", or "1 of 3 seeds" while some of the row's runs have not completed."""
    done, total = int(row["n_completed"]), int(row["n_seeds"])
    return (f"{total} seed" if done == total else f"{done} of {total} seed") + ("s" if total > 1 else "")


def render_ledger(report: Report):
    """The ledger as a rich Table that reads in an 80-column terminal (tables.runs_table): it leads with
    the validation-loss excess over bf16 (positive = worse, as every excess fp4lab shows), whether that
    differs from bf16 beyond seed noise (with its 95 % interval; one seed says so), then the val loss,
    the train-loss excess labelled as such, steady tokens/s and verdicts; a seed spread on a second line.
    The full table is in ledger.csv, ledger.md and report.html."""
    from fp4lab.lab.records.tables import runs_table

    title = f"recipe ledger{' of ' + report.sweep if report.sweep else ''} ({report.catalog_path}); excess: + = worse than bf16"
    caption = [
        *report.notes,
        "excess %: 100 x (run - bf16) / bf16; positive = worse than bf16 (ref)",
        "val excess %: final val loss; train excess %: train loss, mean over steps; ± std over seeds",
        "vs bf16: 95 % CI of the val-loss difference of means (paired by seed, else Welch's)",
        "everything else: ledger.csv, ledger.md, report.html",
    ]
    columns = _console_columns(report)
    rows = _console_rows(report)
    if report.sweep is not None:  # a report of one sweep: its name is in the title
        columns, rows = columns[1:], [row[1:] for row in rows]
    return runs_table(title, columns, rows, caption=caption)


def _horizon_section(report: Report) -> str:
    """The validation excess of each row at its first and last eval and its trend against tokens seen
    (val_excess.png); empty where no row has two evals."""
    curves = [c for c in horizon_curves(report) if len(c.tokens) > 1]
    if not curves:
        return ""
    unit = "tokens" if all(c.in_tokens for c in curves) else "steps"
    lines = ["| row | evals | first eval | val excess % | last eval | val excess % | trend |", "|---|---|---|---|---|---|---|"]
    for c in curves:
        lines.append(f"| {c.label.replace('|', chr(92) + '|')} | {len(c.tokens)} | {c.tokens[0]:,.0f} | {c.mean[0]:+.2f} | "
                     f"{c.tokens[-1]:,.0f} | {c.mean[-1]:+.2f} | {trend_text(c)} |")  # fmt: skip
    return (
        "\n## Excess against tokens\n\n"
        f"The validation-loss excess at each eval (in {unit} seen), mean over the row's seeds; the trend is the "
        "least-squares slope of the excess against log10(tokens), in percentage points per tenfold tokens, ± the "
        "standard error over the row's seeds (each seed fitted alone; the one seed's fit where there is one). "
        "Positive: the excess grows with tokens. Plot: val_excess.png.\n\n" + "\n".join(lines) + "\n"
    )


def _excess_method(report: Report) -> str:
    window = smoothing_window(report)
    return (
        "Loss excess at a step = 100 × (train loss of the run − bf16 reference) / bf16 reference, where the "
        "reference is the mean train loss of the bf16 runs named in the 'bf16 runs' column: the bf16 runs of the "
        "same sweep whose config equals the run's apart from recipe and seed, or every bf16 run of the sweep when "
        "none matches. The ledger uses the losses the catalog records (every 10 steps and the last step); the "
        f"plot uses every logged step, smoothed by a centered rolling mean over {window} logged steps. "
        "Validation excess = 100 × (final val loss of the run − mean final val loss of the same bf16 runs) / that "
        "mean. Whether a row differs from bf16 beyond seed noise is the 95 % confidence interval of the difference "
        "of the means of its final val losses and those bf16 runs', in % of the bf16 mean: paired by seed where both "
        "sides ran the same seeds (a seed fixes the initial weights and every batch whatever the recipe, so the "
        "t-interval of the per-seed differences leaves out what the seeds share), else Welch's t-test (unequal "
        "variances); the ci test column names which."
    )


def ledger_markdown(report: Report) -> str:
    """ledger.md: the full table, what each column means, how the excess is computed, the notes and the
    further sections (the claims'). No timestamp: the same catalog gives the same bytes."""
    columns = _full_columns(report)
    headers = [_HEADERS[c][0] for c in columns]

    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in _full_rows(report)]
    title = f"# Recipe ledger{': ' + report.sweep if report.sweep else ''}\n\n"
    glossary = "".join(f"- **{_HEADERS[c][0]}**: {COLUMN_DOCS[c]}\n" for c in columns)
    notes = "".join(f"- {n}\n" for n in report.notes)
    claims = "".join("\n" + section for section in report.sections)
    return (
        title + "\n".join(lines) + "\n\nColumns:\n\n" + glossary + "\n" + _excess_method(report) + "\n"
        + _horizon_section(report) + ("\nNotes:\n\n" + notes if notes else "") + claims
    )  # fmt: skip


# --- writing -------------------------------------------------------------------------------------------


def _runs_html(report: Report) -> str:
    import html

    def cell(text: Any) -> str:
        return f"<td>{html.escape('' if text is None else str(text))}</td>"

    rows, configs = [], []
    for r in report.records:
        config = r.get("config") or {}
        commit = r.get("git_commit")
        dirty = {True: "yes (uncommitted changes)", False: "no"}.get(r.get("git_dirty"), "unknown")
        rows.append(
            "<tr>" + cell(r["id"]) + cell(r.get("sweep")) + cell(r.get("recipe")) + cell(config_label(r))
            + cell(config.get("seed")) + cell(r.get("state")) + cell(r.get("verdict"))
            + (f'<td><code title="{html.escape(commit)}">{html.escape(commit[:12])}</code></td>' if commit
               else "<td>unknown</td>")
            + cell(dirty) + cell((r.get("paths") or {}).get("run_dir")) + "</tr>"
        )  # fmt: skip
        configs.append(
            f"<details><summary>{html.escape(r['id'])} ({html.escape(run_label(report, r['id']))})</summary>"
            f"<pre>{html.escape(json.dumps(config, indent=2, sort_keys=True, default=str))}</pre></details>"
        )
    headers = ("run", "sweep", "recipe", "config", "seed", "state", "verdict", "git commit", "dirty", "run folder")
    return (
        "<h2>Runs</h2>\n<p>Each run's catalog record: the commit it was launched from and whether the work tree had "
        "uncommitted changes then, and its resolved training config.</p>\n<table><tr>"
        + "".join(f"<th>{h}</th>" for h in headers) + "</tr>" + "".join(rows) + "</table>\n"
        + "<h3>Configs</h3>\n" + "\n".join(configs) + "\n"
    )  # fmt: skip


def _html(report: Report, pngs: dict[str, bytes]) -> str:
    import html
    from datetime import UTC, datetime

    columns = _full_columns(report)
    headers = "".join(
        f'<th title="{html.escape(COLUMN_DOCS[c])}">{html.escape(_HEADERS[c][0])}</th>' for c in columns
    )
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in _full_rows(report)
    )
    glossary = "".join(
        f"<dt>{html.escape(_HEADERS[c][0])} <code>{c}</code></dt><dd>{html.escape(COLUMN_DOCS[c])}</dd>"
        for c in columns
    )
    references = ""
    if report.has_baseline:
        items = []
        for index, run_ids in enumerate(report.groups):
            bases = report.baseline_of.get(run_ids[0], [])
            named = ", ".join(f"{b} ({run_label(report, b)})" for b in bases)
            items.append(f"<li>{html.escape(group_label(report, index))}: {html.escape(named)}</li>")
        references = f"<p>The bf16 runs each row is compared with:</p><ul>{''.join(items)}</ul>\n"
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in report.notes)
    window = smoothing_window(report)
    images = "".join(
        f"<figure><h3>{html.escape(name.replace('_', ' '))}</h3>\n"
        f'<img alt="{name}" src="data:image/png;base64,{base64.b64encode(data).decode()}">\n'
        f"<figcaption>{html.escape(PLOT_CAPTIONS[name].format(window=window))}</figcaption></figure>\n"
        for name, data in pngs.items()
    )
    title = f"fp4lab recipe ledger{' — ' + report.sweep if report.sweep else ''}"
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        '<!doctype html>\n<html><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}img{max-width:100%}"
        "dt{font-weight:bold;margin-top:.4em}figure{margin:1.5em 0}figcaption{max-width:60em}"
        "</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1>\n"
        f"<p>Generated {generated} by <code>fp4lab report</code> from the catalog "
        f"<code>{html.escape(str(report.catalog_path))}</code>"
        f"{' (sweep ' + html.escape(report.sweep) + ')' if report.sweep else ' (every sweep)'}. "
        "One row per recipe and config; the seeds of a row are grouped.</p>\n"
        f"<h2>Recipe ledger</h2>\n<table><tr>{headers}</tr>{body}</table>\n"
        f"<h3>Columns</h3>\n<dl>{glossary}</dl>\n"
        f"<h3>Loss excess</h3>\n<p>{html.escape(_excess_method(report))}</p>\n{references}"
        + (f"<h2>Notes</h2><ul>{notes}</ul>\n" if notes else "")
        + ("<h2>Plots</h2>\n" + images if images else "")
        + _runs_html(report)
        + "</body></html>\n"
    )


def write_report(report: Report, out_dir: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Write ledger.csv, ledger.md, claims.csv (where claims were checked), the PNG plots and report.html (PNGs embedded) into `out_dir`
    (default: report.default_out_dir, i.e. reports/<sweep or all>/), each atomically. Returns
    name -> path of every file written ("csv", "md", "html" and the plot names that had data)."""
    out = (
        Path(out_dir) if out_dir is not None else (report.default_out_dir or Path("reports") / (report.sweep or "all"))
    )
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    write_atomic(out / "ledger.csv", report.ledger.to_csv(index=False).encode())
    written["csv"] = out / "ledger.csv"
    write_atomic(out / "ledger.md", ledger_markdown(report).encode())
    written["md"] = out / "ledger.md"
    if report.claims is not None:
        write_atomic(out / "claims.csv", report.claims.to_csv(index=False).encode())
        written["claims"] = out / "claims.csv"
    pngs: dict[str, bytes] = {}
    for name in PLOTS:
        data = plot_png(report, name)
        if data is None:
            continue
        pngs[name] = data
        write_atomic(out / f"{name}.png", data)
        written[name] = out / f"{name}.png"
    write_atomic(out / "report.html", _html(report, pngs).encode())
    written["html"] = out / "report.html"
    return written
