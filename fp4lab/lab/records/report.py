"""The recipe ledger of a sweep: one row per recipe/config (seeds grouped), loss excess vs bf16, plots.

    report = build_report("sweep_catalog.json", sweep="mini")   # reads the catalog and the runs' metrics
    paths = write_report(report, "reports/mini")                # ledger.csv, ledger.md, report.html, *.png
    console.print(render_ledger(report))                        # a rich Table that fits 100 columns
    fig = plot_figure(report, "loss_excess")                    # one of PLOTS as a matplotlib Figure

Ledger columns (one row per (recipe, config without seed) group; COLUMN_DOCS explains each):
  sweep, recipe, config (the non-seed sweep parameters, or a hash of the config), n_seeds, n_completed
  (the completed runs, which every loss, excess and throughput column is over), seeds, final_val_loss_mean/_std, final_train_loss_mean/_std (std: sample std over seeds, empty for one seed),
  excess_pct_mean (train-loss excess vs bf16 in %, mean over the steps present in both `loss_at_steps`,
  averaged over the group's runs) and excess_pct_std (the sample std over the runs of each run's mean
  excess), excess_pct_last, excess_pct_last_std and excess_last_step (same at the last common step),
  val_excess_pct_mean/_std (each run's final val loss vs the mean final val loss of its bf16 runs, in %),
  val_excess_ci95, ci_test and vs_bf16 (the 95 % interval of the difference of the group's and its bf16
  runs' mean final val losses in % of the bf16 mean: paired by seed where both sides ran the same seeds,
  Welch's otherwise, `difference_ci95`; and "above", "below" or "within noise" as it excludes or contains
  0; "n/a" with fewer than two finite val losses on a side; empty on bf16 rows), baseline_runs (the bf16 run ids of the reference), tokens_per_s_mean, verdicts
  ("converged x2, diverged@40 x1"), first_bad_event ("loss_spike@12", earliest over the group), runs
  (the run ids).

The bf16 reference of a run is the mean of the bf16 runs of the same sweep whose config (minus seed,
recipe and run-specific fields) equals the run's; if there is none, every bf16 run of the sweep. With no
bf16 run at all, the excess columns are empty, vs_bf16 is "n/a" and `report.notes` says so. The excess
plot uses the same reference at every logged step, smoothed, with a seed-noise band (`excess_curves`).
ledger.md has no timestamp: the same catalog gives the same bytes, so docs can embed it.

pandas, scipy and matplotlib (Agg) are imported lazily inside functions; this module never imports torch.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import math
import os
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4lab.lab.records.logscan import EVENT_KINDS
from fp4lab.train.atomic import write_atomic
from fp4lab.train.config import RESULT_NEUTRAL
from fp4lab.train.jsonl import read_metrics_file

BASELINE = "bf16"
RUN_SPECIFIC = ("seed", *RESULT_NEUTRAL)
"""Config keys that differ between runs of one config; dropped (with `recipe` for the bf16 match) when grouping."""

COLUMNS = (
    "sweep",
    "recipe", "config", "n_seeds", "n_completed", "seeds",
    "final_val_loss_mean", "final_val_loss_std", "final_train_loss_mean", "final_train_loss_std",
    "excess_pct_mean", "excess_pct_std", "excess_pct_last", "excess_pct_last_std", "excess_last_step",
    "val_excess_pct_mean", "val_excess_pct_std", "val_excess_ci95", "ci_test", "vs_bf16", "baseline_runs", "tokens_per_s_mean",
    "steady_tokens_per_s_mean", "verdicts", "first_bad_event", "runs",
)  # fmt: skip

COLUMN_DOCS = {
    "sweep": "the sweep the runs belong to",
    "recipe": "the FP4 recipe (bf16 is the reference)",
    "config": "the sweep parameters besides recipe and seed (or a hash of the config when there are none)",
    "n_seeds": "how many runs (seeds) the row groups, finished or not (see verdicts); every loss, excess and "
    "throughput column is over the completed ones only (an interrupted run's last losses are not final)",
    "n_completed": "how many of them completed: the runs behind every loss, excess, throughput column and "
    "the loss-excess plot",
    "seeds": "their seeds",
    "final_val_loss_mean": "validation loss at the last evaluation, mean over the seeds",
    "final_val_loss_std": "its sample standard deviation over the seeds (empty for one seed)",
    "final_train_loss_mean": "train loss at the last step, mean over the seeds",
    "final_train_loss_std": "its sample standard deviation over the seeds (empty for one seed)",
    "excess_pct_mean": "train-loss excess over the bf16 reference in %, averaged over the steps both recorded "
    "(the catalog keeps the loss every 10 steps), then over the seeds; negative: below bf16",
    "excess_pct_std": "the sample standard deviation over the seeds of each seed's mean excess (empty for one seed)",
    "excess_pct_last": "the same excess at the last step both recorded, mean over the seeds",
    "excess_pct_last_std": "its sample standard deviation over the seeds (empty for one seed)",
    "excess_last_step": "that last common step",
    "val_excess_pct_mean": "final validation loss over the mean final validation loss of the bf16 runs in %, "
    "mean over the seeds; negative: below bf16",
    "val_excess_pct_std": "its sample standard deviation over the seeds (empty for one seed)",
    "val_excess_ci95": "95 % confidence interval of the difference between the mean final validation loss of the "
    "seeds and of the bf16 runs (the test in ci test), in % of the bf16 mean",
    "ci_test": "paired: both sides ran the same seeds, and a seed fixes the initial weights and every batch in "
    "every recipe, so the interval is the t-interval of the per-seed differences; welch: Welch's t-test of the "
    "two sides (seeds differ, or a side lacks one)",
    "vs_bf16": "above or below bf16 when that interval excludes 0, within noise when it contains 0, n/a when "
    "either side has fewer than two finite final validation losses (empty on bf16 rows)",
    "baseline_runs": "the completed bf16 runs whose mean train and validation losses are the reference of the excess",
    "tokens_per_s_mean": "training throughput in tokens/s, the run's tokens over its training seconds (compilation, "
    "probe and evaluation steps included), mean over the seeds",
    "steady_tokens_per_s_mean": "the median of the per-step throughput over the second half of each run's steps "
    "(a median leaves out the probe and evaluation steps; compilation is over by then), mean over the seeds",
    "verdicts": "the log scanner's verdicts and how many seeds got each",
    "first_bad_event": "the earliest scanner event (NaN, loss spike, entropy collapse, large logit) over the seeds",
    "runs": "the catalog ids of the runs",
}

PLOTS = ("loss_curves", "loss_excess", "attn_entropy", "max_logit")


@dataclass
class RunMetrics:
    """What the plots need from one run's metrics.jsonl."""

    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    val: list[tuple[int, float]] = field(default_factory=list)  # (step, val_loss)
    entropy: list[tuple[int, list[float]]] = field(default_factory=list)  # (step, mean over heads per layer)
    max_logit: list[tuple[int, list[float]]] = field(default_factory=list)  # (step, max over heads per layer)
    throughput: list[tuple[int, float]] = field(default_factory=list)  # (step, tokens_per_s of that step)
    skipped_lines: int = 0  # torn or corrupt lines left out


@dataclass
class Report:
    """A built report: the ledger DataFrame, the records and metrics it came from, notes (skips, no bf16)."""

    sweep: str | None
    catalog_path: Path
    ledger: Any  # pandas.DataFrame with COLUMNS
    records: list[dict[str, Any]]
    metrics: dict[str, RunMetrics]  # run id -> metrics (runs with missing/corrupt metrics are absent)
    notes: list[str] = field(default_factory=list)
    has_baseline: bool = False
    default_out_dir: Path | None = None
    groups: list[list[str]] = field(default_factory=list)  # run ids of each ledger row, in ledger order
    baseline_of: dict[str, list[str]] = field(default_factory=dict)  # run id -> the bf16 run ids of its reference
    claims: Any = None  # pandas.DataFrame of fp4lab.lab.records.claims.check_claims, when claims were checked
    sections: list[str] = field(default_factory=list)  # further Markdown sections of ledger.md (the claims')


# --- small helpers -------------------------------------------------------------------------------------


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _std(values: list[float]) -> float:
    """Sample standard deviation (ddof=1); NaN for fewer than two values."""
    if len(values) < 2:
        return math.nan
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _config_key(config: dict[str, Any], drop: tuple[str, ...]) -> str:
    return json.dumps({k: v for k, v in config.items() if k not in drop}, sort_keys=True, default=str)


def _config_label(record: dict[str, Any]) -> str:
    params = (record.get("extra") or {}).get("params")
    if isinstance(params, dict):
        shown = {k: v for k, v in params.items() if k not in ("seed", "recipe")}
        if shown or params:
            return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or "default"
    config = record.get("config") or {}
    return "cfg-" + hashlib.sha1(_config_key(config, ("recipe", *RUN_SPECIFIC)).encode()).hexdigest()[:8]


def _losses(record: dict[str, Any]) -> dict[int, float]:
    raw = (record.get("summary") or {}).get("loss_at_steps") or {}
    out: dict[int, float] = {}
    for step, loss in raw.items():
        value = _num(loss)
        try:
            if value is not None:
                out[int(step)] = value
        except (TypeError, ValueError):
            continue
    return out


def _reference(curves: list[dict[int, float]]) -> dict[int, float]:
    """Mean over the given step->loss curves, per step (each step averaged over the curves that have it)."""
    sums: dict[int, list[float]] = {}
    for curve in curves:
        for step, loss in curve.items():
            sums.setdefault(step, []).append(loss)
    return {step: _mean(vals) for step, vals in sums.items()}


def excess_pct(run: dict[int, float], ref: dict[int, float]) -> tuple[float | None, float | None, int | None]:
    """(mean excess %, excess % at the last common step, that step) of `run` over `ref` (step -> loss)."""
    common = sorted(s for s in run if s in ref and ref[s] != 0)
    if not common:
        return None, None, None
    per_step = [100.0 * (run[s] - ref[s]) / ref[s] for s in common]
    return _mean(per_step), per_step[-1], common[-1]


def difference_ci95(values: list[tuple[Any, float]], reference: list[tuple[Any, float]]) -> tuple[tuple[float, float] | None, str]:
    """The 95 % confidence interval of mean(values) - mean(reference), given as (seed, value) pairs, and
    the test behind it. "paired" where both sides hold the same seeds, each once (two or more): a seed
    fixes a run's initial weights and every batch (the sampler is a function of seed and step) whatever
    the recipe, so the t-interval of the per-seed differences leaves out what the seeds share; else
    "welch" (`welch_ci95`). (None, "") with fewer than two values on a side."""
    seeds, reference_seeds = [seed for seed, _ in values], [seed for seed, _ in reference]
    if len(seeds) >= 2 and None not in seeds and len(set(seeds)) == len(seeds) and sorted(seeds) == sorted(reference_seeds):
        by_seed = dict(reference)
        diffs = [value - by_seed[seed] for seed, value in values]
        from scipy import stats

        mean, half = statistics.fmean(diffs), stats.t.ppf(0.975, len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
        return (mean - half, mean + half), "paired"
    interval = welch_ci95([v for _, v in values], [v for _, v in reference])
    return interval, "welch" if interval is not None else ""


def welch_ci95(values: list[float], reference: list[float]) -> tuple[float, float] | None:
    """The 95 % confidence interval of mean(values) - mean(reference) from Welch's two-sample t-test
    (seeds of two recipes need not share a variance); None with fewer than two values on either side."""
    if len(values) < 2 or len(reference) < 2:
        return None
    from scipy import stats

    interval = stats.ttest_ind(values, reference, equal_var=False).confidence_interval(confidence_level=0.95)
    return float(interval.low), float(interval.high)


def _vs_bf16(values: list[tuple[Any, float]], reference: list[tuple[Any, float]]) -> tuple[str | None, str | None, str]:
    """(val_excess_ci95, ci_test, vs_bf16) of a group's (seed, final val loss) pairs against its bf16 runs' ones."""
    interval, test = difference_ci95(values, reference)
    ref_mean = _mean([v for _, v in reference])
    if interval is None or ref_mean == 0:
        return None, None, "n/a"
    low, high = interval
    verdict = "above" if low > 0 else "below" if high < 0 else "within noise"
    return f"{_signed(100.0 * low / ref_mean)}..{_signed(100.0 * high / ref_mean)}", test, verdict


def _per_layer(value: Any, reduce) -> list[float] | None:
    if not isinstance(value, list) or not value:
        return None
    out = []
    for layer in value:
        if isinstance(layer, list):
            nums = [v for v in (_num(x) for x in layer) if v is not None]
            out.append(reduce(nums) if nums else math.nan)
        else:
            v = _num(layer)
            out.append(math.nan if v is None else v)
    return out


def final_val(record: dict[str, Any]) -> float | None:
    """A run's final validation loss from its catalog record, or None where it has none (finite only)."""
    return _num((record.get("summary") or {}).get("final_val_loss"))


def run_seed(record: dict[str, Any]) -> Any:
    """The seed a run was configured with (None where its config has none)."""
    return (record.get("config") or {}).get("seed")


def seeded(records: list[dict[str, Any]], value) -> list[tuple[Any, float]]:
    """(seed, value(record)) of the records whose value is a finite number, in order."""
    pairs = [(run_seed(r), value(r)) for r in records]
    return [(seed, v) for seed, v in pairs if v is not None and math.isfinite(v)]


def run_records(report: Report, run_ids: list[str], completed_only: bool = False) -> list[dict[str, Any]]:
    """The records of these runs of a built report, in order (the completed ones only, with completed_only)."""
    by_id = {r["id"]: r for r in report.records}
    return [by_id[i] for i in run_ids if i in by_id and (not completed_only or by_id[i].get("state") == "completed")]


def final_val_losses(report: Report, run_ids: list[str], completed_only: bool = False) -> list[tuple[Any, float]]:
    """(seed, final validation loss) of these runs of a built report that have a finite one, in order (of
    the completed ones only, with completed_only)."""
    return seeded(run_records(report, run_ids, completed_only), final_val)


def steady_tokens_per_s(metrics: RunMetrics | None) -> float | None:
    """The median per-step throughput over the second half of a run's recorded steps (None without any):
    the pace once compiled, which probe and evaluation steps, the few slow ones, do not move."""
    if metrics is None or not metrics.throughput:
        return None
    last = metrics.throughput[-1][0]
    return statistics.median(v for step, v in metrics.throughput if 2 * step >= last)


def endpoint_train_loss(metrics: RunMetrics | None) -> float | None:
    """The mean train loss over the last tenth of a run's logged steps (at least one step; None without
    any): its loss at the end of training, with the noise of a single batch averaged out."""
    if metrics is None or not metrics.loss:
        return None
    return statistics.fmean(metrics.loss[-math.ceil(len(metrics.loss) / 10) :])


def read_metrics(path: Path) -> RunMetrics:
    """Parse a metrics.jsonl (torn or corrupt lines skipped and counted in `skipped_lines`, as every
    reader does); raises ValueError when it is missing, unreadable or has no loss."""
    metrics = RunMetrics()
    counts: dict[str, int] = {}
    try:
        rows = list(read_metrics_file(path, counts))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from None
    metrics.skipped_lines = counts["skipped_lines"]
    for row in rows:
        step = row["step"]
        loss = _num(row.get("loss"))
        if loss is not None:
            metrics.steps.append(step)
            metrics.loss.append(loss)
        val = _num(row.get("val_loss"))
        if val is not None:
            metrics.val.append((step, val))
        tokens_per_s = _num(row.get("tokens_per_s"))
        if tokens_per_s is not None:
            metrics.throughput.append((step, tokens_per_s))
        if "attn_entropy" in row or "attn_entropy_mean" in row:
            layers = _per_layer(row.get("attn_entropy"), _mean) or _per_layer(row.get("attn_entropy_mean"), _mean)
            if layers:
                metrics.entropy.append((step, layers))
        if "max_logit" in row:
            layers = _per_layer(row.get("max_logit"), max)
            if layers:
                metrics.max_logit.append((step, layers))
    if not metrics.steps:
        raise ValueError(f"{path}: no loss values")
    return metrics


# --- building ------------------------------------------------------------------------------------------


def build_report(catalog_path: str | os.PathLike[str], sweep: str | None = None, out_dir: Any = None) -> Report:
    """Read the catalog (and each run's metrics.jsonl) and build the ledger. Raises ValueError for a
    missing catalog, an unknown sweep or an empty catalog. `out_dir` only sets `report.default_out_dir`."""
    import pandas as pd

    from fp4lab.lab.records.catalog import Catalog, CatalogError

    catalog_path = Path(catalog_path)
    if not catalog_path.exists():
        raise ValueError(f"report: no catalog at {str(catalog_path)!r}; run fp4lab sweep SPEC first")
    try:
        catalog = Catalog(catalog_path)
        records = [dict(r) for r in catalog.records(sweep=sweep, per_sweep=True)]  # a shared run: one row per sweep
        if sweep is None:  # ratchet iterations (sweep "ratchet/<tag>") are not recipe runs: fp4lab report --ratchet TAG
            records = [r for r in records if not str(r.get("sweep") or "").startswith("ratchet/")]
        all_sweeps = sorted({str(r.get("sweep")) for r in catalog.records(per_sweep=True) if r.get("sweep")})
    except CatalogError as exc:
        raise ValueError(f"report: {str(exc).splitlines()[0]}") from None
    if not records:
        if sweep is not None:
            known = ", ".join(all_sweeps) or "none"
            raise ValueError(f"report: unknown sweep {sweep!r} in {catalog_path} (sweeps: {known})")
        raise ValueError(f"report: the catalog {catalog_path} has no runs")

    notes: list[str] = []
    metrics: dict[str, RunMetrics] = {}
    for record in records:
        run_dir = catalog.resolve((record.get("paths") or {}).get("run_dir"))
        if run_dir is None:
            notes.append(f"{record['id']}: no run_dir; skipped in plots")
            continue
        try:
            metrics[record["id"]] = read_metrics(run_dir / "metrics.jsonl")
        except ValueError as exc:
            notes.append(f"{record['id']}: metrics skipped ({exc})")
            continue
        if metrics[record["id"]].skipped_lines:
            notes.append(f"{record['id']}: {metrics[record['id']].skipped_lines} torn or corrupt line(s) of its metrics.jsonl left out")

    # bf16 references: per (sweep, config without seed/recipe), with a per-sweep fallback
    drop = ("recipe", *RUN_SPECIFIC)
    # Final losses and throughput come from completed runs only: the last validation of a run that was
    # interrupted, timed out or is still going is not a final loss.
    baselines = [r for r in records if r.get("recipe") == BASELINE and r.get("state") == "completed"]
    has_baseline = bool(baselines)
    if not has_baseline:
        notes.append(
            f"no completed {BASELINE} run in {'sweep ' + repr(sweep) if sweep else 'the catalog'}: loss excess not computed"
        )

    def baseline_records(record: dict[str, Any]) -> list[dict[str, Any]]:
        same_sweep = [b for b in baselines if b.get("sweep") == record.get("sweep")]
        key = _config_key(record.get("config") or {}, drop)
        matched = [b for b in same_sweep if _config_key(b.get("config") or {}, drop) == key]
        return matched or same_sweep

    baseline_of = {r["id"]: [b["id"] for b in baseline_records(r)] for r in records}

    grouped: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for record in records:
        key = (record.get("sweep"), record.get("recipe"), _config_key(record.get("config") or {}, RUN_SPECIFIC))
        grouped.setdefault(key, []).append(record)

    def baseline_vals(record: dict[str, Any]) -> list[float]:
        return [v for _, v in seeded(baseline_records(record), final_val)]

    rows = []
    for (_sweep, recipe, _key), members in grouped.items():
        ended = [r for r in members if r.get("state") == "completed"]
        summaries = [r.get("summary") or {} for r in ended]
        vals = [v for v in map(final_val, ended) if v is not None]
        trains = [v for v in (_num(s.get("final_train_loss")) for s in summaries) if v is not None]
        tps = [v for v in (_num(s.get("tokens_per_s")) for s in summaries) if v is not None]
        steady = [v for v in (steady_tokens_per_s(metrics.get(r["id"])) for r in ended) if v is not None]
        ex_mean, ex_last, last_steps = [], [], []
        if has_baseline:
            for r in ended:
                m, last, step = excess_pct(_losses(r), _reference([_losses(b) for b in baseline_records(r)]))
                if m is not None:
                    ex_mean.append(m)
                    ex_last.append(last)
                    last_steps.append(step)
        val_excess = []
        for r in ended:
            val, ref_val = final_val(r), _mean(baseline_vals(r))
            if val is not None and math.isfinite(ref_val) and ref_val != 0:
                val_excess.append(100.0 * (val - ref_val) / ref_val)
        ci95, test, versus = (None, None, None) if recipe == BASELINE else _vs_bf16(
            seeded(ended, final_val), seeded(baseline_records(members[0]), final_val)
        )
        verdict_counts: dict[str, int] = {}
        for r in members:
            v = r.get("verdict") or r.get("state") or "?"
            verdict_counts[v] = verdict_counts.get(v, 0) + 1
        bad = []
        for r in members:
            for e in r.get("events") or []:
                if isinstance(e, dict) and isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool):
                    bad.append((e["step"], str(e.get("kind", "?"))))
        first_bad = min(bad, key=_event_order) if bad else None
        seeds = [run_seed(r) for r in members]
        rows.append(
            {
                "sweep": _sweep or "",
                "recipe": recipe or "?",
                "config": _config_label(members[0]),
                "n_seeds": len(members),
                "n_completed": len(ended),
                "seeds": ",".join("?" if s is None else str(s) for s in seeds),
                "final_val_loss_mean": _mean(vals),
                "final_val_loss_std": _std(vals),
                "final_train_loss_mean": _mean(trains),
                "final_train_loss_std": _std(trains),
                "excess_pct_mean": _mean(ex_mean),
                "excess_pct_std": _std(ex_mean),
                "excess_pct_last": _mean(ex_last),
                "excess_pct_last_std": _std(ex_last),
                "excess_last_step": min(last_steps) if last_steps else None,
                "val_excess_pct_mean": _mean(val_excess),
                "val_excess_pct_std": _std(val_excess),
                "val_excess_ci95": ci95,
                "ci_test": test,
                "vs_bf16": versus,
                "baseline_runs": " ".join(baseline_of[members[0]["id"]]) if has_baseline else "",
                "tokens_per_s_mean": _mean(tps),
                "steady_tokens_per_s_mean": _mean(steady),
                "verdicts": ", ".join(f"{v} x{n}" for v, n in verdict_counts.items()),
                "first_bad_event": f"{first_bad[1]}@{first_bad[0]}" if first_bad else "",
                "runs": " ".join(r["id"] for r in members),
            }
        )
    ledger = pd.DataFrame(rows, columns=list(COLUMNS))
    ledger["excess_last_step"] = ledger["excess_last_step"].astype("Int64")
    default = Path(out_dir) if out_dir is not None else Path("reports") / (sweep or "all")
    groups = [[r["id"] for r in members] for members in grouped.values()]
    return Report(sweep, catalog_path, ledger, records, metrics, notes, has_baseline, default, groups, baseline_of)


# --- rendering -----------------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.{digits}f}"
    try:
        import pandas as pd

        if pd.isna(value):
            return ""
    except (TypeError, ValueError):
        pass
    return str(value)


def _signed(value: Any, digits: int = 2) -> str:
    text = _fmt(value, digits)
    return text if not text or text.startswith("-") else "+" + text


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
    return [[_fmt(row[c], _HEADERS[c][1]) if _HEADERS[c][1] else _fmt(row[c]) for c in columns]
            for _, row in report.ledger.iterrows()]  # fmt: skip


_CONSOLE_COLUMNS = (  # header, right-aligned, may wrap
    ("sweep", False, True), ("recipe", False, False), ("config", False, True), ("seeds", True, False),
    ("val loss", True, False), ("excess %", True, False), ("val loss\nvs bf16", True, False),
    ("steady\ntok/s", True, False), ("verdicts", False, True),
)  # fmt: skip


def _console_rows(report: Report) -> list[list[str]]:
    rows = []
    for _, row in report.ledger.iterrows():
        val_std = _fmt(row["final_val_loss_std"], 4)
        excess_std = _fmt(row["excess_pct_std"], 2)
        first_bad = row["first_bad_event"]
        verdicts = row["verdicts"].removesuffix(" x1") if row["n_seeds"] == 1 else row["verdicts"]
        versus = "\n".join(_fmt(row[c]) for c in ("vs_bf16", "val_excess_ci95") if _fmt(row[c]))
        rows.append([
            row["sweep"], row["recipe"], row["config"], _seed_count(row),
            _fmt(row["final_val_loss_mean"], 4) + (f"\n±{val_std}" if val_std else ""),
            _signed(row["excess_pct_mean"]) + (f"\n±{excess_std}" if excess_std else ""), versus,
            _fmt(row["steady_tokens_per_s_mean"], 0), verdicts + (f"\nfirst: {first_bad}" if first_bad else ""),
        ])  # fmt: skip
    return rows


def _seed_count(row) -> str:
    """"3", or "1 of 3" while some of the row's runs have not completed."""
    done, total = int(row["n_completed"]), int(row["n_seeds"])
    return str(total) if done == total else f"{done} of {total}"


def render_ledger(report: Report):
    """The ledger as a rich Table that reads in a 100-column terminal: the columns that decide between
    recipes (val loss, train-loss excess, whether the val loss differs from bf16 beyond seed noise, with
    its 95 % interval), a seed spread on a second line, recipe names never wrapped or cut (the config,
    sweep and verdict columns wrap instead; config only when the rows differ in it). The full table is in
    ledger.csv, ledger.md and report.html."""
    from rich.table import Table

    title = f"recipe ledger{' of ' + report.sweep if report.sweep else ''} ({report.catalog_path})"
    caption = [
        *report.notes,
        "excess %: train-loss excess over bf16, mean over steps, ± std over seeds",
        "val loss vs bf16: 95 % CI of the difference of means, in % of bf16 (paired by seed, else Welch's)",
        "train loss, last-step excess, bf16 runs, run ids: ledger.csv, ledger.md, report.html",
    ]
    table = Table(title=title, caption="\n".join(caption))
    hidden = set() if report.sweep is None else {"sweep"}
    if (report.ledger["config"] == "default").all():  # one config: the column would repeat "default"
        hidden.add("config")
    shown = [i for i, (header, _, _) in enumerate(_CONSOLE_COLUMNS) if header not in hidden]
    for i in shown:
        header, right, wraps = _CONSOLE_COLUMNS[i]
        table.add_column(header, justify="right" if right else "left", no_wrap=not wraps, overflow="fold")
    for row in _console_rows(report):
        table.add_row(*(row[i] for i in shown))
    return table


def _excess_method(report: Report) -> str:
    window = _smoothing_window(report)
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
        + ("\nNotes:\n\n" + notes if notes else "") + claims
    )  # fmt: skip


# --- plots ---------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _label(report: Report, run_id: str) -> str:
    for r in report.records:
        if r["id"] == run_id:
            name = (r.get("extra") or {}).get("name")
            return str(name or run_id)
    return run_id


def _group_label(report: Report, index: int, seeds: int | None = None) -> str:
    """The row's recipe (config, sweep) and its number of seeds: `seeds` where a plot draws fewer runs."""
    row = report.ledger.iloc[index]
    parts = [row["recipe"]]
    if row["config"] != "default":
        parts.append(row["config"])
    if report.sweep is None:
        parts.append(row["sweep"])
    label = parts[0] + (f" ({', '.join(parts[1:])})" if parts[1:] else "")
    seeds = row["n_seeds"] if seeds is None else seeds
    return label + (f", {seeds} seeds" if seeds > 1 else "")


PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
           "tab:brown", "tab:pink", "tab:gray", "tab:olive", "tab:cyan")  # fmt: skip
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")


def _linestyle(index: int) -> Any:
    """A distinct line style for every index: the four named ones, then dash-dot patterns with longer dashes."""
    if index < len(LINESTYLES):
        return LINESTYLES[index]
    return (0, (3 + index - len(LINESTYLES), 1.5, 1, 1.5))


def _style(index: int) -> tuple[str, Any]:
    """(colour, line style) of series `index`: the ten colours, then again with the next line style."""
    return PALETTE[index % len(PALETTE)], _linestyle(index // len(PALETTE))


def _event_order(event: tuple[int, str]) -> tuple[int, int]:
    """Earliest step first; at one step, in the scanner's order of kinds (a spike before the runaway it starts)."""
    step, kind = event
    return step, EVENT_KINDS.index(kind) if kind in EVENT_KINDS else len(EVENT_KINDS)


def divergence_step(record: dict[str, Any], last_step: int | None = None) -> int | None:
    """The step a run diverged at: from its verdict "diverged@N", else its first `nan` event, else (a
    verdict "diverged" without a step) `last_step`; None for a run that did not diverge."""
    verdict = str(record.get("verdict") or "")
    match = re.fullmatch(r"diverged@(\d+)", verdict)
    if match:
        return int(match.group(1))
    nan_steps = [e["step"] for e in record.get("events") or []
                 if isinstance(e, dict) and e.get("kind") == "nan" and type(e.get("step")) is int]  # fmt: skip
    if nan_steps:
        return min(nan_steps)
    return last_step if verdict.startswith("diverged") else None


def _mark_divergence(ax, record: dict[str, Any], steps: list[int], values: list[float], colour: str, label: str | None):
    """An x at the divergence step, level with the curve's last point up to it (where the curve stops)."""
    step = divergence_step(record, steps[-1] if steps else None)
    before = [v for s, v in zip(steps, values) if s <= step and math.isfinite(v)] if step is not None else []
    if not before:
        return
    ax.plot([step], [before[-1]], linestyle="none", marker="x", markersize=9, markeredgewidth=2, color=colour,
            zorder=4, label=f"{label}: diverged@{step}" if label else "_nolegend_")  # fmt: skip


def _smoothing_window(report: Report) -> int:
    """The excess plot's rolling window: a tenth of the longest run's logged steps, at least 5, odd (centered)."""
    longest = max((len(m.steps) for m in report.metrics.values()), default=0)
    window = max(5, longest // 10)
    return window + 1 - window % 2


@dataclass
class ExcessCurve:
    """One ledger row's loss excess vs bf16 as plotted: smoothed, with its seed-noise band."""

    label: str
    run_ids: list[str]
    steps: list[int]
    smoothed: list[float]  # mean over the row's seeds of each seed's smoothed excess (%)
    band: list[float]  # half-width of the noise band (%), NaN where unknown
    band_label: str
    per_run: dict[str, tuple[list[int], list[float]]]  # run id -> its own smoothed excess (steps, %)


def excess_curves(report: Report) -> list[ExcessCurve]:
    """The loss excess of every non-bf16 ledger row's completed runs vs its bf16 reference (the mean of
    `report.baseline_of`'s runs), per logged step, smoothed by a centered rolling mean over `_smoothing_window` steps (fewer at the
    ends). The band is seed noise: ±1 standard error of the difference of the two means, from the spread of
    the smoothed excess across the row's seeds and across the bf16 seeds (each side only when it has several);
    with one seed on both sides, ±1 std of the unsmoothed excess around the smoothed one (step-to-step noise)."""
    import pandas as pd

    window = _smoothing_window(report)
    completed = {r["id"] for r in report.records if r.get("state") == "completed"}  # as the table's columns

    def excess(run_id: str, ref: dict[int, float]) -> Any:
        m = report.metrics[run_id]
        return pd.Series({s: 100.0 * (v - ref[s]) / ref[s] for s, v in zip(m.steps, m.loss) if ref.get(s)}, dtype=float)

    def smooth(series: Any) -> Any:
        return series.sort_index().rolling(window, center=True, min_periods=1).mean()

    def variance_of_mean(frame: Any) -> Any:
        return frame.var(axis=1) / frame.count(axis=1)

    curves = []
    for index, run_ids in enumerate(report.groups):
        if report.ledger.iloc[index]["recipe"] == BASELINE:
            continue
        members = [i for i in run_ids if i in report.metrics and i in completed]
        bases = [b for b in report.baseline_of.get(run_ids[0], []) if b in report.metrics]
        if not members or not bases:
            continue
        ref = _reference([dict(zip(report.metrics[b].steps, report.metrics[b].loss)) for b in bases])
        runs = pd.concat({i: smooth(excess(i, ref)) for i in members}, axis=1).dropna(how="all")
        if runs.empty:
            continue
        curve = runs.mean(axis=1)
        recipe = report.ledger.iloc[index]["recipe"]
        if len(members) > 1 or len(bases) > 1:
            variance = pd.Series(0.0, index=curve.index)
            sides = []
            for side, ids, frame in ((recipe, members, runs), (BASELINE, bases, None)):
                if len(ids) < 2:
                    sides.append(f"one {side} seed, its noise not included")
                    continue
                if frame is None:
                    frame = pd.concat({b: smooth(excess(b, ref)) for b in ids}, axis=1).reindex(curve.index)
                variance = variance + variance_of_mean(frame)
                sides.append(f"{len(ids)} {side} seeds")
            band = variance.pow(0.5)
            band_label = f"seed noise, ±1 s.e. ({'; '.join(sides)})"
        else:
            raw = excess(members[0], ref).sort_index()
            band = (raw - curve).rolling(window, center=True, min_periods=2).std()
            band_label = "step-to-step noise of the raw excess, ±1 std (one seed each)"
        curves.append(ExcessCurve(
            label=_group_label(report, index, len(members)), run_ids=members, steps=[int(s) for s in curve.index],
            smoothed=curve.tolist(), band=band.reindex(curve.index).tolist(), band_label=band_label,
            per_run={i: ([int(s) for s in runs[i].dropna().index], runs[i].dropna().tolist()) for i in members},
        ))  # fmt: skip
    return curves


def _spans_decades(curves, decades: float = 2.0) -> bool:
    """Whether the positive finite values of these curves span more than `decades` powers of ten."""
    values = [v for curve in curves for v in curve if math.isfinite(v) and v > 0]
    return bool(values) and math.log10(max(values) / min(values)) > decades


def _legend(ax, handles=None) -> None:
    entries = handles if handles is not None else ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
              ncol=2 if len(entries) > 28 else 1)  # fmt: skip


def plot_figure(report: Report, which: str):
    """One of PLOTS as a matplotlib Figure (the caller closes it), or None when no run has its data."""
    from matplotlib.lines import Line2D

    plt = _pyplot()
    records = {r["id"]: r for r in report.records}
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=100)
    handles = None
    drawn = False
    if which == "loss_curves":
        for index, run_ids in enumerate(report.groups):
            colour, linestyle = _style(index)
            label = _group_label(report, index)
            for seed_index, run_id in enumerate(i for i in run_ids if i in report.metrics):
                m = report.metrics[run_id]
                ax.plot(m.steps, m.loss, color=colour, linestyle=linestyle, linewidth=1,
                        label=label if seed_index == 0 else "_nolegend_")  # fmt: skip
                if m.val:
                    ax.plot([s for s, _ in m.val], [v for _, v in m.val], "o", color=colour, markersize=4)
                _mark_divergence(ax, records[run_id], m.steps, m.loss, colour, _label(report, run_id))
                drawn = True
        ax.set(xlabel="step", ylabel="train loss (o: val loss)", title="loss curves")
        if _spans_decades(report.metrics[i].loss for ids in report.groups for i in ids if i in report.metrics):
            ax.set_yscale("log")  # a run that blew up to thousands would flatten every other curve
    elif which == "loss_excess":
        for index, curve in enumerate(excess_curves(report)):
            colour, linestyle = _style(index)
            ax.plot(curve.steps, curve.smoothed, color=colour, linestyle=linestyle, linewidth=1.5,
                    label=f"{curve.label} (smoothed)")  # fmt: skip
            known = [math.isfinite(b) for b in curve.band]
            width = [b if k else 0.0 for b, k in zip(curve.band, known)]
            low = [c - b for c, b in zip(curve.smoothed, width)]
            high = [c + b for c, b in zip(curve.smoothed, width)]
            ax.fill_between(curve.steps, low, high, where=known, color=colour, alpha=0.18, linewidth=0,
                            label=f"{curve.label}: {curve.band_label}")  # fmt: skip
            for run_id, (steps, values) in curve.per_run.items():
                _mark_divergence(ax, records[run_id], steps, values, colour, _label(report, run_id))
            drawn = True
        if drawn:
            ax.axhline(0, color="black", linewidth=0.8, label="bf16 reference (0 %)")
        ax.set(xlabel="step", ylabel="train loss excess vs bf16 (%)",
               title=f"loss excess vs bf16, centered rolling mean over {_smoothing_window(report)} logged steps")
    else:
        attr = "entropy" if which == "attn_entropy" else "max_logit"
        probed = [(run_id, getattr(m, attr)) for run_id, m in report.metrics.items() if getattr(m, attr)]
        n_layers = max((len(v) for _, series in probed for _, v in series), default=0)
        handles = []
        for i, (run_id, series) in enumerate(probed):
            colour = PALETTE[i % len(PALETTE)]
            block = n_layers * (i // len(PALETTE))  # past ten runs the colours repeat with the next line styles
            for layer in range(max(len(v) for _, v in series)):
                pts = [(s, v[layer]) for s, v in series if layer < len(v)]
                xs, ys = [s for s, _ in pts], [y for _, y in pts]
                ax.plot(xs, ys, color=colour, linestyle=_linestyle(block + layer), marker=MARKERS[layer % len(MARKERS)],
                        markersize=5, linewidth=1)  # fmt: skip
                _mark_divergence(ax, records[run_id], xs, ys, colour, None)
            handles.append(Line2D([], [], color=colour, linewidth=2, label=_label(report, run_id)))
            diverged_at = divergence_step(records[run_id], series[-1][0])
            if diverged_at is not None:
                label = f"{_label(report, run_id)}: diverged@{diverged_at}"
                handles.append(Line2D([], [], color=colour, linestyle="none", marker="x", markersize=9,
                                      markeredgewidth=2, label=label))  # fmt: skip
            drawn = True
        handles += [Line2D([], [], color="black", linestyle=_linestyle(layer), marker=MARKERS[layer % len(MARKERS)],
                           markersize=5, label=f"layer {layer}") for layer in range(n_layers)]  # fmt: skip
        ylabel = "attention entropy (mean over heads)" if attr == "entropy" else "max logit (max over heads)"
        ax.set(xlabel="step (markers: probe steps)", ylabel=ylabel, title=ylabel + " per layer")
    if not drawn:
        plt.close(fig)
        return None
    _legend(ax, handles)
    ax.grid(alpha=0.3)
    return fig


def _plot_png(report: Report, which: str) -> bytes | None:
    fig = plot_figure(report, which)
    if fig is None:
        return None
    try:
        return _png(fig)
    finally:
        _pyplot().close(fig)


PLOT_CAPTIONS = {
    "loss_curves": "Train loss at every logged step and validation loss (dots); one colour and line style per "
    "ledger row, every seed drawn. An x marks the step at which a run diverged (its scan verdict), where its "
    "curve stops.",
    "loss_excess": "Train-loss excess over the bf16 reference per logged step (definition above), smoothed by a "
    "centered rolling mean over {window} logged steps (fewer at the ends of a run). The shaded band is seed "
    "noise: ±1 standard error of the difference of the means, from the spread across the row's seeds and across "
    "the bf16 seeds where there are several; where both sides have one seed, ±1 standard deviation of the "
    "unsmoothed excess around the smoothed curve (step-to-step noise). Each legend entry says which.",
    "attn_entropy": "Attention entropy (mean over heads) at every probe step, one marker per probe; colour: run, "
    "line style and marker: layer. An x marks a run's divergence.",
    "max_logit": "Largest attention logit (max over heads) at every probe step, one marker per probe; colour: run, "
    "line style and marker: layer. An x marks a run's divergence.",
}


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
            "<tr>" + cell(r["id"]) + cell(r.get("sweep")) + cell(r.get("recipe")) + cell(_config_label(r))
            + cell(config.get("seed")) + cell(r.get("state")) + cell(r.get("verdict"))
            + (f'<td><code title="{html.escape(commit)}">{html.escape(commit[:12])}</code></td>' if commit
               else "<td>unknown</td>")
            + cell(dirty) + cell((r.get("paths") or {}).get("run_dir")) + "</tr>"
        )  # fmt: skip
        configs.append(
            f"<details><summary>{html.escape(r['id'])} ({html.escape(_label(report, r['id']))})</summary>"
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
            named = ", ".join(f"{b} ({_label(report, b)})" for b in bases)
            items.append(f"<li>{html.escape(_group_label(report, index))}: {html.escape(named)}</li>")
        references = f"<p>The bf16 runs each row is compared with:</p><ul>{''.join(items)}</ul>\n"
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in report.notes)
    window = _smoothing_window(report)
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
        data = _plot_png(report, name)
        if data is None:
            continue
        pngs[name] = data
        write_atomic(out / f"{name}.png", data)
        written[name] = out / f"{name}.png"
    write_atomic(out / "report.html", _html(report, pngs).encode())
    written["html"] = out / "report.html"
    return written


# --- ratchet reports -----------------------------------------------------------------------------------

RATCHET_COLUMNS = (
    "iteration", "decision", "metric", "best_so_far", "improvement_pct", "healthy", "kept_commit", "proposal",
)  # fmt: skip
DECISION_STYLES = {
    "baseline": "blue", "keep": "green", "discard": "grey50", "crash": "red", "invalid": "red", "duplicate": "yellow",
}  # fmt: skip
NOISE_K = 2.0  # the shaded noise band: baseline ± NOISE_K * sigma


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
    base = _num(baseline.get("metric"))
    kept = [e for e in extras if e.get("decision") == "keep" and _num(e.get("metric")) is not None]
    direction = next((e["direction"] for e in extras if e.get("direction") in ("minimize", "maximize")), None)
    if direction is None:  # not recorded: a kept iteration beat the best before it, which tells the direction
        probe = next((e for e in kept if _num(e.get("best_before")) is not None), None)
        direction = "maximize" if probe and probe["metric"] > probe["best_before"] else "minimize"
    sign = -1.0 if direction == "minimize" else 1.0
    rows, best = [], None
    for e in extras:
        metric = _num(e.get("metric"))
        if e.get("decision") in ("baseline", "keep") and metric is not None:
            best = metric  # the ratchet keeps only strict improvements: the latest kept metric is the frontier
        improvement = sign * 100.0 * (metric - base) / abs(base) + 0.0 if metric is not None and base else None
        rows.append({
            "iteration": e.get("iteration"), "decision": e.get("decision") or e.get("phase") or "",
            "metric": metric, "best_so_far": best, "improvement_pct": improvement, "healthy": e.get("healthy"),
            "kept_commit": str(e.get("kept_commit") or "")[:7], "proposal": _proposal_summary(e.get("proposal")),
        })  # fmt: skip
    name = next((str(e["metric_name"]) for e in extras if e.get("metric_name")), "metric")
    return rows, name, _num(baseline.get("sigma"))


def _ratchet_png(rows: list[dict[str, Any]], tag: str, metric_name: str, sigma: float | None) -> bytes:

    plt = _pyplot()
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
        return _png(fig)
    finally:
        plt.close(fig)


def ratchet_report(catalog_path: str | os.PathLike[str], tag: str, out_dir: str | os.PathLike[str] | None = None):
    """The iterations of ratchet `tag` (catalog sweep "ratchet/<tag>"): writes iterations.csv,
    iterations.md and metric.png into `out_dir` (default reports/ratchet-<tag>/), each atomically, and
    returns (rich Table, {"csv", "md", "png"} -> path). Raises ValueError for a missing catalog or tag."""
    import pandas as pd
    from rich.table import Table

    from fp4lab.lab.records.catalog import Catalog, CatalogError

    catalog_path = Path(catalog_path)
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
    rows, metric_name, sigma = _ratchet_rows([dict(r) for r in records])
    frame = pd.DataFrame(rows, columns=list(RATCHET_COLUMNS))
    frame["iteration"] = frame["iteration"].astype("Int64")
    headers = {"metric": metric_name, "best_so_far": "best so far", "improvement_pct": "vs baseline %"}
    shown = [[_fmt(r[c], 2 if c == "improvement_pct" else 6) for c in RATCHET_COLUMNS] for r in rows]
    for row in shown:
        row[5] = {"True": "yes", "False": "no"}.get(row[5], row[5])

    table = Table(title=f"fp4lab ratchet {tag} ({catalog_path})")
    for column in RATCHET_COLUMNS:
        table.add_column(
            headers.get(column, column), justify="right" if column in headers or column == "iteration" else "left"
        )
    for row in shown:
        style = DECISION_STYLES.get(row[1])
        table.add_row(*row[:1], f"[{style}]{row[1]}[/]" if style else row[1], *row[2:])

    lines = ["| " + " | ".join(headers.get(c, c) for c in RATCHET_COLUMNS) + " |", "|" + "---|" * len(RATCHET_COLUMNS)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in shown]
    out = Path(out_dir) if out_dir is not None else Path("reports") / f"ratchet-{tag.replace('/', '-')}"
    out.mkdir(parents=True, exist_ok=True)
    written = {"csv": out / "iterations.csv", "md": out / "iterations.md", "png": out / "metric.png"}
    write_atomic(written["csv"], frame.to_csv(index=False).encode())
    write_atomic(written["md"], (f"# fp4lab ratchet {tag}\n\n" + "\n".join(lines) + "\n").encode())
    write_atomic(written["png"], _ratchet_png(rows, tag, metric_name, sigma))
    return table, written


def _png(fig) -> bytes:
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")  # legends sit outside the axes
    return buffer.getvalue()
