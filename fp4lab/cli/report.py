"""`fp4lab report`: the recipe ledger of a sweep, or a ratchet run's iterations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from fp4lab.cli.choices import complete_sweep
from fp4lab.cli.conventions import fail, print_json, rich_console


def report(
    sweep_name: Annotated[Optional[str], typer.Argument(metavar="SWEEP", help="Only this sweep (default: all).", autocompletion=complete_sweep)] = None,
    out: Annotated[Optional[Path], typer.Option(help="Output folder (default: reports/<SWEEP or all>/, reports/ratchet-<TAG>/).")] = None,
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    ratchet: Annotated[Optional[str], typer.Option(help="Report a ratchet run instead: its TAG (metric vs iteration).")] = None,
    claims: Annotated[Optional[Path], typer.Option(help="A TOML file of papers' claims (recipe, excess_pct or direction, versus, metric, source) to set against the ledger: claims.csv and a section of ledger.md.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the ledger rows and the files written as JSON instead of the table.")] = False,
) -> None:
    """The recipe ledger of a sweep (seeds grouped, loss excess vs bf16) as CSV, Markdown and HTML with plots."""
    from fp4lab.lab.ratchet.report import ratchet_report
    from fp4lab.lab.records.ledger import build_report
    from fp4lab.lab.records.render import render_ledger, write_report

    console = rich_console()
    if ratchet is not None:
        if sweep_name is not None or claims is not None:
            fail("report: --ratchet TAG reports a ratchet run; drop the SWEEP and --claims")
        try:
            table, written = ratchet_report(catalog, ratchet, out)
        except (ValueError, OSError) as exc:
            fail(str(exc).splitlines()[0])
        if as_json:
            import pandas as pd

            rows = json.loads(pd.read_csv(written["csv"]).to_json(orient="records"))  # iterations.csv, as written
            print_json({"ratchet": ratchet, "catalog": str(catalog), "rows": rows, "written": written})
            return
        console.print(table)
        for path in written.values():
            console.print(f"wrote {path}")
        return
    try:
        checked = None
        if claims is not None:
            from fp4lab.lab.records.claims import load_claims

            checked = load_claims(claims)  # a malformed file is refused before anything is written
        built = build_report(catalog, sweep=sweep_name, out_dir=out)
        if checked is not None:
            from fp4lab.lab.records.claims import attach_claims

            attach_claims(built, checked)
        written = write_report(built, out)
    except (ValueError, OSError) as exc:
        fail(str(exc).splitlines()[0])
    if as_json:  # the ledger as in ledger.csv; a value with no data (no bf16 reference, one seed) is null
        rows = json.loads(built.ledger.to_json(orient="records"))
        document = {"sweep": sweep_name, "catalog": str(catalog), "notes": built.notes, "rows": rows, "written": written}
        if built.claims is not None:
            document["claims"] = json.loads(built.claims.to_json(orient="records"))
        print_json(document)
        return
    console.print(render_ledger(built))
    if built.claims is not None:
        from fp4lab.lab.records.claims import render_claims

        console.print(render_claims(built.claims))
    for path in written.values():
        console.print(f"wrote {path}")
