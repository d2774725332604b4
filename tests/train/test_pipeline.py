"""Pipeline parallelism (parallel='pp', fp4lab.train.pipeline) on real gloo process groups (CPU), 2 ranks,
compared with one process training the same global batch. Nothing here has run on GPUs.

Tolerances are tests/train/test_distributed.py's, for the same reason: the pipeline changes summation order
only. One process sums a weight gradient over the 4 rows of the batch inside one GEMM; the pipeline
sums it over 1 row per microbatch (pp_microbatches=4) and adds the 4 microbatch gradients, then
divides by 4 (the schedule's scale_grads), and the gradient norm is the root of the two ranks' summed
squares instead of the norm of the norms. Measured at step 0 (bf16, AdamW): loss and grad norm equal
bit for bit, so RTOL_FIRST = 1e-6 holds with room; later steps inherit the differences through the
optimizer (measured over 6 steps: loss 4e-5, grad norm 4.4e-3 relative), within RTOL_LOSS = 1e-3 and
RTOL_NORM = 1e-2. A broken wire is off at step 0 already: the loss of one microbatch, gradients not
divided by the microbatches (a grad norm 4x), a rank's own gradient norm (one stage's), or max logits
of one microbatch.

Only round-to-nearest recipes whose scales are per block of a row are compared (bf16, mxfp4): NVFP4's
per-tensor scale is the amax of the rows one GEMM sees, which microbatching changes, and SR draws
per GEMM call, so both differ from one process by design, not by summation order.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp4lab.train.config import ConfigError, TrainConfig
from fp4lab.train.data import DEFAULT_SYNTHETIC_VOCAB
from fp4lab.train.loop import run
from tests.distributed_helpers import rank_threads, run_gloo
from tests.train.test_distributed import RTOL_FIRST, assert_same_curve, metrics, run_two_ranks, small

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

VOCAB, SEQ = 64, 32  # the unit tests' model; SEQ is small()'s seq_len too


def build(config: TrainConfig, rank: int = 0, world: int = 1, vocab: int = VOCAB):
    """build_training as rank `rank` of `world` builds it (one process for parallel none)."""
    from fp4lab.nn.model_config import preset
    from fp4lab.nn.recipe import load_recipe
    from fp4lab.train.build import build_training
    from fp4lab.train.distributed import Ranks

    ranks = Ranks(rank, world, rank, world, config.parallel) if config.parallel != "none" else Ranks()
    return build_training(config, load_recipe(config.recipe), preset(config.model, vocab, SEQ), torch.device("cpu"), ranks)


def step_config(**overrides) -> TrainConfig:
    values = {"recipe": "bf16", "optimizer": "adamw", "compute": "reference", "batch_size": 4, "seq_len": SEQ, "out_dir": "unused"}
    return TrainConfig(**(values | overrides))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def block_of(name: str) -> str:
    """"layers.3" for a parameter of block 3, the module's name otherwise."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


# --- the split and the schedule's step, in spawned gloo ranks --------------------------------------


def _held(rank: int, world: int) -> dict:
    model, _, _ = build(step_config(parallel="pp"), rank, world)
    return {name: p.numel() for name, p in model.named_parameters()}


@pytest.mark.slow
def test_each_rank_holds_only_its_blocks_under_their_one_process_names():
    from fp4lab.nn.model_config import count_parameters, preset

    rank_0, rank_1 = run_gloo(_held)
    whole, _, _ = build(step_config())
    # DualPipeV's V: rank 0 holds stages 0 and 3 (embedding + block 0, block 3 + norm + head), rank 1 stages 1 and 2.
    assert {block_of(n) for n in rank_0} == {"tok_embeddings", "layers.0", "layers.3", "norm", "output"}
    assert {block_of(n) for n in rank_1} == {"layers.1", "layers.2"}
    assert not rank_0.keys() & rank_1.keys()
    assert rank_0 | rank_1 == {name: p.numel() for name, p in whole.named_parameters()}
    assert sum(rank_0.values()) + sum(rank_1.values()) == count_parameters(preset("tiny", VOCAB, SEQ))


def _compiled(rank: int, world: int) -> list[bool]:
    model, _, _ = build(step_config(parallel="pp", compile="on"), rank, world)
    return [hasattr(block.forward, "_torchdynamo_orig_callable") for block in model.layers]


@pytest.mark.slow
def test_pp_compiles_each_of_the_ranks_blocks():
    """As under DDP/FSDP2 (tests/train/test_distributed.py): only the wiring, compiling on CPU would take a minute."""
    assert run_gloo(_compiled) == [[True, True], [True, True]]


def _one_step(rank: int, world: int, dualpipe: bool) -> dict:
    from fp4lab.optim.sharding import clip_grad_norm_
    from fp4lab.train import pipeline

    if not dualpipe:  # as on a torch without ScheduleDualPipeV (this process ends after the step)
        pipeline.DUALPIPE_V = None
    model, _, pp = build(step_config(parallel="pp"), rank, world)
    tokens, targets = batch()
    for attention in model.attentions():
        attention.record_max_logits = True
    loss = pp.step(tokens, targets)
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    own_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    return {
        "loss": loss, "grads": grads, "own_norm": own_norm,
        "norm": clip_grad_norm_(model.parameters(), float("inf"), split_over_ranks=True),
        "max_logits": {int(i): a.last_max_logits for i, a in zip(model.layers.keys(), model.attentions())},
        "val_loss": pp(tokens, targets),
    }


@pytest.mark.slow
@pytest.mark.parametrize("dualpipe", [True, False], ids=["DualPipeV", "1F1B"])
def test_a_pipeline_step_gives_the_one_process_loss_gradients_and_max_logits(dualpipe):
    from fp4lab.train import pipeline as pp

    if dualpipe and pp.DUALPIPE_V is None:
        pytest.skip("this torch has no ScheduleDualPipeV")
    ranks = run_gloo(_one_step, dualpipe)
    model, _, loss_fn = build(step_config())
    tokens, targets = batch()
    for attention in model.attentions():
        attention.record_max_logits = True
    loss = loss_fn(tokens, targets)
    loss.backward()
    for result in ranks:  # every rank has the global batch's loss
        assert result["loss"].item() == pytest.approx(loss.item(), rel=RTOL_FIRST)
        assert result["val_loss"].item() == pytest.approx(loss.item(), rel=RTOL_FIRST)
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert ranks[0]["grads"].keys() | ranks[1]["grads"].keys() == grads.keys()
    for result in ranks:
        for name, grad in result["grads"].items():  # divided by the microbatches: the mean loss's gradient
            torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-7, msg=name)
        for index, logits in result["max_logits"].items():  # the max over every microbatch
            torch.testing.assert_close(logits, model.attentions()[index].last_max_logits, rtol=RTOL_FIRST, atol=0)
    whole_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    assert ranks[0]["norm"].item() == ranks[1]["norm"].item() == pytest.approx(whole_norm.item(), rel=RTOL_FIRST)
    assert ranks[0]["own_norm"].item() < 0.99 * whole_norm.item()  # one stage's norm is not the global one


def _fast_step(rank: int, world: int) -> dict:
    model, _, pp = build(step_config(parallel="pp", compute="fast"), rank, world)
    loss = pp.step(*batch())
    return {"loss": loss, "grads": {name: p.grad.clone() for name, p in model.named_parameters()}}


def microbatched_in_one_process(config: TrainConfig) -> tuple[torch.Tensor, dict, list[dict]]:
    """The schedule's arithmetic in one process: each microbatch (one row: a stage's GEMM shapes) forward
    and backward in order on the ranks' thread count, the gradients summed in that order and divided by
    the microbatches (scale_grads), the loss the mean of the microbatch losses (Pipeline._on_every_rank).
    Returns that loss, those gradients and each microbatch's own gradients."""
    with rank_threads():
        model, _, loss_fn = build(config)
        names, params = zip(*model.named_parameters())
        tokens, targets = batch()
        losses, parts = [], []
        for row in range(len(tokens)):
            loss = loss_fn(tokens[row : row + 1], targets[row : row + 1])
            parts.append(dict(zip(names, torch.autograd.grad(loss, params))))
            losses.append(loss.detach())
    grads = {name: sum((part[name] for part in parts[1:]), start=parts[0][name]) / len(parts) for name in names}
    return torch.stack(losses).float().mean(), grads, parts


@pytest.mark.slow
def test_the_fast_path_through_the_stages_gives_the_one_process_step():
    """compute='fast' (bf16 autocast, tensor-core GEMMs emulated on the CPU) through the stages.

    Bit for bit against microbatched_in_one_process: the same arithmetic in the same order (the same
    1-row GEMMs on one thread, the fp32 residual stream sent between stages unrounded, a stage's
    microbatches run first in first out, so losses and gradients add up in microbatch order).

    Against the whole batch in one process the arithmetic differs, in two places:
    - the loss: the same 128 per-token losses, averaged in one fp32 reduction there and as four means
      of 32 then a mean of 4 here. Any summation order of n positive terms is within (n - 1) u relative
      of the exact sum (u = 2^-24, the divisions by powers of two are exact), so the two are within
      (127 + 31 + 3) u = 161 u = 9.6e-6 relative (measured: 1.1e-7, one ulp; equal on some CPUs).
    - a weight gradient leaves its GEMM rounded to bf16 (within 2^-8 relative, 8 significant bits):
      per microbatch here, sum_k bf16(s_k) / 4, once there, bf16(sum_k s_k / 4); so the two differ by at
      most 2^-8 (sum_k |s_k| / 4 + |whole|) in norm (measured: 2.4e-3 of |whole|, that bound 1.2e-2).
    The stages' autocast is not checked here: on the CPU it changes nothing in this model."""
    ranks = run_gloo(_fast_step)
    loss, grads, parts = microbatched_in_one_process(step_config(compute="fast"))
    for result in ranks:
        assert result["loss"].item() == loss.item()
        for name, grad in result["grads"].items():
            assert torch.equal(grad, grads[name]), name
    assert ranks[0]["grads"].keys() | ranks[1]["grads"].keys() == grads.keys()

    model, _, loss_fn = build(step_config(compute="fast"))
    whole_loss = loss_fn(*batch())
    whole_loss.backward()
    assert abs(loss.item() - whole_loss.item()) <= 161 * 2**-24 * whole_loss.item()
    for name, whole in model.named_parameters():
        bound = 2**-8 * (sum(part[name].norm() for part in parts) / len(parts) + whole.grad.norm())
        assert (grads[name] - whole.grad).norm() <= bound, name


# --- whole runs under torchrun ---------------------------------------------------------------------


# (recipe, optimizer, extra): one torchrun launch trains them all, one after another.
CURVE_CASES = [
    ("bf16", "adamw", {}),
    ("mxfp4", "adamw", {}),
    # tau low enough that heads clip: each rank clips its blocks' heads on the max over all microbatches
    ("bf16", "muon", {"qk_clip": "kimi", "qk_clip_tau": 0.15}),
]


@pytest.mark.slow
def test_pp_trains_the_one_process_curve(tmp_path):
    pairs = []
    for index, (recipe, optimizer, extra) in enumerate(CURVE_CASES):
        settings = {"recipe": recipe, "optimizer": optimizer, "adam_lr": 3e-3, **extra}
        one = small(tmp_path, f"one-{index}", **settings)
        run(one, progress=False)
        pairs.append((one, small(tmp_path, f"two-{index}", **settings, parallel="pp")))
    run_two_ranks(*(two for _, two in pairs))
    for case, (one, two) in zip(CURVE_CASES, pairs):
        assert_same_curve(metrics(one), metrics(two), case)
        # Step 0's per-head max logits, every layer's heads gathered to rank 0 in block order, each the
        # max over all microbatches. (Later probes amplify the optimizer's summation-order differences:
        # measured 1.6e-2 at step 3 with Muon; the curve and the clipped-head counts cover those steps.)
        first, first_pp = metrics(one)[0], metrics(two)[0]
        assert torch.tensor(first_pp["max_logit"]) == pytest.approx(torch.tensor(first["max_logit"]), rel=RTOL_FIRST), case
        if case[2]:
            clipped = [r["qk_clipped_heads"] for r in metrics(two)]
            assert clipped == [r["qk_clipped_heads"] for r in metrics(one)] and sum(clipped) > 0, case
        out = Path(two.out_dir)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["world_size"] == 2, case
        assert json.loads((out / "config.json").read_text())["pipeline_schedule"] == "ScheduleDualPipeV", case


@pytest.mark.slow
def test_a_stop_on_one_rank_stops_both_and_the_run_resumes_exactly(tmp_path):
    # SR: every block's streams live on its rank and must be checkpointed and continued there.
    settings = {"recipe": "nvfp4-global", "parallel": "pp"}
    whole = small(tmp_path, "whole", **settings)
    stopped = small(tmp_path, "stopped", **settings)
    first = run_two_ranks(whole, stopped, stop_after_on_rank_1=2)
    assert "rank 0 status stopped steps 2" in first.stderr and "rank 1 status stopped steps 2" in first.stderr
    run_two_ranks(stopped)
    assert metrics(stopped) == [{**r, "tokens_per_s": s["tokens_per_s"]} for r, s in zip(metrics(whole), metrics(stopped))]
    assert sorted(p.name for p in (Path(whole.out_dir) / "checkpoint.dcp").iterdir()) == ["LATEST", "step-6"]


# Every state a layer or optimizer keeps, as tests/train/test_resume_world_size.py's EVERYTHING: SR linears and
# FP4 attention (random streams), Muon with NVFP4 Newton-Schulz, AdamW's NVFP4 v, LoRA-SVD buffers.
EVERYTHING = "fullstack"


def loaded_state(model, optimizer, step: int) -> dict:
    """What a restored rank (or process) holds: parameters and buffers, optimizer state by parameter name,
    the linears' and each block's attention random streams."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fp4lab.nn.build import fp4_linears
    from fp4lab.train import checkpoint

    model_state, optimizer_state = get_state_dict(model, list(optimizer.optimizers.values()))
    return {
        "step": step, "model": {k: v for k, v in model_state.items() if not k.endswith("_extra_state")},
        "optimizer": optimizer_state["state"],
        "linears": {name: linear.get_extra_state() for name, linear in fp4_linears(model).items()},
        "attention": {i: g.get_state() for i, g in checkpoint._generators_by_block(model).items()},
    }


def _restored(rank: int, world: int, out_dir: str) -> dict:
    from fp4lab.train import checkpoint, distributed

    config = small(Path(out_dir).parent, Path(out_dir).name, recipe=EVERYTHING, parallel="pp")
    model, optimizer, pp = build(config, rank, world, DEFAULT_SYNTHETIC_VOCAB)
    state = checkpoint.resume_run(Path(out_dir), config, model, optimizer, distributed.Ranks(rank, world, rank, world, "pp"),
                         pp.whole_optimizer_order)
    return loaded_state(model, optimizer, state.step)


def in_one_process(config: TrainConfig) -> dict:
    """The folder's checkpoint restored in one process (tests/train/test_resume_world_size.py checks that path
    bit for bit against what was saved)."""
    from fp4lab.train import checkpoint, distributed

    one = TrainConfig.from_dict(config.to_dict() | {"parallel": "none"})
    model, optimizer, _ = build(one, vocab=DEFAULT_SYNTHETIC_VOCAB)
    return loaded_state(model, optimizer, checkpoint.resume_run(Path(one.out_dir), one, model, optimizer, distributed.Ranks()).step)


def assert_stages_hold_the_whole(stages: list[dict], whole: dict) -> None:
    """The stages' states, together, are the one process's, bit for bit, each entry on one stage."""
    assert all(stage["step"] == whole["step"] == 2 for stage in stages)
    for part in ("model", "optimizer", "linears", "attention"):
        assert not stages[0][part].keys() & stages[1][part].keys(), part
        merged = stages[0][part] | stages[1][part]
        assert merged.keys() == whole[part].keys(), part
        for key, value in merged.items():
            expected = whole[part][key]
            if part == "linears":
                assert json.dumps(value, default=repr) == json.dumps(expected, default=repr), key
            elif isinstance(value, dict):
                assert value.keys() == expected.keys() and all(torch.equal(value[k], expected[k]) for k in value), key
            else:
                assert torch.equal(value, expected), key
    assert whole["attention"] and any("momentum_buffer" in v for v in whole["optimizer"].values())


@pytest.mark.slow
def test_a_pp_checkpoint_resumes_in_one_process_with_the_same_state(tmp_path):
    config = small(tmp_path, "run", recipe=EVERYTHING, parallel="pp")
    run_two_ranks(config, stop_after_on_rank_1=2)
    # What the pp ranks continue from (exactly: test_a_stop_on_one_rank_...) is what one process gets.
    assert_stages_hold_the_whole(run_gloo(_restored, config.out_dir), in_one_process(config))


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["none", "ddp"])
def test_a_one_process_or_ddp_checkpoint_resumes_on_pp_ranks_with_the_same_state(tmp_path, parallel):
    config = small(tmp_path, "run", recipe=EVERYTHING, parallel=parallel)
    if parallel == "none":
        run(config, progress=False, stop_after=2)
    else:
        run_two_ranks(config, stop_after_on_rank_1=2)
    assert_stages_hold_the_whole(run_gloo(_restored, config.out_dir), in_one_process(config))


@pytest.mark.slow
def test_a_one_process_run_continued_on_pp_ranks_trains_the_uninterrupted_curve(tmp_path):
    rtn = {"recipe": "mxfp4", "optimizer": "adamw", "adam_lr": 3e-3}
    whole = small(tmp_path, "whole", **rtn)
    run(whole, progress=False)
    moved = small(tmp_path, "moved", **rtn)
    run(moved, progress=False, stop_after=2)
    run_two_ranks(TrainConfig.from_dict(moved.to_dict() | {"parallel": "pp"}))
    assert_same_curve(metrics(whole), metrics(moved))
    out = Path(moved.out_dir)
    assert (out / "checkpoint.dcp").exists() and not (out / "checkpoint.pt").exists()


# --- refusals --------------------------------------------------------------------------------------


def test_what_pp_cannot_train_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(key, value)
    refused = [
        ({"capture_steps": [1], "capture_layers": ["layers.0.attention.wq"]}, "capture_steps is not supported with parallel='pp'"),
        ({"cuda_graphs": "on"}, "cuda_graphs='on' is not supported with parallel='pp' (the pipeline's sends"),
        ({"pp_microbatches": 2, "batch_size": 4}, "pp_microbatches=2 is fewer than the 4 pipeline stages of ScheduleDualPipeV on 2 ranks"),
    ]
    for overrides, message in refused:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
            run(small(tmp_path, "refused", parallel="pp", **overrides))
        assert "\n" not in str(error.value)
    for values, message in [
        ({"parallel": "pp", "gather_weights": "encoded"}, "gather_weights='encoded' changes FSDP2's all-gathers; parallel='pp' has none"),
        ({"parallel": "pp", "batch_size": 6}, "batch_size=6 does not split into pp_microbatches=4"),
        ({"parallel": "none", "pp_microbatches": 8}, "pp_microbatches=8 cuts the batch for pipeline stages; parallel='none' has none"),
    ]:
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**values)
    assert not (tmp_path / "refused").exists()


def _refused_resume(rank: int, world: int, out_dir: str) -> str:
    from fp4lab.train import checkpoint, distributed

    config = small(Path(out_dir).parent, Path(out_dir).name, parallel="pp")
    model, optimizer, _ = build(config, rank, world, DEFAULT_SYNTHETIC_VOCAB)
    try:
        checkpoint.resume_run(Path(out_dir), config, model, optimizer, distributed.Ranks(rank, world, rank, world, "pp"))
    except ConfigError as error:
        return str(error)
    return "resumed"


@pytest.mark.slow
def test_a_pp_checkpoint_is_refused_on_another_number_of_pp_ranks(tmp_path):
    config = small(tmp_path, "run", parallel="pp")
    run_two_ranks(config, stop_after_on_rank_1=1)
    (message,) = run_gloo(_refused_resume, config.out_dir, world_size=1)
    assert "was written by 2 pp ranks; a pp run resumes it on as many" in message and "\n" not in message


def test_pp_microbatches_flag_reaches_the_config(run_cli, tmp_path):
    result = run_cli("train", "--pp-microbatches", "2", "--data", "synthetic", "--out", str(tmp_path / "run"))
    assert result.returncode == 2 and "pp_microbatches=2 cuts the batch for pipeline stages" in result.stderr
    assert not (tmp_path / "run").exists()
