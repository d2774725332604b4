"""A run folder has one trainer (issue 37): the trainer holds its folder's lock for its whole life, a
second trainer on it is refused before writing anything, a terminated sweep takes its trainers down
with checkpoints, and a sweep started while a dead sweep's trainer still runs leaves that run to it.
Real processes throughout: `fp4lab train` and `fp4lab sweep` started as a user would."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fp4lab.lab.records.catalog import Catalog
from fp4lab.train import run_folder
from tests.lab.test_sweep_trust import spec

pytestmark = pytest.mark.slow

# One torch thread: beside another pytest worker, spinning threads made such tests several times slower.
ENV = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TRAIN = [sys.executable, "-m", "fp4lab.cli", "train", "--recipe", "bf16", "--model", "tiny", "--data", "synthetic",
         "--seq-len", "64", "--batch-size", "4", "--steps", "2000", "--checkpoint-every", "50"]  # fmt: skip


def _wait_for(predicate, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _training(folder: Path) -> bool:
    metrics = folder / "metrics.jsonl"
    return metrics.exists() and metrics.stat().st_size > 0


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir()}


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_the_lock_is_held_for_the_trainers_life_and_dropped_however_it_ends(tmp_path):
    folder = tmp_path / "run"
    assert run_folder.holder(folder) is None  # no folder yet
    with run_folder.hold(folder), run_folder.hold(folder):  # re-entrant in one process
        assert run_folder.holder(folder) == f"{socket.gethostname()}:{os.getpid()}"
    assert run_folder.holder(folder) is None
    # A process that holds it and is then killed outright (no handler, no finally) leaves no stale lock.
    code = f"from fp4lab.train import run_folder; import time\nwith run_folder.hold({str(folder)!r}):\n    print('held', flush=True); time.sleep(600)"
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert other.stdout.readline().strip() == "held"
        assert run_folder.holder(folder) == f"{socket.gethostname()}:{other.pid}"
        with pytest.raises(run_folder.RunFolderBusy, match=f"is being trained by process {socket.gethostname()}:{other.pid}"):
            with run_folder.hold(folder):
                pass
    finally:
        other.kill()
        other.wait()
    assert run_folder.holder(folder) is None
    with run_folder.hold(folder):
        pass


def test_a_second_trainer_on_a_held_folder_is_refused_and_touches_nothing(tmp_path):
    folder = tmp_path / "run"
    first = subprocess.Popen([*TRAIN, "--out", str(folder)], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        _wait_for(lambda: _training(folder))
        _wait_for(lambda: (folder / "checkpoint.pt").exists())
        first.send_signal(signal.SIGSTOP)  # frozen, so nothing in the folder moves while the second tries
        before = _snapshot(folder)
        for extra in ([], ["--fresh"]):  # --fresh would delete the first trainer's checkpoint under it
            second = subprocess.run([*TRAIN, "--out", str(folder), *extra], cwd=tmp_path, env=ENV,
                                    capture_output=True, text=True, timeout=300)  # fmt: skip
            assert second.returncode == 2, second.stderr
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1 and f"is being trained by process {socket.gethostname()}:{first.pid}" in lines[0], lines
            assert _snapshot(folder) == before
        first.send_signal(signal.SIGCONT)
    finally:
        first.send_signal(signal.SIGCONT)
        _stop(first)
    assert run_folder.holder(folder) is None


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_terminated_sweep_stops_its_trainer_at_a_checkpoint_and_records_it_interrupted(tmp_path, stop):
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"], steps=2000))
    sweep = subprocess.Popen([sys.executable, "-m", "fp4lab.cli", "sweep", "s.toml"], cwd=tmp_path, env=ENV,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    _wait_for(lambda: any(_training(p.parent) for p in tmp_path.glob("runs/s/*/metrics.jsonl")))
    (run_dir,) = [p.parent for p in tmp_path.glob("runs/s/*/metrics.jsonl")]
    trainer = run_folder.holder(run_dir)
    assert trainer is not None and not trainer.endswith(f":{sweep.pid}")
    sweep.send_signal(stop)
    out, err = sweep.communicate(timeout=180)
    assert sweep.returncode == 130, err
    assert "interrupted: 1 run(s) stopped" in out
    assert run_folder.holder(run_dir) is None  # the trainer ended with the sweep
    with pytest.raises(ProcessLookupError):
        os.kill(int(trainer.rpartition(":")[2]), 0)
    (record,) = Catalog(tmp_path / "sweep_catalog.json").records()
    assert (record["state"], record["verdict"], record["owner"]) == ("interrupted", "interrupted", None)
    stopped_at = json.loads((run_dir / "summary.json").read_text())["steps_completed"]
    assert 0 < stopped_at < 2000 and (run_dir / "checkpoint.pt").exists()


def test_a_sweep_started_while_a_dead_sweeps_trainer_runs_leaves_the_run_to_it(tmp_path):
    (tmp_path / "s.toml").write_text(spec("s", ["bf16"], steps=2000))
    command = [sys.executable, "-m", "fp4lab.cli", "sweep", "s.toml"]
    first = subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_for(lambda: any(_training(p.parent) for p in tmp_path.glob("runs/s/*/metrics.jsonl")))
    (run_dir,) = [p.parent for p in tmp_path.glob("runs/s/*/metrics.jsonl")]
    first.kill()  # SIGKILL: no handler runs, the trainer (its own session) keeps training
    first.wait()
    trainer = run_folder.holder(run_dir)
    assert trainer is not None
    pid = int(trainer.rpartition(":")[2])
    try:
        again = subprocess.run(command, cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
        assert "1 runs, 0 to run, skipped: 1 in flight" in again.stdout, again.stdout
        assert run_folder.holder(run_dir) == trainer  # still the one trainer, never a second
        record = Catalog(tmp_path / "sweep_catalog.json").records()[0]
        assert (record["state"], record["owner"], record["attempts"]) == ("running", trainer, 1)
    finally:
        os.kill(pid, signal.SIGINT)  # the orphaned trainer checkpoints and records itself
        _wait_for(lambda: run_folder.holder(run_dir) is None)
    record = Catalog(tmp_path / "sweep_catalog.json").records()[0]
    assert (record["state"], record["verdict"], record["owner"]) == ("interrupted", "interrupted", None)
