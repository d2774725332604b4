"""The recipe ledger of a sweep: one row per recipe/config (seeds grouped), its loss excess vs bf16 and
whether that excess stands out of seed noise (the statistics), built from the catalog into a `Report`.

    report = build_report("sweep_catalog.json", sweep="mini")   # reads the catalog and the runs' metrics

The report's plots are in `plots`, its table, Markdown, HTML and files in `render` (`write_report`).

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
plot uses the same reference at every logged step, smoothed, with a seed-noise band (`plots.excess_curves`).
ledger.md has no timestamp: the same catalog gives the same bytes, so docs can embed it.

pandas and scipy are imported lazily inside functions; this module never imports torch.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4lab.lab.records.logscan import EVENT_KINDS
from fp4lab.lab.records.run_metrics import RunMetrics, read_metrics, steady_tokens_per_s
from fp4lab.lab.records.values import finite_number, mean_or_nan, sample_std, signed_cell
from fp4lab.train.config import RESULT_NEUTRAL
from fp4lab.train.environment import COMPARED

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


# --- a run's record ------------------------------------------------------------------------------------


def _config_key(config: dict[str, Any], drop: tuple[str, ...]) -> str:
    return json.dumps({k: v for k, v in config.items() if k not in drop}, sort_keys=True, default=str)


def config_label(record: dict[str, Any]) -> str:
    """A run's config as the ledger names it: its sweep parameters besides seed and recipe ("default"
    where it has none), or a hash of its config where the sweep recorded no parameters."""
    params = (record.get("extra") or {}).get("params")
    if isinstance(params, dict):
        shown = {k: v for k, v in params.items() if k not in ("seed", "recipe")}
        if shown or params:
            return ", ".join(f"{k}={v}" for k, v in sorted(shown.items())) or "default"
    config = record.get("config") or {}
    return "cfg-" + hashlib.sha1(_config_key(config, ("recipe", *RUN_SPECIFIC)).encode()).hexdigest()[:8]


def _recorded_losses(record: dict[str, Any]) -> dict[int, float]:
    """step -> train loss of the finite losses the catalog recorded for a run (its summary's loss_at_steps)."""
    raw = (record.get("summary") or {}).get("loss_at_steps") or {}
    out: dict[int, float] = {}
    for step, loss in raw.items():
        value = finite_number(loss)
        try:
            if value is not None:
                out[int(step)] = value
        except (TypeError, ValueError):
            continue
    return out


def final_val(record: dict[str, Any]) -> float | None:
    """A run's final validation loss from its catalog record, or None where it has none (finite only)."""
    return finite_number((record.get("summary") or {}).get("final_val_loss"))


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


# --- statistics ----------------------------------------------------------------------------------------


def mean_curve(curves: list[dict[int, float]]) -> dict[int, float]:
    """Mean over the given step->loss curves, per step (each step averaged over the curves that have it)."""
    sums: dict[int, list[float]] = {}
    for curve in curves:
        for step, loss in curve.items():
            sums.setdefault(step, []).append(loss)
    return {step: mean_or_nan(vals) for step, vals in sums.items()}


def excess_pct(run: dict[int, float], ref: dict[int, float]) -> tuple[float | None, float | None, int | None]:
    """(mean excess %, excess % at the last common step, that step) of `run` over `ref` (step -> loss)."""
    common = sorted(s for s in run if s in ref and ref[s] != 0)
    if not common:
        return None, None, None
    per_step = [100.0 * (run[s] - ref[s]) / ref[s] for s in common]
    return mean_or_nan(per_step), per_step[-1], common[-1]


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
    ref_mean = mean_or_nan([v for _, v in reference])
    if interval is None or ref_mean == 0:
        return None, None, "n/a"
    low, high = interval
    verdict = "above" if low > 0 else "below" if high < 0 else "within noise"
    return f"{signed_cell(100.0 * low / ref_mean)}..{signed_cell(100.0 * high / ref_mean)}", test, verdict


def _event_order(event: tuple[int, str]) -> tuple[int, int]:
    """Earliest step first; at one step, in the scanner's order of kinds (a spike before the runaway it starts)."""
    step, kind = event
    return step, EVENT_KINDS.index(kind) if kind in EVENT_KINDS else len(EVENT_KINDS)


# --- building ------------------------------------------------------------------------------------------


def build_report(catalog_path: str | os.PathLike[str], sweep: str | None = None, out_dir: Any = None) -> Report:
    """Read the catalog (and each run's metrics.jsonl) and build the ledger. Raises ValueError for a
    missing catalog, an unknown sweep or an empty catalog. `out_dir` only sets `report.default_out_dir`."""
    import pandas as pd

    catalog_path = Path(catalog_path)
    catalog, records = _read_records(catalog_path, sweep)
    notes: list[str] = []
    metrics = _read_run_metrics(catalog, records, notes)
    # Final losses and throughput come from completed runs only: the last validation of a run that was
    # interrupted, timed out or is still going is not a final loss.
    baselines = [r for r in records if r.get("recipe") == BASELINE and r.get("state") == "completed"]
    if not baselines:
        notes.append(
            f"no completed {BASELINE} run in {'sweep ' + repr(sweep) if sweep else 'the catalog'}: loss excess not computed"
        )
    baseline_of = {r["id"]: [b["id"] for b in _baseline_records(r, baselines)] for r in records}
    grouped: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for record in records:
        key = (record.get("sweep"), record.get("recipe"), _config_key(record.get("config") or {}, RUN_SPECIFIC))
        grouped.setdefault(key, []).append(record)
    rows = [_group_row(members, metrics, baselines, baseline_of) for members in grouped.values()]
    ledger = pd.DataFrame(rows, columns=list(COLUMNS))
    ledger["excess_last_step"] = ledger["excess_last_step"].astype("Int64")
    default = Path(out_dir) if out_dir is not None else Path("reports") / (sweep or "all")
    groups = [[r["id"] for r in members] for members in grouped.values()]
    notes += environment_notes(records, list(grouped.values()), baseline_of)
    return Report(sweep, catalog_path, ledger, records, metrics, notes, bool(baselines), default, groups, baseline_of)


def _environment(record: dict[str, Any]) -> tuple | None:
    found = (record.get("extra") or {}).get("environment")
    return tuple(found.get(key) for key in COMPARED) if isinstance(found, dict) else None


def environment_text(environment: tuple) -> str:
    """One environment in a line: "torch 2.13.0+cpu, Python 3.11.7, fp4lab 0.1.0 @52c29f4, CPU"."""
    values = dict(zip(COMPARED, environment))
    commit = f" @{str(values['fp4lab_commit'])[:7]}{'+dirty' if str(values['fp4lab_commit']).endswith('+dirty') else ''}" \
        if values["fp4lab_commit"] else ""
    parts = [f"torch {values['torch']}", f"CUDA {values['cuda']}" if values["cuda"] else None,
             f"Triton {values['triton']}" if values["triton"] else None, f"Python {values['python']}",
             f"fp4lab {values['fp4lab']}{commit}",
             f"{values['gpu_count']} x {values['gpu']}, driver {values['driver']}" if values["gpu"] else "CPU"]
    return ", ".join(p for p in parts if p)


def environment_notes(records: list[dict[str, Any]], groups: list[list[dict[str, Any]]],
                      baseline_of: dict[str, list[str]]) -> list[str]:
    """A line per distinct environment the runs came from, and a warning for each ledger row whose runs
    and bf16 reference came from more than one (its comparison mixes machines or software)."""
    seen: dict[tuple, list[str]] = {}
    for record in records:
        environment = _environment(record)
        if environment is not None:
            seen.setdefault(environment, []).append(record["id"])
    notes = [f"environment {k}: {environment_text(env)} ({len(ids)} run{'s' if len(ids) != 1 else ''})"
             for k, (env, ids) in enumerate(seen.items(), 1)] if seen else []
    if len(seen) < 2:
        return notes
    number = {env: k for k, env in enumerate(seen, 1)}
    by_id = {r["id"]: r for r in records}
    for members in groups:
        compared = members + [by_id[i] for i in baseline_of.get(members[0]["id"], []) if i in by_id]
        used = sorted({number[e] for e in map(_environment, compared) if e is not None})
        if len(used) > 1 and members[0].get("recipe") != BASELINE:
            notes.append(f"{members[0].get('recipe')} ({config_label(members[0])}) and its bf16 reference ran in environments "
                         f"{', '.join(map(str, used))}: the comparison mixes them")
    return notes


def _read_records(catalog_path: Path, sweep: str | None) -> tuple[Any, list[dict[str, Any]]]:
    """(the catalog, the records of the sweep's runs, or of every sweep's recipe runs); ValueError for a
    missing or unreadable catalog, an unknown sweep or no runs."""
    from fp4lab.lab.records.catalog import Catalog, CatalogError

    if not catalog_path.exists():
        raise ValueError(f"report: no catalog at {str(catalog_path)!r}; run fp4lab sweep SPEC first")
    try:
        catalog = Catalog(catalog_path)
        records = [dict(r) for r in catalog.records(sweep=sweep, per_sweep=True)]  # a shared run: one row per sweep
        if sweep is None:  # ratchet iterations (sweep "ratchet/<tag>") are not recipe runs: fp4lab report --ratchet TAG
            records = [r for r in records if not str(r.get("sweep") or "").startswith("ratchet/")]
        all_sweeps = catalog.sweeps()
    except CatalogError as exc:
        raise ValueError(f"report: {str(exc).splitlines()[0]}") from None
    if not records:
        if sweep is not None:
            known = ", ".join(all_sweeps) or "none"
            raise ValueError(f"report: unknown sweep {sweep!r} in {catalog_path} (sweeps: {known})")
        raise ValueError(f"report: the catalog {catalog_path} has no runs")
    return catalog, records


def _read_run_metrics(catalog: Any, records: list[dict[str, Any]], notes: list[str]) -> dict[str, RunMetrics]:
    """run id -> its metrics.jsonl; a run without a folder or readable metrics is left out with a note."""
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
    return metrics


def _baseline_records(record: dict[str, Any], baselines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The bf16 reference of a run: the completed bf16 runs of its sweep whose config minus seed and
    recipe equals its own, or every completed bf16 run of the sweep where none does."""
    drop = ("recipe", *RUN_SPECIFIC)
    same_sweep = [b for b in baselines if b.get("sweep") == record.get("sweep")]
    key = _config_key(record.get("config") or {}, drop)
    matched = [b for b in same_sweep if _config_key(b.get("config") or {}, drop) == key]
    return matched or same_sweep


def _group_row(
    members: list[dict[str, Any]], metrics: dict[str, RunMetrics], baselines: list[dict[str, Any]], baseline_of: dict[str, list[str]]
) -> dict[str, Any]:
    """The ledger row of one group (the runs of one recipe and config, seeds apart): its losses, excess and
    throughput over the completed runs, its verdicts and first event over all of them."""
    first = members[0]
    ended = [r for r in members if r.get("state") == "completed"]
    summaries = [r.get("summary") or {} for r in ended]
    vals = [v for v in map(final_val, ended) if v is not None]
    trains = [v for v in (finite_number(s.get("final_train_loss")) for s in summaries) if v is not None]
    tps = [v for v in (finite_number(s.get("tokens_per_s")) for s in summaries) if v is not None]
    steady = [v for v in (steady_tokens_per_s(metrics.get(r["id"])) for r in ended) if v is not None]
    ci95, test, versus = (None, None, None) if first.get("recipe") == BASELINE else _vs_bf16(
        seeded(ended, final_val), seeded(_baseline_records(first, baselines), final_val)
    )
    seeds = [run_seed(r) for r in members]
    return {
        "sweep": first.get("sweep") or "",
        "recipe": first.get("recipe") or "?",
        "config": config_label(first),
        "n_seeds": len(members),
        "n_completed": len(ended),
        "seeds": ",".join("?" if s is None else str(s) for s in seeds),
        "final_val_loss_mean": mean_or_nan(vals),
        "final_val_loss_std": sample_std(vals),
        "final_train_loss_mean": mean_or_nan(trains),
        "final_train_loss_std": sample_std(trains),
        **_excess_cells(ended, baselines),
        "val_excess_ci95": ci95,
        "ci_test": test,
        "vs_bf16": versus,
        "baseline_runs": " ".join(baseline_of[first["id"]]),
        "tokens_per_s_mean": mean_or_nan(tps),
        "steady_tokens_per_s_mean": mean_or_nan(steady),
        **_scan_cells(members),
        "runs": " ".join(r["id"] for r in members),
    }


def _excess_cells(ended: list[dict[str, Any]], baselines: list[dict[str, Any]]) -> dict[str, Any]:
    """The train-loss excess (over the steps the catalog recorded) and the validation excess of a group's
    completed runs over each one's bf16 reference: mean and spread over the runs."""
    ex_mean, ex_last, last_steps = [], [], []
    val_excess = []
    for r in ended:
        reference = _baseline_records(r, baselines)
        m, last, step = excess_pct(_recorded_losses(r), mean_curve([_recorded_losses(b) for b in reference]))
        if m is not None:
            ex_mean.append(m)
            ex_last.append(last)
            last_steps.append(step)
        val, ref_val = final_val(r), mean_or_nan([v for _, v in seeded(reference, final_val)])
        if val is not None and math.isfinite(ref_val) and ref_val != 0:
            val_excess.append(100.0 * (val - ref_val) / ref_val)
    return {
        "excess_pct_mean": mean_or_nan(ex_mean),
        "excess_pct_std": sample_std(ex_mean),
        "excess_pct_last": mean_or_nan(ex_last),
        "excess_pct_last_std": sample_std(ex_last),
        "excess_last_step": min(last_steps) if last_steps else None,
        "val_excess_pct_mean": mean_or_nan(val_excess),
        "val_excess_pct_std": sample_std(val_excess),
    }


def _scan_cells(members: list[dict[str, Any]]) -> dict[str, str]:
    """What the log scanner said of a group's runs: each verdict with its count (a pruned trial's as
    "pruned", or "pruned, <verdict>" where the scanner found a problem before), and the earliest event."""
    verdict_counts: dict[str, int] = {}
    for r in members:
        v = r.get("verdict") or r.get("state") or "?"
        if r.get("state") == "pruned":
            v = "pruned" if v in ("converged", "pruned") else f"pruned, {v}"
        verdict_counts[v] = verdict_counts.get(v, 0) + 1
    bad = []
    for r in members:
        for e in r.get("events") or []:
            if isinstance(e, dict) and isinstance(e.get("step"), int) and not isinstance(e.get("step"), bool):
                bad.append((e["step"], str(e.get("kind", "?"))))
    first_bad = min(bad, key=_event_order) if bad else None
    return {
        "verdicts": ", ".join(f"{v} x{n}" for v, n in verdict_counts.items()),
        "first_bad_event": f"{first_bad[1]}@{first_bad[0]}" if first_bad else "",
    }
