"""Proposers for `fp4lab ratchet`: where the next change to try comes from, and the checks every
proposed change passes before the loop may apply it.

A proposal is ONE change, as a JSON object:

    {"params": {"lr": 0.01, "recipe": "nvfp4"}, "rationale": "..."}   # values for [search_space] keys
    {"diff": "<unified diff, git format>", "rationale": "..."}       # an edit of [edit].files

Proposers (`propose(context) -> Proposal`, `observe(proposal, value, healthy)`):

- OptunaProposer: TPE over [search_space]; its state is an optuna journal file, so a killed loop resumes
  (`pending_trial()` / `resume_trial(n)`).
- LLMProposer: any OpenAI-compatible chat endpoint (vLLM, llama.cpp, ollama, OpenAI). The context goes
  in the user message as JSON; the answer must be one proposal object.
- CommandProposer: any program; it reads the context JSON on stdin and prints a proposal on stdout.

Safety rules, enforced here whatever the proposer:

- Agent text is data, never code. Nothing from an answer runs or reaches a shell: a diff only goes to
  `git apply` (argv list, diff on stdin) after validate_proposal has asked git which paths it touches
  (rename and copy sources included, which `--numstat` leaves out). Every path must match [edit].files,
  be relative without `..` and outside .git, and not go through a symlink in the tree; symlink and
  submodule modes and binary patches are refused; `git apply --check` must pass on the tree.
- Params must be [search_space] keys with in-range values of the declared type (bools are not ints).
- The API key goes to the OpenAI client only: it is not in the proposer's repr, in any error message or
  in any log line (an error text that would contain it is redacted).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fp4lab.lab import repo
from fp4lab.lab.choices import PROPOSERS
from fp4lab.lab.specs import search_space
from fp4lab.lab.specs.program import Program, safe_relative_path
from fp4lab.validation import did_you_mean

MAX_DIFF_BYTES = 200 * 1024
MAX_FILES_BYTES = 100_000
MAX_RATIONALE = 300
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
# Extended-header lines that carry a file mode; 120000 is a symlink, 160000 a submodule (gitlink).
MODE_LINE = re.compile(r"^(?:new file mode|deleted file mode|old mode|new mode|index \S+) (\d{6})\s*$", re.MULTILINE)
# Rename/copy sources: git apply --numstat names only the destination.
SOURCE_LINE = re.compile(r"^(?:rename|copy) (?:from|to|old|new) (.*)$", re.MULTILINE)
NUMSTAT = re.compile(r"^(\d+|-)\t(\d+|-)\t(.*)$", re.DOTALL)
FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*?)\n[ \t]*```", re.DOTALL)

SYSTEM_PROMPT = """\
You propose ONE change for an automated research loop (fp4lab ratchet). Each change is tested by a \
capped experiment and kept only if the metric strictly improves and the run stays healthy.

The user message is JSON: goal (what to achieve, in words), metric and direction, search_space (the \
parameters you may set, with their ranges or choices), edit_files (glob patterns of the files you may \
edit), files (their current text), history (recent attempts: proposal, metric, status keep/discard/crash, \
rationale), best and current_params.

Answer with ONE JSON object and nothing else, either
  {"params": {"<search_space key>": <value>, ...}, "rationale": "<one line>"}
with values inside the given ranges or choices, or
  {"diff": "<unified diff in git format, paths a/<path> and b/<path>>", "rationale": "<one line>"}
touching only files that match edit_files.

Learn from the history: do not repeat a change that was discarded or crashed; prefer one small, testable \
change. Never write shell commands: nothing you write is executed."""


class ProposalError(ValueError):
    """A proposal that fails validation; one line saying why. The loop logs it and moves on."""


class AgentError(RuntimeError):
    """A proposer that could not answer (timeout, connection, exit code); one line, no secrets."""


@dataclass(frozen=True)
class Proposal:
    kind: str  # "params" | "diff"
    params: dict[str, Any]  # search-space values for kind="params"; {} for a diff
    diff: str | None  # unified diff for kind="diff"
    rationale: str  # one line
    source: str  # "optuna" | "llm" | "command"
    trial: int | None = None  # optuna trial number
    paths: tuple[str, ...] = ()  # the paths the diff touches, as approved by validate_proposal

    def fingerprint(self) -> str:
        """sha256 over what the change is (kind, params, diff), not who proposed it or why."""
        change = {"kind": self.kind, "params": self.params, "diff": _normalise_diff(self.diff) if self.diff else None}
        text = json.dumps(change, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class Context:
    """What a proposer sees. `root` is the tree a diff must apply to (default: program.md's folder)."""

    program: Program
    files: dict[str, str] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    best: dict = field(default_factory=dict)
    current_params: dict = field(default_factory=dict)
    root: Path | None = None

    def tree(self) -> Path:
        return Path(self.root) if self.root is not None else self.program.path.resolve().parent

    def to_json(self) -> dict[str, Any]:
        program = self.program
        return _jsonable({
            "goal": program.goal,
            "metric": program.metric,
            "direction": program.direction,
            "search_space": {name: p.as_table() for name, p in program.search_space.items()},
            "edit_files": list(program.edit_files),
            "files": self.files,
            "history": self.history,
            "best": self.best,
            "current_params": self.current_params,
        })


# -------------------------------------------------------------------------------------- validation


def validate_proposal(raw: Any, program: Program, repo_root: Path, source: str) -> Proposal:
    """Check a proposal object (see the module docstring) against program.md and the tree at repo_root."""
    if not isinstance(raw, dict):
        raise ProposalError(f"a proposal is a JSON object with params or diff, and rationale; got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"params", "diff", "rationale"})
    if unknown:
        raise ProposalError(f"unknown key(s) {', '.join(map(repr, unknown))}; "
                            "a proposal has params or diff, and rationale")
    if ("params" in raw) == ("diff" in raw):
        raise ProposalError("give exactly one of params (search-space values) and diff (a unified diff)")
    rationale = raw.get("rationale", "")
    if not isinstance(rationale, str):
        raise ProposalError(f"rationale must be a string, got {type(rationale).__name__}")
    rationale = " ".join("".join(c if c.isprintable() else " " for c in rationale).split())[:MAX_RATIONALE]
    if "params" in raw:
        params = _check_params(raw["params"], program)
        return Proposal(kind="params", params=params, diff=None, rationale=rationale, source=source)
    diff = raw["diff"]
    if not isinstance(diff, str) or not diff.strip():
        raise ProposalError("diff must be a non-empty string holding a unified diff")
    diff = _normalise_diff(diff)
    if len(diff.encode()) > MAX_DIFF_BYTES:
        raise ProposalError(f"diff is {len(diff.encode())} bytes; the limit is {MAX_DIFF_BYTES}")
    paths = _touched_paths(diff, Path(repo_root))
    for path in paths:
        if not program.editable(path):
            allowed = ", ".join(program.edit_files) or "nothing ([edit].files is empty)"
            raise ProposalError(f"diff touches {path!r}; [edit].files allows only {allowed}")
    # --recount (here and in every git apply): models often miscount the lines in a hunk header.
    _git(Path(repo_root), ["apply", "--recount", "--check", "-"], diff, "diff does not apply to the current tree")
    return Proposal(kind="diff", params={}, diff=diff, rationale=rationale, source=source, paths=paths)


def apply_proposal(proposal: Proposal, worktree: Path) -> None:
    """Apply a validated diff in `worktree` (params are the loop's to write). The paths are checked again
    in this tree and must be the ones validate_proposal approved."""
    if proposal.kind != "diff":
        return
    paths = _touched_paths(proposal.diff or "", Path(worktree))
    unapproved = sorted(set(paths) - set(proposal.paths))
    if unapproved:
        raise ProposalError(f"diff touches {', '.join(unapproved)}, which validate_proposal did not approve")
    _git(Path(worktree), ["apply", "--recount", "-"], proposal.diff, "diff does not apply to the worktree")


def editable_files(program: Program, root: Path, max_bytes: int = MAX_FILES_BYTES) -> dict[str, str]:
    """The current text of the tracked files a diff may touch, path -> text, in path order until
    max_bytes (UTF-8) are used; binary, non-UTF-8 and symlinked files are left out."""
    listing = _git(Path(root), ["ls-files", "-z"], "", "git ls-files failed")
    files, used = {}, 0
    for path in sorted(p for p in listing.split("\0") if p):
        full = Path(root) / path
        if not program.editable(path) or _through_symlink(Path(root), path) or not full.is_file():
            continue
        try:
            text = full.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        size = len(text.encode())
        if "\0" in text or used + size > max_bytes:
            continue
        files[path] = text
        used += size
    return files


def _check_params(params: Any, program: Program) -> dict[str, Any]:
    if not isinstance(params, dict) or not params:
        raise ProposalError("params must be a non-empty object of search-space values")
    allowed = ", ".join(program.search_space) or "none ([search_space] is empty; propose a diff)"
    unknown = [name for name in params if name not in program.search_space]
    if unknown:
        hints = "".join(did_you_mean(name, program.search_space) for name in unknown)
        raise ProposalError(f"params {', '.join(map(repr, unknown))}: not [search_space] key(s){hints}; allowed: {allowed}")
    checked = {}
    for name, value in params.items():
        try:
            checked[name] = search_space.checked_value(f"params.{name}", value, program.search_space[name])
        except ValueError as exc:
            raise ProposalError(str(exc)) from None
    return checked


def _touched_paths(diff: str, root: Path) -> tuple[str, ...]:
    """Every path the diff would create, change or delete, by git's own reading of it; raises on an
    unsafe path or mode."""
    for mode in MODE_LINE.findall(diff):
        if mode in ("120000", "160000"):
            raise ProposalError("diff creates a symlink or a submodule; only regular files may be edited")
    listing = _git(root, ["apply", "--recount", "--numstat", "-z", "-"], diff, "not a valid diff")
    paths, pending = [], 0
    for token in listing.split("\0"):
        match = NUMSTAT.match(token)
        if pending:  # the `added\tdeleted\t\0old\0new\0` form of a rename
            paths.append(token)
            pending -= 1
        elif match and match[3]:
            if match[1] == "-":
                raise ProposalError(f"diff has a binary patch for {match[3]!r}; only text edits are accepted")
            paths.append(match[3])
        elif match:
            pending = 2
    for source in SOURCE_LINE.findall(diff):
        if source.startswith('"'):
            raise ProposalError(f"diff renames or copies the quoted path {source}; use plain file names")
        paths.append(source.rstrip())
    if not paths:
        raise ProposalError("diff changes no file")
    for path in paths:
        if not safe_relative_path(path):
            raise ProposalError(f"diff touches {path!r}: paths must be relative to the repo root, without '..', "
                                "and outside .git")
        if _through_symlink(root, path):
            raise ProposalError(f"diff touches {path!r}, which is or goes through a symlink in the tree")
    return tuple(dict.fromkeys(paths))


def _through_symlink(root: Path, path: str) -> bool:
    parts = path.split("/")
    return any((root.joinpath(*parts[:i])).is_symlink() for i in range(1, len(parts) + 1))


def _git(root: Path, args: list[str], stdin: str, what: str) -> str:
    try:
        return repo.git(root, *args, stdin=stdin, strip=False)
    except repo.GitError as exc:
        raise ProposalError(f"{what}: {exc.reason}") from None


def _normalise_diff(diff: str) -> str:
    # git apply needs the final newline; models often add blank lines around the diff.
    return diff.strip("\n") + "\n"


# --------------------------------------------------------------------------------------- proposers


class Proposer(Protocol):
    """What the ratchet asks of a proposer. `unrecorded` and `observe_again` let a proposer that keeps
    its own state (a study) recover after the ratchet died between asking, recording and telling."""

    def propose(self, context: Context) -> Proposal: ...

    def observe(self, proposal: Proposal, value: float | None, healthy: bool, pruned: bool = False) -> None: ...

    def unrecorded(self, recorded_trials: set[int]) -> Proposal | None:
        """A proposal made before a crash that no iteration records (to run now), if any."""

    def observe_again(self, trial: int, value: float | None, healthy: bool, pruned: bool = False) -> None:
        """Repeat the outcome of an iteration whose telling a crash may have cut off (idempotent)."""


class StatelessProposer:
    """A proposer that learns only from the context it is given: nothing to recover after a crash."""

    def unrecorded(self, recorded_trials: set[int]) -> Proposal | None:
        return None

    def observe_again(self, trial: int, value: float | None, healthy: bool, pruned: bool = False) -> None:
        pass

    def observe(self, proposal: Proposal, value: float | None, healthy: bool, pruned: bool = False) -> None:
        """Nothing to learn here: the history reaches the proposer through the context."""


class OptunaProposer:
    """TPE over [search_space]; the study lives in an optuna journal file (JournalFileBackend)."""

    def __init__(self, program: Program, storage_path: Path, study_name: str, seed: int = 0):
        if not program.search_space:
            raise ValueError(f"{program.path}: the optuna proposer needs a [search_space]; "
                             "add one or use another proposer")
        self.program, self.seed, self.study_path = program, seed, Path(storage_path)
        self.study = search_space.open_study(study_name, storage_path, direction=program.direction, seed=seed,
                                             pruner=program.pruner)

    def propose(self, context: Context) -> Proposal:
        # A fresh process would replay the seeded sampler from its first draw and propose the same
        # start-up points again; seeding with the number of trials so far continues the sequence.
        self.study.sampler = search_space.sampler(self.seed, len(self.study.get_trials(deepcopy=False)))
        trial = self.study.ask()
        params = search_space.suggest(trial, self.program.search_space)
        return self._proposal(trial.number, params)

    def observe(self, proposal: Proposal, value: float | None, healthy: bool, pruned: bool = False) -> None:
        if proposal.trial is not None:
            self.tell_trial(proposal.trial, value, healthy, pruned)

    def unrecorded(self, recorded_trials: set[int]) -> Proposal | None:
        orphan = self.pending_trial(in_flight=recorded_trials)
        return None if orphan is None else self.resume_trial(orphan)

    def observe_again(self, trial: int, value: float | None, healthy: bool, pruned: bool = False) -> None:
        self.tell_trial(trial, value, healthy, pruned)

    def tell_trial(self, number: int, value: float | None, healthy: bool, pruned: bool = False) -> None:
        """Complete trial `number` with `value`, prune it (its run stopped by the pruner), or fail it
        (unhealthy, crashed, NaN). Telling a finished trial again is a no-op, so a resumed loop may
        repeat its last tell."""
        from optuna.trial import TrialState

        if pruned:
            self.study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)
        elif healthy and value is not None and math.isfinite(value):
            self.study.tell(number, value, skip_if_finished=True)
        else:
            self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)

    def pending_trial(self, in_flight: set[int] = frozenset()) -> int | None:
        """The oldest RUNNING trial, left by a process that died between ask and tell, other than the
        `in_flight` ones (still being run by their caller). A trial that died before all its parameters
        were sampled was never proposed and is failed here."""
        from optuna.trial import TrialState

        for trial in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            if trial.number in in_flight:
                continue
            if set(trial.params) >= set(self.program.search_space):
                return trial.number
            self.study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
        return None

    def resume_trial(self, number: int) -> Proposal:
        """The proposal of trial `number` again, from the parameters the journal holds."""
        trials = [t for t in self.study.get_trials(deepcopy=False) if t.number == number]
        if not trials or not set(trials[0].params) >= set(self.program.search_space):
            raise ValueError(f"optuna trial {number} does not exist or has no complete parameters; use pending_trial()")
        return self._proposal(number, {name: trials[0].params[name] for name in self.program.search_space})

    def _proposal(self, number: int, params: dict[str, Any]) -> Proposal:
        # The study's trial number stays in the record (to resume it) but out of the text a person reads:
        # trials count from 0 and iterations from 1 (0 is the baseline), so one numbering is shown.
        return Proposal(kind="params", params=params, diff=None, rationale="optuna TPE", source="optuna", trial=number)


class LLMProposer(StatelessProposer):
    """One chat completion per proposal from an OpenAI-compatible server (`openai` package)."""

    def __init__(self, program: Program, base_url: str, model: str, api_key: str | None, timeout_s: float = 60,
                 max_retries: int = 2, temperature: float = 0.7):
        import openai

        self.program, self.base_url, self.model = program, base_url, model
        self.timeout_s, self.max_retries, self.temperature = timeout_s, max_retries, temperature
        self._api_key = api_key  # only to redact error texts; never shown
        self._json_mode = True
        self._client = openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout_s,
                                     max_retries=max_retries)

    def __repr__(self) -> str:
        return f"LLMProposer(base_url={self.base_url!r}, model={self.model!r})"

    def propose(self, context: Context) -> Proposal:
        messages = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": json.dumps(context.to_json(), ensure_ascii=False)},
        ]
        answer = self._complete(messages)
        return validate_proposal(_parse_answer(answer, "llm answer"), self.program, context.tree(), "llm")

    def _complete(self, messages: list[dict]) -> str:
        import openai

        where = f"llm {self.model!r} at {self.base_url}"
        create = self._client.chat.completions.create
        request = {"model": self.model, "messages": messages, "temperature": self.temperature}
        try:
            try:
                if self._json_mode:
                    response = create(**request, response_format={"type": "json_object"})
                else:
                    response = create(**request)
            except openai.BadRequestError:
                if not self._json_mode:
                    raise
                # Some local servers reject response_format; ask once more without it and, if that
                # works, stop sending it.
                response = create(**request)
                self._json_mode = False
        except openai.APITimeoutError:
            raise AgentError(f"{where}: no answer within {self.timeout_s:g} s "
                             f"({self.max_retries + 1} attempts)") from None
        except openai.APIConnectionError as exc:
            message = f"{where}: cannot connect ({self.max_retries + 1} attempts): {exc}"
            raise AgentError(self._redact(message)) from None
        except openai.APIStatusError as exc:
            raise AgentError(self._redact(f"{where}: HTTP {exc.status_code}: {_last_line(str(exc.message))}")) from None
        if not response.choices or not response.choices[0].message.content:
            raise ProposalError(f"{where}: the answer is empty")
        return response.choices[0].message.content

    def _redact(self, text: str) -> str:
        return text.replace(self._api_key, "***") if self._api_key else text


class CommandProposer(StatelessProposer):
    """Runs a program (argv, no shell) with the context JSON on stdin; its stdout is the proposal."""

    def __init__(self, program: Program, argv: list[str] | str, timeout_s: float = 300, cwd: Path | None = None):
        self.program = program
        self.argv = shlex.split(argv) if isinstance(argv, str) else [str(a) for a in argv]
        if not self.argv:
            raise ValueError("the proposer command is empty; give a program and its arguments")
        self.timeout_s, self.cwd = timeout_s, cwd

    def propose(self, context: Context) -> Proposal:
        name = f"proposer command {self.argv[0]!r}"
        try:
            # A session of its own, so a timeout kills the command's children too.
            process = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       cwd=self.cwd, start_new_session=True, encoding="utf-8", errors="replace")
        except OSError as exc:
            raise AgentError(f"{name} cannot start: {exc.strerror or exc}") from None
        try:
            stdout, stderr = process.communicate(json.dumps(context.to_json(), ensure_ascii=False),
                                                 timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            raise AgentError(f"{name} gave no proposal within {self.timeout_s:g} s; it was killed") from None
        if process.returncode != 0:
            raise AgentError(f"{name} exited with code {process.returncode}: {_last_line(stderr) or 'no stderr'}")
        return validate_proposal(_parse_answer(stdout, f"{name} output"), self.program, context.tree(), "command")


def llm_proposer_from_env(program: Program, base_url: str | None = None, model: str | None = None,
                          api_key: str | None = None, **options: Any) -> LLMProposer:
    """An LLMProposer with the gaps filled from the environment: FP4LAB_LLM_BASE_URL / OPENAI_BASE_URL
    (default http://127.0.0.1:8000/v1), FP4LAB_LLM_MODEL, FP4LAB_LLM_API_KEY / OPENAI_API_KEY."""
    env = os.environ
    base_url = base_url or env.get("FP4LAB_LLM_BASE_URL") or env.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    model = model or env.get("FP4LAB_LLM_MODEL")
    if not model:
        raise ValueError(f"no LLM model given: name one, or set FP4LAB_LLM_MODEL to a model {base_url} serves")
    api_key = api_key or env.get("FP4LAB_LLM_API_KEY") or env.get("OPENAI_API_KEY")
    return LLMProposer(program, base_url, model, api_key, **options)


def make_proposer(name: str, program: Program, *, state_dir: Path, seed: int = 0, base_url: str | None = None,
                  model: str | None = None, api_key: str | None = None, command: list[str] | str | None = None,
                  timeout_s: float | None = None, study_name: str | None = None) -> Proposer:
    """A proposer by name. The optuna study is state_dir/optuna.journal, named after what defines the
    objective in program.md (metric, direction, [run], [search_space]), so editing those starts afresh."""
    if name == "optuna":
        header = {k: program.header.get(k) for k in ("metric", "direction", "run", "search_space")}
        digest = hashlib.sha256(json.dumps(header, sort_keys=True, default=str).encode()).hexdigest()[:12]
        return OptunaProposer(program, Path(state_dir) / "optuna.journal", study_name or f"ratchet-{digest}", seed)
    options = {} if timeout_s is None else {"timeout_s": timeout_s}
    if name == "llm":
        return llm_proposer_from_env(program, base_url, model, api_key, **options)
    if name == "command":
        if not command:
            raise ValueError("the command proposer needs a command (argv), e.g. 'python propose.py'")
        return CommandProposer(program, command, **options)
    raise ValueError(f"unknown proposer {name!r}; allowed: {', '.join(PROPOSERS)}")


# ----------------------------------------------------------------------------------------- helpers


def _parse_answer(text: str, who: str) -> Any:
    """The JSON object in an answer: the whole text, else a ```json fence, else the outermost braces."""
    body = text.strip()
    fenced = FENCED.search(body)
    candidates = [body, fenced[1] if fenced else None, body[body.find("{"):body.rfind("}") + 1]]
    for candidate in candidates:
        if candidate:
            try:
                return json.loads(candidate)
            except json.JSONDecodeError:
                continue
    raise ProposalError(f"{who} is not a JSON object: {_clip(text)}")


def _jsonable(value: Any) -> Any:
    # Plain JSON for any consumer: NaN/Inf (a diverged run's metric) become null, paths strings.
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return _clip(lines[-1], 200) if lines else ""


def _clip(text: str, limit: int = 80) -> str:
    text = " ".join("".join(c if c.isprintable() else " " for c in text).split())
    return text if len(text) <= limit else text[:limit] + "..."


__all__ = [
    "AgentError", "CommandProposer", "Context", "LLMProposer", "OptunaProposer", "Proposal", "ProposalError",
    "apply_proposal", "editable_files", "llm_proposer_from_env", "make_proposer", "validate_proposal",
]
