"""The sweep commands: `fp4lab sweep` runs a spec's runs, `trial` one Optuna trial of it, `status` shows
the catalog's runs, `scan` judges logs."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from fp4lab.cli.choices import LogPreset, SweepExecutor
from fp4lab.cli.conventions import fail, print_json, rich_console
from fp4lab.cli.train import print_summary_block


def scan(
    logs: Annotated[list[Path], typer.Argument(help="Run folders, metrics.jsonl files, fp4lab's jobs/<sweep>/logs/*.local.log, or text logs of other trainers.")],
    preset: Annotated[Optional[LogPreset], typer.Option(help="Format of text logs (default: the preset matching the most lines).")] = None,
    regex: Annotated[Optional[str], typer.Option(help="Regex with named groups step and loss (optional grad_norm, val_loss).")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option(help="NAME=VALUE threshold override, repeatable (e.g. spike_sigma=5).")] = None,
    running: Annotated[Optional[bool], typer.Option("--running/--not-running", help="Whether the job is alive (default: judge by the log's age).")] = None,
    events: Annotated[bool, typer.Option("--events", help="Print every event under its run's line.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of one line per log.")] = False,
) -> None:
    """Scan logs for NaNs, loss spikes, a vanished loss, entropy collapse and large attention logits; print a verdict per log.

    Exit code 0 when every verdict is converged or running (nothing wrong); 1 when any log raises an
    alarm (diverged, entropy_collapse, loss_vanished, no_loss, unstable, crashed, timeout, stalled),
    live jobs included; 2 on bad options or when a path cannot be scanned (each such path gets an
    error line on stderr; the other paths are still scanned and printed).
    """
    from fp4lab.lab.records.logscan import HEALTHY_VERDICTS, LogFormat, ScanThresholds, format_result
    from fp4lab.lab.records.logscan import scan as scan_log

    try:
        thresholds = ScanThresholds().with_overrides(threshold or [])
        if regex is not None:
            LogFormat.from_regex(regex)
    except ValueError as exc:
        fail(f"scan: {str(exc).splitlines()[0]}")
    results, unreadable = [], 0
    for path in logs:
        try:
            results.append(scan_log(path, thresholds, regex=regex, preset=preset, running=running))
        except (OSError, ValueError) as exc:
            unreadable += 1
            print(f"fp4lab: error: scan: {str(exc).splitlines()[0]}", file=sys.stderr)
    if as_json:
        print_json([r.to_dict() for r in results])
    else:
        for result in results:
            print(format_result(result))
            for event in result.events if events else ():
                print(f"    {event.kind}@{event.step}: {event.detail}")
    if unreadable:
        raise typer.Exit(2)
    raise typer.Exit(0 if all(r.status in HEALTHY_VERDICTS for r in results) else 1)


def sweep(
    spec: Annotated[Path, typer.Argument(help="A sweep spec, e.g. sweeps/quickstart.toml (docs/SWEEPS.md).")],
    executor: Annotated[SweepExecutor, typer.Option(help="local (this machine), slurm (submitit job arrays) or sbatch (plain sbatch of the written scripts).")] = "local",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Write jobs/<sweep>/ (configs and SBATCH scripts) and print the plan; start nothing, record nothing in the catalog.")] = False,
    workers: Annotated[int, typer.Option(help="Local executor: runs at once; with at least that many GPUs (times ranks per run), each run gets GPUs of its own.")] = 1,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Also rerun failed, cancelled and timed-out runs (they resume from their checkpoints; interrupted and preempted runs resume anyway).")] = False,
    jobs_dir: Annotated[Path, typer.Option(help="Where SBATCH scripts and run configs go.")] = Path("jobs"),
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    as_json: Annotated[bool, typer.Option("--json", help="With --dry-run: print the plan (runs, skipped runs, problems) as JSON.")] = False,
) -> None:
    """Expand a sweep spec into runs, write their SBATCH scripts, run what is still needed, record every run.

    Exits 1 when a run of the sweep failed (its error is shown; --dry-run too, when the catalog holds
    failed runs of the sweep), 130 after Ctrl-C (the runs in progress checkpoint and the next
    `fp4lab sweep` resumes them), 2 on a bad spec or argument."""
    from rich.markup import escape

    from fp4lab.lab.records.catalog import Catalog, CatalogError
    from fp4lab.lab.runs.executors import make_executor
    from fp4lab.lab.runs.slurm import SubmissionError
    from fp4lab.lab.runs.sweep import needed_runs, plan_sweep, preflight, register_runs
    from fp4lab.lab.specs.sweep_spec import SpecError

    if workers < 1:
        fail(f"sweep: --workers must be >= 1, got {workers}")
    if as_json and not dry_run:
        fail("sweep: --json prints the plan of --dry-run; add --dry-run (the runs of a sweep as JSON: fp4lab status SWEEP --json)")
    console = rich_console()
    try:
        runner = make_executor(executor, **({"workers": workers} if executor == "local" else {}))
        runs_catalog = Catalog(catalog)
        runs_catalog.records()  # a corrupt catalog fails here, before anything is written
        plan = plan_sweep(spec, jobs_dir, catalog, runner.check, ask_slurm=executor != "local")
        problems = preflight(plan, executor)
        if problems and not dry_run:
            fail(f"sweep: {problems[0]}" + (f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""))
        if not dry_run:  # a dry run records nothing: the catalog holds only runs a sweep started
            register_runs(plan, runs_catalog, runner.records_as)
        todo, skipped = needed_runs(plan, runs_catalog, retry_failed=retry_failed)
    except (SpecError, CatalogError, ValueError) as exc:
        fail(str(exc).splitlines()[0])
    if as_json:
        print_json(_sweep_plan(plan, todo, skipped, problems, runs_catalog))
        _exit_on_failures(runs_catalog, plan)
        return
    _print_sweep_heading(console, plan, todo, skipped, runs_catalog)
    optuna = plan.spec.method == "optuna"
    if dry_run or (not todo and not optuna):
        for run in todo:
            console.print(f"  {run.id}  {run.name}  {plan.sweep_dir / (run.id + '.sbatch')}")
        for script in plan.scripts if optuna else ():
            console.print(f"  {script}")
        for problem in problems if dry_run else ():
            console.print(f"  [yellow]would fail:[/] {escape(problem)}")
        if dry_run:
            console.print(f"dry run: nothing started or recorded in {catalog}; the scripts are in {plan.sweep_dir}")
        _exit_on_failures(runs_catalog, plan)
        return
    if not runner.waits:
        try:
            launched = runner.launch(plan, todo, runs_catalog)
        except SubmissionError as exc:
            fail(f"sweep: Slurm submission failed: {exc} (--executor local runs it here)")
        console.print(f"submitted Slurm jobs {', '.join(launched.job_ids) or '(none: the study is complete)'}; "
                      f"follow them with: fp4lab status {plan.spec.name}")
        return
    _run_here(console, runner, plan, todo, runs_catalog, spec)
    _print_status(runs_catalog, plan.spec.name)
    _exit_on_failures(runs_catalog, plan)


def _print_sweep_heading(console, plan, todo, skipped: dict, runs_catalog) -> None:
    """What the sweep holds: its runs, how many are to run and why the others are skipped (the failed
    and in-flight ones by name), or for an Optuna sweep its study's trials."""
    if plan.spec.method == "optuna":
        from fp4lab.lab.runs.trials import trial_counts

        counts = trial_counts(plan.spec, plan.jobs_dir)
        console.print(f"sweep [bold]{plan.spec.name}[/] (optuna, {plan.spec.optuna.objective} {plan.spec.optuna.direction}): "
                      f"{plan.spec.optuna.n_trials} trials, study {plan.spec.optuna_storage(plan.jobs_dir)} holds "
                      f"{', '.join(f'{n} {k.lower()}' for k, n in counts.items()) or 'none yet'}; scripts in {plan.sweep_dir}")
        return
    skipped_text = ", ".join(f"{len(runs)} {reason}" for reason, runs in skipped.items())
    console.print(f"sweep [bold]{plan.spec.name}[/]: {len(plan.runs)} runs, {len(todo)} to run"
                  f"{', skipped: ' + skipped_text if skipped_text else ''}; scripts in {plan.sweep_dir}")
    for run in skipped.get("failed", []):
        record = runs_catalog.get(run.id)
        console.print(f"  {run.id}  {run.name}: {record['state']}: {record.get('error') or record.get('verdict') or 'no error recorded'}"
                      " (--retry-failed reruns it)", markup=False)
    for run in skipped.get("in flight", []):
        record = runs_catalog.get(run.id)
        driver = record.get("owner") or f"Slurm job {record.get('slurm_job_id')}"
        console.print(f"  {run.id}  {run.name}: in flight ({record['state']}, {driver}); left to it", markup=False)


def _run_here(console, runner, plan, todo, runs_catalog, spec: Path) -> None:
    """Run the sweep on this machine (the local executor waits for its runs), a line as each run starts
    and ends; Ctrl-C stops the runs at a checkpoint and exits 130."""
    from fp4lab.lab.runs.executors import SweepInterrupted

    optuna = plan.spec.method == "optuna"

    def started(run) -> None:
        if not console.is_terminal:
            console.print(f"  {run.id}  {run.name}: started", markup=False)

    def finished(record) -> None:
        if optuna:
            console.print(f"  trial {record['extra'].get('trial')}  {record['id']}  {record['extra'].get('name')}: "
                          f"{record['state']}, {record.get('verdict')}, {plan.spec.optuna.objective} {record['extra'].get('objective')}",
                          markup=False)
            return
        line = f"  {record['id']}  {record['extra'].get('name')}: {record['state']}, {record.get('verdict')}, val {record['summary'].get('final_val_loss')}"
        console.print(line + (f": {record['error']}" if record.get("error") else ""), markup=False)

    runner.on_start, runner.on_finish = started, finished
    try:
        with _sweep_progress(console, runs_catalog, plan, [] if optuna else todo):
            launched = runner.launch(plan, todo, runs_catalog)
    except SweepInterrupted as stopped:
        console.print(f"interrupted: {len(stopped.records)} run(s) stopped; `fp4lab sweep {spec}` resumes them from their last checkpoints")
        raise typer.Exit(130) from None
    if optuna and launched.started == 0:
        console.print("the study already holds every trial; raise [optuna].n_trials to run more", markup=False)


def _sweep_plan(plan, todo, skipped: dict, problems: list[str], runs_catalog) -> dict:
    """`fp4lab sweep --dry-run --json`: what a sweep of this spec would start, what it would skip and why,
    and what would make it fail. Paths of files the sweep wrote are absolute; a run's run_dir is as its config says."""
    sweep_dir = plan.sweep_dir.resolve()

    def run_entry(run) -> dict:
        return {"id": run.id, "name": run.name, "params": run.params, "run_dir": run.config.get("out_dir"),
                "config": str(sweep_dir / f"{run.id}.toml"), "script": str(sweep_dir / f"{run.id}.sbatch")}

    document = {
        "sweep": plan.spec.name, "method": plan.spec.method, "spec": str(Path(plan.spec.path).resolve()), "sweep_dir": str(sweep_dir),
        "catalog": str(runs_catalog.path), "runs": [run_entry(run) for run in todo],
        "skipped": [
            {**run_entry(run), "reason": reason, "state": record["state"], "error": record.get("error")}
            for reason, runs in skipped.items() for run in runs for record in [runs_catalog.get(run.id)]
        ],
        "scripts": [str(Path(script).resolve()) for script in plan.scripts], "problems": problems,
    }  # fmt: skip
    if plan.spec.method == "optuna":
        from fp4lab.lab.runs.trials import trial_counts

        optuna = plan.spec.optuna
        document["optuna"] = {"n_trials": optuna.n_trials, "objective": optuna.objective, "direction": optuna.direction,
                              "study": str(plan.spec.optuna_storage(plan.jobs_dir)),
                              "trials": trial_counts(plan.spec, plan.jobs_dir)}  # fmt: skip
    return document


def _exit_on_failures(runs_catalog, plan) -> None:
    from fp4lab.lab.records.catalog import FAILED_STATES

    failed = [r for r in runs_catalog.records(sweep=plan.spec.name) if r["state"] in FAILED_STATES]
    if failed:
        print(f"sweep: {len(failed)} run(s) of {plan.spec.name!r} failed; see their errors above (fp4lab status {plan.spec.name})", file=sys.stderr)
        raise typer.Exit(1)


def _sweep_progress(console, runs_catalog, plan, todo):
    """On a terminal, a live view of the sweep while it runs: runs done / running / pending, each running
    run's step, loss and time left. Elsewhere nothing (lines are printed as runs start and end)."""
    import contextlib
    import time

    if not console.is_terminal or not todo:
        return contextlib.nullcontext()
    from datetime import UTC, datetime

    from rich.live import Live
    from rich.table import Table

    from fp4lab.lab.runs.sweep import progress_of

    ids = {run.id for run in todo}
    began = time.monotonic()

    def view() -> Table:
        records = [r for r in runs_catalog.records(sweep=plan.spec.name) if r["id"] in ids]
        counts = {k: sum(r["state"] == k for r in records) for k in ("completed", "running", "submitted")}
        done = len(records) - counts["running"] - counts["submitted"] - sum(r["state"] == "pending" for r in records)
        table = Table(title=f"sweep {plan.spec.name}: {done} done, {counts['running']} running, {len(ids) - done - counts['running']} pending "
                            f"({time.monotonic() - began:.0f} s)")
        for column in ("id", "run", "step", "loss", "time left"):
            table.add_column(column)
        for record in records:
            if record["state"] != "running":
                continue
            step, loss = progress_of(record, runs_catalog)
            steps = record["config"].get("steps")
            left = ""
            if step and steps and record.get("started_at"):
                started = datetime.fromisoformat(record["started_at"].replace("Z", "+00:00"))
                elapsed = (datetime.now(UTC) - started).total_seconds()
                left = f"{elapsed / (step + 1) * (steps - step - 1):.0f} s"
            table.add_row(record["id"], record["extra"].get("name", ""), f"{step}/{steps}" if step is not None else "",
                          "" if loss is None else f"{loss:.4f}", left)
        return table

    return Live(get_renderable=view, console=console, refresh_per_second=1, transient=True)


def trial(
    spec: Annotated[Path, typer.Argument(help="A method = \"optuna\" sweep spec (jobs/<sweep>/spec.toml in sweep jobs).")],
    jobs_dir: Annotated[Path, typer.Option(help="The jobs folder holding the study (jobs/<sweep>/optuna.journal).")] = Path("jobs"),
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    slot: Annotated[int, typer.Option(help="This job's slot (array task): offsets the sampler seed.")] = 0,
    resume: Annotated[Optional[int], typer.Option(help="Continue this RUNNING trial number instead of asking a new one.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the trial's catalog record as JSON.")] = False,
) -> None:
    """Run one trial of an Optuna sweep: ask the study, train, tell (what each optuna sweep job runs)."""
    from fp4lab.lab.records.catalog import Catalog, CatalogError
    from fp4lab.lab.runs.trials import run_trial
    from fp4lab.lab.specs.sweep_spec import SpecError
    from fp4lab.nn.recipe import RecipeError
    from fp4lab.train.config import ConfigError

    try:
        record = run_trial(spec, jobs_dir=jobs_dir, catalog_path=catalog, slot=slot, resume=resume)
        run_dir = Catalog(catalog).resolve(record["paths"]["run_dir"])
    except (SpecError, CatalogError, ConfigError, RecipeError, ValueError) as exc:
        fail(f"trial: {str(exc).splitlines()[0]}")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        summary = None  # stopped before its first summary: the worker log ends in progress lines
    if summary is not None:  # beside the progress lines on stderr when stdout carries the JSON record
        print_summary_block(summary, record["paths"]["run_dir"], file=sys.stderr if as_json else None)
    if as_json:
        print_json(record)
    else:
        print(f"trial {record['extra'].get('trial')} run {record['id']} ({record['extra'].get('name')}): {record['state']}, "
              f"{record.get('verdict')}, objective {record['extra'].get('objective')}")


def status(
    sweep_name: Annotated[Optional[str], typer.Argument(metavar="SWEEP", help="Only this sweep (default: all).")] = None,
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    watch: Annotated[float, typer.Option(help="Refresh every N seconds until every run has ended (0: once).")] = 0.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the runs as a JSON list instead of a table.")] = False,
    rescan: Annotated[bool, typer.Option(help="First judge every ended run again from its metrics with the current scanner and record the new verdicts and events (a run otherwise keeps the verdict it ended with).")] = False,
) -> None:
    """A table of the runs in the catalog: state, step, loss, verdict (refreshed from their run folders)."""
    from fp4lab.lab.records.catalog import Catalog, CatalogError

    if as_json and watch > 0:
        fail("status: --json prints the runs once; drop --watch")
    if not catalog.exists():
        fail(f"status: no catalog at {str(catalog)!r}; run fp4lab sweep SPEC first (or pass --catalog)")
    try:
        runs_catalog = Catalog(catalog)
        if rescan:
            from fp4lab.lab.records.logscan import ScanThresholds
            from fp4lab.lab.runs.sweep import rescan as rescan_runs

            changed = rescan_runs(runs_catalog, ScanThresholds(), sweep_name)
            print(f"rescanned: {changed} verdict(s) or event list(s) changed", file=sys.stderr)
        if as_json:
            print_json(_status_rows(runs_catalog, sweep_name))
        else:
            _print_status(runs_catalog, sweep_name, watch=watch)
    except CatalogError as exc:
        fail(str(exc).splitlines()[0])


def _status_rows(runs_catalog, sweep_name: str | None) -> list[dict]:
    """The runs of `sweep_name` (all sweeps but ratchets when None), refreshed from their run folders
    and the scheduler: one dict per run, what `fp4lab status` shows."""
    from fp4lab.lab.records.catalog import TERMINAL_STATES
    from fp4lab.lab.records.logscan import ScanThresholds
    from fp4lab.lab.runs.sweep import progress_of, refresh

    if sweep_name is not None and not runs_catalog.records(sweep=sweep_name):
        known = sorted({r["sweep"] for r in runs_catalog.records(per_sweep=True) if r["sweep"]})
        fail(f"status: no sweep {sweep_name!r} in {runs_catalog.path} (sweeps: {', '.join(known) or 'none'})")
    refresh(runs_catalog, ScanThresholds(), sweep_name)
    records = runs_catalog.records(sweep=sweep_name, per_sweep=True)
    if sweep_name is None:  # ratchet iterations have their own view: fp4lab report --ratchet TAG
        records = [r for r in records if not (r["sweep"] or "").startswith("ratchet/")]
    rows = []
    for record in records:
        step, loss = progress_of(record, runs_catalog)
        if record["state"] in TERMINAL_STATES and record["summary"]:  # as the report shows it: the last finite loss
            loss = record["summary"].get("final_train_loss")
        rows.append({
            "sweep": record["sweep"], "id": record["id"], "name": record["extra"].get("name"), "state": record["state"],
            "step": step, "loss": loss, "val_loss": record["summary"].get("final_val_loss"), "verdict": record["verdict"],
            "error": record.get("error"), "slurm_job_id": record["slurm_job_id"], "slurm_array_index": record["slurm_array_index"],
            "run_dir": (record.get("paths") or {}).get("run_dir"),
        })  # fmt: skip
    return rows


def _print_status(runs_catalog, sweep_name: str | None, watch: float = 0.0) -> None:
    import time

    from rich.live import Live
    from rich.table import Table

    def table() -> tuple[Table, bool]:
        rows = _status_rows(runs_catalog, sweep_name)
        view = Table(title=f"runs{' of ' + sweep_name if sweep_name else ''} ({runs_catalog.path})")
        for column in ("sweep", "id", "run", "state", "step", "loss", "val loss", "verdict", "job"):
            view.add_column(column, no_wrap=column not in ("run", "verdict"))
        for row in rows:
            verdict = row["verdict"] or ""
            if row["error"]:
                verdict = f"{verdict + ': ' if verdict else ''}{row['error']}"
            loss, val = row["loss"], row["val_loss"]
            view.add_row(
                row["sweep"] or "", row["id"], row["name"] or "", row["state"],
                "" if row["step"] is None else str(row["step"]), "" if loss is None else f"{loss:.4f}",
                "" if val is None else f"{val:.4f}", verdict,
                str(row["slurm_job_id"] or "") + ("" if row["slurm_array_index"] is None else f"_{row['slurm_array_index']}"),
            )
        active = any(r["state"] in ("pending", "submitted", "running") for r in rows)
        return view, active

    console = rich_console()
    view, active = table()
    if watch <= 0 or not active:
        console.print(view)
        return
    with Live(view, console=console, refresh_per_second=1) as live:
        while active:
            time.sleep(watch)
            view, active = table()
            live.update(view)


def forget(
    sweep_name: Annotated[str, typer.Argument(metavar="SWEEP", help="The sweep whose rows leave the catalog.")],
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation (needed when stdin is not a terminal).")] = False,
    delete_runs: Annotated[bool, typer.Option("--delete-runs", help="Also delete the run folders of the rows removed (checkpoints, logs, metrics).")] = False,
) -> None:
    """Forget a sweep: its runs leave the catalog; run folders stay unless --delete-runs.

    A run another sweep shares stays, without this sweep's name; jobs/ is kept; a sweep with a run in
    flight is refused."""
    from fp4lab.lab.records.catalog import Catalog, CatalogError
    from fp4lab.lab.runs.forget import SweepInFlight, forget, plan_forget

    if not catalog.exists():
        fail(f"forget: no catalog at {str(catalog)!r} (pass --catalog)")
    try:
        runs_catalog = Catalog(catalog)
        forgetting = plan_forget(runs_catalog, sweep_name)
    except (CatalogError, ValueError) as exc:
        fail(f"forget: {str(exc).splitlines()[0]}")
    folders = forgetting.run_dirs(runs_catalog) if delete_runs else []
    what = (f"forget sweep {sweep_name}: {len(forgetting.removed)} run(s) leave {catalog}"
            + (f", {len(forgetting.shared)} shared with other sweeps stay" if forgetting.shared else "")
            + (f"; delete {len(folders)} run folder(s)" if delete_runs else "; run folders are kept"))
    if not yes:
        if not sys.stdin.isatty():
            fail(f"forget: {what}: add --yes to confirm (stdin is not a terminal)")
        typer.confirm(what + ". Go on?", abort=True, err=True)
    try:
        deleted = forget(runs_catalog, forgetting, delete_runs=delete_runs)
    except (CatalogError, SweepInFlight) as exc:
        fail(f"forget: {str(exc).splitlines()[0]}")
    print(f"forgot sweep {sweep_name}: {len(forgetting.removed)} run(s) removed, {len(forgetting.shared)} shared kept"
          + (f", {len(deleted)} run folder(s) deleted" if delete_runs else ""))
