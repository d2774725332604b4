"""One name per metric: summary.json writes final_train_loss / best_train_loss; runs, specs and programs
written under the earlier names (final_loss / best_loss) still read."""

from __future__ import annotations

import json
import statistics

from fp4lab.lab.records.logscan import scan
from fp4lab.lab.specs.program import FP4LAB_METRICS
from fp4lab.lab.specs.sweep_spec import OBJECTIVES, spec_from_dict
from fp4lab.train.config import summary_value


def test_summary_values_under_either_name():
    new = {"final_train_loss": 3.0, "best_train_loss": 2.5}
    old = {"final_loss": 3.0, "best_loss": 2.5}
    for summary in (new, old):
        assert summary_value(summary, "final_train_loss") == 3.0 and summary_value(summary, "final_loss") == 3.0
        assert summary_value(summary, "best_train_loss") == 2.5
    assert summary_value(new, "final_val_loss") is None


def test_a_run_folder_of_an_earlier_version_scans_with_its_losses(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    (tmp_path / "summary.json").write_text(json.dumps({"status": "completed", "final_loss": 3.25, "best_loss": 3.0, "steps_completed": 10}))
    result = scan(tmp_path, now=1e12)
    assert (result.final_train_loss, result.best_train_loss) == (3.25, 3.0)
    assert "final_loss" not in result.to_dict() and result.to_dict()["final_train_loss"] == 3.25


def test_objectives_and_program_metrics_use_the_one_name():
    assert "final_train_loss" in OBJECTIVES and "final_loss" not in OBJECTIVES
    assert FP4LAB_METRICS["final_loss"] == FP4LAB_METRICS["final_train_loss"] == "final_train_loss"
    table = {"name": "o", "method": "optuna", "base": {"model": "tiny"},
             "optuna": {"n_trials": 2, "objective": "final_loss", "search_space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}}}}
    assert spec_from_dict(table).optuna.objective == "final_train_loss"  # a spec of an earlier version


def test_summary_tokens_per_s_is_the_steady_pace_with_startup_apart(tmp_path):
    """summary.json's tokens_per_s leaves compilation out (a median over the second half of the steps);
    the overall rate and the startup seconds say what compiling cost."""
    from fp4lab.train.checkpoint import RunState
    from fp4lab.train.config import TrainConfig
    from fp4lab.train.summary import throughput

    rates = [100.0, 400.0] + [1000.0 + step for step in range(2, 20)]  # two compiling steps, then steady
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0, "tokens_per_s": r}) + "\n" for s, r in enumerate(rates)))
    tokens = 20 * 256
    state = RunState(step=20, train_seconds=30.0, tokens_seen=tokens)
    got = throughput(TrainConfig(out_dir=str(tmp_path)), state)
    steady = statistics.median(rates[10:])  # steps 10..19: the second half of 0..19
    assert got["tokens_per_s"] == steady
    assert got["tokens_per_s_overall"] == tokens / 30.0 < steady
    assert got["startup_seconds"] == 30.0 - tokens / steady
