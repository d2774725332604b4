"""scripts/ledger_round.sh: the ledger's rounds on machines that keep nothing. A round writes the catalog,
the runs' metrics and the reports; the next round, on a fresh copy with those carried in, skips what is
done; Ctrl-C at the terminal stops the sweep at a checkpoint and the results still come out."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from fp4lab.lab.records.catalog import Catalog

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ledger_round.sh"
SPEC = """name = "{name}"
method = "grid"

[base]
model = "tiny"
steps = {steps}
batch_size = 4
seq_len = 32
warmup_steps = 1
eval_every = 4
eval_batches = 1
probe_every = 4
checkpoint_every = 4
device = "cpu"

[base.data]
source = "synthetic"

[axes]
seed = [{seeds}]
"""


def project(root: Path, specs: dict[str, tuple[int, str]]) -> Path:
    """A folder with the round script and tiny specs {name: (steps, seeds)}, as a checkout would have them."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy(SCRIPT, root / "scripts" / "ledger_round.sh")
    shutil.copy(SCRIPT.parent / "build_corpus.py", root / "scripts" / "build_corpus.py")
    for name, (steps, seeds) in specs.items():
        (root / f"{name}.toml").write_text(SPEC.format(name=name, steps=steps, seeds=seeds))
    return root


def start_round(root: Path, *args: str) -> subprocess.Popen:
    # Its own session and process group, as a terminal's job: SIGINT to the group is a Ctrl-C. SIGINT's
    # default action, as a terminal's job has it (a shell that started pytest in the background set it
    # to be ignored, and the ignoring is inherited).
    return subprocess.Popen(["bash", "scripts/ledger_round.sh", *args], cwd=root, env=dict(os.environ, PYTHON=sys.executable),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip


def states(catalog: Path) -> dict[str, str]:
    return {r["id"]: r["state"] for r in Catalog(catalog).records()}


def test_a_round_on_a_fresh_copy_skips_the_runs_the_carried_catalog_completed(tmp_path):
    first = project(tmp_path / "first", {"tiny_ledger": (8, "0")})
    round_ = start_round(first, "600", str(tmp_path / "out1"), "tiny_ledger.toml")
    _, stderr = round_.communicate(timeout=600)
    assert round_.returncode == 0, stderr[-3000:]
    out1 = tmp_path / "out1"
    assert {p.name for p in out1.iterdir()} == {"sweep_catalog.json", "runs.tar.xz", "reports.tar.xz"}
    done = states(out1 / "sweep_catalog.json")
    assert len(done) == 1 and set(done.values()) == {"completed"}, done
    with tarfile.open(out1 / "runs.tar.xz") as archive:
        names = archive.getnames()
    assert sum(n.endswith("metrics.jsonl") for n in names) == 1 and not any(n.endswith(".pt") for n in names), names
    with tarfile.open(out1 / "reports.tar.xz") as archive:
        assert any(n.startswith("reports/tiny_ledger/") for n in archive.getnames())

    second = project(tmp_path / "second", {"tiny_ledger": (8, "0")})
    (second / "docs" / "ledger").mkdir(parents=True)
    for name in ("sweep_catalog.json", "runs.tar.xz"):
        shutil.copy(out1 / name, second / "docs" / "ledger" / name)
    round_ = start_round(second, "600", str(tmp_path / "out2"), "tiny_ledger.toml")
    _, stderr = round_.communicate(timeout=600)
    assert round_.returncode == 0, stderr[-3000:]
    # nothing trained again: no run wrote a checkpoint here, and the records are the carried ones
    assert not list((second / "runs").rglob("*.pt"))
    carried = {r["id"]: r for r in Catalog(out1 / "sweep_catalog.json").records()}
    kept = {r["id"]: r for r in Catalog(tmp_path / "out2" / "sweep_catalog.json").records()}
    assert {i: r.get("finished_at") for i, r in kept.items()} == {i: r.get("finished_at") for i, r in carried.items()}


def test_ctrl_c_stops_the_sweep_at_a_checkpoint_starts_no_further_spec_and_writes_the_results(tmp_path):
    """SIGINT to the round's process group, as a terminal's Ctrl-C: the sweep passes it to its run, which
    checkpoints and is recorded interrupted, the sweep exits 130, the next spec never starts, and the
    results are written. With timeout's own process group the sweep would never see the Ctrl-C."""
    root = project(tmp_path / "project", {"long_ledger": (100000, "0"), "next_ledger": (8, "0")})
    out = tmp_path / "out"
    round_ = start_round(root, "600", str(out), "long_ledger.toml", "next_ledger.toml")
    deadline = time.monotonic() + 180
    while not list((root / "runs").rglob("*.pt")) and time.monotonic() < deadline:  # the run has checkpointed once
        time.sleep(0.5)
    os.killpg(round_.pid, signal.SIGINT)
    _, stderr = round_.communicate(timeout=180)
    assert round_.returncode == 0 and "long_ledger.toml ended with 130" in stderr, stderr[-3000:]
    assert "interrupted; writing the results" in stderr
    recorded = states(out / "sweep_catalog.json")
    assert list(recorded.values()) == ["interrupted"], recorded  # next_ledger's run never started
    assert (out / "runs.tar.xz").exists() and (out / "reports.tar.xz").exists()
