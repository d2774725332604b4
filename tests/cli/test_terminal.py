"""The CLI as a person sees it in an 80-column terminal: a real tmux pane, the real `fp4lab` command,
a 2-run sweep interrupted with Ctrl-C and resumed, then status, scan and report; the assertions read
the pane (`tmux capture-pane`), not the program's internals."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.tmux, pytest.mark.slow]

SPEC = """
name = "term"
method = "grid"

[base]
model = "tiny"
steps = 40
batch_size = 2
seq_len = 32
warmup_steps = 2
eval_every = 10
eval_batches = 1
probe_every = 10
checkpoint_every = 2
device = "cpu"

[base.data]
source = "synthetic"

[axes]
recipe = ["bf16", "nvfp4"]
"""


class Terminal:
    """One tmux pane of `width` columns on a private tmux server, running bash in `folder`."""

    def __init__(self, folder: Path, width: int = 80, height: int = 50) -> None:
        self.socket, self.session, self.commands = f"fp4lab-test-{uuid.uuid4().hex[:8]}", "t", 0
        config = folder / "tmux.conf"
        config.write_text("set -g history-limit 50000\nset -g status off\n")
        bin_dir = str(Path(sys.executable).parent)  # the venv's `fp4lab` console script
        env = os.environ | {"PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""), "PS1": "$ "}
        self._tmux("-f", str(config), "new-session", "-d", "-s", self.session, "-x", str(width), "-y", str(height),
                   "-c", str(folder), "bash --norc --noprofile", env=env)  # fmt: skip

    def _tmux(self, *args: str, env: dict | None = None) -> str:
        done = subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, env=env, timeout=30, check=True)
        return done.stdout

    def screen(self) -> str:
        """Everything the pane shows and has scrolled past; a line the pane wrapped comes back whole."""
        return self._tmux("capture-pane", "-p", "-J", "-t", self.session, "-S", "-", "-E", "-")  # -J: a wrapped line as one

    def type(self, text: str) -> None:
        self._tmux("send-keys", "-t", self.session, "-l", text)
        self._tmux("send-keys", "-t", self.session, "Enter")

    def ctrl_c(self) -> None:
        self._tmux("send-keys", "-t", self.session, "C-c")

    def run(self, command: str, timeout: float = 300) -> tuple[int, str]:
        """Type `command`, wait for it to end; (its exit code, what the pane showed from its prompt on)."""
        self.commands += 1
        marker = f"__done_{self.commands}__"
        self.type(f"{command}; echo {marker}$?")
        text = self.wait_for(rf"{marker}(\d+)", timeout)
        output = text[text.index(f"echo {marker}$?"):]  # from the line typed on
        return int(re.search(rf"^{marker}(\d+)", output, re.MULTILINE).group(1)), output

    def wait_for(self, pattern: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if re.search(pattern, text):
                return text
            assert time.monotonic() < deadline, f"waited {timeout:.0f} s for {pattern!r}; the pane shows:\n{text[-3000:]}"
            time.sleep(0.2)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=30)


@pytest.fixture
def terminal(tmp_path):
    term = Terminal(tmp_path)
    yield term
    term.close()


def rows_naming(text: str, *words: str) -> list[str]:
    """The table rows (lines drawn with │) that hold every word in `words`."""
    return [line for line in text.splitlines() if "│" in line and all(w in line for w in words)]


def test_a_sweep_interrupted_and_resumed_reads_right_at_80_columns(terminal, tmp_path):
    (tmp_path / "term.toml").write_text(SPEC)
    terminal.type("fp4lab sweep term.toml; echo __sweep_$?")
    # The live view counts steps as the logs do (from 0, to steps - 1); stop the first run midway.
    terminal.wait_for(r"\b(1[0-9]|2[0-9])/39\b", timeout=240)
    terminal.ctrl_c()
    interrupted = terminal.wait_for(r"__sweep_(\d+)", timeout=120)
    assert "__sweep_130" in interrupted
    words = " ".join(interrupted.split())  # rich wraps a long line at 80 columns
    stopped_at = int(re.search(r"recipe=bf16: interrupted at step (\d+) \(resumes from its checkpoint\)", words).group(1))
    assert 10 <= stopped_at < 40
    assert "interrupted: 1 run(s) stopped" in words
    assert "None" not in interrupted and "timeout" not in interrupted

    code, resumed = terminal.run("fp4lab sweep term.toml", timeout=300)
    assert code == 0, resumed
    assert f"resumed from step {stopped_at}" in " ".join(resumed.split())  # the first run's line
    table = resumed[resumed.index("runs of term"):]
    for recipe in ("bf16", "nvfp4"):  # the run and its verdict readable at 80 columns
        assert rows_naming(table, f" {recipe} ", "converged"), table
    assert "None" not in resumed

    code, status = terminal.run("fp4lab status")
    assert code == 0 and "None" not in status
    header = next(line for line in status.splitlines() if "┃" in line)
    assert "run (recipe)" in header and "verdict" in header, status
    assert rows_naming(status, " bf16 ", "converged") and rows_naming(status, " nvfp4 ", "converged")
    assert "all rows: sweep term" in status  # a constant column is said once, not repeated

    code, scanned = terminal.run("fp4lab scan")  # no argument: the catalog's runs, named
    assert code == 0 and "None" not in scanned
    assert rows_naming(scanned, " bf16 ", "converged") and rows_naming(scanned, " nvfp4 ", "converged")

    code, reported = terminal.run(f"fp4lab report term --out {shlex.quote(str(tmp_path / 'report'))}")
    assert code == 0 and "None" not in reported
    assert "excess: + = worse than bf16" in reported and "positive = worse than bf16" in reported  # one sign, said
    header = [line for line in reported.splitlines() if "┃" in line]
    assert any("val" in line for line in header) and any("excess %" in line for line in header)
    nvfp4_row = rows_naming(reported, " nvfp4 ")
    assert nvfp4_row and re.search(r"[+-]\d+\.\d\d", nvfp4_row[0]), reported  # its val excess, signed
    assert "1 seed" in reported  # one seed: a value marked as such, not "n/a"

    # One answer for a run, read from its folder or from its log (the log prints some steps; the
    # catalog leads the scan to the folder's every-step metrics).
    logs = sorted((tmp_path / "jobs" / "term" / "logs").glob("*.local.log"))
    assert len(logs) == 2
    for log in logs:
        folder = tmp_path / "runs" / "term" / log.name.split(".")[0]
        both = subprocess.run([sys.executable, "-m", "fp4lab.cli", "scan", "--json", str(folder), str(log)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        by_folder, by_log = json.loads(both.stdout)
        assert by_folder == by_log and by_folder["last_step"] == 39, both.stderr
