"""`fp4lab ratchet`: propose, run, keep only what improves the metric; its live view."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from fp4lab.cli.choices import Proposer, RatchetExecutor
from fp4lab.cli.conventions import fail, print_json, rich_console


def ratchet(
    program: Annotated[Optional[Path], typer.Argument(help="The goal, metric, budget, health rules and search space (default: program.md).")] = None,
    program_option: Annotated[Optional[Path], typer.Option("--program", hidden=True, help="Deprecated: pass PROGRAM as the argument.", rich_help_panel="What it runs")] = None,
    iterations: Annotated[Optional[int], typer.Option(help="Proposals to decide in all for this tag (default: [stop].iterations).", rich_help_panel="What it runs")] = None,
    tag: Annotated[Optional[str], typer.Option(help="Names the branch ratchet/<TAG> and its state; the same tag resumes (default: program file name).", rich_help_panel="What it runs")] = None,
    agent: Annotated[Proposer, typer.Option(help="Proposer: optuna (TPE, no network), llm (OpenAI-compatible endpoint) or command (an executable).", rich_help_panel="Proposer")] = "optuna",
    command: Annotated[Optional[str], typer.Option(help="--agent command: the executable and its arguments (split like a shell, never run by one).", rich_help_panel="Proposer")] = None,
    base_url: Annotated[Optional[str], typer.Option(help="--agent llm: endpoint (default $FP4LAB_LLM_BASE_URL, $OPENAI_BASE_URL, http://127.0.0.1:8000/v1).", rich_help_panel="Proposer")] = None,
    model: Annotated[Optional[str], typer.Option(help="--agent llm: model name (default $FP4LAB_LLM_MODEL). The key comes from $FP4LAB_LLM_API_KEY or $OPENAI_API_KEY only.", rich_help_panel="Proposer")] = None,
    timeout: Annotated[Optional[float], typer.Option(help="--agent llm/command: seconds per proposal (default 60 / 300).", rich_help_panel="Proposer")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the optuna sampler and the paired bootstrap.", rich_help_panel="What it runs")] = 0,
    executor: Annotated[RatchetExecutor, typer.Option(help="local (this machine) or slurm (each experiment a submitit job, as the program's [slurm] table asks).", rich_help_panel="Where it runs")] = "local",
    workers: Annotated[int, typer.Option(help="Proposals in flight at once, each in its own worktree.", rich_help_panel="Where it runs")] = 1,
    catalog: Annotated[Path, typer.Option(help="The results catalog (one record per iteration, sweep ratchet/<TAG>).", rich_help_panel="What it runs")] = Path("sweep_catalog.json"),
    as_json: Annotated[bool, typer.Option("--json", help="Print the final summary as JSON (the iterations go to stderr).", rich_help_panel="Output")] = False,
) -> None:
    """Propose a change, run a capped experiment, keep it (git commit) only if the metric strictly improves
    and the run is healthy, otherwise revert; every iteration recorded. Works in its own git worktree.

    PROGRAM (default program.md) holds the goal in prose and a ```toml ratchet``` block: [run], [edit],
    [search_space], [health], [noise], [stop] and [slurm] (docs/RATCHET.md)."""
    from fp4lab.lab.ratchet.loop import Ratchet, RatchetError
    from fp4lab.lab.records.catalog import CatalogError
    from fp4lab.lab.repo import GitError
    from fp4lab.lab.specs.program import ProgramError, load_program

    if program is not None and program_option is not None:
        fail(f"ratchet: two programs given, {str(program)!r} and --program {str(program_option)!r}; pass one, as the argument")
    program = program or program_option or Path("program.md")  # `--program PATH`: the old spelling, still accepted
    if iterations is not None and iterations < 1:
        fail(f"ratchet: --iterations must be >= 1, got {iterations}")
    options = {k: v for k, v in {"base_url": base_url, "model": model, "command": command, "timeout_s": timeout}.items() if v is not None}
    console = rich_console()
    view = _RatchetView(rich_console(stderr=True) if as_json else console)
    try:
        loaded = load_program(program)
        loop = Ratchet(loaded, tag=tag or program.stem, proposer=agent, catalog=catalog, seed=seed,
                       proposer_options=options, executor=executor, workers=workers, on_event=view.event)
        with view:
            summary = loop.run(iterations)
    except (ProgramError, RatchetError, GitError, CatalogError, ValueError) as exc:
        fail(f"ratchet: {str(exc).splitlines()[0]}")
    except KeyboardInterrupt:
        _say_interrupted(loop.summary("Ctrl-C"), view, program, catalog)
        raise typer.Exit(130) from None
    if program_option is not None:  # said once it worked, so that an error stays one line
        print(f"fp4lab: note: ratchet --program is deprecated; pass the program as the argument: fp4lab ratchet {program}",
              file=sys.stderr)
    if as_json:
        print_json(summary)
        return
    console.print(
        f"ratchet [bold]{summary['tag']}[/]: stopped after {summary['reason']}; baseline {_fmt(summary['baseline'])} "
        f"(sigma {_fmt(summary['sigma'])}), best {_fmt(summary['best'])}; kept iterations "
        f"{', '.join(map(str, summary['kept'])) or 'none'} on branch {summary['branch']} ({summary['worktree']}); "
        f"table {summary['results']}; plot: {shlex.join(_report_command(summary['tag'], catalog))}"
    )


def _report_command(tag: str, catalog: Path) -> list[str]:
    """The command that plots this ratchet's iterations, naming the catalog where it is not the default."""
    command = ["fp4lab", "report", "--ratchet", tag]
    return command if Path(catalog) == Path("sweep_catalog.json") else [*command, "--catalog", str(catalog)]


def _say_interrupted(summary: dict, view, program: Path, catalog: Path) -> None:
    """What a Ctrl-C'd ratchet finished, what it left running, and the command that goes on from there."""
    running = ", ".join(str(n) for n in sorted(view.running)) or "none"
    again = ["fp4lab", "ratchet", str(program), "--tag", summary["tag"]]
    if catalog != Path("sweep_catalog.json"):
        again += ["--catalog", str(catalog)]
    print(f"ratchet {summary['tag']}: interrupted; {view.decided} iteration(s) decided in this call "
          f"(kept in all: {', '.join(map(str, summary['kept'])) or 'none'}; best {_fmt(summary['best'])}); "
          f"stopped while running iteration(s) {running}, which continue(s) from its checkpoint on resuming", file=sys.stderr)
    print(f"resume with: {shlex.join(again)} (add the same --agent and options)", file=sys.stderr)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.6g}"


class _RatchetView:
    """The ratchet's live view: a table of decided iterations under a line for the one running."""

    STYLE = {"keep": "bold green", "discard": "yellow", "crash": "red", "invalid": "red", "duplicate": "dim", "stale": "dim",
             "baseline": "cyan", "pruned": "magenta"}

    def __init__(self, console) -> None:
        self.console, self.rows, self.running, self.live = console, [], {}, None
        self.decided = 0

    def __enter__(self):
        if self.console.is_terminal:
            from rich.live import Live

            self.live = Live(self._render(), console=self.console, refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def event(self, kind: str, data: dict) -> None:
        from fp4lab.lab.ratchet.report import decision_reason

        if kind == "note":
            self.console.print(data["message"], style="dim", markup=False)
        elif kind == "start":
            proposal = data["proposal"]
            what = "baseline (unchanged tree)" if proposal is None else _describe_proposal(proposal.kind, proposal.params, proposal.rationale)
            self.running[data["iteration"]] = f"iteration {data['iteration']}: {what}"
            if self.live is None:
                self.console.print(f"running {self.running[data['iteration']]}", markup=False)
        elif kind == "decided":
            extra = data["extra"]
            proposal = extra.get("proposal") or {}
            what = ("baseline" if extra["iteration"] == 0 else proposal.get("error") or
                    _describe_proposal(proposal.get("kind"), proposal.get("params") or {}, proposal.get("rationale") or ""))
            self.rows.append((extra["iteration"], what, extra.get("metric"), extra.get("compared_with"), extra.get("gain"),
                              extra["decision"], decision_reason(extra)))
            self.running.pop(extra["iteration"], None)
            self.decided += 1
            if self.live is None:
                self.console.print(f"iteration {extra['iteration']}: {extra['decision']}  {what}  metric {_fmt(extra.get('metric'))}"
                                   + (f" vs {_fmt(extra['compared_with'])}" if extra.get("compared_with") is not None else "")
                                   + f": {decision_reason(extra)}", markup=False)
        if self.live is not None:
            self.live.update(self._render())

    def _render(self):
        from rich.console import Group
        from rich.markup import escape
        from rich.table import Table

        table = Table(title="fp4lab ratchet", expand=False)
        for column in ("iter", "proposal", "metric", "compared\nwith", "gain", "decision", "why"):
            table.add_column(column, overflow="fold", justify="right" if column in ("iter", "metric", "compared\nwith", "gain") else "left")
        for number, what, metric, compared, gain, decision, why in self.rows[-30:]:
            style = self.STYLE.get(decision, "")
            table.add_row(str(number), escape(what[:70]), _fmt(metric), _fmt(compared), "" if gain is None else f"{gain:+.4g}",
                          f"[{style}]{decision}[/]" if style else decision, escape(why))
        return Group(table, *(f"[bold]running[/] {escape(line)}" for _, line in sorted(self.running.items())))


def _describe_proposal(kind, params: dict, rationale: str) -> str:
    if kind == "params":
        return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
    return f"diff: {rationale}" if rationale else "diff"
