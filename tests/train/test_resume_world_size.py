"""A run resumed on another number of ranks (fp4lab.train.loop._resume): a sharded checkpoint written by
2 ranks resumes in one process, on 1 rank and on 2; a one-process checkpoint resumes on 2 ranks.

Model and optimizer state right after loading must equal, bit for bit, what the writing ranks saved:
tests/_resume_worker.py gathers both as full tensors (at save time on the writing ranks, after the
restore on the reading ones), so the comparison never reads the checkpoint through the code under test.
Loss curves across a world-size change are compared with an uninterrupted one-process run within
tests/train/test_distributed.py's tolerances (summation order only; round-to-nearest recipes, since the SR
draws of rows that moved to another rank come from another rank's stream).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp4lab.train.checkpoint import newest_checkpoint, remove_checkpoint
from fp4lab.train.config import CheckpointMismatch, ConfigError, TrainConfig
from fp4lab.train.loop import run
from tests._resume_worker import load
from tests.train.test_distributed import LAUNCH_TIMEOUT, REPO, assert_same_curve, metrics, run_two_ranks, small

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

WORKER = Path(__file__).parents[1] / "_resume_worker.py"
# Every state an optimizer or layer keeps: SR linears and FP4 attention (random streams), Muon with
# NVFP4 Newton-Schulz, AdamW with the NVFP4 second moment (embedding and head), LoRA-SVD buffers.
EVERYTHING = {"recipe": "fullstack"}
# Round to nearest, and AdamW at test_distributed's moderate rate: with Muon, bf16 Newton-Schulz amplifies
# summation-order differences of an FP4 run past its tolerances within 4 steps even without a resume
# (measured, mxfp4: grad norm 1.5e-2 relative at step 3 on 2 ranks uninterrupted).
RTN = {"recipe": "mxfp4", "optimizer": "adamw", "adam_lr": 3e-3}


def launch(mode: str, config: TrainConfig, nproc: int, *args: str) -> None:
    """tests/_resume_worker.py MODE on `nproc` torchrun ranks (one plain process for parallel none)."""
    path = Path(config.out_dir).with_name(f"{Path(config.out_dir).name}-{mode}-{config.parallel}{nproc}.json")
    path.write_text(json.dumps(config.to_dict()))
    ranks = [] if config.parallel == "none" else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    result = subprocess.run(
        [sys.executable, *ranks, str(WORKER), mode, str(path), *args], cwd=REPO, env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=LAUNCH_TIMEOUT, check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def assert_identical(saved, loaded, where: str = "") -> None:
    """Equal keys, and every tensor of the same dtype and shape and equal bit for bit."""
    if isinstance(saved, dict):
        assert set(saved) == set(loaded), (where, set(saved) ^ set(loaded))
        for key in saved:
            assert_identical(saved[key], loaded[key], f"{where}.{key}")
    elif isinstance(saved, (list, tuple)):
        assert len(saved) == len(loaded), where
        for i, (a, b) in enumerate(zip(saved, loaded)):
            assert_identical(a, b, f"{where}[{i}]")
    elif isinstance(saved, torch.Tensor):
        assert saved.dtype == loaded.dtype and saved.shape == loaded.shape, where
        assert torch.equal(saved, loaded), where
    else:
        assert saved == loaded, (where, saved, loaded)


def stopped_after_2(tmp: Path, parallel: str, nproc: int, settings: dict) -> tuple[TrainConfig, dict]:
    """A run stopped after 2 of its 6 steps, and the state its checkpoint holds, gathered whole."""
    config = small(tmp, "run", parallel=parallel, **settings)
    launch("train", config, nproc, "2", str(tmp / "saved.pt"))
    return config, torch.load(tmp / "saved.pt", weights_only=False)


def loaded_on(config: TrainConfig, parallel: str, nproc: int) -> list[dict]:
    """Per rank: the state, step and random streams right after the restore, on `nproc` ranks."""
    moved = TrainConfig.from_dict(config.to_dict() | {"parallel": parallel})
    prefix = f"{config.out_dir}-loaded-{parallel}{nproc}"
    if parallel == "none":
        load(moved, prefix)  # one process, in this one
    else:
        launch("load", moved, nproc, prefix)
    return [torch.load(f"{prefix}-rank{r}.pt", weights_only=False) for r in range(nproc)]


def saved_streams(config: TrainConfig, rank: int) -> dict:
    extras = torch.load(Path(config.out_dir) / "checkpoint.dcp" / "step-2" / f"rank-{rank}.pt", weights_only=True)
    return {"linears": extras["linears"], "attention_generators": extras["attention_generators"]}


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory) -> tuple[TrainConfig, dict]:
    return stopped_after_2(tmp_path_factory.mktemp("fsdp"), "fsdp", 2, EVERYTHING)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    config = small(tmp_path_factory.mktemp("whole"), "whole", **RTN)
    run(config, progress=False)
    return metrics(config)


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "nproc"), [("none", 1), ("fsdp", 1), ("fsdp", 2)])
def test_two_fsdp_ranks_checkpoint_loads_bit_for_bit_on_one_process_one_rank_and_two(fsdp_checkpoint, parallel, nproc):
    config, saved = fsdp_checkpoint
    loaded = loaded_on(config, parallel, nproc)
    assert all(r["step"] == 2 for r in loaded)
    assert_identical(saved, loaded[0]["whole"])
    assert any(k.endswith("v_codes") for state in saved["optimizer"]["state"].values() for k in state)  # NVFP4 v
    assert any("momentum_buffer" in state for state in saved["optimizer"]["state"].values())  # Muon
    for rank, result in enumerate(loaded):  # rank r continues the saved rank r's streams
        assert_identical(saved_streams(config, rank), result["streams"])


@pytest.mark.slow
def test_ddp_checkpoint_of_two_ranks_loads_bit_for_bit_in_one_process(tmp_path):
    config, saved = stopped_after_2(tmp_path, "ddp", 2, EVERYTHING)
    (loaded,) = loaded_on(config, "none", 1)
    assert loaded["step"] == 2
    assert_identical(saved, loaded["whole"])
    assert_identical(saved_streams(config, 0), loaded["streams"])


@pytest.mark.slow
def test_one_process_checkpoint_loads_bit_for_bit_on_two_fsdp_ranks(tmp_path):
    config, saved = stopped_after_2(tmp_path, "none", 1, EVERYTHING)
    rank_0, rank_1 = loaded_on(config, "fsdp", 2)
    assert rank_0["step"] == rank_1["step"] == 2
    assert_identical(saved, rank_0["whole"])
    one_process = torch.load(Path(config.out_dir) / "checkpoint.pt", weights_only=True)
    for name, state in rank_0["streams"]["linears"].items():
        assert_identical(one_process["model"][f"{name}._extra_state"], state)
    # Rank 1 had no saved streams: its own, not rank 0's (its SR errors stay independent of rank 0's).
    seeds = [{n: s["seed"] for n, s in r["streams"]["linears"].items()} for r in (rank_0, rank_1)]
    assert all(seeds[0][n] != seeds[1][n] for n in seeds[0])
    for ours, theirs in zip(rank_1["streams"]["attention_generators"], rank_0["streams"]["attention_generators"]):
        assert not torch.equal(ours, theirs)


@pytest.mark.slow
def test_two_fsdp_ranks_then_one_process_train_the_uninterrupted_curve(tmp_path, uninterrupted):
    moved = small(tmp_path, "moved", parallel="fsdp", **RTN)
    run_two_ranks(moved, stop_after_on_rank_1=3)
    summary = run(TrainConfig.from_dict(moved.to_dict() | {"parallel": "none"}), progress=False)
    assert summary["status"] == "completed" and summary["world_size"] == 1
    assert_same_curve(uninterrupted, metrics(moved))  # one line per step: the log reads as one run
    out = Path(moved.out_dir)
    assert json.loads((out / "config.json").read_text())["world_size"] == 1
    # The one-process checkpoint replaced the sharded one once it was whole.
    assert (out / "checkpoint.pt").exists() and not (out / "checkpoint.dcp").exists()


@pytest.mark.slow
def test_after_a_change_of_world_a_stop_and_resume_on_the_same_ranks_continues_bit_for_bit(tmp_path):
    # SR: rank 1's fresh streams (it had none in the one-process checkpoint) must be checkpointed and
    # continued like any other rank's.
    straight = small(tmp_path, "straight", recipe="nvfp4-global")
    run(straight, progress=False, stop_after=2)
    stopped = small(tmp_path, "stopped", recipe="nvfp4-global")
    shutil.copytree(straight.out_dir, stopped.out_dir)
    on_ranks = TrainConfig.from_dict(stopped.to_dict() | {"parallel": "fsdp"})
    run_two_ranks(TrainConfig.from_dict(straight.to_dict() | {"parallel": "fsdp"}), on_ranks, stop_after_on_rank_1=2)
    run_two_ranks(on_ranks)
    assert [r | {"tokens_per_s": 0} for r in metrics(stopped)] == [r | {"tokens_per_s": 0} for r in metrics(straight)]


@pytest.mark.slow
def test_a_stale_checkpoint_of_the_other_kind_is_never_resumed(tmp_path, uninterrupted):
    # 1 process -> 2 ranks -> 1 process -> 2 ranks, each time with the replaced checkpoint put back, as a
    # kill between writing the new checkpoint and removing the old would leave it.
    one = small(tmp_path, "run", **RTN)
    two = TrainConfig.from_dict(one.to_dict() | {"parallel": "fsdp"})
    out, aside = Path(one.out_dir), tmp_path / "aside"
    aside.mkdir()
    run(one, progress=False, stop_after=2)
    shutil.copy(out / "checkpoint.pt", aside)  # step 2
    run_two_ranks(two, stop_after_on_rank_1=2)
    assert not (out / "checkpoint.pt").exists()
    shutil.copytree(out / "checkpoint.dcp", aside / "checkpoint.dcp")  # step 4
    shutil.copy(aside / "checkpoint.pt", out)
    assert run(one, progress=False, stop_after=1)["steps_completed"] == 5  # from step 4, not the stale 2
    assert not (out / "checkpoint.dcp").exists()
    step_4 = metrics(one)[4]
    shutil.copytree(aside / "checkpoint.dcp", out / "checkpoint.dcp")
    run_two_ranks(two)
    # From step 5, not the stale 4: the line of step 4 (its measured tokens/s included) was not logged again.
    assert metrics(one)[4] == step_4
    assert_same_curve(uninterrupted, metrics(one))


def test_the_newer_checkpoint_wins_and_an_incomplete_one_never_does(tmp_path):
    one_process, sharded = tmp_path / "checkpoint.pt", tmp_path / "checkpoint.dcp"
    assert newest_checkpoint(one_process, sharded) is None
    (sharded / "step-4").mkdir(parents=True)  # a save killed before LATEST named it
    assert newest_checkpoint(one_process, sharded) is None
    torch.save({"state": {"step": 2}}, one_process)
    assert newest_checkpoint(one_process, sharded) == one_process
    (sharded / "LATEST").write_text("step-4\n")
    assert newest_checkpoint(one_process, sharded) == sharded / "step-4"
    torch.save({"state": {"step": 6}}, one_process)
    assert newest_checkpoint(one_process, sharded) == one_process
    remove_checkpoint(sharded)
    assert not sharded.exists() and newest_checkpoint(one_process, sharded) == one_process


@pytest.mark.slow
def test_resuming_on_ranks_that_do_not_split_the_batch_is_refused_before_anything_is_written(fsdp_checkpoint, tmp_path, monkeypatch):
    config, _ = fsdp_checkpoint
    folder = tmp_path / "run"
    shutil.copytree(config.out_dir, folder)
    before = {p: p.stat().st_mtime_ns for p in folder.rglob("*")}
    # torchrun's variables for rank 0 of 3 without its processes: the check comes before the group is joined.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="batch_size=4 does not split over 3 ranks .* a number of ranks that divides 4") as error:
        run(TrainConfig.from_dict(config.to_dict() | {"out_dir": str(folder)}), progress=False)
    assert "\n" not in str(error.value)
    assert {p: p.stat().st_mtime_ns for p in folder.rglob("*")} == before


@pytest.mark.slow
def test_only_parallel_may_change_with_the_world_size(fsdp_checkpoint, tmp_path):
    config, _ = fsdp_checkpoint
    folder = tmp_path / "run"
    shutil.copytree(config.out_dir, folder)
    changed = TrainConfig.from_dict(config.to_dict() | {"out_dir": str(folder), "parallel": "none", "lr": 0.03})
    with pytest.raises(CheckpointMismatch, match=r"checkpoint.dcp was written by a run with a different lr; resume with the same") as error:
        run(changed, progress=False)
    assert "\n" not in str(error.value)
