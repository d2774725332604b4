"""`bench steps` times its anchors on PyTorch's own process settings, whatever an fp4lab run changed;
its figures read whole in an 80-column terminal, and each run's as soon as it is timed."""

from __future__ import annotations

import torch
from rich.console import Console

from fp4lab.bench import steps as bench_steps_module
from fp4lab.bench.steps import StepBench
from fp4lab.cli.bench import _print_suite, _step_line
from fp4lab.train import build


def _settings() -> tuple[bool, bool]:
    return torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction, torch.are_deterministic_algorithms_enabled()


def test_an_anchor_timed_after_a_fast_path_build_runs_on_the_settings_from_before_it(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what the fast path sets: kept inside this test
    build.plain_pytorch_settings()  # as before any fast-path build in this process (a CUDA test's, say)
    plain = _settings()
    assert plain != (False, True), plain  # the fast path's settings differ, so the check can fail
    seen = []
    real_anchor = bench_steps_module.anchor_step
    monkeypatch.setattr(bench_steps_module, "anchor_step", lambda *a, **k: seen.append(_settings()) or real_anchor(*a, **k))
    try:
        build.fast_path_process_settings()  # as a fast-path recipe timed earlier in the process left them
        assert _settings() == (False, True)
        results = bench_steps_module.bench_steps([], model="tiny", batch_size=2, seq_len=32, device=torch.device("cpu"),
                                                 steps=1, warmup=0, compile="off")
    finally:
        build.plain_pytorch_settings()
    assert [r.name for r in results] == ["anchor"] and seen == [plain]
    assert _settings() == plain


def _run(name: str, compute: str, step_ms: float, peak_mb: float | None) -> StepBench:
    return StepBench(name=name, model="350m", batch_size=16, seq_len=1024, device="cuda", compute=compute, compiled=True,
                     cuda_graph=compute == "fast", paths=None, optimizer="adamw", step_ms=step_ms, step_ms_spread=0.012,
                     tokens_per_s=16 * 1024 / step_ms * 1000, peak_memory_mb=peak_mb, first_loss=8.3, last_loss=8.1)


def test_the_steps_table_fits_80_columns_and_each_run_prints_its_figures_when_timed():
    runs = [_run("anchor", "bf16 autocast", 81.2, None), _run("bf16", "fast", 80.6, 18312.0),
            _run("mxfp4-rowsr-h32", "fast", 105.8, 16655.0), _run("torchao-float8-rowwise", "torchao float8 rowwise", 166.4, 15021.0)]
    console = Console(width=80, record=True)
    _print_suite({"steps": [r.as_dict() for r in runs], "device": "NVIDIA H200"}, "steps", console)
    text = console.export_text()
    assert "\u2026" not in text, text  # nothing cut to an ellipsis
    assert max(len(line) for line in text.splitlines()) <= 80
    row = next(line for line in text.splitlines() if line.startswith("torchao-float8-rowwise"))
    assert row.split() == ["torchao-float8-rowwise", "yes/no", "166.4", "98,462", "0.49", "2.06", "15,021", "0.82"], row
    assert "torchao-float8-rowwise torchao float8 rowwise" in " ".join(text.split())
    assert _step_line(runs[2]) == "  mxfp4-rowsr-h32: 154,858 tokens/s, 105.8 ms a step (spread 1.2%), peak 16,655 MB"
    assert _step_line(runs[0]).endswith("81.2 ms a step (spread 1.2%)")
