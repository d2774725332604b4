"""Capturing real GEMM operands in the training loop (fp4lab.train.capture) and the per-GEMM error
diagnostic on them (fp4lab.train.gemm_error, `fp4lab numerics --capture`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from fp4lab.nn.model_config import preset
from fp4lab.nn.recipe import load_recipe
from fp4lab.numerics import hadamard, hadamard_signs, quantize
from fp4lab.train.build import build_training
from fp4lab.train.capture import CaptureError, capture_files, load_capture
from fp4lab.train.checkpoint import _restore, load_checkpoint
from fp4lab.train.config import RESULT_NEUTRAL, ConfigError, TrainConfig
from fp4lab.train.data import BatchSampler, DataConfig, load_dataset
from fp4lab.train.gemm_error import (
    DEFAULT_FORMATS,
    FORMATS,
    backward_outputs,
    candidates,
    exact_outputs,
    measure,
    summarize,
)
from fp4lab.train.jsonl import read_json_line
from fp4lab.train.loop import _set_probes, run

LAYERS = ["layers.0.attention.wq", "layers.*.feed_forward.w2"]
CAPTURED = ["layers.0.attention.wq"] + [f"layers.{i}.feed_forward.w2" for i in range(4)]


# CTA-local NVFP4 with SR on Dgrad's dY, random Hadamard signs on Wgrad and LoRA-SVD: the random streams
# a capture could disturb, and a weight the GEMMs read that is not the master weight.
RECIPE = 'extends = "nvfp4-cta"\nname = "cta-lora-rht"\n[model]\nlora_svd_rank = 8\n[linear.wgrad]\ntransform = "rht16"\n'


def small(out: Path, **overrides) -> TrainConfig:
    """Four steps of the tiny preset; steps 0 and 3 are probe steps, 1 and 2 are not."""
    recipe = out.parent / "cta-lora-rht.toml"
    recipe.write_text(RECIPE)
    values = {
        "recipe": str(recipe), "data": DataConfig(source="synthetic"), "seq_len": 32, "batch_size": 4, "steps": 4,
        "warmup_steps": 1, "eval_every": 2, "eval_batches": 1, "probe_every": 4, "checkpoint_every": 4, "out_dir": str(out),
    }
    return TrainConfig(**(values | overrides))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run that captures steps 1 and 2, and the same run without capture, stopped after 2 steps (its
    checkpoint is where step 2 starts) and then resumed to the end."""
    root = tmp_path_factory.mktemp("capture")
    captured = small(root / "captured", capture_steps=[1, 2], capture_layers=LAYERS)
    run(captured, progress=False)
    plain = small(root / "plain")
    run(plain, progress=False, stop_after=2)
    at_step_2 = recompute_step(plain, 2)
    run(plain, progress=False)
    return captured, plain, at_step_2


def recompute_step(config: TrainConfig, step: int) -> dict[str, torch.Tensor]:
    """x, the LoRA residual weight and dY (by autograd: retain_grad on the output) of layers.0.attention.wq,
    from a step the run's checkpoint resumes at, replayed outside the loop."""
    recipe, data = load_recipe(config.recipe), load_dataset(config.data, progress=False)
    model, optimizer, loss_fn = build_training(config, recipe, preset(config.model, data.vocab_size, config.seq_len), torch.device("cpu"))
    path = Path(config.out_dir) / "checkpoint.pt"
    assert _restore(path, load_checkpoint(path), config, model, optimizer).step == step
    _set_probes(model, False, record_max_logits=False)
    linear = dict(model.named_modules())["layers.0.attention.wq"]
    seen = {}

    def hook(module, args, output):
        seen["x"], seen["out"] = args[0], output
        output.retain_grad()

    handle = linear.register_forward_hook(hook)
    tokens, targets = BatchSampler(data.train, config.batch_size, config.seq_len, config.seed).batch(step)
    loss_fn(tokens, targets).backward()
    handle.remove()
    residual = linear.weight - linear.lora_u.float() @ linear.lora_v.float().T
    return {"x": seen["x"].detach().reshape(-1, 128), "w": residual.detach(), "dy": seen["out"].grad.reshape(-1, 128)}


def metrics(config: TrainConfig) -> list[dict]:
    lines = (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in read_json_line(line).items() if k != "tokens_per_s"} for line in lines]


def test_capture_writes_the_chosen_steps_and_layers_only(runs):
    captured, plain, _ = runs
    root = Path(captured.out_dir) / "captures"
    assert sorted(p.name for p in root.iterdir()) == ["step-1", "step-2"]
    for step in (1, 2):
        assert sorted(p.stem for p in (root / f"step-{step}").iterdir()) == sorted(CAPTURED)
    assert not (Path(plain.out_dir) / "captures").exists()
    meta = load_capture(root / "step-2" / "layers.3.feed_forward.w2.pt").meta
    assert meta["step"] == 2 and meta["block"] == 3 and meta["n_layers"] == 4 and meta["recipe"] == "cta-lora-rht"
    assert meta["shapes"] == {"x": [128, 384], "w": [128, 384], "dy": [128, 128]} and meta["lora_residual"]
    assert meta["operands"]["dgrad_dy"]["format"] == "nvfp4_cta" and meta["operands"]["dgrad_dy"]["rounding"] == "sr"
    assert meta["operands"]["wgrad_x"]["transform"] == "rht16"


def test_captured_tensors_are_the_step_s_real_operands(runs):
    captured, _, at_step_2 = runs
    capture = load_capture(Path(captured.out_dir) / "captures" / "step-2" / "layers.0.attention.wq.pt")
    for key in ("x", "w", "dy"):
        assert torch.equal(getattr(capture, key), at_step_2[key]), key
    assert capture.dy.abs().sum() > 0


def test_capture_does_not_change_training(runs):
    captured, plain, _ = runs
    assert metrics(captured) == metrics(plain)
    a, b = (load_checkpoint(Path(c.out_dir) / "checkpoint.pt") for c in (captured, plain))
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b["model"][key]), key
    assert torch.equal(a["torch_rng"], b["torch_rng"])


def test_capture_config_is_validated_and_result_neutral(tmp_path):
    assert {"capture_steps", "capture_layers"} <= set(RESULT_NEUTRAL)
    with pytest.raises(ConfigError, match="capture_layers is empty"):
        TrainConfig(capture_steps=[3])
    with pytest.raises(ConfigError, match="steps are 0..199"):
        TrainConfig(capture_steps=[200], capture_layers=["output"])
    with pytest.raises(ConfigError, match=r"capture_steps\[1\]=-1"):
        TrainConfig(capture_steps=[0, -1], capture_layers=["output"])
    (tmp_path / "runs").mkdir()
    unknown = small(tmp_path / "runs" / "unknown", capture_steps=[0], capture_layers=["output", "layers.*.mlp.w2"])
    with pytest.raises(ConfigError, match=r"'layers.\*.mlp.w2' matches no FP4 linear.*layers.0.attention.wq"):
        run(unknown, progress=False)
    compiled = small(tmp_path / "runs" / "compiled", capture_steps=[0], capture_layers=["output"], compile="on")
    with pytest.raises(ConfigError, match="compile='off'"):
        run(compiled, progress=False)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["cta-lora-rht.toml"]  # no run folder


def test_diagnostic_equals_an_independent_quantized_product(runs):
    captured, _, _ = runs
    capture = load_capture(Path(captured.out_dir) / "captures" / "step-1" / "layers.1.feed_forward.w2.pt")
    x, w, dy = capture.x, capture.w, capture.dy
    h32 = hadamard_signs(32, "fixed")

    def q(t, fmt, transform=None, **options):
        t = hadamard(t.contiguous(), 32, h32) if transform else t.contiguous()
        return quantize(t, fmt, **options).dequantize()

    independent = {  # each operand quantized along its contraction dim: N for Dgrad, tokens for Wgrad
        "mxfp4": {"dgrad": q(dy, "mxfp4", scale_mode="floor") @ q(w.T, "mxfp4", scale_mode="floor").T,
                  "wgrad": q(dy.T, "mxfp4", scale_mode="floor") @ q(x.T, "mxfp4", scale_mode="floor").T},
        "mxfp4-h32": {"dgrad": q(dy, "mxfp4", True, scale_mode="floor") @ q(w.T, "mxfp4", True, scale_mode="floor").T,
                      "wgrad": q(dy.T, "mxfp4", True, scale_mode="floor") @ q(x.T, "mxfp4", True, scale_mode="floor").T},
        "nvfp4_cta": {"dgrad": q(dy, "nvfp4_cta") @ q(w.T, "nvfp4_cta").T, "wgrad": q(dy.T, "nvfp4_cta") @ q(x.T, "nvfp4_cta").T},
    }
    chosen = candidates(independent, [])
    rows = measure([capture.path], chosen)
    for candidate in chosen:
        outputs = backward_outputs(capture, candidate.linear(capture.meta), seed=0)
        for gemm in ("dgrad", "wgrad"):
            assert torch.equal(outputs[gemm], independent[candidate.name][gemm]), (candidate.name, gemm)
            exact = {"dgrad": dy @ w, "wgrad": dy.T @ x}[gemm]
            expected = ((independent[candidate.name][gemm] - exact).norm() / exact.norm()).item()
            row = next(r for r in rows if r.candidate == candidate.name and r.gemm == gemm)
            assert row.rel == pytest.approx(expected, rel=1e-5) and 0.01 < row.rel < 0.5
            assert torch.equal(exact_outputs(capture)[gemm], exact)


def test_recipe_candidates_use_the_recipe_s_linear_for_the_captured_block(runs):
    captured, _, _ = runs
    root = Path(captured.out_dir) / "captures" / "step-1"
    # nvfp4 keeps the last of 4 blocks in BF16 (round(0.129 * 4) = 1): block 3 is bf16, block 1 NVFP4.
    chosen = candidates(["bf16", "nvfp4"], [load_recipe("nvfp4")])
    rows = {(r.layer, r.candidate, r.gemm): r.rel for r in measure(capture_files(root), chosen)}
    assert rows[("layers.3.feed_forward.w2", "nvfp4", "dgrad")] == rows[("layers.3.feed_forward.w2", "bf16", "dgrad")]
    assert rows[("layers.1.feed_forward.w2", "nvfp4", "dgrad")] > 10 * rows[("layers.1.feed_forward.w2", "bf16", "dgrad")]


def test_summary_marks_the_best_fp4_candidate_and_the_mx_vs_cta_ratio(runs):
    captured, _, _ = runs
    chosen = candidates(["bf16", "mxfp4", "nvfp4_cta"], [])
    rows = measure(capture_files(captured.out_dir), chosen)
    summary = summarize(rows, chosen)
    dgrad = {name: summary["candidates"][name]["dgrad"]["mean_rel"] for name in ("bf16", "mxfp4", "nvfp4_cta")}
    assert summary["best"]["dgrad"] == min(("mxfp4", "nvfp4_cta"), key=dgrad.get)  # bf16 is the baseline
    pair = summary["mx_vs_cta"]
    ratios = [next(r.energy for r in rows if (r.step, r.layer, r.candidate, r.gemm) == (s, layer, "mxfp4", "dgrad"))
              / next(r.energy for r in rows if (r.step, r.layer, r.candidate, r.gemm) == (s, layer, "nvfp4_cta", "dgrad"))
              for s in (1, 2) for layer in CAPTURED]
    assert pair["captures"] == 10 and pair["cta_lower"] == sum(r > 1 for r in ratios)
    assert pair["energy_ratio_geomean"] == pytest.approx(math.exp(sum(map(math.log, ratios)) / len(ratios)), rel=1e-12)


def test_cli_numerics_capture_table_and_json(runs, run_cli):
    captured, _, _ = runs
    result = run_cli("numerics", "--capture", captured.out_dir, "--format", "mxfp4", "--format", "nvfp4_cta", "--recipe", "hybrid-operand")
    assert result.returncode == 0, result.stderr
    for word in ("layers.0.attention.wq", "mxfp4", "nvfp4_cta", "hybrid-operand", "E_MX / E_CTA"):
        assert word in result.stdout
    result = run_cli("numerics", "--capture", str(Path(captured.out_dir) / "captures" / "step-2"), "--json")
    document = json.loads(result.stdout)
    assert result.returncode == 0 and [c["name"] for c in document["candidates"]] == list(DEFAULT_FORMATS)
    assert "fp8-e4m3" in FORMATS and "fp8-e4m3" not in DEFAULT_FORMATS
    assert len(document["rows"]) == 5 * len(DEFAULT_FORMATS) * 2 and {r["step"] for r in document["rows"]} == {2}
    assert document["summary"]["mx_vs_cta"]["captures"] == 5


def test_cli_numerics_capture_bad_inputs_are_one_line_exit_2(runs, run_cli, tmp_path):
    captured, plain, _ = runs
    corrupt = tmp_path / "captures" / "step-0" / "output.pt"
    corrupt.parent.mkdir(parents=True)
    corrupt.write_bytes(b"not a torch file")
    foreign = tmp_path / "foreign.pt"
    torch.save({"x": torch.zeros(2, 2)}, foreign)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    cases = [
        (["--capture", str(tmp_path / "missing")], "does not exist"),
        (["--capture", plain.out_dir], "no captured GEMM operands"),
        (["--capture", str(tmp_path)], "not a readable capture file"),
        (["--capture", str(foreign)], "not a capture file"),
        (["--capture", captured.out_dir, "--dist", "normal"], "drop --tensor"),
        (["--capture", captured.out_dir, "--format", "mxfp5"], "allowed: bf16, mxfp4"),
        (["--capture", captured.out_dir, "--recipe", "no-such-recipe"], "--recipe"),
        (["--format", "mxfp4"], "pass --capture RUN too"),
    ]
    for args, message in cases:
        result = run_cli("numerics", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
        assert result.stdout == ""
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    with pytest.raises(CaptureError, match="no captured GEMM operands"):
        capture_files(plain.out_dir)


def test_cli_train_capture_options(run_cli, tmp_path):
    out = tmp_path / "run"
    result = run_cli("train", "--data", "synthetic", "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--warmup-steps", "1",
                     "--capture-steps", "1", "--capture-layers", "output,layers.1.attention.w*", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (out / "captures").rglob("*.pt")) == [
        "layers.1.attention.wk.pt", "layers.1.attention.wo.pt", "layers.1.attention.wq.pt", "layers.1.attention.wv.pt", "output.pt"]
    assert json.loads((out / "config.json").read_text())["config"]["capture_steps"] == [1]
    result = run_cli("train", "--data", "synthetic", "--capture-steps", "1,two", "--capture-layers", "output", "--out", str(tmp_path / "bad"))
    assert result.returncode == 2 and "--capture-steps '1,two'" in result.stderr and not (tmp_path / "bad").exists()


def test_a_sweep_spec_sets_capture_and_the_run_id_ignores_it(tmp_path):
    from fp4lab.lab.specs.sweep_spec import SpecError, expand, load_spec

    base = 'name = "t"\n[base]\nsteps = 10\n[base.data]\nsource = "synthetic"\n'
    plain = tmp_path / "plain.toml"
    plain.write_text(base)
    capturing = tmp_path / "capturing.toml"
    capturing.write_text(base.replace("steps = 10\n", 'steps = 10\ncapture_steps = [9]\ncapture_layers = ["output"]\n'))
    (run,), (reference,) = expand(load_spec(capturing)), expand(load_spec(plain))
    assert run.config["capture_steps"] == [9] and run.config["capture_layers"] == ["output"]
    assert run.id == reference.id  # the same run: capturing changes nothing it computes
    capturing.write_text(base.replace("steps = 10\n", "steps = 10\ncapture_steps = [10]\ncapture_layers = [\"output\"]\n"))
    with pytest.raises(SpecError, match="capture_steps has step 10"):
        load_spec(capturing)
