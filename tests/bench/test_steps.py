"""`bench steps` times its anchors on PyTorch's own process settings, whatever an fp4lab run changed."""

from __future__ import annotations

import torch

from fp4lab.bench import steps as bench_steps_module
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
