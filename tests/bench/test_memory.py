"""What holds a step's peak memory (`fp4lab.bench.memory`): the trace replay, and on CUDA the real allocator."""

from __future__ import annotations

import pytest
import torch

from fp4lab.bench.memory import peak_holders

MIB = 2**20


def _event(action: str, addr: int, size: int, *frames: tuple[str, int, str]) -> dict:
    return {"action": action, "addr": addr, "size": size, "frames": [{"filename": f, "line": n, "name": fn} for f, n, fn in frames]}


LAYER = ("/x/site-packages/fp4lab/nn/fp4_linear.py", 100, "forward")
ADAM = ("/x/site-packages/fp4lab/optim/adamw.py", 200, "step")
KERNEL = ("/tmp/torchinductor_root/ab/cab.py", 7, "call")


def test_the_replay_finds_the_highest_point_and_who_holds_it():
    trace = [
        _event("alloc", 1, 4 * MIB, ADAM),  # optimizer state, kept
        _event("alloc", 2, 8 * MIB, KERNEL, LAYER),  # an activation a compiled kernel wrote, for this layer
        _event("alloc", 3, 2 * MIB, LAYER),
        _event("free_requested", 2, 8 * MIB, KERNEL, LAYER),  # requested: still allocated until completed
        _event("alloc", 4, 1 * MIB, LAYER),  # the peak: 4 + 8 + 2 + 1
        _event("free_completed", 2, 8 * MIB, KERNEL, LAYER),
        _event("alloc", 5, 9 * MIB, ADAM),  # 4 + 2 + 1 + 9 = 16 is higher still
        _event("free_completed", 5, 9 * MIB, ADAM),
        _event("free_completed", 99, 50 * MIB, ADAM),  # allocated before the trace began: not counted
        _event("alloc", 6, 3 * MIB),  # no stack
    ]
    holders = peak_holders(trace, before_bytes=5 * MIB)
    assert holders.peak_bytes == 16 * MIB and holders.before_bytes == 5 * MIB
    assert holders.by_fp4lab_line == [("fp4lab/optim/adamw.py:200 step", 13 * MIB), ("fp4lab/nn/fp4_linear.py:100 forward", 3 * MIB)]
    assert holders.by_innermost_frame[0] == ("fp4lab/optim/adamw.py:200 step", 13 * MIB)
    assert not holders.truncated and holders.events == len(trace)
    table = holders.table()
    assert "traced peak 16 MiB (+ 5 MiB allocated before recording)" in table and "13.0 MiB  fp4lab/optim/adamw.py:200 step" in table


def test_an_inductor_buffer_is_charged_to_the_fp4lab_line_that_ran_the_graph():
    holders = peak_holders([_event("alloc", 1, 8 * MIB, KERNEL, LAYER)])
    assert holders.by_fp4lab_line == [("fp4lab/nn/fp4_linear.py:100 forward", 8 * MIB)]
    assert holders.by_innermost_frame == [("/tmp/torchinductor_root/ab/cab.py:7 call", 8 * MIB)]


@pytest.mark.cuda
def test_bench_steps_writes_what_holds_the_peak_of_a_real_step(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU)")
    from fp4lab.bench.steps import bench_steps

    device = torch.device("cuda")
    (result,) = [r for r in bench_steps(["nvfp4"], model="tiny", batch_size=4, seq_len=128, device=device, steps=2, warmup=4,
                                        memory_dir=tmp_path) if r.name == "nvfp4"]
    table = (tmp_path / "nvfp4.txt").read_text()
    traced = float(table.split("traced peak ")[1].split(" MiB")[0].replace(",", ""))
    before = float(table.split("(+ ")[1].split(" MiB")[0].replace(",", ""))
    # The allocator's own peak of the timed steps is one of the points the replay went through.
    assert result.peak_memory_mb <= traced + before + 1, (result.peak_memory_mb, traced, before)
    assert "fp4lab/" in table and "TRUNCATED" not in table
    assert (tmp_path / "anchor.txt").is_file()
