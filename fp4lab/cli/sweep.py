"""The sweep commands: `fp4lab sweep` runs a spec's runs, `trial` one Optuna trial of it, `status` shows
the catalog's runs, `scan` judges logs."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from fp4lab.cli.choices import LogPreset, SweepExecutor, complete_sweep
from fp4lab.cli.conventions import fail, print_json, rich_console
from fp4lab.cli.train import print_summary_block


def scan(
    logs: Annotated[Optional[list[Path]], typer.Argument(help="Run folders, metrics.jsonl files, fp4lab's jobs/<sweep>/logs/*.local.log, or text logs of other trainers (default: every run folder of the catalog).")] = None,
    preset: Annotated[Optional[LogPreset], typer.Option(help="Format of text logs (default: the preset matching the most lines).")] = None,
    regex: Annotated[Optional[str], typer.Option(help="Regex with named groups step and loss (optional grad_norm, val_loss).")] = None,
    threshold: Annotated[Optional[list[str]], typer.Option(help="NAME=VALUE threshold override, repeatable (e.g. spike_sigma=5).")] = None,
    running: Annotated[Optional[bool], typer.Option("--running/--not-running", help="Whether the job is alive (default: judge by the log's age).")] = None,
    events: Annotated[bool, typer.Option("--events", help="Print every event under the table, by run.")] = False,
    catalog: Annotated[Path, typer.Option(help="The results catalog: names the runs scanned, and its run folders are what a scan without LOGS reads.")] = Path("sweep_catalog.json"),
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Scan logs for NaNs, loss spikes, a vanished loss, entropy collapse and large attention logits; a verdict per log.

    A log of an fp4lab run the catalog knows is judged from its run folder's metrics.jsonl (every
    step; the log prints some), so a run folder and its log get the same answer. Exit code 0 when every
    verdict is converged or running (nothing wrong); 1 when any log raises an alarm (diverged,
    entropy_collapse, loss_vanished, no_loss, unstable, crashed, timeout, interrupted, stalled), live
    jobs included; 2 on bad options or when a path cannot be scanned (each such path gets an error
    line on stderr; the other paths are still scanned and printed).
    """
    from fp4lab.lab.records.logscan import HEALTHY_VERDICTS, LogFormat, ScanThresholds
    from fp4lab.lab.records.logscan import scan as scan_log

    try:
        thresholds = ScanThresholds().with_overrides(threshold or [])
        if regex is not None:
            LogFormat.from_regex(regex)
    except ValueError as exc:
        fail(f"scan: {str(exc).splitlines()[0]}")
    known = _catalog_runs(catalog)
    if not logs:
        logs = [Path(run_dir) for run_dir in known.run_dirs()]
        if not logs:
            fail(f"scan: nothing to scan: give run folders or logs (e.g. fp4lab scan runs/quickstart/*), or run a sweep "
                 f"first ({'no runs in' if catalog.exists() else 'no catalog at'} {str(catalog)!r})")
    results, unreadable = [], 0
    for path in logs:
        target = known.run_dir_of_log(path) or path
        try:
            results.append((path, target, scan_log(target, thresholds, regex=regex, preset=preset, running=running)))
        except (OSError, ValueError) as exc:
            unreadable += 1
            print(f"fp4lab: error: scan: {str(exc).splitlines()[0]}", file=sys.stderr)
    if as_json:
        print_json([result.to_dict() for _, _, result in results])
    elif results:
        _print_scan_table(results, known, events)
    if unreadable:
        raise typer.Exit(2)
    raise typer.Exit(0 if all(result.status in HEALTHY_VERDICTS for _, _, result in results) else 1)


class _CatalogRuns:
    """The catalog's records by run folder and by log, to name what `fp4lab scan` reads."""

    def __init__(self, catalog, records: list[dict]) -> None:
        self.by_folder, self.by_log = {}, {}
        for record in records:
            paths = record.get("paths") or {}
            for key, index in (("run_dir", self.by_folder), ("log", self.by_log)):
                resolved = catalog.resolve(paths.get(key)) if catalog is not None else None
                if resolved is not None:
                    index.setdefault(Path(resolved).resolve(), record)

    def run_dirs(self) -> list[Path]:
        return [folder for folder in self.by_folder if folder.is_dir()]

    def record_of(self, path: Path) -> dict | None:
        resolved = path.resolve()
        return self.by_folder.get(resolved) or self.by_folder.get(resolved.parent if resolved.name == "metrics.jsonl" else resolved) \
            or self.by_log.get(resolved)

    def run_dir_of_log(self, path: Path) -> Path | None:
        """The run folder of an fp4lab log the catalog knows, where its metrics are (None otherwise)."""
        record = self.by_log.get(path.resolve())
        folder = next((f for f, r in self.by_folder.items() if r is record), None) if record else None
        return folder if folder is not None and (folder / "metrics.jsonl").exists() else None


def _catalog_runs(catalog: Path) -> _CatalogRuns:
    """The catalog's runs, or none where there is no readable catalog (scan works without one)."""
    from fp4lab.lab.records.catalog import Catalog, CatalogError

    if not catalog.exists():
        return _CatalogRuns(None, [])
    try:
        runs_catalog = Catalog(catalog)
        return _CatalogRuns(runs_catalog, runs_catalog.records())
    except CatalogError:
        return _CatalogRuns(None, [])


def _print_scan_table(results: list, known: _CatalogRuns, events: bool) -> None:
    """One row per log scanned (tables.runs_table): the run by name where the catalog knows it, else
    by its folder's recipe or the file's name; then each run's events when asked."""
    from fp4lab.lab.records.logscan import result_fields
    from fp4lab.lab.records.tables import Column, run_names, runs_table

    records = [known.record_of(path) for path, _, _ in results]
    fallback = [(record or {}).get("extra", {}).get("name") or _folder_recipe(target) or path.name
                for record, (path, target, _) in zip(records, results)]  # fmt: skip
    header, names = run_names([(record or {}).get("extra", {}).get("params") for record in records], fallback)
    rows = []
    for name, (path, target, result) in zip(names, results):
        fields = result_fields(result)
        notes = fields["notes"].removeprefix("no events").removeprefix("; ").removeprefix("events: ")
        notes += "" if target == path else f"{'; ' if notes else ''}read from {_shown_path(target)}/metrics.jsonl (the log prints some steps)"
        rows.append([name, fields["verdict"], fields["step"], fields["loss"], fields["val"], notes, _shown_path(path)])
    columns = [Column(header, identifies=True), Column("verdict", identifies=True), Column("step", right=True),
               Column("loss", wraps=True), Column("val", right=True), Column("events", wraps=True), Column("path", wraps=True)]  # fmt: skip
    console = rich_console()
    console.print(runs_table(f"fp4lab scan: {len(results)} log(s)", columns, rows, caption=["steps count from 0"]))
    for name, (_, _, result) in zip(names, results):
        for event in result.events if events else ():
            console.print(f"  {name}: {event.kind}@{event.step}: {event.detail}", markup=False)


def _shown_path(path: Path) -> str:
    """`path` relative to the current folder where it lies under it (a table cell at 80 columns)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _folder_recipe(target: Path) -> str | None:
    """The recipe of an fp4lab run folder (its config.json), for a run the catalog does not name."""
    folder = target.parent if target.name == "metrics.jsonl" else target
    try:
        return json.loads((folder / "config.json").read_text())["config"]["recipe"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def sweep(
    spec: Annotated[Path, typer.Argument(help="A sweep spec, e.g. sweeps/quickstart.toml (docs/SWEEPS.md).")],
    executor: Annotated[SweepExecutor, typer.Option(help="local (this machine), slurm (submitit job arrays) or sbatch (plain sbatch of the written scripts).")] = "local",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Write jobs/<sweep>/ (configs and SBATCH scripts) and print the plan; start nothing, record nothing in the catalog.")] = False,
    workers: Annotated[int, typer.Option(help="Local executor: runs at once; with at least that many GPUs (times ranks per run), each run gets GPUs of its own.")] = 1,
    retry_failed: Annotated[bool, typer.Option("--retry-failed", help="Also rerun failed, cancelled and timed-out runs (they resume from their checkpoints; interrupted and preempted runs resume anyway).")] = False,
    jobs_dir: Annotated[Path, typer.Option(help="Where SBATCH scripts and run configs go.")] = Path("jobs"),
    catalog: Annotated[Path, typer.Option(help="The results catalog.")] = Path("sweep_catalog.json"),
    after: Annotated[Optional[str], typer.Option("--after", metavar="SWEEP", autocompletion=complete_sweep, help="Slurm executors: start these jobs only once every queued or running job of sweep SWEEP (as the catalog knows it) has ended, whatever its outcome (sbatch --dependency=afterany).")] = None,
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
    if after is not None and executor == "local":
        fail("sweep: --after chains Slurm jobs; add --executor slurm or --executor sbatch (on this machine, "
             "run the sweeps one after the other)")
    console = rich_console()
    try:
        runs_catalog = Catalog(catalog)
        runs_catalog.sweeps()  # a corrupt catalog fails here, before anything is written
        dependency = _after_dependency(runs_catalog, after, spec) if after is not None else None
        options = {"workers": workers} if executor == "local" else {"dependency": dependency}
        runner = make_executor(executor, **options)
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
    if after is not None:
        console.print(f"after sweep {after}: " + (f"the jobs wait for its Slurm jobs {dependency.removeprefix('afterany:').replace(':', ', ')} "
                      "to end (--dependency=afterany)" if dependency else "none of its jobs is queued or running; nothing to wait for"),
                      markup=False)
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


def _after_dependency(runs_catalog, name: str, spec: Path) -> str | None:
    """The --dependency that waits for sweep `name`'s jobs (fp4lab.lab.runs.slurm.after_sweep); a
    one-line error when the catalog has no such sweep, or the spec sets a dependency of its own."""
    from fp4lab.lab.runs.slurm import after_sweep
    from fp4lab.lab.specs.sweep_spec import load_spec
    from fp4lab.validation import did_you_mean

    if "dependency" in load_spec(spec).slurm.extra_options():
        fail(f"sweep: --after {name} and [slurm].extra.dependency in {spec} both set the job dependency; keep one")

    records = runs_catalog.records(sweep=name)
    if not records:
        known = runs_catalog.sweeps()
        fail(f"sweep: --after {name}: the catalog {str(runs_catalog.path)!r} has no sweep of that name{did_you_mean(name, known)}"
             f"; {'its sweeps: ' + ', '.join(known) if known else 'submit that sweep first'}")
    return after_sweep(records, name)


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
    from fp4lab.train.run_folder import has_checkpoint

    optuna = plan.spec.method == "optuna"

    def started(run) -> None:
        if not console.is_terminal:  # a terminal has the live view instead
            how = "resuming from its checkpoint" if has_checkpoint(run.config["out_dir"]) else "started"
            console.print(f"  {run.id}  {run.name}: {how}", markup=False)

    def finished(record) -> None:
        if optuna:
            objective = record["extra"].get("objective")
            console.print(f"  trial {record['extra'].get('trial')}  {record['id']}  {record['extra'].get('name')}: {run_outcome(record)}"
                          + ("" if objective is None else f", {plan.spec.optuna.objective} {objective:.4f}"), markup=False)
            return
        console.print(f"  {record['id']}  {record['extra'].get('name')}: {run_outcome(record)}", markup=False)

    runner.on_start, runner.on_finish = started, finished
    try:
        with _sweep_progress(console, runs_catalog, plan, [] if optuna else todo):
            launched = runner.launch(plan, todo, runs_catalog)
    except SweepInterrupted as stopped:
        console.print(f"interrupted: {len(stopped.records)} run(s) stopped; `fp4lab sweep {spec}` resumes them from their last checkpoints")
        raise typer.Exit(130) from None
    if optuna and launched.started == 0:
        console.print("the study already holds every trial; raise [optuna].n_trials to run more", markup=False)


def run_outcome(record: dict) -> str:
    """How a run ended, for a line a person reads: "completed, converged, val 4.2310, resumed from step
    18", "interrupted at step 18 (resumes from its checkpoint)", "pruned after 10 steps (...)", "failed,
    crashed: <error>"."""
    summary = record.get("summary") or {}
    state, verdict = record["state"], record.get("verdict")
    parts = [state]
    if state in ("interrupted", "preempted", "timeout") and summary.get("steps_completed") is not None:
        parts = [f"{state} at step {summary['steps_completed']} (resumes from its checkpoint)"]
    if state == "pruned" and summary.get("steps_completed") is not None:
        parts = [f"pruned after {summary['steps_completed']} steps (its Optuna pruner stopped it)"]
    if verdict and verdict != state and not (state == "pruned" and verdict == "converged"):
        parts.append(verdict)
    if summary.get("final_val_loss") is not None:
        parts.append(f"val {summary['final_val_loss']:.4f}")
    if summary.get("resumed_from_step"):
        parts.append(f"resumed from step {summary['resumed_from_step']}")
    return ", ".join(parts) + (f": {record['error']}" if record.get("error") else "")


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
    run's step, loss and time left. Elsewhere (a pipe, a log file) a line per running run every
    PIPED_PROGRESS_S seconds, besides the lines printed as runs start and end."""
    import time

    if not todo:
        return contextlib.nullcontext()
    if not console.is_terminal:
        return _progress_lines(console, runs_catalog, plan, {run.id for run in todo})
    from datetime import UTC, datetime

    from rich.live import Live

    from fp4lab.lab.runs.sweep import progress_of

    ids = {run.id for run in todo}
    began = time.monotonic()

    def view():
        from fp4lab.lab.records.tables import Column, run_names, runs_table, short_ids

        records = [r for r in runs_catalog.records(sweep=plan.spec.name) if r["id"] in ids]
        counts = {k: sum(r["state"] == k for r in records) for k in ("completed", "running", "submitted")}
        done = len(records) - counts["running"] - counts["submitted"] - sum(r["state"] == "pending" for r in records)
        title = (f"sweep {plan.spec.name}: {done} done, {counts['running']} running, {len(ids) - done - counts['running']} pending "
                 f"({time.monotonic() - began:.0f} s)")
        running = [r for r in records if r["state"] == "running"]
        header, names = run_names([r["extra"].get("params") for r in records], [r["extra"].get("name") or r["id"] for r in records])
        name_of = dict(zip((r["id"] for r in records), names))
        short = short_ids([r["id"] for r in records])
        rows = []
        for record in running:
            step, loss = progress_of(record, runs_catalog)
            steps = record["config"].get("steps")
            left = ""
            if step is not None and steps and record.get("started_at"):
                started = datetime.fromisoformat(record["started_at"].replace("Z", "+00:00"))
                elapsed = (datetime.now(UTC) - started).total_seconds()
                left = f"{elapsed / (step + 1) * (steps - step - 1):.0f} s"
            rows.append([short[record["id"]], name_of[record["id"]], "" if step is None else f"{step}/{steps - 1}",
                         "" if loss is None else f"{loss:.4f}", left])  # fmt: skip
        columns = [Column("id"), Column(header, identifies=True), Column("step", right=True), Column("loss", right=True), Column("time left", right=True)]
        return runs_table(title, columns, rows, fold_constant=False)

    return Live(get_renderable=view, console=console, refresh_per_second=1, transient=True)


PIPED_PROGRESS_S = 30.0


@contextlib.contextmanager
def _progress_lines(console, runs_catalog, plan, ids: set[str], every: float | None = None):
    """While the block runs, every `every` seconds (PIPED_PROGRESS_S) one line per running run of `ids`:
    "  <id>  <name>: step 30/59, loss 4.1234"."""
    import threading

    from fp4lab.lab.runs.sweep import progress_of

    stop = threading.Event()

    def report() -> None:
        while not stop.wait(PIPED_PROGRESS_S if every is None else every):
            for record in runs_catalog.records(sweep=plan.spec.name):
                if record["id"] not in ids or record["state"] != "running":
                    continue
                step, loss = progress_of(record, runs_catalog)
                if step is not None:
                    steps = record["config"].get("steps")
                    console.print(f"  {record['id']}  {record['extra'].get('name')}: step {step}/{steps - 1}"
                                  + ("" if loss is None else f", loss {loss:.4f}"), markup=False)

    thread = threading.Thread(target=report, name="fp4lab-sweep-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


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
    sweep_name: Annotated[Optional[str], typer.Argument(metavar="SWEEP", help="Only this sweep (default: all).", autocompletion=complete_sweep)] = None,
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
    """The runs of `sweep_name` (all when None: sweeps, trials and ratchet iterations), refreshed from
    their run folders and the scheduler: one dict per run, what `fp4lab status` shows."""
    from fp4lab.lab.records.catalog import TERMINAL_STATES
    from fp4lab.lab.records.logscan import ScanThresholds
    from fp4lab.lab.runs.sweep import progress_of, refresh

    if sweep_name is not None and not runs_catalog.records(sweep=sweep_name):
        known = runs_catalog.sweeps()
        fail(f"status: no sweep {sweep_name!r} in {runs_catalog.path} (sweeps: {', '.join(known) or 'none'})")
    refresh(runs_catalog, ScanThresholds(), sweep_name)
    rows = []
    for record in runs_catalog.records(sweep=sweep_name, per_sweep=True):
        step, loss = progress_of(record, runs_catalog)
        if record["state"] in TERMINAL_STATES and record["summary"]:  # as the report shows it: the last finite loss
            loss = record["summary"].get("final_train_loss")
        rows.append({
            "sweep": record["sweep"], "id": record["id"], "name": record["extra"].get("name"), "params": record["extra"].get("params"),
            "state": record["state"], "step": step, "steps": (record.get("config") or {}).get("steps"), "loss": loss, "val_loss": record["summary"].get("final_val_loss"),
            "tokens_per_s": record["summary"].get("tokens_per_s"),
            "resumed_from_step": record["summary"].get("resumed_from_step"), "verdict": record["verdict"],
            "error": record.get("error"), "slurm_job_id": record["slurm_job_id"], "slurm_array_index": record["slurm_array_index"],
            "run_dir": (record.get("paths") or {}).get("run_dir"),
        })  # fmt: skip
    return rows


def status_table(rows: list[dict], title: str):
    """`fp4lab status` (and the end of `fp4lab sweep`): one line per run, at 80 columns too (tables.runs_table)."""
    from fp4lab.lab.records.tables import Column, run_names, runs_table, short_ids
    from fp4lab.lab.records.values import format_cell

    header, names = run_names([r["params"] for r in rows], [r["name"] or r["id"] for r in rows])
    ids = short_ids([r["id"] for r in rows])
    columns = [Column("sweep", wraps=True), Column("id"), Column(header, identifies=True), Column("state", wraps=True, identifies=True),
               Column("step", right=True), Column("loss", right=True), Column("val loss", right=True), Column("tok/s", right=True),
               Column("verdict", wraps=True, identifies=True), Column("Slurm job")]  # fmt: skip
    cells = []
    for row in rows:
        verdict = row["verdict"] or ""
        if row["error"]:
            verdict = f"{verdict + ': ' if verdict else ''}{row['error']}"
        state = row["state"] + (f" (resumed from step {row['resumed_from_step']})" if row.get("resumed_from_step") else "")
        job = "" if row["slurm_job_id"] is None else str(row["slurm_job_id"]) + ("" if row["slurm_array_index"] is None else f"_{row['slurm_array_index']}")
        cells.append([row["sweep"] or "", ids[row["id"]], names.pop(0), state, format_cell(row["step"]),
                      format_cell(row["loss"]), format_cell(row["val_loss"]),
                      "" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:,.0f}", verdict, job])  # fmt: skip
    return runs_table(title, columns, cells, caption=[_step_numbering({row.get("steps") for row in rows})] if rows else ())


def _step_numbering(steps: set) -> str:
    """How steps are counted, in the words of the runs shown: "steps count from 0: a 40-step run ends at step 39"."""
    n = steps.pop() if len(steps) == 1 and isinstance(next(iter(steps)), int) else 60
    return f"steps count from 0: a {n}-step run ends at step {n - 1}"


def _print_status(runs_catalog, sweep_name: str | None, watch: float = 0.0) -> None:
    import time

    from rich.live import Live

    def table():
        rows = _status_rows(runs_catalog, sweep_name)
        view = status_table(rows, f"runs{' of ' + sweep_name if sweep_name else ''} ({runs_catalog.path})")
        return view, any(r["state"] in ("pending", "submitted", "running") for r in rows)

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
    sweep_name: Annotated[str, typer.Argument(metavar="SWEEP", help="The sweep whose rows leave the catalog.", autocompletion=complete_sweep)],
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
