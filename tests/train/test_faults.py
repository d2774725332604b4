"""Faults said plainly: a damaged newest checkpoint falls back to the generation before it (and resumes
exactly from there), none readable is one line naming the files and the fix, and a disk that fills up
while a run checkpoints is "no space left on device" naming the file, with the previous checkpoint kept
and the run recorded as failed for that reason (a real full filesystem: a small tmpfs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from fp4lab.lab.records.catalog import Catalog
from fp4lab.lab.runs.job import train_recorded
from fp4lab.train.atomic import NoSpaceLeft
from fp4lab.train.checkpoint import CheckpointDamaged, load_checkpoint
from fp4lab.train.config import TrainConfig, toml_text
from fp4lab.train.data import DataConfig
from fp4lab.train.loop import run

ROOT = Path(__file__).resolve().parents[2]


def tiny(out: Path, steps: int = 6) -> TrainConfig:
    return TrainConfig(recipe="nvfp4", model="tiny", data=DataConfig(source="synthetic"), steps=steps, batch_size=2, seq_len=32,
                       eval_every=100, probe_every=100, eval_batches=1, checkpoint_every=2, out_dir=str(out))


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_and_resumes_exactly(tmp_path, capsys):
    whole = tmp_path / "whole"
    run(tiny(whole), progress=False)
    out = tmp_path / "run"
    run(tiny(out), progress=False, stop_after=4)
    assert load_checkpoint(out / "checkpoint.pt")["state"]["step"] == 4
    assert load_checkpoint(out / "checkpoint.prev.pt")["state"]["step"] == 2  # the generation before
    truncate(out / "checkpoint.pt")  # a copy cut short
    capsys.readouterr()
    summary = run(tiny(out), progress=False)
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and str(out / "checkpoint.pt") in warning[0] and str(out / "checkpoint.prev.pt") in warning[0], warning
    assert "cannot be read" in warning[0] and "RuntimeError" in warning[0]
    assert summary["resumed_from_step"] == 2
    assert losses(out) == losses(whole)  # steps 3 and 4 trained again, bit for bit


def test_no_readable_checkpoint_is_one_line_naming_the_files_and_the_fix(tmp_path):
    out = tmp_path / "run"
    run(tiny(out), progress=False, stop_after=4)
    truncate(out / "checkpoint.pt")
    truncate(out / "checkpoint.prev.pt")
    with pytest.raises(CheckpointDamaged, match=r"no checkpoint of .* can be read: .*checkpoint\.pt .*; .*checkpoint\.prev\.pt .*--fresh"):
        run(tiny(out), progress=False)
    config_path = tmp_path / "run.toml"
    config_path.write_text(toml_text(tiny(out).to_dict()))
    done = subprocess.run([sys.executable, "-m", "fp4lab.cli", "train", "--config", str(config_path)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "no checkpoint of" in line]
    assert len(errors) == 1 and "--fresh" in errors[0], done.stderr[-2000:]


@pytest.fixture
def small_filesystem(tmp_path):
    """A tmpfs of a few MiB mounted at tmp_path/full (root only: CI runs as root); the test fails with
    the reason where the mount is refused."""
    mount_point = tmp_path / "full"
    mount_point.mkdir()

    def mount(size_kib: int) -> Path:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", f"fp4lab-{uuid.uuid4().hex[:8]}", str(mount_point)],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            pytest.fail(f"cannot mount a tmpfs to fill ({done.stderr.strip() or done.returncode}); this test needs root (CI runs as root)")
        return mount_point

    yield mount
    subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


def test_a_disk_that_fills_while_checkpointing_says_so_keeps_the_last_checkpoint_and_records_why(tmp_path, small_filesystem):
    # The filesystem's size from the run's own checkpoint: room for two generations and most of a third,
    # so the third save (step 6) finds it full.
    probe = tmp_path / "probe"
    run(tiny(probe, steps=2), progress=False)
    size = (probe / "checkpoint.pt").stat().st_size
    full = small_filesystem((size * 5 // 2) // 1024)
    out = full / "run"

    config_path = tmp_path / "jobs" / "faults" / "3f2a9c1b7d40.toml"
    config_path.parent.mkdir(parents=True)
    config_path.write_text(toml_text(tiny(out, steps=8).to_dict()))
    catalog = Catalog(tmp_path / "sweep_catalog.json")  # on the roomy filesystem
    catalog.upsert({"id": "3f2a9c1b7d40", "sweep": "faults", "recipe": "nvfp4", "state": "pending", "config": tiny(out, steps=8).to_dict()})
    with pytest.raises(NoSpaceLeft) as raised:
        train_recorded(config_path, catalog, progress=False)
    message = str(raised.value)
    assert "no space left on device" in message and str(out / "checkpoint.pt") in message and "\n" not in message
    assert load_checkpoint(out / "checkpoint.pt")["state"]["step"] == 4  # the last whole one, kept
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]  # the partial file is gone
    record = catalog.get("3f2a9c1b7d40")
    assert record["state"] == "failed" and "no space left on device" in record["error"], record
    torch.load(out / "checkpoint.prev.pt", weights_only=True)  # and the generation before it


def test_a_full_disk_under_the_catalog_and_the_metrics_log_is_said_plainly_and_loses_nothing(small_filesystem):
    from fp4lab.train.checkpoint import MetricsLog

    full = small_filesystem(1024)
    catalog = Catalog(full / "sweep_catalog.json")
    catalog.upsert({"id": "3f2a9c1b7d40", "sweep": "faults", "recipe": "nvfp4", "state": "pending"})
    metrics = MetricsLog(full / "metrics.jsonl")
    metrics.write({"step": 1, "loss": 2.5})
    with open(full / "filler", "wb") as filler:  # the rest of the filesystem
        with pytest.raises(OSError):
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
    with pytest.raises(NoSpaceLeft, match=r"no space left on device writing .*sweep_catalog\.json.*sweep_catalog\.json and its records were left as they were"):
        catalog.update("3f2a9c1b7d40", state="running", extra={"note": "x" * 200_000})
    assert catalog.get("3f2a9c1b7d40")["state"] == "pending"  # the catalog as it was, still readable
    with pytest.raises(NoSpaceLeft, match=r"no space left on device writing .*metrics\.jsonl.*the lines written before it are kept"):
        metrics.write({"step": 2, "loss": 2.4, "note": "y" * 200_000})
    metrics.close()
    assert json.loads((full / "metrics.jsonl").read_text().splitlines()[0]) == {"step": 1, "loss": 2.5}
    os.unlink(full / "filler")  # space again: the next write goes through and the view is rebuilt whole
    catalog.update("3f2a9c1b7d40", state="running")
    catalog.sync()
    assert json.loads((full / "sweep_catalog.json").read_text())["runs"]["3f2a9c1b7d40"]["state"] == "running"
