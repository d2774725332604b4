"""`fp4lab forget SWEEP`: a sweep's rows leave the catalog after a confirmation; a run another sweep
shares stays with it; run folders stay unless --delete-runs; a sweep with a run in flight is refused
and a refused command has touched nothing."""

from __future__ import annotations

import json

import pytest

from fp4lab.lab.records.catalog import sweeps_of
from fp4lab.train import run_folder
from tests.lab.test_sweep import registered
from tests.lab.test_sweep_trust import spec


@pytest.fixture
def two_sweeps(run_cli, monkeypatch, tmp_path):
    """Sweeps "first" (bf16, nvfp4) and "second" (bf16, mxfp4) sharing the bf16 run, each run with a folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "first.toml").write_text(spec("first", ["bf16", "nvfp4"]))
    (tmp_path / "second.toml").write_text(spec("second", ["bf16", "mxfp4"]))
    registered(tmp_path, "first.toml")
    catalog = registered(tmp_path, "second.toml")
    for record in catalog.records():
        folder = catalog.resolve(record["paths"]["run_dir"])
        folder.mkdir(parents=True)
        (folder / "metrics.jsonl").write_text("{}\n")
    return catalog


def _by_recipe(catalog) -> dict[str, dict]:
    return {r["recipe"]: r for r in catalog.records()}


def test_forget_removes_the_sweeps_own_rows_keeps_shared_ones_and_every_folder(two_sweeps, run_cli):
    catalog = two_sweeps
    before = _by_recipe(catalog)
    out = run_cli("forget", "first", "--yes")
    assert out.returncode in (0, None), out.stderr
    assert "1 run(s) removed, 1 shared kept" in out.stdout
    after = _by_recipe(catalog)
    assert sorted(after) == ["bf16", "mxfp4"]
    assert (after["bf16"]["sweep"], sweeps_of(after["bf16"])) == ("second", ["second"])
    assert all(catalog.resolve(r["paths"]["run_dir"]).is_dir() for r in before.values())  # folders kept
    assert {row["sweep"] for row in json.loads(run_cli("status", "--json").stdout)} == {"second"}


def test_delete_runs_deletes_the_removed_rows_folders_only(two_sweeps, run_cli):
    catalog = two_sweeps
    folders = {recipe: catalog.resolve(r["paths"]["run_dir"]) for recipe, r in _by_recipe(catalog).items()}
    out = run_cli("forget", "first", "--yes", "--delete-runs")
    assert out.returncode in (0, None), out.stderr
    assert "1 run folder(s) deleted" in out.stdout
    assert not folders["nvfp4"].exists() and folders["bf16"].is_dir() and folders["mxfp4"].is_dir()


def test_refusals_touch_nothing(two_sweeps, run_cli):
    catalog = two_sweeps
    text = catalog.path.read_bytes()
    unconfirmed = run_cli("forget", "first")  # stdin is no terminal here: no prompt, a refusal
    assert unconfirmed.returncode == 2 and "add --yes to confirm" in unconfirmed.stderr
    unknown = run_cli("forget", "third", "--yes")
    assert unknown.returncode == 2 and "no sweep 'third'" in unknown.stderr and "first, second" in unknown.stderr
    nvfp4 = _by_recipe(catalog)["nvfp4"]
    with run_folder.hold(catalog.resolve(nvfp4["paths"]["run_dir"])):  # a trainer is at work in it
        busy = run_cli("forget", "first", "--yes", "--delete-runs")
    assert busy.returncode == 2 and "1 run(s) in flight" in busy.stderr and nvfp4["id"] in busy.stderr
    for out in (unconfirmed, unknown, busy):
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert catalog.path.read_bytes() == text
    assert all(catalog.resolve(r["paths"]["run_dir"]).is_dir() for r in catalog.records())
