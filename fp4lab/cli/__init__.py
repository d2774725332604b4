"""The `fp4lab` command line: the app, its commands in --help order, and the entry point `main`.

Commands import torch (and everything heavy) inside their bodies, so `fp4lab --help` stays fast.
Conventions, the same on every command (fp4lab.cli.conventions): the main input is a positional
argument; an enumerated option is a choice that `--help` lists (fp4lab.cli.choices); `--json` (on
every command that lists or reports) prints exactly one JSON document on stdout and nothing else
there; help text is plain text (brackets such as `[slurm]` are shown as written). Exit codes: 0 ok,
1 a scan or a run found a problem, 2 a usage or input error (one line on stderr), 130 interrupted.

One module per command group: numerics, train, bench, sweep (sweep, trial, status, scan), report,
export, ratchet, recipes, data.
"""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from fp4lab.cli import bench, data, export, numerics, ratchet, recipes, report, sweep, train
from fp4lab.cli.conventions import Commands, UserError, choice_error

app = typer.Typer(
    name="fp4lab",
    cls=Commands,
    help="Find which FP4 training recipe trains a language model stably and fast.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"fp4lab {version('fp4lab')}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print fp4lab's version and exit.")
    ] = None,
) -> None:
    """Find which FP4 training recipe trains a language model stably and fast."""


for command in (numerics.numerics, train.train, bench.bench, sweep.scan, sweep.sweep, sweep.trial, sweep.status,
                sweep.forget, report.report, export.export, ratchet.ratchet):  # fmt: skip
    app.command()(command)
app.add_typer(recipes.group, name="recipes")
app.add_typer(data.group, name="data")


def main() -> None:
    """Console entry point: one-line errors and exit code 2 for every usage or input mistake."""
    from typer.exceptions import TyperException

    try:
        code = app(standalone_mode=False, prog_name="fp4lab")
    except UserError as exc:
        print(f"fp4lab: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except TyperException as exc:  # usage errors: unknown option, bad value, missing argument
        message = exc.format_message()
        if not message:  # bare `fp4lab` (or a bare group): the help it printed is the whole answer
            sys.exit(0)
        print(f"fp4lab: error: {choice_error(exc) or message}", file=sys.stderr)
        sys.exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        print("fp4lab: aborted", file=sys.stderr)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)
