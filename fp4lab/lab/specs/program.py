"""program.md: what `fp4lab ratchet` optimises, as prose for the proposers plus one machine-readable block.

    program = load_program("program.md")     # validated; a one-line ProgramError otherwise
    program.better(new, best)                # strictly better, given the direction
    program.editable("fp4lab/recipes/x.toml")

The file is Markdown. Exactly one fenced code block whose info string is `toml ratchet` holds the
header; everything outside it is the goal, handed to proposers verbatim. A fence inside another fence
(a ```` example, say) does not count. The header (all tables but [run] optional):

    metric = "val_loss"       # kind "fp4lab": a summary.json key, see FP4LAB_METRICS; "command": a label
    direction = "minimize"    # or "maximize"
    [run]                     # kind = "fp4lab": base = {TrainConfig fields, data = {DataConfig fields}},
                              #   steps and/or minutes per run (not in base: they are the budget)
                              # kind = "command": command = [argv], metric_regex (>= 1 group; the last
                              #   match in stdout+stderr wins), timeout_minutes, env = {KEY = "value"}
    [health]                  # no_nan, entropy_floor, max_logit (absent: the log scanner's defaults),
                              #   require_verdict = ["converged"]
    [edit]                    # files = glob patterns a diff proposal may touch
    [search_space]            # name = {type = "float"|"int"|"categorical", low, high, log, choices}
    [stop]                    # iterations, target, plateau
    [noise]                   # seeds, rule = "sigma"|"paired", k, confidence
    [slurm]                   # as in a sweep spec: where --executor slurm runs each experiment
    pruner = "median"         # the optuna proposer's early stopping (fp4lab.train.pruning), kind "fp4lab"
                              #   with a validation-loss metric only; default "none"

Edit patterns are relative to the repo root: `*` and `?` match within one path component and `**`
across components (`fp4lab/**/*.py`). A path that is absolute, has an empty, `.` or `..` component, or
lies under a `.git` folder never matches, whatever the patterns say.

Every error is one line: the file, the key (`[run].kind`, `[search_space].lr.low`) and the fix. This
module does not import torch; validating a kind = "fp4lab" run imports fp4lab.train.config (and torch)
inside the call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.lab.records.logscan import VERDICTS
from fp4lab.lab.specs.search_space import SearchParam, probe_values, search_param
from fp4lab.lab.specs.sweep_spec import SlurmSpec, slurm_table
from fp4lab.train.config import ConfigError, DataConfig, TrainConfig
from fp4lab.train.pruning import pruner_settings, pruning_problem
from fp4lab.validation import (
    boolean,
    checked_table,
    choice,
    entry,
    integer,
    known_keys,
    list_of,
    number,
    string,
    table_of,
)

# metric names a kind = "fp4lab" program may give -> the summary.json key the run writes.
FP4LAB_METRICS = {
    "final_val_loss": "final_val_loss",
    "val_loss": "final_val_loss",
    "best_val_loss": "best_val_loss",
    "final_train_loss": "final_train_loss",
    "final_loss": "final_train_loss",  # the earlier name
    "best_train_loss": "best_train_loss",
    "best_loss": "best_train_loss",  # the earlier name
    "tokens_per_s": "tokens_per_s",
}
KINDS = ("fp4lab", "command")
DIRECTIONS = ("minimize", "maximize")
TOP_KEYS = ("metric", "direction", "run", "health", "edit", "search_space", "stop", "noise", "slurm", "pruner")
# The per-run budget is [run].steps / [run].minutes, so that every run gets the same one.
BUDGET_FIELDS = {"steps": "[run].steps", "max_minutes": "[run].minutes"}
# Searching over these would compare runs that measure different things (another seed is noise,
# another budget is not the same experiment) or fight the loop, which chooses out_dir itself.
NOT_SEARCHABLE = ("seed", "steps", "max_minutes", "out_dir", "data")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ProgramError(ValueError):
    """A program.md that does not validate: one line naming the file, the key and the fix."""


@dataclass(frozen=True, kw_only=True)
class RunTarget:
    kind: str = entry(choice(KINDS))
    base: dict[str, Any] = entry(table_of(), {})
    steps: int | None = entry(integer(minimum=1), None)
    minutes: float | None = entry(number(positive=True, wants="a number of minutes > 0"), None)
    command: tuple[str, ...] | None = entry(list_of(string()), None)
    metric_regex: str | None = entry(string(), None)
    timeout_minutes: float | None = entry(number(positive=True, wants="a number of minutes > 0, e.g. 10"), None)
    env: dict[str, str] = entry(table_of(string()), {})


@dataclass(frozen=True, kw_only=True)
class Health:
    no_nan: bool = entry(boolean(), True)
    entropy_floor: float | None = entry(number(positive=False).hinted("leave it out for the scanner's default"), None)
    max_logit: float | None = entry(number(positive=False).hinted("leave it out for the scanner's default"), None)
    require_verdict: tuple[str, ...] = entry(list_of(string()), ("converged",))


@dataclass(frozen=True, kw_only=True)
class StopRules:
    iterations: int | None = entry(integer(minimum=1).hinted("leave it out for no limit"), None)
    target: float | None = entry(number(), None)
    plateau: int | None = entry(integer(minimum=1).hinted("leave it out for no limit"), None)


@dataclass(frozen=True, kw_only=True)
class NoiseGate:
    seeds: int = entry(integer(minimum=1).hinted("1 turns the noise gate off"), 1)
    rule: str = entry(choice(("sigma", "paired")), "sigma")
    k: float = entry(number(positive=False), 2.0)
    confidence: float = entry(number(positive=True, below=1, wants="between 0 and 1, e.g. 0.95"), 0.95)


@dataclass(frozen=True, kw_only=True)
class _Edit:
    files: tuple[str, ...] = entry(list_of(string()), ())


@dataclass(frozen=True)
class Program:
    path: Path
    goal: str
    metric: str
    direction: str
    run: RunTarget
    health: Health
    edit_files: tuple[str, ...]
    search_space: dict[str, SearchParam]
    stop: StopRules
    noise: NoiseGate
    header: dict[str, Any]
    slurm: SlurmSpec = SlurmSpec()  # where `fp4lab ratchet --executor slurm` runs each experiment
    pruner: dict[str, Any] = dataclasses.field(default_factory=lambda: {"type": "none"})  # the optuna proposer's

    def improvement(self, new: float, old: float) -> float:
        """How much better `new` is than `old`: positive = better, in metric units."""
        return old - new if self.direction == "minimize" else new - old

    def better(self, a: float, b: float) -> bool:
        """a strictly better than b. NaN compares as never better (nan > 0 is False)."""
        return self.improvement(a, b) > 0

    def editable(self, path: str) -> bool:
        """May a diff touch this repo-relative posix path?"""
        if not safe_relative_path(path):
            return False
        return any(_glob(pattern).fullmatch(path) for pattern in self.edit_files)


# ---------------------------------------------------------------------------------------------- load


def load_program(path: str | Path) -> Program:
    """Read and validate program.md; raises ProgramError (one line) on any problem."""
    path = Path(path)
    if not path.is_file():
        raise ProgramError(f"{path}: does not exist; write the goal and a ```toml ratchet block there")
    try:
        text = path.read_text()
    except UnicodeDecodeError as exc:
        raise ProgramError(f"{path}: not UTF-8 text: {exc}") from None
    return parse_program(text, path)


def parse_program(text: str, path: str | Path = "program.md") -> Program:
    path = Path(path)

    def fail(where: str, message: str) -> ProgramError:
        return ProgramError(f"{path}: {where}: {message}")

    goal, header = _header(text, path)
    known_keys(header, TOP_KEYS, "", fail)
    _require(header, fail)
    direction = choice(DIRECTIONS).check("direction", header["direction"], fail)
    run = checked_table(RunTarget, header["run"], "[run]", fail)
    metric = _metric(header["metric"], run, fail)
    search_space = _search_space(header.get("search_space", {}), fail)
    if run.kind == "fp4lab":
        _check_fp4lab(run, set(header["run"]), search_space, fail)
    else:
        _check_command(run, set(header["run"]), fail)
    health = _health(header.get("health", {}), fail)
    edit_files = _edit_files(header.get("edit", {}), fail)
    stop = checked_table(StopRules, header.get("stop", {}), "[stop]", fail)
    noise = _noise(header.get("noise", {}), fail)
    slurm = _slurm(header.get("slurm", {}), fail)
    pruner = pruner_settings(header.get("pruner", "none"), "pruner", fail)
    if pruner["type"] != "none":
        problem = pruning_problem(metric if run.kind == "fp4lab" else None, direction)
        if problem:
            raise fail("pruner", problem + " (or leave pruner out)")
    return Program(path=path, goal=goal, metric=metric, direction=direction, run=run, health=health,
                   edit_files=edit_files, search_space=search_space, stop=stop, noise=noise, header=header,
                   slurm=slurm, pruner=pruner)


def metric_from_output(text: str, regex: str) -> float | None:
    """Group 1 of the last match of `regex` (multiline) in `text`, as a finite float; else None."""
    matches = list(re.finditer(regex, text, re.MULTILINE))
    if not matches or matches[-1].group(1) is None:
        return None
    try:
        value = float(matches[-1].group(1))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


# ------------------------------------------------------------------------------- the header's parts


def _header(text: str, path: Path) -> tuple[str, dict[str, Any]]:
    """(goal prose, the ```toml ratchet block's table)."""
    goal, block, first_line = _split(text, path)
    try:
        return goal, tomllib.loads(block)
    except tomllib.TOMLDecodeError as exc:
        # tomllib counts lines from the start of the block; point at the line of program.md instead.
        message = re.sub(r"at line (\d+)", lambda m: f"at line {int(m[1]) + first_line}", str(exc))
        raise ProgramError(f"{path}: the ```toml ratchet block is not valid TOML: {message}; fix that line") from None


def _require(header: dict[str, Any], fail) -> None:
    """metric, direction and [run] with its kind: the keys without a default."""
    for key in ("metric", "direction", "run"):
        if key not in header:
            example = {"metric": 'metric = "val_loss"', "direction": 'direction = "minimize"',
                       "run": '[run] with kind = "fp4lab" or "command"'}[key]
            raise fail(key, f"missing; add {example}")
    if isinstance(header["run"], dict) and "kind" not in header["run"]:
        raise fail("[run].kind", "missing; add kind = \"fp4lab\" (a training run of this repo) "
                   "or \"command\" (any program)")


def _metric(metric: Any, run: RunTarget, fail) -> str:
    """The summary.json key an fp4lab run's metric names, or the label of a command's number."""
    if run.kind == "fp4lab":
        if not isinstance(metric, str) or metric not in FP4LAB_METRICS:
            raise fail("metric", f"{metric!r} is not a summary key of an fp4lab run; "
                       f"allowed: {', '.join(FP4LAB_METRICS)}")
        return FP4LAB_METRICS[metric]
    if not isinstance(metric, str) or not metric.strip() or not metric.isprintable():
        raise fail("metric", f"{metric!r} must be a name for the command's number, e.g. \"score\"")
    return metric


def _search_space(space: Any, fail) -> dict[str, SearchParam]:
    if not isinstance(space, dict):
        raise fail("[search_space]", "must be a table: name = {type = ..., low, high} "
                   "or {type = \"categorical\", choices = [...]}")
    return {name: search_param(f"[search_space].{name}", param, fail) for name, param in space.items()}


def _health(table: Any, fail) -> Health:
    health = checked_table(Health, table, "[health]", fail)
    for verdict in health.require_verdict:
        if verdict not in VERDICTS:
            raise fail("[health].require_verdict",
                       f"{verdict!r} is not a scanner verdict; allowed: {', '.join(VERDICTS)}")
    if not health.require_verdict:
        raise fail("[health].require_verdict",
                   "is empty; list the verdicts that count as healthy, e.g. [\"converged\"]")
    return health


def _edit_files(table: Any, fail) -> tuple[str, ...]:
    edit = checked_table(_Edit, table, "[edit]", fail)
    for i, pattern in enumerate(edit.files):
        if not safe_relative_path(pattern.replace("**", "x")):
            raise fail(f"[edit].files[{i}]", f"{pattern!r} must be a pattern relative to the repo root, without "
                       "'..', '.' or empty components and outside .git, e.g. \"fp4lab/recipes/*.toml\"")
    return edit.files


def _noise(table: Any, fail) -> NoiseGate:
    noise = checked_table(NoiseGate, table, "[noise]", fail)
    if noise.rule == "paired" and noise.seeds < 2:
        raise fail("[noise].rule", "\"paired\" compares a proposal with the baseline seed by seed; set seeds >= 2")
    return noise


def _slurm(table: Any, fail) -> SlurmSpec:
    slurm = slurm_table(table, fail, "[slurm]")
    if slurm.ranks > 1:  # each experiment is one submitit task, one process
        raise fail("[slurm]", f"{slurm.ranks_text()} gives each experiment {slurm.ranks} ranks; the ratchet trains "
                              "one process per experiment: leave gpus_per_node, ntasks_per_node and nodes at 1")
    return slurm


# ----------------------------------------------------------------------------------------- helpers


def _split(text: str, path: Path) -> tuple[str, str, int]:
    """(goal prose, block text, 1-based line of the opening fence) for the one ```toml ratchet block."""
    lines = text.splitlines()
    blocks, outer = [], None  # outer: (fence char, length, start index, is ratchet) of the open fence
    for i, line in enumerate(lines):
        match = FENCE.match(line)
        if not match:
            continue
        fence, info = match[1], match[2].strip()
        if outer is None:
            outer = (fence[0], len(fence), i, fence[0] == "`" and info.split() == ["toml", "ratchet"])
        elif fence[0] == outer[0] and len(fence) >= outer[1] and not info:
            if outer[3]:
                blocks.append((outer[2], i))
            outer = None
    if outer is not None and outer[3]:
        raise ProgramError(f"{path}:{outer[2] + 1}: the ```toml ratchet block is never closed; end it with a ``` line")
    if not blocks:
        raise ProgramError(f"{path}: found no ```toml ratchet block; add one with metric, direction and [run]")
    if len(blocks) > 1:
        lines_at = ", ".join(str(start + 1) for start, _ in blocks)
        raise ProgramError(f"{path}: found {len(blocks)} ```toml ratchet blocks (lines {lines_at}); keep exactly one")
    start, end = blocks[0]
    goal = re.sub(r"\n{3,}", "\n\n", "\n".join(lines[:start] + lines[end + 1:])).strip()
    return goal, "\n".join(lines[start + 1:end]), start + 1


def _check_fp4lab(run: RunTarget, given: set[str], search_space: dict[str, SearchParam], fail) -> None:
    """A kind = "fp4lab" run: [run].base a valid TrainConfig without the budget and out_dir, a budget,
    and a search space of TrainConfig fields whose bounds (or choices) each give a valid config."""
    for key in ("command", "metric_regex", "timeout_minutes", "env"):
        if key in given:
            raise fail(f"[run].{key}", "only applies to kind = \"command\"; remove it or set kind = \"command\"")
    train_fields = [f.name for f in dataclasses.fields(TrainConfig)]
    data_fields = [f.name for f in dataclasses.fields(DataConfig)]
    known_keys(run.base, train_fields, "[run].base", fail)
    if "data" in run.base:
        if not isinstance(run.base["data"], dict):
            raise fail("[run].base.data",
                       "must be a table of DataConfig fields, e.g. data = { source = \"synthetic\" }")
        known_keys(run.base["data"], data_fields, "[run].base.data", fail)
    if "out_dir" in run.base:
        raise fail("[run].base.out_dir", "is chosen by the ratchet for every run; remove it")
    for key, budget in BUDGET_FIELDS.items():
        if key in run.base:
            raise fail(f"[run].base.{key}", f"the per-run budget is {budget}; move it there")
    if run.steps is None and run.minutes is None:
        raise fail("[run]", "kind = \"fp4lab\" needs a budget: steps = N and/or minutes = M per run")
    _check_run_config(run, {}, "[run].base", fail)
    for name, p in search_space.items():
        where = f"[search_space].{name}"
        field_name = name.removeprefix("data.")
        known = data_fields if name.startswith("data.") else train_fields
        if name in NOT_SEARCHABLE or field_name not in known:
            why = ("is not searchable: seed is the noise gate's, steps/max_minutes are the fixed budget, "
                   "out_dir is the loop's" if name in NOT_SEARCHABLE
                   else "is not a TrainConfig field (or data.<DataConfig field>)")
            searchable = [f for f in train_fields if f not in NOT_SEARCHABLE] + [f"data.{f}" for f in data_fields]
            raise fail(where, f"{why}; allowed: {', '.join(searchable)}")
        for value in probe_values(p):
            _check_run_config(run, {name: value}, where, fail)


def _check_run_config(run: RunTarget, params: dict[str, Any], where: str, fail) -> None:
    """The TrainConfig of one experiment (base, budget, then params; `data.x` keys go into the data
    table) validates, and so does its recipe."""
    from fp4lab.nn.recipe import RecipeError, load_recipe

    values = {**run.base, "data": dict(run.base.get("data", {})), "max_minutes": run.minutes}
    if run.steps is not None:
        values["steps"] = run.steps
    for key, value in params.items():
        if key.startswith("data."):
            values["data"][key[5:]] = value
        else:
            values[key] = value
    try:
        config = TrainConfig.from_dict(values, "config")
        load_recipe(config.recipe)
    except (ConfigError, RecipeError) as exc:
        raise fail(where, str(exc).removeprefix("config: ")) from None


def _check_command(run: RunTarget, given: set[str], fail) -> None:
    """A kind = "command" run: an argv, a regex with a group for the metric, a time cap, env names."""
    for key in ("base", "steps", "minutes"):
        if key in given:
            raise fail(f"[run].{key}", "only applies to kind = \"fp4lab\"; remove it or set kind = \"fp4lab\"")
    if not run.command or not all(arg and "\0" not in arg for arg in run.command):
        raise fail("[run].command", "must be a non-empty list of non-empty strings (argv, no shell), "
                   "e.g. [\"python\", \"bench.py\"]")
    if run.metric_regex is None:
        raise fail("[run].metric_regex", "missing; add a regex whose first group captures the metric, "
                   "e.g. '^score:\\s*([-+0-9.eE]+)'")
    try:
        groups = re.compile(run.metric_regex, re.MULTILINE).groups
    except re.error as exc:
        raise fail("[run].metric_regex", f"{run.metric_regex!r} does not compile: {exc}") from None
    if groups < 1:
        raise fail("[run].metric_regex", f"{run.metric_regex!r} has no capture group; wrap the number in ( )")
    if run.timeout_minutes is None:
        raise fail("[run].timeout_minutes", "missing; every run is capped: add timeout_minutes = a number of minutes > 0, e.g. 10")
    for key in run.env:
        if not ENV_NAME.match(key):
            raise fail(f"[run].env.{key}", "is not an environment variable name (letters, digits, _)")


def safe_relative_path(path: str) -> bool:
    """A plain repo-relative posix path: not absolute, no empty, `.` or `..` component, nothing under .git."""
    if not isinstance(path, str) or not path or path.startswith("/") or "\\" in path or not path.isprintable():
        return False
    parts = path.split("/")
    return not any(part in ("", ".", "..") or part.lower() == ".git" for part in parts)


@functools.lru_cache(maxsize=256)
def _glob(pattern: str) -> re.Pattern:
    """Glob pattern -> regex: `*`, `?`, `[...]` within one component, `**` across components."""
    out, i = [], 0
    while i < len(pattern):
        char = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:[^/]+/)*")
            i += 3
            continue
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[" and (end := pattern.find("]", i + 2)) != -1:
            body = pattern[i + 1:end]
            body = "^" + body[1:] if body.startswith("!") else body
            out.append("(?!/)[" + body.replace("\\", "\\\\") + "]")
            i = end + 1
            continue
        else:
            out.append(re.escape(char))
        i += 1
    return re.compile("".join(out))


__all__ = [
    "FP4LAB_METRICS", "Health", "NoiseGate", "Program", "ProgramError", "RunTarget", "StopRules",
    "load_program", "metric_from_output", "parse_program", "safe_relative_path",
]
