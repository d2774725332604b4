"""What every fp4lab command does the same way: plain help text, one-line errors, one JSON document
for `--json`, and a console that does not truncate tables when piped."""

from __future__ import annotations

import json
import re
import sys
from typing import Any, NoReturn

import typer
from typer.core import TyperGroup

from fp4lab.train.jsonl import nonfinite_as_strings


def _plain_help(command, params: list) -> list:
    """Help text as written: typer reads it as rich markup, where `[stop]` or `[slurm]` (TOML tables)
    would vanish as unknown tags, so each text is escaped (once). Flags lose the `<bool>` value type
    typer labels them with, as if they took a value."""
    from rich.markup import escape

    for item in (command, *params):
        if getattr(item, "help", None) and not getattr(item, "_fp4lab_plain_help", False):
            item.help = escape(re.sub(r"(?<!\n)\n(?!\n)", " ", item.help))  # a paragraph reflows to the terminal
            item._fp4lab_plain_help = True
    for param in params:
        if getattr(param, "is_flag", False):
            param.metavar = ""
        if getattr(param, "param_type_name", None) == "argument":  # usage reads "SPEC", "[SWEEP]", "LOGS...", not "{spec}"
            param._usage_display_name = _usage_name(param)
    return params


def _usage_name(param):
    name = (param.metavar or param.name).upper()
    shown = name if param.required else f"[{name}]"
    return lambda: shown + ("..." if param.nargs != 1 else "")


class Commands(TyperGroup):
    """An fp4lab command group: it and each of its commands get plain help text (_plain_help)."""

    def get_params(self, ctx: typer.Context) -> list:
        return _plain_help(self, super().get_params(ctx))

    def get_command(self, ctx: typer.Context, name: str):
        command = super().get_command(ctx, name)
        if command is not None and not isinstance(command, Commands):
            _plain_help(command, command.get_params(ctx))
        return command


class UserError(Exception):
    """A mistake in the user's input: reported in one line, exit code 2."""


def fail(message: str) -> NoReturn:
    raise UserError(message)


def choice_error(exc) -> str | None:
    """A value outside an option's choices, in fp4lab's words (the command, the option, the value, the
    allowed values): `sweep: --executor 'cloud' is not supported; allowed: local, slurm, sbatch`.
    None for any other usage error, which keeps typer's message."""
    param = getattr(exc, "param", None)
    choices = getattr(getattr(param, "type_descriptor", None), "choices", None)
    found = re.match(r"(?:Value error, )?(.+) is not one of ", str(getattr(exc, "message", "")))
    if not choices or found is None:
        return None
    name = param.opts[0] if param.opts and param.opts[0].startswith("-") else param.name.upper()
    names, ctx = [], exc.ctx
    while ctx is not None and ctx.parent is not None:  # the command's names under the root: "recipes show"
        names.insert(0, ctx.info_name)
        ctx = ctx.parent
    command = " ".join(names)
    return f"{command + ': ' if command else ''}{name} {found.group(1)} is not supported; allowed: {', '.join(map(str, choices))}"


def print_json(document: Any) -> None:
    """The one JSON document of a `--json` command, on stdout: strict JSON, with non-finite floats as
    the strings "nan", "inf" and "-inf" (as in metrics.jsonl) and paths as strings."""
    json.dump(nonfinite_as_strings(document), sys.stdout, indent=1, allow_nan=False, default=str)
    sys.stdout.write("\n")


def rich_console(stderr: bool = False):
    """A rich console on stdout (or stderr); when output is piped, wide enough that tables do not truncate."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr) if stream.isatty() else Console(stderr=stderr, width=140)
