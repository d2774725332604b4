"""Sweeps a researcher can trust: shared runs, one owner per run, Ctrl-C that resumes, failures that
say why, and refusals that touch nothing."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from fp4lab.lab.records.catalog import Catalog
from fp4lab.train import run_folder
from tests.lab.test_sweep import BASE_TABLES, registered


def spec(name: str, recipes: list[str], steps: int = 6, source: str = '"synthetic"') -> str:
    """The mini sweep's base (tests/lab/test_sweep.py) under another name, recipes, length or token source."""
    base = BASE_TABLES.replace("\nsteps = 6\n", f"\nsteps = {steps}\n").replace('source = "synthetic"', f"source = {source}")
    return f'name = "{name}"\n' + base + f"[axes]\nrecipe = {json.dumps(recipes)}\n"


@pytest.fixture
def cli(run_cli, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    return run_cli


def test_sweeps_share_a_run_and_each_reports_excess_against_it(cli, tmp_path):
    from fp4lab.lab.records.ledger import build_report

    (tmp_path / "first.toml").write_text(spec("first", ["bf16", "nvfp4"]))
    (tmp_path / "second.toml").write_text(spec("second", ["bf16", "mxfp4"]))
    first = cli("sweep", "first.toml")
    assert first.returncode == 0, first.stderr
    second = cli("sweep", "second.toml")
    assert second.returncode == 0, second.stderr
    assert "2 runs, 1 to run, skipped: 1 done" in second.stdout  # the bf16 baseline is reused, not retrained
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    assert len(catalog) == 3
    for sweep, recipe in (("first", "nvfp4"), ("second", "mxfp4")):
        ledger = build_report(tmp_path / "sweep_catalog.json", sweep=sweep).ledger
        row = ledger[ledger["recipe"] == recipe].iloc[0]
        assert row["excess_pct_mean"] == row["excess_pct_mean"]  # computed against the shared bf16 run
    # a copy of a spec under a new name runs nothing and still owns its runs
    (tmp_path / "copy.toml").write_text(spec("copy", ["bf16", "nvfp4"]))
    copied = cli("sweep", "copy.toml")
    assert "0 to run, skipped: 2 done" in copied.stdout
    assert sorted(r["recipe"] for r in catalog.records(sweep="copy")) == ["bf16", "nvfp4"]
    assert "copy" in cli("status", "copy").stdout
    every = build_report(tmp_path / "sweep_catalog.json").ledger
    assert sorted(set(every["sweep"])) == ["copy", "first", "second"]


def test_a_second_spec_with_the_same_name_is_refused_and_touches_nothing(cli, tmp_path):
    (tmp_path / "a.toml").write_text(spec("same", ["bf16", "nvfp4"]))
    (tmp_path / "b.toml").write_text(spec("same", ["mxfp4", "nvfp4-all"]))
    catalog = registered(tmp_path, "a.toml")
    manifest = (tmp_path / "jobs" / "same" / "manifest.json").read_text()
    catalog_text = catalog.path.read_text()
    refused = cli("sweep", "b.toml")
    assert refused.returncode == 2 and "is already the sweep of" in refused.stderr and "b.toml" in refused.stderr
    assert (tmp_path / "jobs" / "same" / "manifest.json").read_text() == manifest
    assert catalog.path.read_text() == catalog_text


def test_an_edited_spec_leaves_no_stale_array_script(cli, tmp_path):
    (tmp_path / "s.toml").write_text(spec("s", ["bf16", "nvfp4"]))
    cli("sweep", "s.toml", "--dry-run")
    assert (tmp_path / "jobs" / "s" / "array_0.sbatch").exists()
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"]))
    edited = cli("sweep", "s.toml", "--dry-run")
    assert edited.returncode == 0, edited.stderr
    assert not list((tmp_path / "jobs" / "s").glob("array_*"))


def test_a_run_another_live_process_owns_is_left_to_it(cli, tmp_path):
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"]))
    catalog = registered(tmp_path, "s.toml")
    (record,) = catalog.records()
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        catalog.update(record["id"], state="running", owner=f"{socket.gethostname()}:{owner.pid}")
        out = cli("sweep", "s.toml")
        assert "0 to run, skipped: 1 in flight" in out.stdout and "left to it" in out.stdout
        assert not (tmp_path / "runs" / "s" / record["id"] / "metrics.jsonl").exists()
        train = cli("train", "--config", f"jobs/s/{record['id']}.toml", "--catalog", "sweep_catalog.json")
        assert train.returncode == 2 and "is being trained by process" in train.stderr
    finally:
        owner.kill()
        owner.wait()
    out = cli("sweep", "s.toml")  # its owner died: the run is taken over (and resumes)
    assert "1 to run" in out.stdout and catalog.get(record["id"])["state"] == "completed"


def test_a_failed_run_says_why_and_the_sweep_exits_non_zero(cli, tmp_path):
    (tmp_path / "bad.bin").write_bytes(b"\x01")  # one byte: not a uint16 token file
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"], source='"bad.bin"'))
    out = cli("sweep", "s.toml")
    assert out.returncode == 1 and "failed" in out.stderr
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records()
    assert record["state"] == "failed" and record["error"] and "Error" in record["error"]
    assert record["error"] in out.stdout.replace("\n", "")
    again = cli("sweep", "s.toml")
    assert again.returncode == 1 and "skipped: 1 failed" in again.stdout and "--retry-failed reruns it" in again.stdout


def test_a_missing_token_file_is_found_before_anything_runs(cli, tmp_path):
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"], source='"missing.bin"'))
    out = cli("sweep", "s.toml")
    assert out.returncode == 2 and "data.source 'missing.bin' is not a file" in out.stderr
    assert not (tmp_path / "sweep_catalog.json").exists()


def test_an_unbuilt_corpus_is_found_before_anything_runs(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("FP4LAB_CACHE", str(tmp_path / "empty-cache"))
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"], source='"pycode"'))
    out = cli("sweep", "s.toml")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "the corpus is not built in" in out.stderr and "run `fp4lab data build pycode`" in out.stderr
    assert not (tmp_path / "sweep_catalog.json").exists() and not (tmp_path / "empty-cache").exists()


def test_train_refuses_catalog_with_fresh_before_deleting_anything(cli, tmp_path):
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"]))
    cli("sweep", "s.toml")
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records()
    run_dir = tmp_path / "runs" / "s" / record["id"]
    before = sorted(p.name for p in run_dir.iterdir())
    out = cli("train", "--config", f"jobs/s/{record['id']}.toml", "--catalog", "sweep_catalog.json", "--fresh")
    assert out.returncode == 2 and "drop --fresh" in out.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == before


def test_status_reads_a_running_ratchet_record_and_an_unknown_sweep_is_an_error(cli, tmp_path):
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    catalog.upsert({"id": "it1", "sweep": "ratchet/t", "state": "running", "config": {"command": "make score"}})
    out = cli("status")
    assert out.returncode == 0, out.stderr
    nosuch = cli("status", "nosuch")
    assert nosuch.returncode == 2 and "no sweep 'nosuch'" in nosuch.stderr and "ratchet/t" in nosuch.stderr


def test_run_folders_are_found_relative_to_the_catalog(cli, tmp_path):
    from fp4lab.lab.records.ledger import build_report

    (tmp_path / "s.toml").write_text(spec("s", ["bf16", "nvfp4"]))
    out = cli("sweep", "s.toml", "--catalog", "results/c.json")
    assert out.returncode == 0, out.stderr
    catalog = Catalog(tmp_path / "results" / "c.json")
    record = catalog.records()[0]
    assert record["paths"]["run_dir"] == f"../runs/s/{record['id']}"
    assert record["paths"]["checkpoint"] == f"../runs/s/{record['id']}/checkpoint.pt"  # every path, the one rule
    assert catalog.resolve(record["paths"]["checkpoint"]).is_file()
    os.chdir(tmp_path / "results")  # status and report from another folder find the same runs
    assert "6" in cli("status", "--catalog", "c.json").stdout
    notes = build_report("c.json", sweep="s").notes
    assert len(notes) == 1 and notes[0].startswith("environment 1: torch")  # nothing amiss: the one machine they ran on


def test_status_and_report_show_the_same_final_loss(cli, tmp_path):
    from fp4lab.lab.records.ledger import build_report

    (tmp_path / "s.toml").write_text(spec("s", ["bf16"]))
    cli("sweep", "s.toml")
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records()
    final = record["summary"]["final_train_loss"]
    assert f"{final:.4f}" in cli("status", "s").stdout
    assert build_report(tmp_path / "sweep_catalog.json", sweep="s").ledger.iloc[0]["final_train_loss_mean"] == pytest.approx(final)


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_ctrl_c_stops_a_sweep_with_checkpoints_and_the_next_sweep_resumes_it(tmp_path):
    (tmp_path / "s.toml").write_text(spec("s", ["bf16", "nvfp4"], steps=150))
    command = [sys.executable, "-m", "fp4lab.cli", "sweep", "s.toml"]
    # One torch thread: beside another pytest worker, two spinning threads made this test 8x slower in CI.
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    # A shell that starts a job in the background (as CI may start pytest) ignores SIGINT for it, and the
    # ignoring is inherited; Ctrl-C from a terminal reaches a sweep whose SIGINT has its default action.
    sweep = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for(lambda: any(p.stat().st_size > 0 for p in tmp_path.glob("runs/s/*/metrics.jsonl")))
    sweep.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reaches the sweep; it passes one SIGINT on
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, err
    assert "interrupted: 1 run(s) stopped" in out
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    states = {r["recipe"]: r["state"] for r in catalog.records()}
    assert states == {"bf16": "interrupted", "nvfp4": "pending"}  # the second run was never started
    (interrupted,) = [r for r in catalog.records() if r["state"] == "interrupted"]
    run_dir = tmp_path / interrupted["paths"]["run_dir"]
    stopped_at = json.loads((run_dir / "summary.json").read_text())["steps_completed"]
    assert 0 < stopped_at < 150 and (run_dir / "checkpoint.pt").exists()
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"], steps=150))
    again = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "1 runs, 1 to run" in again.stdout  # interrupted runs resume by default
    record = catalog.get(interrupted["id"])
    assert record["state"] == "completed" and record["attempts"] == 2
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(150))  # continued from the checkpoint, no step twice


def test_a_ctrl_c_delivered_twice_still_waits_for_the_run_to_checkpoint_and_record_itself(tmp_path):
    """A terminal's Ctrl-C reaches the sweep, and a wrapper in its process group (`timeout --foreground`)
    passes the same Ctrl-C on again a moment later: the second must not end the sweep's wait, or the
    trainer outlives it with its record "running"."""
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"], steps=100000))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    sweep = subprocess.Popen([sys.executable, "-m", "fp4lab.cli", "sweep", "s.toml"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for(lambda: any(p.stat().st_size > 0 for p in tmp_path.glob("runs/s/*/metrics.jsonl")))
    sweep.send_signal(signal.SIGINT)
    time.sleep(0.05)  # apart, as the two deliveries come: no coalescing into one pending signal
    sweep.send_signal(signal.SIGINT)
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130 and "interrupted: 1 run(s) stopped" in out, err
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records()
    run_dir = tmp_path / record["paths"]["run_dir"]
    assert record["state"] == "interrupted" and run_folder.holder(run_dir) is None, record  # no trainer left
    assert (run_dir / "checkpoint.pt").exists()


def test_ctrl_c_during_start_up_leaves_the_run_interrupted_so_the_next_sweep_runs_it(cli, tmp_path, monkeypatch):
    """A Ctrl-C before the loop's handler is in place (here while the data loads) must not record the run
    as failed: a sweep skips failed runs, and a ledger round cut at a run's start-up would lose it."""
    import fp4lab.train.loop as loop
    from fp4lab.lab.runs.job import train_recorded

    (tmp_path / "s.toml").write_text(spec("s", ["bf16"]))
    catalog = registered(tmp_path, "s.toml")
    (record,) = catalog.records()

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(loop, "load_dataset", ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            train_recorded(tmp_path / "jobs" / "s" / f"{record['id']}.toml", catalog)
    stopped = catalog.get(record["id"])
    assert (stopped["state"], stopped["verdict"], stopped["owner"]) == ("interrupted", "interrupted", None)
    again = cli("sweep", "s.toml")
    assert again.returncode == 0 and "1 runs, 1 to run" in again.stdout, again.stdout
    assert catalog.get(record["id"])["state"] == "completed"


def test_ctrl_c_while_a_training_process_starts_up_leaves_its_run_interrupted(tmp_path):
    """The sweep's SIGINT can reach a training process before it has imported fp4lab (and so before it
    could record anything): the run must be interrupted, not failed, or the next sweep skips it (a
    ledger round lost nvfp4-cta seed 2 so). A sitecustomize holds the training process in start-up."""
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"]))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import pathlib, sys, time\n"
        "if 'train' in sys.argv:\n"
        "    pathlib.Path('starting').touch()\n"
        "    time.sleep(120)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    sweep = subprocess.Popen([sys.executable, "-m", "fp4lab.cli", "sweep", "s.toml"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for(lambda: (tmp_path / "starting").exists())
    sweep.send_signal(signal.SIGINT)
    out, err = sweep.communicate(timeout=120)
    assert sweep.returncode == 130, err
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records()
    assert (record["state"], record["verdict"], record["owner"]) == ("interrupted", "interrupted", None), record
    assert "interrupted: 1 run(s) stopped" in out


def test_ctrl_c_stops_train_with_a_checkpoint_and_exit_130(tmp_path):
    command = [sys.executable, "-m", "fp4lab.cli", "train", "--model", "tiny", "--data", "synthetic", "--steps", "2000",
               "--batch-size", "2", "--seq-len", "32", "--checkpoint-every", "1000", "--out", "run"]
    train = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists() and (tmp_path / "run" / "metrics.jsonl").stat().st_size > 0)
    train.send_signal(signal.SIGINT)
    out, err = train.communicate(timeout=120)
    assert train.returncode == 130 and "the same command resumes from step" in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["stop_signal"] == "SIGINT"
    assert (tmp_path / "run" / "checkpoint.pt").exists() and "status: interrupted" in out


def test_bare_fp4lab_prints_help_without_an_empty_error(cli):
    out = cli()
    assert out.returncode == 0 and "Usage" in out.stdout and "error" not in out.stderr


def test_recipes_show_resolves_the_cpu_default_depth(cli):
    out = cli("recipes", "show", "nvfp4")
    assert out.returncode == 0, out.stderr
    assert "4 blocks" in out.stdout


def test_a_run_probes_its_final_step_and_writes_strict_json(cli, tmp_path):
    out = cli("train", "--model", "tiny", "--data", "synthetic", "--steps", "7", "--batch-size", "2", "--seq-len", "32",
              "--probe-every", "5", "--out", "run")
    assert out.returncode == 0, out.stderr

    def refuse(token):
        raise ValueError(token)

    records = [json.loads(line, parse_constant=refuse) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "attn_entropy_mean" in r] == [0, 5, 6]
    again = cli("train", "--model", "tiny", "--data", "synthetic", "--steps", "7", "--batch-size", "2", "--seq-len", "32",
                "--probe-every", "5", "--out", "run")
    assert "already holds this run, completed after 7 steps" in again.stderr
    longer = cli("train", "--model", "tiny", "--data", "synthetic", "--steps", "9", "--batch-size", "2", "--seq-len", "32",
                 "--probe-every", "5", "--out", "run")
    assert longer.returncode == 2 and "cannot be extended exactly" in longer.stderr and "--fresh" in longer.stderr


def test_a_spec_sets_the_sparse_log_spike_rule():
    from fp4lab.lab.runs.job import thresholds_from_table
    from fp4lab.lab.specs.sweep_spec import spec_from_dict

    table = {"name": "s", "base": {"model": "tiny"}, "axes": {"recipe": ["bf16"]},
             "scan": {"spike_ratio_baseline": 8, "spike_ratio_min_count": 6}}
    thresholds = thresholds_from_table(spec_from_dict(table).scan, "s.toml")
    assert (thresholds.spike_ratio_baseline, thresholds.spike_ratio_min_count) == (8, 6)


def test_the_live_sweep_view_shows_counts_step_loss_and_time_left(tmp_path):
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from fp4lab.cli.sweep import _progress_lines, _sweep_progress

    catalog = Catalog(tmp_path / "c.json")
    run_dir = tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text('{"step": 9, "loss": 3.25}\n')
    catalog.upsert({"id": "a", "sweep": "s", "sweeps": ["s"], "state": "running", "config": {"steps": 20},
                    "started_at": "2026-01-01T00:00:00.000Z", "paths": {"run_dir": "runs/a"}, "extra": {"name": "recipe=nvfp4"}})
    catalog.upsert({"id": "b", "sweep": "s", "sweeps": ["s"], "state": "completed"})
    catalog.upsert({"id": "c", "sweep": "s", "sweeps": ["s"], "state": "pending"})
    plan = SimpleNamespace(spec=SimpleNamespace(name="s"))
    todo = [SimpleNamespace(id=i) for i in "abc"]
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    live = _sweep_progress(console, catalog, plan, todo)
    console.print(live.get_renderable())
    text = console.file.getvalue()
    assert "1 done, 1 running, 1 pending" in text and "9/19" in text and "3.2500" in text  # steps from 0: the last is 19
    assert "nvfp4" in text and "recipe=" not in text  # the run named by its value, no key= on every row
    assert " s" in text.split("3.2500")[1]  # a time left in seconds
    # Piped (a log file, CI): no live view, but a line per running run every PIPED_PROGRESS_S seconds.
    piped = Console(file=io.StringIO(), width=120)
    with _progress_lines(piped, catalog, plan, {"a", "b", "c"}, every=0.05):
        deadline = time.monotonic() + 10
        while "step 9/19" not in piped.file.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "  a  recipe=nvfp4: step 9/19, loss 3.2500\n" in piped.file.getvalue()
    assert " b " not in piped.file.getvalue() and " c " not in piped.file.getvalue()  # ended and pending runs: no line


def test_status_rescan_judges_ended_runs_again_with_the_current_scanner(cli, tmp_path):
    from .test_logscan import curve, write_run

    # a run recorded under an older scanner (three probes of baseline) that missed a collapse at step 10
    write_run(tmp_path / "runs" / "r1", curve(60), probe_every=10, entropy=lambda step: [5.9, 5.9 if step < 10 else 0.46])
    catalog = Catalog(tmp_path / "sweep_catalog.json")
    catalog.upsert({"id": "r1", "sweep": "s", "recipe": "bf16", "state": "completed", "verdict": "converged", "events": [],
                    "config": {"recipe": "bf16"}, "paths": {"run_dir": "runs/r1"}, "summary": {"final_train_loss": 3.0}})
    (row,) = json.loads(cli("status", "--json").stdout)
    assert row["verdict"] == "converged"  # kept as recorded
    out = cli("status", "s", "--rescan", "--json")
    assert out.returncode == 0 and "1 verdict(s)" in out.stderr
    (row,) = json.loads(out.stdout)
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records()
    assert row["verdict"] == record["verdict"] == "entropy_collapse@10"
    assert record["events"][0]["kind"] == "entropy_collapse" and record["events"][0]["step"] == 10
    assert "0 verdict(s)" in cli("status", "--rescan").stderr  # judged once: nothing left to change
