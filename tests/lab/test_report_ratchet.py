"""fp4lab.lab.ratchet.report.ratchet_report: the iterations of a ratchet run (table, CSV, Markdown, plot)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from fp4lab.lab.ratchet.report import ratchet_report
from fp4lab.lab.records.catalog import Catalog
from fp4lab.lab.records.ledger import build_report

from .test_report import _add_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _iteration(catalog: Catalog, tag: str, number: int, decision: str, metric: float | None, **extra) -> None:
    fields = {"iteration": number, "decision": decision, "metric": metric, "values": [metric], "healthy": True,
              "note": "", "kept_commit": None, "proposal": None, "phase": "done", **extra}  # fmt: skip
    state = "completed" if decision in ("baseline", "keep", "discard") else "failed"
    catalog.upsert({"id": f"ratchet-{tag}-{number:04d}", "sweep": f"ratchet/{tag}", "state": state, "extra": fields})


def _params(**params) -> dict:
    return {"kind": "params", "params": params, "rationale": "", "source": "optuna", "fingerprint": str(params)}


@pytest.fixture
def catalog_path(tmp_path) -> Path:
    """A ratchet t1 (minimising): baseline 4.0 (sigma 0.01), then keep / discard / crash / keep / invalid / diff."""
    path = tmp_path / "sweep_catalog.json"
    catalog = Catalog(path)
    # inserted out of order: the report sorts by iteration
    _iteration(catalog, "t1", 3, "crash", None, healthy=False, note="exit 1", proposal=_params(lr=0.3))
    _iteration(catalog, "t1", 0, "baseline", 4.0, values=[3.99, 4.01, 4.0], sigma=0.01)
    _iteration(catalog, "t1", 1, "keep", 3.8, best_before=4.0, sigma=0.01, kept_commit="abcdef0123456789",
               proposal=_params(lr=0.0123456, warmup=10))  # fmt: skip
    _iteration(catalog, "t1", 2, "discard", 3.9, best_before=3.8, proposal=_params(lr=0.02))
    _iteration(catalog, "t1", 4, "keep", 3.5, best_before=3.8, kept_commit="1234567890",
               proposal={"kind": "diff", "params": {}, "rationale": "scale the init", "source": "claude"})  # fmt: skip
    _iteration(catalog, "t1", 5, "invalid", None, healthy=False, proposal={"source": "claude", "error": "bad patch"})
    catalog.upsert({"id": "ratchet-t1-0006", "sweep": "ratchet/t1", "state": "failed", "extra": {"iteration": 6}})
    _iteration(catalog, "other", 0, "baseline", 1.0)
    return path


def _csv(path: Path) -> list[dict[str, str]]:
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_table_csv_md_png_and_frontier(catalog_path, tmp_path):
    table, written = ratchet_report(catalog_path, "t1", tmp_path / "out")
    assert written == {"csv": tmp_path / "out/iterations.csv", "md": tmp_path / "out/iterations.md",
                       "png": tmp_path / "out/metric.png"}  # fmt: skip
    rows = _csv(written["csv"])
    assert list(rows[0]) == ["iteration", "decision", "metric", "compared_with", "gain", "gate", "excess_pct", "best_so_far",
                             "healthy", "kept_commit", "proposal", "reason"]  # fmt: skip
    assert [r["iteration"] for r in rows] == ["0", "1", "2", "3", "4", "5", "6"]
    assert [r["decision"] for r in rows] == ["baseline", "keep", "discard", "crash", "keep", "invalid", ""]
    assert [r["metric"] for r in rows] == ["4.0", "3.8", "3.9", "", "3.5", "", ""]
    assert [float(r["best_so_far"]) for r in rows] == [4.0, 3.8, 3.8, 3.8, 3.5, 3.5, 3.5]
    # + = worse than the baseline, as the ledger's excess: lower is better here, so 3.8 vs 4.0 is -5 %
    assert float(rows[1]["excess_pct"]) == pytest.approx(-5.0)
    assert float(rows[2]["excess_pct"]) == pytest.approx(-2.5) and rows[3]["excess_pct"] == ""
    assert [r["kept_commit"] for r in rows[:5]] == ["", "abcdef0", "", "", "1234567"]
    assert rows[1]["proposal"] == "lr=0.01235, warmup=10"
    assert rows[4]["proposal"] == "diff: scale the init" and rows[5]["proposal"] == "(rejected)" and "bad patch" in rows[5]["reason"]
    assert rows[0]["healthy"] == "yes" and rows[3]["healthy"] == "no" and rows[3]["reason"] == "exit 1"
    md = written["md"].read_text()
    assert md.startswith("# fp4lab ratchet t1") and md.count("\n| ") == 8 and "| keep |" in md
    data = written["png"].read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    assert not list((tmp_path / "out").glob(".*.tmp"))
    assert len(table.rows) == 7 and [c.header for c in table.columns][:3] == ["iter", "decision", "metric"]
    assert "[green]keep[/]" in [row[1] for row in table.rows]


def test_metric_name_maximise_and_only_crashes(tmp_path):
    path = tmp_path / "sweep_catalog.json"
    catalog = Catalog(path)
    _iteration(catalog, "up", 0, "baseline", 0.5, metric_name="accuracy")
    _iteration(catalog, "up", 1, "keep", 0.6, best_before=0.5, metric_name="accuracy")
    table, written = ratchet_report(path, "up", tmp_path / "a")
    assert table.columns[2].header == "accuracy" and "| accuracy |" in written["md"].read_text()
    assert float(_csv(written["csv"])[1]["excess_pct"]) == pytest.approx(-20.0)  # higher is better here: -20 % is better
    # no metric at all (crashed baseline, no sigma): the plot is still written
    _iteration(catalog, "dead", 0, "crash", None, healthy=False)
    _iteration(catalog, "dead", 1, "invalid", None, proposal={"source": "x", "error": "no"})
    _, written = ratchet_report(path, "dead", tmp_path / "b")
    assert written["png"].read_bytes().startswith(PNG_MAGIC)
    assert [r["best_so_far"] for r in _csv(written["csv"])] == ["", ""]


def test_default_out_dir(catalog_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, written = ratchet_report(catalog_path, "t1", None)
    assert written["png"] == Path("reports/ratchet-t1/metric.png") and written["png"].exists()


def test_unknown_tag_and_missing_catalog_are_value_errors(catalog_path, tmp_path):
    with pytest.raises(
        ValueError, match=r"no ratchet iterations for tag 'nope'.*run the ratchet with tag 'nope'.*tags here: other, t1\)"
    ) as info:
        ratchet_report(catalog_path, "nope", tmp_path / "out")
    assert "\n" not in str(info.value) and str(catalog_path) in str(info.value)
    with pytest.raises(ValueError, match="missing.json") as info:
        ratchet_report(tmp_path / "missing.json", "t1", tmp_path / "out")
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_all_sweeps_report_ignores_ratchet_records(catalog_path, tmp_path):
    _add_run(Catalog(catalog_path), tmp_path, "b0", "bf16", 0, [5.0, 4.0])
    report = build_report(catalog_path)
    assert [r["id"] for r in report.records] == ["b0"]
    assert report.ledger["runs"].tolist() == ["b0"] and report.ledger["sweep"].tolist() == ["hand"]


def test_cli(run_cli, catalog_path, tmp_path):
    done = run_cli("report", "--ratchet", "t1", "--catalog", str(catalog_path), "--out", str(tmp_path / "r"))
    assert done.returncode == 0, done.stderr
    assert "metric.png" in done.stdout and (tmp_path / "r" / "metric.png").exists()
    done = run_cli("report", "--ratchet", "nope", "--catalog", str(catalog_path))
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and "tags here: other, t1" in done.stderr
