"""Shell completion: `fp4lab --install-completion bash` installs a script that a real bash sources, and
its completion function, run as bash runs it on Tab, completes commands, options, choices, recipe
names and the catalog's sweep names."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.lab.test_sweep import SPEC, registered

FP4LAB = Path(sys.executable).with_name("fp4lab")
pytestmark = pytest.mark.skipif(not FP4LAB.exists() or shutil.which("bash") is None,
                                reason="needs bash and the installed fp4lab entry point")


def complete(line: str, cwd: Path, env: dict[str, str]) -> list[str]:
    """What bash's completion function offers for `line` (the word being typed is its last, "" after a space)."""
    words = line.split(" ")
    script = env["HOME"] + "/.bash_completions/fp4lab.sh"
    probe = (f"source {script}; COMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}; "
             "_fp4lab_completion fp4lab; printf '%s\\n' \"${COMPREPLY[@]}\"")
    done = subprocess.run(["bash", "-c", probe], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if line]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "HOME": str(home), "SHELL": "/bin/bash", "PATH": f"{FP4LAB.parent}{os.pathsep}{os.environ['PATH']}"}
    # Typer finds the shell among the process's ancestors (shellingham), so the installer runs under bash
    # itself, not exec'd by it (hence the `; exit`): under a runner whose ancestry has no shell it would find
    # none ("Shell None is not supported").
    done = subprocess.run(["bash", "-c", '"$0" --install-completion; exit $?', str(FP4LAB)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "source" in (home / ".bashrc").read_text() and (home / ".bash_completions" / "fp4lab.sh").is_file()
    return env


def test_commands_options_and_choices_complete(installed, tmp_path):
    assert complete("fp4lab swe", tmp_path, installed) == ["sweep"]
    assert complete("fp4lab sweep --exe", tmp_path, installed) == ["--executor"]
    assert complete("fp4lab sweep --executor ", tmp_path, installed) == ["local", "slurm", "sbatch"]
    assert complete("fp4lab train --recipe nvfp4-c", tmp_path, installed) == ["nvfp4-cta", "nvfp4-cta-h16"]


def test_sweep_names_come_from_the_catalog(installed, tmp_path):
    assert complete("fp4lab status ", tmp_path, installed) == []  # no catalog here: nothing to offer
    (tmp_path / "mini.toml").write_text(SPEC)
    registered(tmp_path, "mini.toml")
    (tmp_path / "other.toml").write_text(SPEC.replace('name = "mini"', 'name = "other"'))
    registered(tmp_path, "other.toml")
    assert complete("fp4lab status ", tmp_path, installed) == ["mini", "other"]
    assert complete("fp4lab report o", tmp_path, installed) == ["other"]
    assert complete("fp4lab sweep other.toml --after m", tmp_path, installed) == ["mini"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    catalog = str(tmp_path / "sweep_catalog.json")
    assert complete(f"fp4lab forget --catalog {catalog} ", elsewhere, installed) == ["mini", "other"]
