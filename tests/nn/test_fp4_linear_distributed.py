"""FP4Linear (reference path) under FSDP2's fully_shard, on 2 real gloo ranks (CPU).

fully_shard all-gathers the weight before the forward, so the autograd function sees the whole W,
and reduce-scatters the fp32 gradient, averaged over the ranks. Each rank keeps its own per-layer
generator (the same seed everywhere), so a rank's forward and backward on its batch draw what an
unsharded copy of the model, fresh from the same seed, draws on that batch: the test compares the
sharded gradient with the mean of those unsharded gradients. The extra state (the generator) must
come through get_model_state_dict / set_model_state_dict and a distributed checkpoint, and LoRA-SVD's
realign_low_rank must decompose the whole weight.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp4lab.nn.fp4_linear import FP4Linear
from fp4lab.nn.recipe import load_recipe
from tests.distributed_helpers import gloo_unavailable, rank_threads, run_gloo

pytestmark = [pytest.mark.slow, pytest.mark.skipif(gloo_unavailable() is not None, reason=str(gloo_unavailable()))]


@pytest.fixture(autouse=True)
def _as_a_rank():
    """The references below run on a rank's threads: the same arithmetic as the ranks', so bits can match."""
    with rank_threads():
        yield

DIM, TOKENS, LORA_RANK = 64, 32, 4
# The mean of two fp32 gradients: FSDP2 may divide before or after the sum (its pre/post-divide
# factors), which can round the last bit differently from (g0 + g1) / 2.
GRAD_RTOL = 1e-6


def _model(lora_rank: int = 0) -> nn.Sequential:
    torch.manual_seed(0)
    recipe = load_recipe("nvfp4").linear  # stochastic rounding on dY: the generators are exercised
    return nn.Sequential(*(FP4Linear(DIM, DIM, recipe, seed=s, lora_rank=lora_rank) for s in (3, 4)))


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(100 + rank))


def _sharded(lora_rank: int = 0) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    model = _model(lora_rank)
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    return model


def _rank(rank: int, world_size: int, checkpoint_dir: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    out = {}
    model = _sharded()
    model(_batch(rank)).square().mean().backward()
    out["grads"] = [layer.weight.grad.full_tensor() for layer in model]
    out["generators"] = [layer.generator_for(torch.device("cpu")).get_state() for layer in model]
    dcp.save(get_model_state_dict(model), checkpoint_id=checkpoint_dir)
    restored = _sharded()
    state = get_model_state_dict(restored)
    dcp.load(state, checkpoint_id=checkpoint_dir)
    set_model_state_dict(restored, state)
    out["restored_generators"] = [layer._generator.get_state() for layer in restored]

    lora = _sharded(LORA_RANK)
    for layer in lora:
        layer.realign_low_rank()
    out["lora_factors"] = [(layer.lora_u.clone(), layer.lora_v.clone()) for layer in lora]
    lora(_batch(rank)).square().mean().backward()
    out["lora_grads"] = [layer.weight.grad.full_tensor() for layer in lora]
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_gloo(_rank, str(tmp_path_factory.mktemp("dcp")), world_size=2)


def _unsharded_mean_grads(lora_rank: int = 0) -> list[torch.Tensor]:
    grads = []
    for rank in range(2):
        model = _model(lora_rank)
        for layer in model:
            if lora_rank:
                layer.realign_low_rank()
        model(_batch(rank)).square().mean().backward()
        grads.append([layer.weight.grad for layer in model])
    return [(g0 + g1) / 2 for g0, g1 in zip(*grads)]


def test_sharded_forward_backward_matches_the_unsharded_mean_gradient(ranks):
    want = _unsharded_mean_grads()
    for r in ranks:
        for got, expected in zip(r["grads"], want):
            torch.testing.assert_close(got, expected, rtol=GRAD_RTOL, atol=0.0)


def test_generator_state_survives_a_distributed_checkpoint(ranks):
    fresh = torch.Generator().manual_seed(3).get_state()
    for r in ranks:
        assert not torch.equal(r["generators"][0], fresh)  # the forward drew from it
        for saved, restored in zip(r["generators"], r["restored_generators"]):
            assert torch.equal(saved, restored)


def test_lora_svd_realigns_from_the_whole_weight_under_fsdp(ranks):
    reference = _model(LORA_RANK)
    for layer in reference:
        layer.realign_low_rank()
    want = _unsharded_mean_grads(LORA_RANK)
    for r in ranks:
        for (u, v), layer in zip(r["lora_factors"], reference):
            assert torch.equal(u, layer.lora_u)
            assert torch.equal(v, layer.lora_v)
        for got, expected in zip(r["lora_grads"], want):
            torch.testing.assert_close(got, expected, rtol=GRAD_RTOL, atol=0.0)
