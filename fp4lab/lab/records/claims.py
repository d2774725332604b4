"""Papers' claims set against a measured ledger: `fp4lab report SWEEP --claims FILE`.

A claims file is data (TOML): each `[[claim]]` names a recipe, what a paper reports of its loss against
a reference recipe (BF16 unless `versus` names another), which loss, and where it comes from:

    [[claim]]
    recipe = "nvfp4-all"
    excess_pct = 1.34           # the recipe's loss over the reference's, in % of the reference's
    metric = "train"            # "val": final validation loss (the default); "train": endpoint train loss
    source = "arXiv 2610.00053 sections 2.6, 5.2: 8B parameters, 160B tokens"
    versus = "bf16"             # optional: the reference recipe (default bf16)
    config = "default"          # optional: the ledger row's config label, where a recipe has several

A claim without a number says only a direction: `direction = "above"` (or "below") in place of
`excess_pct`, e.g. "the H16 variant ends with a higher loss than the plain one".

Each claim is checked against the ledger row of its recipe and that of its reference (the row's bf16 runs
for bf16, else the reference recipe's row of the same config), over the completed runs only (an
interrupted run's last losses are not final). The loss is a run's final validation loss, or its
endpoint train loss: the mean train loss over the last tenth of its logged steps (`run_metrics.
endpoint_train_loss`), which averages out the noise of one batch. The measured excess is each seed's
loss over the reference runs' mean, the mean over seeds; its 95 % interval is that of the difference
of the two means, in % of the reference mean, paired by seed where both sides ran the same seeds and
Welch's otherwise (`ledger.difference_ci95`; for a val claim against bf16, the row's `val_excess_ci95`).
The verdict says what the seeds allow. For a number: "agrees" when the claimed value
lies inside the interval, "smaller here" or "larger here" when the whole interval lies below or above it.
For a direction: "agrees" when the whole interval lies on the claimed side of 0, "opposite here" when
it lies on the other, "within noise" when it holds 0. "n/a" with fewer than two finite losses on either
side (where each side has one, the measured excess is still shown, with no interval), "not run" where
the ledger has no row for the recipe or its reference. "agrees" with a number
means "seed noise here cannot tell the two apart", at this ledger's scale, no more.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.lab.records.ledger import BASELINE, difference_ci95, final_val, run_records, seeded
from fp4lab.lab.records.run_metrics import endpoint_train_loss
from fp4lab.lab.records.values import format_cell
from fp4lab.validation import Checks, is_number, read_toml

METRICS = ("val", "train")
DIRECTIONS = ("above", "below")
CLAIM_KEYS = ("recipe", "versus", "metric", "excess_pct", "direction", "source", "config")
CLAIM_COLUMNS = (
    "recipe", "versus", "metric", "config", "source", "claimed_excess_pct", "claimed_direction",
    "measured_excess_pct", "measured_excess_std", "measured_ci95_low", "measured_ci95_high", "ci_test", "n_seeds",
    "n_versus", "verdict",
)  # fmt: skip
CLAIM_HEADERS = {
    "recipe": "recipe", "versus": "versus", "metric": "loss", "config": "config", "source": "source",
    "claimed": "claimed", "measured_excess_pct": "measured %", "measured_excess_std": "± std",
    "measured_ci95": "95 % CI", "ci_test": "test", "n_seeds": "seeds", "n_versus": "versus runs", "verdict": "verdict",
}  # fmt: skip


class ClaimsError(ValueError):
    """A malformed claims file or a claim the ledger cannot place; the message names where."""


@dataclass(frozen=True)
class Claim:
    recipe: str
    source: str
    excess_pct: float | None = None
    direction: str | None = None
    versus: str = BASELINE
    metric: str = "val"
    config: str | None = None


def load_claims(path: str | Path) -> list[Claim]:
    """The claims of a TOML file, each checked: raises ClaimsError naming the file, the claim and the fix."""
    path = Path(path)
    table = read_toml(path, ClaimsError, "claims file")
    Checks(lambda message: ClaimsError(f"{path}: {message}")).known_keys(table, ("claim",))
    entries = table.get("claim")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ClaimsError(f"{path}: no claims; add [[claim]] tables with recipe, excess_pct and source")
    return [_claim(entry, f"{path}: claim {index}", path, index) for index, entry in enumerate(entries, start=1)]


def _claim(entry: dict, where: str, path: Path, index: int) -> Claim:
    Checks(lambda message: ClaimsError(f"{path}: {message}")).known_keys(entry, CLAIM_KEYS, f"claim {index}")
    for key in ("recipe", "source"):
        if not isinstance(entry.get(key), str) or not entry[key].strip():
            raise ClaimsError(f"{where}: {key} must be a non-empty string")
    versus = entry.get("versus", BASELINE)
    if not isinstance(versus, str) or not versus.strip() or versus == entry["recipe"]:
        raise ClaimsError(f"{where}: versus must name the reference recipe, another than recipe (default {BASELINE!r})")
    metric = entry.get("metric", "val")
    if metric not in METRICS:
        raise ClaimsError(f"{where}: metric={metric!r}; allowed: 'val' (final validation loss), 'train' (endpoint train loss)")
    direction = entry.get("direction")
    if ("excess_pct" in entry) == (direction is not None):
        raise ClaimsError(f"{where}: give exactly one of excess_pct (the claimed loss excess, in %) and direction ('above' or 'below')")
    if direction is not None and direction not in DIRECTIONS:
        raise ClaimsError(f"{where}: direction={direction!r}; allowed: 'above', 'below' (the recipe's loss against versus's)")
    if direction is None and not is_number(entry["excess_pct"]):
        raise ClaimsError(f"{where}: excess_pct must be a finite number (the paper's loss excess over {versus}, in %)")
    config = entry.get("config")
    if config is not None and not isinstance(config, str):
        raise ClaimsError(f"{where}: config must be a string (a ledger row's config label)")
    excess = float(entry["excess_pct"]) if direction is None else None
    return Claim(entry["recipe"], entry["source"], excess, direction, versus, metric, config)


def check_claims(report: Any, claims: list[Claim]) -> Any:
    """A DataFrame with CLAIM_COLUMNS, one row per claim, from a built report (fp4lab.lab.records.ledger.build_report)."""
    import pandas as pd

    rows = []
    for claim in claims:
        row = {
            "recipe": claim.recipe, "versus": claim.versus, "metric": claim.metric, "config": claim.config or "",
            "source": claim.source, "claimed_excess_pct": claim.excess_pct, "claimed_direction": claim.direction or "",
        }  # fmt: skip
        match = _ledger_row(report, claim.recipe, claim.config)
        reference_row = None if match is None or claim.versus == BASELINE else _ledger_row(report, claim.versus, match["config"])
        if match is None or (claim.versus != BASELINE and reference_row is None):
            rows.append(row | {"verdict": "not run"})
            continue
        reference_runs = match["baseline_runs"] if reference_row is None else reference_row["runs"]
        values = _seeded_losses(report, match["runs"].split(), claim.metric)
        reference = _seeded_losses(report, reference_runs.split(), claim.metric)
        row |= {"config": match["config"], "n_seeds": len(values), "n_versus": len(reference)}
        interval, test = difference_ci95(values, reference)
        ref_mean = statistics.mean(v for _, v in reference) if reference else 0.0
        if not values or ref_mean == 0:
            rows.append(row | {"verdict": "n/a"})
            continue
        excess = [100.0 * (v - ref_mean) / ref_mean for _, v in values]
        if interval is None:  # one seed on a side: the excess says how far, nothing says how sure
            rows.append(row | {"measured_excess_pct": statistics.mean(excess), "verdict": "n/a"})
            continue
        low, high = (100.0 * bound / ref_mean for bound in interval)
        rows.append(row | {
            "measured_excess_pct": statistics.mean(excess), "measured_excess_std": statistics.stdev(excess),
            "measured_ci95_low": low, "measured_ci95_high": high, "ci_test": test, "verdict": _claim_verdict(claim, low, high),
        })  # fmt: skip
    table = pd.DataFrame(rows, columns=list(CLAIM_COLUMNS))
    table["n_seeds"] = table["n_seeds"].astype("Int64")
    table["n_versus"] = table["n_versus"].astype("Int64")
    return table


def _ledger_row(report: Any, recipe: str, config: str | None) -> Any:
    """The ledger row of `recipe` (of `config`), None where there is none; raises ClaimsError where the
    recipe has several rows and no config chooses one."""
    matches = report.ledger[report.ledger["recipe"] == recipe]
    if config is not None:
        matches = matches[matches["config"] == config]
    if len(matches) > 1:
        configs = ", ".join(repr(c) for c in matches["config"])
        raise ClaimsError(f"claim for {recipe!r}: the ledger has {len(matches)} rows ({configs}); name one with config = ...")
    return None if matches.empty else matches.iloc[0]


def _seeded_losses(report: Any, run_ids: list[str], metric: str) -> list[tuple[Any, float]]:
    """(seed, loss) of these runs' completed ones with a finite loss (final validation, or endpoint
    train), in order."""
    def loss(record: dict[str, Any]) -> float | None:
        return final_val(record) if metric == "val" else endpoint_train_loss(report.metrics.get(record["id"]))

    return seeded(run_records(report, run_ids, completed_only=True), loss)


def _claim_verdict(claim: Claim, low: float, high: float) -> str:
    if claim.direction is None:
        return "agrees" if low <= claim.excess_pct <= high else "smaller here" if high < claim.excess_pct else "larger here"
    measured = "above" if low > 0 else "below" if high < 0 else None
    return "within noise" if measured is None else "agrees" if measured == claim.direction else "opposite here"


def attach_claims(report: Any, claims: list[Claim]) -> None:
    """Check the claims against a built report and keep them on it: write_report then writes claims.csv
    and ledger.md gains the claims section."""
    report.claims = check_claims(report, claims)
    report.sections.append(claims_markdown(report.claims))


def _cells(table: Any) -> list[dict[str, str]]:
    """Each claim as display strings: percentages signed with two decimals, missing values empty, the
    claimed number or direction in one cell and the interval in another."""
    def pct(value: Any) -> str:
        return f"{value:+.2f}" if isinstance(value, float) and value == value else ""

    cells = []
    for _, row in table.iterrows():
        low, high = pct(row["measured_ci95_low"]), pct(row["measured_ci95_high"])
        cells.append({
            "recipe": row["recipe"], "versus": row["versus"], "metric": row["metric"], "config": format_cell(row["config"]),
            "source": row["source"], "claimed": row["claimed_direction"] or pct(row["claimed_excess_pct"]),
            "measured_excess_pct": pct(row["measured_excess_pct"]), "measured_excess_std": pct(row["measured_excess_std"]).lstrip("+"),
            "measured_ci95": f"{low}..{high}" if low else "", "ci_test": format_cell(row["ci_test"]), "n_seeds": format_cell(row["n_seeds"]),
            "n_versus": format_cell(row["n_versus"]), "verdict": row["verdict"],
        })  # fmt: skip
    return cells


VERDICTS = (
    "loss: val = final validation loss, train = endpoint train loss (the mean over the last tenth of the logged "
    "steps). measured %: the recipe's loss over the mean of the versus runs', in %, mean over the seeds; 95 % CI: "
    "the interval of the difference of the means, in % of the versus mean, by the test named (paired: the per-seed "
    "differences, where both sides ran the same seeds; welch: Welch's t-test). A claimed number agrees when it lies "
    "in that interval (seed noise here cannot tell them apart); smaller here / larger here: the whole interval "
    "lies below / above it. A claimed direction (above / below) agrees when the whole interval lies on that side "
    "of 0; opposite here: on the other side; within noise: the interval holds 0. n/a: fewer than two finite "
    "losses on a side (with one on each, measured % without an interval); not run: no ledger row for the recipe "
    "or its versus."
)


def claims_markdown(table: Any) -> str:
    """The claims table in Markdown, with what its verdicts mean."""
    headers = list(CLAIM_HEADERS)
    lines = ["| " + " | ".join(CLAIM_HEADERS[h] for h in headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell[h]).replace("|", "\\|") for h in headers) + " |" for cell in _cells(table)]
    return "## Claims\n\n" + "\n".join(lines) + "\n\n" + VERDICTS + "\n"


def render_claims(table: Any):
    """The claims as a rich Table for the terminal: the source and config stay in claims.csv and ledger.md."""
    from rich.table import Table

    rich_table = Table(title="papers' claims vs this ledger", caption=VERDICTS)
    shown = ("recipe", "versus", "metric", "claimed", "measured", "measured_ci95", "n_seeds", "verdict")
    for name in shown:
        header = "measured %" if name == "measured" else CLAIM_HEADERS[name]
        rich_table.add_column(header, justify="left" if name in ("recipe", "versus", "metric", "verdict") else "right", no_wrap=True)
    for cell in _cells(table):
        std = cell["measured_excess_std"]
        cell["measured"] = cell["measured_excess_pct"] + (f" ±{std}" if std else "")
        rich_table.add_row(*(cell[name] for name in shown))
    return rich_table
