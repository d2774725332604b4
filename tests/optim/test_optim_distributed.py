"""The optimizers and logit clipping on FSDP2-sharded parameters, on 2 real gloo ranks (CPU).

A small Llama-shaped model (torchtitan's parameter names, so build_optimizer routes it as it routes
fp4lab's Llama) is `fully_shard`-ed per block and at the root: every parameter becomes a DTensor cut
along dim 0, some unevenly (67 rows: 34 + 33), and the attention heads' rows straddle the two shards.
Both ranks set the same known full gradients (their shards), step, and gather the parameters; the
test runs the same steps on the whole tensors in this process. One scenario runs on an HSDP mesh
(replicate x shard, 1 x 2). One spawn runs every scenario, each
test checks its own.

Bit-exact: Muon (bf16 and NVFP4 Newton-Schulz, batched), AdamW (fp32 and NVFP4 v) and QK-Clip, whose
sharded math is the unsharded math element for element. Not bit-exact, by a stated tolerance: the
update cap and gradient clipping, whose norms are sums of squares in a different order (sharded:
each shard's partial sum, then the sum of those).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fp4lab.optim import OptimizerConfig, all_reduce_max_logits_, build_optimizer, qk_clip_
from fp4lab.optim.sharding import clip_grad_norm_
from tests.distributed_helpers import gloo_unavailable, rank_threads, run_gloo

pytestmark = [pytest.mark.slow, pytest.mark.skipif(gloo_unavailable() is not None, reason=str(gloo_unavailable()))]


@pytest.fixture(autouse=True)
def _as_a_rank():
    """The references below run on a rank's threads: the same arithmetic as the ranks', so bits can match."""
    with rank_threads():
        yield

DIM, N_HEADS, N_KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 64, 3, 1, 16, 96, 67
STEPS = 3
TAU = 10.0
# Per-rank max logits [n_heads]: each head's maximum is on a different rank (or both, head 2).
RANK_LOGITS = ([30.0, 5.0, 12.0], [8.0, 40.0, 12.0])
SCENARIOS = {
    "muon-bf16": {"name": "muon"},
    "muon-nvfp4": {"name": "muon", "ns_format": "nvfp4", "adam_v_format": "nvfp4"},
    "muon-batched": {"name": "muon", "fused": True, "adam_v_format": "nvfp4"},
    "adamw-fp32": {"name": "adamw"},
    "adamw-nvfp4": {"name": "adamw", "adam_v_format": "nvfp4"},
    # Caps small enough to bind on every matrix, so each factor depends on the global norms.
    "update-cap": {"name": "muon", "update_cap": (0.002, 0.001)},
}
# HSDP: a 2D mesh (replicate x shard), here 1 x 2, so the placements are (Replicate(), Shard(0)).
HSDP_SCENARIOS = {"hsdp-muon-nvfp4": SCENARIOS["muon-nvfp4"]}
# float64 norms summed in another order differ in the last ulps; the factor they give moves a float32
# weight by at most about one float32 ulp.
NORM_RTOL = 1e-6


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq = nn.Linear(DIM, N_HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, N_KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(N_HEADS * HEAD_DIM, DIM, bias=False)


class _FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = _Attention()
        self.feed_forward = _FeedForward()
        self.attention_norm = nn.RMSNorm(DIM)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([_Block(), _Block()])
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        with torch.no_grad():  # norm gains other than 1, so their AdamW update is not trivial
            for module in (self.norm, *(b.attention_norm for b in self.layers)):
                module.weight.uniform_(0.5, 1.5)


def _full_grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) for p in model.parameters()]  # a DTensor's shape is global


def _sharded(world_size: int, hsdp: bool = False, replicas: int = 1):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard") if hsdp else None
    mesh = init_device_mesh("cpu", (replicas, world_size // replicas) if hsdp else (world_size,), mesh_dim_names=names)
    model = _Tiny()
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def _set_grads(model: nn.Module, grads: list[torch.Tensor], mesh) -> None:
    from torch.distributed.tensor import distribute_tensor

    for p, g in zip(model.parameters(), grads):
        p.grad = distribute_tensor(g, mesh, p.placements, src_data_rank=None) if mesh is not None else g


def _steps(model: nn.Module, kwargs: dict, mesh) -> None:
    optimizer = build_optimizer(model.named_parameters(), OptimizerConfig(**kwargs))
    for step in range(STEPS):
        _set_grads(model, _full_grads(model, step), mesh)
        optimizer.step()
        optimizer.zero_grad()


def _whole(model: nn.Module) -> dict[str, torch.Tensor]:
    params = model.named_parameters()
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone() for n, p in params}


def _clip(model: nn.Module, rank: int) -> torch.Tensor:
    attention = model.layers[0].attention
    logits = all_reduce_max_logits_(torch.tensor(RANK_LOGITS[rank]))
    return qk_clip_(attention.wq.weight, attention.wk.weight, logits, TAU, N_HEADS, N_KV_HEADS, HEAD_DIM)


def _resumed(world_size: int, checkpoint_dir: str) -> tuple[dict, dict]:
    """The last of STEPS steps run straight on, and after a distributed checkpoint of the sharded
    optimizer state (get_optimizer_state_dict, dcp.save, a fresh model and optimizer, dcp.load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    config = OptimizerConfig(**SCENARIOS["muon-nvfp4"])
    model, mesh = _sharded(world_size)
    optimizer = build_optimizer(model.named_parameters(), config)
    for step in range(STEPS - 1):
        _set_grads(model, _full_grads(model, step), mesh)
        optimizer.step()
        optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model, list(optimizer.optimizers.values()))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=checkpoint_dir)
    resumed, _ = _sharded(world_size)
    resumed_optimizer = build_optimizer(resumed.named_parameters(), config)
    model_state, optim_state = get_state_dict(resumed, list(resumed_optimizer.optimizers.values()))
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=checkpoint_dir)
    optimizers = list(resumed_optimizer.optimizers.values())
    set_state_dict(resumed, optimizers, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for m, opt in ((model, optimizer), (resumed, resumed_optimizer)):
        _set_grads(m, _full_grads(m, STEPS - 1), mesh)
        opt.step()
    return _whole(model), _whole(resumed)


def _rank(rank: int, world_size: int, checkpoint_dir: str) -> dict:
    out = {"resumed": _resumed(world_size, checkpoint_dir)}
    for name, kwargs in SCENARIOS.items():
        model, mesh = _sharded(world_size)
        _steps(model, kwargs, mesh)
        out[name] = _whole(model)
    for name, kwargs in HSDP_SCENARIOS.items():
        model, mesh = _sharded(world_size, hsdp=True)
        _steps(model, kwargs, mesh)
        out[name] = _whole(model)
    model, mesh = _sharded(world_size)
    out["qk-clip-gamma"] = _clip(model, rank)
    out["qk-clip"] = _whole(model)
    replica = _Tiny()  # DDP's view: every rank holds the whole weights
    out["qk-clip-replica"] = (_clip(replica, rank), _whole(replica))
    for name, layout in {"grad-clip": {}, "grad-clip-replicas": {"hsdp": True, "replicas": world_size}}.items():
        model, mesh = _sharded(world_size, **layout)  # replicas: HSDP whose every rank holds every row
        _set_grads(model, _full_grads(model, 0), mesh)
        norm = clip_grad_norm_(model.parameters(), 1.0)
        out[name] = (norm, {n: p.grad.full_tensor() for n, p in model.named_parameters()})
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return run_gloo(_rank, str(tmp_path_factory.mktemp("dcp")), world_size=2)


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], **tolerance) -> None:
    assert got.keys() == want.keys()
    for name, expected in want.items():
        if tolerance:
            torch.testing.assert_close(got[name], expected, **tolerance, msg=lambda m, n=name: f"{n}: {m}")
        else:
            assert torch.equal(got[name], expected), f"{name}: max diff {(got[name] - expected).abs().max()}"


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "update-cap"] + list(HSDP_SCENARIOS))
def test_sharded_step_is_bit_identical_to_unsharded(ranks, scenario):
    reference = _Tiny()
    before = _whole(reference)
    _steps(reference, (SCENARIOS | HSDP_SCENARIOS)[scenario], None)
    want = _whole(reference)
    assert all(not torch.equal(want[n], before[n]) for n in want)  # every parameter moved
    for r in ranks:
        _assert_same(r[scenario], want)


def test_update_cap_uses_global_norms(ranks):
    reference, capless = _Tiny(), _Tiny()
    _steps(reference, SCENARIOS["update-cap"], None)
    _steps(capless, {"name": "muon"}, None)
    want, free = _whole(reference), _whole(capless)
    hidden = [n for n in want if n.startswith("layers.") and want[n].ndim == 2]
    assert all(not torch.allclose(want[n], free[n], rtol=0, atol=1e-5) for n in hidden)  # the cap binds
    for r in ranks:
        _assert_same(r["update-cap"], want, rtol=NORM_RTOL, atol=0.0)


def test_qk_clip_uses_the_global_max_logits_on_sharded_weights(ranks):
    reference = _Tiny()
    global_max = torch.tensor(RANK_LOGITS).amax(dim=0)
    attention = reference.layers[0].attention
    gamma = qk_clip_(attention.wq.weight, attention.wk.weight, global_max, TAU, N_HEADS, N_KV_HEADS, HEAD_DIM)
    assert (gamma < 1).all()
    want = _whole(reference)
    for r in ranks:
        assert torch.equal(r["qk-clip-gamma"], gamma)
        _assert_same(r["qk-clip"], want)
        replica_gamma, replica = r["qk-clip-replica"]
        assert torch.equal(replica_gamma, gamma)
        _assert_same(replica, want)


def test_clip_grad_norm_over_sharded_grads_is_the_global_norm(ranks):
    reference = _Tiny()
    _set_grads(reference, _full_grads(reference, 0), None)
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert norm > 1.0  # so the gradients are scaled, by the global norm
    for r in ranks:
        for layout in ("grad-clip", "grad-clip-replicas"):  # shard norms summed over shards, not over replicas
            got_norm, grads = r[layout]
            torch.testing.assert_close(got_norm, norm, rtol=NORM_RTOL, atol=0.0)
            _assert_same(grads, {n: p.grad for n, p in reference.named_parameters()}, rtol=NORM_RTOL, atol=0.0)


def test_sharded_optimizer_state_resumes_bit_for_bit_from_a_distributed_checkpoint(ranks):
    reference = _Tiny()
    _steps(reference, SCENARIOS["muon-nvfp4"], None)
    want = _whole(reference)
    for r in ranks:
        straight, resumed = r["resumed"]
        _assert_same(straight, want)
        _assert_same(resumed, want)
