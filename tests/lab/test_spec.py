"""Sweep specs: the shipped specs load and expand; malformed specs fail in one line naming the key;
run ids are stable; grid and random expansion; optuna validation; no torch at import."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fp4lab.lab.specs.sweep_spec import SpecError, expand, load_spec, make_run, run_id
from fp4lab.nn.recipe import list_recipes

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {"quickstart": 3, "recipes": len(list_recipes()), "muon_qkclip": 36, "ledger": 3 * len(list_recipes()),
           "ledger_stress": 18, "ledger_ns": 6, "ledger_horizon": 10, "ledger_speed": 11}

BASE = """
name = "t"
[base]
model = "tiny"
steps = 10
[base.data]
source = "synthetic"
"""


def write(tmp_path: Path, text: str, name: str = "spec.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as exc:
        load_spec(path)
    message = str(exc.value)
    assert "\n" not in message and str(path) in message
    return message


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_specs_load_and_expand(name):
    spec = load_spec(ROOT / "sweeps" / f"{name}.toml")
    runs = expand(spec)
    assert spec.name == name and len(runs) == SHIPPED[name] == spec.size()
    assert len({r.id for r in runs}) == len(runs)
    for run in runs:
        assert run.config["out_dir"] == f"runs/{name}/{run.id}"
        assert run_id(run.config) == run.id


def test_recipes_sweep_covers_every_recipe_with_one_seed():
    runs = expand(load_spec(ROOT / "sweeps" / "recipes.toml"))
    assert sorted(r.config["recipe"] for r in runs) == list_recipes()
    assert len({(r.config["seed"], r.config["data"]["source"], r.config["steps"]) for r in runs}) == 1


def test_the_ledger_runs_every_recipe_on_three_seeds_with_one_budget_within_the_corpus():
    runs = expand(load_spec(ROOT / "sweeps" / "ledger.toml"))
    assert sorted({r.config["recipe"] for r in runs}) == list_recipes()
    for recipe in list_recipes():
        assert sorted(r.config["seed"] for r in runs if r.config["recipe"] == recipe) == [0, 1, 2]
    budgets = {(r.config["model"], r.config["data"]["source"], r.config["steps"], r.config["batch_size"], r.config["seq_len"]) for r in runs}
    assert len(budgets) == 1
    (_model, source, steps, batch, seq), = budgets
    assert source == "pycode" and steps * batch * seq < 50e6  # under the corpus's ~75M tokens: none repeats


def test_the_stress_ablation_pushes_lr_and_drops_qk_clip_and_the_hadamard_transform():
    ledger = expand(load_spec(ROOT / "sweeps" / "ledger.toml"))[0].config
    runs = expand(load_spec(ROOT / "sweeps" / "ledger_stress.toml"))
    assert {r.config["qk_clip"] for r in runs} == {"kimi", "none"}
    assert max(r.config["lr"] for r in runs) >= 10 * ledger["lr"]
    assert {"bf16", "nvfp4", "nvfp4-no-rht"} <= {r.config["recipe"] for r in runs}
    assert all(r.config["probe_every"] <= 10 and r.config["data"]["source"] == "pycode" for r in runs)
    adamw = expand(load_spec(ROOT / "sweeps" / "ledger_stress_adamw.toml"))
    assert min(r.config["adam_lr"] for r in adamw) >= 10 * ledger["adam_lr"] and {r.config["qk_clip"] for r in adamw} == {"none"}
    assert {r.config["recipe"] for r in adamw} == {"bf16", "nvfp4", "nvfp4-no-rht"}
    assert {(r.config["model"], r.config["steps"], r.config["probe_every"]) for r in adamw} == {(runs[0].config["model"], 300, 10)}


def test_the_optitrain_ablation_crosses_recipe_and_newton_schulz_polynomial_on_cpu():
    runs = expand(load_spec(ROOT / "sweeps" / "optitrain_ns.toml"))
    cells = {(r.config["recipe"], r.config["ns_polynomial"], r.config["seed"]) for r in runs}
    assert cells == {(recipe, ns, seed) for recipe in ("bf16", "optitrain") for ns in ("quintic", "cubic") for seed in (0, 1)}
    shared = [{k: v for k, v in r.config.items() if k not in ("recipe", "ns_polynomial", "seed", "out_dir")} for r in runs]
    assert all(config == shared[0] for config in shared)
    assert shared[0]["device"] == "cpu" and shared[0]["model"] == "tiny" and shared[0]["optimizer"] == "muon"


def test_the_ledger_cause_and_horizon_rows_keep_the_ledgers_shape():
    """ledger_ns: the two missing cells of recipe x Newton-Schulz polynomial (bf16 cubic, optitrain
    quintic), everything else the ledger's; ledger_horizon: the ledger's shape at 5x its steps, warmup
    scaled with them, within the corpus."""
    from fp4lab.nn.recipe import load_recipe

    ledger = {k: v for k, v in expand(load_spec(ROOT / "sweeps" / "ledger.toml"))[0].config.items() if k not in ("recipe", "seed", "out_dir")}
    runs = expand(load_spec(ROOT / "sweeps" / "ledger_ns.toml"))
    cells = set()
    for run in runs:
        recipe = load_recipe(str(ROOT / run.config["recipe"]))
        cells.add((recipe.name, recipe.optimizer.ns_polynomial, run.config["seed"]))
        assert {k: v for k, v in run.config.items() if k not in ("recipe", "seed", "out_dir")} == ledger
    assert cells == {(name, ns, seed) for name, ns in (("bf16-cubic", "cubic"), ("optitrain-quintic", "quintic")) for seed in (0, 1, 2)}
    horizon = expand(load_spec(ROOT / "sweeps" / "ledger_horizon.toml"))
    assert {(r.config["recipe"], r.config["seed"]) for r in horizon} == {
        (recipe, seed) for recipe in ("bf16", "fp8", "nvfp4", "nvfp4-global", "mxfp4-rowsr-h32") for seed in (0, 1)}
    for run in horizon:
        config = run.config
        assert config["steps"] == 5 * ledger["steps"] and config["warmup_steps"] == 5 * ledger["warmup_steps"]
        assert {k: v for k, v in config.items() if k not in ("recipe", "seed", "out_dir", "steps", "warmup_steps")} == {
            k: v for k, v in ledger.items() if k not in ("steps", "warmup_steps")}
        assert config["steps"] * config["batch_size"] * config["seq_len"] < 50e6  # none of the corpus repeats


def test_shipped_optuna_spec_loads_and_makes_valid_trial_runs():
    spec = load_spec(ROOT / "sweeps" / "muon_tpe.toml")
    assert spec.method == "optuna" and spec.size() == spec.optuna.n_trials == 8
    space = spec.optuna.search_space
    corner = make_run(spec, {name: p.low for name, p in space.items()})
    assert corner.config["device"] == "cpu" and corner.config["lr"] == space["lr"].low
    assert corner.id != make_run(spec, {name: p.high for name, p in space.items()}).id


def test_quickstart_is_small_and_on_cpu():
    for run in expand(load_spec(ROOT / "sweeps" / "quickstart.toml")):
        assert run.config["device"] == "cpu" and run.config["model"] == "tiny" and run.config["steps"] <= 100


def test_malformed_toml(tmp_path):
    assert "not valid TOML" in error(tmp_path, 'name = "t"\n[axes\n')


@pytest.mark.parametrize(
    "extra, key",
    [
        ("colour = 1\n", "colour"),
        ("[slurm]\npartitions = 'gpu'\n", "slurm.partitions"),
        ("[scan]\nspike_sigmaa = 3\n", "scan.spike_sigmaa"),
        ("[axes]\nlearning_rate = [0.1]\n", "axes.learning_rate"),
        ("[axes]\n'data.sauce' = ['x']\n", "axes.data.sauce"),
    ],
)
def test_unknown_keys_name_the_key(tmp_path, extra, key):
    message = error(tmp_path, extra + BASE if "[" not in extra else BASE + extra)
    assert f": {key}:" in message and "allowed" in message


def test_unknown_base_keys(tmp_path):
    assert "base.stepz: unknown key" in error(tmp_path, 'name = "t"\n[base]\nstepz = 3\n')
    assert "base.data.sorce: unknown key" in error(tmp_path, 'name = "t"\n[base.data]\nsorce = "x"\n')
    assert "base.out_dir" in error(tmp_path, 'name = "t"\n[base]\nout_dir = "x"\n')


def test_bad_axis_values_name_the_index(tmp_path):
    message = error(tmp_path, BASE + "[axes]\nlr = [0.01, 0.02, -1.0]\n")
    assert "axes.lr[2]" in message and "lr=-1.0" in message
    assert "axes.model[1]" in error(tmp_path, BASE + "[axes]\nmodel = ['tiny', 'huge']\n")
    assert "axes.lr: must be a non-empty list" in error(tmp_path, BASE + "[axes]\nlr = []\n")
    assert "axes.lr[2]" in error(tmp_path, BASE + "[axes]\nlr = [0.1, 0.2, 0.1]\n")


def test_unknown_recipe(tmp_path):
    message = error(tmp_path, BASE + "[axes]\nrecipe = ['bf16', 'nvfp5']\n")
    assert "axes.recipe[1]" in message and "unknown recipe 'nvfp5'" in message and "nvfp4" in message
    assert "base.recipe" in error(tmp_path, 'name = "t"\n[base]\nrecipe = "missing.toml"\n')


def test_recipe_path_is_accepted(tmp_path):
    recipe = write(tmp_path, 'extends = "nvfp4"\nname = "mine"\n', "mine.toml")
    spec = load_spec(write(tmp_path, BASE + f"[axes]\nrecipe = ['bf16', '{recipe}']\n"))
    assert [r.config["recipe"] for r in expand(spec)] == ["bf16", str(recipe)]


@pytest.mark.parametrize(
    "slurm, key",
    [
        ("partition = 'gpu; rm -rf ~'", "slurm.partition"),
        ("account = '$(whoami)'", "slurm.account"),
        ("constraint = 'a b'", "slurm.constraint"),
        ("mem = '64 G'", "slurm.mem"),
        ("time = '4 hours'", "slurm.time"),
        ('setup = ["echo hi\\nrm -rf ~"]', "slurm.setup[0]"),
        ('setup = ["ok", "a\\u0000b"]', "slurm.setup[1]"),
        ("nodes = 0", "slurm.nodes"),
        ("gpus_per_node = 'two'", "slurm.gpus_per_node"),
        ("time = 2\nsignal_before_timeout_s = 300", "slurm.signal_before_timeout_s"),
        ("extra = 'gres'", "slurm.extra"),
        ("extra = { Gres = 'gpu:1' }", "slurm.extra.Gres"),
        ("extra = { '--gres' = 'gpu:1' }", "slurm.extra.--gres"),
        ("extra = { 'gres=gpu:1 --wrap' = true }", "slurm.extra.gres=gpu:1 --wrap"),
        ("extra = { comment = 'a\"b' }", "slurm.extra.comment"),
        ("extra = { comment = 'a\\\\b' }", "slurm.extra.comment"),
        ('extra = { comment = "line\\nbreak" }', "slurm.extra.comment"),
        ("extra = { comment = '' }", "slurm.extra.comment"),
        ("extra = { exclusive = false }", "slurm.extra.exclusive"),
        ("extra = { nice = 1.5 }", "slurm.extra.nice"),
        ("extra = { job_name = 'x' }", "slurm.extra.job_name"),
        ("extra = { output = '/tmp/x' }", "slurm.extra.output"),
        ("extra = { time = '01:00:00' }", "slurm.extra.time"),
        ("extra = { gpus-per-node = 2 }", "slurm.extra.gpus-per-node"),
        ("extra = { mail_type = 'END', mail-type = 'BEGIN' }", "slurm.extra.mail-type"),
    ],
)
def test_bad_slurm_values(tmp_path, slurm, key):
    assert f": {key}:" in error(tmp_path, BASE + "[slurm]\n" + slurm + "\n")


def test_slurm_extra_names_the_option_fp4lab_sets_itself(tmp_path):
    assert "fp4lab sets --time itself: set [slurm].time" in error(tmp_path, BASE + "[slurm]\nextra = { time = 5 }\n")
    assert "fp4lab sets --job-name itself" in error(tmp_path, BASE + "[slurm]\nextra = { job_name = 'x' }\n")


def test_slurm_extra_keeps_the_spec_order_under_sbatch_names(tmp_path):
    spec = load_spec(write(tmp_path, BASE + "[slurm.extra]\nmail_type = 'END'\ngres = 'gpu:h100:1'\nexclusive = true\n"
                                          "nice = 5\ncomment = 'two words'\n"))
    assert spec.slurm.extra_options() == {"mail-type": "END", "gres": "gpu:h100:1", "exclusive": True, "nice": 5,
                                          "comment": "two words"}


def test_bad_scan_and_method(tmp_path):
    assert "scan.spike_window" in error(tmp_path, BASE + "[scan]\nspike_window = 0\n")
    assert "method: 'bayes'" in error(tmp_path, "method = 'bayes'\n" + BASE)
    assert "samples: only applies" in error(tmp_path, "samples = 3\n" + BASE)
    assert "name:" in error(tmp_path, 'name = "../x"\n')


def test_grid_order_and_count(tmp_path):
    spec = load_spec(write(tmp_path, BASE + "[axes]\nlr = [0.01, 0.02]\nseed = [0, 1, 2]\n'data.seed' = [5, 6]\n"))
    runs = expand(spec)
    assert len(runs) == 12
    assert [(r.params["lr"], r.params["seed"], r.params["data.seed"]) for r in runs[:3]] == [
        (0.01, 0, 5), (0.01, 0, 6), (0.01, 1, 5)]
    assert runs[1].config["data"] == {**runs[0].config["data"], "seed": 6}
    assert runs[0].name == "lr=0.01 seed=0 data.seed=5"
    assert [r.id for r in expand(spec)] == [r.id for r in runs]


def test_random_is_seeded_subset(tmp_path):
    axes = "[axes]\nlr = [0.01, 0.02, 0.03, 0.04]\nseed = [0, 1, 2, 3, 4]\n"
    spec = load_spec(write(tmp_path, "method = 'random'\nsamples = 7\nseed = 3\n" + BASE + axes))
    runs = expand(spec)
    assert len(runs) == 7 == len({r.id for r in runs})
    grid = load_spec(write(tmp_path, BASE + axes, "grid.toml"))
    grid_ids = [r.id for r in expand(grid)]
    assert [r.id for r in runs] == [i for i in grid_ids if i in {r.id for r in runs}]  # grid order kept
    assert [r.id for r in expand(spec)] == [r.id for r in runs]
    other = load_spec(write(tmp_path, "method = 'random'\nsamples = 7\nseed = 4\n" + BASE + axes, "o.toml"))
    assert [r.id for r in expand(other)] != [r.id for r in runs]
    assert "samples: 21 is more" in error(tmp_path, "method = 'random'\nsamples = 21\n" + BASE + axes)
    assert "samples" in error(tmp_path, "method = 'random'\n" + BASE + axes)


def test_ids_are_stable_across_processes(tmp_path):
    path = write(tmp_path, BASE + "[axes]\nrecipe = ['bf16', 'nvfp4']\n")
    ids = [r.id for r in expand(load_spec(path))]
    code = f"from fp4lab.lab.specs.sweep_spec import load_spec, expand; print(' '.join(r.id for r in expand(load_spec({str(path)!r}))))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ids and len(set(ids)) == 2


def test_id_rule(tmp_path):
    spec = load_spec(write(tmp_path, BASE))
    run = make_run(spec, {})
    same = make_run(spec, {"device": "cuda", "max_minutes": 3.0, "lr": 2e-2, "steps": 10})  # lr default, explicit
    assert same.id == run.id
    neutral = {"checkpoint_every": 7, "compile": "off", "cuda_graphs": "off"}  # train.config.RESULT_NEUTRAL
    assert make_run(spec, neutral).id == run.id
    assert make_run(spec, {"warmup_steps": 20}).id == run.id  # the default, stated
    assert make_run(spec, {"lr": 1}).id == make_run(spec, {"lr": 1.0}).id
    assert make_run(spec, {"lr": 0.03}).id != run.id
    assert make_run(spec, {"data.seed": 1}).id != run.id
    assert run_id({**run.config, "out_dir": "elsewhere"}) == run.id
    # A field added later keeps the ids of runs made before it while it holds their value.
    before_parallel = {k: v for k, v in run.config.items() if k != "parallel"}
    assert run.config["parallel"] == "none" and run_id(before_parallel) == run.id
    assert make_run(spec, {"parallel": "ddp"}).id != run.id
    renamed = load_spec(write(tmp_path, BASE.replace('"t"', '"other"'), "b.toml"))
    assert make_run(renamed, {}).id == run.id and make_run(renamed, {}).config["out_dir"] == f"runs/other/{run.id}"


OPTUNA = BASE.replace('name = "t"', 'name = "t"\nmethod = "optuna"') + """
[optuna]
n_trials = 20
objective = "final_val_loss"
direction = "minimize"
[optuna.search_space]
lr = {type = "float", low = 1e-3, high = 1e-1, log = true}
ns_steps = {type = "int", low = 3, high = 7}
recipe = {type = "categorical", choices = ["bf16", "nvfp4"]}
"""


def test_optuna_spec(tmp_path):
    spec = load_spec(write(tmp_path, OPTUNA))
    assert spec.optuna.n_trials == 20 and spec.size() == 20
    assert spec.optuna.search_space["lr"].log is True
    assert spec.optuna_storage() == "jobs/t/optuna.journal"
    with pytest.raises(SpecError, match="one trial at a time"):
        expand(spec)
    run = make_run(spec, {"lr": 0.005, "ns_steps": 4, "recipe": "nvfp4"})
    assert run.config["lr"] == 0.005 and run.config["out_dir"] == f"runs/t/{run.id}"


@pytest.mark.parametrize(
    "old, new, key",
    [
        ('direction = "minimize"', 'direction = "down"', "optuna.direction"),
        ('objective = "final_val_loss"', 'objective = "val"', "optuna.objective"),
        ("low = 3, high = 7", "low = 7, high = 3", "optuna.search_space.ns_steps"),
        ("low = 1e-3", "low = 0.0", "optuna.search_space.lr"),
        ('"bf16", "nvfp4"]', '"bf16", "nvfp9"]', "optuna.search_space.recipe.choices[1]"),
        ("n_trials = 20", "n_trials = 20\nsampler = 'tpe'", "optuna.sampler"),
        ("ns_steps = {", "nss = {", "optuna.search_space.nss"),
        # the search-space rules of program.md too (one validator): distinct choices, a known type
        ('"bf16", "nvfp4"]', '"bf16", "bf16"]', "optuna.search_space.recipe.choices[1]"),
        ('type = "int"', 'type = "integer"', "optuna.search_space.ns_steps.type"),
    ],
)
def test_optuna_errors(tmp_path, old, new, key):
    assert f": {key}:" in error(tmp_path, OPTUNA.replace(old, new))


def test_import_does_not_import_torch():
    code = "import sys, fp4lab.lab.specs.sweep_spec, fp4lab.lab.runs.sbatch; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
