"""Sweep specs: a TOML file naming a base training config, the axes to expand and the Slurm settings.

    spec = load_spec("sweeps/recipes.toml")   # validates everything; one-line SpecError otherwise
    runs = expand(spec)                       # list[RunSpec(id, name, config, params)]

The format is documented in docs/SWEEPS.md. Every error is one line naming the file, the key path
(`axes.lr[2]`, `slurm.partition`) and the allowed values or the fix.

Run ids: `run_id(config)` is the first 12 hex digits of sha256 over the canonical JSON of the
resolved TrainConfig (every field, defaults filled in, ints in float fields written as floats, keys
sorted), leaving out the fields that don't change what a run computes (`train.config.RESULT_NEUTRAL`:
out_dir, device, max_minutes, checkpoint_every, compile, cuda_graphs). The same config gets the same id in any process on any machine; a run's folder is
`runs/<sweep>/<id>`.

This module does not import torch: run configs are validated by the torch-free `TrainConfig.from_dict`
(recipes by `nn.recipe`, imported inside the call).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fp4lab.lab.records.logscan import ScanThresholds, threshold_value
from fp4lab.lab.specs.search_space import SearchParam, probe_values, search_param
from fp4lab.train.config import (
    HASHED_UNLESS_DEFAULT,
    RENAMED_SUMMARY_KEYS,
    RESULT_NEUTRAL,
    ConfigError,
    DataConfig,
    TrainConfig,
)
from fp4lab.train.pruning import PRUNER_WANTS, pruner_settings, pruning_problem
from fp4lab.validation import (
    Rule,
    checked_table,
    choice,
    entry,
    integer,
    is_int,
    known_keys,
    list_of,
    read_toml,
    string,
    table_of,
)

METHODS = ("grid", "random", "optuna")
# Summary keys (train.loop's summary.json) an optuna objective may name.
OBJECTIVES = ("final_val_loss", "best_val_loss", "final_train_loss", "best_train_loss", "tokens_per_s", "train_seconds")
DIRECTIONS = ("minimize", "maximize")
SEARCH_SPACE_WANTS = ("a non-empty table: name = {type = ..., low, high} or "
                      "{type = \"categorical\", choices = [...]}")
TOP_KEYS = ("name", "description", "base", "axes", "method", "samples", "seed", "optuna", "slurm", "scan")
SET_BY_THE_SWEEP = ("tracker_group", "tracker_run")  # with out_dir: a run config's fields a spec may not give
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# #SBATCH values: sbatch (not bash) parses these lines, so they may only hold characters that need no
# quoting anywhere: no whitespace, quotes, `#`, `$`, backticks, `;`, newlines or NUL.
SBATCH_PATTERNS = {
    "partition": (r"[A-Za-z0-9_.+-]+(,[A-Za-z0-9_.+-]+)*", "names of letters, digits, _ . + -, comma-separated"),
    "account": (r"[A-Za-z0-9_.+-]+", "letters, digits, _ . + -"),
    "qos": (r"[A-Za-z0-9_.+-]+", "letters, digits, _ . + -"),
    "mem": (r"[0-9]+[KMGT]?", "an integer with an optional K/M/G/T suffix, e.g. 64G"),
    "time": (r"([0-9]+-)?[0-9]+(:[0-9]{1,2}){0,2}", "minutes, MM:SS, HH:MM:SS or D-HH:MM:SS, e.g. 04:00:00"),
    "constraint": (r"[A-Za-z0-9_.,:&|*!()\[\]-]+", "features joined by & | , with no spaces, e.g. h100&ib"),
    "exclude": (r"[A-Za-z0-9_.,\[\]-]+", "a node list such as node[01-04],gpu7"),
}
# [slurm].extra: any further sbatch option by its long name (`mail_type` or `mail-type`).
SBATCH_EXTRA_NAME = re.compile(r"[a-z][a-z0-9_-]*")
# A value needs no quotes when made of these; otherwise it is written --name="value", which sbatch's own
# parser reads (it ends an unquoted value at whitespace or `#`, and takes `\` as an escape).
SBATCH_BARE_VALUE = re.compile(r"[A-Za-z0-9_./+,:=@~%&|*!()\[\]-]+")
# Options fp4lab writes itself, or through a [slurm] key of its own: extra may not set them.
SBATCH_OWN_OPTIONS = {
    "job-name": "fp4lab names each job after its sweep and run",
    "array": "fp4lab writes the job arrays ([slurm].max_array_size, array_parallelism)",
    "output": "fp4lab writes the logs into jobs/<sweep>/logs/",
    "error": "fp4lab writes the logs into jobs/<sweep>/logs/",
    "open-mode": "a requeued run appends to its log",
    "signal": "set [slurm].signal_before_timeout_s",
    "requeue": "set [slurm].max_requeues",
    "no-requeue": "set [slurm].max_requeues = 0",
    "wrap": "the script is fp4lab's",
    "parsable": "fp4lab reads the job id",
    **{name.replace("_", "-"): f"set [slurm].{name}" for name in (
        "partition", "account", "qos", "gpus_per_node", "nodes", "ntasks_per_node", "cpus_per_task", "mem", "time",
        "constraint", "exclude")},
}


def _extra_value(value: Any) -> bool:
    return value is True or is_int(value) or (isinstance(value, str) and value != "" and value.isprintable()
                                              and '"' not in value and "\\" not in value)


class SpecError(ValueError):
    """A sweep spec that does not validate: one line naming the file, the key path and the fix."""


@dataclass(frozen=True)
class RunSpec:
    """One run of a sweep. `config` is the resolved TrainConfig dict (TrainConfig.from_dict takes it);
    `params` are the axis values that distinguish it; `name` is those values as `k=v` text."""

    id: str
    name: str
    config: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)


def _sbatch_time(value: Any) -> bool:
    return is_int(value) or isinstance(value, str)


@dataclass(frozen=True, kw_only=True)
class OptunaSpec:
    n_trials: int = entry(integer(minimum=1))
    objective: str = entry(choice(OBJECTIVES), "final_val_loss")
    direction: str = entry(choice(DIRECTIONS), "minimize")
    search_space: dict[str, SearchParam] = entry(table_of(wants=SEARCH_SPACE_WANTS))
    storage: str | None = entry(string(wants="a journal file path (default jobs/<sweep>/optuna.journal)",
                                       holds=lambda path: bool(path) and path.isprintable()), None)
    # Early stopping (fp4lab.train.pruning): a name or a table as written; _optuna stores its full settings.
    pruner: Any = entry(Rule(PRUNER_WANTS, lambda value: isinstance(value, (str, dict))), "none")


@dataclass(frozen=True, kw_only=True)
class SlurmSpec:
    """[slurm]: where and how the runs go on a Slurm cluster. The text values go into #SBATCH lines and
    keep to SBATCH_PATTERNS (checked by slurm_table)."""

    partition: str | None = entry(string(), None)
    account: str | None = entry(string(), None)
    qos: str | None = entry(string(), None)
    gpus_per_node: int | None = entry(integer(minimum=0), None)
    nodes: int = entry(integer(minimum=1), 1)
    ntasks_per_node: int | None = entry(integer(minimum=1), None)
    cpus_per_task: int | None = entry(integer(minimum=1), None)
    mem: str | None = entry(string(), None)
    time: str | int | None = entry(Rule("minutes (an integer >= 1) or text such as 04:00:00", _sbatch_time,
                                        holds=lambda value: not is_int(value) or value >= 1), None)
    constraint: str | None = entry(string(), None)
    exclude: str | None = entry(string(), None)
    array_parallelism: int | None = entry(integer(minimum=1), None)
    signal_before_timeout_s: int = entry(integer(minimum=1), 120)
    setup: tuple[str, ...] = entry(list_of(string()), ())
    max_array_size: int | None = entry(integer(minimum=1), None)
    max_requeues: int = entry(integer(minimum=0), 3)
    extra: dict[str, str | int | bool] = entry(table_of(Rule(
        "printable text without double quotes or backslashes, an integer, or true (a flag without a value)",
        _extra_value)), {})

    def extra_options(self) -> dict[str, str | int | bool]:
        """`extra` by sbatch's own option names (`mail_type` -> `mail-type`), in the spec's order."""
        return {name.replace("_", "-"): value for name, value in self.extra.items()}

    @property
    def ranks_per_node(self) -> int:
        """Training processes of one run on each node: one per GPU (gpus_per_node > 0), else
        ntasks_per_node CPU ranks, else 1."""
        return self.gpus_per_node or self.ntasks_per_node or 1

    @property
    def ranks(self) -> int:
        """Training processes (torchrun ranks) of one run: ranks_per_node on each of `nodes` nodes."""
        return self.ranks_per_node * self.nodes

    def ranks_text(self) -> str:
        """Where `ranks` comes from, in the spec's own keys, for error messages."""
        per = f"gpus_per_node = {self.gpus_per_node}" if self.gpus_per_node else (
            f"ntasks_per_node = {self.ntasks_per_node}" if self.ntasks_per_node else "1 rank per node")
        return f"[slurm] {per}" + (f" on nodes = {self.nodes}" if self.nodes > 1 else "")


@dataclass(frozen=True)
class SweepSpec:
    name: str
    description: str
    path: Path
    base: dict[str, Any]
    axes: dict[str, list[Any]]
    method: str = "grid"
    samples: int | None = None
    seed: int = 0
    optuna: OptunaSpec | None = None
    slurm: SlurmSpec = SlurmSpec()
    scan: dict[str, float | int] = field(default_factory=dict)

    def sweep_dir(self, jobs_dir: str | Path = "jobs") -> Path:
        """Where this sweep's scripts, configs and logs go: jobs/<name>."""
        return Path(jobs_dir) / self.name

    def optuna_storage(self, jobs_dir: str | Path = "jobs") -> str:
        """The optuna JournalFileBackend file: [optuna].storage, default jobs/<name>/optuna.journal."""
        if self.optuna is not None and self.optuna.storage:
            return self.optuna.storage
        return str(self.sweep_dir(jobs_dir) / "optuna.journal")

    def size(self) -> int:
        """How many runs expand() gives (n_trials for optuna)."""
        if self.method == "optuna":
            return self.optuna.n_trials
        total = math.prod(len(values) for values in self.axes.values())
        return min(total, self.samples) if self.method == "random" else total


# ---------------------------------------------------------------------------------------------- load


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a sweep spec; raises SpecError (one line) on any problem."""
    return spec_from_dict(read_toml(path, SpecError, "sweep spec"), Path(path))


def spec_from_dict(table: dict[str, Any], path: str | Path = "<spec>") -> SweepSpec:
    path = Path(path)

    def fail(where: str, message: str) -> SpecError:
        return SpecError(f"{path}: {where}: {message}")

    known_keys(table, TOP_KEYS, "", fail)
    name, description, method = _identity(table, fail)
    slurm = slurm_table(table.get("slurm", {}), fail)
    base, base_config = _base(table.get("base", {}), fail)
    axes = _axes(table.get("axes", {}), base, fail)
    samples, seed = _sampling(table, method, axes, fail)
    optuna = _optuna(table, method, axes, base, fail)
    _check_ranks(slurm, method, base_config, axes, fail)
    scan = _scan(table.get("scan", {}), fail)
    return SweepSpec(name=name, description=description, path=path, base=base, axes=axes, method=method,
                     samples=samples, seed=seed if method != "grid" else 0, optuna=optuna, slurm=slurm, scan=scan)


def _identity(table: dict[str, Any], fail) -> tuple[str, str, str]:
    """name, description and method."""
    name = table.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.match(name):
        raise fail("name", f"{name!r} must be 1-64 letters, digits, . _ - (it names jobs/<name> and runs/<name>)")
    description = string().check("description", table.get("description", ""), fail)
    method = choice(METHODS).check("method", table.get("method", "grid"), fail)
    return name, description, method


def _base(base: Any, fail) -> tuple[dict[str, Any], dict[str, Any]]:
    """[base] as written, and the TrainConfig it resolves to."""
    if not isinstance(base, dict):
        raise fail("base", "must be a table of TrainConfig fields ([base])")
    train_fields, data_fields = _train_fields()
    known_keys(base, train_fields, "base", fail)
    if "data" in base:
        if not isinstance(base["data"], dict):
            raise fail("base.data", "must be a table ([base.data]) of DataConfig fields")
        known_keys(base["data"], data_fields, "base.data", fail)
    if "out_dir" in base:
        raise fail("base.out_dir", "is set by the sweep to runs/<sweep>/<id>; remove it")
    for key in SET_BY_THE_SWEEP:
        if key in base:
            raise fail(f"base.{key}", "is set by the sweep: trackers file each run under the sweep's name, by its id; remove it")
    _check_recipe(base.get("recipe"), "base.recipe", fail)
    return base, _validate_config(_merge(base, {}), "base", fail)


def _axes(axes: Any, base: dict[str, Any], fail) -> dict[str, list[Any]]:
    """[axes]: each a TrainConfig field (or data.<DataConfig field>) with distinct values, each value
    giving a valid config on top of [base]."""
    if not isinstance(axes, dict):
        raise fail("axes", "must be a table: name = [values]")
    train_fields, data_fields = _train_fields()
    for axis, values in axes.items():
        _check_axis_name(axis, train_fields, data_fields, f"axes.{axis}", fail)
        if not isinstance(values, list) or not values:
            raise fail(f"axes.{axis}", "must be a non-empty list of values, e.g. [0.01, 0.02]")
        seen: dict[str, int] = {}
        for i, value in enumerate(values):
            where = f"axes.{axis}[{i}]"
            key = json.dumps(value, sort_keys=True)
            if key in seen:
                raise fail(where, f"{value!r} repeats axes.{axis}[{seen[key]}]; remove the duplicate")
            seen[key] = i
            if axis == "recipe":
                _check_recipe(value, where, fail)
            _validate_config(_merge(base, {axis: value}), where, fail)
    return axes


def _sampling(table: dict[str, Any], method: str, axes: dict[str, list[Any]], fail) -> tuple[int | None, Any]:
    """samples and seed: random sweeps need both, optuna takes a seed, grid neither."""
    samples = table.get("samples")
    seed = table.get("seed", 0)
    if method != "random" and "samples" in table:
        raise fail("samples", f"only applies to method = \"random\" (this spec has method = {method!r})")
    if method == "grid" and "seed" in table:
        raise fail("seed", "only applies to method = \"random\" or \"optuna\" (this spec has method = \"grid\")")
    if method == "optuna":
        integer(minimum=0).hinted("the Optuna sampler's seed").check("seed", seed, fail)
    if method == "random":
        if samples is None:
            raise fail("samples", "missing; method = \"random\" needs samples = an integer >= 1")
        integer(minimum=1).check("samples", samples, fail)
        integer(minimum=0).check("seed", seed, fail)
        total = math.prod(len(v) for v in axes.values())
        if samples > total:
            raise fail("samples", f"{samples} is more than the {total} distinct axis combinations; lower it")
    return samples, seed


def _optuna(table: dict[str, Any], method: str, axes: dict[str, list[Any]], base: dict[str, Any], fail) -> OptunaSpec | None:
    """[optuna], which method = "optuna" needs and no other method takes; its search space holds
    TrainConfig fields, and both ends (or every choice) of each give a valid config on top of [base]."""
    if method != "optuna":
        if "optuna" in table:
            raise fail("optuna", f"only applies to method = \"optuna\" (this spec has method = {method!r})")
        return None
    if axes:
        raise fail("axes", "method = \"optuna\" takes its parameters from [optuna.search_space]; "
                   "move the axes there (type = \"categorical\", choices = [...])")
    if "optuna" not in table:
        raise fail("optuna", "method = \"optuna\" needs an [optuna] table (n_trials, objective, direction, search_space)")
    optuna = table["optuna"]
    if isinstance(optuna, dict) and optuna.get("objective") in RENAMED_SUMMARY_KEYS:  # a spec written before the rename
        optuna = {**optuna, "objective": RENAMED_SUMMARY_KEYS[optuna["objective"]]}
    spec = checked_table(OptunaSpec, optuna, "optuna", fail)
    spec = dataclasses.replace(spec, pruner=pruner_settings(spec.pruner, "optuna.pruner", fail))
    if spec.pruner["type"] != "none" and (problem := pruning_problem(spec.objective, spec.direction)):
        raise fail("optuna.pruner", problem + " (or pruner = \"none\")")
    if not spec.search_space:
        raise fail("optuna.search_space", f"must be {SEARCH_SPACE_WANTS}")
    train_fields, data_fields = _train_fields()
    space = {}
    for pname, param in spec.search_space.items():
        where = f"optuna.search_space.{pname}"
        _check_axis_name(pname, train_fields, data_fields, where, fail)
        space[pname] = search_param(where, param, fail)
        for i, value in enumerate(probe_values(space[pname])):
            if pname == "recipe":
                _check_recipe(value, f"{where}.choices[{i}]", fail)
            _validate_config(_merge(base, {pname: value}), where, fail)
    return dataclasses.replace(spec, search_space=space)


def slurm_table(table: Any, fail, where: str = "slurm") -> SlurmSpec:
    """A validated [slurm] table (sweep specs and program.md share it); fail(place, message) for errors,
    `where` naming the table in them (`slurm`, `[slurm]`)."""
    slurm = checked_table(SlurmSpec, table, where, fail)
    for key, (pattern, allowed) in SBATCH_PATTERNS.items():
        value = getattr(slurm, key)
        if isinstance(value, str) and not re.fullmatch(pattern, value):
            raise fail(f"{where}.{key}", f"{value!r} is not allowed in an #SBATCH line; use {allowed}")
    if slurm.gpus_per_node and slurm.ntasks_per_node not in (None, slurm.gpus_per_node):
        raise fail(f"{where}.ntasks_per_node", f"{slurm.ntasks_per_node} differs from gpus_per_node = {slurm.gpus_per_node}: "
                   "a run has one rank per GPU; remove ntasks_per_node")
    limit = time_limit_seconds(slurm.time)
    if limit is not None and slurm.signal_before_timeout_s >= limit:
        raise fail(f"{where}.signal_before_timeout_s",
                   f"{slurm.signal_before_timeout_s} s must be shorter than the time limit ({limit} s)")
    seen: dict[str, str] = {}
    for name in slurm.extra:
        option = name.replace("_", "-")
        if not SBATCH_EXTRA_NAME.fullmatch(name):
            raise fail(f"{where}.extra.{name}", "is not an sbatch option name: use its long name in lower case, "
                       "e.g. gres, mail_type, reservation")
        if option in SBATCH_OWN_OPTIONS:
            raise fail(f"{where}.extra.{name}", f"fp4lab sets --{option} itself: {SBATCH_OWN_OPTIONS[option]}")
        if option in seen:
            raise fail(f"{where}.extra.{name}", f"--{option} is also given as {seen[option]!r}; keep one")
        seen[option] = name
    for i, line in enumerate(slurm.setup):
        if any(ch in line for ch in "\n\r\0") or not line.strip():
            raise fail(f"{where}.setup[{i}]", "each entry is one shell command on one line: no newlines or NUL, not empty; "
                       "split it into several entries")
    return slurm


def _check_ranks(slurm: SlurmSpec, method: str, base_config: dict[str, Any], axes: dict[str, list[Any]], fail) -> None:
    """Runs of several ranks (SlurmSpec.ranks) need a parallel mode that shares the model over them and
    a batch that splits into equal rows per rank; optuna trials (`fp4lab trial`: ask, train, tell) are
    one process each. A run's parallel and batch_size come from their axis when there is one, else
    from [base]; every value either can take is checked."""
    ranks = slurm.ranks
    if ranks == 1:
        return
    if method == "optuna":
        raise fail("slurm", f"{slurm.ranks_text()} gives each run {ranks} ranks, but method = \"optuna\" trains each "
                   "trial in one process; ask for one rank, or use method = \"grid\" or \"random\"")
    for key in ("parallel", "batch_size"):
        places = [(f"axes.{key}[{i}]", v) for i, v in enumerate(axes[key])] if key in axes else [(f"base.{key}", base_config[key])]
        for where, value in places:
            if key == "parallel" and value == "none":
                raise fail(where, f"parallel = \"none\" trains in one process, but {slurm.ranks_text()} gives each run "
                           f"{ranks} ranks; set parallel = \"ddp\", \"fsdp\", \"hsdp\" or \"pp\", or ask [slurm] for one rank")
            if key == "batch_size" and value % ranks:
                raise fail(where, f"batch_size = {value} does not split over the {ranks} ranks {slurm.ranks_text()} "
                           f"gives each run; use a multiple of {ranks}")


def _scan(table: Any, fail) -> dict[str, Any]:
    """[scan]: overrides of the log scanner's thresholds (logscan.ScanThresholds), checked by the same
    code as `fp4lab scan --threshold NAME=VALUE`."""
    if not isinstance(table, dict):
        raise fail("scan", "must be a table")
    for key, value in table.items():
        try:
            threshold_value(key, value)
        except ValueError as exc:
            raise fail(f"scan.{key}", str(exc)) from None
    try:
        ScanThresholds().with_overrides(table)
    except ValueError as exc:  # values that do not fit together
        raise fail(f"scan.{next(iter(table))}" if len(table) == 1 else "scan", str(exc)) from None
    return dict(table)


def time_limit_seconds(value: str | int | None) -> int | None:
    """Slurm --time in seconds: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS."""
    if value is None:
        return None
    if is_int(value):
        return value * 60
    days, _, rest = value.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))
        h, m, s = parts
        return ((int(days) * 24 + h) * 60 + m) * 60 + s
    if len(parts) == 1:
        return parts[0] * 60
    if len(parts) == 2:
        return parts[0] * 60 + parts[1]
    return (parts[0] * 60 + parts[1]) * 60 + parts[2]


# -------------------------------------------------------------------------------------------- expand


def expand(spec: SweepSpec) -> list[RunSpec]:
    """The runs of a grid or random sweep, in a stable order (the cartesian product of the axes in the
    order the spec lists them, last axis fastest; random keeps that order for the sampled points).
    Optuna sweeps are expanded trial by trial with `make_run(spec, params)`."""
    if spec.method == "optuna":
        raise SpecError(f"{spec.path}: method = \"optuna\" runs are proposed one trial at a time; "
                        "use make_run(spec, trial_params) from the ask/tell loop")
    names = list(spec.axes)
    sizes = [len(spec.axes[n]) for n in names]
    total = math.prod(sizes)
    if spec.method == "random":
        indices = sorted(random.Random(spec.seed).sample(range(total), spec.samples))
    else:
        indices = range(total)
    runs, seen = [], {}
    for index in indices:
        params = {}
        for name, size in zip(reversed(names), reversed(sizes)):
            index, digit = divmod(index, size)
            params[name] = spec.axes[name][digit]
        params = {n: params[n] for n in names}
        run = make_run(spec, params)
        if run.id in seen:
            raise SpecError(f"{spec.path}: axes: {run.name!r} and {seen[run.id]!r} resolve to the same config "
                            f"(id {run.id}); remove one of the values")
        seen[run.id] = run.name
        runs.append(run)
    return runs


def make_run(spec: SweepSpec, params: dict[str, Any]) -> RunSpec:
    """One run: base + params (axis or trial values; `data.x` keys go into the data table), validated
    by TrainConfig, with out_dir = runs/<sweep>/<id>."""
    config = _validate_config(_merge(spec.base, params), _describe(params) or "base",
                              lambda where, message: SpecError(f"{spec.path}: {where}: {message}"))
    rid = run_id(config)
    config["out_dir"] = f"runs/{spec.name}/{rid}"
    if config.get("log_to"):  # trackers file the run under the sweep, by its id
        config["tracker_group"], config["tracker_run"] = spec.name, rid
    return RunSpec(id=rid, name=_describe(params) or "base", config=config, params=dict(params))


def run_id(config: dict[str, Any]) -> str:
    """12 hex digits of sha256 over the canonical JSON of a resolved TrainConfig dict, leaving out
    RESULT_NEUTRAL. Pass a complete config (TrainConfig(...).to_dict() or RunSpec.config)."""
    return hashlib.sha256(canonical_json(config).encode()).hexdigest()[:12]


def canonical_json(config: dict[str, Any]) -> str:
    """Sorted keys, no spaces, ints in float fields as floats, RESULT_NEUTRAL left out, and the fields of
    HASHED_UNLESS_DEFAULT left out at their default."""
    floats, data_floats = _float_fields()
    values = {
        k: v for k, v in config.items()
        if k not in RESULT_NEUTRAL and not (k in HASHED_UNLESS_DEFAULT and v == HASHED_UNLESS_DEFAULT[k])
    }
    for key in floats & values.keys():
        values[key] = _as_float(values[key])
    if isinstance(values.get("data"), dict):
        values["data"] = {k: (_as_float(v) if k in data_floats else v) for k, v in values["data"].items()}
    return json.dumps(values, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


# ----------------------------------------------------------------------------------------- helpers


def _train_fields() -> tuple[tuple[str, ...], tuple[str, ...]]:

    return tuple(f.name for f in dataclasses.fields(TrainConfig)), tuple(f.name for f in dataclasses.fields(DataConfig))


def _float_fields() -> tuple[set[str], set[str]]:

    def floats(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls) if "float" in str(f.type)}

    return floats(TrainConfig), floats(DataConfig)


def _validate_config(values: dict[str, Any], where: str, fail) -> dict[str, Any]:
    """TrainConfig.from_dict(values).to_dict(), with any ConfigError re-raised naming `where`."""

    try:
        return TrainConfig.from_dict(values, "config").to_dict()
    except ConfigError as exc:
        raise fail(where, str(exc).removeprefix("config: ")) from None


def _check_recipe(value: Any, where: str, fail) -> None:
    """A built-in recipe name or an existing .toml path (relative to the current directory), loaded
    and validated in full."""
    if value is None:
        return
    from fp4lab.nn.recipe import RecipeError, list_recipes, load_recipe

    if not isinstance(value, str) or not value:
        raise fail(where, f"{value!r} must be a recipe name ({', '.join(list_recipes())}) or a .toml path")
    try:
        load_recipe(value)
    except RecipeError as exc:
        raise fail(where, str(exc).splitlines()[0]) from None


def _check_axis_name(name: str, train_fields, data_fields, where: str, fail) -> None:
    if name.startswith("data."):
        if name[5:] not in data_fields:
            raise fail(where, f"unknown data field {name[5:]!r}; allowed: {', '.join('data.' + f for f in data_fields)}")
        return
    if name == "data":
        raise fail(where, "sweep data fields one at a time: data.source, data.vocab_size, ...")
    if name in ("out_dir", *SET_BY_THE_SWEEP):
        raise fail(where, f"{name} is set by the sweep (runs/<sweep>/<id>, the sweep's name, the run id); remove this axis")
    if name not in train_fields:
        allowed = [f for f in train_fields if f not in ("data", "out_dir", *SET_BY_THE_SWEEP)] + [f"data.{f}" for f in data_fields]
        raise fail(where, f"unknown field {name!r}; allowed: {', '.join(allowed)}")


def _merge(base: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for key, value in params.items():
        if key.startswith("data."):
            merged.setdefault("data", {})[key[5:]] = value
        else:
            merged[key] = value
    merged.pop("out_dir", None)
    return merged


def _describe(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in params.items())


def _short(value: Any) -> str:
    if isinstance(value, str) and value.isprintable() and value and not any(c.isspace() or c in "\"'=" for c in value):
        return value
    if isinstance(value, float):
        return f"{value:.4g}"  # a label: the run id keeps the exact value
    return json.dumps(value)


def _as_float(value: Any) -> Any:
    return float(value) if is_int(value) else value


__all__ = [
    "OptunaSpec", "RunSpec", "SlurmSpec", "SpecError", "SweepSpec", "slurm_table",
    "canonical_json", "expand", "load_spec", "make_run", "run_id", "spec_from_dict", "time_limit_seconds",
]
