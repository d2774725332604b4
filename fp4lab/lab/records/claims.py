"""Papers' claims set against a measured ledger: `fp4lab report SWEEP --claims FILE`.

A claims file is data (TOML): each `[[claim]]` names a recipe, the final loss excess over BF16 a paper
reports for it in percent, and where it comes from:

    [[claim]]
    recipe = "nvfp4-all"
    excess_pct = 1.34
    source = "arXiv 2610.00053 sections 2.6, 5.2: 8B parameters, 160B tokens"
    config = "default"          # optional: the ledger row's config label, where a recipe has several

Each claim is checked against the ledger row of its recipe: the measured excess is the row's final
validation loss over the mean of its bf16 runs', the mean over seeds, and its 95 % interval is
Welch's interval of the difference of the two means (as the row's `val_excess_ci95`), both over the
completed runs only (an interrupted run's last validation is not a final loss). The verdict says what the seeds allow: "agrees" when the claimed
value lies inside the interval, "smaller here" or "larger here" when the whole interval lies below or
above it, "n/a" with fewer than two finite final validation losses on either side, and "not run"
where the ledger has no row for the recipe. "agrees" means "seed noise here cannot tell the two
apart", at this ledger's scale, no more.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.validation import Checks, is_number, read_toml

CLAIM_KEYS = ("recipe", "excess_pct", "source", "config")
CLAIM_COLUMNS = (
    "recipe", "config", "source", "claimed_excess_pct", "measured_excess_pct", "measured_excess_std",
    "measured_ci95_low", "measured_ci95_high", "n_seeds", "n_bf16", "verdict",
)  # fmt: skip
CLAIM_HEADERS = {
    "recipe": "recipe", "config": "config", "source": "source", "claimed_excess_pct": "claimed %",
    "measured_excess_pct": "measured %", "measured_excess_std": "± std", "measured_ci95_low": "95 % CI low",
    "measured_ci95_high": "95 % CI high", "n_seeds": "seeds", "n_bf16": "bf16 runs", "verdict": "verdict",
}  # fmt: skip


class ClaimsError(ValueError):
    """A malformed claims file or a claim the ledger cannot place; the message names where."""


@dataclass(frozen=True)
class Claim:
    recipe: str
    excess_pct: float
    source: str
    config: str | None = None


def load_claims(path: str | Path) -> list[Claim]:
    """The claims of a TOML file, each checked: raises ClaimsError naming the file, the claim and the fix."""
    path = Path(path)
    table = read_toml(path, ClaimsError, "claims file")
    Checks(lambda message: ClaimsError(f"{path}: {message}")).known_keys(table, ("claim",))
    entries = table.get("claim")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise ClaimsError(f"{path}: no claims; add [[claim]] tables with recipe, excess_pct and source")
    claims = []
    for index, entry in enumerate(entries, start=1):
        where = f"{path}: claim {index}"
        Checks(lambda message: ClaimsError(f"{path}: {message}")).known_keys(entry, CLAIM_KEYS, f"claim {index}")
        for key in ("recipe", "source"):
            if not isinstance(entry.get(key), str) or not entry[key].strip():
                raise ClaimsError(f"{where}: {key} must be a non-empty string")
        if not is_number(entry.get("excess_pct")):
            raise ClaimsError(f"{where}: excess_pct must be a finite number (the paper's loss excess over BF16, in %)")
        config = entry.get("config")
        if config is not None and not isinstance(config, str):
            raise ClaimsError(f"{where}: config must be a string (a ledger row's config label)")
        claims.append(Claim(entry["recipe"], float(entry["excess_pct"]), entry["source"], config))
    return claims


def check_claims(report: Any, claims: list[Claim]) -> Any:
    """A DataFrame with CLAIM_COLUMNS, one row per claim, from a built report (fp4lab.lab.records.report)."""
    import pandas as pd

    from fp4lab.lab.records.report import final_val_losses, welch_ci95

    rows = []
    for claim in claims:
        matches = report.ledger[report.ledger["recipe"] == claim.recipe]
        if claim.config is not None:
            matches = matches[matches["config"] == claim.config]
        if len(matches) > 1:
            configs = ", ".join(repr(c) for c in matches["config"])
            raise ClaimsError(f"claim for {claim.recipe!r}: the ledger has {len(matches)} rows ({configs}); name one with config = ...")
        row = {"recipe": claim.recipe, "config": claim.config or "", "source": claim.source, "claimed_excess_pct": claim.excess_pct}
        if matches.empty:
            rows.append(row | {"verdict": "not run"})
            continue
        match = matches.iloc[0]
        # completed runs only: an interrupted run's last validation is not a final loss
        values = final_val_losses(report, match["runs"].split(), completed_only=True)
        reference = final_val_losses(report, match["baseline_runs"].split(), completed_only=True)
        row |= {"config": match["config"], "n_seeds": len(values), "n_bf16": len(reference)}
        interval = welch_ci95(values, reference)
        ref_mean = statistics.mean(reference) if reference else 0.0
        if interval is None or ref_mean == 0:
            rows.append(row | {"verdict": "n/a"})
            continue
        excess = [100.0 * (v - ref_mean) / ref_mean for v in values]
        row |= {"measured_excess_pct": statistics.mean(excess), "measured_excess_std": statistics.stdev(excess)}
        low, high = (100.0 * bound / ref_mean for bound in interval)
        verdict = "agrees" if low <= claim.excess_pct <= high else "smaller here" if high < claim.excess_pct else "larger here"
        rows.append(row | {"measured_ci95_low": low, "measured_ci95_high": high, "verdict": verdict})
    table = pd.DataFrame(rows, columns=list(CLAIM_COLUMNS))
    table["n_seeds"] = table["n_seeds"].astype("Int64")
    table["n_bf16"] = table["n_bf16"].astype("Int64")
    return table


def attach_claims(report: Any, claims: list[Claim]) -> None:
    """Check the claims against a built report and keep them on it: write_report then writes claims.csv
    and ledger.md gains the claims section."""
    report.claims = check_claims(report, claims)
    report.sections.append(claims_markdown(report.claims))


def _cells(table: Any) -> list[list[str]]:
    """The claims as strings: percentages signed with two decimals, missing values empty."""
    from fp4lab.lab.records.report import _fmt

    return [[f"{row[c]:+.2f}" if isinstance(row[c], float) and row[c] == row[c] else _fmt(row[c]) for c in CLAIM_COLUMNS]
            for _, row in table.iterrows()]  # fmt: skip


VERDICTS = (
    "measured %: final validation loss over the bf16 runs' mean, in %, mean over the seeds; 95 % CI: Welch's "
    "interval of the difference of the means, in % of the bf16 mean. agrees: the claimed value lies in that "
    "interval (seed noise here cannot tell them apart); smaller here / larger here: the whole interval lies "
    "below / above it; n/a: fewer than two finite losses on a side; not run: no ledger row for the recipe."
)


def claims_markdown(table: Any) -> str:
    """The claims table in Markdown, with what its verdicts mean."""
    headers = [CLAIM_HEADERS[c] for c in CLAIM_COLUMNS]
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in _cells(table)]
    return "## Claims\n\n" + "\n".join(lines) + "\n\n" + VERDICTS + "\n"


def render_claims(table: Any):
    """The claims as a rich Table for the terminal: the source and config stay in claims.csv and ledger.md."""
    from rich.table import Table

    rich_table = Table(title="papers' claims vs this ledger", caption=VERDICTS)
    for header in ("recipe", "claimed %", "measured %", "95 % CI", "seeds", "verdict"):
        rich_table.add_column(header, justify="left" if header in ("recipe", "verdict") else "right", no_wrap=True)
    index = {column: i for i, column in enumerate(CLAIM_COLUMNS)}
    for row in _cells(table):
        measured = row[index["measured_excess_pct"]] + (f" ±{row[index['measured_excess_std']].lstrip('+')}" if row[index["measured_excess_std"]] else "")
        low, high = row[index["measured_ci95_low"]], row[index["measured_ci95_high"]]
        rich_table.add_row(
            row[index["recipe"]], row[index["claimed_excess_pct"]], measured, f"{low}..{high}" if low else "",
            row[index["n_seeds"]], row[index["verdict"]],
        )  # fmt: skip
    return rich_table
