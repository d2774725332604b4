"""`fp4lab ratchet`: the autoresearch commit/revert loop as software, driven by program.md.

    ratchet = Ratchet(load_program("program.md"), tag="nov29", proposer="optuna")
    ratchet.run(iterations=5)

Where things live (for tag T, in the repository that holds program.md):

    branch ratchet/T                    the kept iterations, one commit each, on top of the HEAD the
                                        ratchet started from
    .fp4lab/ratchet/T/worktree/         a git worktree of that branch: the only tree the loop edits;
                                        the user's checkout and its uncommitted work are never touched
    .fp4lab/ratchet/T/results.tsv       one row per iteration, kept or not (autoresearch's columns+)
    .fp4lab/ratchet/T/patches/          iter-NNNN.patch: the change each iteration tried
    .fp4lab/ratchet/T/runs/, logs/      run folders (kind fp4lab) and command output (kind command)
    .fp4lab/ratchet/T/optuna.journal    the optuna proposer's study
    sweep_catalog.json                  one record per iteration, sweep "ratchet/T": the proposal, the
                                        metric per seed, the decision, the kept commit

One iteration: propose -> save the change as a patch -> record it (phase "running") -> apply it in the
worktree (params go to `ratchet.toml`, diffs through `git apply`) -> run the capped experiment once
per seed -> scan it -> decide -> record the decision in the catalog and results.tsv (phase "decided")
-> `git commit` (keep) or reset the worktree (discard) -> phase "done". Because every step is
recorded before the next one, a ratchet killed at any point (SIGKILL included) continues correctly
when started again with the same tag: a decided iteration is committed or reverted as recorded; a
running one is re-applied on a clean tree and its runs continue from their checkpoints.

`workers > 1` keeps that many proposals in flight, each applied and run in its own worktree
(.fp4lab/ratchet/T/worker-k/, detached at the branch head); decisions are taken one at a time, and a
kept change must land on the branch as exactly the tree that was measured, else it is "stale".
`executor="slurm"` runs each experiment as a submitit job (program.md [slurm]); its job id is
recorded first, so a restarted ratchet waits for that job instead of running the experiment twice.

The noise gate: iteration 0 runs the unchanged tree on [noise].seeds seeds; sigma is their sample
standard deviation. Rule "sigma" runs a proposal on the first seed and keeps it when it beats the
best by more than k * sigma; rule "paired" runs it on every seed and keeps it when a paired bootstrap
gives P(better) >= confidence. Either way the run must be healthy ([health]) and strictly better. A
proposal already tried (same fingerprint) is never run again.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import tomllib
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fp4lab.lab import repo
from fp4lab.lab.choices import RATCHET_EXECUTORS
from fp4lab.lab.ratchet.proposers import (
    AgentError,
    Context,
    Proposal,
    ProposalError,
    apply_proposal,
    editable_files,
    make_proposer,
)
from fp4lab.lab.records.catalog import Catalog, utc_now
from fp4lab.lab.runs.sbatch import config_toml
from fp4lab.lab.specs.program import Program, metric_from_output
from fp4lab.lab.specs.sweep_spec import RunSpec
from fp4lab.train.atomic import write_atomic
from fp4lab.train.config import ENDED_STATUSES, summary_value, toml_text

PARAMS_FILE = "ratchet.toml"
PRUNED = "pruned"  # a run's summary status, an iteration's verdict and decision when the pruner stopped it
TSV_COLUMNS = ("iteration", "commit", "metric", "best", "status", "healthy", "source", "fingerprint", "description")


class RatchetError(RuntimeError):
    """The ratchet cannot start or continue safely; one line saying why and what to do."""


@dataclass
class Outcome:
    """What one iteration measured: the metric per seed (None where a run failed) and health."""

    values: list[float | None]
    healthy: bool
    verdicts: list[str]
    note: str = ""
    pruned: bool = False  # the first seed's run was stopped by the optuna proposer's pruner

    @property
    def metric(self) -> float | None:
        finite = [v for v in self.values if v is not None]
        return sum(finite) / len(finite) if finite and len(finite) == len(self.values) else None


class Ratchet:
    def __init__(self, program: Program, *, tag: str, proposer: str = "optuna", catalog: str | Path = "sweep_catalog.json",
                 seed: int = 0, proposer_options: dict[str, Any] | None = None, executor: str = "local",
                 workers: int = 1, on_event: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        if executor not in RATCHET_EXECUTORS:
            raise RatchetError(f"executor {executor!r} is not supported; allowed: {', '.join(RATCHET_EXECUTORS)}")
        if workers < 1:
            raise RatchetError(f"workers must be >= 1, got {workers}")
        if not tag or not all(c.isalnum() or c in "._-" for c in tag) or tag.startswith((".", "-")):
            raise RatchetError(f"tag {tag!r}: use letters, digits, '.', '_' or '-' (it names the branch ratchet/<tag>)")
        self.program, self.tag, self.seed = program, tag, seed
        try:
            self.repo_root = repo.repo_root(program.path.resolve().parent)
        except repo.GitError as exc:
            raise RatchetError(str(exc)) from None
        self.state_dir = self.repo_root / ".fp4lab" / "ratchet" / tag
        self.worktree = self.state_dir / "worktree"
        self.branch = f"ratchet/{tag}"
        self.sweep = f"ratchet/{tag}"
        self.catalog = Catalog(catalog)
        self.proposer_name = proposer
        self.executor = executor
        self.workers = workers
        self.proposer_options = proposer_options or {}
        self.on_event = on_event or (lambda kind, data: None)
        self._proposer = None

    # ------------------------------------------------------------------------------------ the loop

    def run(self, iterations: int | None = None) -> dict[str, Any]:
        """Run until `iterations` proposals (iteration 1..N; 0 is the baseline) have been decided, or a
        [stop] rule fires. Returns the summary (best metric, kept iterations, branch)."""
        target = iterations if iterations is not None else self.program.stop.iterations
        if target is None:
            raise RatchetError(f"{self.program.path}: no iteration budget: give a number of iterations, or set [stop].iterations")
        self.proposer()  # a misconfigured proposer fails here, before anything runs
        self._prepare_worktree()
        interrupted = self._recover()
        baseline = self._record(0)
        if baseline is None or baseline["extra"].get("phase") == "running":
            self._iteration(0, None, self.worktree, resumed=baseline is not None)
        if self.workers > 1:
            self._run_parallel(target, interrupted)
        else:
            for number, proposal in interrupted:
                self._iteration(number, proposal, self.worktree, resumed=True)
            while not self._stop_reason(self._records(), target):
                number = self._next_number()
                proposal = self._propose(self._records(), number)
                if proposal is not None:
                    self._iteration(number, proposal, self.worktree)
        summary = self.summary(self._stop_reason(self._records(), target))
        self.on_event("end", summary)
        return summary

    def _run_parallel(self, target: int, interrupted: list[tuple[int, Proposal | None]]) -> None:
        """`workers` proposals at once, each applied and run in its own worktree (detached at the branch
        head when it starts); decisions are taken one at a time as results come in."""
        free = [self._worker_tree(k) for k in range(self.workers)]
        inflight: dict[Future, tuple[int, Proposal | None, Path]] = {}
        queue = list(interrupted)
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            while True:
                while free and (queue or not self._stop_reason(self._records(), target)):
                    if queue:
                        number, proposal = queue.pop(0)
                        resumed = True
                    else:
                        number = self._next_number()
                        proposal = self._propose(self._records(), number)
                        resumed = False
                        if proposal is None:
                            continue
                    tree = free.pop()
                    if not self._start(number, proposal, tree, resumed=resumed):
                        free.append(tree)
                        continue
                    inflight[pool.submit(self._measure, number, tree)] = (number, proposal, tree)
                if not inflight:
                    return
                done, _ = wait(inflight, return_when=FIRST_COMPLETED)
                for future in done:
                    number, proposal, tree = inflight.pop(future)
                    self._decide(number, proposal, future.result(), tree)
                    free.append(tree)

    def _worker_tree(self, k: int) -> Path:
        """Worker k's own worktree (detached; only the main worktree is on the branch)."""
        tree = self.state_dir / f"worker-{k}"
        if f"worktree {tree}" not in repo.git(self.repo_root, "worktree", "list", "--porcelain").splitlines():
            if tree.exists():
                raise RatchetError(f"{tree} exists but is not a git worktree of {self.repo_root}; move it away")
            repo.git(self.repo_root, "worktree", "add", "-q", "--detach", str(tree), self.branch)
        return tree

    def _next_number(self) -> int:
        return max((r["extra"]["iteration"] for r in self._records()), default=0) + 1

    def summary(self, reason: str = "") -> dict[str, Any]:
        records = self._records()
        kept = [r["extra"]["iteration"] for r in records if r["extra"].get("decision") == "keep"]
        baseline = self._record(0)
        return {"tag": self.tag, "branch": self.branch, "worktree": str(self.worktree), "reason": reason,
                "iterations": len([r for r in records if r["extra"]["iteration"] > 0]), "kept": kept,
                "baseline": baseline["extra"].get("metric") if baseline else None, "best": self._best(records)[0],
                "sigma": baseline["extra"].get("sigma") if baseline else None, "results": str(self.state_dir / "results.tsv")}

    def _stop_reason(self, records: list[dict[str, Any]], target: int) -> str:
        iterations = [r for r in records if r["extra"]["iteration"] > 0]
        if len(iterations) >= target:
            return f"{len(iterations)} iterations"
        best, _ = self._best(records)
        stop = self.program.stop
        if stop.target is not None and best is not None and not self.program.better(stop.target, best):
            return f"target {stop.target} reached ({best:.6g})"
        decided = [r for r in iterations if r["extra"].get("decision")]
        if stop.plateau and len(decided) >= stop.plateau:
            if not any(r["extra"].get("decision") == "keep" for r in decided[-stop.plateau:]):
                return f"plateau: no kept change in the last {stop.plateau} iterations"
        return ""

    def _iteration(self, number: int, proposal: Proposal | None, tree: Path, resumed: bool = False) -> None:
        """Record, apply, run, decide, commit or revert one iteration (0 = the baseline, proposal None)."""
        if self._start(number, proposal, tree, resumed=resumed):
            self._decide(number, proposal, self._measure(number, tree), tree)

    def _start(self, number: int, proposal: Proposal | None, tree: Path, *, resumed: bool = False) -> bool:
        """Record the iteration and apply its change in `tree`, on the branch head (a resumed one: on the
        commit it started from). False when the proposal was tried before (recorded as a duplicate)."""
        record = self._record(number)
        base = record["extra"]["base_commit"] if resumed and record else repo.git(self.worktree, "rev-parse", "HEAD")
        extra: dict[str, Any] = {"iteration": number, "phase": "running", "base_commit": base,
                                 "proposal": _proposal_dict(proposal), "tree_dir": str(tree)}
        if proposal is not None and self._seen(proposal.fingerprint(), number):
            self._finish(number, proposal, Outcome([], False, [], "duplicate of an earlier iteration"), "duplicate",
                         record=extra)
            return False
        repo.reset(tree, "HEAD")
        if tree != self.worktree:  # a worker's tree: detached at the commit the change starts from
            repo.git(tree, "checkout", "-q", "--detach", base)
        self.catalog.upsert({"id": self._record_id(number), "sweep": self.sweep, "state": "running",
                             "started_at": utc_now(), "git_commit": base, "executor": self.executor, "extra": extra})
        self.on_event("start", {"iteration": number, "proposal": proposal})
        if proposal is not None:
            self._apply(number, proposal, tree)
        config = self._config(number, 0, tree)
        if config is not None:
            self.catalog.update(self._record_id(number), config=config, recipe=config.get("recipe"))
        return True

    def _measure(self, number: int, tree: Path) -> Outcome:
        seeds = self.program.noise.seeds
        count = seeds if number == 0 or self.program.noise.rule == "paired" else 1
        values, verdicts, healthy, notes = [], [], True, []
        for index in range(count):
            value, verdict, ok, note = self._run_once(number, index, tree)
            values.append(value)
            verdicts.append(verdict)
            healthy = healthy and ok
            if note:
                notes.append(note)
            if verdict == PRUNED:  # the trial is over: its other seeds are not run
                return Outcome(values, False, verdicts, note, pruned=True)
        return Outcome(values, healthy and all(v is not None for v in values), verdicts, "; ".join(notes))

    def _decide(self, number: int, proposal: Proposal | None, outcome: Outcome, tree: Path) -> None:
        best, best_values = self._best([r for r in self._records() if r["extra"]["iteration"] != number])
        sigma = (self._record(0) or {}).get("extra", {}).get("sigma") or 0.0
        decision, judged = self._judge(number, outcome, best, best_values, sigma)
        if decision == "keep" and tree != self.worktree and not self._land(number, tree):
            outcome.note = "stale: the branch moved and the change no longer gives the tree that was measured"
            decision, judged["reason"] = "stale", outcome.note
        self._finish(number, proposal, outcome, decision, best=best, sigma=sigma, judged=judged)

    def _judge(self, number: int, outcome: Outcome, best: float | None, best_values: list[float], sigma: float) -> tuple[str, dict[str, Any]]:
        """(decision, how it was decided): the value the gate compared with, the gain over it (positive =
        better, in metric units), the gate (rule "sigma": k * sigma; rule "paired": the bootstrap
        probability against the confidence) and the reason in words, recorded and shown as decided."""
        noise = self.program.noise
        if number == 0:
            healthy = outcome.healthy
            return ("baseline" if healthy else "crash"), {"reason": "the unchanged tree" if healthy else f"baseline unhealthy: {_verdicts(outcome)}"}
        if outcome.pruned:
            return PRUNED, {"reason": outcome.note}
        if not outcome.healthy or outcome.metric is None:
            return "crash", {"reason": f"unhealthy: {_verdicts(outcome)}"}
        if best is None:
            return "keep", {"reason": "no healthy result before it"}
        if noise.rule == "paired" and len(best_values) == len(outcome.values) > 1:
            reference = sum(best_values) / len(best_values)
            chance = self._paired_probability(outcome.values, best_values)
            keep = chance >= noise.confidence
            return ("keep" if keep else "discard"), {
                "rule": "paired", "compared_with": reference, "gain": self.program.improvement(outcome.metric, reference),
                "probability": chance, "confidence": noise.confidence,
                "reason": f"P(better) {chance:.3f} {'>=' if keep else '<'} confidence {noise.confidence:g} (paired over {len(best_values)} seeds)",
            }  # fmt: skip
        # rule "sigma": the proposal's first-seed run against the best's run on that seed (same init and batches)
        reference = best_values[0] if best_values and best_values[0] is not None else best
        gain, gate = self.program.improvement(outcome.values[0], reference), noise.k * sigma
        keep = gain > gate
        return ("keep" if keep else "discard"), {
            "rule": "sigma", "compared_with": reference, "gain": gain, "gate": gate,
            "reason": f"gain {gain:.4g} {'>' if keep else '<='} gate {noise.k:g} x sigma = {gate:.4g} (seed 0 against seed 0)",
        }

    def _land(self, number: int, tree: Path) -> bool:
        """Put a worker's change on the branch head (the main worktree). True when the result is the very
        tree the worker measured; otherwise the main worktree is reset and the change is stale. Parameters
        land as the worker's whole params file (so they land on any head that differs only there); a diff
        lands through its patch."""
        extra = self._record(number)["extra"]
        repo.reset(self.worktree, "HEAD")
        if (extra.get("proposal") or {}).get("kind") == "params":
            (self.worktree / PARAMS_FILE).write_text((tree / PARAMS_FILE).read_text())
            repo.git(self.worktree, "add", PARAMS_FILE)
        elif extra.get("patch") and Path(extra["patch"]).read_text():
            if not repo.succeeds(self.worktree, "apply", "--index", extra["patch"]):
                repo.reset(self.worktree, "HEAD")
                return False
        if repo.git(self.worktree, "write-tree") != extra.get("tree"):
            repo.reset(self.worktree, "HEAD")
            return False
        return True

    def _finish(self, number: int, proposal: Proposal | None, outcome: Outcome, decision: str, *,
                best: float | None = None, sigma: float | None = None, record: dict[str, Any] | None = None,
                judged: dict[str, Any] | None = None) -> None:
        """Record the decision (and how it was judged: _judge) in the catalog, then commit or revert, write
        results.tsv, mark done."""
        fields: dict[str, Any] = {
            "iteration": number, "phase": "decided", "decision": decision, "metric": outcome.metric,
            "values": outcome.values, "verdicts": outcome.verdicts, "healthy": outcome.healthy, "note": outcome.note,
            "best_before": best, "metric_name": self.program.metric, "direction": self.program.direction,
            **({"reason": outcome.note} if decision == "duplicate" else {}), **(judged or {}),
        }
        if number == 0:
            finite = [v for v in outcome.values if v is not None]
            fields["sigma"] = _stdev(finite) if len(finite) == len(outcome.values) else None
        elif sigma is not None:
            fields["sigma"] = sigma
        if record is not None:
            fields |= {k: v for k, v in record.items() if k not in fields}
        record_id = self._record_id(number)
        state = "completed" if decision in ("keep", "discard", "baseline", "stale") else PRUNED if decision == PRUNED else "failed"
        if self.catalog.get(record_id) is None:
            self.catalog.upsert({"id": record_id, "sweep": self.sweep, "state": state, "finished_at": utc_now(),
                                 "executor": self.executor, "extra": fields})
        else:
            self.catalog.update(record_id, state=state, finished_at=utc_now(),
                                verdict=outcome.verdicts[0] if outcome.verdicts else None, extra=fields)
        self._complete(number)
        if proposal is not None and self._proposer is not None:
            self._proposer.observe(proposal, outcome.metric, outcome.healthy, pruned=decision == PRUNED)
        self.on_event("decided", self.catalog.get(record_id))

    def _complete(self, number: int) -> None:
        """The git half of a decided iteration: commit a kept change, reset anything else; idempotent."""
        record = self._record(number)
        extra = record["extra"]
        if extra["decision"] == "keep" and not extra.get("kept_commit"):
            clean = not repo.git(self.worktree, "status", "--porcelain")
            # Clean with the measured tree at HEAD: committed, then killed before kept_commit was recorded.
            committed = clean and repo.git(self.worktree, "rev-parse", "HEAD^{tree}") == extra.get("tree")
            if clean and not committed and extra.get("patch") and Path(extra["patch"]).read_text():
                repo.git(self.worktree, "apply", "--index", extra["patch"])
            if repo.git(self.worktree, "status", "--porcelain"):
                metric = extra["metric"]
                title = (f"ratchet {self.tag} iteration {number}: {self.program.metric} {metric:.6g}"
                         f" (was {extra['best_before']:.6g})" if extra.get("best_before") is not None else
                         f"ratchet {self.tag} iteration {number}: {self.program.metric} {metric:.6g}")
                rationale = (extra.get("proposal") or {}).get("rationale") or ""
                repo.git(self.worktree, "add", "-A")
                repo.commit(self.worktree, title + (f"\n\n{rationale}" if rationale else ""))
            commit = repo.git(self.worktree, "rev-parse", "HEAD")
            self.catalog.update(record["id"], extra={"kept_commit": commit})
        elif extra["decision"] != "keep":
            repo.reset(self.worktree, "HEAD")  # the main worktree never holds more than the branch head, but be sure
        self._write_tsv_row(number)  # from the record: a ratchet killed before writing it writes it on resuming
        self.catalog.update(record["id"], extra={"phase": "done"})

    # --------------------------------------------------------------------------------- proposing

    def proposer(self):
        if self._proposer is None:
            self._proposer = make_proposer(self.proposer_name, self.program, state_dir=self.state_dir, seed=self.seed,
                                           **self.proposer_options)
        return self._proposer

    def _propose(self, records: list[dict[str, Any]], number: int) -> Proposal | None:
        """The next proposal, or None when the proposer failed (that iteration is recorded as invalid)."""
        proposer = self.proposer()
        recorded = {(r["extra"].get("proposal") or {}).get("trial") for r in records} - {None}
        unrecorded = proposer.unrecorded(recorded)
        if unrecorded is not None:  # asked before a crash, never recorded: run it now
            return unrecorded
        context = Context(self.program, files=editable_files(self.program, self.worktree),
                          history=[_history_row(r) for r in records[-20:]],
                          best={"metric": self._best(records)[0]}, current_params=self._current_params(),
                          root=self.worktree)
        try:
            proposal = proposer.propose(context)
        except (ProposalError, AgentError) as exc:
            self._finish(number, None, Outcome([], False, []), "invalid", judged={"reason": f"rejected proposal: {exc}"},
                         record={"base_commit": repo.git(self.worktree, "rev-parse", "HEAD"),
                                 "proposal": {"source": self.proposer_name, "error": str(exc)}})
            return None
        return proposal

    def _seen(self, fingerprint: str, number: int) -> bool:
        return any((r["extra"].get("proposal") or {}).get("fingerprint") == fingerprint
                   for r in self._records() if r["extra"]["iteration"] not in (0, number))

    def _current_params(self, tree: Path | None = None) -> dict[str, Any]:
        path = (tree or self.worktree) / PARAMS_FILE
        return tomllib.loads(path.read_text()) if path.exists() else {}

    # ----------------------------------------------------------------------------------- applying

    def _apply(self, number: int, proposal: Proposal, tree: Path) -> None:
        patch = self.state_dir / "patches" / f"iter-{number:04d}.patch"
        patch.parent.mkdir(parents=True, exist_ok=True)
        if proposal.kind == "params":
            params = self._current_params(tree) | proposal.params
            (tree / PARAMS_FILE).write_text(toml_text(dict(sorted(params.items())), [f"fp4lab ratchet {self.tag}: the parameters of the kept iterations (written by the loop)"]))
        else:
            apply_proposal(proposal, tree)
        repo.git(tree, "add", "-A")
        patch.write_text(repo.git(tree, "diff", "--cached", "--binary", strip=False))
        # The tree that will be measured: a kept change must land as exactly this tree (see _land).
        self.catalog.update(self._record_id(number), extra={"patch": str(patch), "tree": repo.git(tree, "write-tree")})

    # ------------------------------------------------------------------------------------ running

    def _config(self, number: int, seed_index: int, tree: Path) -> dict[str, Any] | None:
        """The TrainConfig dict of one run (kind fp4lab): base, the params file, the budget, the seed."""
        run = self.program.run
        if run.kind != "fp4lab":
            return None
        config = {k: (dict(v) if isinstance(v, dict) else v) for k, v in run.base.items()}
        config |= self._current_params(tree)
        config["seed"] = int(run.base.get("seed", 0)) + seed_index
        if run.steps is not None:
            config["steps"] = run.steps
        if run.minutes is not None:
            config["max_minutes"] = run.minutes
        config["out_dir"] = str(self.state_dir / "runs" / f"iter-{number:04d}-s{seed_index}")
        trial = ((self._record(number) or {}).get("extra", {}).get("proposal") or {}).get("trial")
        if trial is not None and seed_index == 0 and self.proposer_name == "optuna":
            # The first seed's run reports its validation losses to the trial; the pruner may stop it.
            config["optuna_trial"] = {"storage": str(self.proposer().study_path.resolve()),
                                      "study": self.proposer().study.study_name, "trial": trial,
                                      "pruner": self.program.pruner}
        return config

    def _run_once(self, number: int, seed_index: int, tree: Path) -> tuple[float | None, str, bool, str]:
        """(metric, verdict, healthy, note) of one run of `tree` as it is now."""
        if self.program.run.kind == "command":
            return self._run_command(number, seed_index, tree)
        return self._run_fp4lab(number, seed_index, tree)

    def _run_fp4lab(self, number: int, seed_index: int, tree: Path) -> tuple[float | None, str, bool, str]:
        from fp4lab.lab.records.logscan import ScanThresholds, scan

        config = self._config(number, seed_index, tree)
        out = Path(config["out_dir"])
        out.mkdir(parents=True, exist_ok=True)
        config_path = out / "run.toml"
        run = RunSpec(f"{self.tag}-{number:04d}-s{seed_index}", f"ratchet {self.tag} iteration {number} seed {seed_index}", config)
        config_path.write_text(config_toml(run))
        summary_path = out / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        if summary is None or summary.get("status") not in ENDED_STATUSES:
            minutes = self.program.run.minutes
            command = WorktreeCommand([sys.executable, "-m", "fp4lab.cli", "train", "--config", str(config_path)],
                                      tree, worktree_first({}, tree), self._log(number, seed_index),
                                      timeout_s=None if minutes is None else 120 * minutes + 600)
            returncode, _ = self._execute(number, seed_index, command)
            if returncode != 0 or not summary_path.exists():
                return None, "crashed", False, f"training exited with {returncode} (log {command.log})"
            summary = json.loads(summary_path.read_text())
        if summary.get("status") == PRUNED:
            value = summary_value(summary, self.program.metric)
            return (value if isinstance(value, (int, float)) and math.isfinite(value) else None, PRUNED, False,
                    f"pruned after {summary.get('steps_completed')} steps by the {self.program.pruner['type']} pruner")
        health = self.program.health
        overrides = {k: v for k, v in (("entropy_floor", health.entropy_floor), ("max_logit_tau", health.max_logit)) if v is not None}
        result = scan(out, ScanThresholds().with_overrides(overrides), running=False)
        verdict = result.verdict
        value = summary_value(summary, self.program.metric)
        value = float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None
        status = verdict.split("@")[0]
        healthy = status in health.require_verdict and summary.get("status") == "completed"
        if not health.no_nan and status == "diverged":
            healthy = value is not None
        return value, verdict, healthy, "" if healthy else f"unhealthy: {verdict}"

    def _run_command(self, number: int, seed_index: int, tree: Path) -> tuple[float | None, str, bool, str]:
        run = self.program.run
        env = dict(run.env) | {"FP4LAB_SEED": str(seed_index), "FP4LAB_PARAMS": json.dumps(self._current_params(tree))}
        command = WorktreeCommand(list(run.command), tree, worktree_first(env, tree), self._log(number, seed_index),
                                  timeout_s=60 * run.timeout_minutes)
        returncode, output = self._execute(number, seed_index, command)
        if returncode is None:
            return None, "timeout", False, f"{output} (log {command.log})"
        value = metric_from_output(output, run.metric_regex)
        if returncode != 0:
            return value, "crashed", False, f"exit code {returncode} (log {command.log})"
        if value is None:
            return None, "crashed", False, f"no metric matched {run.metric_regex!r} (log {command.log})"
        return value, "converged", True, ""

    def _log(self, number: int, seed_index: int) -> Path:
        return self.state_dir / "logs" / f"iter-{number:04d}-s{seed_index}.log"

    def _execute(self, number: int, seed_index: int, command: WorktreeCommand) -> tuple[int | None, str]:
        """Run one experiment here, or as a Slurm job through submitit (`--executor slurm`). The job id
        goes into the iteration's record first, so a ratchet restarted while the job still runs waits
        for that job instead of starting a second one on the same run folder."""
        if self.executor == "local":
            return command()
        import submitit

        from fp4lab.lab.runs.slurm import submitit_executor

        folder = self.state_dir / "submitit"
        record_id = self._record_id(number)
        jobs = dict(self.catalog.get(record_id)["extra"].get("jobs") or {})
        job = None
        if str(seed_index) in jobs:
            job = submitit.SlurmJob(folder=folder, job_id=jobs[str(seed_index)])
            if job.state in ("CANCELLED", "FAILED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY") and not job.paths.result_pickle.exists():
                job = None  # it ended without a result: run the experiment again
        if job is None:
            job = submitit_executor(self.program.slurm, f"ratchet-{self.tag}", folder).submit(command)
            jobs[str(seed_index)] = job.job_id
            self.catalog.update(record_id, executor="slurm", slurm_job_id=job.job_id, extra={"jobs": jobs})
        self.on_event("note", {"message": f"iteration {number} seed {seed_index}: Slurm job {job.job_id}"})
        try:
            return job.result()
        except Exception as exc:  # the job died (scancel, node failure, time limit): a crashed experiment
            return 1, f"Slurm job {job.job_id} failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__}"

    # ------------------------------------------------------------------------ worktree and recovery

    def _prepare_worktree(self) -> None:
        """Create (or re-attach) the worktree of branch ratchet/<tag>; refuse whatever could touch the
        user's checkout."""
        exclude = Path(repo.git(self.repo_root, "rev-parse", "--git-common-dir"))
        exclude = (exclude if exclude.is_absolute() else self.repo_root / exclude) / "info" / "exclude"
        if ".fp4lab/" not in (exclude.read_text() if exclude.exists() else "").split():
            exclude.parent.mkdir(parents=True, exist_ok=True)
            with open(exclude, "a") as handle:
                handle.write("\n.fp4lab/\n")  # the ratchet's state never shows up as untracked in the checkout
        current = repo.git(self.repo_root, "rev-parse", "--abbrev-ref", "HEAD")
        if current == self.branch:
            raise RatchetError(f"{self.repo_root} has branch {self.branch} checked out; the ratchet works on it in its own "
                               f"worktree: check out another branch first")
        worktrees = repo.git(self.repo_root, "worktree", "list", "--porcelain")
        registered = f"worktree {self.worktree}" in worktrees.splitlines()
        branch_exists = bool(repo.git(self.repo_root, "branch", "--list", self.branch))
        if registered:
            if repo.git(self.worktree, "rev-parse", "--abbrev-ref", "HEAD") != self.branch:
                raise RatchetError(f"{self.worktree} is not on {self.branch}; remove it (git worktree remove) or use another tag")
            return
        if self.worktree.exists():
            raise RatchetError(f"{self.worktree} exists but is not a git worktree of {self.repo_root}; move it away or use another tag")
        if branch_exists:
            if not self._records():
                raise RatchetError(f"branch {self.branch} exists but {self.catalog.path} has no iteration of it; "
                                   f"pick another tag (or delete the branch)")
            repo.git(self.repo_root, "worktree", "add", str(self.worktree), self.branch)
        else:
            if self._records():
                raise RatchetError(f"{self.catalog.path} has iterations of {self.sweep} but branch {self.branch} is gone; "
                                   f"pick another tag")
            self.state_dir.mkdir(parents=True, exist_ok=True)
            repo.git(self.repo_root, "worktree", "add", "-b", self.branch, str(self.worktree), "HEAD")
            dirty = repo.git(self.repo_root, "status", "--porcelain", "--untracked-files=no")
            self.on_event("note", {"message": f"branch {self.branch} starts at {repo.git(self.repo_root, 'rev-parse', '--short', 'HEAD')}"
                                   + ("; uncommitted changes in your checkout are not part of it" if dirty else "")})

    def _recover(self) -> list[tuple[int, Proposal | None]]:
        """Finish what a killed ratchet left: a decided iteration gets its commit or revert as recorded;
        the main worktree is brought back to the branch head (any stray change saved as a patch first);
        the iterations that were running are returned, to run again (their runs continue from their
        checkpoints, or re-attach to their Slurm jobs)."""
        records = self._records()
        for record in records:
            extra = record["extra"]
            if extra.get("phase") == "decided":
                self._complete(extra["iteration"])
                trial = (extra.get("proposal") or {}).get("trial")
                if trial is not None:  # the tell may not have happened
                    self.proposer().observe_again(trial, extra.get("metric"), bool(extra.get("healthy")),
                                                  pruned=extra["decision"] == PRUNED)
        running = [r["extra"] for r in self._records() if r["extra"].get("phase") == "running"]
        name = f"iter-{running[0]['iteration']:04d}.interrupted.patch" if running else "stray-before-start.patch"
        repo.save_and_reset(self.worktree, self.state_dir / "patches" / name)
        interrupted = []
        for extra in running:
            if extra["iteration"] == 0:
                continue  # run() runs an unfinished baseline again
            self.on_event("note", {"message": f"resuming iteration {extra['iteration']} after an interruption"})
            interrupted.append((extra["iteration"], _proposal_from(extra.get("proposal"), self.program, self.worktree)))
        return interrupted

    # ---------------------------------------------------------------------------------- bookkeeping

    def _record_id(self, number: int) -> str:
        return f"ratchet-{self.tag}-{number:04d}"

    def _records(self) -> list[dict[str, Any]]:
        records = [r for r in self.catalog.records(sweep=self.sweep) if "iteration" in r["extra"]]
        return sorted(records, key=lambda r: r["extra"]["iteration"])

    def _record(self, number: int) -> dict[str, Any] | None:
        return self.catalog.get(self._record_id(number))

    def _best(self, records: list[dict[str, Any]]) -> tuple[float | None, list[float]]:
        """The best metric (and its per-seed values) among the baseline and the kept iterations: since a
        change is kept only when it beats the best, this is the branch head's."""
        candidates = [r["extra"] for r in records
                      if r["extra"].get("decision") in ("keep", "baseline") and r["extra"].get("metric") is not None]
        if not candidates:
            return None, []
        sign = 1 if self.program.direction == "minimize" else -1
        best = min(candidates, key=lambda extra: sign * extra["metric"])
        return best["metric"], list(best.get("values") or [])

    def _paired_probability(self, new: list[float], old: list[float], draws: int = 10_000) -> float:
        """Bootstrap probability that the mean per-seed improvement is positive (seeded: reproducible)."""
        gains = [self.program.improvement(a, b) for a, b in zip(new, old)]
        rng = random.Random(self.seed)
        wins = sum(sum(rng.choice(gains) for _ in gains) > 0 for _ in range(draws))
        return wins / draws

    def _write_tsv_row(self, number: int) -> None:
        """results.tsv's row for a decided iteration, made from its catalog record (replacing any earlier one)."""
        extra = self._record(number)["extra"]
        proposal = extra.get("proposal") or {}
        description = "baseline" if number == 0 else proposal.get("rationale") or ""
        if proposal.get("kind") == "params":
            description = " ".join(f"{k}={_short(v)}" for k, v in proposal["params"].items()) + (f" ({description})" if description else "")
        if extra.get("note"):
            description += f" [{extra['note']}]"
        metric, best = extra.get("metric"), self._best(self._records())[0]
        row = {"iteration": str(number), "commit": (extra.get("kept_commit") or "")[:7],
               "metric": "" if metric is None else f"{metric:.6f}", "best": "" if best is None else f"{best:.6f}",
               "status": extra["decision"], "healthy": str(bool(extra.get("healthy"))).lower(),
               "source": proposal.get("source") or ("baseline" if number == 0 else self.proposer_name),
               "fingerprint": (proposal.get("fingerprint") or "")[:12], "description": " ".join(description.split())}
        path = self.state_dir / "results.tsv"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [r for r in _read_tsv(path) if r["iteration"] != str(number)]
        _write_tsv(path, sorted([*rows, row], key=lambda r: int(r["iteration"])))  # workers decide out of order


# ------------------------------------------------------------------------------------------- helpers


def worktree_first(env: dict[str, str], tree: Path) -> dict[str, str]:
    """`env` with the worktree first on PYTHONPATH (then the run's own PYTHONPATH, else the ratchet's):
    an experiment imports the worktree's code, so the change under test is what it measures, even
    where it starts an installed console script (`fp4lab ...`), whose imports skip the cwd and would
    find the checkout the package was installed from."""
    rest = env.get("PYTHONPATH", os.environ.get("PYTHONPATH"))
    return env | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), rest]))}


class WorktreeCommand:
    """One experiment process: `argv` in the worktree with `env` added to the environment; writes its
    output to `log` and returns (exit code, output), exit code None on timeout. Called here, or pickled
    by submitit and called inside a Slurm job (so it is a plain class of an importable module)."""

    def __init__(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path, timeout_s: float | None) -> None:
        self.argv, self.cwd, self.env, self.log, self.timeout_s = list(argv), Path(cwd), dict(env), Path(log), timeout_s

    def __call__(self) -> tuple[int | None, str]:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        header = f"$ {shlex.join(self.argv)}\n"
        # One stream, written as it comes: the log reads in the order the run printed (its progress lines
        # on stderr before its summary on stdout) and can be followed while the experiment runs.
        with open(self.log, "w") as log:
            log.write(header)
            log.flush()
            process = None
            try:
                with _ctrl_c_after_spawn():
                    process = subprocess.Popen(self.argv, cwd=self.cwd, env=os.environ | self.env, stdout=log,
                                               stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
                returncode = process.wait(timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                log.write("\n[timed out]\n")
                return None, f"timed out after {self.timeout_s / 60:.3g} min"
            except OSError as exc:
                log.write(f"[cannot run: {exc.strerror}]\n")
                return 127, f"cannot run {self.argv[0]!r}: {exc.strerror}"
            except BaseException:  # Ctrl-C: the experiment goes with the ratchet
                if process is not None:
                    process.kill()
                    process.wait()
                raise
            log.write(f"\n[exit {returncode}]\n")
        output = self.log.read_text(errors="replace")[len(header):]
        return returncode, output.removesuffix(f"\n[exit {returncode}]\n")


@contextlib.contextmanager
def _ctrl_c_after_spawn() -> Iterator[None]:
    """Hold a SIGINT that arrives while a child is forked and started until it is: Python runs the
    handler wherever it is then, and an at-fork hook swallows the KeyboardInterrupt (logging's) or the
    child's preexec_fn fails with it, so the ratchet went on, or failed with "Exception occurred in
    preexec_fn" instead of stopping. Once the child exists the signal is raised again, to whatever
    handler was there. Only the main thread sets handlers; elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the ratchet dies, so a killed ratchet leaves no run behind that
    would race the resumed one on the same run folder (Linux prctl; elsewhere a no-op)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _proposal_dict(proposal: Proposal | None) -> dict[str, Any] | None:
    if proposal is None:
        return None
    return {"kind": proposal.kind, "params": proposal.params, "diff": proposal.diff, "rationale": proposal.rationale,
            "source": proposal.source, "trial": proposal.trial, "paths": list(proposal.paths),
            "fingerprint": proposal.fingerprint()}


def _proposal_from(data: dict[str, Any] | None, program: Program, worktree: Path) -> Proposal | None:
    """A recorded proposal again; a diff goes through validation again before it may be applied."""
    if not data or "kind" not in data:
        return None
    from fp4lab.lab.ratchet.proposers import validate_proposal

    raw = {"params": data["params"]} if data["kind"] == "params" else {"diff": data["diff"]}
    proposal = validate_proposal(raw | {"rationale": data.get("rationale", "")}, program, worktree, data["source"])
    return Proposal(proposal.kind, proposal.params, proposal.diff, proposal.rationale, proposal.source,
                    data.get("trial"), proposal.paths)


def _history_row(record: dict[str, Any]) -> dict[str, Any]:
    extra = record["extra"]
    proposal = extra.get("proposal") or {}
    return {"iteration": extra["iteration"], "decision": extra.get("decision"), "metric": extra.get("metric"),
            "kind": proposal.get("kind"), "params": proposal.get("params"), "rationale": proposal.get("rationale"),
            "note": extra.get("note")}


def _verdicts(outcome: Outcome) -> str:
    bad = [v for v in outcome.verdicts if v not in ("converged", "running")] or outcome.verdicts
    return ", ".join(bad) + (f" ({outcome.note})" if outcome.note else "") if bad else outcome.note or "no metric"


def _stdev(values: list[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _read_tsv(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t"))


def _write_tsv(path: Path, rows: list[dict[str, str]]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=TSV_COLUMNS, delimiter="\t", lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, text.getvalue())
