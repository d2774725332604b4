"""fp4lab ratchet end to end, with real git, real proposers and real runs: a command target (fast), an
fp4lab training target, diff proposals, refusals, and a ratchet killed with SIGKILL and started again."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fp4lab.lab.ratchet.loop import Ratchet, RatchetError
from fp4lab.lab.records.catalog import Catalog
from fp4lab.lab.specs.program import load_program

# The target: a "benchmark" whose score is (x - 3)^2 + a small seed-dependent jitter; lower is better.
SCORE = textwrap.dedent("""
    import json, os, sys, time
    from pathlib import Path
    calls = os.environ.get("CALLS_FILE")
    if calls:
        with open(calls, "a") as f:
            f.write(f"call {os.getpid()}\\n")  # its pid: the test checks that exactly these processes end
        if len(Path(calls).read_text().splitlines()) == int(os.environ.get("BLOCK_AT", "0")):
            while Path(calls + ".block").exists():  # held here until the test removes the file
                time.sleep(0.1)
    x = json.loads(os.environ["FP4LAB_PARAMS"]).get("x", 0.0)
    offset = float(Path("offset.txt").read_text()) if Path("offset.txt").exists() else 0.0
    seed = int(os.environ["FP4LAB_SEED"])
    print(f"score: {(x - 3.0) ** 2 + offset + 0.001 * seed}")
""")

PROGRAM = textwrap.dedent("""
    # Minimise the score

    Make score.py's score as small as possible.

    ```toml ratchet
    metric = "score"
    direction = "minimize"

    [run]
    kind = "command"
    command = ["{python}", "score.py"]
    metric_regex = '^score: ([-+0-9.eE]+)'
    timeout_minutes = 2

    [edit]
    files = ["offset.txt"]

    [search_space]
    x = {{ type = "float", low = 0.0, high = 6.0 }}

    [noise]
    seeds = 2
    rule = "sigma"
    k = 2.0
    ```
""")


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout.rstrip("\n")


def make_repo(tmp_path, program_name: str = "program.md"):
    """A committed git project with score.py, its offset and the program (named `program_name`)."""
    root = tmp_path / "project"
    root.mkdir()
    git(root, "init", "-q", "-b", "main")
    git(root, "config", "user.name", "Test User")
    git(root, "config", "user.email", "test@example.invalid")
    (root / "score.py").write_text(SCORE)
    (root / "offset.txt").write_text("0.5\n")
    (root / program_name).write_text(PROGRAM.format(python=sys.executable))
    (root / ".gitignore").write_text("sweep_catalog.json*\n")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "initial")
    return root


@pytest.fixture
def repo(tmp_path):
    return make_repo(tmp_path)


def recorded_pids(calls: Path) -> list[int]:
    """The pids score.py wrote into CALLS_FILE, one line ("call PID") per run."""
    return [int(line.split()[1]) for line in calls.read_text().splitlines()]


def process_running(pid: int, name: str) -> bool:
    """Whether `pid` is still a live process running `name`: not gone, not a zombie (a dead child no one
    has reaped yet), and not a new process that reuses the pid. Reads /proc; no process-table scan."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return False
    state = stat.rpartition(")")[2].split()[0]  # the field after "(comm)"
    return state not in ("Z", "X") and name.encode() in cmdline


def wait_until_ended(pid: int, name: str, timeout: float = 60.0) -> None:
    """Wait for a process that was sent SIGKILL to end: the kernel ends it soon, not at once."""
    deadline = time.monotonic() + timeout
    while process_running(pid, name):
        assert time.monotonic() < deadline, f"process {pid} ({name}) still runs {timeout:.0f} s after its ratchet was killed"
        time.sleep(0.05)


def ratchet_tsv(root: Path, tag: str) -> list[dict[str, str]]:
    with open(root / ".fp4lab" / "ratchet" / tag / "results.tsv", newline="") as handle:
        return list(csv.DictReader(handle, delimiter="\t"))


def test_optuna_ratchet_keeps_exactly_the_improvements_and_never_touches_the_checkout(repo):
    (repo / "offset.txt").write_text("0.5\n# my uncommitted edit\n")  # the user's work in progress
    (repo / "notes.txt").write_text("untracked notes\n")
    head = git(repo, "rev-parse", "HEAD")
    catalog = repo / "sweep_catalog.json"
    events = []
    loop = Ratchet(load_program(repo / "program.md"), tag="t1", catalog=catalog, on_event=lambda k, d: events.append(k))
    summary = loop.run(iterations=5)

    records = Catalog(catalog).records(sweep="ratchet/t1")
    assert [r["extra"]["iteration"] for r in records] == [0, 1, 2, 3, 4, 5]
    assert all(r["extra"]["phase"] == "done" for r in records)
    decisions = [r["extra"]["decision"] for r in records]
    assert decisions[0] == "baseline" and set(decisions[1:]) <= {"keep", "discard"}
    kept = [r for r in records if r["extra"]["decision"] == "keep"]
    assert summary["kept"] == [r["extra"]["iteration"] for r in kept]
    # The branch holds exactly one commit per kept iteration, in order, on top of the starting HEAD.
    log = git(repo, "log", "--format=%H %s", f"{head}..ratchet/t1").splitlines()[::-1]
    assert [line.split()[0] for line in log] == [r["extra"]["kept_commit"] for r in kept]
    for line, record in zip(log, kept):
        assert f"iteration {record['extra']['iteration']}: score" in line
    # Each kept change is strictly better than the best before it by more than 2 sigma of the baseline.
    sigma = records[0]["extra"]["sigma"]
    assert sigma == pytest.approx(0.001 / 2**0.5, rel=1e-6)
    for record in kept:
        assert record["extra"]["best_before"] - record["extra"]["values"][0] > 2 * sigma
    for record in records[1:]:
        if record["extra"]["decision"] == "discard":
            assert record["extra"]["best_before"] - record["extra"]["values"][0] <= 2 * sigma
    # results.tsv: every iteration, the commit of each kept one.
    rows = ratchet_tsv(repo, "t1")
    assert [row["status"] for row in rows] == decisions
    assert [row["commit"] for row in rows if row["commit"]] == [r["extra"]["kept_commit"][:7] for r in kept]
    # Every proposal's change was kept as a patch, kept or not.
    for record in records[1:]:
        assert "x = " in Path(record["extra"]["patch"]).read_text()
    # The user's checkout: same HEAD and branch, same uncommitted and untracked files, nothing new.
    assert git(repo, "rev-parse", "HEAD") == head and git(repo, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    assert (repo / "offset.txt").read_text() == "0.5\n# my uncommitted edit\n"
    assert git(repo, "status", "--porcelain").splitlines() == [" M offset.txt", "?? notes.txt"]
    worktree = Path(summary["worktree"])
    assert git(worktree, "status", "--porcelain") == ""
    assert "start" in events and "decided" in events and events[-1] == "end"
    # Run again: the budget is spent, nothing new happens.
    again = Ratchet(load_program(repo / "program.md"), tag="t1", catalog=catalog).run(iterations=5)
    assert again["iterations"] == 5 and len(Catalog(catalog).records(sweep="ratchet/t1")) == 6


@pytest.mark.parametrize("workers", [1, 2])
def test_a_killed_ratchet_continues_where_it_stopped(repo, tmp_path, workers):
    calls = tmp_path / "calls.txt"
    Path(f"{calls}.block").write_text("")
    env = os.environ | {"CALLS_FILE": str(calls), "BLOCK_AT": "4", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "fp4lab.cli", "ratchet", "--program", "program.md", "--iterations", "3", "--tag", "k",
               "--workers", str(workers)]
    first = subprocess.Popen(command, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    # Calls 1-2: the baseline's two seeds; then iterations 1, 2, ...: the 4th call blocks mid-run.
    while not (calls.exists() and len(calls.read_text().splitlines()) >= 4):
        assert first.poll() is None and time.monotonic() < deadline, first.stdout.read().decode()
        time.sleep(0.2)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    records = Catalog(repo / "sweep_catalog.json").records(sweep="ratchet/k")
    blocked = [r["extra"]["iteration"] for r in records if r["extra"]["phase"] == "running"]
    assert blocked and (workers == 2 or blocked == [2])
    # The run blocked mid-experiment still has its change applied in its tree. With two workers the other
    # one may have been killed between recording its iteration and applying its change: a clean tree,
    # on which the resumed ratchet applies it again (asserted below: every iteration ends done).
    dirty = [number for number in blocked if git(Path(records[number]["extra"]["tree_dir"]), "status", "--porcelain")]
    assert dirty if workers == 2 else dirty == blocked
    for pid in recorded_pids(calls):  # every run the killed ratchet started dies with it (none is left blocked)
        wait_until_ended(pid, "score.py")

    Path(f"{calls}.block").unlink()
    second = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout + second.stderr
    assert all(f"resuming iteration {n}" in second.stdout for n in blocked)
    records = Catalog(repo / "sweep_catalog.json").records(sweep="ratchet/k")
    assert [r["extra"]["iteration"] for r in records] == [0, 1, 2, 3]
    assert all(r["extra"]["phase"] == "done" for r in records)
    kept = [r["extra"]["kept_commit"] for r in records if r["extra"]["decision"] == "keep"]
    base = git(repo, "rev-parse", "main")
    landed = git(repo, "log", "--format=%H", f"{base}..ratchet/k").splitlines()[::-1]
    # two workers may land their kept changes out of iteration order (each commits when it is decided)
    assert landed == kept if workers == 1 else sorted(landed) == sorted(kept)
    assert git(repo / ".fp4lab" / "ratchet" / "k" / "worktree", "status", "--porcelain") == ""
    trials = json.loads(json.dumps([r["extra"]["proposal"]["trial"] for r in records[1:]]))
    if workers == 1:
        assert trials == [0, 1, 2]  # the interrupted trial was finished, not asked again
    else:
        # The free worker may have been killed while asking the next trial: one not fully sampled was never
        # proposed and is failed (OptunaProposer.pending_trial), so a fresh number follows; none is lost.
        assert trials == sorted(set(trials)) and trials[:2] == [0, 1]
        states = {t.number: t.state.name for t in _study(repo / ".fp4lab" / "ratchet" / "k" / "optuna.journal").get_trials()}
        assert all(states[n] == "FAIL" for n in range(trials[-1]) if n not in trials), states
    assert [row["iteration"] for row in ratchet_tsv(repo, "k")] == ["0", "1", "2", "3"]


def test_a_ratchet_killed_between_its_commit_and_recording_it_adopts_that_commit(repo):
    catalog = repo / "sweep_catalog.json"
    program = load_program(repo / "program.md")
    Ratchet(program, tag="c", catalog=catalog).run(iterations=1)
    record = Catalog(catalog).get("ratchet-c-0001")
    assert record["extra"]["decision"] == "keep"  # x = 0 is the baseline's (x - 3)^2 = 9, the most any x in [0, 6] scores
    commit = record["extra"]["kept_commit"]
    assert git(repo, "rev-parse", "ratchet/c") == commit
    rows = ratchet_tsv(repo, "c")
    assert [(r["iteration"], r["commit"]) for r in rows] == [("0", ""), ("1", commit[:7])]
    # The state on disk when SIGKILL lands right after `git commit`: the catalog still says "decided" and
    # results.tsv has no row for the iteration yet.
    Catalog(catalog).update("ratchet-c-0001", extra={"phase": "decided", "kept_commit": None})
    tsv = repo / ".fp4lab" / "ratchet" / "c" / "results.tsv"
    tsv.write_text("".join(tsv.read_text().splitlines(keepends=True)[:-1]))
    Ratchet(program, tag="c", catalog=catalog).run(iterations=1)
    record = Catalog(catalog).get("ratchet-c-0001")
    assert record["extra"]["phase"] == "done" and record["extra"]["kept_commit"] == commit
    assert git(repo, "rev-parse", "ratchet/c") == commit  # adopted, not applied and committed a second time
    assert ratchet_tsv(repo, "c") == rows  # the row the kill left out, written from the record


def _study(journal: Path):
    """The one Optuna study in a ratchet's journal file."""
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    storage = JournalStorage(JournalFileBackend(str(journal)))
    (study,) = storage.get_all_studies()
    return optuna.load_study(study_name=study.study_name, storage=storage)


PROPOSER = textwrap.dedent("""
    import json, sys
    context = json.load(sys.stdin)
    n = len([h for h in context["history"] if h["iteration"] > 0])
    answers = [
        {"diff": "--- a/offset.txt\\n+++ b/offset.txt\\n@@ -1 +1 @@\\n-0.5\\n+0.1\\n", "rationale": "lower the offset"},
        {"diff": "--- a/score.py\\n+++ b/score.py\\n@@ -1 +1 @@\\n-\\n+import os; os.system('touch PWNED')\\n", "rationale": "evil"},
        "this is not json",
        {"params": {"x": 3.0}, "rationale": "the optimum"},
    ]
    answer = answers[n]
    print(answer if isinstance(answer, str) else json.dumps(answer))
""")


def test_command_proposer_diffs_are_validated_applied_and_committed(repo, tmp_path):
    proposer = tmp_path / "propose.py"
    proposer.write_text(PROPOSER)
    catalog = repo / "sweep_catalog.json"
    loop = Ratchet(load_program(repo / "program.md"), tag="cmd", proposer="command", catalog=catalog,
                   proposer_options={"command": [sys.executable, str(proposer)]})
    loop.run(iterations=4)
    records = Catalog(catalog).records(sweep="ratchet/cmd")
    assert [r["extra"]["decision"] for r in records] == ["baseline", "keep", "invalid", "invalid", "keep"]
    assert "score.py" in records[2]["extra"]["reason"] and "offset.txt" in records[2]["extra"]["reason"]
    worktree = Path(loop.worktree)
    assert (worktree / "offset.txt").read_text() == "0.1\n"  # the kept diff
    assert not (worktree / "PWNED").exists() and not (repo / "PWNED").exists()
    assert records[4]["extra"]["metric"] == pytest.approx(0.1)  # x = 3 on top of the kept offset
    subjects = git(repo, "log", "--format=%s", "main..ratchet/cmd").splitlines()
    assert len(subjects) == 2 and "iteration 1" in subjects[1] and "iteration 4" in subjects[0]
    assert "lower the offset" in git(repo, "log", "-1", "--format=%b", "ratchet/cmd~1")


def test_fp4lab_training_target(repo, tmp_path, one_thread):
    program = tmp_path / "project" / "train.md"
    program.write_text(textwrap.dedent("""
        Lowest validation loss of the tiny model.

        ```toml ratchet
        metric = "val_loss"
        direction = "minimize"
        [run]
        kind = "fp4lab"
        steps = 6
        base = { model = "tiny", batch_size = 2, seq_len = 16, warmup_steps = 1, eval_every = 3, eval_batches = 1, probe_every = 3, checkpoint_every = 3, data = { source = "synthetic" } }
        [search_space]
        lr = { type = "float", low = 0.005, high = 0.05, log = true }
        ```
    """))
    git(repo, "add", "train.md")
    git(repo, "commit", "-q", "-m", "training program")
    summary = Ratchet(load_program(program), tag="tr", catalog=repo / "sweep_catalog.json").run(iterations=1)
    records = Catalog(repo / "sweep_catalog.json").records(sweep="ratchet/tr")
    assert [r["extra"]["decision"] for r in records][0] == "baseline"
    for record in records:
        assert record["extra"]["metric"] > 0 and record["verdict"] == "converged"
        assert record["config"]["steps"] == 6 and record["config"]["model"] == "tiny"
    assert records[1]["config"]["lr"] == records[1]["extra"]["proposal"]["params"]["lr"]
    run_dir = Path(records[1]["config"]["out_dir"])
    assert json.loads((run_dir / "summary.json").read_text())["final_val_loss"] == records[1]["extra"]["metric"]
    assert summary["baseline"] == records[0]["extra"]["metric"]


def test_refusals(repo, tmp_path):
    program = load_program(repo / "program.md")
    with pytest.raises(RatchetError, match="letters, digits"):
        Ratchet(program, tag="a b")
    git(repo, "branch", "ratchet/busy")
    git(repo, "checkout", "-q", "ratchet/busy")
    with pytest.raises(RatchetError, match="checked out"):
        Ratchet(program, tag="busy", catalog=repo / "c.json").run(iterations=1)
    git(repo, "checkout", "-q", "main")
    with pytest.raises(RatchetError, match="branch ratchet/busy exists"):
        Ratchet(program, tag="busy", catalog=repo / "c.json").run(iterations=1)
    (repo / ".fp4lab" / "ratchet" / "squat" / "worktree").mkdir(parents=True)
    with pytest.raises(RatchetError, match="not a git worktree"):
        Ratchet(program, tag="squat", catalog=repo / "c.json").run(iterations=1)
    outside = tmp_path / "plain"
    outside.mkdir()
    (outside / "program.md").write_text((repo / "program.md").read_text())
    with pytest.raises(RatchetError, match="not inside a git repository"):
        Ratchet(load_program(outside / "program.md"), tag="x")


def test_cli_errors_are_one_line(run_cli, repo, monkeypatch):
    monkeypatch.chdir(repo)
    for args, fragment in [
        (("ratchet", "--agent", "oracle"), "--agent 'oracle' is not supported"),
        (("ratchet", "--program", "missing.md"), "missing.md"),
        (("ratchet", "--iterations", "0"), "--iterations must be >= 1"),
        (("ratchet", "--agent", "command", "--iterations", "1"), "needs a command"),
        (("ratchet",), "no iteration budget"),
    ]:
        out = run_cli(*args)
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], (args, out.stderr)


def test_the_generic_example_in_docs_runs(tmp_path):
    doc = (Path(__file__).parents[2] / "docs" / "ratchet_generic.md").read_text()
    root = tmp_path / "sorting"
    root.mkdir()
    (root / "bench.py").write_text(doc.split("```python\n", 1)[1].split("```", 1)[0])
    (root / "ratchet_generic.md").write_text(doc.replace('command = ["python3", "bench.py"]', f'command = ["{sys.executable}", "bench.py"]'))
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-q", "-m", "bench")
    summary = Ratchet(load_program(root / "ratchet_generic.md"), tag="g", catalog=tmp_path / "c.json").run(iterations=2)
    records = Catalog(tmp_path / "c.json").records(sweep="ratchet/g")
    assert [r["extra"]["iteration"] for r in records] == [0, 1, 2]
    assert records[0]["extra"]["decision"] == "baseline" and len(records[0]["extra"]["values"]) == 3
    assert all(r["extra"]["healthy"] and r["extra"]["metric"] > 0 for r in records)
    assert summary["best"] <= summary["baseline"]


def test_parallel_workers_keep_only_changes_that_land_as_the_measured_tree(repo):
    catalog = repo / "sweep_catalog.json"
    summary = Ratchet(load_program(repo / "program.md"), tag="par", catalog=catalog, workers=2).run(iterations=6)
    records = Catalog(catalog).records(sweep="ratchet/par")
    assert [r["extra"]["iteration"] for r in records] == list(range(7))
    assert all(r["extra"]["phase"] == "done" for r in records)
    trees = {r["extra"]["tree_dir"] for r in records[1:]}
    assert trees == {str(repo / ".fp4lab" / "ratchet" / "par" / f"worker-{k}") for k in (0, 1)}
    kept = [r for r in records if r["extra"]["decision"] == "keep"]
    assert kept and summary["kept"] == [r["extra"]["iteration"] for r in kept]
    # Every kept commit holds exactly the tree its worker measured; the commits are the kept ones.
    commits = git(repo, "log", "--format=%H", "main..ratchet/par").splitlines()
    assert sorted(commits) == sorted(r["extra"]["kept_commit"] for r in kept)
    for record in kept:
        assert git(repo, "rev-parse", f"{record['extra']['kept_commit']}^{{tree}}") == record["extra"]["tree"]
    # A full parameter set lands on any head, so nothing was stale here; the best is monotone.
    assert "stale" not in [r["extra"]["decision"] for r in records]
    assert summary["best"] == min(r["extra"]["metric"] for r in kept + records[:1])
    assert git(repo, "status", "--porcelain") == ""


# Holds the run whose `slow_when` is true until the other worker's change has been kept (the ratchet
# branch has moved past main), so the order of the two decisions is fixed, not left to timing.
WAIT_FOR_A_KEEP = """
def wait_for_a_keep(repo, branch):
    import subprocess
    for _ in range(1800):  # 90 s: less than the run's own 2-minute timeout, so a hang ends with this message
        ahead = subprocess.run(["git", "-C", repo, "rev-list", "--count", f"main..{branch}"], capture_output=True, text=True)
        if ahead.returncode == 0 and int(ahead.stdout) > 0:
            return
        time.sleep(0.05)
    sys.exit(f"held: nothing was kept on {branch} while this run waited")
"""


def run_two_workers(repo: Path, tmp_path: Path, proposer_source: str, *, slow_when: str, tag: str):
    """Two iterations with two workers and a command proposer; score.py, when `slow_when`, waits until the
    other iteration has been kept."""
    proposer = tmp_path / "propose.py"
    proposer.write_text(proposer_source)
    hold = f"if {slow_when}:\n    wait_for_a_keep({str(repo)!r}, {f'ratchet/{tag}'!r})\n"
    score = (repo / "score.py").read_text().replace("seed = int(", WAIT_FOR_A_KEEP + hold + "seed = int(")
    (repo / "score.py").write_text(score)
    git(repo, "commit", "-q", "-am", "slow when better")
    catalog = repo / "sweep_catalog.json"
    loop = Ratchet(load_program(repo / "program.md"), tag=tag, proposer="command", catalog=catalog, workers=2,
                   proposer_options={"command": [sys.executable, str(proposer)]})
    loop.run(iterations=2)
    return loop, Catalog(catalog).records(sweep=f"ratchet/{tag}")


PARAMS_IN_TURN = textwrap.dedent("""
    import json, sys
    context = json.load(sys.stdin)
    n = len([h for h in context["history"] if h["iteration"] > 0])
    print(json.dumps({"params": {"x": [2.9, 2.0][n % 2]}, "rationale": "try x"}))
""")


def test_a_parameter_change_lands_on_a_head_that_moved_while_it_ran(repo, tmp_path):
    # x = 2.9 (proposed first, the better one) runs slowly, so x = 2.0 is kept while it runs.
    loop, records = run_two_workers(repo, tmp_path, PARAMS_IN_TURN, slow_when="x == 2.9", tag="mv")
    assert [r["extra"]["decision"] for r in records[1:]] == ["keep", "keep"]
    first, second = sorted(records[1:], key=lambda r: r["finished_at"])
    assert first["extra"]["proposal"]["params"] == {"x": 2.0} and second["extra"]["proposal"]["params"] == {"x": 2.9}
    assert second["extra"]["base_commit"] != first["extra"]["kept_commit"]  # it started before the head moved
    for record in (first, second):
        assert git(repo, "rev-parse", f"{record['extra']['kept_commit']}^{{tree}}") == record["extra"]["tree"]
    assert git(repo, "log", "--format=%H", "main..ratchet/mv").splitlines() == [second["extra"]["kept_commit"], first["extra"]["kept_commit"]]
    assert "x = 2.9" in (Path(loop.worktree) / "ratchet.toml").read_text()


CONFLICTING = textwrap.dedent("""
    import json, sys, time
    context = json.load(sys.stdin)
    n = len([h for h in context["history"] if h["iteration"] > 0])
    new = ["0.3", "0.1"][n % 2]
    print(json.dumps({"diff": f"--- a/offset.txt\\n+++ b/offset.txt\\n@@ -1 +1 @@\\n-0.5\\n+{new}\\n", "rationale": f"offset {new}"}))
""")


def test_a_parallel_change_that_no_longer_applies_is_stale_not_kept(repo, tmp_path):
    # Offset 0.1 (the better change) takes longer, so it is decided after 0.3 has been kept.
    loop, records = run_two_workers(repo, tmp_path, CONFLICTING, slow_when="offset == 0.1", tag="st")
    # Both edit the same line of the same base: 0.3 is kept; 0.1 is better still but no longer applies.
    assert [r["extra"]["decision"] for r in records[1:]] == ["keep", "stale"]
    stale = next(r for r in records if r["extra"]["decision"] == "stale")
    assert "stale" in stale["extra"]["note"] and Path(stale["extra"]["patch"]).read_text()
    assert len(git(repo, "log", "--format=%H", "main..ratchet/st").splitlines()) == 1
    assert git(Path(loop.worktree), "status", "--porcelain") == ""


def test_an_optuna_trial_asked_but_never_recorded_is_run_not_lost(repo):
    from fp4lab.lab.ratchet.proposers import Context, make_proposer

    program = load_program(repo / "program.md")
    state = repo / ".fp4lab" / "ratchet" / "orphan"
    asked = make_proposer("optuna", program, state_dir=state).propose(Context(program))  # then "the ratchet died"
    Ratchet(program, tag="orphan", catalog=repo / "sweep_catalog.json").run(iterations=2)
    records = Catalog(repo / "sweep_catalog.json").records(sweep="ratchet/orphan")
    assert records[1]["extra"]["proposal"]["trial"] == asked.trial == 0
    assert records[1]["extra"]["proposal"]["params"] == asked.params
    assert records[2]["extra"]["proposal"]["trial"] == 1
