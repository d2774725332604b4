"""scripts/ratchet_round.sh: a ratchet's rounds on machines that keep nothing. A round on one clone,
its four files carried to a fresh clone, and the next round there continues the same ratchet: the
same records, the branch grown from the kept commits, the optuna study resumed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from fp4lab.lab.records.catalog import Catalog
from tests.lab.test_ratchet import git, make_repo

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ratchet_round.sh"


def install_round_script(repo: Path) -> None:
    """The round script and the corpus step it calls, into the project's scripts/."""
    (repo / "scripts").mkdir()
    for script in (SCRIPT, SCRIPT.parent / "build_corpus.py"):
        shutil.copy(script, repo / "scripts" / script.name)


def round_(repo: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    return subprocess.run(["bash", "scripts/ratchet_round.sh", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=600)


def iterations(catalog: Path) -> dict[int, dict]:
    return {r["extra"]["iteration"]: r for r in Catalog(catalog).records(sweep="ratchet/program") if "iteration" in r["extra"]}


def test_a_round_on_a_fresh_clone_continues_the_ratchet_from_the_carried_files(tmp_path):
    first = make_repo(tmp_path)
    install_round_script(first)
    git(first, "add", "-A")
    git(first, "commit", "-q", "-m", "the round script")

    out1 = tmp_path / "out1"
    done = round_(first, "300", str(out1), "program.md", "2")
    assert done.returncode == 0, done.stderr[-3000:]
    assert {p.name for p in out1.iterdir()} == {"sweep_catalog.json", "branch", "branch.bundle", "state.tar.xz"}
    # the plot command it prints names the round's catalog, so that it runs as printed
    assert "plot: fp4lab report --ratchet program --catalog docs/ratchet/program/sweep_catalog.json" in " ".join(done.stdout.split())
    before = iterations(out1 / "sweep_catalog.json")
    assert sorted(before) == [0, 1, 2] and all(r["extra"]["phase"] == "done" for r in before.values())
    head1, base1 = (out1 / "branch").read_text().split()
    assert base1 == git(first, "rev-parse", "main") and head1 == git(first, "rev-parse", "ratchet/program") != base1

    # A fresh machine: a clone without the branch or the state, the files where a round publishes them.
    second = tmp_path / "second"
    git(tmp_path, "clone", "-q", str(first), str(second))
    assert not git(second, "branch", "--list", "ratchet/program") and not (second / ".fp4lab").exists()
    git(second, "config", "user.name", "Test User")
    git(second, "config", "user.email", "test@example.invalid")
    shutil.copytree(out1, second / "docs" / "ratchet" / "program")

    out2 = tmp_path / "out2"
    done = round_(second, "300", str(out2), "program.md", "4")
    assert done.returncode == 0, done.stderr[-3000:]
    after = iterations(out2 / "sweep_catalog.json")
    assert sorted(after) == [0, 1, 2, 3, 4]
    for number, record in before.items():  # the carried records, unchanged
        assert after[number]["extra"]["metric"] == record["extra"]["metric"] and after[number]["state"] == record["state"]
    trials = [after[n]["extra"]["proposal"]["trial"] for n in (1, 2, 3, 4)]
    assert trials == [0, 1, 2, 3], trials  # the study went on from its journal, not from trial 0 again
    head2 = (out2 / "branch").read_text().split()[0]
    assert head2 == git(second, "rev-parse", "ratchet/program")
    subprocess.run(["git", "-C", str(second), "merge-base", "--is-ancestor", head1, head2], check=True)
    state = second / ".fp4lab" / "ratchet" / "program"
    assert (state / "patches" / "iter-0001.patch").exists() and (state / "patches" / "iter-0004.patch").exists()
    rows = (state / "results.tsv").read_text().splitlines()
    assert len(rows) == 1 + 5, rows  # the header and iterations 0-4

    # The carried state holds no worktree and no checkpoint.
    listing = subprocess.run(["tar", "-tJf", str(out2 / "state.tar.xz")], check=True, capture_output=True, text=True).stdout.split()
    assert "./results.tsv" in listing and not any(name.startswith("./worktree") for name in listing)


def test_bad_arguments_are_refused_with_the_usage_and_write_nothing(tmp_path):
    repo = make_repo(tmp_path)
    install_round_script(repo)
    out = tmp_path / "out"
    for args, message in ((("soon", str(out), "program.md"), "usage"), (("60", str(out), "missing.md"), "no such program"),
                          (("60", str(out), "program.md", "two"), "ITERATIONS"),
                          (("60", str(out), "program.md", "--", "--catalog", "x.json"), "--catalog")):
        done = round_(repo, *args)
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert not out.exists() and not (repo / "docs").exists() and not (repo / ".fp4lab").exists()


def test_ctrl_c_stops_the_round_cleanly_and_its_state_still_comes_out(tmp_path):
    """A Ctrl-C at the terminal (SIGINT to the round's process group) reaches the ratchet, which stops
    as at a terminal (exit 130, the running iteration recorded as interrupted), and the round still
    writes its four files; with timeout's own process group the ratchet would never see it."""
    import signal
    import time

    repo = make_repo(tmp_path)
    install_round_script(repo)
    calls = tmp_path / "calls.txt"
    (tmp_path / "calls.txt.block").write_text("")
    env = dict(os.environ, PYTHON=sys.executable, CALLS_FILE=str(calls), BLOCK_AT="3")  # iteration 1's first run waits
    out = tmp_path / "out"
    round_ = subprocess.Popen(["bash", "scripts/ratchet_round.sh", "300", str(out), "program.md", "3"], cwd=repo, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (calls.exists() and len(calls.read_text().splitlines()) >= 3) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(round_.pid, signal.SIGINT)
    stdout, stderr = round_.communicate(timeout=120)
    assert round_.returncode == 0 and "the ratchet ended with 130" in stderr, stderr[-2000:]
    assert {p.name for p in out.iterdir()} == {"sweep_catalog.json", "branch", "state.tar.xz"}
    records = iterations(out / "sweep_catalog.json")
    assert records[0]["extra"]["phase"] == "done" and records[1]["extra"]["phase"] == "running"
