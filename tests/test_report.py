"""fp4lab.lab.report: the recipe ledger (seeds grouped, loss excess vs bf16) and its exports."""

from __future__ import annotations

import base64
import csv
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from fp4lab.lab.catalog import Catalog
from fp4lab.lab.report import build_report, excess_pct, render_ledger, write_report

from .test_sweep import SPEC

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory) -> Path:
    """A real 6-step bf16 + nvfp4 sweep (fp4lab sweep, local executor); returns the catalog path."""
    folder = tmp_path_factory.mktemp("sweep")
    (folder / "mini.toml").write_text(SPEC)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env["OMP_NUM_THREADS"] = "1"  # two workers of tiny tensors: spinning OpenMP threads made it several times slower
    done = subprocess.run(
        [sys.executable, "-m", "fp4lab.cli", "sweep", "mini.toml", "--workers", "2"],
        cwd=folder, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return folder / "sweep_catalog.json"


def _metrics_lines(losses: list[float], layers: int = 2, heads: int = 2) -> str:
    rows = []
    for step, loss in enumerate(losses):
        row = {"step": step, "loss": loss, "lr": 0.01, "grad_norm": 1.0, "tokens_per_s": 100.0}
        if step % 2 == 0:
            row["attn_entropy"] = [[1.0 + 0.1 * layer + 0.01 * h for h in range(heads)] for layer in range(layers)]
            row["attn_entropy_mean"] = [statistics.mean(r) for r in row["attn_entropy"]]
            row["max_logit"] = [[2.0 + layer + h for h in range(heads)] for layer in range(layers)]
            row["max_logit_max"] = max(max(r) for r in row["max_logit"])
        if step == len(losses) - 1:
            row["val_loss"] = loss + 0.1
        rows.append(json.dumps(row))
    return "\n".join(rows) + "\n"


def _add_run(catalog: Catalog, folder: Path, run_id: str, recipe: str, seed: int, losses: list[float], **extra):
    run_dir = folder / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(_metrics_lines(losses))
    summary = {
        "final_train_loss": losses[-1], "best_train_loss": min(losses), "final_val_loss": losses[-1] + 0.1,
        "tokens_per_s": 100.0 + seed, "loss_at_steps": {"0": losses[0], str(len(losses) - 1): losses[-1]},
    }  # fmt: skip
    config = {"recipe": recipe, "model": "tiny", "seed": seed, "steps": len(losses), "out_dir": f"runs/{run_id}"}
    catalog.upsert(
        {
            "id": run_id, "sweep": extra.pop("sweep", "hand"), "recipe": recipe, "config": config,
            "state": "completed", "verdict": extra.pop("verdict", "converged"), "events": extra.pop("events", []),
            "summary": summary, "paths": {"run_dir": f"runs/{run_id}"},
            "extra": {"name": f"recipe={recipe},seed={seed}", "params": {"recipe": recipe, "seed": seed}},
        }
    )  # fmt: skip
    return run_dir


def _rows(path: Path) -> dict[str, dict[str, str]]:
    with path.open() as handle:
        return {row["recipe"]: row for row in csv.DictReader(handle)}


def test_real_sweep_ledger_and_exports(real_sweep, tmp_path):
    report = build_report(real_sweep, sweep="mini")
    written = write_report(report, tmp_path / "out")
    assert {"csv", "md", "html", "loss_curves", "loss_excess", "attn_entropy", "max_logit"} <= set(written)
    rows = _rows(written["csv"])
    assert set(rows) == {"bf16", "nvfp4"}
    assert list(next(iter(rows.values()))) == list(report.ledger.columns)
    bf16, nvfp4 = rows["bf16"], rows["nvfp4"]
    assert float(bf16["excess_pct_mean"]) == 0.0 and float(bf16["excess_pct_last"]) == 0.0
    records = {r["recipe"]: r for r in Catalog(real_sweep).records(sweep="mini")}
    ref = {int(s): v for s, v in records["bf16"]["summary"]["loss_at_steps"].items()}
    run = {int(s): v for s, v in records["nvfp4"]["summary"]["loss_at_steps"].items()}
    common = sorted(set(ref) & set(run))
    expected = [100 * (run[s] - ref[s]) / ref[s] for s in common]
    assert float(nvfp4["excess_pct_mean"]) == pytest.approx(statistics.mean(expected), rel=1e-9)
    assert float(nvfp4["excess_pct_last"]) == pytest.approx(expected[-1], rel=1e-9)
    assert int(nvfp4["excess_last_step"]) == common[-1] == 5
    for recipe, row in rows.items():
        summary = records[recipe]["summary"]
        assert row["n_seeds"] == "1" and row["verdicts"] == "converged x1"
        assert float(row["final_val_loss_mean"]) == pytest.approx(summary["final_val_loss"])
        assert float(row["final_train_loss_mean"]) == pytest.approx(summary["final_train_loss"])
        assert float(row["tokens_per_s_mean"]) == pytest.approx(summary["tokens_per_s"])
    assert "| nvfp4 |" in written["md"].read_text()
    html = written["html"].read_text()
    for name in ("loss_curves", "loss_excess", "attn_entropy", "max_logit"):
        data = written[name].read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
        assert base64.b64encode(data).decode() in html  # the very same PNG is embedded
    assert html.count('src="data:image/png;base64,') == 4
    assert not list((tmp_path / "out").glob(".*.tmp"))  # atomic writes leave no temps
    table = render_ledger(report)
    assert table.row_count == 2 and table.columns[0].header == "recipe"  # no sweep column for one sweep


def test_default_out_dir_is_reports_sweep(real_sweep, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = build_report(real_sweep)  # all sweeps
    written = write_report(report)
    assert written["csv"] == Path("reports/all/ledger.csv") and written["csv"].exists()
    assert report.ledger["sweep"].tolist() == ["mini", "mini"]
    assert [c.header for c in render_ledger(report).columns][:2] == ["sweep", "recipe"]
    assert build_report(real_sweep, "mini").default_out_dir == Path("reports/mini")


def test_seeds_are_grouped_with_mean_and_std(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    base = [5.0, 4.5, 4.0, 3.8]
    _add_run(catalog, tmp_path, "b0", "bf16", 0, base)
    finals = {0: 3.9, 1: 4.1, 2: 4.6}
    for seed, final in finals.items():
        kwargs = {"verdict": "diverged@2", "events": [{"kind": "loss_spike", "step": 2}]} if seed == 2 else {}
        _add_run(catalog, tmp_path, f"n{seed}", "nvfp4", seed, [5.1, 4.6, 4.2, final], **kwargs)
    report = build_report(tmp_path / "sweep_catalog.json", sweep="hand")
    assert report.notes == []
    row = report.ledger.set_index("recipe").loc["nvfp4"]
    assert row["n_seeds"] == 3 and row["seeds"] == "0,1,2"
    vals = [f + 0.1 for f in finals.values()]
    assert row["final_val_loss_mean"] == pytest.approx(statistics.mean(vals))
    assert row["final_val_loss_std"] == pytest.approx(statistics.stdev(vals))
    assert row["final_train_loss_mean"] == pytest.approx(statistics.mean(finals.values()))
    assert row["final_train_loss_std"] == pytest.approx(statistics.stdev(finals.values()))
    assert row["tokens_per_s_mean"] == pytest.approx(101.0)
    assert row["verdicts"] == "converged x2, diverged@2 x1" and row["first_bad_event"] == "loss_spike@2"
    per_run = [statistics.mean([100 * (5.1 - 5.0) / 5.0, 100 * (f - 3.8) / 3.8]) for f in finals.values()]
    assert row["excess_pct_mean"] == pytest.approx(statistics.mean(per_run))
    assert row["excess_pct_last"] == pytest.approx(statistics.mean(100 * (f - 3.8) / 3.8 for f in finals.values()))
    bf16 = report.ledger.set_index("recipe").loc["bf16"]
    assert bf16["n_seeds"] == 1 and math.isnan(bf16["final_val_loss_std"]) and bf16["excess_pct_mean"] == 0
    written = write_report(report, tmp_path / "out")
    assert written["max_logit"].read_bytes().startswith(PNG_MAGIC)


def test_sweep_without_bf16_has_empty_excess_and_says_so(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _add_run(catalog, tmp_path, "m0", "mxfp4", 0, [5.0, 4.0])
    _add_run(catalog, tmp_path, "n0", "nvfp4", 0, [5.0, 4.1])
    report = build_report(tmp_path / "sweep_catalog.json", "hand")
    assert report.ledger["excess_pct_mean"].isna().all() and report.ledger["excess_pct_last"].isna().all()
    assert any("no bf16 run" in note for note in report.notes)
    written = write_report(report, tmp_path / "out")
    assert "loss_excess" not in written and "no bf16 run" in written["md"].read_text()
    assert "no bf16 run" in written["html"].read_text()
    assert all(row["excess_pct_mean"] == "" for row in _rows(written["csv"]).values())


def test_missing_or_corrupt_metrics_are_skipped_with_a_note(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _add_run(catalog, tmp_path, "b0", "bf16", 0, [5.0, 4.0])
    bad = _add_run(catalog, tmp_path, "n0", "nvfp4", 0, [5.0, 4.1])
    (bad / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\n{"step": 1, "lo')
    gone = _add_run(catalog, tmp_path, "m0", "mxfp4", 0, [5.0, 4.2])
    (gone / "metrics.jsonl").unlink()
    report = build_report(tmp_path / "sweep_catalog.json", "hand")
    assert set(report.metrics) == {"b0"}
    assert any(n.startswith("n0: metrics skipped") and "not JSON" in n for n in report.notes)
    assert any(n.startswith("m0: metrics skipped") for n in report.notes)
    assert len(report.ledger) == 3  # the ledger still comes from the catalog summaries
    written = write_report(report, tmp_path / "out")
    assert written["loss_curves"].read_bytes().startswith(PNG_MAGIC)


def test_unknown_sweep_and_missing_catalog_are_clear_value_errors(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _add_run(catalog, tmp_path, "b0", "bf16", 0, [5.0, 4.0])
    with pytest.raises(ValueError, match=r"unknown sweep 'nope'.*sweeps: hand"):
        build_report(tmp_path / "sweep_catalog.json", sweep="nope")
    with pytest.raises(ValueError, match="no catalog"):
        build_report(tmp_path / "missing.json")


def test_excess_pct_helper():
    assert excess_pct({0: 2.0, 10: 1.1}, {0: 2.0, 10: 1.0, 20: 0.9}) == (pytest.approx(5.0), pytest.approx(10.0), 10)
    assert excess_pct({5: 1.0}, {0: 1.0}) == (None, None, None)


def test_import_is_light():
    code = (
        "import sys, fp4lab.lab.report\n"
        "heavy = [m for m in ('torch', 'pandas', 'matplotlib') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
