"""fp4lab.lab.records.report: the recipe ledger (seeds grouped, loss excess vs bf16) and its exports."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from matplotlib import pyplot
from rich.console import Console

from fp4lab.lab.records.catalog import Catalog
from fp4lab.lab.records.report import (
    COLUMN_DOCS,
    build_report,
    divergence_step,
    excess_curves,
    excess_pct,
    plot_figure,
    render_ledger,
    write_report,
)

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
    """One row per step; attention probes every other step and at the last step (as the training loop does)."""
    rows = []
    for step, loss in enumerate(losses):
        row = {"step": step, "loss": loss, "lr": 0.01, "grad_norm": 1.0, "tokens_per_s": 100.0}
        if step % 2 == 0 or step == len(losses) - 1:
            row["attn_entropy"] = [[1.0 + 0.1 * layer + 0.01 * h for h in range(heads)] for layer in range(layers)]
            row["attn_entropy_mean"] = [statistics.mean(r) for r in row["attn_entropy"]]
            row["max_logit"] = [[2.0 + layer + h for h in range(heads)] for layer in range(layers)]
            row["max_logit_max"] = max(max(r) for r in row["max_logit"])
        if step == len(losses) - 1:
            row["val_loss"] = loss + 0.1
        rows.append(json.dumps(row))
    return "\n".join(rows) + "\n"


def _add_run(
    catalog: Catalog, folder: Path, run_id: str, recipe: str, seed: int, losses: list[float], layers: int = 2, **extra
):
    run_dir = folder / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(_metrics_lines(losses, layers))
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
            "git_commit": extra.pop("git_commit", None), "git_dirty": extra.pop("git_dirty", None),
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


def test_torn_lines_are_left_out_and_missing_metrics_skipped_with_a_note(tmp_path):
    # The one rule of every metrics reader: a torn or corrupt line is skipped and counted, the rest kept.
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _add_run(catalog, tmp_path, "b0", "bf16", 0, [5.0, 4.0])
    torn = _add_run(catalog, tmp_path, "n0", "nvfp4", 0, [5.0, 4.1])
    (torn / "metrics.jsonl").write_text('{"step": 0, "loss": 5.0}\nnot json\n{"step": 1.5, "loss": 2}\n{"step": 2, "loss": 4.5}\n{"step": 3, "lo')
    gone = _add_run(catalog, tmp_path, "m0", "mxfp4", 0, [5.0, 4.2])
    (gone / "metrics.jsonl").unlink()
    report = build_report(tmp_path / "sweep_catalog.json", "hand")
    assert set(report.metrics) == {"b0", "n0"}
    assert report.metrics["n0"].steps == [0, 2] and report.metrics["n0"].loss == [5.0, 4.5]
    assert any(n.startswith("n0: 3 torn or corrupt line(s)") for n in report.notes), report.notes
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
        "import sys, fp4lab.lab.records.report\n"
        "heavy = [m for m in ('torch', 'pandas', 'matplotlib') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


# --- the console ledger, plots and HTML page for choosing between recipes ---------------------------------


def _noisy(start: float, key: str, steps: int = 40, noise: float = 0.08) -> list[float]:
    """A decaying loss with deterministic per-step noise of a few percent, like a tiny model's."""
    draw = random.Random(key)
    return [start * math.exp(-step / 25) + 2.0 + draw.uniform(-noise, noise) for step in range(steps)]


def _rendered(renderable, width: int) -> list[str]:
    console = Console(file=io.StringIO(), width=width)  # a file, not a terminal: what a pipe gets
    console.print(renderable)
    return console.file.getvalue().splitlines()


@pytest.fixture
def recipes_catalog(tmp_path) -> Path:
    """bf16, three mxfp4-rowsr-h32 seeds (one with a loss spike), the longest built-in recipe name, nvfp4."""
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _add_run(catalog, tmp_path, "b0", "bf16", 0, _noisy(3.0, "b0"), git_commit="0123456789abcdef0123", git_dirty=False)
    for seed in range(3):
        spike = {"events": [{"kind": "loss_spike", "step": 12}]} if seed == 1 else {}
        _add_run(catalog, tmp_path, f"m{seed}", "mxfp4-rowsr-h32", seed, _noisy(3.0, f"m{seed}"), **spike)
    _add_run(catalog, tmp_path, "l0", "nvfp4-last4-bf16", 0, _noisy(3.1, "l0"), git_commit="fedcba9876", git_dirty=True)
    _add_run(catalog, tmp_path, "n0", "nvfp4", 0, _noisy(3.1, "n0"))
    return tmp_path / "sweep_catalog.json"


@pytest.mark.parametrize("width", [100, 140])
@pytest.mark.parametrize("sweep", ["hand", None])
def test_console_ledger_keeps_recipe_names_whole(recipes_catalog, width, sweep):
    report = build_report(recipes_catalog, sweep=sweep)
    lines = _rendered(render_ledger(report), width)
    assert max(len(line) for line in lines) <= width
    assert not any("…" in line for line in lines)
    cells = [cell.strip() for line in lines for cell in line.split("│")]
    assert {"bf16", "mxfp4-rowsr-h32", "nvfp4-last4-bf16", "nvfp4"} <= set(cells)
    row = next(line for line in lines if "mxfp4-rowsr-h32" in line)
    assert "3" in [cell.strip() for cell in row.split("│")]  # the seed count
    assert any("loss_spike@12" in line for line in lines)  # the first bad event, not folded


def test_cli_report_piped_output_keeps_recipe_names_whole(run_cli, recipes_catalog, tmp_path):
    done = run_cli("report", "hand", "--catalog", str(recipes_catalog), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout and max(len(line) for line in done.stdout.splitlines()) <= 140
    assert "mxfp4-rowsr-h32" in done.stdout and "nvfp4-last4-bf16" in done.stdout


def _centered_mean(values: list[float], window: int) -> list[float]:
    half = window // 2
    return [statistics.mean(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def _excess(run: list[float], ref: list[float]) -> list[float]:
    return [100 * (r - b) / b for r, b in zip(run, ref)]


def test_excess_is_smoothed_with_a_band_of_seed_noise(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    bf16 = {seed: _noisy(3.0, f"bf16-{seed}") for seed in range(2)}
    nvfp4 = {seed: _noisy(3.1, f"nvfp4-{seed}") for seed in range(3)}
    for seed, losses in bf16.items():
        _add_run(catalog, tmp_path, f"b{seed}", "bf16", seed, losses)
    for seed, losses in nvfp4.items():
        _add_run(catalog, tmp_path, f"n{seed}", "nvfp4", seed, losses)
    report = build_report(tmp_path / "sweep_catalog.json", "hand")
    (curve,) = excess_curves(report)
    window = 5  # 40 logged steps: a tenth is 4, the floor is 5
    ref = [statistics.mean(pair) for pair in zip(*bf16.values())]
    per_seed = [_centered_mean(_excess(losses, ref), window) for losses in nvfp4.values()]
    per_bf16 = [_centered_mean(_excess(losses, ref), window) for losses in bf16.values()]
    assert curve.steps == list(range(40))
    assert curve.smoothed == pytest.approx([statistics.mean(v) for v in zip(*per_seed)], rel=1e-9)
    raw = [statistics.mean(v) for v in zip(*(_excess(losses, ref) for losses in nvfp4.values()))]
    assert statistics.pstdev(curve.smoothed) < 0.6 * statistics.pstdev(raw)  # smoothing took out the step noise
    expected_band = [
        math.sqrt(statistics.variance(r) / 3 + statistics.variance(b) / 2)
        for r, b in zip(zip(*per_seed), zip(*per_bf16))
    ]
    assert curve.band == pytest.approx(expected_band, rel=1e-9)
    assert curve.band_label == "seed noise, ±1 s.e. (3 nvfp4 seeds; 2 bf16 seeds)"

    fig = plot_figure(report, "loss_excess")
    try:
        ax = fig.axes[0]
        assert "centered rolling mean over 5 logged steps" in ax.get_title()
        (line,) = [line for line in ax.get_lines() if line.get_label() == "nvfp4, 3 seeds (smoothed)"]
        assert list(line.get_ydata()) == pytest.approx(curve.smoothed, rel=1e-9)
        legend = [text.get_text() for text in ax.get_legend().get_texts()]
        assert "nvfp4, 3 seeds: seed noise, ±1 s.e. (3 nvfp4 seeds; 2 bf16 seeds)" in legend
        (band,) = ax.collections
        top = band.get_paths()[0].vertices[:, 1].max()
        assert top == pytest.approx(max(c + b for c, b in zip(curve.smoothed, curve.band)), rel=1e-6)
    finally:
        pyplot.close(fig)


def test_excess_band_with_one_seed_is_the_step_noise_and_says_so(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    bf16, nvfp4 = _noisy(3.0, "bf16"), _noisy(3.1, "nvfp4")
    _add_run(catalog, tmp_path, "b0", "bf16", 0, bf16)
    _add_run(catalog, tmp_path, "n0", "nvfp4", 0, nvfp4)
    (curve,) = excess_curves(build_report(tmp_path / "sweep_catalog.json", "hand"))
    raw = _excess(nvfp4, bf16)
    residual = [r - s for r, s in zip(raw, _centered_mean(raw, 5))]
    assert curve.band[20] == pytest.approx(statistics.stdev(residual[18:23]), rel=1e-9)
    assert curve.band_label == "step-to-step noise of the raw excess, ±1 std (one seed each)"


def test_probe_series_have_markers_every_probe_step_and_distinct_styles(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    for run_id, recipe in (("b0", "bf16"), ("m0", "mxfp4-rowsr-h32"), ("n0", "nvfp4")):
        _add_run(catalog, tmp_path, run_id, recipe, 0, _noisy(3.0, run_id, steps=61), layers=4)
    report = build_report(tmp_path / "sweep_catalog.json", "hand")
    for which in ("attn_entropy", "max_logit"):
        fig = plot_figure(report, which)
        try:
            lines = fig.axes[0].get_lines()
            assert len(lines) == 12  # 3 runs x 4 layers, as the quickstart
            assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == 12
            assert all(line.get_marker() not in (None, "None", "", ".", ",") for line in lines)
            assert all(list(line.get_xdata()) == [*range(0, 61, 2)] for line in lines)  # the last step (60) too
            legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
            assert legend == ["recipe=bf16,seed=0", "recipe=mxfp4-rowsr-h32,seed=0", "recipe=nvfp4,seed=0",
                              "layer 0", "layer 1", "layer 2", "layer 3"]  # fmt: skip
        finally:
            pyplot.close(fig)


def test_divergence_is_marked_with_an_x_and_named_in_the_legend(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _add_run(catalog, tmp_path, "b0", "bf16", 0, _noisy(3.0, "b0", steps=12))
    losses = _noisy(3.1, "n0", steps=12)
    run_dir = _add_run(catalog, tmp_path, "n0", "nvfp4", 0, losses, verdict="diverged@8",
                       events=[{"kind": "nan", "step": 8}])  # fmt: skip
    (run_dir / "metrics.jsonl").write_text(_metrics_lines([*losses[:8], math.nan, math.nan]))  # the loop stops at a NaN
    report = build_report(tmp_path / "sweep_catalog.json", "hand")
    for which, height in (("loss_curves", losses[7]), ("loss_excess", None), ("attn_entropy", None)):
        fig = plot_figure(report, which)
        try:
            ax = fig.axes[0]
            crosses = [line for line in ax.get_lines() if line.get_marker() == "x"]
            assert crosses and all(list(line.get_xdata()) == [8] for line in crosses)
            if height is not None:
                assert list(crosses[0].get_ydata()) == [pytest.approx(height)]
            legend = [text.get_text() for text in ax.get_legend().get_texts()]
            assert "recipe=nvfp4,seed=0: diverged@8" in legend
        finally:
            pyplot.close(fig)


def test_divergence_step_from_verdict_or_events():
    assert divergence_step({"verdict": "diverged@40", "events": [{"kind": "nan", "step": 41}]}) == 40
    events = [{"kind": "loss_spike", "step": 3}, {"kind": "nan", "step": 9}]
    assert divergence_step({"verdict": "diverged", "events": events}) == 9
    assert divergence_step({"verdict": "diverged"}, last_step=17) == 17
    assert divergence_step({"verdict": "converged", "events": [{"kind": "loss_spike", "step": 3}]}) is None


def test_html_page_stands_on_its_own(recipes_catalog, tmp_path):
    report = build_report(recipes_catalog, "hand")
    written = write_report(report, tmp_path / "out")
    page = written["html"].read_text()
    text = html.unescape(page)
    assert re.search(r"Generated \d{4}-\d\d-\d\d \d\d:\d\d UTC", text)
    for column in report.ledger.columns:
        if column != "sweep":
            assert COLUMN_DOCS[column] in text and f"<code>{column}</code>" in page
    assert "100 × (train loss of the run − bf16 reference) / bf16 reference" in text
    assert "mxfp4-rowsr-h32, 3 seeds: b0 (recipe=bf16,seed=0)" in text  # which bf16 runs each row is compared with
    runs = re.search(r"<h2>Runs</h2>.*", page, re.S).group(0)
    assert runs.count("<tr>") == 1 + len(report.records)
    assert '<code title="0123456789abcdef0123">0123456789ab</code>' in runs and "fedcba9876" in runs
    assert "yes (uncommitted changes)" in runs and "<td>no</td>" in runs and runs.count("<td>unknown</td>") == 8
    assert html.escape('"recipe": "nvfp4-last4-bf16"') in runs and html.escape('"steps": 40') in runs
    assert page.count('src="data:image/png;base64,') == 4 == page.count("<figcaption>")
    assert "centered rolling mean over 5 logged steps" in text
    markdown = written["md"].read_text()
    assert f"- **excess % (mean)**: {COLUMN_DOCS['excess_pct_mean']}" in markdown and "| bf16 runs |" in markdown
