"""fp4lab sweep end to end on this machine: spec -> scripts -> runs -> scanned catalog rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fp4lab.lab.catalog import Catalog

SPEC = """
name = "mini"
[base]
model = "tiny"
steps = 6
batch_size = 2
seq_len = 32
warmup_steps = 1
eval_every = 3
eval_batches = 1
probe_every = 3
checkpoint_every = 3
[base.data]
source = "synthetic"
[axes]
recipe = ["bf16", "nvfp4"]
"""


@pytest.fixture
def cli(run_cli, monkeypatch, tmp_path):
    """The CLI, run from inside tmp_path (jobs/, runs/ and the catalog land there)."""
    monkeypatch.chdir(tmp_path)
    return run_cli


def test_dry_run_writes_scripts_and_registers_runs(cli, tmp_path):
    (tmp_path / "mini.toml").write_text(SPEC)
    out = cli("sweep", "mini.toml", "--dry-run")
    assert out.returncode in (0, None), out.stderr
    assert "2 runs, 2 to run" in out.stdout
    manifest = json.loads((tmp_path / "jobs" / "mini" / "manifest.json").read_text())
    ids = [r["id"] for r in manifest["runs"]]
    assert all((tmp_path / "jobs" / "mini" / f"{i}.sbatch").exists() for i in ids)
    records = Catalog(tmp_path / "sweep_catalog.json").records(sweep="mini")
    assert [r["id"] for r in records] == ids and {r["state"] for r in records} == {"pending"}
    assert not (tmp_path / "runs").exists()  # nothing started


def test_local_sweep_runs_scans_records_and_skips_completed_runs(cli, tmp_path):
    (tmp_path / "mini.toml").write_text(SPEC)
    out = cli("sweep", "mini.toml", "--workers", "2")
    assert out.returncode in (0, None), out.stderr
    records = Catalog(tmp_path / "sweep_catalog.json").records(sweep="mini")
    assert {r["recipe"] for r in records} == {"bf16", "nvfp4"}
    for record in records:
        assert record["state"] == "completed" and record["verdict"] == "converged", record
        assert record["attempts"] == 1 and record["finished_at"] and record["started_at"]
        summary = record["summary"]
        assert summary["final_val_loss"] > 0 and summary["tokens_per_s"] > 0
        assert set(summary["loss_at_steps"]) == {"0", "5"}
        assert Path(record["paths"]["run_dir"], "summary.json").exists()
    again = cli("sweep", "mini.toml")
    assert "0 to run, 2 skipped" in again.stdout
    status = cli("status", "mini")
    assert status.returncode in (0, None) and status.stdout.count("completed") == 2


def test_sweep_errors_are_one_line(cli, tmp_path):
    (tmp_path / "bad.toml").write_text(SPEC.replace('recipe = ["bf16", "nvfp4"]', 'recipe = ["bf16", "nope"]'))
    for args, fragment in [
        (("sweep", "bad.toml"), "unknown recipe 'nope'"),
        (("sweep", "missing.toml"), "missing.toml"),
        (("sweep", "bad.toml", "--executor", "cloud"), "--executor 'cloud' is not supported"),
        (("status",), "no catalog"),
    ]:
        out = cli(*args)
        assert out.returncode == 2, (args, out.stdout)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], (args, out.stderr)
