"""fp4lab sweep --executor slurm on the real local cluster (scripts/local-slurm.sh): the job array runs,
`fp4lab status` refreshes the catalog from Slurm and the run folders, and a cancelled job is recorded."""

from __future__ import annotations

import subprocess
import time


from fp4lab.lab.catalog import Catalog
from tests.test_slurm_local import UP_STATES, _node_state  # skips this module too when Slurm is down
from tests.test_sweep import SPEC, cli  # noqa: F401 (the fixture)

assert _node_state() in UP_STATES

SLURM = '\n[slurm]\ncpus_per_task = 1\ntime = "00:10:00"\n'


def wait_for(cli, catalog, predicate, timeout=240):  # noqa: F811
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        cli("status")
        records = catalog.records()
        if predicate(records):
            return records
        time.sleep(2)
    raise AssertionError(f"timed out; records: {[(r['id'], r['state'], r['slurm_job_id']) for r in catalog.records()]}")


def test_slurm_sweep_runs_the_array_and_records_the_results(cli, tmp_path):  # noqa: F811
    (tmp_path / "mini.toml").write_text(SPEC + SLURM)
    out = cli("sweep", "mini.toml", "--executor", "slurm")
    assert out.returncode in (0, None), out.stderr
    assert "submitted Slurm jobs" in out.stdout
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    submitted = catalog.records()
    assert len({r["slurm_job_id"] for r in submitted}) == 1  # one array
    assert sorted(r["slurm_array_index"] for r in submitted) == [0, 1]
    records = wait_for(cli, catalog, lambda rs: all(r["state"] == "completed" for r in rs))
    for record in records:
        assert record["verdict"] == "converged" and record["summary"]["final_val_loss"] > 0
        assert record["executor"] == "slurm" and record["finished_at"]


def test_a_cancelled_slurm_run_is_recorded_as_cancelled(cli, tmp_path):  # noqa: F811
    spec = SPEC.replace("steps = 6", "steps = 100000").replace('recipe = ["bf16", "nvfp4"]', 'recipe = ["bf16"]')
    (tmp_path / "long.toml").write_text(spec + SLURM)
    assert cli("sweep", "long.toml", "--executor", "slurm").returncode in (0, None)
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    running = wait_for(cli, catalog, lambda rs: rs[0]["state"] == "running")
    subprocess.run(["scancel", str(running[0]["slurm_job_id"])], check=True)
    cancelled = wait_for(cli, catalog, lambda rs: rs[0]["state"] != "running")
    assert cancelled[0]["state"] == "cancelled", cancelled[0]
