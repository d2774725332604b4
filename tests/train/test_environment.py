"""The environment on record: summary.json and config.json say what the run ran on; the report has a
line per environment and flags a comparison whose runs came from more than one."""

from __future__ import annotations

import json
import platform
import socket
import subprocess
from pathlib import Path

import torch

from fp4lab.lab.records.ledger import environment_notes
from fp4lab.train.environment import COMPARED, environment
from fp4lab.train.loop import run
from tests.train.test_train import small

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_records_what_it_ran_on(tmp_path):
    config = small(tmp_path, steps=2)
    run(config, progress=False)
    folder = Path(config.out_dir)
    recorded = json.loads((folder / "summary.json").read_text())["environment"]
    assert recorded == json.loads((folder / "config.json").read_text())["environment"]
    assert recorded["torch"] == torch.__version__ and recorded["cuda"] == torch.version.cuda
    assert recorded["python"] == platform.python_version() and recorded["hostname"] == socket.gethostname()
    assert recorded["gpu"] is None and recorded["gpu_count"] == 0 and recorded["driver"] is None  # a CPU run
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a checkout: the commit, marked when the package's files have changes
        assert recorded["fp4lab_commit"].removesuffix("+dirty") == head.stdout.strip()
    assert set(COMPARED) <= set(recorded)


def _record(run_id: str, recipe: str, torch_version: str, gpu: str | None = None) -> dict:
    env = environment(torch.device("cpu")) | {"torch": torch_version, "gpu": gpu, "gpu_count": 1 if gpu else 0}
    return {"id": run_id, "recipe": recipe, "config": {"recipe": recipe}, "extra": {"environment": env}}


def test_the_report_names_each_environment_and_flags_a_mixed_comparison():
    bf16 = _record("a" * 12, "bf16", "2.13.0")
    same = _record("b" * 12, "nvfp4", "2.13.0")
    other = _record("c" * 12, "mxfp4", "2.11.0", gpu="NVIDIA H200")
    notes = environment_notes([bf16, same, other], [[bf16], [same], [other]],
                              {r["id"]: [bf16["id"]] for r in (bf16, same, other)})
    assert notes[0].startswith("environment 1: torch 2.13.0") and notes[0].endswith("CPU (2 runs)")
    assert notes[1].startswith("environment 2: torch 2.11.0") and "1 x NVIDIA H200" in notes[1] and notes[1].endswith("(1 run)")
    assert notes[2].startswith("mxfp4 (") and notes[2].endswith("ran in environments 1, 2: the comparison mixes them")
    assert len(notes) == 3  # nvfp4 ran where its reference did: no warning
    alone = environment_notes([bf16, same], [[bf16], [same]], {bf16["id"]: [bf16["id"]], same["id"]: [bf16["id"]]})
    assert alone == [notes[0]]
    moved = _record("d" * 12, "nvfp4", "2.13.0")
    moved["extra"]["environment"] |= {"hostname": "another-node"}
    assert len(environment_notes([bf16, moved], [[bf16], [moved]], {moved["id"]: [bf16["id"]]})) == 1  # the host alone differs
