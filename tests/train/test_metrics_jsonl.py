"""fp4lab.train.jsonl: strict JSON lines, and the one rule every metrics reader follows."""

from __future__ import annotations

import json
import math

from fp4lab.train.checkpoint import MetricsLog
from fp4lab.train.jsonl import json_line, metrics_records, read_metrics_file


def test_lines_are_strict_json_and_read_back_as_floats():
    line = json_line({"step": 3, "loss": math.nan, "grad_norm": math.inf, "probe": [[-math.inf, 1.0]]})
    assert json.loads(line, parse_constant=lambda token: (_ for _ in ()).throw(ValueError(token)))["loss"] == "nan"
    (record,) = metrics_records([line])
    assert math.isnan(record["loss"]) and record["grad_norm"] == math.inf and record["probe"] == [[-math.inf, 1.0]]


def test_torn_and_corrupt_lines_are_skipped_and_counted_never_fatal():
    lines = ['{"step": 0, "loss": 5.0}', "", "garbage", '[1, 2]', '{"loss": 4.0}', '{"step": true}',
             '{"step": 1.0, "loss": 4.5}', '{"step": 2, "loss": NaN}', '{"step": 3, "lo']
    counts: dict[str, int] = {}
    records = list(metrics_records(lines, counts))
    assert [r["step"] for r in records] == [0, 2] and math.isnan(records[1]["loss"])  # bare NaN of older files
    assert counts == {"lines": 8, "skipped_lines": 6}


def test_a_resumed_log_keeps_the_steps_before_the_checkpoint_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json_line({"step": s, "loss": 5.0 - s}) + "\n" for s in range(6)) + '{"step": 6, "lo')
    log = MetricsLog(path, resume_step=4)
    log.write({"step": 4, "loss": 0.5})
    log.close()
    counts: dict[str, int] = {}
    assert [r["step"] for r in read_metrics_file(path, counts)] == [0, 1, 2, 3, 4]
    assert counts["skipped_lines"] == 0
