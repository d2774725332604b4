"""Data-parallel training on real gloo process groups (CPU): torchrun starts 2 ranks of
tests/_distributed_worker.py (or of `fp4lab train`), and the results are compared with one process
training the same global batch (fp4lab.train.distributed).

Tolerance of the loss curves: both runs see the same tokens in the same order from the same initial
weights, and differ only in summation order: one process sums the 4 rows' gradients inside one GEMM,
two ranks sum 2 rows each and gloo adds the halves. At step 0 that is fp32 rounding alone (measured:
loss 9e-8 relative, grad norm equal), so step 0 must agree to RTOL_FIRST = 1e-6. Later steps inherit
those differences through the optimizer, which amplifies them: Muon rounds every Newton-Schulz
iteration to bf16 (2^-8 relative), so a 1e-7 difference that flips one bf16 rounding moves the update
by ~1e-3 (measured over 6 steps, bf16 + Muon: loss 1.2e-4, grad norm 2.3e-3 relative), and an FP4
value near a rounding boundary can flip too. Later steps get RTOL_LOSS = 1e-3 and RTOL_NORM = 1e-2.
A wrong wire (a rank's own loss logged, the rows not split, gradients not averaged) is off by 1e-2
or more already at step 0. Only round-to-nearest recipes are compared: SR recipes give ranks other
than 0 their own generators (fp4lab.train.distributed.offset_random_streams), so their bits differ
from a one-process run by design.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp4lab.train.capture import capture_files, load_capture
from fp4lab.train.config import ConfigError, DataConfig, TrainConfig
from fp4lab.train.distributed import Ranks
from fp4lab.train.jsonl import read_json_line
from fp4lab.train.loop import run
from tests.distributed_helpers import run_gloo

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).parents[1] / "_distributed_worker.py"
RTOL_FIRST, RTOL_LOSS, RTOL_NORM = 1e-6, 1e-3, 1e-2
# Per run of 2 ranks: two interpreters importing torch on a loaded CI machine, then seconds of training.
LAUNCH_TIMEOUT = 240


def small(tmp_path: Path, name: str, **overrides) -> TrainConfig:
    """6 steps of the tiny preset on the synthetic task, global batch 4, an evaluation at steps 3 and 6."""
    values = {
        "recipe": "bf16", "data": DataConfig(source="synthetic"), "seq_len": 32, "batch_size": 4, "steps": 6,
        "warmup_steps": 2, "eval_every": 3, "eval_batches": 2, "probe_every": 3, "checkpoint_every": 3,
        "compute": "reference", "out_dir": str(tmp_path / name),
    }
    return TrainConfig(**(values | overrides))


def torchrun(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    # In a session of its own: a launch over its time is killed with its ranks (killing torchrun alone
    # left them training, or hung in a collective, for the rest of the suite).
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True) as launch:
        try:
            stdout, stderr = launch.communicate(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            os.killpg(launch.pid, signal.SIGKILL)
            launch.communicate()
            raise
    return subprocess.CompletedProcess(command, launch.returncode, stdout, stderr)


def run_two_ranks(*configs: TrainConfig, stop_after_on_rank_1: int | None = None) -> subprocess.CompletedProcess:
    """Train each config on two ranks, one after another in one torchrun launch (rank 1 stops the last
    one after `stop_after_on_rank_1` steps)."""
    paths = []
    for config in configs:
        path = Path(config.out_dir).with_suffix(".json")
        path.write_text(json.dumps(config.to_dict()))
        paths.append(str(path))
    extra = [] if stop_after_on_rank_1 is None else [str(stop_after_on_rank_1)]
    result = torchrun(str(WORKER), *paths, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def metrics(config: TrainConfig) -> list[dict]:
    return [read_json_line(line) for line in (Path(config.out_dir) / "metrics.jsonl").read_text().splitlines()]


def assert_same_curve(one: list[dict], two: list[dict], case: object = None) -> None:
    assert [r["step"] for r in one] == [r["step"] for r in two], case
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "val_loss"):
            if key in a or key in b:
                rtol = RTOL_FIRST if a["step"] == 0 else RTOL_NORM if key == "grad_norm" else RTOL_LOSS
                assert b[key] == pytest.approx(a[key], rel=rtol), (case, a["step"], key)


# --- no process group needed ---------------------------------------------------------------------


def test_each_rank_takes_its_own_rows_of_the_global_batch():
    batch = torch.arange(8).reshape(4, 2)
    assert Ranks().rows(batch) is batch
    assert Ranks(rank=0, world=2, mode="ddp").rows(batch).tolist() == [[0, 1], [2, 3]]
    assert Ranks(rank=1, world=2, mode="ddp").rows(batch).tolist() == [[4, 5], [6, 7]]


def test_ranks_other_than_0_draw_their_own_random_bits():
    from fp4lab.nn.build import attention_generators, build_model, fp4_linears
    from fp4lab.nn.model_config import preset
    from fp4lab.nn.recipe import load_recipe
    from fp4lab.train.distributed import offset_random_streams

    def streams(rank: int | None) -> tuple[list[int], list[int]]:
        recipe = load_recipe("fullstack")  # SR linears and FP4 attention, each with its own generator
        model = build_model(preset("tiny", 256, 32), recipe, seed=0)
        if rank is not None:
            offset_random_streams(model, Ranks(rank=rank, world=2, mode="ddp"))
        return [m.seed for m in fp4_linears(model).values()], [g.initial_seed() for g in attention_generators(model)]

    one_process, rank_0, rank_1 = streams(None), streams(0), streams(1)
    assert len(one_process[0]) > 4 and len(one_process[1]) == 4
    assert rank_0 == one_process
    for ours, theirs in zip(rank_1, rank_0):
        assert all(a != b for a, b in zip(ours, theirs))


def test_parallel_is_validated_like_the_other_fields():
    with pytest.raises(ConfigError, match="parallel"):
        TrainConfig(parallel="tp")
    assert TrainConfig().parallel == "none"


def test_nproc_per_node_refuses_what_the_ranks_could_not_train(run_cli, tmp_path):
    for args, message in [
        (["--nproc-per-node", "0"], "--nproc-per-node 0 must be at least 1"),
        (["--nproc-per-node", "2"], "--nproc-per-node 2 needs --parallel ddp"),
        (["--nproc-per-node", "2", "--parallel", "ddp", "--batch-size", "5"], "--batch-size 5 does not split over 2"),
    ]:
        result = run_cli("train", "--data", "synthetic", "--out", str(tmp_path / "run"), *args)
        assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "run").exists()


def test_parallel_without_torchrun_names_the_launcher(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError, match="--nproc-per-node") as error:
        run(small(tmp_path, "nogroup", parallel="ddp"))
    assert "\n" not in str(error.value)
    assert not (tmp_path / "nogroup").exists()


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(tmp_path, monkeypatch):
    # torchrun's variables without its processes: the check comes before the process group is joined.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="batch_size=5 does not split over 2 ranks"):
        run(small(tmp_path, "odd", parallel="ddp", batch_size=5))
    with pytest.raises(ConfigError, match="parallel='none' but torchrun started 2 processes"):
        run(small(tmp_path, "none"))
    with pytest.raises(ConfigError, match="cuda_graphs='on' is not supported with parallel='fsdp'"):
        run(small(tmp_path, "graphs", parallel="fsdp", cuda_graphs="on"))
    assert not (tmp_path / "odd").exists() and not (tmp_path / "none").exists() and not (tmp_path / "graphs").exists()


# --- two ranks ---------------------------------------------------------------------------------------


# (recipe, parallel, optimizer, extra): one torchrun launch trains them all, one after another.
CURVE_CASES = [
    ("bf16", "ddp", "muon", {}),
    ("mxfp4", "ddp", "adamw", {}),
    ("bf16", "fsdp", "muon", {}),  # fp4lab.optim gathers each sharded update for Newton-Schulz
    ("bf16", "hsdp", "adamw", {}),  # one node of 2: mesh (replicate 1, shard 2)
    # tau low enough that heads clip: the max logits must be those of the global batch on every rank
    ("bf16", "fsdp", "muon", {"qk_clip": "kimi", "qk_clip_tau": 0.15}),
]


@pytest.mark.slow
def test_two_ranks_train_the_one_process_curve(tmp_path):
    pairs = []
    for index, (recipe, parallel, optimizer, extra) in enumerate(CURVE_CASES):
        # AdamW at a moderate rate: at the default 1e-2 the loss rises over these steps, and the chaos
        # amplifies summation-order differences past 1e-2 by step 3 (measured).
        settings = {"recipe": recipe, "optimizer": optimizer, "adam_lr": 3e-3, **extra}
        one = small(tmp_path, f"one-{index}", **settings)
        run(one, progress=False)
        pairs.append((one, small(tmp_path, f"two-{index}", **settings, parallel=parallel)))
    run_two_ranks(*(two for _, two in pairs))
    for case, (one, two) in zip(CURVE_CASES, pairs):
        assert_same_curve(metrics(one), metrics(two), case)
        if case[3]:
            clipped = [r["qk_clipped_heads"] for r in metrics(two)]
            assert clipped == [r["qk_clipped_heads"] for r in metrics(one)] and sum(clipped) > 0, case
        summary = json.loads((Path(two.out_dir) / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["world_size"] == 2, case


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_only_rank_0_writes_and_a_stop_on_one_rank_stops_all_and_resumes_exactly(tmp_path, parallel):
    # An SR recipe: the resumed run must continue every rank's own generators (checkpoint.dcp's rank-<r>.pt).
    settings = {
        "recipe": "nvfp4-global", "parallel": parallel, "capture_steps": [1], "capture_layers": ["layers.0.attention.wq"],
    }
    whole = small(tmp_path, "whole", **settings)
    stopped = small(tmp_path, "stopped", **settings)
    first = run_two_ranks(whole, stopped, stop_after_on_rank_1=2)
    # Only rank 1 was asked to stop, after its second step: both stop there, or the run would hang.
    assert "rank 0 status stopped steps 2" in first.stderr and "rank 1 status stopped steps 2" in first.stderr
    assert json.loads((Path(stopped.out_dir) / "summary.json").read_text())["status"] == "stopped"
    run_two_ranks(stopped)
    assert metrics(stopped) == [{**r, "tokens_per_s": s["tokens_per_s"]} for r, s in zip(metrics(whole), metrics(stopped))]
    out = Path(whole.out_dir)
    assert sorted(p.name for p in out.iterdir()) == ["captures", "checkpoint.dcp", "config.json", "metrics.jsonl", "summary.json"]
    assert sorted(p.name for p in (out / "checkpoint.dcp").iterdir()) == ["LATEST", "step-6"]
    # Rank 0's operands: its 2 rows of the global batch of 4, seq_len 32.
    (capture,) = capture_files(out)
    assert load_capture(capture).x.shape[0] == 2 * 32


def fp4lab_train(out: Path, *args: str) -> subprocess.CompletedProcess:
    """`fp4lab train ARGS --data synthetic --out OUT` in its own interpreter (it must exit 0)."""
    command = [sys.executable, "-m", "fp4lab.cli", "train", *args, "--data", "synthetic", "--out", str(out)]
    result = subprocess.run(command, cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                            timeout=LAUNCH_TIMEOUT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_fp4lab_train_nproc_per_node_runs_torchrun(tmp_path):
    out = tmp_path / "cli"
    result = fp4lab_train(out, "--nproc-per-node", "2", "--parallel", "ddp", "--steps", "3", "--batch-size", "4", "--seq-len", "32",
                          "--eval-every", "3", "--compute", "reference")
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert result.stderr.count("step 2/2") == 1  # the last step (steps count from 0); rank 1 prints nothing
    assert result.stdout.count("status: completed") == 1


@pytest.mark.slow
def test_nproc_per_node_1_runs_one_rank_under_torchrun(tmp_path):
    """`--nproc-per-node 1 --parallel fsdp`: one FSDP2 rank (how a run written by 2 GPUs goes on on 1)."""
    out = tmp_path / "one"
    fp4lab_train(out, "--nproc-per-node", "1", "--parallel", "fsdp", "--steps", "2", "--batch-size", "2", "--seq-len", "32",
                 "--eval-every", "2", "--compute", "reference")
    assert json.loads((out / "summary.json").read_text())["world_size"] == 1
    assert (out / "checkpoint.dcp" / "LATEST").exists()


def _compiled_parts(rank: int, world: int, parallel: str) -> tuple[bool, list[bool]]:
    from fp4lab.nn.model_config import preset
    from fp4lab.nn.recipe import load_recipe
    from fp4lab.train.build import build_training

    config = TrainConfig(recipe="bf16", model="tiny", compile="on", parallel=parallel, out_dir="unused")
    model, _, loss_fn = build_training(config, load_recipe("bf16"), preset("tiny", 64, 32), torch.device("cpu"),
                                       Ranks(rank, world, rank, world, parallel))
    return _is_compiled(loss_fn), [_is_compiled(block.forward) for block in model.layers]


def _is_compiled(fn) -> bool:
    return hasattr(fn, "_torchdynamo_orig_callable")


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_data_parallel_runs_compile_each_block_not_the_whole_loss(parallel):
    """Under DDP/FSDP2 each block is compiled, torchtitan's pattern, instead of the whole loss, whose graph
    their hooks break up (docs/BENCHMARKS.md has the H200 figures). Only the wiring is checked here:
    compiling on CPU would take a minute."""
    (whole, blocks), = run_gloo(_compiled_parts, parallel, world_size=1)
    assert not whole and blocks and all(blocks)


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["bf16", "nvfp4"])
def test_ddp_steps_replay_from_a_cuda_graph_with_the_same_bits(tmp_path, recipe):
    """DDP on CUDA (NCCL, one rank here) captures forward, backward and the gradient all-reduce after its
    11 eager steps; the replayed steps give the eager run's losses and grad norms bit for bit."""
    curves = {}
    for graphs in ("on", "off"):
        out = tmp_path / graphs
        fp4lab_train(out, "--nproc-per-node", "1", "--parallel", "ddp", "--device", "cuda", "--recipe", recipe, "--compile", "off",
                     "--cuda-graphs", graphs, "--steps", "20", "--batch-size", "4", "--seq-len", "64", "--eval-every", "20",
                     "--probe-every", "10")
        assert json.loads((out / "summary.json").read_text())["cuda_graph"] == (graphs == "on")
        curves[graphs] = [(r["loss"], r["grad_norm"]) for r in metrics(TrainConfig(out_dir=str(out)))]
    # Eager probe steps 0, 10 and 19 interleave with the replays (steps 13-18, after 11 eager ones).
    assert len(curves["on"]) == 20 and curves["on"] == curves["off"]
