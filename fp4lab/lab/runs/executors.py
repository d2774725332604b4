"""Executors: how a sweep's runs get run. One interface, three ways (in the manner of submitit's own
executors); everything Slurm-specific they need is in `slurm.py`.

    executor = make_executor("local", workers=2, on_start=..., on_finish=...)
    launched = executor.launch(plan, runs, catalog)

- `LocalExecutor` (`local`): on this machine, `workers` at a time, each run its own
  `fp4lab train --config jobs/<sweep>/<id>.toml --catalog ...` process (optuna sweeps: `fp4lab trial`
  processes), and a run of several ranks ([slurm], SlurmSpec.ranks) its own torchrun --standalone of
  that many processes; returns when every run has ended, with their records. Ctrl-C raises SweepInterrupted.
- `SubmititExecutor` (`slurm`): job arrays of `job.SweepTask` / `trials.TrialTask` through submitit,
  with signal-before-timeout and requeue; returns the Slurm job ids. One process per run: a spec of
  several ranks per run is refused (`check`) before anything is written; `sbatch` runs those.
- `SbatchExecutor` (`sbatch`): plain `sbatch` of the scripts written into jobs/<sweep>/; returns the
  job ids.

Each job records its own start and end in the catalog (job.py), so a sweep that is killed loses
nothing and `fp4lab status` sees finished runs at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from fp4lab.lab.choices import SWEEP_EXECUTORS as EXECUTORS
from fp4lab.lab.records.catalog import IN_FLIGHT_STATES, Catalog, this_owner, utc_now
from fp4lab.lab.runs import slurm
from fp4lab.lab.runs import sweep as sweep_plans
from fp4lab.lab.runs.job import SweepTask, finish_run, last_error_line, train_command
from fp4lab.lab.runs.sweep import SweepPlan, scan_thresholds
from fp4lab.lab.runs.trials import TrialTask, orphaned_trials, trial_counts
from fp4lab.lab.specs.sweep_spec import RunSpec, SpecError, SweepSpec
from fp4lab.train import run_folder


@dataclass
class Launched:
    """What a launch did: how many runs (or trials) it started, the records of those that ended here
    (local), or the Slurm job ids it submitted."""

    started: int
    records: list[dict[str, Any]]
    job_ids: list[str]


class Executor(Protocol):
    name: ClassVar[str]  # the --executor value
    records_as: ClassVar[str]  # the `executor` field of the runs' catalog records: local | slurm
    waits: ClassVar[bool]  # whether launch returns only when the runs have ended

    def launch(self, plan: SweepPlan, runs: list[RunSpec], catalog: Catalog) -> Launched: ...

    def check(self, spec: SweepSpec) -> None:
        """Raise SpecError (one line) if this executor cannot run the spec's runs; called before
        anything is written."""


def make_executor(name: str, **options: Any) -> Executor:
    """The executor called `name` (EXECUTORS); options go to LocalExecutor (workers, on_start, on_finish)
    or to the Slurm executors (dependency: a --dependency for every job they submit)."""
    if name == "local":
        return LocalExecutor(**options)
    if name == "slurm":
        return SubmititExecutor(**options)
    if name == "sbatch":
        return SbatchExecutor(**options)
    raise ValueError(f"executor {name!r} is not supported; allowed: {', '.join(EXECUTORS)}")


class SweepInterrupted(Exception):
    """Ctrl-C stopped a local sweep: the runs in progress stopped (with a checkpoint once past start-up) and were recorded "interrupted"."""

    def __init__(self, records: list[dict[str, Any]]):
        super().__init__(f"{len(records)} run(s) interrupted")
        self.records = records


class LocalExecutor:
    """Runs on this machine, `workers` at a time. on_start(run) and on_finish(record) are called as each
    run starts and ends (optuna sweeps: on_finish(record) per trial)."""

    name = "local"
    records_as = "local"
    waits = True

    def __init__(self, workers: int = 1, on_start: Callable[[RunSpec], None] | None = None,
                 on_finish: Callable[[dict[str, Any]], None] | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.workers, self.on_start, self.on_finish = workers, on_start, on_finish

    def launch(self, plan: SweepPlan, runs: list[RunSpec], catalog: Catalog) -> Launched:
        if plan.spec.method == "optuna":
            return _run_trials_local(plan, catalog, workers=self.workers, on_finish=self.on_finish)
        records = _run_local(plan, runs, catalog, workers=self.workers, on_start=self.on_start, on_finish=self.on_finish)
        return Launched(len(runs), records, [])

    def check(self, spec: SweepSpec) -> None:
        pass


class SubmititExecutor:
    """Slurm through submitit: job arrays, signal before the time limit, requeue on preemption and timeout."""

    name = "slurm"
    records_as = "slurm"
    waits = False

    def __init__(self, dependency: str | None = None) -> None:
        self.dependency = dependency

    def check(self, spec: SweepSpec) -> None:
        # A submitit job runs the task in one process per node (tasks_per_node = 1): no torchrun.
        if spec.slurm.ranks > 1:
            raise SpecError(f"{spec.path}: {spec.slurm.ranks_text()} gives each run {spec.slurm.ranks} ranks; "
                            "--executor slurm runs one process per run: use --executor sbatch (srun + torchrun)")

    def launch(self, plan: SweepPlan, runs: list[RunSpec], catalog: Catalog) -> Launched:
        try:
            job_ids = _submit_submitit(plan, runs, catalog, self.dependency)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:  # how submitit reports a missing or refusing Slurm
            text = str(exc).strip()
            raise slurm.SubmissionError(f"submitit: {text.splitlines()[-1] if text else type(exc).__name__}") from exc
        return Launched(len(runs), [], job_ids)


class SbatchExecutor:
    """Slurm with plain `sbatch` of the scripts written into jobs/<sweep>/ (the ones a user can resubmit by hand)."""

    name = "sbatch"
    records_as = "slurm"
    waits = False

    def __init__(self, dependency: str | None = None) -> None:
        self.dependency = dependency

    def check(self, spec: SweepSpec) -> None:
        pass

    def launch(self, plan: SweepPlan, runs: list[RunSpec], catalog: Catalog) -> Launched:
        return Launched(len(runs), [], _submit_sbatch(plan, runs, catalog, self.dependency))


def _run_local(
    plan: SweepPlan,
    runs: list[RunSpec],
    catalog: Catalog,
    *,
    workers: int = 1,
    on_start: Callable[[RunSpec], None] | None = None,
    on_finish: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run `runs` as separate training processes, at most `workers` at once; return their records.

    This process owns each run while it trains (`Catalog.claim`): a run another live process owns is
    left to it (recorded by that process, returned here as is). Each training process records its own
    start and end (`train --catalog`); one that dies without doing so (killed, out of memory) is
    recorded here as failed, with the last line of its log as the error, unless this sweep was stopping
    (Ctrl-C reached it in start-up): then interrupted. A run of several ranks is
    one torchrun --standalone (its agent passes signals on to the ranks; rank 0 records the run).
    Ctrl-C (KeyboardInterrupt), SIGTERM or SIGHUP
    starts nothing more, passes one SIGINT to each training process (they run in their own session,
    so a terminal's Ctrl-C reaches them only this way, once), waits while they checkpoint, and raises
    SweepInterrupted. Further stops while it waits never end the wait (`_stop_signals`).

    On a machine with at least `workers` x ranks GPUs, each run at a time gets GPUs of its own
    (`gpu_slots`), so concurrent runs neither share a GPU nor slow each other's tokens/s; more
    single-GPU runs than GPUs share them evenly."""
    local = _LocalRuns(plan, catalog, workers, on_start, on_finish, _gpu_queue(workers, plan.spec.slurm.ranks, runs))
    pool = ThreadPoolExecutor(max_workers=max(1, workers))
    futures = [pool.submit(local.run, run) for run in runs]
    try:
        with _stop_signals(local):
            try:
                return [record for record in (future.result() for future in futures) if record is not None]
            except KeyboardInterrupt:
                local.stop()
                pool.shutdown(wait=True, cancel_futures=True)
        done = [f.result() for f in futures if f.done() and not f.cancelled() and f.exception() is None]
        raise SweepInterrupted([r for r in done if r is not None and r["state"] == "interrupted"])
    finally:
        pool.shutdown(wait=True)


# Signals that end a sweep as Ctrl-C does: `kill`, `timeout`, a scheduler's stop (SIGTERM) and a
# dropped ssh session or closed terminal (SIGHUP). The trainers run in their own sessions, so only
# the sweep can pass the stop on; left alone they would outlive it.
TERMINATIONS = (signal.SIGTERM, signal.SIGHUP)


# A second stop this soon after the first is the same stop delivered twice: a terminal's Ctrl-C reaches
# the sweep, and a wrapper in its process group (`timeout --foreground`, a job script) passes it on again.
STOP_ECHO_S = 1.0


@contextlib.contextmanager
def _stop_signals(local: _LocalRuns) -> Iterator[None]:
    """While the block runs, in the main thread (elsewhere handlers cannot be installed, and a caller's
    thread keeps its own): the first Ctrl-C, SIGTERM or SIGHUP raises KeyboardInterrupt. A later one,
    while the caller waits for the stopped trainers, never ends that wait (left alone, a trainer would
    outlive the sweep with its record "running"): within STOP_ECHO_S of the first it is dropped, after
    it each trainer gets one more SIGINT (its second Ctrl-C: it stops now, resuming later from its last
    checkpoint). A SIGINT its parent set to be ignored (a background job) stays ignored."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    first_stop: list[float] = []

    def on_stop(signum, _frame) -> None:
        if not first_stop:
            first_stop.append(time.monotonic())
            raise KeyboardInterrupt(signal.Signals(signum).name)
        if time.monotonic() - first_stop[0] > STOP_ECHO_S:
            local.stop()

    stops = [sig for sig in (signal.SIGINT, *TERMINATIONS) if sig != signal.SIGINT or signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, on_stop) for sig in stops}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _gpu_queue(workers: int, ranks: int, runs: list[RunSpec]) -> queue.SimpleQueue | None:
    """The GPU slots (`gpu_slots`) that concurrent runs take and give back, or None when runs do not
    split the GPUs: one worker, CPU runs only, or nothing to split."""
    if workers < 2 or all(str(run.config.get("device", "auto")) == "cpu" for run in runs):
        return None
    assignment = gpu_slots(workers, ranks, sweep_plans.cuda_devices(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if assignment is None:
        return None
    slots = queue.SimpleQueue()
    for gpus in assignment:
        slots.put(gpus)
    return slots


class _LocalRuns:
    """One local launch's runs, each its own training process, and what they share: the GPU slots, the
    live processes a Ctrl-C must reach, and whether the sweep is stopping. `run` is called from the
    pool's threads; `stop` from the launching thread."""

    def __init__(self, plan: SweepPlan, catalog: Catalog, workers: int,
                 on_start: Callable[[RunSpec], None] | None, on_finish: Callable[[dict[str, Any]], None] | None,
                 slots: queue.SimpleQueue | None) -> None:
        self.plan, self.catalog, self.workers, self.slots = plan, catalog, workers, slots
        self.on_start, self.on_finish = on_start, on_finish
        self.thresholds = scan_thresholds(plan.spec)
        self.ranks = plan.spec.slurm.ranks  # all on this machine
        self.owner = this_owner()
        self.lock = threading.RLock()  # `stop` also runs in a signal handler, which may interrupt `stop`
        self.stopping = threading.Event()
        self.children: dict[str, subprocess.Popen] = {}

    def run(self, run: RunSpec) -> dict[str, Any] | None:
        """Claim, train and record one run; None when the sweep stopped before it began."""
        if self.stopping.is_set():
            return None
        if run_folder.holder(run.config["out_dir"]) is not None:
            return self.catalog.get(run.id)  # its trainer outlived the sweep that started it: still running
        log = self.plan.log_path(run)
        log.parent.mkdir(parents=True, exist_ok=True)
        other = self.catalog.claim(run.id, self.owner, state="submitted", submitted_at=utc_now(), executor="local",
                                   error=None, paths={"log": self.catalog.relative(log)})
        if other is not None:
            return self.catalog.get(run.id)
        if self.on_start is not None:
            with self.lock:
                self.on_start(run)
        finished = self._record_end(run, self._train(run, log), log)
        if self.on_finish is not None:
            with self.lock:
                self.on_finish(finished)
        return finished

    def _train(self, run: RunSpec, log: Path) -> int:
        """The run's training process (torchrun for several ranks or a parallel mode), on its GPU slot
        if there are slots, its output appended to `log`; its exit status."""
        distributed = self.ranks > 1 or run.config.get("parallel", "none") != "none"
        command = train_command(self.plan.sweep_dir / f"{run.id}.toml", self.catalog.path,
                                nproc=self.ranks if distributed else None)
        gpus = self.slots.get() if self.slots is not None else None  # never waits: one slot per pool thread
        try:
            with open(log, "ab") as out:
                child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                         env=worker_env(self.workers, self.ranks, gpus), start_new_session=True)
                with self.lock:
                    self.children[run.id] = child
                returncode = child.wait()
                with self.lock:
                    self.children.pop(run.id, None)
        finally:
            if gpus is not None:
                self.slots.put(gpus)
        return returncode

    def _record_end(self, run: RunSpec, returncode: int, log: Path) -> dict[str, Any]:
        """The run's record once its process ended: as the process wrote it, or, if it died before
        recording its end, interrupted (the sweep was stopping) or failed with its log's last error."""
        finished = self.catalog.get(run.id)
        if finished["state"] not in IN_FLIGHT_STATES or run_folder.holder(run.config["out_dir"]) is not None:
            return finished  # recorded by its process, or ours was refused: another trainer holds the folder
        if self.stopping.is_set():
            # Our SIGINT reached it before it could record anything (interpreter start-up, imports):
            # nothing broke, so the next sweep runs it again instead of skipping it as failed.
            return finish_run(run, self.catalog, self.thresholds, returncode=130, state="interrupted")
        finished = finish_run(run, self.catalog, self.thresholds, returncode=returncode or 1)
        if finished["state"] == "failed" and not finished.get("error"):
            finished = self.catalog.update(run.id, error=last_error_line(log) or f"the training process exited with {_exit_text(returncode)}")
        return finished

    def stop(self) -> None:
        """Start nothing more, and pass one SIGINT to each training process."""
        self.stopping.set()
        with self.lock:
            for child in self.children.values():
                child.send_signal(signal.SIGINT)


def _exit_text(returncode: int) -> str:
    if returncode < 0:
        return f"signal {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def worker_env(workers: int, ranks: int = 1, gpus: str | None = None) -> dict[str, str]:
    """The environment of a local training process: with several processes at once (`workers` runs of
    `ranks` processes each), each gets its share of the cores (unless OMP_NUM_THREADS is set), since
    oversubscribed OpenMP threads slow every run down several times over (torchrun would give each
    rank one thread); with `gpus` (a `gpu_slots` entry), CUDA_VISIBLE_DEVICES = gpus."""
    env = dict(os.environ)
    if workers * ranks > 1 and "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (workers * ranks)))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


def gpu_slots(workers: int, ranks: int, devices: int, visible: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES of each of `workers` concurrent local runs of `ranks` processes: slot k
    gets the visible GPUs k * ranks .. (k + 1) * ranks - 1 (`visible`, CUDA_VISIBLE_DEVICES as set, maps
    them to the machine's ids). With more single-process runs than GPUs, slot k gets GPU k mod the
    count, so the runs share the GPUs evenly instead of all landing on the first. None when there is
    nothing to split: one worker, no GPU, or multi-process runs that do not each fit (they then share
    what they see)."""
    if workers < 2 or devices < 1:
        return None
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(devices)]
    ids = ids[:devices]
    if devices >= workers * ranks:
        return [",".join(ids[k * ranks:(k + 1) * ranks]) for k in range(workers)]
    if ranks == 1 and len(ids) > 1:
        return [ids[k % len(ids)] for k in range(workers)]
    return None


def _run_trials_local(
    plan: SweepPlan,
    catalog: Catalog,
    *,
    workers: int = 1,
    on_finish: Callable[[dict[str, Any]], None] | None = None,
) -> Launched:
    """Optuna sweep on this machine: first resume the trials a killed sweep left RUNNING, then run new
    trials until the study holds [optuna].n_trials finished ones; each trial is its own `fp4lab trial`
    process (ask, train, tell), `workers` at once."""
    counts = trial_counts(plan.spec, plan.jobs_dir)
    done = sum(counts.get(state, 0) for state in ("COMPLETE", "FAIL", "PRUNED"))
    resumes = orphaned_trials(plan.spec, plan.jobs_dir)
    fresh = max(0, plan.spec.optuna.n_trials - done - len(resumes) - counts.get("WAITING", 0))
    spec_copy = plan.sweep_dir / "spec.toml"
    base = [sys.executable, "-m", "fp4lab.cli", "trial", str(spec_copy), "--jobs-dir", str(plan.jobs_dir), "--catalog", str(catalog.path)]
    # One log per launch: concurrent trials sharing a file would interleave their lines.
    logs = plan.sweep_dir / "logs"
    launches = [(base + ["--resume", str(n)], logs / f"trial-{n}-resume.local.log") for n in resumes]
    for slot in range(done + len(resumes), done + len(resumes) + fresh):
        launches.append((base + ["--slot", str(slot)], logs / f"trial-slot{slot}.local.log"))
    logs.mkdir(parents=True, exist_ok=True)
    lock = threading.Lock()

    def one(launch: tuple[list[str], Path]) -> dict[str, Any] | None:
        command, log = launch
        with open(log, "ab") as out:
            trial = subprocess.run(command + ["--json"], stdout=subprocess.PIPE, stderr=out, text=True, env=worker_env(workers))
        if trial.returncode != 0:
            return None
        record = json.loads(trial.stdout)
        if on_finish is not None:
            with lock:
                on_finish(record)
        return record

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        records = [record for record in pool.map(one, launches) if record is not None]
    return Launched(len(launches), records, [])


def _submit_sbatch(plan: SweepPlan, runs: list[RunSpec], catalog: Catalog, dependency: str | None = None) -> list[str]:
    """Submit with plain `sbatch` the scripts written into jobs/<sweep>/ (the same ones a user can
    resubmit by hand): the job arrays when every run is needed, else one script per run. Records
    each run's job id and state "submitted"; returns the job ids."""
    manifest = json.loads((plan.sweep_dir / "manifest.json").read_text())
    if plan.spec.method == "optuna":
        return [slurm.submit_script(plan.sweep_dir / a["script"], dependency) for a in manifest["arrays"]]
    ids = {run.id for run in runs}
    submissions: list[tuple[Path, list[str]]]
    if manifest["arrays"] and ids == {run.id for run in plan.runs}:
        submissions = [(plan.sweep_dir / a["script"], a["run_ids"]) for a in manifest["arrays"]]
    else:
        submissions = [(plan.sweep_dir / f"{run.id}.sbatch", [run.id]) for run in runs]
    job_ids = []
    for script, run_ids in submissions:
        job_id = slurm.submit_script(script, dependency)
        job_ids.append(job_id)
        with catalog.transaction() as tx:
            for index, run_id in enumerate(run_ids):
                array_index = index if len(run_ids) > 1 or script.name.startswith("array_") else None
                tx.update(run_id, state="submitted", submitted_at=utc_now(), slurm_job_id=job_id,
                          slurm_array_index=array_index, executor="slurm")
    return job_ids


def _submit_submitit(plan: SweepPlan, runs: list[RunSpec], catalog: Catalog, dependency: str | None = None) -> list[str]:
    """Submit through submitit: job arrays (split at MaxArraySize) of `job.SweepTask` (grid/random) or
    `trials.TrialTask` (optuna) with --signal before the time limit and requeue on preemption and
    timeout. Records each run's job id; returns the array job ids."""
    manifest = json.loads((plan.sweep_dir / "manifest.json").read_text())
    size = int(manifest["max_array_size"])
    executor = slurm.submitit_executor(plan.spec.slurm, f"fp4lab-{plan.spec.name}", plan.sweep_dir.absolute() / "submitit",
                                       dependency)
    catalog_path = Path(catalog.path).absolute()
    if plan.spec.method == "optuna":
        counts = trial_counts(plan.spec, plan.jobs_dir)
        first = sum(counts.values())
        slots = list(range(first, first + max(0, plan.spec.optuna.n_trials - first)))
        task = TrialTask((plan.sweep_dir / "spec.toml").absolute(), plan.jobs_dir.absolute(), catalog_path)
        jobs = [job for start in range(0, len(slots), size) for job in executor.map_array(task, slots[start:start + size])]
        return sorted({job.job_id.split("_")[0] for job in jobs})
    task = SweepTask(plan.sweep_dir.absolute(), catalog_path)
    array_ids = []
    for start in range(0, len(runs), size):
        chunk = runs[start:start + size]
        jobs = executor.map_array(task, [run.id for run in chunk])
        with catalog.transaction() as tx:
            for run, job in zip(chunk, jobs):
                job_id, _, index = job.job_id.partition("_")
                tx.update(run.id, state="submitted", submitted_at=utc_now(), slurm_job_id=job_id, executor="slurm",
                          slurm_array_index=int(index) if index else None, paths={"log": str(job.paths.stdout)})
                array_ids.append(job_id)
    return sorted(set(array_ids))


