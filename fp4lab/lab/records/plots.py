"""The ledger's figures (matplotlib, Agg): loss curves, the loss excess vs bf16 with its seed-noise band,
and the attention probes per layer; a diverged run is marked where its curve stops.

    fig = plot_figure(report, "loss_excess")    # one of PLOTS as a Figure, None where no run has its data

matplotlib and pandas are imported lazily inside functions; this module never imports torch.
"""

from __future__ import annotations

import io
import math
import re
import statistics
from dataclasses import dataclass
from typing import Any

from fp4lab.lab.records.ledger import BASELINE, Report, mean_curve

PLOTS = ("loss_curves", "loss_excess", "val_excess", "attn_entropy", "max_logit")

PLOT_CAPTIONS = {
    "loss_curves": "Train loss at every logged step and validation loss (diamonds); one colour and line style per "
    "ledger row, every seed drawn. An x marks the step at which a run diverged (its scan verdict), where its "
    "curve stops.",
    "loss_excess": "Train-loss excess over the bf16 reference per logged step (definition above), smoothed by a "
    "centered rolling mean over {window} logged steps (fewer at the ends of a run). The shaded band is seed "
    "noise: ±1 standard error of the difference of the means, from the spread across the row's seeds and across "
    "the bf16 seeds where there are several; where both sides have one seed, ±1 standard deviation of the "
    "unsmoothed excess around the smoothed curve (step-to-step noise). Each legend entry says which.",
    "val_excess": "Validation-loss excess over the bf16 reference (the mean of its seeds' validation losses at the "
    "same eval step) against the tokens seen, log scale: one point per eval, the mean over the row's seeds, the "
    "band ±1 standard error of the row's seeds where it has several. Each legend entry gives the row's trend: the "
    "least-squares slope of its excess against log10(tokens), in percentage points per tenfold tokens, ± the "
    "standard error of that slope over the row's seeds (each seed fitted alone), or the fit's own standard error "
    "where the row has one seed.",
    "attn_entropy": "Attention entropy (mean over heads) at every probe step, one marker per probe; colour: run, "
    "line style and marker: layer. An x marks a run's divergence.",
    "max_logit": "Largest attention logit (max over heads) at every probe step, one marker per probe; colour: run, "
    "line style and marker: layer. An x marks a run's divergence.",
}

# One colour per recipe in every figure of every report: bf16 black (the reference, as the excess plot's 0
# line), each built-in recipe its own colour by its place among them, another recipe one chosen by its name.
BASELINE_COLOUR = "black"
# None is near black (bf16's); the built-in names take them in sorted order (nvfp4: crimson).
PALETTE = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
           "tab:cyan", "crimson", "teal", "gold", "limegreen", "magenta", "sienna", "slateblue", "darkgoldenrod",
           "deepskyblue")  # fmt: skip
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")


def pyplot_agg():
    """matplotlib.pyplot on the Agg backend: figures render to PNG bytes, never to a window."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def png_bytes(fig) -> bytes:
    """The figure as PNG bytes, laid out tight with the legends that sit outside the axes."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")  # legends sit outside the axes
    return buffer.getvalue()


def recipe_colour(recipe: str) -> str:
    """The recipe's colour, the same in every figure and every report (PALETTE)."""
    import hashlib

    from fp4lab.nn.recipe import list_recipes

    if recipe == BASELINE:
        return BASELINE_COLOUR
    builtin = [name for name in list_recipes() if name != BASELINE]
    index = builtin.index(recipe) if recipe in builtin else int(hashlib.sha1(recipe.encode()).hexdigest(), 16)
    return PALETTE[index % len(PALETTE)]


def row_style(report: Report, index: int) -> tuple[str, Any]:
    """(colour, line style) of ledger row `index`: its recipe's colour; rows of one recipe (other configs
    or sweeps) differ in line style."""
    recipes = list(report.ledger["recipe"])
    return recipe_colour(recipes[index]), _linestyle(recipes[:index].count(recipes[index]))


def _row_of(report: Report, run_id: str) -> int | None:
    return next((index for index, run_ids in enumerate(report.groups) if run_id in run_ids), None)


def run_label(report: Report, run_id: str) -> str:
    """A run as the figures name it: its ledger row's label, and its seed where the row has several."""
    index = _row_of(report, run_id)
    if index is None:
        return run_id
    record = next((r for r in report.records if r["id"] == run_id), {})
    seed = (record.get("config") or {}).get("seed")
    several = len(report.groups[index]) > 1
    return group_label(report, index, 1) + (f", seed {seed}" if several and seed is not None else "")


def group_label(report: Report, index: int, seeds: int | None = None) -> str:
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


def _linestyle(index: int) -> Any:
    """A distinct line style for every index: the four named ones, then dash-dot patterns with longer dashes."""
    if index < len(LINESTYLES):
        return LINESTYLES[index]
    return (0, (3 + index - len(LINESTYLES), 1.5, 1, 1.5))


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


def smoothing_window(report: Report) -> int:
    """The excess plot's rolling window: a tenth of the longest run's logged steps, at least 5, odd (centered)."""
    longest = max((len(m.steps) for m in report.metrics.values()), default=0)
    window = max(5, longest // 10)
    return window + 1 - window % 2


@dataclass
class ExcessCurve:
    """One ledger row's loss excess vs bf16 as plotted: smoothed, with its seed-noise band."""

    label: str
    index: int  # its ledger row
    run_ids: list[str]
    steps: list[int]
    smoothed: list[float]  # mean over the row's seeds of each seed's smoothed excess (%)
    band: list[float]  # half-width of the noise band (%), NaN where unknown
    band_label: str
    per_run: dict[str, tuple[list[int], list[float]]]  # run id -> its own smoothed excess (steps, %)


def excess_curves(report: Report) -> list[ExcessCurve]:
    """The loss excess of every non-bf16 ledger row's completed runs vs its bf16 reference (the mean of
    `report.baseline_of`'s runs), per logged step, smoothed by a centered rolling mean over `smoothing_window` steps (fewer at the
    ends). The band is seed noise: ±1 standard error of the difference of the two means, from the spread of
    the smoothed excess across the row's seeds and across the bf16 seeds (each side only when it has several);
    with one seed on both sides, ±1 std of the unsmoothed excess around the smoothed one (step-to-step noise)."""
    import pandas as pd

    window = smoothing_window(report)
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
        ref = mean_curve([dict(zip(report.metrics[b].steps, report.metrics[b].loss)) for b in bases])
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
            band_label = f"±1 s.e. of seeds ({'; '.join(sides)})"
        else:
            raw = excess(members[0], ref).sort_index()
            band = (raw - curve).rolling(window, center=True, min_periods=2).std()
            band_label = "±1 std of step-to-step noise (one seed each)"
        curves.append(ExcessCurve(
            label=group_label(report, index, len(members)), index=index, run_ids=members, steps=[int(s) for s in curve.index],
            smoothed=curve.tolist(), band=band.reindex(curve.index).tolist(), band_label=band_label,
            per_run={i: ([int(s) for s in runs[i].dropna().index], runs[i].dropna().tolist()) for i in members},
        ))  # fmt: skip
    return curves


@dataclass
class HorizonCurve:
    """One ledger row's validation-loss excess vs bf16 against tokens seen, and its trend."""

    label: str
    index: int  # its ledger row
    tokens: list[float]  # tokens seen at each eval (or steps done, where a run's config lacks the batch shape)
    in_tokens: bool  # whether `tokens` are tokens (else steps)
    mean: list[float]  # the mean excess (%) over the row's seeds at each eval
    band: list[float]  # ±1 standard error over the seeds (NaN with one seed)
    slope: float  # percentage points of excess per tenfold tokens (NaN under two evals)
    slope_se: float  # its standard error: over the seeds' own slopes, or the one seed's fit (NaN if unknown)
    seeds: int


def tokens_per_step(record: dict[str, Any]) -> int | None:
    """Tokens one training step consumes (batch_size x seq_len of the run's config), None if not recorded."""
    config = record.get("config") or {}
    batch, seq = config.get("batch_size"), config.get("seq_len")
    return batch * seq if isinstance(batch, int) and isinstance(seq, int) and batch > 0 and seq > 0 else None


def slope_with_se(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares slope of y on x and its standard error (scipy's linregress); NaN under 2 points or
    distinct x, the error NaN under 3 points (no residual is left to estimate it)."""
    from scipy.stats import linregress

    if len(set(x)) < 2:
        return math.nan, math.nan
    fit = linregress(x, y)
    return float(fit.slope), float(fit.stderr) if len(x) > 2 else math.nan


def horizon_curves(report: Report) -> list[HorizonCurve]:
    """For every non-bf16 ledger row with validation points: its excess (%) over the mean of its bf16
    reference's validation losses at each eval step both have, against tokens seen; the mean over its
    completed seeds with their standard error, and the trend in points per tenfold tokens (each seed's
    least-squares slope against log10(tokens); their mean, and the standard error of that mean)."""
    completed = {r["id"] for r in report.records if r.get("state") == "completed"}
    records = {r["id"]: r for r in report.records}
    curves = []
    for index, run_ids in enumerate(report.groups):
        if report.ledger.iloc[index]["recipe"] == BASELINE:
            continue
        members = [i for i in run_ids if i in report.metrics and i in completed and report.metrics[i].val]
        bases = [b for b in report.baseline_of.get(run_ids[0], []) if b in report.metrics and report.metrics[b].val]
        if not members or not bases:
            continue
        base_vals = [dict(report.metrics[b].val) for b in bases]
        shared = set.intersection(*(set(v) for v in base_vals))
        ref = {step: sum(v[step] for v in base_vals) / len(base_vals) for step in shared}
        per_run = {}
        for run_id in members:
            points = {step: 100.0 * (val - ref[step]) / ref[step] for step, val in report.metrics[run_id].val if ref.get(step)}
            if points:
                per_run[run_id] = points
        if not per_run:
            continue
        scale = [tokens_per_step(records[i]) for i in per_run]
        scale = scale[0] if len(set(scale)) == 1 and scale[0] is not None else None
        steps = sorted(set.union(*(set(points) for points in per_run.values())))
        def seen(step: int) -> float:  # metrics count steps from 0: after step s, s + 1 steps are done
            return float((step + 1) * (scale or 1))

        x = [seen(step) for step in steps]
        mean, band = [], []
        for step in steps:
            values = [points[step] for points in per_run.values() if step in points]
            mean.append(sum(values) / len(values))
            band.append(math.sqrt(statistics.variance(values) / len(values)) if len(values) > 1 else math.nan)
        fits = [slope_with_se([math.log10(seen(step)) for step in points], list(points.values())) for points in per_run.values()]
        slopes = [slope for slope, _ in fits if math.isfinite(slope)]
        if len(slopes) > 1:
            slope, slope_se = sum(slopes) / len(slopes), math.sqrt(statistics.variance(slopes) / len(slopes))
        elif slopes:
            slope, slope_se = slopes[0], fits[0][1] if len(per_run) == 1 else math.nan
        else:
            slope, slope_se = math.nan, math.nan
        curves.append(HorizonCurve(label=group_label(report, index, len(per_run)), index=index, tokens=x, in_tokens=bool(scale), mean=mean,
                                   band=band, slope=slope, slope_se=slope_se, seeds=len(per_run)))  # fmt: skip
    return curves


def trend_text(curve: HorizonCurve) -> str:
    """`+0.42 ± 0.10 pts per 10x tokens`, or why there is no trend (the row's label says its seeds)."""
    if not math.isfinite(curve.slope):
        return "no trend (fewer than 2 evals)"
    se = f" ± {curve.slope_se:.2f}" if math.isfinite(curve.slope_se) else " (no error estimate)"
    return f"{curve.slope:+.2f}{se} pts per 10x tokens"


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
    plt = pyplot_agg()
    records = {r["id"]: r for r in report.records}
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=100)
    if which == "loss_curves":
        drawn, handles = _draw_loss_curves(ax, report, records), None
    elif which == "loss_excess":
        drawn, handles = _draw_loss_excess(ax, report, records), None
    elif which == "val_excess":
        drawn, handles = _draw_val_excess(ax, report), None
    else:
        drawn, handles = _draw_probes(ax, report, records, "entropy" if which == "attn_entropy" else "max_logit")
    if not drawn:
        plt.close(fig)
        return None
    _legend(ax, handles)
    ax.grid(alpha=0.3)
    return fig


def _draw_loss_curves(ax, report: Report, records: dict[str, dict[str, Any]]) -> bool:
    """Every run's train loss and validation losses, one colour and line style per ledger row."""
    drawn = val_drawn = False
    for index, run_ids in enumerate(report.groups):
        colour, linestyle = row_style(report, index)
        label = group_label(report, index)
        for seed_index, run_id in enumerate(i for i in run_ids if i in report.metrics):
            m = report.metrics[run_id]
            ax.plot(m.steps, m.loss, color=colour, linestyle=linestyle, linewidth=1,
                    label=label if seed_index == 0 else "_nolegend_")  # fmt: skip
            if m.val:  # large, white-edged diamonds over the curve: seen apart from the train line
                ax.plot([s for s, _ in m.val], [v for _, v in m.val], linestyle="none", marker="D", markersize=7,
                        markerfacecolor=colour, markeredgecolor="white", markeredgewidth=1.2, zorder=3,
                        label="_nolegend_")  # fmt: skip
                val_drawn = True
            _mark_divergence(ax, records[run_id], m.steps, m.loss, colour, run_label(report, run_id))
            drawn = True
    if val_drawn:
        ax.plot([], [], linestyle="none", marker="D", markersize=7, markerfacecolor="grey", markeredgecolor="white",
                label="validation loss (its row's colour)")  # fmt: skip
    ax.set(xlabel="step", ylabel="loss (lines: train, diamonds: validation)", title="loss curves")
    if _spans_decades(report.metrics[i].loss for ids in report.groups for i in ids if i in report.metrics):
        ax.set_yscale("log")  # a run that blew up to thousands would flatten every other curve
    return drawn


def _draw_loss_excess(ax, report: Report, records: dict[str, dict[str, Any]]) -> bool:
    """Each non-bf16 row's smoothed excess over its bf16 reference, with its noise band (`excess_curves`)."""
    drawn = False
    curves = excess_curves(report)
    # Rows whose bands are of one kind (all over seeds, or all step noise) say it once, not on every row.
    kinds = {curve.band_label.split(" (")[0] for curve in curves}
    shared_band = len(curves) > 1 and len(kinds) == 1
    for curve in curves:
        colour, linestyle = row_style(report, curve.index)
        ax.plot(curve.steps, curve.smoothed, color=colour, linestyle=linestyle, linewidth=1.5,
                label=curve.label if shared_band else f"{curve.label}\n  band: {curve.band_label}")  # fmt: skip
        known = [math.isfinite(b) for b in curve.band]
        width = [b if k else 0.0 for b, k in zip(curve.band, known)]
        low = [c - b for c, b in zip(curve.smoothed, width)]
        high = [c + b for c, b in zip(curve.smoothed, width)]
        ax.fill_between(curve.steps, low, high, where=known, color=colour, alpha=0.18, linewidth=0, label="_nolegend_")
        for run_id, (steps, values) in curve.per_run.items():
            _mark_divergence(ax, records[run_id], steps, values, colour, run_label(report, run_id))
        drawn = True
    if shared_band:
        ax.fill_between([], [], [], color="grey", alpha=0.3, linewidth=0, label=f"bands: {kinds.pop()}, each row's own")
    if drawn:
        ax.axhline(0, color=BASELINE_COLOUR, linewidth=0.8, label="bf16 (the reference, 0 %)")
    ax.set(xlabel="step", ylabel="train loss excess vs bf16 (%)",
           title=f"loss excess vs bf16, centered rolling mean over {smoothing_window(report)} logged steps")
    return drawn


def _draw_val_excess(ax, report: Report) -> bool:
    """Each non-bf16 row's validation excess against tokens seen, its band and its trend (`horizon_curves`)."""
    curves = horizon_curves(report)
    for curve in curves:
        colour, linestyle = row_style(report, curve.index)
        ax.plot(curve.tokens, curve.mean, color=colour, linestyle=linestyle, marker="D", markersize=4, linewidth=1.5,
                label=f"{curve.label}: {trend_text(curve)}")  # fmt: skip
        known = [math.isfinite(b) for b in curve.band]
        width = [b if k else 0.0 for b, k in zip(curve.band, known)]
        ax.fill_between(curve.tokens, [m - w for m, w in zip(curve.mean, width)], [m + w for m, w in zip(curve.mean, width)],
                        where=known, color=colour, alpha=0.18, linewidth=0, label="_nolegend_")  # fmt: skip
    if not curves:
        return False
    ax.axhline(0, color=BASELINE_COLOUR, linewidth=0.8, label="bf16 (the reference, 0 %)")
    ax.set_xscale("log")
    ax.set(xlabel="tokens seen" if all(curve.in_tokens for curve in curves) else "step (some runs record no batch shape)", ylabel="validation loss excess vs bf16 (%)",
           title="validation loss excess vs bf16 against tokens seen; legend: trend per 10x tokens, ± s.e.")
    return True


# Up to this many probed runs, one per ledger row, a probe plot draws every layer of every run; otherwise
# one line per ledger row (so a colour always means one recipe).
PER_LAYER_RUNS = 10
PROBE_LABELS = {"entropy": "attention entropy (mean over heads)", "max_logit": "max logit (max over heads)"}


def _draw_probes(ax, report: Report, records: dict[str, dict[str, Any]], attr: str) -> tuple[bool, list]:
    """A probe (`entropy` or `max_logit` of RunMetrics): every layer of every run for a few runs, else the
    ledger rows' worst layer (`_draw_probe_rows`); (whether any was drawn, the legend's handles)."""
    probed = [(run_id, getattr(m, attr)) for run_id, m in report.metrics.items() if getattr(m, attr)]
    rows = [_row_of(report, run_id) for run_id, _ in probed]
    if len(probed) > PER_LAYER_RUNS or len(set(rows)) < len(rows):
        return _draw_probe_rows(ax, report, records, attr)
    return _draw_probe_layers(ax, report, records, attr, probed)


def _draw_probe_layers(ax, report: Report, records: dict[str, dict[str, Any]], attr: str, probed) -> tuple[bool, list]:
    """Colour for the run, line style and marker for the layer."""
    from matplotlib.lines import Line2D

    n_layers = max((len(v) for _, series in probed for _, v in series), default=0)
    handles = []
    for run_id, series in probed:
        index = _row_of(report, run_id)
        colour = row_style(report, index)[0] if index is not None else "grey"
        for layer in range(max(len(v) for _, v in series)):
            pts = [(s, v[layer]) for s, v in series if layer < len(v)]
            xs, ys = [s for s, _ in pts], [y for _, y in pts]
            ax.plot(xs, ys, color=colour, linestyle=_linestyle(layer), marker=MARKERS[layer % len(MARKERS)],
                    markersize=5, linewidth=1)  # fmt: skip
            _mark_divergence(ax, records[run_id], xs, ys, colour, None)
        handles.append(Line2D([], [], color=colour, linewidth=2, label=run_label(report, run_id)))
        diverged_at = divergence_step(records[run_id], series[-1][0])
        if diverged_at is not None:
            label = f"{run_label(report, run_id)}: diverged@{diverged_at}"
            handles.append(Line2D([], [], color=colour, linestyle="none", marker="x", markersize=9,
                                  markeredgewidth=2, label=label))  # fmt: skip
    handles += [Line2D([], [], color="black", linestyle=_linestyle(layer), marker=MARKERS[layer % len(MARKERS)],
                       markersize=5, label=f"layer {layer}") for layer in range(n_layers)]  # fmt: skip
    ax.set(xlabel="step (markers: probe steps)", ylabel=PROBE_LABELS[attr], title=PROBE_LABELS[attr] + " per layer")
    return bool(probed), handles


def _draw_probe_rows(ax, report: Report, records: dict[str, dict[str, Any]], attr: str) -> tuple[bool, list]:
    """One line per ledger row: at each probe step its worst layer (the lowest entropy, where collapse
    shows first; the highest max logit), averaged over the row's seeds probed at that step."""
    worst = min if attr == "entropy" else max
    drawn, means = False, []
    for index, run_ids in enumerate(report.groups):
        per_run = {i: [(s, worst(v)) for s, v in getattr(report.metrics[i], attr) if v]
                   for i in run_ids if i in report.metrics and getattr(report.metrics[i], attr)}  # fmt: skip
        if not per_run:
            continue
        by_step: dict[int, list[float]] = {}
        for series in per_run.values():
            for step, value in series:
                by_step.setdefault(step, []).append(value)
        steps = sorted(by_step)
        colour, linestyle = row_style(report, index)
        means.append([sum(by_step[s]) / len(by_step[s]) for s in steps])
        ax.plot(steps, means[-1], color=colour, linestyle=linestyle,
                marker=".", markersize=4, linewidth=1.2, label=group_label(report, index, len(per_run)))  # fmt: skip
        for run_id, series in per_run.items():
            _mark_divergence(ax, records[run_id], [s for s, _ in series], [v for _, v in series], colour,
                             run_label(report, run_id))  # fmt: skip
        drawn = True
    if attr == "max_logit" and _spans_decades(means):
        ax.set_yscale("log")  # runs whose logits grew a thousandfold would flatten every other line
    which = "lowest" if attr == "entropy" else "highest"
    ax.set(xlabel="step (markers: probe steps)", ylabel=PROBE_LABELS[attr],
           title=f"{PROBE_LABELS[attr]}, {which} layer, mean over seeds")  # fmt: skip
    return drawn, None


def plot_png(report: Report, which: str) -> bytes | None:
    """One of PLOTS as PNG bytes, None when no run has its data."""
    fig = plot_figure(report, which)
    if fig is None:
        return None
    try:
        return png_bytes(fig)
    finally:
        pyplot_agg().close(fig)
