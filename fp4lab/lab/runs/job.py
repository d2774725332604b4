"""What runs inside one sweep job, wherever it runs: record the start, train, scan, record the end.

    fp4lab train --config jobs/<sweep>/<id>.toml --catalog sweep_catalog.json

is the command every SBATCH script and every local worker runs. With `--catalog`, the job itself keeps
its catalog record current, so `fp4lab status` and `fp4lab report` see a finished run the moment it
ends, on Slurm as on this machine:

- start: state "running", `started_at`, `attempts` + 1, `requeues` = SLURM_RESTART_COUNT, the Slurm job
  id and array index from the environment;
- end: `finish_run` scans the run folder (thresholds from the sweep's manifest.json) and writes state,
  verdict, events and summary metrics. A crash inside training records state "failed" before the
  exception propagates; a job killed outright (SIGKILL, out of memory) leaves "running", which
  `fp4lab status` corrects from Slurm's view of the job (or the local executor from the exit code).

Under torchrun (a run of several ranks) every rank runs that command; rank 0 alone records the start
and the end, the other ranks train silently (the loop has rank 0 alone write the run's files).

`python -m fp4lab.lab.runs.job checkpointed CONFIG SINCE` exits 0 when the run's summary.json, written
at or after SINCE (Unix seconds), says "preempted": how an SBATCH script of several ranks knows the run
checkpointed (torchrun's agent exits 1 after passing a signal on, however cleanly the ranks stopped).

`SweepTask` is the same thing as a submitit callable (`fp4lab sweep --executor slurm`); it also
hands a preemption or time-limit signal back to submitit so the job is requeued and resumes from its
checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path
from typing import Any

from fp4lab.lab.records.catalog import Catalog, live_owner, this_owner, utc_now
from fp4lab.lab.records.logscan import ScanThresholds, scan
from fp4lab.lab.runs import slurm
from fp4lab.lab.specs.sweep_spec import RunSpec
from fp4lab.train import run_folder
from fp4lab.train.config import TrainConfig, summary_value
from fp4lab.train.jsonl import read_metrics_file

# Summary status of a finished training process -> catalog state.
STATE_OF_STATUS = {
    "completed": "completed",
    "diverged": "completed",  # the run ended as designed; the verdict says it diverged
    "pruned": "pruned",  # its Optuna trial's pruner stopped it: ended as designed, never retried
    "time_limit": "timeout",
    "preempted": "preempted",
    "stopped": "preempted",
    "interrupted": "interrupted",
}
# Spec [scan] keys -> log scanner thresholds.
def thresholds_from_table(table: dict[str, Any], where: str) -> ScanThresholds:
    """Log scanner thresholds from a spec's [scan] table (documented in docs/SWEEPS.md)."""
    try:
        return ScanThresholds().with_overrides(table)
    except ValueError as exc:
        raise ValueError(f"{where}: [scan]: {exc}") from None


class RunInFlight(ValueError):
    """Another live process is training this run."""


def pending_record(run: RunSpec, sweep: str, catalog: Catalog, executor: str, log: Path,
                   git: tuple[str | None, bool | None]) -> dict[str, Any]:
    """The catalog record of a run no process has started yet (`git`: the commit and whether the tree is dirty)."""
    return {
        "id": run.id, "sweep": sweep, "sweeps": [sweep], "config": run.config, "recipe": run.config["recipe"],
        "git_commit": git[0], "git_dirty": git[1], "executor": executor,
        "paths": {"run_dir": catalog.relative(run.config["out_dir"]), "log": catalog.relative(log)},
        "extra": {"name": run.name, "params": run.params},
    }  # fmt: skip


def record_start(catalog: Catalog, run_id: str, config_path: Path | None = None) -> dict[str, Any]:
    """Mark the run running with this trainer as its owner (it holds the run folder: run_folder.hold), so
    a run outlives the sweep that launched it; refuse, before anything is written, a run another live
    process is training (the launching sweep excepted: its claim hands the run over to us). A run the
    catalog lacks is recorded first when `config_path`'s manifest lists it and names this catalog (the
    scripts of `fp4lab sweep --dry-run`, submitted by hand)."""
    with catalog.transaction() as tx:
        record = tx.get(run_id) or _listed_run(catalog, run_id, config_path)
        if record is None:
            raise ValueError(f"{catalog.path}: no run {run_id}; a catalog records the runs of sweeps "
                             f"(jobs/<sweep>/<id>.toml): run the sweep, or train without a catalog")
        if tx.get(run_id) is None:
            record = tx.upsert(record)
        launcher = this_owner().rpartition(":")[0] + f":{_launcher_pid()}"
        if live_owner(record, this_owner(), launcher) is not None:
            raise RunInFlight(f"run {run_id} is being trained by process {record['owner']} (state {record['state']}); "
                              "wait for it (fp4lab status) or stop that process first")
        fields = {"state": "running", "started_at": utc_now(), "finished_at": None, "attempts": record["attempts"] + 1,
                  "error": None, "owner": this_owner()}
        return tx.update(run_id, **fields, **slurm.identity())


def _listed_run(catalog: Catalog, run_id: str, config_path: Path | None) -> dict[str, Any] | None:
    """The pending record of a run its sweep's manifest lists, when that manifest names this catalog."""
    from fp4lab.lab.repo import git_state

    manifest_path = config_path.parent / "manifest.json" if config_path is not None else None
    try:
        manifest = json.loads(manifest_path.read_text()) if manifest_path is not None else {}
    except (OSError, json.JSONDecodeError):
        return None
    listed = next((r for r in manifest.get("runs", []) if r.get("id") == run_id), None)
    named = manifest.get("catalog")
    if listed is None or not named or os.path.realpath(named) != os.path.realpath(catalog.path):
        return None
    config = TrainConfig.from_toml(config_path).to_dict()
    run = RunSpec(run_id, listed.get("name", run_id), config, listed.get("params", {}))
    log = config_path.parent / "logs" / f"{run_id}.local.log"
    return pending_record(run, manifest["sweep"], catalog, "sbatch" if slurm.identity() else "local", log, git_state())


def train_command(config_path: str | Path, catalog: str | Path | None = None, *, nproc: int | None = None) -> list[str]:
    """The argv that trains a config on this machine: `fp4lab train --config C [--catalog K]`, and with
    `nproc` the same on nproc local ranks through torchrun (--standalone: a rendezvous on a free port);
    nproc=1 is still torchrun: a parallel='ddp'|'fsdp'|'hsdp' run needs its environment even alone."""
    train = ["-m", "fp4lab.cli", "train", "--config", str(config_path), *(["--catalog", str(catalog)] if catalog else [])]
    if nproc is None:
        return [sys.executable, *train]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *train]


def _launcher_pid() -> int:
    """The process that started this training process: the parent, or under torchrun the agent's
    parent (a local sweep, `fp4lab train --nproc-per-node`, or the job's srun step)."""
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return parent
    try:
        stat = Path(f"/proc/{parent}/stat").read_text()
    except OSError:
        return parent
    return int(stat.rpartition(")")[2].split()[1])  # after "pid (comm)": state, ppid


def train_recorded(config_path: Path, catalog: Catalog, *, progress: bool | None = None) -> dict[str, Any]:
    """Train the run whose config is `config_path` (jobs/<sweep>/<id>.toml), keeping its catalog record
    current (rank 0 alone, under torchrun); return the loop's summary."""
    from fp4lab.train.loop import run

    run_id = config_path.stem
    config = TrainConfig.from_toml(config_path)
    if os.environ.get("RANK", "0") != "0":
        return run(config, progress=progress)
    manifest_path = config_path.parent / "manifest.json"
    table = json.loads(manifest_path.read_text()).get("scan", {}) if manifest_path.exists() else {}
    thresholds = thresholds_from_table(table, str(manifest_path))
    with run_folder.hold(config.out_dir):  # before the record: a refused second trainer writes nothing
        record = record_start(catalog, run_id, config_path)
        spec = RunSpec(run_id, record["extra"].get("name", run_id), config.to_dict())
        try:
            summary = run(config, progress=progress)
        except KeyboardInterrupt:
            # Ctrl-C before the loop's own handler is in place (start-up: data, model, compilation) or a
            # second Ctrl-C: nothing is broken, so the run is interrupted, and the next sweep resumes it
            # from its last checkpoint (or from step 0) instead of skipping it as failed.
            finish_run(spec, catalog, thresholds, returncode=130, state="interrupted")
            raise
        except BaseException as exc:
            finish_run(spec, catalog, thresholds, returncode=1, error=error_line(exc))
            raise
        finish_run(spec, catalog, thresholds, returncode=0)
        return summary


def error_line(exc: BaseException) -> str:
    """One line saying why a run failed: the exception's type and the first line of its message."""
    message = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {message[0]}" if message else type(exc).__name__


def tail_lines(path: Path, size: int = 65536) -> list[str]:
    """The lines of the last `size` bytes of a file (a log or metrics.jsonl), empty if it is missing."""
    if not path.exists():
        return []
    with open(path, "rb") as handle:
        handle.seek(0, 2)
        handle.seek(max(0, handle.tell() - size))
        return handle.read().decode(errors="replace").splitlines()


def last_error_line(log: Path) -> str | None:
    """The last line of a training log that reads like an error (a traceback's last line), if any."""
    lines = [line.strip() for line in tail_lines(log) if line.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head.endswith(("Error", "Exception", "Interrupt")) or line.startswith(("fp4lab", "Killed")):
            return line
    return None


def finish_run(run: RunSpec, catalog: Catalog, thresholds: ScanThresholds, *, returncode: int, error: str | None = None,
               state: str | None = None) -> dict[str, Any]:
    """Scan a finished run's folder and write state, verdict, events, summary metrics, the error of a
    failed run, and let go of the run (no owner). `state` overrides the one read from the run's summary
    (a run stopped before it wrote one)."""
    run_dir = Path(run.config["out_dir"])
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    if state is None:
        state = STATE_OF_STATUS.get(summary["status"], "failed") if summary and returncode == 0 else "failed"
    fields: dict[str, Any] = {"state": state, "finished_at": utc_now(), "owner": None}
    if state == "failed":
        fields["error"] = error
    if (run_dir / "metrics.jsonl").exists():
        result = scan(run_dir, thresholds, running=False)
        fields["verdict"] = result.verdict
        fields["events"] = result.to_dict()["events"]
    else:
        fields["verdict"] = "interrupted" if state in ("interrupted", "preempted") else "crashed"
    if summary:
        fields["summary"] = {
            "final_train_loss": summary_value(summary, "final_train_loss"),
            "best_train_loss": summary_value(summary, "best_train_loss"),
            "final_val_loss": summary.get("final_val_loss"),
            "best_val_loss": summary.get("best_val_loss"),
            "tokens_per_s": summary.get("tokens_per_s"),
            "startup_seconds": summary.get("startup_seconds"),
            "resumed_from_step": summary.get("resumed_from_step"),
            "steps_completed": summary.get("steps_completed"),
            "peak_memory_mb": summary.get("peak_memory_mb"),
            "loss_at_steps": loss_at_steps(run_dir / "metrics.jsonl"),
        }
        fields["paths"] = {"checkpoint": catalog.relative(run_dir / run_folder.CHECKPOINT)}
        if summary.get("environment"):  # what the run ran on: the report tells runs of different ones apart
            fields["extra"] = {"environment": summary["environment"]}
    return catalog.update(run.id, **fields)


def loss_at_steps(metrics: Path, every: int = 10) -> dict[str, float]:
    """Train loss every `every` steps (and the last step), for comparisons at matched steps."""
    losses: dict[str, float] = {}
    if not metrics.exists():
        return losses
    last = None
    for record in read_metrics_file(metrics):
        step, loss = record["step"], record.get("loss")
        if isinstance(loss, float) and math.isfinite(loss):
            last = (step, loss)
            if step % every == 0:
                losses[str(step)] = loss
    if last is not None:
        losses[str(last[0])] = last[1]
    return losses


class SweepTask:
    """A submitit callable: `task(run_id)` trains jobs/<sweep>/<run_id>.toml with its catalog record kept
    current. submitit sends SIGUSR2 before the time limit (and on preemption); the training loop turns
    it into a checkpoint at the end of the current step; this task then raises the signal again so
    submitit's own handler (back in place once the loop has returned) calls `checkpoint`, requeues the
    job and exits. The requeued job starts this task again, and the loop resumes from its checkpoint.
    When submitit refuses (out of timeout requeues: [slurm].max_requeues) the run is recorded as
    "timeout"."""

    def __init__(self, sweep_dir: str | Path, catalog_path: str | Path) -> None:
        self.sweep_dir = Path(sweep_dir)
        self.catalog_path = Path(catalog_path)

    def __call__(self, run_id: str) -> dict[str, Any]:
        catalog = Catalog(self.catalog_path)
        summary = train_recorded(self.sweep_dir / f"{run_id}.toml", catalog, progress=False)
        hand_back_preemption(summary, catalog, run_id)
        return summary

    def checkpoint(self, run_id: str):
        """What submitit resubmits on requeue: this same task (the trainer's checkpoint is on disk)."""
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, run_id)


def hand_back_preemption(summary: dict[str, Any], catalog: Catalog, run_id: str) -> None:
    """Inside a submitit job: if the trainer stopped on submitit's preemption signal, raise that signal
    again so submitit's handler requeues the job (it exits the process); if submitit declines (out of
    timeout requeues), record the run as "timeout" and let its error end the job."""
    preempt = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    preempt = preempt if preempt.startswith("SIG") else f"SIG{preempt}"
    if summary.get("status") != "preempted" or summary.get("stop_signal") != preempt:
        return
    from submitit.core.utils import UncompletedJobError

    try:
        signal.raise_signal(signal.Signals[preempt])
    except UncompletedJobError:
        catalog.update(run_id, state="timeout")
        raise


def checkpointed(config_path: Path, since: float) -> bool:
    """Whether the run of `config_path` stopped on a signal with its checkpoint written (summary.json
    status "preempted", written after the checkpoint) at or after `since` (Unix seconds)."""
    summary = Path(TrainConfig.from_toml(config_path).out_dir) / "summary.json"
    try:
        return summary.stat().st_mtime >= since and json.loads(summary.read_text()).get("status") == "preempted"
    except (OSError, json.JSONDecodeError):
        return False


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "checkpointed":
        sys.exit("usage: python -m fp4lab.lab.runs.job checkpointed CONFIG SINCE")
    sys.exit(0 if checkpointed(Path(sys.argv[2]), float(sys.argv[3])) else 1)
