"""fp4lab.lab.records.ledger, plots and render: the recipe ledger (seeds grouped, loss excess vs bf16) and its exports."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import math
import random
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from matplotlib import pyplot
from rich.console import Console
from scipy import stats as scipy_stats

from fp4lab.lab.records.catalog import Catalog
from fp4lab.lab.records.claims import claims_markdown
from fp4lab.lab.records.ledger import COLUMN_DOCS, build_report, excess_pct
from fp4lab.lab.records.plots import PER_LAYER_RUNS, PLOTS, divergence_step, excess_curves, plot_figure, recipe_colour
from fp4lab.lab.records.render import ledger_markdown, render_ledger, write_report
from fp4lab.lab.records.run_metrics import RunMetrics, endpoint_train_loss
from fp4lab.nn.recipe import list_recipes

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[2]


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
            "state": extra.pop("state", "completed"), "verdict": extra.pop("verdict", "converged"), "events": extra.pop("events", []),
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
    for name in ("loss_curves", "loss_excess", "val_excess", "attn_entropy", "max_logit"):
        data = written[name].read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 1000
        assert base64.b64encode(data).decode() in html  # the very same PNG is embedded
    assert html.count('src="data:image/png;base64,') == 5
    assert not list((tmp_path / "out").glob(".*.tmp"))  # atomic writes leave no temps
    table = render_ledger(report)
    assert len(table.rows) == 2 and table.columns[0].header == "recipe"  # no sweep column for one sweep


def test_default_out_dir_is_reports_sweep(real_sweep, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    report = build_report(real_sweep)  # all sweeps
    written = write_report(report)
    assert written["csv"] == Path("reports/all/ledger.csv") and written["csv"].exists()
    assert report.ledger["sweep"].tolist() == ["mini", "mini"]
    table = render_ledger(report)  # all sweeps: one here, named once in the caption instead of on every row
    assert table.columns[0].header == "recipe" and "all rows: sweep mini" in table.caption
    assert build_report(real_sweep, "mini").default_out_dir == Path("reports/mini")


def test_seeds_are_grouped_with_mean_and_std(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    base = [5.0, 4.5, 4.0, 3.8]
    _add_run(catalog, tmp_path, "b0", "bf16", 0, base)
    finals = {0: 3.9, 1: 4.1, 2: 4.6}
    for seed, final in finals.items():
        events = [{"kind": "loss_above_start", "step": 2}, {"kind": "loss_spike", "step": 2}]  # one step: the spike comes first
        kwargs = {"verdict": "diverged@2", "events": events} if seed == 2 else {}
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


def test_steady_throughput_is_the_median_of_the_second_half_of_the_steps(tmp_path):
    """tok/s from the summary counts compilation, probe and evaluation steps; the steady column is the
    median per-step rate over the second half of the steps, mean over the seeds."""
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    paces = {0: 400.0, 1: 500.0}
    for seed, pace in paces.items():
        run_dir = _add_run(catalog, tmp_path, f"b{seed}", "bf16", seed, [5.0, 4.8, 4.6, 4.4, 4.2, 4.0, 3.9, 3.8, 3.7])
        # steps 0-8: compiling (slow) in the first half, one probe step (slow) in the second
        rates = [1.0, 50.0, 300.0, 300.0, pace, pace, 20.0, pace, pace]
        lines = [json.loads(line) | {"tokens_per_s": rate} for line, rate in zip(
            (run_dir / "metrics.jsonl").read_text().splitlines(), rates)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    row = build_report(tmp_path / "sweep_catalog.json").ledger.set_index("recipe").loc["bf16"]
    assert row["steady_tokens_per_s_mean"] == pytest.approx(statistics.mean(paces.values()))
    assert row["tokens_per_s_mean"] == pytest.approx(100.5)  # the summaries' figure, kept beside it


def test_sweep_without_bf16_has_empty_excess_and_says_so(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _add_run(catalog, tmp_path, "m0", "mxfp4", 0, [5.0, 4.0])
    _add_run(catalog, tmp_path, "n0", "nvfp4", 0, [5.0, 4.1])
    report = build_report(tmp_path / "sweep_catalog.json", "hand")
    assert report.ledger["excess_pct_mean"].isna().all() and report.ledger["excess_pct_last"].isna().all()
    assert any("no completed bf16 run" in note for note in report.notes)
    written = write_report(report, tmp_path / "out")
    assert "loss_excess" not in written and "no completed bf16 run" in written["md"].read_text()
    assert "no completed bf16 run" in written["html"].read_text()
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
        "import sys, fp4lab.lab.records.ledger, fp4lab.lab.records.plots, fp4lab.lab.records.render, fp4lab.lab.ratchet.report\n"
        "heavy = [m for m in ('torch', 'pandas', 'matplotlib', 'scipy') if m in sys.modules]\n"
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


@pytest.mark.parametrize("width", [80, 100, 140])
@pytest.mark.parametrize("sweep", ["hand", None])
def test_console_ledger_keeps_recipe_names_whole(recipes_catalog, width, sweep):
    report = build_report(recipes_catalog, sweep=sweep)
    lines = _rendered(render_ledger(report), width)
    assert max(len(line) for line in lines) <= width
    assert not any("…" in line for line in lines)
    cells = [cell.strip() for line in lines for cell in line.split("│")]
    assert {"bf16", "mxfp4-rowsr-h32", "nvfp4-last4-bf16", "nvfp4"} <= set(cells)
    row = lines.index(next(line for line in lines if "mxfp4-rowsr-h32" in line))
    assert "3 seeds" in [cell.strip() for cell in lines[row + 1].split("│")]  # the seed count, under the recipe
    assert any("loss_spike@12" in line for line in lines)  # the first bad event, not folded


def test_each_recipe_has_one_colour_and_one_label_in_every_figure(recipes_catalog):
    """A palette keyed by recipe: the same colour for a recipe in all four figures (and in any other
    report: recipe_colour), distinct recipes distinct colours, legends naming recipes without `key=`,
    validation losses as large diamonds apart from their line's colour."""
    from matplotlib.colors import to_hex

    report = build_report(recipes_catalog, "hand")
    recipes = ("bf16", "mxfp4-rowsr-h32", "nvfp4-last4-bf16", "nvfp4")
    seen: dict[str, set[str]] = {}
    for which in PLOTS:
        fig = plot_figure(report, which)
        try:
            legend = fig.axes[0].get_legend()
            for handle, text in zip(legend.legend_handles, legend.get_texts()):
                label = text.get_text()
                assert "recipe=" not in label and "seed=" not in label, label
                recipe = next((r for r in sorted(recipes, key=len, reverse=True) if label.startswith(r)), None)
                if recipe is not None and hasattr(handle, "get_color"):
                    seen.setdefault(recipe, set()).add(to_hex(handle.get_color()))
            if which == "loss_curves":
                diamonds = [line for line in fig.axes[0].get_lines() if line.get_marker() == "D" and len(line.get_xdata())]
                assert diamonds and all(line.get_markersize() >= 6 and line.get_markeredgecolor() == "white" for line in diamonds)
        finally:
            pyplot.close(fig)
    assert set(seen) == set(recipes)
    assert all(len(colours) == 1 for colours in seen.values()), seen
    assert {r: colours.pop() for r, colours in seen.items()} == {r: to_hex(recipe_colour(r)) for r in recipes}
    assert len({to_hex(recipe_colour(r)) for r in list_recipes()}) == len(list_recipes())  # every built-in its own


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
    assert curve.band_label == "±1 s.e. of seeds (3 nvfp4 seeds; 2 bf16 seeds)"

    fig = plot_figure(report, "loss_excess")
    try:
        ax = fig.axes[0]
        assert "centered rolling mean over 5 logged steps" in ax.get_title()
        (line,) = [line for line in ax.get_lines() if line.get_label() == "nvfp4, 3 seeds\n  band: ±1 s.e. of seeds (3 nvfp4 seeds; 2 bf16 seeds)"]
        assert list(line.get_ydata()) == pytest.approx(curve.smoothed, rel=1e-9)
        legend = [text.get_text() for text in ax.get_legend().get_texts()]
        assert "nvfp4, 3 seeds\n  band: ±1 s.e. of seeds (3 nvfp4 seeds; 2 bf16 seeds)" in legend  # one entry per row
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
    assert curve.band_label == "±1 std of step-to-step noise (one seed each)"


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
            assert legend == ["bf16", "mxfp4-rowsr-h32", "nvfp4", "layer 0", "layer 1", "layer 2", "layer 3"]  # by recipe
        finally:
            pyplot.close(fig)


def test_probe_plots_of_many_runs_draw_each_rows_worst_layer_averaged_over_its_seeds(tmp_path):
    # Past PER_LAYER_RUNS runs a line per layer per run is unreadable (the 57-run ledger drew 684 lines).
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    recipes = ("bf16", "mxfp4", "nvfp4", "nvfp4-all")
    for recipe, seed in ((r, s) for r in recipes for s in range(3)):
        run_dir = _add_run(catalog, tmp_path, f"{recipe}-{seed}", recipe, seed, _noisy(3.0, recipe, steps=9), layers=4)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        for row in rows:
            if "attn_entropy" in row:  # layer 0 lowest, layer 3 highest; each seed shifts every layer
                row["attn_entropy"] = [[1.0 + 0.1 * layer + 0.2 * seed] for layer in range(4)]
                row["attn_entropy_mean"] = [1.0 + 0.1 * layer + 0.2 * seed for layer in range(4)]
                row["max_logit"] = [[2.0 + layer + seed] for layer in range(4)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert len(recipes) * 3 > PER_LAYER_RUNS
    report = build_report(tmp_path / "sweep_catalog.json", "hand")
    for which, expected in (("attn_entropy", 1.0 + 0.2), ("max_logit", 5.0 + 1)):  # mean of seeds 0, 1, 2
        fig = plot_figure(report, which)
        try:
            lines = fig.axes[0].get_lines()
            assert len(lines) == len(recipes)
            assert len({(line.get_color(), line.get_linestyle()) for line in lines}) == len(recipes)
            for line in lines:
                assert list(line.get_xdata()) == [0, 2, 4, 6, 8]
                assert list(line.get_ydata()) == pytest.approx([expected] * 5, rel=1e-12)
            legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
            assert sorted(legend) == sorted(f"{r}, 3 seeds" for r in recipes)
            assert ("lowest" if which == "attn_entropy" else "highest") in fig.axes[0].get_title()
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
            assert "nvfp4: diverged@8" in legend
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
    assert "mxfp4-rowsr-h32, 3 seeds: b0 (bf16)" in text  # which bf16 runs each row is compared with
    runs = re.search(r"<h2>Runs</h2>.*", page, re.S).group(0)
    assert runs.count("<tr>") == 1 + len(report.records)
    assert '<code title="0123456789abcdef0123">0123456789ab</code>' in runs and "fedcba9876" in runs
    assert "yes (uncommitted changes)" in runs and "<td>no</td>" in runs and runs.count("<td>unknown</td>") == 8
    assert html.escape('"recipe": "nvfp4-last4-bf16"') in runs and html.escape('"steps": 40') in runs
    assert page.count('src="data:image/png;base64,') == 5 == page.count("<figcaption>")
    assert "centered rolling mean over 5 logged steps" in text
    markdown = written["md"].read_text()
    assert f"- **excess % (mean)**: {COLUMN_DOCS['excess_pct_mean']}" in markdown and "| bf16 runs |" in markdown


# --- seed noise: the spread of the excess and whether a recipe differs from bf16 beyond it ----------------

T_975_DF4 = 2.7764451051977987  # Student's t, 97.5 % quantile, 4 degrees of freedom (any t table: 2.776)


def _paired_ci_pct(values: list[float], reference: list[float]) -> tuple[float, float]:
    """The t-interval of the mean per-seed difference (values[i] and reference[i] share a seed) in % of
    mean(reference), written out."""
    diffs = [v - r for v, r in zip(values, reference)]
    half = scipy_stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    ref = statistics.mean(reference)
    return 100 * (statistics.mean(diffs) - half) / ref, 100 * (statistics.mean(diffs) + half) / ref


def _welch_ci_pct(values: list[float], reference: list[float]) -> tuple[float, float]:
    """Welch's 95 % interval of mean(values) - mean(reference) in % of mean(reference), written out."""
    se2_a, se2_b = statistics.variance(values) / len(values), statistics.variance(reference) / len(reference)
    df = (se2_a + se2_b) ** 2 / (se2_a**2 / (len(values) - 1) + se2_b**2 / (len(reference) - 1))
    half = scipy_stats.t.ppf(0.975, df) * math.sqrt(se2_a + se2_b)
    ref = statistics.mean(reference)
    diff = statistics.mean(values) - ref
    return 100 * (diff - half) / ref, 100 * (diff + half) / ref


# recipe -> (first train loss, final train loss) of each seed; the final val loss is the final train loss + 0.1
SEED_NOISE_RUNS = {
    "bf16": [(5.0, 2.98), (5.1, 3.00), (4.9, 3.02)],
    "nvfp4": [(5.2, 3.18), (5.3, 3.20), (5.1, 3.22)],  # clearly above bf16, the same spread
    "mxfp4": [(5.0, 2.95), (5.2, 3.01), (5.1, 3.10)],  # overlaps bf16, a wider spread
    "mxfp4-rowsr-h32": [(4.8, 2.80), (4.9, 2.82), (4.7, 2.85)],  # clearly below
    "nvfp4-last4-bf16": [(5.0, 3.00)],  # one seed: nothing to conclude
}


@pytest.fixture
def seed_noise_catalog(tmp_path) -> Path:
    """The bf16 runs have seeds 10-12, the recipes 0-2: no seed is shared, so every interval is Welch's
    (`test_matched_seeds_are_compared_pair_by_pair` has the paired one)."""
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    for recipe, runs in SEED_NOISE_RUNS.items():
        for index, (first, final) in enumerate(runs):
            seed = index + 10 if recipe == "bf16" else index
            _add_run(catalog, tmp_path, f"{recipe}-{index}", recipe, seed, [first, 4.0, final])
    return tmp_path / "sweep_catalog.json"


def _vals(recipe: str) -> list[float]:
    return [final + 0.1 for _, final in SEED_NOISE_RUNS[recipe]]


def test_excess_spread_over_seeds_and_val_excess(seed_noise_catalog):
    ledger = build_report(seed_noise_catalog, "hand").ledger.set_index("recipe")
    ref_first = statistics.mean(first for first, _ in SEED_NOISE_RUNS["bf16"])
    ref_final = statistics.mean(final for _, final in SEED_NOISE_RUNS["bf16"])
    ref_val = statistics.mean(_vals("bf16"))
    for recipe in ("nvfp4", "mxfp4", "mxfp4-rowsr-h32"):
        row = ledger.loc[recipe]
        lasts = [100 * (final - ref_final) / ref_final for _, final in SEED_NOISE_RUNS[recipe]]
        means = [statistics.mean([100 * (first - ref_first) / ref_first, last])
                 for (first, _), last in zip(SEED_NOISE_RUNS[recipe], lasts)]  # fmt: skip
        val_excess = [100 * (v - ref_val) / ref_val for v in _vals(recipe)]
        assert row["excess_pct_mean"] == pytest.approx(statistics.mean(means), rel=1e-9)
        assert row["excess_pct_std"] == pytest.approx(statistics.stdev(means), rel=1e-9)
        assert row["excess_pct_last"] == pytest.approx(statistics.mean(lasts), rel=1e-9)
        assert row["excess_pct_last_std"] == pytest.approx(statistics.stdev(lasts), rel=1e-9)
        assert row["val_excess_pct_mean"] == pytest.approx(statistics.mean(val_excess), rel=1e-9)
        assert row["val_excess_pct_std"] == pytest.approx(statistics.stdev(val_excess), rel=1e-9)
    # by hand: nvfp4's seeds sit 0.20 above bf16's (3.30 vs 3.10), each side with std 0.02
    assert ledger.loc["nvfp4", "val_excess_pct_mean"] == pytest.approx(100 * 0.2 / 3.1, rel=1e-9)
    assert ledger.loc["nvfp4", "val_excess_pct_std"] == pytest.approx(100 * 0.02 / 3.1, rel=1e-9)
    assert ledger.loc["nvfp4", "excess_pct_last_std"] == pytest.approx(100 * 0.02 / 3.0, rel=1e-9)
    single = ledger.loc["nvfp4-last4-bf16"]
    assert single["val_excess_pct_mean"] == pytest.approx(0, abs=1e-9)  # its 3.10 is bf16's mean
    assert all(math.isnan(single[c]) for c in ("excess_pct_std", "excess_pct_last_std", "val_excess_pct_std"))
    bf16 = ledger.loc["bf16"]  # bf16 against itself: no excess on average, its own seed spread
    assert bf16["val_excess_pct_mean"] == pytest.approx(0, abs=1e-9)
    assert bf16["val_excess_pct_std"] == pytest.approx(100 * statistics.stdev(_vals("bf16")) / ref_val, rel=1e-9)


def test_welch_interval_says_above_below_within_noise_or_n_a(seed_noise_catalog):
    ledger = build_report(seed_noise_catalog, "hand").ledger.set_index("recipe")
    # by hand: equal spreads and three seeds a side make Welch's degrees of freedom exactly 4
    half = T_975_DF4 * math.sqrt(0.02**2 / 3 + 0.02**2 / 3)
    assert (100 * (0.2 - half) / 3.1, 100 * (0.2 + half) / 3.1) == pytest.approx((4.989059, 7.914166), abs=1e-6)
    assert ledger.loc["nvfp4", "val_excess_ci95"] == "+4.99..+7.91"
    expected = {"nvfp4": "above", "mxfp4": "within noise", "mxfp4-rowsr-h32": "below"}
    for recipe, verdict in expected.items():
        low, high = _welch_ci_pct(_vals(recipe), _vals("bf16"))
        direct = scipy_stats.ttest_ind(_vals(recipe), _vals("bf16"), equal_var=False).confidence_interval()
        assert (low, high) == pytest.approx((100 * direct.low / 3.1, 100 * direct.high / 3.1), rel=1e-9)
        assert ledger.loc[recipe, "val_excess_ci95"] == f"{low:+.2f}..{high:+.2f}"
        assert ledger.loc[recipe, "vs_bf16"] == verdict
    assert ledger.loc["mxfp4", "val_excess_ci95"] == "-4.93..+6.22"  # Student's pooled t: -3.39..+4.68
    assert ledger.loc["mxfp4-rowsr-h32", "val_excess_ci95"] == "-7.40..-4.00"
    single = ledger.loc["nvfp4-last4-bf16"]
    assert single["vs_bf16"] == "n/a" and pd.isna(single["val_excess_ci95"])
    assert pd.isna(ledger.loc["bf16", "vs_bf16"]) and pd.isna(ledger.loc["bf16", "val_excess_ci95"])


def test_vs_bf16_is_n_a_with_one_bf16_seed_or_no_bf16(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _add_run(catalog, tmp_path, "b0", "bf16", 0, [5.0, 3.0])
    for seed, final in enumerate((3.2, 3.3, 3.25)):
        _add_run(catalog, tmp_path, f"n{seed}", "nvfp4", seed, [5.0, final])
        _add_run(catalog, tmp_path, f"m{seed}", "mxfp4", seed, [5.0, final], sweep="no-bf16")
    one_bf16 = build_report(tmp_path / "sweep_catalog.json", "hand").ledger.set_index("recipe")
    assert one_bf16.loc["nvfp4", "vs_bf16"] == "n/a" and pd.isna(one_bf16.loc["nvfp4", "val_excess_ci95"])
    assert one_bf16.loc["nvfp4", "val_excess_pct_mean"] == pytest.approx(100 * (3.25 - 3.0) / 3.1, rel=1e-9)
    no_bf16 = build_report(tmp_path / "sweep_catalog.json", "no-bf16").ledger.iloc[0]
    assert no_bf16["vs_bf16"] == "n/a" and math.isnan(no_bf16["val_excess_pct_mean"])


def test_matched_seeds_are_compared_pair_by_pair(tmp_path):
    """A seed fixes the initial weights and the batches in every recipe: where a row and its bf16 runs
    ran the same seeds the interval is the paired one, which a shared seed effect does not widen; a row
    missing one of the seeds falls back to Welch's."""
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    bf16, nvfp4 = [3.00, 3.10, 3.20], [3.05, 3.16, 3.24]  # seed effects of 0.1 shared; nvfp4 0.04-0.06 above
    for seed, (a, b) in enumerate(zip(bf16, nvfp4)):
        _add_run(catalog, tmp_path, f"b{seed}", "bf16", seed, [5.0, a])
        _add_run(catalog, tmp_path, f"n{seed}", "nvfp4", seed, [5.0, b])
        if seed < 2:
            _add_run(catalog, tmp_path, f"m{seed}", "mxfp4", seed, [5.0, b])
    ledger = build_report(tmp_path / "sweep_catalog.json", "hand").ledger.set_index("recipe")
    vals = {name: [v + 0.1 for v in losses] for name, losses in (("bf16", bf16), ("nvfp4", nvfp4))}
    low, high = _paired_ci_pct(vals["nvfp4"], vals["bf16"])
    assert (low, high) == pytest.approx((0.786, 2.339), abs=1e-3)  # by hand: 0.05 ± 4.303 x 0.01 / sqrt(3), of 3.2
    assert ledger.loc["nvfp4", "val_excess_ci95"] == f"{low:+.2f}..{high:+.2f}" and ledger.loc["nvfp4", "ci_test"] == "paired"
    assert ledger.loc["nvfp4", "vs_bf16"] == "above"
    welch_low, welch_high = _welch_ci_pct(vals["nvfp4"], vals["bf16"])
    assert welch_low < 0 < welch_high  # unpaired, the shared seed effect hides the difference
    low, high = _welch_ci_pct(vals["nvfp4"][:2], vals["bf16"])
    assert ledger.loc["mxfp4", "ci_test"] == "welch" and ledger.loc["mxfp4", "val_excess_ci95"] == f"{low:+.2f}..{high:+.2f}"
    assert pd.isna(ledger.loc["bf16", "ci_test"])


def test_seed_noise_columns_in_every_export_and_the_markdown_is_reproducible(seed_noise_catalog, tmp_path):
    report = build_report(seed_noise_catalog, "hand")
    written = write_report(report, tmp_path / "out")
    rows = _rows(written["csv"])
    assert rows["nvfp4"]["val_excess_ci95"] == "+4.99..+7.91" and rows["nvfp4"]["vs_bf16"] == "above"
    assert rows["bf16"]["val_excess_ci95"] == "" and rows["bf16"]["vs_bf16"] == ""
    assert float(rows["nvfp4"]["val_excess_pct_std"]) == pytest.approx(100 * 0.02 / 3.1, rel=1e-9)
    assert rows["nvfp4-last4-bf16"]["vs_bf16"] == "n/a" and rows["nvfp4-last4-bf16"]["excess_pct_std"] == ""

    markdown = written["md"].read_text()
    assert markdown == ledger_markdown(build_report(seed_noise_catalog, "hand"))  # built again: the same bytes
    lines = markdown.splitlines()
    assert lines[2] == (
        "| recipe | config | seeds | completed | seed list | val loss | ± std | train loss | ± std | excess % (mean) | ± std "
        "| excess % (last) | ± std | @step | val excess % | ± std | val excess 95 % CI | ci test | vs bf16 | bf16 runs | tok/s "
        "| steady tok/s | verdicts | first event | runs |"
    )
    nvfp4 = lines[5]
    assert nvfp4.startswith("| nvfp4 | default | 3 | 3 | 0,1,2 | 3.3000 | 0.0200 | 3.2000 | 0.0200 |")
    assert nvfp4.endswith("| 6.45 | 0.65 | +4.99..+7.91 | welch | above | bf16-0 bf16-1 bf16-2 | 101.0 | 100.0 | converged x3 |  "
                          "| nvfp4-0 nvfp4-1 nvfp4-2 |")  # fmt: skip
    assert f"- **vs bf16**: {COLUMN_DOCS['vs_bf16']}" in markdown and "Welch's t-test" in markdown
    text = html.unescape(written["html"].read_text())
    assert "<td>+4.99..+7.91</td><td>welch</td><td>above</td>" in text and COLUMN_DOCS["val_excess_ci95"] in text

    lines = _rendered(render_ledger(build_report(seed_noise_catalog)), 100)  # every sweep: the widest table
    assert max(len(line) for line in lines) <= 100 and not any("…" in line for line in lines)
    index = next(i for i, line in enumerate(lines) if "│ nvfp4 " in line)
    first, second = ([cell.strip() for cell in line.split("│")] for line in lines[index : index + 2])
    row = report.ledger.set_index("recipe").loc["nvfp4"]
    assert f"{row['excess_pct_mean']:+.2f}" in first and f"±{row['excess_pct_std']:.2f}" in second
    assert "above" in first and "+4.99..+7.91" in second
    assert f"{row['val_excess_pct_mean']:+.2f}" in first  # the table leads with the validation excess
    assert any(line.strip().startswith("vs bf16: 95 % CI of the val-loss difference of means") for line in lines)


CLAIMS = """
[[claim]]
recipe = "nvfp4"
excess_pct = 6.0
source = "inside the interval"

[[claim]]
recipe = "mxfp4-rowsr-h32"
excess_pct = 2.11
source = "above the interval (which lies below bf16)"

[[claim]]
recipe = "nvfp4"
excess_pct = 1.0
source = "below the interval"

[[claim]]
recipe = "nvfp4-last4-bf16"
excess_pct = 0.87
source = "one seed"

[[claim]]
recipe = "nvfp4-all"
excess_pct = 1.34
source = "not in the ledger"
"""


def test_claims_are_set_against_the_welch_interval_of_their_recipe(seed_noise_catalog, run_cli, tmp_path):
    """Each claim gets its recipe's measured val excess and Welch interval (the ledger row's, as numbers)
    and a verdict: agrees inside it, smaller/larger here when the interval lies below/above the claim, n/a with one seed (its excess shown, with no interval), not run without a row;
    `fp4lab report --claims` writes claims.csv, a section of ledger.md and the JSON rows."""
    from fp4lab.lab.records.claims import check_claims, load_claims

    claims_file = tmp_path / "claims.toml"
    claims_file.write_text(CLAIMS)
    # an interrupted seed, its last validation far above: not a final loss, left out of the claims
    _add_run(Catalog(seed_noise_catalog), tmp_path, "nvfp4-3", "nvfp4", 3, [5.0, 4.9, 4.8], state="interrupted")
    table = check_claims(build_report(seed_noise_catalog, "hand"), load_claims(claims_file))
    assert table["verdict"].tolist() == ["agrees", "smaller here", "larger here", "n/a", "not run"]
    nvfp4 = table.iloc[0]
    low, high = _welch_ci_pct(_vals("nvfp4"), _vals("bf16"))
    assert (nvfp4["measured_ci95_low"], nvfp4["measured_ci95_high"]) == (pytest.approx(low), pytest.approx(high))
    ref = statistics.mean(_vals("bf16"))
    assert nvfp4["measured_excess_pct"] == pytest.approx(statistics.mean(100 * (v - ref) / ref for v in _vals("nvfp4")))
    assert nvfp4["n_seeds"] == 3 and nvfp4["n_versus"] == 3 and nvfp4["versus"] == "bf16" and nvfp4["metric"] == "val"
    assert table.iloc[1]["measured_ci95_high"] < 0 < 2.11  # mxfp4-rowsr-h32 is below bf16 here: smaller than claimed
    assert table.iloc[2]["measured_ci95_low"] > 1.0
    one_seed = table.iloc[3]  # how far one seed lies from the reference, with no interval to say how sure
    (last4,) = _vals("nvfp4-last4-bf16")
    assert one_seed["measured_excess_pct"] == pytest.approx(100 * (last4 - ref) / ref)
    assert pd.isna(one_seed["measured_ci95_low"]) and pd.isna(one_seed["measured_excess_std"]) and one_seed["n_seeds"] == 1
    assert pd.isna(table.iloc[4]["measured_excess_pct"])

    out = tmp_path / "out"
    done = run_cli("report", "hand", "--catalog", str(seed_noise_catalog), "--out", str(out), "--claims", str(claims_file), "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)
    assert [row["verdict"] for row in document["claims"]] == table["verdict"].tolist()
    assert (out / "claims.csv").exists() and "## Claims" in (out / "ledger.md").read_text()
    assert "| nvfp4 | bf16 | val | default | inside the interval | +6.00 |" in (out / "ledger.md").read_text()


VERSUS_CLAIMS = """
[[claim]]
recipe = "nvfp4"
versus = "mxfp4-rowsr-h32"
direction = "above"
source = "agrees: nvfp4 sits well above mxfp4-rowsr-h32"

[[claim]]
recipe = "mxfp4-rowsr-h32"
versus = "nvfp4"
direction = "above"
source = "opposite here"

[[claim]]
recipe = "mxfp4"
metric = "train"
direction = "below"
source = "within noise: mxfp4 overlaps bf16"

[[claim]]
recipe = "nvfp4"
versus = "mxfp4-rowsr-h32"
metric = "train"
excess_pct = 13.0
source = "a number against another recipe, on the endpoint train loss"

[[claim]]
recipe = "nvfp4"
versus = "nvfp4-all"
excess_pct = 1.0
source = "its reference is not in the ledger"
"""


def test_claims_against_another_recipe_by_direction_and_on_the_endpoint_train_loss(seed_noise_catalog, tmp_path):
    """versus: the reference is another recipe's row; direction: agrees only when the whole interval lies
    on the claimed side of 0; metric train: the endpoint train loss (here each run's last logged loss)."""
    from fp4lab.lab.records.claims import check_claims, load_claims

    claims_file = tmp_path / "claims.toml"
    claims_file.write_text(VERSUS_CLAIMS)
    # an interrupted seed, its last losses far above: no endpoint train loss of a finished run, left out
    _add_run(Catalog(seed_noise_catalog), tmp_path, "nvfp4-3", "nvfp4", 3, [5.0, 4.9, 4.8], state="interrupted")
    table = check_claims(build_report(seed_noise_catalog, "hand"), load_claims(claims_file))
    assert table["verdict"].tolist() == ["agrees", "opposite here", "within noise", "agrees", "not run"]
    above = table.iloc[0]  # nvfp4 and mxfp4-rowsr-h32 ran seeds 0-2 both: compared pair by pair
    low, high = _paired_ci_pct(_vals("nvfp4"), _vals("mxfp4-rowsr-h32"))
    assert (above["measured_ci95_low"], above["measured_ci95_high"]) == (pytest.approx(low), pytest.approx(high))
    assert above["n_versus"] == 3 and above["claimed_direction"] == "above" and math.isnan(above["claimed_excess_pct"])
    finals = {recipe: [final for _, final in runs] for recipe, runs in SEED_NOISE_RUNS.items()}
    train = table.iloc[3]  # the endpoint train losses are the finals, not the val losses (0.1 above them)
    low, high = _paired_ci_pct(finals["nvfp4"], finals["mxfp4-rowsr-h32"])
    assert (train["measured_ci95_low"], train["measured_ci95_high"]) == (pytest.approx(low), pytest.approx(high))
    assert train["ci_test"] == "paired" and table.iloc[2]["ci_test"] == "welch"  # mxfp4 vs bf16: no shared seed
    ref = statistics.mean(finals["mxfp4-rowsr-h32"])
    assert train["measured_excess_pct"] == pytest.approx(statistics.mean(100 * (v - ref) / ref for v in finals["nvfp4"]))
    assert low < 13.0 < high and train["metric"] == "train"
    markdown = claims_markdown(table)
    assert "| nvfp4 | mxfp4-rowsr-h32 | val | default | agrees: nvfp4 sits well above mxfp4-rowsr-h32 | above |" in markdown
    assert f"| {low:+.2f}..{high:+.2f} | paired | 3 | 3 | agrees |" in markdown


def test_the_endpoint_train_loss_is_the_mean_over_the_last_tenth_of_the_logged_steps():
    assert endpoint_train_loss(RunMetrics(steps=list(range(20)), loss=[5.0] * 18 + [3.0, 2.0])) == 2.5
    assert endpoint_train_loss(RunMetrics(steps=list(range(21)), loss=[5.0] * 18 + [4.0, 3.0, 2.0])) == 3.0
    assert endpoint_train_loss(RunMetrics(steps=[0, 1, 2], loss=[5.0, 4.0, 3.0])) == 3.0
    assert endpoint_train_loss(RunMetrics()) is None and endpoint_train_loss(None) is None


@pytest.mark.parametrize("text, message", [
    ("[[claim]]\nrecipe = 'nvfp4'\nsource = 's'\n", "claim 1: give exactly one of excess_pct"),
    ("[[claim]]\nrecipe = 'nvfp4'\nexcess_pct = 1.0\ndirection = 'above'\nsource = 's'\n", "claim 1: give exactly one of excess_pct"),
    ("[[claim]]\nrecipe = 'nvfp4'\nexcess_pct = 'x'\nsource = 's'\n", "claim 1: excess_pct must be a finite number"),
    ("[[claim]]\nrecipe = 'nvfp4'\ndirection = 'up'\nsource = 's'\n", "claim 1: direction='up'; allowed: 'above', 'below'"),
    ("[[claim]]\nrecipe = 'nvfp4'\nexcess_pct = 1.0\nmetric = 'loss'\nsource = 's'\n", "claim 1: metric='loss'; allowed: 'val'"),
    ("[[claim]]\nrecipe = 'nvfp4'\nexcess_pct = 1.0\nversus = 'nvfp4'\nsource = 's'\n", "claim 1: versus must name the reference recipe"),
    ("[[claim]]\nrecipe = 'nvfp4'\nexcess_pct = 1.0\nsource = 's'\npaper = 'x'\n", "claim 1.paper: unknown key"),
    ("[[claim]]\nrecipe = ''\nexcess_pct = 1.0\nsource = 's'\n", "claim 1: recipe must be a non-empty string"),
    ("title = 'x'\n", "title: unknown key"),
    ("claim = 3\n", "no claims; add [[claim]] tables"),
    ("[[claim\n", "not valid TOML"),
])  # fmt: skip
def test_a_malformed_claims_file_is_refused_before_anything_is_written(seed_noise_catalog, run_cli, tmp_path, text, message):
    claims_file = tmp_path / "claims.toml"
    claims_file.write_text(text)
    out = tmp_path / "out"
    done = run_cli("report", "hand", "--catalog", str(seed_noise_catalog), "--out", str(out), "--claims", str(claims_file))
    assert done.returncode == 2 and message in done.stderr and str(claims_file) in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()
    missing = run_cli("report", "hand", "--catalog", str(seed_noise_catalog), "--claims", str(tmp_path / "none.toml"))
    assert missing.returncode == 2 and "claims file" in missing.stderr and "does not exist" in missing.stderr


def test_losses_and_throughput_come_from_completed_runs_only(tmp_path):
    catalog = Catalog(tmp_path / "c.json")
    for seed in (0, 1):
        _add_run(catalog, tmp_path, f"b{seed}", "bf16", seed, [4.0, 3.0 + 0.01 * seed])
        _add_run(catalog, tmp_path, f"n{seed}", "nvfp4", seed, [4.0, 3.1 + 0.01 * seed])
    # cut short by a time limit at a high loss: its last validation is not a final loss
    _add_run(catalog, tmp_path, "n2", "nvfp4", 2, [4.0, 3.9], state="interrupted", verdict="timeout")
    _add_run(catalog, tmp_path, "b2", "bf16", 2, [4.0, 2.0], state="interrupted", verdict="timeout")
    report = build_report(tmp_path / "c.json")
    ledger = report.ledger.set_index("recipe")
    row = ledger.loc["nvfp4"]
    assert row["n_seeds"] == 3 and row["n_completed"] == 2 and "timeout x1" in row["verdicts"] and "n2" in row["runs"]
    console = Console(file=io.StringIO(), width=140)
    console.print(render_ledger(report))
    assert "2 of 3" in console.file.getvalue()
    (curve,) = excess_curves(report)  # the seed-noise band over the completed runs, as the table
    assert curve.run_ids == ["n0", "n1"] and curve.label == "nvfp4 (hand), 2 seeds" and "2 nvfp4 seeds" in curve.band_label
    assert row["final_val_loss_mean"] == pytest.approx(3.205)  # (3.2 + 3.21) / 2: the interrupted 4.0 left out
    assert row["baseline_runs"] == "b0 b1"
    assert row["val_excess_pct_mean"] == pytest.approx(100 * (3.205 - 3.105) / 3.105)
    assert row["tokens_per_s_mean"] == pytest.approx(100.5)


def test_loss_curves_go_on_a_log_axis_when_a_run_blew_up_by_decades(tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    _add_run(catalog, tmp_path, "b0", "bf16", 0, [5.0, 4.0, 3.5, 3.2])
    _add_run(catalog, tmp_path, "n0", "nvfp4", 0, [5.1, 4.1, 3.6, 3.3])
    tame = build_report(tmp_path / "sweep_catalog.json", "hand")
    _add_run(catalog, tmp_path, "n1", "nvfp4", 1, [5.2, 60.0, 900.0, 3000.0], verdict="diverged@1")
    wild = build_report(tmp_path / "sweep_catalog.json", "hand")
    for report, scale in ((tame, "linear"), (wild, "log")):
        fig = plot_figure(report, "loss_curves")
        try:
            assert fig.axes[0].get_yscale() == scale
        finally:
            pyplot.close(fig)


def test_rows_whose_bands_are_of_one_kind_say_it_once_in_the_legend(tmp_path):
    """One legend line per row (the ledger's 18 rows took more than the figure's height with the band
    named on each), the band's kind said once."""
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    for run_id, recipe in (("b0", "bf16"), ("m0", "mxfp4-rowsr-h32"), ("n0", "nvfp4")):
        _add_run(catalog, tmp_path, run_id, recipe, 0, _noisy(3.0, run_id))
    fig = plot_figure(build_report(tmp_path / "sweep_catalog.json", "hand"), "loss_excess")
    try:
        legend = [text.get_text() for text in fig.axes[0].get_legend().get_texts()]
        assert legend == ["mxfp4-rowsr-h32", "nvfp4", "bands: ±1 std of step-to-step noise, each row's own", "bf16 (the reference, 0 %)"]
    finally:
        pyplot.close(fig)


def _add_val_run(catalog: Catalog, folder: Path, run_id: str, recipe: str, seed: int, val: dict[int, float], config: dict | None = None):
    """A completed run whose metrics.jsonl has a train loss every 50 steps and a val_loss at each `val` step."""
    run_dir = folder / "runs" / run_id
    run_dir.mkdir(parents=True)
    last = max(val)
    rows = [{"step": s, "loss": 4.0, "tokens_per_s": 100.0} | ({"val_loss": val[s]} if s in val else {}) for s in range(0, last + 1, 50)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    catalog.upsert({
        "id": run_id, "sweep": "horizon", "recipe": recipe, "state": "completed", "verdict": "converged", "events": [],
        "config": {"recipe": recipe, "model": "tiny", "seed": seed, "steps": last, "out_dir": f"runs/{run_id}", **(config or {})},
        "summary": {"final_train_loss": 4.0, "final_val_loss": val[last], "tokens_per_s": 100.0},
        "paths": {"run_dir": f"runs/{run_id}"}, "extra": {"params": {"recipe": recipe, "seed": seed}},
    })  # fmt: skip


def test_the_excess_against_tokens_and_its_trend_over_seeds(tmp_path):
    """val_excess: each eval's validation excess over the bf16 seeds' mean at that step, against tokens
    seen (steps x batch x seq); the trend is the mean of the seeds' own least-squares slopes against
    log10(tokens), its error the standard error of those slopes; one seed: the fit's own error. The
    ledger's Markdown states it; the plot draws it on a log axis."""
    import numpy as np

    from fp4lab.lab.records.plots import horizon_curves

    catalog = Catalog(tmp_path / "sweep_catalog.json")
    shape = {"batch_size": 4, "seq_len": 64}
    steps = [100, 200, 400, 800, 1600]
    for seed in (0, 1):
        _add_val_run(catalog, tmp_path, f"b{seed}", "bf16", seed, {s: 3.0 + 0.01 * seed for s in steps}, shape)
    reference = 3.005  # the bf16 seeds' mean at every eval
    slopes = {0: 0.8, 1: 1.4}  # points per 10x tokens
    wanted = {}
    for seed, slope in slopes.items():
        excess = {s: 1.0 + slope * math.log10((s + 1) * 256) + (0.3 if s == 400 else 0.0) * (1 - 2 * seed) for s in steps}
        _add_val_run(catalog, tmp_path, f"n{seed}", "nvfp4", seed, {s: reference * (1 + e / 100) for s, e in excess.items()}, shape)
        wanted[seed] = np.polyfit([math.log10((s + 1) * 256) for s in steps], [excess[s] for s in steps], 1)[0]
    one = {s: 2.0 - 0.5 * math.log10((s + 1) * 256) + (0.2 if s == 200 else 0.0) for s in steps}
    _add_val_run(catalog, tmp_path, "m0", "mxfp4", 0, {s: reference * (1 + e / 100) for s, e in one.items()}, shape)

    report = build_report(tmp_path / "sweep_catalog.json", sweep="horizon")
    curves = {report.ledger.iloc[c.index]["recipe"]: c for c in horizon_curves(report)}
    nv, mx = curves["nvfp4"], curves["mxfp4"]
    assert nv.in_tokens and nv.tokens == [(s + 1) * 256.0 for s in steps] and nv.seeds == 2  # step s: s + 1 steps done
    assert nv.slope == pytest.approx(statistics.mean(wanted.values()), abs=1e-9)
    assert nv.slope_se == pytest.approx(statistics.stdev(wanted.values()) / math.sqrt(2), abs=1e-9)
    assert nv.mean[2] == pytest.approx(statistics.mean(1.0 + slopes[k] * math.log10(401 * 256) for k in (0, 1)), abs=1e-9)
    assert nv.band[2] == pytest.approx(statistics.stdev(1.0 + slopes[k] * math.log10(401 * 256) + 0.3 * (1 - 2 * k) for k in (0, 1)) / math.sqrt(2), abs=1e-9)
    x = [math.log10((s + 1) * 256) for s in steps]
    fit, cov = np.polyfit(x, [one[s] for s in steps], 1, cov="unscaled")
    residual = sum((one[s] - np.polyval(fit, xi)) ** 2 for s, xi in zip(steps, x))
    assert mx.seeds == 1 and math.isnan(mx.band[0])
    assert mx.slope == pytest.approx(fit[0], abs=1e-9) and mx.slope_se == pytest.approx(math.sqrt(cov[0][0] * residual / 3), abs=1e-9)

    markdown = ledger_markdown(report)
    assert "## Excess against tokens" in markdown and "in tokens seen" in markdown
    assert f"| {nv.label} | 5 | 25,856 | {nv.mean[0]:+.2f} | 409,856 | {nv.mean[-1]:+.2f} | {nv.slope:+.2f} ± {nv.slope_se:.2f} pts per 10x tokens |" in markdown
    fig = plot_figure(report, "val_excess")
    try:
        ax = fig.axes[0]
        assert ax.get_xscale() == "log" and ax.get_xlabel() == "tokens seen"
        labels = [line.get_label() for line in ax.get_lines()]
        assert any(label.startswith("nvfp4") and "pts per 10x tokens" in label for label in labels), labels
    finally:
        pyplot.close(fig)
    assert "val_excess" in PLOTS and write_report(report, tmp_path / "out")["val_excess"].read_bytes().startswith(PNG_MAGIC)
