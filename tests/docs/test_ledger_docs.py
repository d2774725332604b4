"""docs/LEDGER.md's tables come from the committed catalog and runs: `fp4lab report` on them writes
docs/ledger/<report>/'s Markdown and CSV again byte for byte, so the published ledger cannot drift from
its data or from the report code."""

from __future__ import annotations

import csv
import shutil
import tarfile
from pathlib import Path

import pytest

from fp4lab.lab.records.catalog import Catalog
from tests.browser import check_page

REPO = Path(__file__).resolve().parents[2]
LEDGER = REPO / "docs" / "ledger"
REPORTS = {  # committed report folder -> (sweep, extra report options)
    "ledger": ("ledger", ["--claims", str(REPO / "sweeps" / "ledger_claims.toml")]),
    "stress": ("ledger_stress", []),
    "stress_adamw": ("ledger_stress_adamw", []),
    "optitrain_ns": ("optitrain_ns", []),
}


@pytest.fixture(scope="module")
def ledger_copy(tmp_path_factory) -> Path:
    """The committed catalog at docs/ledger/ and its runs unpacked beside, as the LEDGER's commands have them."""
    root = tmp_path_factory.mktemp("ledger")
    (root / "docs" / "ledger").mkdir(parents=True)
    shutil.copy(LEDGER / "sweep_catalog.json", root / "docs" / "ledger" / "sweep_catalog.json")
    with tarfile.open(LEDGER / "runs.tar.xz") as archive:
        archive.extractall(root, filter="data")
    return root


@pytest.mark.parametrize("folder", sorted(REPORTS))
def test_the_committed_report_is_what_fp4lab_report_writes_from_the_committed_catalog(folder, ledger_copy, run_cli, monkeypatch):
    sweep, options = REPORTS[folder]
    monkeypatch.chdir(ledger_copy)
    out = ledger_copy / "docs" / "ledger" / folder
    result = run_cli("report", sweep, "--catalog", "docs/ledger/sweep_catalog.json", "--out", f"docs/ledger/{folder}", *options)
    assert result.returncode == 0, result.stderr
    committed = sorted(p.name for p in (LEDGER / folder).iterdir() if p.suffix in (".md", ".csv"))
    assert "ledger.md" in committed and "ledger.csv" in committed
    for name in committed:
        assert (out / name).read_text() == (LEDGER / folder / name).read_text(), (
            f"docs/ledger/{folder}/{name} is not what the report writes from the committed catalog: run "
            f"`fp4lab report {sweep} --catalog docs/ledger/sweep_catalog.json --out docs/ledger/{folder}` and commit it"
        )


def _condensed_row(row: dict[str, str]) -> list[str]:
    """The cells of one row of docs/LEDGER.md's main table, as it rounds the report's CSV row."""

    def with_spread(mean: str, std: str, decimals: int, sign: str = "") -> str:
        return f"{float(mean):{sign}.{decimals}f}" + (f" ± {float(std):.{decimals}f}" if std else "")

    def excess(mean: str, std: str) -> str:
        return f"0 ± {float(std):.2f}" if not row["vs_bf16"] else with_spread(mean, std, 2, "+")  # bf16 is the baseline

    seeds = row["n_seeds"] if row["n_completed"] == row["n_seeds"] else f"{row['n_completed']} of {row['n_seeds']}"
    return [
        row["recipe"], seeds,
        with_spread(row["final_val_loss_mean"], row["final_val_loss_std"], 4),
        excess(row["val_excess_pct_mean"], row["val_excess_pct_std"]),
        row["val_excess_ci95"], row["vs_bf16"],
        excess(row["excess_pct_mean"], row["excess_pct_std"]),
        f"{round(float(row['steady_tokens_per_s_mean'])):,}", row["verdicts"],
    ]


def test_the_ledger_table_in_LEDGER_md_rounds_the_committed_report():
    rows = [r for r in csv.DictReader((LEDGER / "ledger" / "ledger.csv").open()) if int(r["n_completed"]) > 0]
    text = (REPO / "docs" / "LEDGER.md").read_text().splitlines()
    header = text.index(
        "| recipe | seeds | val loss | val excess % | 95 % CI | vs bf16 | train-loss excess % (all steps) | steady tok/s | verdicts |"
    )
    table = []
    for line in text[header + 2:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    assert table == [_condensed_row(r) for r in rows], (
        "docs/LEDGER.md's ledger table differs from docs/ledger/ledger/ledger.csv: write each row as _condensed_row does"
    )


@pytest.mark.browser
def test_the_published_ledgers_page_reads_whole_and_offline_in_a_browser(ledger_copy, run_cli, monkeypatch, tmp_path):
    """report.html of the published ledger, checked as the small sweep's in tests/lab/test_report_page.py."""
    sweep, options = REPORTS["ledger"]
    monkeypatch.chdir(ledger_copy)
    result = run_cli("report", sweep, "--catalog", "docs/ledger/sweep_catalog.json", "--out", str(tmp_path), *options)
    assert result.returncode == 0, result.stderr
    found = check_page(tmp_path / "report.html")
    assert found.problems == []
    plots = sorted(p.stem for p in (LEDGER / "ledger").glob("*.png"))
    assert sorted(image["name"] for image in found.images) == plots and len(plots) == 5
    rows = list(csv.DictReader((LEDGER / "ledger" / "ledger.csv").open()))
    runs = Catalog(ledger_copy / "docs" / "ledger" / "sweep_catalog.json").records(sweep=sweep)
    assert [(t["name"], t["filledRows"]) for t in found.tables] == [("Recipe ledger", len(rows)), ("Runs", len(runs))]
