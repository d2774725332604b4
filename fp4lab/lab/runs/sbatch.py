"""SBATCH scripts for a sweep: one per run, plus job-array scripts that cover all runs.

    paths = write_scripts(spec, expand(spec), "jobs")

writes into jobs/<sweep>/:

- `<id>.toml`: the run's resolved TrainConfig (`fp4lab train --config` reads it);
- `<id>.sbatch`: a script for that one run;
- when there is more than one run, `array_<k>.sbatch` + `array_<k>.runs` (run ids, one per line;
  task i runs line i+1), split so no array exceeds max_array_size ([slurm].max_array_size, else
  Slurm's MaxArraySize from `scontrol show config`, else 1001);
- `manifest.json`: sweep name, the runs (id, name, params, config and script paths) and arrays;
- `logs/`: where Slurm writes each job's stdout/stderr (`<id>-%j.out`, `array_<k>-%A_%a.out`).

Each script can be resubmitted by hand with plain `sbatch PATH` from anywhere (its paths are
absolute). What a script does: cd to the working directory, run the [slurm].setup lines, then
`python -m fp4lab.cli train --config <id>.toml --catalog <catalog>` in the background, forwarding
signals (with --catalog the job records its own start and end: fp4lab.lab.runs.job). Slurm sends
SIGUSR1 to the batch shell `signal_before_timeout_s` before the time limit (`--signal=B:USR1@N`); the
script passes it to the trainer, which checkpoints and exits with status "preempted", and then the
script runs `scontrol requeue $SLURM_JOB_ID` (`--requeue`) so the run resumes from its checkpoint.
SIGTERM (scancel, preemption) is forwarded without requeueing. FP4LAB_NO_REQUEUE=1 turns the requeue off.
(Runs of several ranks differ: below.)

Quoting rule: every value written into the shell body (paths, the interpreter, ids) is passed
through shlex.quote. #SBATCH lines are parsed by sbatch, not bash; their values are validated
(sweep_spec.SBATCH_PATTERNS, and the path check here) so they contain no whitespace, quotes, `$`, `#`,
backticks, `;`, newlines or NUL, and are written bare. [slurm].extra values (any further sbatch
option) are printable and hold no `"` or `\\`: bare when they keep to SBATCH_BARE_VALUE, else in
double quotes, which sbatch's parser takes whole (spaces, `#` and `$` included, nothing expanded). Comments carry only printable text (values
JSON-escaped). [slurm].setup lines are shell commands by design and are written verbatim, one entry
per line; entries with newlines, CR or NUL are rejected when the spec loads.

Runs of several ranks ([slurm] SlurmSpec.ranks > 1: gpus_per_node, else ntasks_per_node, x nodes;
sweep_spec refuses such specs with parallel = "none" or a batch the ranks do not divide): the script
asks for --ntasks-per-node=<ranks per node> and starts `srun` with one task per node, each a torchrun
agent (`--nnodes=$SLURM_NNODES --nproc-per-node=P`, c10d rendezvous on the allocation's first node at
port 10000 + job id % 20000) whose ranks each run the same `train --config --catalog` (rank 0 alone
records). USR1 goes batch shell -> srun -> agents (--signals-to-handle) -> ranks; the ranks checkpoint,
the agent exits 1 regardless, and the script requeues when rank 0's summary.json of this attempt says
"preempted" (`python -m fp4lab.lab.runs.job checkpointed`). TERM is not passed on (srun would turn it
into SIGKILL); Slurm sends it to every rank itself. docs/SWEEPS.md has the details.

Nothing is written until every script and config has been rendered; each file is then written to a
temporary name and renamed into place.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from fp4lab.lab.runs import slurm
from fp4lab.lab.specs.sweep_spec import SBATCH_BARE_VALUE, RunSpec, SpecError, SweepSpec
from fp4lab.train.atomic import write_atomic
from fp4lab.train.config import toml_text

# Characters a path may have to appear bare in an #SBATCH line (and `%` is Slurm's pattern escape).
SBATCH_PATH = re.compile(r"[A-Za-z0-9_./+,:=@~-]+")
RUN_ID = re.compile(r"[0-9a-f]{12}")


def write_scripts(
    spec: SweepSpec,
    runs: list[RunSpec],
    jobs_dir: str | Path = "jobs",
    *,
    python: str | Path = sys.executable,
    workdir: str | Path | None = None,
    max_array_size: int | None = None,
    catalog: str | Path | None = None,
    ask_slurm: bool = True,
) -> list[Path]:
    """Write configs, per-run scripts and array scripts into jobs_dir/<sweep>/; return the script paths
    (per-run scripts in run order, then array scripts). The arrays' size is `max_array_size`, else the
    spec's, else the cluster's (asked only with `ask_slurm`: a local sweep never waits on Slurm), else
    Slurm's default. Raises SpecError before writing anything if a path cannot go into an #SBATCH line."""
    if not runs:
        raise SpecError(f"{spec.path}: the sweep has no runs to write")
    sweep_dir = Path(os.path.abspath(Path(jobs_dir) / spec.name))
    workdir = Path(os.path.abspath(workdir if workdir is not None else Path.cwd()))
    catalog = Path(os.path.abspath(catalog)) if catalog is not None else None
    for what, path in (("jobs folder", sweep_dir),):
        if not SBATCH_PATH.fullmatch(str(path)):
            raise SpecError(f"{what} {str(path)!r} has characters an #SBATCH --output path cannot carry "
                            "(spaces, quotes, %, $, ...); use a path of letters, digits and _ . / + , : = @ ~ -")
    for run in runs:
        if not RUN_ID.fullmatch(run.id):
            raise SpecError(f"run id {run.id!r} is not 12 hex digits")
    if len({r.id for r in runs}) != len(runs):
        raise SpecError(f"{spec.path}: two runs share an id; remove the duplicate configs")
    _check_name_is_ours(spec, sweep_dir)
    size = max_array_size or spec.slurm.max_array_size or _cluster_array_size(ask_slurm)

    files: dict[Path, str] = {}
    scripts: list[Path] = []
    for run in runs:
        files[sweep_dir / f"{run.id}.toml"] = config_toml(run, spec)
        path = sweep_dir / f"{run.id}.sbatch"
        files[path] = render_run_script(spec, run, sweep_dir, python=python, workdir=workdir, catalog=catalog)
        scripts.append(path)
    arrays = []
    if len(runs) > 1:
        for k, start in enumerate(range(0, len(runs), size)):
            chunk = runs[start:start + size]
            path = sweep_dir / f"array_{k}.sbatch"
            files[sweep_dir / f"array_{k}.runs"] = "".join(f"{r.id}\n" for r in chunk)
            files[path] = render_array_script(spec, chunk, k, sweep_dir, python=python, workdir=workdir, catalog=catalog)
            scripts.append(path)
            arrays.append({"script": path.name, "runs_file": f"array_{k}.runs", "tasks": len(chunk),
                           "run_ids": [r.id for r in chunk]})
    manifest = {
        "sweep": spec.name, "spec": os.path.abspath(spec.path), "method": spec.method, "workdir": str(workdir),
        "python": str(python), "catalog": str(catalog) if catalog else None, "max_array_size": size, "scan": spec.scan,
        "runs": [{"id": r.id, "name": r.name, "params": r.params, "out_dir": r.config["out_dir"],
                  "config": f"{r.id}.toml", "script": f"{r.id}.sbatch"} for r in runs],
        "arrays": arrays,
    }
    files[sweep_dir / "manifest.json"] = json.dumps(manifest, indent=1, sort_keys=False) + "\n"

    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        write_atomic(path, text, executable=path.suffix == ".sbatch")
    for stale in [*sweep_dir.glob("array_*.sbatch"), *sweep_dir.glob("array_*.runs")]:
        if stale not in files:  # an earlier version of this spec had more arrays: none may be resubmitted
            stale.unlink()
    return scripts


def _check_name_is_ours(spec: SweepSpec, sweep_dir: Path) -> None:
    """jobs/<name>/ belongs to the spec file that first wrote it: another spec with the same `name` would
    overwrite its manifest and mix its runs into that sweep. An edited version of the same file is fine."""
    manifest = sweep_dir / "manifest.json"
    try:
        written = json.loads(manifest.read_text())
    except (OSError, json.JSONDecodeError):
        return
    owner = Path(written.get("workdir") or ".", written.get("spec") or "")
    if written.get("spec") and os.path.realpath(owner) != os.path.realpath(spec.path):
        raise SpecError(f"{spec.path}: name = {spec.name!r} is already the sweep of {owner} ({manifest}); give this "
                        f"spec its own name, or delete {sweep_dir} if {owner} is gone")


# ------------------------------------------------------------------------------------------ render


def render_run_script(spec: SweepSpec, run: RunSpec, sweep_dir: Path, *, python, workdir: Path, catalog: Path | None = None) -> str:
    head = [
        "#!/bin/bash",
        f"# fp4lab sweep {spec.name!r}, run {run.id}: {_comment(run.name)}",
        *_description(spec),
        f"# Config: {_comment(str(sweep_dir / (run.id + '.toml')))} -> out_dir {_comment(run.config['out_dir'])}",
        f"# Submit again by hand: sbatch {_comment(str(sweep_dir / (run.id + '.sbatch')))}",
        "# Written by `fp4lab sweep`; edit the spec and re-run it rather than editing this file.",
        *_sbatch_lines(spec, f"{spec.name}-{run.id}", sweep_dir / "logs" / f"{run.id}-%j"),
        *_variables(sweep_dir, workdir, python),
        f"RUN_ID={shlex.quote(run.id)}",
    ]
    return "\n".join(head + _body(spec, catalog)) + "\n"


def render_array_script(spec: SweepSpec, chunk: list[RunSpec], k: int, sweep_dir: Path, *, python, workdir: Path, catalog: Path | None = None) -> str:
    n = len(chunk)
    parallel = f"%{spec.slurm.array_parallelism}" if spec.slurm.array_parallelism else ""
    head = [
        "#!/bin/bash",
        f"# fp4lab sweep {spec.name!r}, job array {k}: {n} runs; task i runs line i+1 of array_{k}.runs",
        *_description(spec),
        f"# Submit again by hand: sbatch {_comment(str(sweep_dir / f'array_{k}.sbatch'))}"
        f"  (one task: sbatch --array=I {_comment(str(sweep_dir / f'array_{k}.sbatch'))})",
        "# Written by `fp4lab sweep`; edit the spec and re-run it rather than editing this file.",
        "#",
        "# task  run id        what",
        *(f"# {i:<5} {r.id}  {_comment(r.name)}" for i, r in enumerate(chunk)),
        *_sbatch_lines(spec, f"{spec.name}-array{k}", sweep_dir / "logs" / f"array_{k}-%A_%a",
                       array=f"0-{n - 1}{parallel}"),
        *_variables(sweep_dir, workdir, python),
        f"RUNS_FILE=\"$SWEEP_DIR\"/{shlex.quote(f'array_{k}.runs')}",
        'TASK="${SLURM_ARRAY_TASK_ID:?not a job array task: submit this file with sbatch}"',
        'RUN_ID="$(sed -n "$((TASK + 1))p" "$RUNS_FILE")"',
        'if ! [[ "$RUN_ID" =~ ^[0-9a-f]{12}$ ]]; then',
        '  echo "fp4lab: no run id on line $((TASK + 1)) of $RUNS_FILE" >&2',
        "  exit 1",
        "fi",
    ]
    return "\n".join(head + _body(spec, catalog)) + "\n"


def _variables(sweep_dir: Path, workdir: Path, python) -> list[str]:
    """The start of every script's body: strict mode and the shell-quoted paths it works with."""
    return ["", "set -uo pipefail", f"SWEEP_DIR={shlex.quote(str(sweep_dir))}",
            f"WORKDIR={shlex.quote(str(workdir))}", f"PYTHON={shlex.quote(str(python))}"]


def _description(spec: SweepSpec) -> list[str]:
    lines = [f"# Spec: {_comment(str(spec.path))} (method {spec.method})"]
    if spec.description:
        lines.insert(0, f"# {_comment(spec.description)}")
    return lines


def _sbatch_lines(spec: SweepSpec, job_name: str, log_stem: Path, array: str | None = None) -> list[str]:
    s = spec.slurm
    options: list[tuple[str, Any]] = [("job-name", job_name)]
    if array:
        options.append(("array", array))
    for key in ("partition", "account", "qos", "nodes", "ntasks_per_node", "gpus_per_node", "cpus_per_task",
                "mem", "time", "constraint", "exclude"):
        value = getattr(s, key)
        if key == "ntasks_per_node" and s.ranks > 1:  # one task (and its CPUs) per rank, GPU ranks too
            value = s.ranks_per_node
        if value is not None:
            options.append((key.replace("_", "-"), value))
    options += [
        ("signal", f"B:USR1@{s.signal_before_timeout_s}"),
        ("requeue", None),
        ("open-mode", "append"),
        ("output", f"{log_stem}.out"),
        ("error", f"{log_stem}.err"),
    ]
    lines = ["#"]
    for key, value in options:
        if value is None:
            lines.append(f"#SBATCH --{key}")
            continue
        text = str(value)
        if not SBATCH_BARE_VALUE.fullmatch(text):
            raise SpecError(f"{spec.path}: slurm.{key}: {text!r} cannot go into an #SBATCH line")
        lines.append(f"#SBATCH --{key}={text}")
    if s.extra:
        lines.append("# [slurm].extra")
    lines += [sbatch_option_line(key, value) for key, value in s.extra_options().items()]
    return lines


def sbatch_option_line(key: str, value: str | int | bool) -> str:
    """One `#SBATCH --key[=value]` line of [slurm].extra (validated by sweep_spec.slurm_table): true is a
    flag; a value outside SBATCH_BARE_VALUE is double-quoted, as sbatch's parser reads it (the value
    holds no `"`, `\\`, newline or NUL)."""
    if value is True:
        return f"#SBATCH --{key}"
    text = str(value)
    return f"#SBATCH --{key}={text}" if SBATCH_BARE_VALUE.fullmatch(text) else f'#SBATCH --{key}="{text}"'


def _body(spec: SweepSpec, catalog: Path | None, command: str | None = None) -> list[str]:
    """The script after its variables: cd, setup, the trainer (`command`, default: train $CONFIG) in the
    background with the stop signals passed on, then the requeue of a run that checkpointed."""
    s = spec.slurm
    lines = [
        *([] if command else ['CONFIG="$SWEEP_DIR/$RUN_ID.toml"']),
        *([f"CATALOG={shlex.quote(str(catalog))}  # the job records its own start and end here"] if catalog else []),
        'cd "$WORKDIR" || { echo "fp4lab: cannot cd to $WORKDIR" >&2; exit 1; }',
        "",
    ]
    if s.setup:
        lines.append("# setup ([slurm].setup, verbatim)")
        lines += s.setup
        lines.append("")
    lines.append('echo "fp4lab: optuna trial slot $SLOT, host $(hostname), job ${SLURM_JOB_ID:-none}"' if command else
                 'echo "fp4lab: run $RUN_ID, config $CONFIG, host $(hostname), job ${SLURM_JOB_ID:-none}"')
    train = command or '-m fp4lab.cli train --config "$CONFIG"' + (' --catalog "$CATALOG"' if catalog else "")
    lines += [
        "# USR1 (before the time limit): the trainer checkpoints and stops; then this job is requeued.",
        "REQUEUE=0",
        "CHILD=",
        "trap 'REQUEUE=1; [ -n \"$CHILD\" ] && kill -USR1 \"$CHILD\" 2>/dev/null' USR1",
    ]
    if s.ranks > 1:  # never an optuna trial (`command`): sweep_spec refuses those specs
        lines += [
            "# TERM (scancel, preemption, time limit): not passed on; srun would turn it into SIGKILL, and Slurm",
            "# sends it to every rank itself (its KillWait bounds the checkpoint). No requeue.",
            "trap 'echo \"fp4lab: TERM; Slurm passes it to the ranks\" >&2' TERM",
            *_ranks_launch(spec, train),
        ]
        # torchrun's agent exits 1 after passing a signal on, however cleanly the ranks stopped: whether
        # the run checkpointed is what rank 0 wrote into summary.json during this attempt.
        checkpointed = '"$PYTHON" -m fp4lab.lab.runs.job checkpointed "$CONFIG" "$STARTED"'
    else:
        lines += [
            "# TERM (scancel, preemption): passed on, no requeue.",
            "trap '[ -n \"$CHILD\" ] && kill -TERM \"$CHILD\" 2>/dev/null' TERM",
            f'"$PYTHON" -u {train} &',
        ]
        checkpointed = '[ "$RC" = 0 ]'  # the trainer exits 0 after a stop only once its checkpoint is written
    lines += [
        "CHILD=$!",
        "# wait returns early when a trapped signal arrives; keep waiting until the trainer has exited.",
        'while kill -0 "$CHILD" 2>/dev/null; do wait "$CHILD"; done',
        'wait "$CHILD"; RC=$?',
        f'if [ "$REQUEUE" = 1 ] && [ -z "${{FP4LAB_NO_REQUEUE:-}}" ] && [ -n "${{SLURM_JOB_ID:-}}" ] && {checkpointed}; then',
        '  echo "fp4lab: checkpointed before the time limit; requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'exit "$RC"',
    ]
    return lines


def _ranks_launch(spec: SweepSpec, train: str) -> list[str]:
    """A run of several ranks: srun starts one torchrun agent per node; the agents meet in a c10d
    rendezvous on the allocation's first node (where this script runs) and start ranks_per_node
    processes each. The step asks for the CPUs the job has for its ranks on a node (one task of
    ranks_per_node x cpus_per_task), and the node's GPUs: srun >= 22.05 no longer inherits sbatch's
    --cpus-per-task, and a step run with --exact (or by a Slurm of exclusive steps) gets only what it asks for.

    Signals: srun passes USR1 on to the agents unchanged, and the agents (--signals-to-handle) pass it
    to their ranks; any rank's signal makes all of them checkpoint (train.distributed). A TERM is not
    passed on: srun would turn it into SIGKILL ("forcing job termination"), and Slurm itself sends
    TERM to every process of the job's steps on scancel, time limit and preemption."""
    s = spec.slurm
    per_node = s.ranks_per_node
    step = [
        "srun", '--nodes="$SLURM_NNODES"', '--ntasks="$SLURM_NNODES"', "--ntasks-per-node=1",
        f"--cpus-per-task={per_node * (s.cpus_per_task or 1)}",
        *([f"--gpus-per-node={s.gpus_per_node}"] if s.gpus_per_node else []),
        "--kill-on-bad-exit=1",
        '"$PYTHON" -u -m torch.distributed.run', '--nnodes="$SLURM_NNODES"', f"--nproc-per-node={per_node}",
        "--rdzv-backend=c10d", '--rdzv-endpoint="$RDZV_HOST:$RDZV_PORT"', '--rdzv-id="$SLURM_JOB_ID"',
        "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        f"--shutdown-timeout={s.signal_before_timeout_s}",
    ]
    return [
        f"# {s.ranks} ranks ({s.ranks_text()}): one torchrun agent per node, c10d rendezvous on the first node.",
        ': "${SLURM_JOB_ID:?a run of several ranks starts through srun: submit this file with sbatch}"',
        'RDZV_HOST="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        "# The port comes from the job id, so two jobs on one node (array tasks too: each has its own id) differ",
        "# unless their ids are 20000 apart; 10000-29999 lies below Linux's ephemeral ports (32768 up).",
        "RDZV_PORT=$((10000 + SLURM_JOB_ID % 20000))",
        "# The agents pass USR1 on to their ranks and give them signal_before_timeout_s",
        f"# = {s.signal_before_timeout_s} s to checkpoint before SIGKILL.",
        "STARTED=$(date +%s)",
        " ".join(step) + f" {train} &",
    ]


def _comment(text: str) -> str:
    """Text safe on one comment line: printable as is, otherwise JSON-escaped."""
    return text if text.isprintable() else json.dumps(text)[1:-1]


def _cluster_array_size(ask_slurm: bool) -> int:
    return slurm.max_array_size() if ask_slurm else slurm.DEFAULT_MAX_ARRAY_SIZE


def write_trial_scripts(
    spec: SweepSpec,
    jobs_dir: str | Path = "jobs",
    *,
    catalog: str | Path,
    python: str | Path = sys.executable,
    workdir: str | Path | None = None,
    max_array_size: int | None = None,
    ask_slurm: bool = True,
) -> list[Path]:
    """Optuna sweeps: a copy of the spec (jobs/<sweep>/spec.toml, what the jobs read, so later edits of
    the original do not change a running sweep), the manifest, and `trials_<k>.sbatch` job arrays of
    [optuna].n_trials tasks in all; each task runs `fp4lab trial` (ask, train, tell) with its slot
    number (the sampler seed offset). Returns the script paths."""
    sweep_dir = Path(os.path.abspath(Path(jobs_dir) / spec.name))
    if not SBATCH_PATH.fullmatch(str(sweep_dir)):
        raise SpecError(f"jobs folder {str(sweep_dir)!r} has characters an #SBATCH --output path cannot carry "
                        "(spaces, quotes, %, $, ...); use a path of letters, digits and _ . / + , : = @ ~ -")
    workdir = Path(os.path.abspath(workdir if workdir is not None else Path.cwd()))
    catalog = Path(os.path.abspath(catalog))
    size = max_array_size or spec.slurm.max_array_size or _cluster_array_size(ask_slurm)
    _check_name_is_ours(spec, sweep_dir)
    n = spec.optuna.n_trials
    files = {sweep_dir / "spec.toml": Path(spec.path).read_text()}
    scripts = []
    for k, offset in enumerate(range(0, n, size)):
        tasks = min(size, n - offset)
        parallel = f"%{spec.slurm.array_parallelism}" if spec.slurm.array_parallelism else ""
        path = sweep_dir / f"trials_{k}.sbatch"
        head = [
            "#!/bin/bash",
            f"# fp4lab sweep {spec.name!r} (method optuna), trial array {k}: {tasks} of {n} trials; slots {offset}..{offset + tasks - 1}",
            *_description(spec),
            f"# Study: {_comment(spec.optuna_storage(jobs_dir))}; objective {spec.optuna.objective} ({spec.optuna.direction})",
            f"# Submit again by hand: sbatch {_comment(str(path))}",
            "# Written by `fp4lab sweep`; edit the spec and re-run it rather than editing this file.",
            *_sbatch_lines(spec, f"{spec.name}-trials{k}", sweep_dir / "logs" / f"trials_{k}-%A_%a", array=f"0-{tasks - 1}{parallel}"),
            *_variables(sweep_dir, workdir, python),
            f"JOBS_DIR={shlex.quote(str(Path(os.path.abspath(jobs_dir))))}",
            'TASK="${SLURM_ARRAY_TASK_ID:?not a job array task: submit this file with sbatch}"',
            f"SLOT=$((TASK + {offset}))",
        ]
        command = '-m fp4lab.cli trial "$SWEEP_DIR/spec.toml" --jobs-dir "$JOBS_DIR" --catalog "$CATALOG" --slot "$SLOT"'
        files[path] = "\n".join(head + _body(spec, catalog, command)) + "\n"
        scripts.append(path)
    manifest = {"sweep": spec.name, "spec": os.path.abspath(spec.path), "method": spec.method, "workdir": str(workdir),
                "python": str(python), "catalog": str(catalog), "max_array_size": size, "scan": spec.scan,
                "study": spec.optuna_storage(jobs_dir), "n_trials": n, "runs": [],
                "arrays": [{"script": p.name} for p in scripts]}
    files[sweep_dir / "manifest.json"] = json.dumps(manifest, indent=1) + "\n"
    (sweep_dir / "logs").mkdir(parents=True, exist_ok=True)
    for file, text in files.items():
        write_atomic(file, text, executable=file.suffix == ".sbatch")
    return scripts


# -------------------------------------------------------------------------------------- run configs


def config_toml(run: RunSpec, spec: SweepSpec | None = None) -> str:
    """The run's resolved config as TOML (None values are left out: they are TrainConfig's defaults)."""
    head = [f"fp4lab run {run.id}: {_comment(run.name)}"]
    if spec is not None:
        head.append(f"sweep {spec.name!r} ({_comment(str(spec.path))}); train with: fp4lab train --config THIS_FILE")
    return toml_text(run.config, head)


__all__ = ["config_toml", "render_array_script", "render_run_script", "write_scripts", "write_trial_scripts"]
