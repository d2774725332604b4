"""The `fp4lab` command line: fast help, one-line errors with exit code 2, the numerics survey."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch


def cli_in_fresh_process(*args: str) -> tuple[str, list[str]]:
    """`fp4lab ARGS` run in a fresh interpreter (it must exit 0): its stdout, and which heavy modules
    (torch, numpy, pandas, optuna) it imported on the way."""
    probe = (
        f"import sys, runpy; sys.argv = ['fp4lab', *{list(args)!r}]\n"
        "try:\n    runpy.run_module('fp4lab.cli', run_name='__main__')\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'pandas', 'optuna') if m in sys.modules)\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    *printed, heavy = out.stdout.rstrip("\n").split("\n")
    return "\n".join(printed), [m for m in heavy.removeprefix("HEAVY=").split(",") if m]


def test_help_does_not_import_torch():
    # `fp4lab --help` must stay fast: the CLI module and help rendering may not pull in torch.
    printed, heavy = cli_in_fresh_process("--help")
    assert "numerics" in printed
    assert heavy == [], heavy


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["numerics", "--dist", "cauchy"], "--dist 'cauchy' is not supported; allowed: normal, student-t, outlier"),
        (["numerics", "--shape", "4x30"], "COLS a multiple of 32"),
        (["numerics", "--shape", "four"], "is not ROWSxCOLS"),
        (["numerics", "--tensor", "/no/such/file.pt"], "is not a file"),
        (["numerics", "--dist", "normal", "--tensor", "x.pt"], "either --tensor or --dist"),
        (["numerics", "--frobnicate"], "No such option: --frobnicate"),
        (["numerics", "--seed", "abc"], "Invalid value for '--seed'"),
        (["no-such-command"], "No such command"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(run_cli, args, fragment):
    out = run_cli(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("fp4lab: error: ")
    assert fragment in lines[0]


def test_bad_tensor_files(run_cli, tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a torch file")
    ints = tmp_path / "ints.pt"
    torch.save(torch.arange(64), ints)
    odd = tmp_path / "odd.pt"
    torch.save(torch.randn(4, 48), odd)
    state = tmp_path / "state.pt"
    torch.save({"w": torch.randn(64, 64)}, state)
    for args, fragment in [
        (["--tensor", str(garbage)], "is not a loadable torch file"),
        (["--tensor", str(ints)], "floating-point tensor"),
        (["--tensor", str(odd)], "multiple of 32"),
        (["--tensor", str(state)], "pick a tensor with --key (one of: w)"),
        (["--tensor", str(state), "--key", "v"], "--key 'v' is not a tensor"),
    ]:
        out = run_cli("numerics", *args)
        assert out.returncode == 2, (args, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1
        assert fragment in out.stderr, (args, out.stderr)


def test_numerics_json_on_a_state_dict_entry(run_cli, tmp_path):
    path = tmp_path / "state.pt"
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(3))
    torch.save({"layer.weight": weight, "step": 7}, path)
    out = run_cli("numerics", "--tensor", str(path), "--key", "layer.weight", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["shape"] == [64, 128]
    rows = report["rows"]
    assert len(rows) == (6 * 2 + 4) * 5  # (FP4 scale contracts x roundings + FP8 contracts, RTN only) x transforms
    assert {r["format"] for r in rows} == {"nvfp4", "nvfp4_cta", "mxfp4", "fp8"}
    assert {r["transform"] for r in rows} == {"none", "H16", "H32", "RHT16", "RHTfull"}
    fp8 = {r["scale_mode"]: r["rel_rms"] for r in rows if r["format"] == "fp8" and r["transform"] == "none"}
    assert fp8["e4m3 row"] < fp8["e5m2 row"] < min(r["rel_rms"] for r in rows if r["format"] == "nvfp4")
    for row in rows:
        assert 0.0 < row["rel_rms"] < 0.3
        assert row["snr_db"] == pytest.approx(-20 * math.log10(row["rel_rms"]))
        assert 0.0 <= row["saturated"] <= 1.0 and 0.0 <= row["flushed"] <= 1.0


def test_numerics_outlier_hadamard_effect(run_cli):
    """The survey's headline on outlier channels: Hadamard mixing cuts MXFP4's error a lot; for NVFP4
    (whose E4M3 block scale already represents the block max almost exactly) it raises the
    energy-weighted error while halving the fraction of values flushed to zero."""
    out = run_cli("numerics", "--dist", "outlier", "--shape", "128x512", "--json")
    assert out.returncode == 0, out.stderr
    rows = {(r["format"], r["scale_mode"], r["rounding"], r["transform"]): r for r in json.loads(out.stdout)["rows"]}
    for mode in ("floor", "ceil", "even", "rceil"):
        none = rows[("mxfp4", mode, "rtn", "none")]["rel_rms"]
        for transform in ("H16", "RHT16"):
            assert rows[("mxfp4", mode, "rtn", transform)]["rel_rms"] < 0.85 * none
    nv_none = rows[("nvfp4", "-", "rtn", "none")]
    for transform in ("H16", "RHT16"):
        assert rows[("nvfp4", "-", "rtn", transform)]["flushed"] < 0.6 * nv_none["flushed"]


def test_numerics_table_is_reproducible(run_cli):
    first = run_cli("numerics", "--dist", "student-t", "--shape", "64x256", "--seed", "5")
    second = run_cli("numerics", "--dist", "student-t", "--shape", "64x256", "--seed", "5")
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    assert "mxfp4" in first.stdout and "Transform effect" in first.stdout


def test_recipes_lists_and_shows_the_ledger(run_cli):
    listed = run_cli("recipes")
    assert listed.returncode == 0
    for name in ("bf16", "nvfp4", "mxfp4-rowsr-h32", "hybrid-depth", "optitrain", "fullstack"):
        assert name in listed.stdout
    shown = run_cli("recipes", "show", "mxfp4-rowsr-h32", "--layers", "4")
    assert shown.returncode == 0
    rows = [line for line in shown.stdout.splitlines() if "mxfp4" in line and "│" in line]
    assert len(rows) == 6  # one per operand of blocks 0-3
    assert any("rceil adaptive" in r and "32x32" in r for r in rows)
    assert any("sr" in r.split("│")[6] for r in rows) and sum("h32" in r for r in rows) == 2


def test_recipes_show_names_the_fp8_element_and_scaling(run_cli):
    shown = run_cli("recipes", "show", "fp8", "--layers", "2")
    assert shown.returncode == 0, shown.stderr
    cells = [[c.strip() for c in line.split("│")] for line in shown.stdout.splitlines() if "fp8" in line and "│" in line]
    by_operand = {(row[2], row[3]): row for row in cells}
    assert by_operand["fprop", "x"][4:7] == ["fp8 e4m3", "per tensor", "rtn"]
    assert by_operand["dgrad", "dy"][4:6] == ["fp8 e5m2", "per tensor"]
    rowwise = run_cli("recipes", "show", "fp8-rowwise", "--layers", "2")
    assert "per row pow2" in rowwise.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["recipes", "show", "nope"], "unknown recipe 'nope'"),
        (["recipes", "show", "bf16", "--layers", "0"], "--layers must be positive"),
        (["train", "--recipe", "nope", "--data", "synthetic"], "unknown recipe 'nope'"),
        (["train", "--lr", "-1"], "lr=-1.0 must be a finite number > 0"),
        (["train", "--model", "huge"], "train: --model 'huge' is not supported; allowed: tiny, 125m, 350m, 1b"),
        (["train", "--data", "/no/such.bin"], "no such file"),
        (["train", "--config", "/no/such.toml"], "does not exist"),
        (["train", "--compute", "turbo"], "--compute 'turbo' is not supported; allowed: auto, reference, fast"),
        (["train", "--cuda-graphs", "maybe"], "--cuda-graphs 'maybe' is not supported"),
        (["bench", "gpus"], "bench: WHAT 'gpus' is not supported; allowed: all, kernels, steps"),
        (["bench", "--recipes", "bf16,fp3"], "fp3"),
        (["bench", "--shape", "100x100"], "multiple of 32"),
        (["bench", "--compile", "yes"], "--compile 'yes' is not supported"),
        (["bench", "--cuda-graphs", "yes"], "--cuda-graphs 'yes' is not supported"),
        (["bench", "--optimizer", "sgd"], "--optimizer 'sgd' is not supported"),
        (["bench", "--device", "tpu"], "--device 'tpu' is not supported"),
    ],
)
def test_train_recipes_and_bench_errors_are_one_line(run_cli, args, fragment):
    out = run_cli(*args)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], out.stderr


def test_train_command_runs_and_prints_the_summary_block(run_cli, tmp_path):
    config = tmp_path / "run.toml"
    config.write_text('recipe = "nvfp4"\nsteps = 3\nseq_len = 64\nbatch_size = 2\n[data]\nsource = "synthetic"\n')
    out = run_cli("train", "--config", str(config), "--out", str(tmp_path / "run"), "--steps", "4")
    assert out.returncode == 0, out.stderr
    block = dict(line.split(": ", 1) for line in out.stdout.split("---\n", 1)[1].splitlines())
    assert block["status"] == "completed" and block["steps_completed"] == "4"
    assert (tmp_path / "run" / "metrics.jsonl").read_text().count("\n") == 4


def test_scan_reports_verdicts_and_exit_codes(run_cli, tmp_path):
    healthy, broken = tmp_path / "healthy", tmp_path / "broken"
    for folder, losses in ((healthy, [5.0 - 0.01 * i for i in range(50)]), (broken, [5.0, 4.9, float("nan")])):
        folder.mkdir()
        lines = [json.dumps({"step": i, "loss": v, "grad_norm": 1.0}) for i, v in enumerate(losses)]
        (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n{\"step\": 3, \"lo")  # a torn last line
        status = "diverged" if folder is broken else "completed"
        (folder / "summary.json").write_text(json.dumps({"status": status, "diverged_step": 2 if folder is broken else None, "steps_completed": len(losses)}))
    ok = run_cli("scan", str(healthy))
    assert ok.returncode == 0 and "converged" in ok.stdout and "1 bad line" in ok.stdout
    bad = run_cli("scan", str(healthy), str(broken), "--json")
    assert bad.returncode == 1
    verdicts = [r["verdict"] for r in json.loads(bad.stdout)]
    assert verdicts == ["converged", "diverged@2"]
    missing = run_cli("scan", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr.startswith("fp4lab: error: scan:")


def test_report_command_errors_are_one_line(run_cli, tmp_path):
    out = run_cli("report", "--catalog", str(tmp_path / "none.json"))
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert out.stderr.startswith("fp4lab: error: report:")


def test_bench_on_the_cpu_times_kernels_and_steps_beside_the_anchor(run_cli, tmp_path):
    """The CI smoke test of `fp4lab bench`: small shapes on the CPU, the torch reference quantizers,
    the plain PyTorch anchor and two recipes, as JSON with the ratios the GPU benchmark reports."""
    out = run_cli("bench", "--device", "cpu", "--recipes", "bf16,nvfp4", "--steps", "2", "--warmup", "1",
                  "--batch-size", "2", "--seq-len", "64", "--shape", "256x256", "--json", "--profile", str(tmp_path))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert [k["case"] for k in report["kernels"]][:2] == ["mxfp4", "mxfp4 rceil"]
    assert all(k["implementation"] == "torch reference" and k["gb_per_s"] > 0 for k in report["kernels"])
    steps = {s["name"]: s for s in report["steps"]}
    assert list(steps) == ["anchor", "bf16", "nvfp4"]
    assert steps["bf16"]["compute"] == "reference" and not steps["bf16"]["compiled"] and not steps["bf16"]["cuda_graph"]
    assert "aten::mm" in (tmp_path / "nvfp4.txt").read_text() and (tmp_path / "anchor.txt").exists()
    assert all(s["tokens_per_s"] > 0 and math.isfinite(s["last_loss"]) for s in steps.values())
    ratios = report["ratios"]
    assert ratios["bf16_tokens_per_s_vs_anchor"] == steps["bf16"]["tokens_per_s"] / steps["anchor"]["tokens_per_s"]
    assert ratios["nvfp4_step_time_vs_bf16"] == steps["nvfp4"]["step_ms"] / steps["bf16"]["step_ms"]
    assert not {"gemm", "tile_gemm", "attention", "fusion"} & set(report)  # no argument: kernels and steps, as the README says
    every = json.loads(run_cli("bench", "all", "--device", "cpu", "--recipes", "bf16", "--steps", "1", "--warmup", "0",
                               "--batch-size", "2", "--seq-len", "64", "--shape", "256x256", "--json").stdout)
    assert every["gemm"] == every["tile_gemm"] == every["attention"] == every["fusion"] == []  # CUDA-only kernels
    # Each suite's table as it ends: the quantizers' before the steps suite starts (stdout and stderr as one stream).
    tables = subprocess.run([sys.executable, "-m", "fp4lab.cli", "bench", "--device", "cpu", "--recipes", "bf16", "--steps", "1",
                             "--warmup", "0", "--batch-size", "2", "--seq-len", "64", "--shape", "256x256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)  # fmt: skip
    assert tables.returncode == 0, tables.stdout
    text = tables.stdout
    assert 0 <= text.index("Quantizers vs a device-to-device copy") < text.index("training steps:") < text.index("Training steps")
    text = run_cli("bench", "gemm", "--device", "cpu")
    assert text.returncode == 0 and "skipped: the GEMM kernels need CUDA and Triton" in text.stderr, text.stderr
    text = run_cli("bench", "fusion", "--device", "cpu")
    assert text.returncode == 0 and "skipped: the fused producers need CUDA and Triton" in text.stderr, text.stderr


@pytest.mark.cuda
def test_bench_gemm_attention_and_fusion_on_a_gpu(run_cli):
    out = run_cli("bench", "gemm", "--json")
    assert out.returncode == 0, out.stderr
    gemm = json.loads(out.stdout)["gemm"]
    assert [g["case"] for g in gemm][:3] == ["125m w1 Fprop", "125m w1 Dgrad", "125m w1 Wgrad"] and len(gemm) == 8
    assert all(g["throughput_vs_bf16"] == pytest.approx(g["bf16_ms"] / g["ms"]) for g in gemm)
    tiles = json.loads(out.stdout)["tile_gemm"]
    assert [g["case"] for g in tiles][:3] == ["125m w1 Fprop", "125m w1 Dgrad", "125m wq Fprop"] and len(tiles) == 6
    out = run_cli("bench", "attention", "--json")
    assert out.returncode == 0, out.stderr
    attention = json.loads(out.stdout)["attention"]
    assert {(a["seq"], a["head_dim"]) for a in attention} == {(t, d) for t in (1024, 4096, 8192) for d in (64, 128)}
    assert all(a["fused_vs_sdpa"] == pytest.approx(a["fused_ms"] / a["sdpa_ms"]) for a in attention)
    out = run_cli("bench", "fusion", "--json")
    assert out.returncode == 0, out.stderr
    fusion = json.loads(out.stdout)["fusion"]
    assert [(f["fmt"], f["features"], sorted(set(f) & {"swiglu", "swiglu_backward", "residual_rmsnorm"})) for f in fusion] == [
        (fmt, width, names) for fmt in ("mxfp4", "nvfp4")
        for width, names in ((768, ["residual_rmsnorm"]), (2048, ["swiglu", "swiglu_backward"]))]  # fmt: skip
    assert all(f["tokens"] == 16 * 1024 for f in fusion)



def test_help_lists_flags_without_a_value_type():
    # A flag takes no value, so --help must not print a `<bool>` type beside it, on any command.
    import typer
    from typer.testing import CliRunner

    from fp4lab.cli import app

    runner = CliRunner()

    def command_paths(group, ctx, prefix: list[str]):
        yield prefix
        for name in group.list_commands(ctx):
            sub = group.get_command(ctx, name)
            if hasattr(sub, "list_commands"):
                yield from command_paths(sub, typer.Context(sub, parent=ctx), prefix + [name])
            else:
                yield prefix + [name]

    root = typer.main.get_command(app)
    paths = list(command_paths(root, typer.Context(root), []))
    assert ["recipes", "show"] in paths and ["train"] in paths
    for path in paths:
        result = runner.invoke(app, [*path, "--help"], terminal_width=100)
        assert result.exit_code == 0, (path, result.output)
        assert "--help" in result.output
        assert "<bool>" not in result.output, path
    assert "<int>" in runner.invoke(app, ["train", "--help"], terminal_width=100).output


def test_train_fresh_removes_both_kinds_of_checkpoint_and_keeps_other_files(run_cli, tmp_path):
    out = tmp_path / "run"
    args = ("train", "--data", "synthetic", "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2",
            "--compute", "reference", "--out", str(out))
    assert run_cli(*args).returncode == 0
    # A sharded checkpoint left by an earlier run on several ranks, newer than checkpoint.pt: resumed
    # from unless --fresh removes it too (it is not a readable checkpoint, so resuming would fail).
    (out / "checkpoint.dcp" / "step-9").mkdir(parents=True)
    (out / "checkpoint.dcp" / "LATEST").write_text("step-9\n")
    (out / "notes.txt").write_text("mine")
    result = run_cli(*args, "--fresh")
    assert result.returncode == 0, result.stderr
    assert not (out / "checkpoint.dcp").exists() and (out / "checkpoint.pt").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1]


def test_train_with_a_catalog_refuses_every_other_option_by_its_name(run_cli, tmp_path):
    # A sweep run trains exactly as its config file says: any option beside it is named, even one set to 0.
    config = tmp_path / "run.toml"
    config.write_text('[data]\nsource = "synthetic"\n')
    out = run_cli("train", "--config", str(config), "--catalog", str(tmp_path / "c.json"), "--data", "synthetic",
                  "--seed", "0", "--fresh")
    assert out.returncode == 2 and out.stderr.strip().endswith("(drop --data, --seed, --fresh)"), out.stderr
    assert not (tmp_path / "c.json").exists()
