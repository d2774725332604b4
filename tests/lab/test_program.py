"""program.md: the example header parses; every malformed header fails in one line naming the file and
the key; better/improvement follow the direction; editable() globs and refuses unsafe paths;
metric_from_output takes the last match."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from fp4lab.lab.specs.program import ProgramError, load_program, metric_from_output, parse_program

HEADER = """\
metric = "val_loss"
direction = "minimize"

[run]
kind = "fp4lab"
base = { model = "tiny", seq_len = 32, batch_size = 8, device = "cpu", data = { source = "synthetic" } }
steps = 100
minutes = 5.0

[health]
no_nan = true
entropy_floor = 0.05
max_logit = 100.0
require_verdict = ["converged"]

[edit]
files = ["fp4lab/recipes/*.toml", "docs/**/*.md"]

[search_space]
lr = { type = "float", low = 0.005, high = 0.05, log = true }
ns_steps = { type = "int", low = 3, high = 6 }
recipe = { type = "categorical", choices = ["nvfp4", "mxfp4-rowsr-h32"] }
"data.vocab_size" = { type = "int", low = 64, high = 256 }

[stop]
iterations = 20
target = 3.5
plateau = 8

[noise]
seeds = 3
rule = "sigma"
k = 2.0
confidence = 0.95
"""

COMMAND = """\
metric = "score"
direction = "maximize"

[run]
kind = "command"
command = ["python", "bench.py", "--fast"]
metric_regex = '^score:\\s*([-+0-9.eE]+)'
timeout_minutes = 10
env = { BENCH_MODE = "quick" }

[search_space]
width = { type = "int", low = 1, high = 8 }
"""


def document(header: str) -> str:
    return f"# Goal\n\nLower the validation loss.\n\n```toml ratchet\n{header}```\n\nMore prose after the block.\n"


def error(header: str | None = None, text: str | None = None) -> str:
    with pytest.raises(ProgramError) as exc:
        parse_program(text if text is not None else document(header), "dir/program.md")
    message = str(exc.value)
    assert "\n" not in message and message.startswith("dir/program.md")
    return message


def replace(old: str, new: str, header: str = HEADER) -> str:
    assert old in header
    return header.replace(old, new)


def test_example_parses(tmp_path):
    path = tmp_path / "program.md"
    path.write_text(document(HEADER))
    program = load_program(path)
    assert program.path == path
    assert program.goal == "# Goal\n\nLower the validation loss.\n\nMore prose after the block."
    assert program.metric == "final_val_loss" and program.direction == "minimize"
    assert program.run.kind == "fp4lab" and program.run.steps == 100 and program.run.minutes == 5.0
    assert program.run.base["data"] == {"source": "synthetic"}
    assert program.health.require_verdict == ("converged",) and program.health.max_logit == 100.0
    assert program.edit_files == ("fp4lab/recipes/*.toml", "docs/**/*.md")
    assert set(program.search_space) == {"lr", "ns_steps", "recipe", "data.vocab_size"}
    assert program.search_space["lr"].log and program.search_space["ns_steps"].high == 6
    assert (program.stop.iterations, program.stop.target, program.stop.plateau) == (20, 3.5, 8)
    assert (program.noise.seeds, program.noise.rule, program.noise.k) == (3, "sigma", 2.0)
    assert program.header["run"]["steps"] == 100 and program.header["metric"] == "val_loss"


def test_defaults_and_train_metric_names():
    minimal = 'metric = "best_train_loss"\ndirection = "minimize"\n[run]\nkind = "fp4lab"\nsteps = 5\n'
    program = parse_program(document(minimal))
    assert program.metric == "best_train_loss"  # the key train.loop writes to summary.json
    health = program.health
    assert health.no_nan and health.entropy_floor is None and health.require_verdict == ("converged",)
    assert program.edit_files == () and program.search_space == {}
    assert program.noise.seeds == 1 and program.stop.iterations is None
    assert not program.editable("fp4lab/recipes/a.toml")


def test_command_program():
    program = parse_program(document(COMMAND))
    assert program.metric == "score" and program.direction == "maximize"
    assert program.run.command == ("python", "bench.py", "--fast")
    assert program.run.timeout_minutes == 10 and program.run.env == {"BENCH_MODE": "quick"}
    assert metric_from_output("warmup\nscore: 1.5\nscore: 2.25\ndone\n", program.run.metric_regex) == 2.25


def test_no_torch_at_import():
    code = "import fp4lab.lab.specs.program, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_block_count_and_fences():
    assert "found no ```toml ratchet block; add one" in error(text="# Goal\n\nno header here\n")
    two = error(text=f"```toml ratchet\n{HEADER}```\n" * 2)
    assert "found 2 ```toml ratchet blocks (lines 1, 37); keep exactly one" in two
    assert "never closed" in error(text=f"# Goal\n```toml ratchet\n{HEADER}")
    # An example inside a longer fence is documentation, not a second header.
    example = "````markdown\n```toml ratchet\nmetric = 1\n```\n````\n"
    program = parse_program(example + document(HEADER))
    assert program.metric == "final_val_loss" and "metric = 1" in program.goal


def test_bad_toml_names_the_line():
    # The block opens on line 5, so its 2nd line is line 7 of program.md.
    message = error(text=f"# Goal\n\ntext\n\n```toml ratchet\nmetric = \"val_loss\"\ndirection = \n{HEADER[40:]}```\n")
    assert "not valid TOML" in message and "line 7" in message


@pytest.mark.parametrize("header, expected", [
    ("colour = 1\n" + HEADER, ": colour: unknown key; allowed: metric, direction, run"),
    (replace("[stop]", "[stop]\nforever = true"), "[stop].forever: unknown key; allowed in [stop]: iterations"),
    (replace('direction = "minimize"', 'direction = "lower"'), "direction: 'lower' is not supported; allowed: minimize, max"),
    (replace('kind = "fp4lab"', 'kind = "foo"'), "[run].kind: 'foo' is not supported; allowed: fp4lab, command"),
    (replace('kind = "fp4lab"\n', ""), "[run].kind: missing"),
    (replace('metric = "val_loss"\n', ""), "metric: missing"),
    (replace('"val_loss"', '"accuracy"'), "metric: 'accuracy' is not a summary key of an fp4lab run"),
    (replace('model = "tiny"', 'model = "tiny", dropout = 0.1'), "[run].base.dropout: unknown key; allowed in [run].base"),
    (replace('source = "synthetic"', 'source = "synthetic", shuffle = true'), "[run].base.data.shuffle: unknown key"),
    (replace('model = "tiny"', 'model = "huge"'), "[run].base: model='huge' is not supported"),
    (replace('model = "tiny"', 'model = "tiny", out_dir = "x"'), "[run].base.out_dir: is chosen by the ratchet"),
    (replace('model = "tiny"', 'model = "tiny", steps = 3'), "[run].base.steps: the per-run budget is [run].steps"),
    (replace("steps = 100\nminutes = 5.0\n", ""), "[run]: kind = \"fp4lab\" needs a budget"),
    (replace("steps = 100", "steps = 0"), "[run].steps: 0 must be an integer >= 1"),
    (replace("steps = 100", "steps = 1.5"), "[run].steps: 1.5 must be an integer >= 1"),
    (replace("minutes = 5.0", "minutes = -1"), "[run].minutes: -1.0 must be a number of minutes > 0"),
    (replace("steps = 100", 'steps = 100\ncommand = ["x"]'), "[run].command: only applies to kind = \"command\""),
    (replace("lr = {", "dropout = {"), "[search_space].dropout: is not a TrainConfig field"),
    (replace("lr = {", "seed = {"), "[search_space].seed: is not searchable"),
    (replace('"data.vocab_size"', '"data.shuffle"'), "[search_space].data.shuffle: is not a TrainConfig field"),
    (replace("low = 0.005, high = 0.05", "low = 0.05, high = 0.005"), "[search_space].lr: low = 0.05 must be below high"),
    (replace("low = 0.005, high = 0.05", "low = 0.0, high = 0.05"), "[search_space].lr: log = true needs low > 0"),
    (replace("low = 3, high = 6", "low = 3.5, high = 6"), "[search_space].ns_steps: type = \"int\" needs integer"),
    (replace('choices = ["nvfp4", "mxfp4-rowsr-h32"]', "choices = []"), "[search_space].recipe: type = \"categorical\" takes"),
    (replace('"mxfp4-rowsr-h32"]', '"nvfp4"]'), "[search_space].recipe.choices[1]: 'nvfp4': choices are distinct"),
    (replace('"mxfp4-rowsr-h32"]', '"fp3"]'), "[search_space].recipe: unknown recipe 'fp3'"),
    (replace('type = "int", low = 3', 'type = "integer", low = 3'), "ns_steps.type: 'integer' is not supported"),
    (replace("low = 3, high = 6", "low = 3, high = 6, step = 1"), "[search_space].ns_steps.step: unknown key"),
    (replace('require_verdict = ["converged"]', 'require_verdict = ["fine"]'), "require_verdict: 'fine' is not a scanner verdict"),
    (replace("no_nan = true", 'no_nan = "yes"'), "[health].no_nan: 'yes' must be true or false"),
    (replace('"docs/**/*.md"', '"../secrets/*"'), "[edit].files[1]: '../secrets/*' must be a pattern relative"),
    (replace('"docs/**/*.md"', '"/etc/*"'), "[edit].files[1]: '/etc/*' must be a pattern relative"),
    (replace("plateau = 8", "plateau = 0"), "[stop].plateau: 0 must be an integer >= 1"),
    (replace('rule = "sigma"', 'rule = "vibes"'), "[noise].rule: 'vibes' is not supported; allowed: sigma, paired"),
    (replace("seeds = 3", "seeds = 1").replace('"sigma"', '"paired"'), "[noise].rule: \"paired\" compares"),
    (replace("confidence = 0.95", "confidence = 1.5"), "[noise].confidence: 1.5 must be between 0 and 1"),
    (HEADER + "\n[slurm]\nntasks_per_node = 2\n", "[slurm]: [slurm] ntasks_per_node = 2 gives each experiment 2 ranks"),
])
def test_fp4lab_errors(header, expected):
    assert expected in error(header)


@pytest.mark.parametrize("header, expected", [
    (replace("metric_regex = '^score:\\s*([-+0-9.eE]+)'", "metric_regex = '^score: ([0-9'", COMMAND),
     "[run].metric_regex: '^score: ([0-9' does not compile"),
    (replace("([-+0-9.eE]+)", "[-+0-9.eE]+", COMMAND), "has no capture group; wrap the number in ( )"),
    (replace("metric_regex", "# metric_regex", COMMAND), "[run].metric_regex: missing"),
    (replace('command = ["python", "bench.py", "--fast"]', 'command = "python bench.py"', COMMAND),
     "[run].command: 'python bench.py' must be a list"),
    (replace('command = ["python", "bench.py", "--fast"]', "command = []", COMMAND), "[run].command: must be a non-empty"),
    (replace("timeout_minutes = 10", "timeout_minutes = 0", COMMAND), "[run].timeout_minutes: 0.0 must be a number of minutes > 0"),
    (replace('BENCH_MODE = "quick"', '"BAD-NAME" = "x"', COMMAND), "[run].env.BAD-NAME: is not an environment"),
    (replace('BENCH_MODE = "quick"', "BENCH_MODE = 1", COMMAND), "[run].env.BENCH_MODE: 1 must be a string"),
    (replace('kind = "command"', 'kind = "command"\nsteps = 5', COMMAND), "[run].steps: only applies to kind = \"fp4"),
])
def test_command_errors(header, expected):
    assert expected in error(header)


def test_better_and_improvement():
    low = parse_program(document(HEADER))
    high = parse_program(document(COMMAND))
    assert low.better(3.0, 3.1) and not low.better(3.1, 3.0) and not low.better(3.0, 3.0)
    assert high.better(3.1, 3.0) and not high.better(3.0, 3.1) and not high.better(3.0, 3.0)
    assert low.improvement(3.0, 3.5) == pytest.approx(0.5) and low.improvement(3.5, 3.0) == pytest.approx(-0.5)
    assert high.improvement(3.5, 3.0) == pytest.approx(0.5)
    assert not low.better(math.nan, 3.0) and low.better(3.0, math.inf)


def test_editable():
    program = parse_program(document(HEADER))
    assert program.editable("fp4lab/recipes/nvfp4.toml")
    assert not program.editable("fp4lab/recipes/sub/nvfp4.toml")  # `*` stays within one folder
    assert not program.editable("fp4lab/recipes/nvfp4.py") and not program.editable("secret.txt")
    assert program.editable("docs/a.md") and program.editable("docs/x/y/z.md")  # `**/` is zero or more folders
    for unsafe in ("fp4lab/recipes/../../secret.toml", "../fp4lab/recipes/a.toml", "/fp4lab/recipes/a.toml",
                   "./fp4lab/recipes/a.toml", "fp4lab//recipes/a.toml", "docs/.git/x.md", "", "docs/a\n.md"):
        assert not program.editable(unsafe), unsafe


def test_metric_from_output():
    regex = r"^score:\s*([-+0-9.eE]+|nan|inf)"
    assert metric_from_output("score: 1\nnoise\nscore: -2.5e-1\n", regex) == -0.25
    assert metric_from_output("nothing here\n", regex) is None
    assert metric_from_output("score: 1\nscore: nan\n", regex) is None  # the last match decides
    assert metric_from_output("score: inf\n", regex) is None
    assert metric_from_output("score: 1.2.3\n", regex) is None
    assert metric_from_output("x score: 4\n", regex) is None  # ^ anchors at line starts


def test_the_shipped_program_keeps_only_runs_whose_attention_entropy_stays_above_0_1():
    # OptiTrain-FP4's keep rule ("entropy > 0.1"): a run whose attention entropy falls below it is unhealthy.
    from pathlib import Path

    from fp4lab.lab.specs.program import load_program

    program = load_program(Path(__file__).resolve().parents[2] / "program.md")
    assert program.health.entropy_floor == 0.1 and program.health.require_verdict == ("converged",)


def test_the_gpu_pilot_program_searches_the_issues_settings_on_the_ledgers_recipe_and_data():
    """sweeps/nvfp4_pilot.md (issue 40): nvfp4 at 125m on pycode, a short pilot with a time cap, the
    Optuna space over Muon lr, AdamW lr, Newton-Schulz K and QK-Clip tau, two seeds in the gate; its
    starting point is the ledger's settings and lies inside the space."""
    from pathlib import Path

    from fp4lab.lab.specs.program import load_program
    from fp4lab.lab.specs.sweep_spec import load_spec

    root = Path(__file__).resolve().parents[2]
    program = load_program(root / "sweeps" / "nvfp4_pilot.md")
    base = program.run.base
    assert (base["recipe"], base["model"], base["data"]["source"], base["device"]) == ("nvfp4", "125m", "pycode", "cuda")
    assert program.run.steps <= 200 and program.run.minutes and program.noise.seeds == 2
    assert set(program.search_space) == {"lr", "adam_lr", "ns_steps", "qk_clip_tau"}
    ledger = load_spec(root / "sweeps" / "ledger.toml").base
    for name in ("lr", "adam_lr", "model", "batch_size", "seq_len", "optimizer"):
        assert base[name] == ledger[name], name
    for name, space in program.search_space.items():
        assert space.low <= base[name] <= space.high, name
