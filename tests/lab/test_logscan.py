"""fp4lab.lab.records.logscan: readers, every event kind, every verdict, thresholds, one real fp4lab run."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fp4lab.lab.records.logscan import PRESETS, ScanThresholds, format_result, scan
from fp4lab.train.jsonl import json_line

OLD = 1e12  # a "now" long after any file's mtime: the log is stale


def _refuse(token: str):
    raise ValueError(f"not strict JSON: {token}")


def curve(n: int, seed: int = 0, start: float = 5.5, end: float = 3.0, noise: float = 0.03) -> list[float]:
    """A smoothly decreasing, noisy loss curve."""
    rng = random.Random(seed)
    return [end + (start - end) * math.exp(-i / (n / 5)) + rng.gauss(0, noise) for i in range(n)]


def write_run(
    folder: Path,
    losses: list[float],
    *,
    status: str | None = "completed",
    diverged_step: int | None = None,
    probe_every: int = 0,
    entropy=None,
    max_logit=None,
    extra_lines: list[str] = (),
    grad_norms: list[float] | None = None,
) -> Path:
    """An fp4lab run folder: metrics.jsonl (as json_line writes it: strict JSON, "nan"/"inf" strings) + summary.json.
    entropy(step) -> [layers]; max_logit(step) -> [layers][heads]."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for step, loss in enumerate(losses):
        record = {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": grad_norms[step] if grad_norms else 1.0, "tokens_per_s": 1000.0}
        if probe_every and step % probe_every == 0:
            if entropy is not None:
                means = entropy(step)
                record["attn_entropy"] = [[m, m] for m in means]
                record["attn_entropy_mean"] = means
            if max_logit is not None:
                heads = max_logit(step)
                record["max_logit"] = heads
                record["max_logit_max"] = max(max(h) for h in heads)
        if step == len(losses) - 1 and math.isfinite(loss):
            record["val_loss"] = loss + 0.1
        lines.append(json_line(record))
    (folder / "metrics.jsonl").write_text("\n".join([*lines, *extra_lines]) + "\n")
    if status is not None:
        summary = {"status": status, "diverged_step": diverged_step, "steps_completed": len(losses), "steps": len(losses)}
        (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_module_imports_without_torch():
    code = "import sys, fp4lab.lab.records.logscan; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_converged_run_folder(tmp_path):
    run = write_run(tmp_path / "r", curve(300))
    result = scan(run, now=OLD)
    assert result.verdict == "converged" and result.status == "converged" and result.events == []
    assert result.counts["lines"] == 300 and result.counts["skipped_lines"] == 0 and result.counts["steps"] == 300
    assert result.last_step == 299 and result.final_train_loss == pytest.approx(curve(300)[-1])
    assert result.best_train_loss == pytest.approx(min(curve(300))) and result.final_val_loss == pytest.approx(curve(300)[-1] + 0.1)
    assert result.source == "fp4lab" and result.summary_status == "completed"
    # the metrics file itself also works (summary.json beside it is read)
    assert scan(run / "metrics.jsonl", now=OLD).verdict == "converged"
    line = format_result(result)
    assert "\n" not in line and "converged" in line and "no events" in line


def test_smooth_noisy_curve_gives_no_false_spike(tmp_path):
    for seed in range(5):
        result = scan(write_run(tmp_path / f"r{seed}", curve(1000, seed=seed, noise=0.05)), now=OLD)
        assert "loss_spike" not in result.first_step, result.events


def test_loss_spike_first_step_and_unstable(tmp_path):
    losses = curve(400)
    losses[300] += 0.8  # ~25 sigma above the window, well below 2x the median
    losses[301] += 0.8  # the first spike widens the window (as in OLMo-core); this one still counts
    result = scan(write_run(tmp_path / "r", losses), now=OLD)
    assert result.verdict == "unstable"
    assert result.first_step["loss_spike"] == 300
    spikes = [e for e in result.events if e.kind == "loss_spike"]
    assert len(spikes) == 1 and spikes[0].steps == 2 and spikes[0].value == pytest.approx(losses[300])
    assert spikes[0].threshold < losses[300] and result.counts["loss_spike"] == 2
    assert "loss_spike@300" in format_result(result)


def test_ratio_rule_needs_only_a_handful_of_points(tmp_path):
    # a flat, noiseless loss: std is 0 so only the ratio rule can fire
    losses = [2.0] * 100
    losses[60] = 4.5
    result = scan(write_run(tmp_path / "a", losses), now=OLD)
    assert result.first_step["loss_spike"] == 60 and "median" in result.events[0].detail
    # long before the mean + k x std rule's 32 values: the 5th point is tested against the first 4
    losses = [2.0] * 100
    losses[4] = 4.5
    result = scan(write_run(tmp_path / "b", losses), now=OLD)
    assert result.first_step["loss_spike"] == 4 and result.events[0].threshold == pytest.approx(4.0)
    # a blow-up at the second step (an AdamW rate of 1.0: 8.3 -> 46) is tested against the first loss
    losses = [8.3, 46.0, 58.0, 70.0, 51.0] + [45.0] * 95
    result = scan(write_run(tmp_path / "c", losses), now=OLD)
    assert result.first_step["loss_spike"] == 1 and result.events[0].threshold == pytest.approx(16.6)
    assert "loss_spike" not in scan(tmp_path / "c", ScanThresholds(spike_ratio_min_count=4), now=OLD).first_step
    with pytest.raises(ValueError, match="spike_ratio_min_count"):
        ScanThresholds(spike_ratio_min_count=6, spike_ratio_baseline=5)


def test_ratio_baseline_follows_a_falling_curve(tmp_path):
    # the median of the last 5 losses, not of the whole window: 3.0 -> 6.5 is a spike even though the
    # run's early losses (10 -> 7) put the median of everything logged so far above 6.5 / 2
    losses = [10.0, 9.0, 8.0, 7.5, 7.0, 6.8, 6.6, 4.0, 3.5, 3.2, 3.1, 3.0, 3.0, 6.5, 3.0]
    result = scan(write_run(tmp_path / "r", losses), now=OLD)
    assert result.first_step["loss_spike"] == 13 and result.verdict == "unstable"


def test_grad_spike_is_a_warning(tmp_path):
    grads = [1.0 + 0.01 * math.sin(i) for i in range(200)]
    grads[150] = 40.0
    result = scan(write_run(tmp_path / "r", curve(200), grad_norms=grads), now=OLD)
    assert result.first_step["grad_spike"] == 150 and result.verdict == "converged"
    strict = ScanThresholds(unstable_kinds=("loss_spike", "grad_spike"))
    assert scan(tmp_path / "r", strict, now=OLD).verdict == "unstable"


def test_nan_tokens_diverged(tmp_path):
    losses = curve(60)
    losses[50] = math.nan
    run = write_run(tmp_path / "r", losses[:51], status="diverged", diverged_step=50)
    text = (run / "metrics.jsonl").read_text()
    assert '"loss": "nan"' in text  # what fp4lab's json_line writes: strict JSON
    assert all(json.loads(line, parse_constant=_refuse) for line in text.splitlines())
    result = scan(run, now=OLD)
    assert result.verdict == "diverged@50" and result.verdict_step == 50 and result.first_step["nan"] == 50
    assert result.final_train_loss is None and result.best_train_loss is not None
    json.dumps(result.to_dict(), allow_nan=False)  # strict JSON
    assert result.to_dict()["events"][0]["value"] == "nan"


def test_infinite_grad_norm_without_summary_is_diverged(tmp_path):
    grads = [1.0] * 30
    grads[20] = math.inf
    run = write_run(tmp_path / "r", curve(21), grad_norms=grads, status=None)
    assert '"grad_norm": "inf"' in (run / "metrics.jsonl").read_text()
    result = scan(run, now=OLD)
    assert result.verdict == "diverged@20" and "grad_norm" in result.events[0].detail


def test_a_finite_loss_that_runs_away_for_good_is_diverged(tmp_path):
    # The ledger's AdamW lr 1.0 stress run, in shape: 10.5, a dip, then a climb to hundreds that never
    # comes back. No NaN; each step rises less than 2x the median before it, so no spike rule fires after
    # the first steps. The diverged step is where the median of the last 5 losses passes 1.5 x 10.5.
    losses = [10.5, 8.3, 10.0, 12.0, 15.0, 17.0, 19.0, 23.0, 28.0, 34.0] + [40.0 + 2 * i for i in range(90)]
    run = write_run(tmp_path / "away", losses)
    result = scan(run, now=OLD)
    assert result.verdict == "diverged@7" and result.first_step["loss_above_start"] == 7
    (event,) = [e for e in result.events if e.kind == "loss_above_start"]
    assert event.steps == 93 and event.value == 17.0 and event.threshold == pytest.approx(15.75) and event.peak == 214.0
    assert "since step 7" in event.detail and "first loss 10.5" in event.detail
    assert scan(run, ScanThresholds(diverge_ratio=None), now=OLD).verdict.split("@")[0] != "diverged"
    assert scan(run, ScanThresholds(diverge_ratio=15), now=OLD).first_step["loss_above_start"] == 71


def test_a_loss_that_runs_away_and_recovers_is_not_diverged(tmp_path):
    # AdamW lr 0.1 in the ledger's stress runs: 10.5 -> 31 by step 8, back below the start by step 40.
    climb = [10.5, 8.3, 10.7, 13.4, 18.0, 18.8, 16.0, 16.3, 31.3, 20.4, 27.8, 26.4, 23.3, 23.8, 26.7, 24.3]
    run = write_run(tmp_path / "back", climb + [max(3.6, 22.0 - 0.6 * i) for i in range(184)])
    result = scan(run, now=OLD)
    assert "loss_above_start" not in result.first_step and result.verdict == "converged"
    live = write_run(tmp_path / "live", climb, status=None)  # scanned while still up there: the alarm is on
    assert scan(live, running=True).verdict.startswith("diverged@")
    with pytest.raises(ValueError, match="diverge_ratio"):
        ScanThresholds(diverge_ratio=0.9)


def test_corrupt_and_truncated_lines_are_counted_not_fatal(tmp_path):
    bad = ["{not json", "[1, 2, 3]", '"a string"', '{"loss": 3.0}', '{"step": "7", "loss": 3.0}', '{"step": 300, "loss": 2.9, "lr"']
    run = write_run(tmp_path / "r", curve(300), extra_lines=bad)
    text = (run / "metrics.jsonl").read_text().rstrip("\n")  # the last line is half-written: no newline
    (run / "metrics.jsonl").write_text(text)
    result = scan(run, now=OLD)
    assert result.counts["skipped_lines"] == len(bad) and result.counts["steps"] == 300
    assert result.counts["lines"] == 300 + len(bad)
    assert result.verdict == "converged" and result.last_step == 299
    assert f"{len(bad)} bad lines skipped" in format_result(result)


def test_entropy_collapse_on_one_layer(tmp_path):
    def entropy(step):
        layer2 = 2.0 if step < 80 else 0.01
        return [2.1, 1.9, layer2, 2.2]

    run = write_run(tmp_path / "r", curve(200), probe_every=10, entropy=entropy)
    result = scan(run, now=OLD)
    assert result.verdict == "entropy_collapse@80" and result.verdict_step == 80
    events = [e for e in result.events if e.kind == "entropy_collapse"]
    assert len(events) == 1 and "layer 2" in events[0].detail and events[0].steps == 12  # probes 80..190
    assert "floor" in events[0].detail


def test_entropy_relative_drop(tmp_path):
    def entropy(step):  # above the 0.05 floor, but a fall to a tenth of its own median
        return [2.0, 2.0 if step < 100 else 0.2]

    result = scan(write_run(tmp_path / "r", curve(200), probe_every=10, entropy=entropy), now=OLD)
    assert result.verdict == "entropy_collapse@100" and "median" in result.events[0].detail
    off = ScanThresholds(entropy_drop_factor=None)
    assert scan(tmp_path / "r", off, now=OLD).verdict == "converged"


def test_entropy_collapse_before_the_second_probe(tmp_path):
    # the ledger's stress runs at Muon lr 1.0: a layer's entropy falls from its initial 5.9 nats to
    # 0.46 by the first probe after step 0 and stays there, above the 0.05 floor, so the collapsed value
    # becomes its own baseline unless the relative rule tests against the first probe alone
    def entropy(step):
        return [5.9, 5.9 if step < 10 else 0.46 - step / 1000]

    run = write_run(tmp_path / "r", curve(60), probe_every=10, entropy=entropy)
    result = scan(run, now=OLD)
    assert result.verdict == "entropy_collapse@10" and "layer 1" in result.events[0].detail
    assert scan(run, ScanThresholds(entropy_min_probes=3), now=OLD).verdict == "converged"


def test_max_logit_event(tmp_path):
    def max_logit(step):
        return [[10.0, 12.0], [30.0, 150.0 if step >= 40 else 50.0]]

    run = write_run(tmp_path / "r", curve(100), probe_every=10, max_logit=max_logit)
    result = scan(run, now=OLD)
    assert result.first_step["max_logit"] == 40 and result.verdict == "converged"  # a warning by default
    event = result.events[0]
    assert event.value == 150.0 and event.threshold == 100.0 and "layer 1 head 1" in event.detail
    assert scan(run, ScanThresholds(max_logit_tau=40.0), now=OLD).first_step["max_logit"] == 0
    assert scan(run, ScanThresholds(unstable_kinds=("max_logit",)), now=OLD).verdict == "unstable"


@pytest.mark.parametrize("status, verdict", [("time_limit", "timeout"), ("preempted", "interrupted"), ("stopped", "interrupted"),
                                             ("interrupted", "interrupted")])
def test_stopped_statuses(tmp_path, status, verdict):
    """Every status a stopped run's summary can hold (train.config.STOPPED_STATUSES): "timeout" only when its
    time ran out, "interrupted" for Ctrl-C, a terminated sweep or a preemption; a fresh log is not "running"."""
    from fp4lab.train.config import STOPPED_STATUSES

    assert status in STOPPED_STATUSES
    run = write_run(tmp_path / "r", curve(50), status=status)
    assert scan(run, now=OLD).verdict == verdict
    assert scan(run, now=(run / "metrics.jsonl").stat().st_mtime + 1).verdict == verdict


def test_running_crashed_and_stalled(tmp_path):
    run = write_run(tmp_path / "r", curve(50), status=None)
    mtime = (run / "metrics.jsonl").stat().st_mtime
    fresh = scan(run, now=mtime + 5)
    assert fresh.verdict == "running" and "stalled" not in fresh.first_step
    stale = scan(run, now=mtime + 3600)
    assert stale.verdict == "crashed" and stale.first_step["stalled"] == 49
    assert stale.events[-1].value == pytest.approx(3600)
    hung = scan(run, running=True, now=mtime + 3600)
    assert hung.verdict == "stalled" and "stalled" in hung.first_step and "hung" in hung.reasons[0]
    assert scan(run, running=False, now=mtime + 5).verdict == "crashed"
    assert scan(run, ScanThresholds(stall_seconds=10_000), now=mtime + 3600).verdict == "running"


def test_stale_summary_of_a_resumed_run_is_ignored(tmp_path):
    run = write_run(tmp_path / "r", curve(80), status=None)
    (run / "summary.json").write_text(json.dumps({"status": "preempted", "diverged_step": None, "steps_completed": 50}))
    mtime = (run / "metrics.jsonl").stat().st_mtime
    assert scan(run, now=mtime + 5).verdict == "running"
    assert scan(run, now=mtime + 3600).verdict == "crashed"


def test_progress_stall(tmp_path):
    losses = curve(100, noise=0.0) + [2.9] * 100  # flat after step 100
    result = scan(write_run(tmp_path / "r", losses), ScanThresholds(stall_steps=50, stall_min_delta=1e-3), now=OLD)
    assert result.first_step["stalled"] == 150 and result.verdict == "converged"
    assert "stalled" not in scan(tmp_path / "r", now=OLD).first_step  # off by default


NANOGPT = """\
number of parameters: 10.65M
step 0: train loss 4.2874, val loss 4.2823
iter 0: loss 4.2652, time 30520.47ms, mfu -100.00%
iter 10: loss 3.2470, time 41.20ms, mfu 12.00%
iter 20: loss 2.7810, time 41.25ms, mfu 12.01%
iter 30: loss 2.6124, time 41.31ms, mfu 12.01%
step 40: train loss 2.5300, val loss 2.5512
saving checkpoint to out-shakespeare-char
iter 40: loss 2.5391, time 9012.11ms, mfu 11.90%
"""

MEGATRON = """\
[2024-05-01 10:00:00] iteration       10/    1000 | consumed samples:         5120 | elapsed time per iteration (ms): 812.3 | learning rate: 1.000000E-04 | global batch size:   512 | lm loss: 7.812345E+00 | loss scale: 1.0 | grad norm: 2.345 | number of skipped iterations:   0 | number of nan iterations:   0 |
[2024-05-01 10:00:08] iteration       20/    1000 | consumed samples:        10240 | elapsed time per iteration (ms): 801.0 | learning rate: 2.000000E-04 | global batch size:   512 | lm loss: 6.501234E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |
-------------------------------------------------------------------------------------------------
 validation loss at iteration 20 | lm loss value: 6.400000E+00 | lm loss PPL: 6.018E+02 |
-------------------------------------------------------------------------------------------------
[2024-05-01 10:00:16] iteration       30/    1000 | consumed samples:        15360 | elapsed time per iteration (ms): 799.9 | learning rate: 3.000000E-04 | global batch size:   512 | lm loss: 5.900000E+00 | loss scale: 1.0 | grad norm: 0.812 | number of skipped iterations:   0 | number of nan iterations:   0 |
"""


def test_nanogpt_log(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(NANOGPT)
    result = scan(log, preset="nanogpt", now=OLD)
    assert result.source == "nanogpt" and result.verdict == "converged"
    assert result.counts["steps"] == 5 and result.last_step == 40
    assert result.final_train_loss == pytest.approx(2.5391) and result.best_train_loss == pytest.approx(2.5391)
    assert result.final_val_loss == pytest.approx(2.5512)
    assert scan(log, now=OLD).source == "nanogpt"  # detected without a preset
    assert scan(log, now=log.stat().st_mtime + 1).verdict == "running"  # fresh text log
    log.write_text(NANOGPT + "iter 50: loss nan, time 41.20ms, mfu 12.00%\n")
    assert scan(log, now=OLD).verdict == "diverged@50"


def test_megatron_log(tmp_path):
    log = tmp_path / "slurm-123.out"
    log.write_text(MEGATRON)
    result = scan(log, preset="megatron", now=OLD)
    assert result.verdict == "converged" and result.counts["steps"] == 3 and result.last_step == 30
    assert result.final_train_loss == pytest.approx(5.9) and result.final_val_loss == pytest.approx(6.4)
    assert scan(log, now=OLD).source == "megatron"
    # Megatron drops "lm loss" from the line when it is NaN and counts a nan iteration instead
    nan_line = (
        "[2024-05-01 10:00:24] iteration       40/    1000 | consumed samples:        20480 | learning rate: 4.000000E-04 |"
        " global batch size:   512 | loss scale: 1.0 | grad norm: nan | number of skipped iterations:   0 | number of nan iterations:   1 |\n"
    )
    log.write_text(MEGATRON + nan_line)
    result = scan(log, now=OLD)
    assert result.verdict == "diverged@40" and result.final_train_loss is None
    assert result.last_finite_loss == pytest.approx(5.9) and result.last_finite_step == 30
    line = format_result(result)
    assert "last finite loss 5.9000 at step 30, diverged step 40" in line and "| loss " not in line


def test_text_log_markers(tmp_path):
    log = tmp_path / "slurm.out"
    log.write_text(MEGATRON + "slurmstepd: error: *** JOB 123 ON nid001 CANCELLED AT 2024-05-01T12:00:00 DUE TO TIME LIMIT ***\n")
    assert scan(log, now=OLD).verdict == "timeout"
    log.write_text(MEGATRON + "Traceback (most recent call last):\n  File \"x.py\", line 1\ntorch.OutOfMemoryError: CUDA out of memory.\n")
    result = scan(log, now=log.stat().st_mtime + 1)  # a crash wins over a fresh log
    assert result.verdict == "crashed" and "Traceback" in result.reasons[0]


def test_custom_regex(tmp_path):
    log = tmp_path / "my.log"
    rows = [f"[rank0] step={i} loss={v:.4f} gnorm={1.0:.3f}" for i, v in enumerate(curve(200))]
    rows[150] = "[rank0] step=150 loss=9.0000 gnorm=1.000"
    log.write_text("\n".join(rows) + "\n")
    regex = r"step=(?P<step>\d+) loss=(?P<loss>\S+) gnorm=(?P<grad_norm>\S+)"
    result = scan(log, regex=regex, now=OLD)
    assert result.source == "regex" and result.counts["steps"] == 200
    assert result.verdict == "unstable" and result.first_step["loss_spike"] == 150
    with pytest.raises(ValueError, match="loss"):
        scan(log, regex=r"step=(?P<step>\d+)")
    with pytest.raises(ValueError, match="bad log regex"):
        scan(log, regex=r"step=(?P<step>\d+")
    with pytest.raises(ValueError, match="unknown log preset"):
        scan(log, preset="fairseq")
    assert set(PRESETS) == {"nanogpt", "megatron", "torchtitan", "fp4lab"}


def test_threshold_overrides(tmp_path):
    losses = curve(300)
    losses[200] += 1.6  # ~8.5 sigma of the (still falling) window, below 2x its median
    run = write_run(tmp_path / "r", losses)
    assert scan(run, now=OLD).first_step.get("loss_spike") == 200
    loose = ScanThresholds().with_overrides(["spike_sigma=50", "spike_ratio=none"])
    assert loose.spike_sigma == 50.0 and loose.spike_ratio is None
    assert ScanThresholds().with_overrides({"spike_k": 50, "grad_spike_k": 3}) == ScanThresholds(spike_sigma=50.0, grad_spike_sigma=3.0)  # old names
    assert scan(run, loose, now=OLD).verdict == "converged"
    assert ScanThresholds().with_overrides({"max_logit_tau": "30", "unstable_kinds": "loss_spike,max_logit"}) == ScanThresholds(
        max_logit_tau=30.0, unstable_kinds=("loss_spike", "max_logit")
    )
    with pytest.raises(ValueError, match="unknown threshold"):
        ScanThresholds().with_overrides({"spike_sigmaa": 3})
    with pytest.raises(ValueError, match="not a number"):
        ScanThresholds().with_overrides(["spike_sigma=high"])
    with pytest.raises(ValueError, match="not an integer"):
        ScanThresholds().with_overrides({"spike_window": 2.5})
    with pytest.raises(ValueError, match="must be a finite number >= 0"):
        ScanThresholds().with_overrides({"spike_sigma": -1})
    with pytest.raises(ValueError, match="unstable_kinds"):
        ScanThresholds(unstable_kinds=("boom",))


def test_missing_paths_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such run folder or log"):
        scan(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without metrics.jsonl"):
        scan(tmp_path / "empty")



def test_no_loss_is_an_alarm_not_converged(tmp_path):
    other = tmp_path / "other.log"
    other.write_text("hello\nworld\n")
    result = scan(other, now=OLD)
    assert result.verdict == "no_loss" and result.source == "unknown"
    assert "no line of 2 matches a known log format" in result.reasons[0] and "name a preset or give a regex" in result.reasons[0]
    assert "no line of 2 matches" in format_result(result)
    empty = tmp_path / "empty.log"
    empty.write_text("")
    for preset in (None, "megatron", "nanogpt"):
        result = scan(empty, preset=preset, now=OLD)
        assert result.verdict == "no_loss" and result.reasons[0] == "the log is empty", preset
    # live and empty: the job may just have started, and the message says so
    assert "scan again" in scan(empty, now=empty.stat().st_mtime + 1).reasons[0]
    # Megatron lines that never carry "lm loss" (e.g. a model whose loss has another name)
    no_lm_loss = tmp_path / "megatron.log"
    no_lm_loss.write_text(MEGATRON.replace("lm loss:", "mtp loss:"))
    result = scan(no_lm_loss, now=OLD)
    assert result.verdict == "no_loss" and result.source == "megatron" and result.counts["steps"] == 3
    assert "no loss value parsed from" in result.reasons[0]
    # an fp4lab run folder whose metrics.jsonl is empty
    run = write_run(tmp_path / "r", [], status="completed")
    assert scan(run, now=OLD).verdict == "no_loss"


def test_real_fp4lab_run_is_converged(tmp_path):
    from fp4lab.train.config import TrainConfig
    from fp4lab.train.data import DataConfig
    from fp4lab.train.loop import run

    config = TrainConfig(
        recipe="bf16", data=DataConfig(source="synthetic"), seq_len=32, batch_size=2, steps=8,
        warmup_steps=2, eval_every=4, eval_batches=1, probe_every=4, checkpoint_every=8,
        out_dir=str(tmp_path / "run"),
    )
    summary = run(config, progress=False)
    assert summary["status"] == "completed"
    result = scan(tmp_path / "run")
    assert result.verdict == "converged", result.to_dict()
    assert result.counts["steps"] == 8 and result.counts["skipped_lines"] == 0 and result.last_step == 7
    assert result.final_train_loss == pytest.approx(summary["final_train_loss"])
    assert result.final_val_loss == pytest.approx(summary["final_val_loss"])
    assert result.best_train_loss == pytest.approx(summary["best_train_loss"])
    json.dumps(result.to_dict(), allow_nan=False)


def megatron_line(iteration: int, loss: float | None, *, skipped: int = 0, nan: int = 0, grad_norm: str = "1.234") -> str:
    """One line exactly as Megatron-LM's training_log prints it (lm loss left out when not > 0)."""
    lm_loss = f" lm loss: {loss:.6E} |" if loss is not None else ""
    return (
        f" [2024-05-01 12:00:00] iteration {iteration:8d}/{500000:8d} | consumed samples: {iteration * 256:12d} |"
        f" elapsed time per iteration (ms): 512.3 | learning rate: {1.5e-4:.6E} | global batch size: {256:5d} |"
        f"{lm_loss} loss scale: 1.0 | grad norm: {grad_norm} | number of skipped iterations: {skipped:3d} |"
        f" number of nan iterations: {nan:3d} |"
    )


def megatron_losses(last: int, every: int = 100) -> dict[int, float]:
    rng = random.Random(1)
    return {it: 3.5 + 7.3 * math.exp(-it / 400) + rng.gauss(0, 0.02) for it in range(every, last + 1, every)}


def test_megatron_spike_at_a_sparse_log_interval(tmp_path):
    losses = megatron_losses(3000)
    clean = tmp_path / "clean.log"
    clean.write_text("\n".join(megatron_line(it, v) for it, v in losses.items()) + "\n")
    assert scan(clean, now=OLD).verdict == "converged"  # the steep early fall is not a spike
    losses[2500] = 2.5 * losses[2400]  # 24 logged points before it: fewer than the sigma rule's 32
    log = tmp_path / "slurm-1.out"
    log.write_text("\n".join(megatron_line(it, v) for it, v in losses.items()) + "\n")
    result = scan(log, now=OLD)
    assert result.source == "megatron" and result.verdict == "unstable" and result.first_step["loss_spike"] == 2500
    spike = result.events[0]
    assert spike.value == pytest.approx(losses[2500]) and "median" in spike.detail and spike.steps == 1
    assert scan(log, ScanThresholds(spike_ratio=None), now=OLD).verdict == "converged"


def test_live_logs_with_a_problem_raise_the_alarm(tmp_path):
    losses = megatron_losses(3000)
    log = tmp_path / "live.out"
    log.write_text("\n".join(megatron_line(it, v) for it, v in losses.items()) + "\n")
    healthy = scan(log)  # just written: mtime is now
    assert healthy.verdict == "running" and healthy.live and format_result(healthy).startswith(f"{log}: running |")
    losses[2500] = 2.5 * losses[2400]
    log.write_text("\n".join(megatron_line(it, v) for it, v in losses.items()) + "\n")
    spiked = scan(log)
    assert spiked.verdict == "unstable" and spiked.live and "still running" in spiked.reasons[0]
    assert format_result(spiked).startswith(f"{log}: unstable (live) |")
    assert scan(log, running=True).verdict == "unstable"
    nanogpt = tmp_path / "nanogpt.log"
    nanogpt.write_text(NANOGPT + "iter 50: loss nan, time 41.20ms, mfu 12.00%\n")
    assert scan(nanogpt).verdict == "diverged@50" and scan(nanogpt).live

    def entropy(step):
        return [2.0, 2.0 if step < 40 else 0.01]

    run = write_run(tmp_path / "r", curve(60), status=None, probe_every=10, entropy=entropy)
    collapsed = scan(run)
    assert collapsed.verdict == "entropy_collapse@40" and collapsed.live


def test_megatron_loss_vanishing_from_its_lines(tmp_path):
    losses = megatron_losses(1000)
    lines = [megatron_line(it, v if it < 700 else None, grad_norm="1.234" if it < 700 else "nan") for it, v in losses.items()]
    log = tmp_path / "vanished.out"
    log.write_text("\n".join(lines).replace("grad norm: nan |", "grad norm: 1.5 |") + "\n")  # counters stay 0
    result = scan(log, now=OLD)
    assert result.verdict == "loss_vanished@700" and result.verdict_step == 700
    event = [e for e in result.events if e.kind == "loss_missing"]
    assert len(event) == 1 and event[0].steps == 4  # iterations 700..1000
    assert result.final_train_loss is None and result.last_finite_step == 600
    assert result.last_finite_loss == pytest.approx(float(f"{losses[600]:.6E}"))
    line = format_result(result)
    assert f"last finite loss {result.last_finite_loss:.4f} at step 600, loss missing from step 700" in line
    assert "Megatron" in result.reasons[0]
    # fp16 loss-scale overflows: a line of only skipped iterations has no loss to average; not an alarm
    skipped = [megatron_line(it, v if it != 500 else None, skipped=100 if it == 500 else 0) for it, v in losses.items()]
    log.write_text("\n".join(skipped) + "\n")
    assert scan(log, now=OLD).verdict == "converged"
    # a live log's half-written last line (no newline yet) is not a lost loss
    torn = "\n".join(megatron_line(it, v) for it, v in losses.items()) + "\n" + megatron_line(1100, None)[:60]
    log.write_text(torn)
    result = scan(log)
    assert result.verdict == "running" and result.counts["skipped_lines"] == 1


TORCHTITAN_COLOURS = {"red": "\x1b[31m", "green": "\x1b[32m", "yellow": "\x1b[33m", "blue": "\x1b[34m", "magenta": "\x1b[35m",
                      "cyan": "\x1b[36m", "reset": "\x1b[39m", "orange": "\x1b[38;2;180;60;0m", "turquoise": "\x1b[38;2;54;234;195m"}


def torchtitan_line(step: int, loss: float, grad_norm: float | None = None) -> str:
    """MetricsProcessor.log's console line with torchtitan's Color codes, behind its logger prefix."""
    c = TORCHTITAN_COLOURS
    grad = f"{c['orange']}grad_norm: {grad_norm:7.4f}  " if grad_norm is not None else ""
    return (
        f"[rank0]:[titan] 2025-05-01 12:00:00,000 - root - INFO - {c['red']}step: {step:2}  {c['green']}loss: {loss:7.4f}  "
        f"{grad}{c['turquoise']}memory: 12.34GiB(15.62%)  {c['blue']}tps: {1234:,}  {c['cyan']}tflops: 56.78  "
        f"{c['magenta']}mfu: 12.34%{c['reset']}"
    )


def test_torchtitan_log_with_colour_codes(tmp_path):
    c = TORCHTITAN_COLOURS
    losses = curve(40, start=11.0, end=4.0)
    rows = [torchtitan_line(step, v, grad_norm=1.0 if step % 2 else None) for step, v in enumerate(losses, start=1)]
    rows.insert(20, f"[rank0]:[titan] 2025-05-01 12:00:00,000 - root - INFO - {c['yellow']}validate step: 20  "
                    f"{c['green']}loss:  5.1234  {c['turquoise']}memory: 12.34GiB(15.62%)  {c['blue']}tps: 2,345{c['reset']}")
    log = tmp_path / "titan.log"
    log.write_text("\n".join(rows) + "\n")
    assert "\x1b[31mstep:  1  \x1b[32mloss:" in log.read_text()
    result = scan(log, now=OLD)
    assert result.source == "torchtitan" and result.verdict == "converged"
    assert result.counts["steps"] == 40 and result.last_step == 40 and result.final_val_loss == pytest.approx(5.1234)
    assert result.final_train_loss == pytest.approx(round(losses[-1], 4))
    log.write_text("\n".join([*rows, torchtitan_line(41, math.nan)]) + "\n")
    assert scan(log, preset="torchtitan", now=OLD).verdict == "diverged@41"


def test_fp4lab_local_worker_log(tmp_path):
    """The real output of `fp4lab train` as a local sweep worker writes it (stdout and stderr in one file)."""
    config = tmp_path / "run.toml"
    config.write_text('recipe = "bf16"\nsteps = 8\nseq_len = 16\nbatch_size = 2\neval_every = 4\n[data]\nsource = "synthetic"\n')
    log = tmp_path / "logs" / "quick-0001.local.log"
    log.parent.mkdir()
    with open(log, "ab") as out:
        command = [sys.executable, "-m", "fp4lab.cli", "train", "--config", str(config), "--out", str(tmp_path / "run")]
        assert subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=300).returncode == 0, log.read_text()
    text = log.read_text()
    assert "step 7/7 loss " in text and " val_loss " in text and "status: completed" in text
    result = scan(log)  # fresh, but its summary block says it finished
    assert result.source == "fp4lab" and result.verdict == "converged" and not result.live
    assert result.last_step == 7 and result.final_val_loss is not None and result.summary_status == "completed"
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert result.final_train_loss == pytest.approx(summary["final_train_loss"], abs=1e-4)

    progress = "".join(f"step {s}/60 loss {5.0 - 0.02 * s:.4f} lr 0.02 tok/s 14694\n" for s in range(3, 58, 3))
    block = "---\nstatus: {}\ndiverged_step: {}\nsteps_completed: 57\nfinal_train_loss: 3.86\nout_dir: runs/x\n"
    log.write_text(progress + block.format("diverged", 57))
    diverged = scan(log, now=OLD)
    assert diverged.verdict == "diverged@57" and diverged.last_finite_step == 57
    assert "last finite loss 3.8600 at step 57, diverged step 57" in format_result(diverged)
    log.write_text(progress + block.format("preempted", "None"))
    assert scan(log, now=OLD).verdict == "interrupted"  # stopped by a preemption, not out of time
    log.write_text(progress + block.format("preempted", "None") + "step 60/60 loss 3.8000 lr 0.02 tok/s 14694\n")
    assert scan(log).verdict == "running"  # the resumed segment's lines follow the old block


def test_cli_scans_every_path_and_reports_the_missing_one(run_cli, tmp_path):
    nanogpt, spiked = tmp_path / "nanogpt.log", tmp_path / "megatron.out"
    nanogpt.write_text(NANOGPT)
    losses = megatron_losses(3000)
    losses[2500] = 2.5 * losses[2400]
    spiked.write_text("\n".join(megatron_line(it, v) for it, v in losses.items()) + "\n")
    missing = tmp_path / "nope.log"
    out = run_cli("scan", str(nanogpt), str(missing), str(spiked), "--events")
    assert out.returncode == 2
    assert out.stderr.strip() == f"fp4lab: error: scan: no such run folder or log: {missing}"
    rows = [line for line in out.stdout.splitlines() if line.startswith(("│ nanogpt.log ", "│ megatron.out "))]
    assert len(rows) == 2 and "running" in rows[0] and "unstable (live)" in rows[1]
    assert any(line.startswith("  megatron.out: loss_spike@2500: ") for line in out.stdout.splitlines())
    assert run_cli("scan", str(spiked), "--not-running").returncode == 1
    assert run_cli("scan", str(nanogpt)).returncode == 0
    verdicts = json.loads(run_cli("scan", str(nanogpt), str(spiked), "--json").stdout)
    assert [v["verdict"] for v in verdicts] == ["running", "unstable"] and verdicts[1]["live"] is True
    empty = tmp_path / "empty.log"
    empty.write_text("")
    no_loss = run_cli("scan", str(empty), "--preset", "megatron")
    assert no_loss.returncode == 1 and "no_loss" in no_loss.stdout and "the log is empty" in no_loss.stdout
    bad = run_cli("scan", str(nanogpt), "--preset", "fairseq")
    assert bad.returncode == 2 and "--preset 'fairseq'" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_a_log_holding_several_runs_judges_each_against_its_own_history(tmp_path):
    # A log that restarts at step 0 (a second run appended to it, or a restart from an earlier
    # checkpoint): the new run's high first losses are not a spike against the old run's low ones...
    def nanogpt_lines(losses):
        return "".join(f"iter {i}: loss {x:.4f}, time 40.00ms, mfu 12.00%\n" for i, x in enumerate(losses))

    log = tmp_path / "train.log"
    log.write_text(nanogpt_lines(curve(200, seed=1)) + nanogpt_lines(curve(200, seed=2)))
    result = scan(log, preset="nanogpt", now=OLD)
    assert result.verdict == "converged", result.events
    assert result.counts["steps"] == 400 and result.last_step == 199
    # ...but a spike inside the second run is still caught, at its step
    second = curve(200, seed=2)
    second[120] *= 2.5
    log.write_text(nanogpt_lines(curve(200, seed=1)) + nanogpt_lines(second))
    result = scan(log, preset="nanogpt", now=OLD)
    assert result.verdict == "unstable" and result.first_step["loss_spike"] == 120
