"""Trackers (fp4lab.train.trackers), each read back with its own library's reader: TensorBoard's event
accumulator, MLflow's client, and `wandb leet inspect --json` (the reader of offline run files the
wandb package ships). A sweep files its runs under its name; a run stopped and resumed is one tracker
run; a tracker that breaks mid-run is reported once and the run goes on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp4lab.train.jsonl import read_metrics_file
from fp4lab.train.loop import run
from fp4lab.train.trackers import scalars
from tests.lab.test_sweep import SPEC, cli  # noqa: F401 (the fixture)
from tests.train.test_train import small

WANDB = Path(sys.executable).with_name("wandb")


@pytest.fixture(autouse=True)
def local_trackers(tmp_path, monkeypatch):
    """W&B offline and MLflow in a store of this test's own."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def tensorboard_scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return [(event.step, event.value) for event in events.Scalars(tag)]


def wandb_records(run_file: Path) -> list[dict]:
    done = subprocess.run([str(WANDB), "leet", "inspect", str(run_file), "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def wandb_history(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["history"]["step"].get("num", 0), r["history"]["item"][key]) for r in records
            if r["type"] == "history" and key in r["history"]["item"]]


def mlflow_client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri)


def jsonl(folder: Path, key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in read_metrics_file(folder / "metrics.jsonl") if key in r]


def close(logged: list[tuple[int, float]], written: list[tuple[int, float]]) -> None:
    """TensorBoard stores float32 and W&B JSON text: the same steps, values within float32 rounding."""
    assert [s for s, _ in logged] == [s for s, _ in written]
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for (_, a), (_, b) in zip(logged, written))


def test_scalars_flatten_every_metric_of_a_record():
    record = {"step": 3, "loss": 2.5, "lr": 0.01, "grad_norm": float("nan"), "val_loss": 2.4,
              "attn_entropy": [[1.0, 2.0]], "attn_entropy_mean": [1.5, 0.5], "max_logit": [[3.0, 9.0], [1.0, 2.0]],
              "max_logit_max": 9.0, "quant": {"layers.0.attention.wq": {"x": [0.01, 0.02]}}, "qk_clipped_heads": 1}
    assert scalars(record) == {
        "loss": 2.5, "lr": 0.01, "val_loss": 2.4, "attention/entropy/layer_0": 1.5, "attention/entropy/layer_1": 0.5,
        "attention/max_logit/layer_0": 9.0, "attention/max_logit/layer_1": 2.0, "max_logit_max": 9.0,
        "quant/layers.0.attention.wq/x/saturated": 0.01, "quant/layers.0.attention.wq/x/flushed": 0.02,
        "qk_clipped_heads": 1.0}  # a non-finite value is left out: no tracker takes NaN the same way


@pytest.mark.slow
def test_a_sweep_files_its_runs_in_each_tracker_by_sweep_and_id(cli, tmp_path, local_trackers):  # noqa: F811
    from fp4lab.lab.specs.sweep_spec import expand, load_spec

    spec = SPEC.replace("[base]\n", '[base]\nlog_to = ["tensorboard", "mlflow", "wandb"]\n')
    (tmp_path / "mini.toml").write_text(spec)
    (tmp_path / "plain.toml").write_text(SPEC)
    runs = expand(load_spec(tmp_path / "mini.toml"))
    assert [r.id for r in runs] == [r.id for r in expand(load_spec(tmp_path / "plain.toml"))]  # result-neutral
    out = cli("sweep", "mini.toml")
    assert out.returncode == 0, out.stderr
    client = mlflow_client(local_trackers)
    experiment = client.get_experiment_by_name("mini")
    logged = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(logged) == sorted(r.id for r in runs)
    for spec_run in runs:
        folder = tmp_path / "runs" / "mini" / spec_run.id
        written = jsonl(folder, "loss")
        assert [s for s, _ in written] == list(range(6))
        # TensorBoard: the run folder, under runs/<sweep>/
        close(tensorboard_scalars(folder, "loss"), written)
        close(tensorboard_scalars(folder, "val_loss"), jsonl(folder, "val_loss"))
        assert tensorboard_scalars(folder, "attention/entropy/layer_0")
        # MLflow: experiment = sweep, run name = run id, every step, the config, the end
        mlflow_run = logged[spec_run.id]
        history = client.get_metric_history(mlflow_run.info.run_id, "loss")
        assert [(m.step, m.value) for m in history] == written
        assert mlflow_run.info.status == "FINISHED" and mlflow_run.data.tags["fp4lab.status"] == "completed"
        assert mlflow_run.data.params["config.recipe"] == spec_run.config["recipe"]
        assert mlflow_run.data.params["environment.torch"] == torch.__version__  # the environment on record
        assert mlflow_run.data.metrics["summary/final_val_loss"] == pytest.approx(jsonl(folder, "val_loss")[-1][1])
        # W&B offline: group = sweep, name = run id
        (run_file,) = folder.glob("wandb/offline-run-*/run-*.wandb")
        records = wandb_records(run_file)
        (header,) = [r["run"] for r in records if r["type"] == "run"]
        assert header["run_group"] == "mini" and header["display_name"] == spec_run.id and header["project"] == "fp4lab"
        assert header["config"]["update"]["config"]["recipe"] == spec_run.config["recipe"]
        close(wandb_history(records, "loss"), written)
    from fp4lab.lab.records.catalog import Catalog
    from fp4lab.lab.records.ledger import build_report

    assert all(r["extra"]["environment"]["torch"] == torch.__version__ for r in Catalog(tmp_path / "sweep_catalog.json").records())
    (line,) = [n for n in build_report(tmp_path / "sweep_catalog.json", "mini").notes if n.startswith("environment")]
    assert line.startswith(f"environment 1: torch {torch.__version__}") and line.endswith("CPU (2 runs)")
    nvfp4 = next(r for r in runs if r.config["recipe"] == "nvfp4")
    folder = tmp_path / "runs" / "mini" / nvfp4.id
    quant = [key for key in scalars(next(read_metrics_file(folder / "metrics.jsonl"))) if key.startswith("quant/")]
    assert quant and tensorboard_scalars(folder, quant[0])  # the FP4 operands' clip and flush fractions


@pytest.mark.slow
def test_a_stopped_and_resumed_run_is_one_tracker_run(tmp_path, local_trackers):
    config = small(tmp_path, log_to=["tensorboard", "mlflow", "wandb"], checkpoint_every=3, eval_every=3)
    folder = Path(config.out_dir)
    run(config, progress=False, stop_after=3)  # checkpoint at step 3
    kept = (folder / "checkpoint.pt").read_bytes()
    run(config, progress=False, stop_after=3)  # logs steps 3..5, checkpoint at 6
    (folder / "checkpoint.pt").write_bytes(kept)  # as if killed before that checkpoint: steps 3..5 again
    summary = run(config, progress=False)
    assert summary["status"] == "completed" and summary["resumed_from_step"] == 3
    written = jsonl(folder, "loss")
    assert [s for s, _ in written] == list(range(12))
    close(tensorboard_scalars(folder, "loss"), written)  # purge_step: each step once, the resumed run's
    ids = json.loads((folder / "trackers.json").read_text())
    client = mlflow_client(local_trackers)
    (only,) = client.search_runs([client.get_experiment_by_name("fp4lab").experiment_id])
    assert only.info.run_id == ids["mlflow"]["run_id"] and only.info.status == "FINISHED"
    history = client.get_metric_history(only.info.run_id, "loss")
    assert sorted({m.step for m in history}) == list(range(12))
    assert all(m.value == dict(written)[m.step] for m in history)  # steps logged twice hold the same value: resume is exact
    segments = sorted(folder.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(segments) == 3  # W&B cannot resume offline: a segment per start, all under one run id
    headers = [next(r["run"] for r in wandb_records(s) if r["type"] == "run") for s in segments]
    assert {h["run_id"] for h in headers} == {ids["wandb"]["id"]}
    assert [wandb_history(wandb_records(s), "loss")[0][0] for s in segments] == [0, 3, 3]


def test_a_tracker_that_breaks_mid_run_is_reported_once_and_the_run_goes_on(tmp_path, capfd, monkeypatch):
    store = tmp_path / "store.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{store}")
    config = small(tmp_path, log_to=["mlflow"], steps=2)
    from fp4lab.train.checkpoint import MetricsLog
    from fp4lab.train.trackers import open_run_log

    folder = Path(config.out_dir)
    folder.mkdir()
    log = open_run_log(config, {"config": config.to_dict()}, folder, 0, MetricsLog(folder / "metrics.jsonl"))
    log.write({"step": 0, "loss": 3.0})
    store.write_bytes(b"not a database" * 100)  # the store breaks under the run
    for step in range(1, 4):
        log.write({"step": step, "loss": 3.0 - step})
    log.close({"status": "completed"})
    warnings = [line for line in capfd.readouterr().err.splitlines() if "tracker mlflow failed" in line]
    assert len(warnings) == 1 and "metrics.jsonl keeps every metric" in warnings[0]
    assert [r["step"] for r in read_metrics_file(folder / "metrics.jsonl")] == [0, 1, 2, 3]


def test_a_tracker_that_cannot_start_is_reported_and_training_goes_on(tmp_path, capfd, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'a file' / 'under a file.db'}")
    (tmp_path / "a file").write_text("not a folder")
    summary = run(small(tmp_path, log_to=["mlflow"], steps=3), progress=False)
    assert summary["status"] == "completed"
    assert "tracker mlflow could not start" in capfd.readouterr().err


def test_log_to_is_checked_when_the_config_is_made(tmp_path):
    from fp4lab.train.config import ConfigError

    with pytest.raises(ConfigError, match=r"log_to\[1\]='neptune' is not supported; allowed: tensorboard, wandb, mlflow"):
        small(tmp_path, log_to=["tensorboard", "neptune"])
    with pytest.raises(ConfigError, match="names a tracker twice"):
        small(tmp_path, log_to=["mlflow", "mlflow"])
