"""The training loop end to end: every recipe trains, resume is bit-identical, bad runs end cleanly."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fp4lab.nn.recipe import list_recipes
from fp4lab.train.config import ConfigError, TrainConfig
from fp4lab.train.data import DataConfig
from fp4lab.train.jsonl import read_json_line
from fp4lab.train.loop import lr_factor, run


def small(tmp_path: Path, name: str = "run", **overrides) -> TrainConfig:
    """A seconds-long run on the synthetic Markov task (vocab 256)."""
    values = dict(
        recipe="bf16", data=DataConfig(source="synthetic"), seq_len=64, batch_size=4, steps=12,
        warmup_steps=2, eval_every=6, eval_batches=2, probe_every=4, checkpoint_every=4,
        out_dir=str(tmp_path / name),
    )
    return TrainConfig(**(values | overrides))


def metrics(config: TrainConfig) -> list[dict]:
    return [read_json_line(line) for line in (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recipe", list_recipes())
def test_every_recipe_trains_and_the_loss_falls(tmp_path, recipe):
    # 8 steps: every recipe's last four average ~1.5 below the first (measured at 10 steps: 1.85-1.89)
    config = small(tmp_path, recipe=recipe, steps=8, seq_len=64, batch_size=8, eval_every=8, probe_every=8)
    summary = run(config, progress=False)
    assert summary["status"] == "completed", summary
    losses = [r["loss"] for r in metrics(config)]
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-4:]) / 4 < losses[0] - 0.4, losses  # ln(256) = 5.55 at the start
    assert summary["final_val_loss"] < losses[0]


def test_metrics_fields_and_outputs(tmp_path):
    config = small(tmp_path, recipe="mxfp4-rowsr-h32", qk_clip="kimi", qk_clip_tau=50.0)
    summary = run(config, progress=False)
    records = metrics(config)
    assert [r["step"] for r in records] == list(range(12))
    for record in records:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "qk_clipped_heads"} <= set(record)
    assert {r["step"] for r in records if "val_loss" in r} == {5, 11}
    probed = [r for r in records if "attn_entropy" in r]
    assert [r["step"] for r in probed] == [0, 4, 8, 11]  # every probe_every steps, and the final step
    first = probed[0]
    assert len(first["attn_entropy"]) == 4 and len(first["attn_entropy"][0]) == 4  # layers x heads
    assert all(0 < h <= math.log(64) for layer in first["attn_entropy"] for h in layer)
    assert len(first["max_logit"]) == 4 and first["max_logit_max"] == max(max(h) for h in first["max_logit"])
    wq = first["quant"]["layers.0.attention.wq"]
    assert set(wq) == {"fprop_x", "fprop_w", "dgrad_dy", "wgrad_dy", "wgrad_x"}  # 2D weights: one encoding
    assert all(0 <= v <= 1 for pair in wq.values() for v in pair)
    assert "layers.0.attention.wq" in first["quant"] and "output" not in first["quant"]  # BF16 head
    out = Path(config.out_dir)
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    identity = json.loads((out / "config.json").read_text())
    assert identity["recipe"]["name"] == "mxfp4-rowsr-h32" and identity["parameters"] > 0
    assert summary["steps_completed"] == 12 and summary["tokens_seen"] == 12 * 4 * 64


@pytest.mark.parametrize("recipe", ["optitrain", "fullstack"])
def test_interrupted_and_resumed_run_matches_an_uninterrupted_one(tmp_path, recipe):
    """SR generators, random Hadamard signs, FP4 attention streams, LoRA-SVD factors, Muon and NVFP4
    optimizer states all travel in the checkpoint: the loss curve continues bit for bit."""
    straight = small(tmp_path, "straight", recipe=recipe, qk_clip="kimi", qk_clip_tau=5.0, steps=8)
    run(straight, progress=False)
    broken = small(tmp_path, "broken", recipe=recipe, qk_clip="kimi", qk_clip_tau=5.0, steps=8)
    first = run(broken, progress=False, stop_after=3)
    assert first["status"] == "stopped" and first["steps_completed"] == 3
    resumed = run(broken, progress=False)
    assert resumed["status"] == "completed" and resumed["steps_completed"] == 8
    a, b = metrics(straight), metrics(broken)
    assert [r["step"] for r in b] == list(range(8))  # no duplicated lines after the resume
    for key in ("loss", "grad_norm", "val_loss", "qk_clipped_heads", "attn_entropy", "max_logit", "quant"):
        assert [r.get(key) for r in a] == [r.get(key) for r in b], key
    a_state = torch.load(Path(straight.out_dir) / "checkpoint.pt", weights_only=True)["model"]
    b_state = torch.load(Path(broken.out_dir) / "checkpoint.pt", weights_only=True)["model"]
    assert all(torch.equal(a_state[k], b_state[k]) for k in a_state if isinstance(a_state[k], torch.Tensor))


def test_evaluation_and_probing_do_not_change_training(tmp_path):
    often = small(tmp_path, "often", recipe="optitrain", eval_every=1, probe_every=1, steps=8)
    rarely = small(tmp_path, "rarely", recipe="optitrain", eval_every=100, probe_every=100, steps=8)
    run(often, progress=False)
    run(rarely, progress=False)
    assert [r["loss"] for r in metrics(often)] == [r["loss"] for r in metrics(rarely)]


def test_divergence_ends_the_run_cleanly(tmp_path):
    config = small(tmp_path, recipe="nvfp4-all", lr=1e6, adam_lr=1e6, grad_clip=1e30, warmup_steps=0, steps=40, eval_every=100)
    summary = run(config, progress=False)
    assert summary["status"] == "diverged", summary
    step = summary["diverged_step"]
    last = metrics(config)[-1]
    assert last["step"] == step and not (math.isfinite(last["loss"]) and math.isfinite(last.get("grad_norm", 0.0)))
    assert summary["steps_completed"] == step


def test_time_budget_stops_cleanly_and_the_run_resumes(tmp_path):
    config = small(tmp_path, max_minutes=1e-6)
    summary = run(config, progress=False)
    assert summary["status"] == "time_limit" and summary["steps_completed"] == 1
    assert (Path(config.out_dir) / "checkpoint.pt").exists()
    resumed = small(tmp_path)  # max_minutes may change between sessions of one run
    assert run(resumed, progress=False)["steps_completed"] == 12


def test_resuming_with_a_different_config_is_refused(tmp_path):
    run(small(tmp_path, steps=4), progress=False)
    with pytest.raises(ConfigError, match="different recipe"):
        run(small(tmp_path, steps=4, recipe="nvfp4"), progress=False)


def test_sigterm_checkpoints_and_reports_preempted(tmp_path):
    out = tmp_path / "preempted"
    command = [
        sys.executable, "-m", "fp4lab.cli", "train", "--data", "synthetic", "--steps", "100000",
        "--seq-len", "64", "--batch-size", "4", "--checkpoint-every", "100000", "--out", str(out),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        log = out / "metrics.jsonl"
        if log.exists() and len(log.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr
    assert "status: preempted" in stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["steps_completed"] >= 3
    assert (out / "checkpoint.pt").exists()


def test_lr_schedules():
    cosine = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(cosine, 0) == pytest.approx(0.1) and lr_factor(cosine, 9) == 1.0
    assert lr_factor(cosine, 99) == pytest.approx(0.1, abs=1e-3)
    wsd = TrainConfig(steps=100, warmup_steps=0, lr_schedule="wsd", min_lr_ratio=0.0)
    assert lr_factor(wsd, 79) == 1.0 and lr_factor(wsd, 99) == pytest.approx(0.0)
    assert lr_factor(TrainConfig(lr_schedule="constant", warmup_steps=0), 150) == 1.0


def test_config_validation_names_the_field(tmp_path):
    with pytest.raises(ConfigError, match="unknown key 'learning_rate'"):
        TrainConfig.from_dict({"learning_rate": 1.0})
    with pytest.raises(ConfigError, match="batch_size=0 must be an integer >= 1"):
        TrainConfig(batch_size=0)
    with pytest.raises(ConfigError, match="lr_schedule='linear' is not supported; allowed: cosine, constant, wsd"):
        TrainConfig(lr_schedule="linear")
    path = tmp_path / "c.toml"
    path.write_text('recipe = "nvfp4"\nsteps = 3\n[data]\nsource = "synthetic"\nvocab = 3\n')
    with pytest.raises(ConfigError, match="unknown key data.vocab"):
        TrainConfig.from_toml(path)
    path.write_text('recipe = "nvfp4"\nsteps = 3\n[data]\nsource = "synthetic"\n')
    loaded = TrainConfig.from_toml(path)
    assert loaded.recipe == "nvfp4" and loaded.data.source == "synthetic"


def test_compute_and_compile_resolve_per_device_and_validate():
    from fp4lab.train.paths import compiled, tensor_cores

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto, off = TrainConfig(), {}
    assert not tensor_cores(auto, cpu, off) and tensor_cores(auto, cuda, off)
    assert not compiled(auto, cpu, off) and compiled(auto, cuda, off)
    assert tensor_cores(TrainConfig(compute="fast"), cpu, off) and not tensor_cores(TrainConfig(compute="reference"), cuda, off)
    assert compiled(TrainConfig(compile="on"), cpu, off) and not compiled(TrainConfig(compile="off"), cuda, off)
    assert off == {"tensor_cores": "config compute='reference'", "compile": "config compile='off'"}  # the last reason of each
    with pytest.raises(ConfigError, match="compute='turbo' is not supported"):
        TrainConfig(compute="turbo")
    with pytest.raises(ConfigError, match="compile='yes' is not supported"):
        TrainConfig(compile="yes")
    from fp4lab.nn.model_config import preset
    from fp4lab.nn.recipe import load_recipe
    from fp4lab.train.build import build_training

    model_config, recipe = preset("tiny", 256, 64), load_recipe("bf16")
    _, _, eager_loss = build_training(TrainConfig(compile="off"), recipe, model_config, cpu)
    _, _, compiled_loss = build_training(TrainConfig(compile="on"), recipe, model_config, cpu)
    assert not hasattr(eager_loss, "_torchdynamo_orig_callable") and hasattr(compiled_loss, "_torchdynamo_orig_callable")


def test_fast_compute_on_the_cpu_trains_with_bf16_activations_and_tensor_core_linears(tmp_path):
    """compute='fast' is the CUDA default; on the CPU it runs the same code (bf16 autocast, the
    tensor-core Function with fp32 GEMMs): it trains, and it is not the reference computation."""
    fast = small(tmp_path, "fast", recipe="nvfp4", compute="fast")
    reference = small(tmp_path, "reference", recipe="nvfp4", compute="reference")
    fast_summary, reference_summary = run(fast, progress=False), run(reference, progress=False)
    assert fast_summary["status"] == reference_summary["status"] == "completed"
    fast_losses, reference_losses = [r["loss"] for r in metrics(fast)], [r["loss"] for r in metrics(reference)]
    assert fast_losses[0] != reference_losses[0]  # bf16 activations change the very first forward
    assert abs(fast_losses[0] - reference_losses[0]) < 0.02 * reference_losses[0]
    assert sum(fast_losses[-4:]) / 4 < fast_losses[0] - 0.4


def test_compiled_training_matches_eager_training(tmp_path):
    """torch.compile changes only summation order: the same run compiled and eager ends within
    rounding of each other (CPU, reference compute, the bf16 recipe whose linears compile)."""
    eager = run(small(tmp_path, "eager", steps=6, eval_every=6, compile="off"), progress=False)
    compiled_run = run(small(tmp_path, "compiled", steps=6, eval_every=6, compile="on"), progress=False)
    assert compiled_run["status"] == "completed"
    assert abs(compiled_run["final_train_loss"] - eager["final_train_loss"]) < 1e-3 * eager["final_train_loss"]
