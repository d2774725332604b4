"""docs/LEDGER.md's tables come from the committed catalog and runs: `fp4lab report` on them writes
docs/ledger/<report>/'s Markdown and CSV again byte for byte, so the published ledger cannot drift from
its data or from the report code."""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LEDGER = REPO / "docs" / "ledger"
REPORTS = {  # committed report folder -> (sweep, extra report options)
    "ledger": ("ledger", ["--claims", str(REPO / "sweeps" / "ledger_claims.toml")]),
    "stress": ("ledger_stress", []),
    "stress_adamw": ("ledger_stress_adamw", []),
}


@pytest.fixture(scope="module")
def ledger_copy(tmp_path_factory) -> Path:
    """The committed catalog at docs/ledger/ and its runs unpacked beside, as the LEDGER's commands have them."""
    root = tmp_path_factory.mktemp("ledger")
    (root / "docs" / "ledger").mkdir(parents=True)
    shutil.copy(LEDGER / "sweep_catalog.json", root / "docs" / "ledger" / "sweep_catalog.json")
    with tarfile.open(LEDGER / "runs.tar.xz") as archive:
        archive.extractall(root, filter="data")
    return root


@pytest.mark.parametrize("folder", sorted(REPORTS))
def test_the_committed_report_is_what_fp4lab_report_writes_from_the_committed_catalog(folder, ledger_copy, run_cli, monkeypatch):
    sweep, options = REPORTS[folder]
    monkeypatch.chdir(ledger_copy)
    out = ledger_copy / "docs" / "ledger" / folder
    result = run_cli("report", sweep, "--catalog", "docs/ledger/sweep_catalog.json", "--out", f"docs/ledger/{folder}", *options)
    assert result.returncode == 0, result.stderr
    committed = sorted(p.name for p in (LEDGER / folder).iterdir() if p.suffix in (".md", ".csv"))
    assert "ledger.md" in committed and "ledger.csv" in committed
    for name in committed:
        assert (out / name).read_text() == (LEDGER / folder / name).read_text(), (
            f"docs/ledger/{folder}/{name} is not what the report writes from the committed catalog: run "
            f"`fp4lab report {sweep} --catalog docs/ledger/sweep_catalog.json --out docs/ledger/{folder}` and commit it"
        )
