"""train.config.toml_text: the one TOML writer (run configs, the ratchet's parameter file)."""

from __future__ import annotations

import math
import tomllib

from fp4lab.train.config import TrainConfig, toml_text


def test_everything_written_reads_back_the_same():
    table = {"lr": 0.02, "tiny": 1e-300, "steps": 10, "flag": True, "name": 'a "quoted"\nline\x7f\\', "choices": [1, 2.5],
             "nested": {"source": "x.bin", "inner": {"k": -1}}, "bad": math.nan, "big": math.inf, "gone": None}
    text = toml_text(table, ["written by a test", "second line"])
    assert text.startswith("# written by a test\n# second line\n")
    back = tomllib.loads(text)
    assert math.isnan(back.pop("bad")) and "gone" not in back
    expected = {k: v for k, v in table.items() if k not in ("bad", "gone")}
    assert back == expected


def test_a_train_config_round_trips():
    config = TrainConfig(recipe="nvfp4", lr=0.0123, steps=7).to_dict()
    assert TrainConfig.from_dict(tomllib.loads(toml_text(config))).to_dict() == config
