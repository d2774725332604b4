"""Wires: every recipe switch, optimizer hook of the training loop and quantization axis is exercised
by a test that fails when the wire is cut or moved (issue 12; scripts/mutate.py applies the deliberate
breaks and docs/NUMERICS.md, "Mutation checks", lists which test catches each).

The loop tests replay the training loop by hand from its documented order (realign LoRA-SVD factors
every lora_svd_every steps; forward and backward; clip the gradient norm; optimizer step with the
update cap around it; Kimi QK-Clip on the step's own max logits) with an optimizer configured here
from the recipe's keys, and compare the checkpoint the loop writes bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fp4lab.nn.build import build_model, fp4_linears
from fp4lab.nn.model_config import preset
from fp4lab.nn.recipe import load_recipe
from fp4lab.optim.adamw import quantized_v
from fp4lab.optim.build import OptimizerConfig, build_optimizer
from fp4lab.optim.muon import NS_POLYNOMIALS
from fp4lab.optim.qk_clip import qk_clip_
from fp4lab.train.config import TrainConfig
from fp4lab.train.data import BatchSampler, DataConfig, load_dataset
from fp4lab.train.loop import lr_factor, run


def small(tmp_path: Path, name: str = "run", **overrides) -> TrainConfig:
    values = {
        "recipe": "bf16", "data": DataConfig(source="synthetic"), "seq_len": 64, "batch_size": 4, "steps": 3,
        "warmup_steps": 1, "eval_every": 100, "eval_batches": 1, "probe_every": 100, "checkpoint_every": 100,
        "out_dir": str(tmp_path / name),
    }
    return TrainConfig(**(values | overrides))


def reference_training(config: TrainConfig):
    """The loop's documented step order, by hand; returns (model, optimizer, clipped heads per step)."""
    recipe = load_recipe(config.recipe)
    data = load_dataset(config.data)
    model_config = preset(config.model, data.vocab_size, config.seq_len)
    torch.manual_seed(config.seed)
    model = build_model(model_config, recipe, seed=config.seed)
    opt = recipe.optimizer
    qk_clip = config.qk_clip or opt.qk_clip
    tau = config.qk_clip_tau or opt.qk_clip_tau
    optimizer = build_optimizer(model.named_parameters(), OptimizerConfig(
        name=config.optimizer or opt.name or "muon", lr=config.lr, adam_lr=config.adam_lr,
        weight_decay=config.weight_decay, ns_steps=config.ns_steps, lr_scaling=config.lr_scaling,
        ns_coefficients=NS_POLYNOMIALS[config.ns_polynomial or opt.ns_polynomial],
        ns_format=opt.ns_format, adam_v_format=opt.adam_v_format,
        update_cap=(opt.update_cap_alpha, opt.update_cap_alpha_qk) if qk_clip == "update_cap" else None,
    ))
    sampler = BatchSampler(data.train, config.batch_size, config.seq_len, config.seed)
    clipped = []
    for step in range(config.steps):
        if recipe.lora_svd_rank and step % recipe.lora_svd_every == 0:
            for linear in fp4_linears(model).values():
                if linear.lora_rank:
                    linear.realign_low_rank()
        optimizer.set_lr_scale(lr_factor(config, step))
        for attention in model.attentions():
            attention.record_max_logits = True
        x, y = sampler.batch(step)
        model.loss(x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        hits = 0
        if qk_clip == "kimi":
            for attention in model.attentions():
                gammas = qk_clip_(attention.wq.weight, attention.wk.weight, attention.last_max_logits, tau,
                                  attention.n_heads, attention.n_kv_heads, attention.head_dim)
                hits += int((gammas < 1).sum())
                if (gammas < 1).any() and recipe.lora_svd_rank:
                    attention.wq.realign_low_rank()
                    attention.wk.realign_low_rank()
        clipped.append(hits)
    return model, optimizer, clipped


def loop_checkpoint(config: TrainConfig) -> dict:
    summary = run(config, progress=False)
    assert summary["status"] == "completed", summary
    return torch.load(Path(config.out_dir) / "checkpoint.pt", weights_only=False)


def assert_same_model(loop_state: dict, model: torch.nn.Module) -> None:
    reference = model.state_dict()
    tensors = [k for k, v in reference.items() if isinstance(v, torch.Tensor)]
    assert set(tensors) <= set(loop_state)
    differ = [k for k in tensors if not torch.equal(loop_state[k], reference[k])]
    assert not differ, f"the loop's weights differ from the documented step order in {differ[:6]}"


@pytest.mark.parametrize(("recipe", "qk_clip"), [("bf16", "kimi"), ("optitrain", None)])
def test_loop_steps_in_the_documented_order_with_qk_clip_and_update_cap(tmp_path, recipe, qk_clip):
    """bf16 with Kimi QK-Clip at a tau the tiny model exceeds, and optitrain's update cap: the loop's
    weights equal the hand-written loop's bit for bit (the clip on this step's logits, after the step)."""
    config = small(tmp_path, recipe=recipe, qk_clip=qk_clip, qk_clip_tau=0.02 if qk_clip else None)
    model, _, clipped = reference_training(config)
    assert_same_model(loop_checkpoint(config)["model"], model)
    if qk_clip == "kimi":
        assert all(c > 0 for c in clipped), clipped  # the wire is exercised on every step


def test_kimi_qk_clip_in_the_loop_changes_the_weights_and_counts_heads(tmp_path):
    clipped = loop_checkpoint(small(tmp_path, "kimi", qk_clip="kimi", qk_clip_tau=0.02))
    free = loop_checkpoint(small(tmp_path, "none", qk_clip="none"))
    assert clipped["state"]["qk_clip_events"] > 0
    assert free["state"]["qk_clip_events"] == 0
    wq = "layers.0.attention.wq.weight"
    assert clipped["model"][wq].norm() < free["model"][wq].norm()  # rescaled down, not just perturbed


def test_fullstack_loop_refreshes_lora_svd_and_keeps_nvfp4_optimizer_states(tmp_path):
    """fullstack: LoRA-SVD factors refreshed at step 0 (non-zero, W's top directions), Kimi QK-Clip
    re-aligning them, Muon NVFP4 Newton-Schulz and AdamW's NVFP4 v: all as the hand-written loop."""
    config = small(tmp_path, recipe="fullstack", qk_clip="kimi", qk_clip_tau=0.02, steps=2)
    model, _, clipped = reference_training(config)
    checkpoint = loop_checkpoint(config)
    state = checkpoint["model"]
    factors = [k for k in state if k.endswith(("lora_u", "lora_v"))]
    assert factors and all(state[k].abs().sum() > 0 for k in factors)
    assert_same_model(state, model)
    assert sum(clipped) > 0
    adam = checkpoint["optimizer"]["adamw"]
    assert {g["v_format"] for g in adam["param_groups"]} == {"nvfp4"}
    packed = [s for s in adam["state"].values() if "exp_avg_sq" not in s]
    assert packed, "no AdamW state holds v in NVFP4"
    assert {g["ns_format"] for g in checkpoint["optimizer"]["muon"]["param_groups"]} == {"nvfp4"}


def test_lora_svd_refresh_follows_lora_svd_every(tmp_path):
    """Factors equal W's top singular directions as of the last refresh step (every 2 steps here)."""
    recipe = tmp_path / "lora.toml"
    recipe.write_text('extends = "nvfp4-all"\nname = "lora"\n[model]\nlora_svd_rank = 4\nlora_svd_every = 2\n')
    config = small(tmp_path, recipe=str(recipe), steps=3)
    model, _, _ = reference_training(config)
    assert_same_model(loop_checkpoint(config)["model"], model)
    assert model.layers[0].attention.wq.lora_u.abs().sum() > 0


def test_recipe_switches_reach_the_model(tmp_path):
    path = tmp_path / "switches.toml"
    path.write_text(
        'extends = "nvfp4-all"\nname = "switches"\n[model]\nhead = "fp4"\nembedding = "fp32"\nlora_svd_rank = 2\n'
        '[attention]\nformat = "mxfp4"\nds_rounding = "rtn"\n'
    )
    recipe = load_recipe(str(path))
    model = build_model(preset("tiny", 256, 64), recipe, seed=0)
    assert model.embedding_dtype == torch.float32
    assert model.output.recipe == recipe.linear and model.output.lora_rank == 0
    assert all(a.quant is not None and (a.quant.format, a.quant.ds_rounding) == ("mxfp4", "rtn") for a in model.attentions())
    assert model.layers[0].attention.wq.lora_rank == 2
    plain = build_model(preset("tiny", 256, 64), load_recipe("fullstack"), seed=0)
    assert plain.embedding_dtype == torch.bfloat16
    assert plain.output.recipe.fprop_x.format == "bf16"
    assert all((a.quant.format, a.quant.ds_rounding) == ("nvfp4", "sr") for a in plain.attentions())
    assert all(a.quant is None for a in build_model(preset("tiny", 256, 64), load_recipe("nvfp4-all"), seed=0).attentions())
    fp32_head = tmp_path / "fp32_head.toml"
    fp32_head.write_text('extends = "nvfp4-all"\nname = "fp32-head"\n[model]\nhead = "fp32"\n')
    head = build_model(preset("tiny", 256, 64), load_recipe(str(fp32_head)), seed=0).output.recipe
    assert {head.operand(name).format for name in ("fprop_x", "fprop_w", "dgrad_dy", "dgrad_w", "wgrad_dy", "wgrad_x")} == {"fp32"}


def test_nvfp4_optimizer_states_are_stored_packed_and_used():
    """AdamW v_format nvfp4 stores v packed (no fp32 exp_avg_sq) and steps from the decoded v; Muon
    ns_format nvfp4 steps differently from bf16."""
    torch.manual_seed(0)
    params = {"layers.0.attention.wq.weight": torch.randn(32, 32), "tok_embeddings.weight": torch.randn(256, 32)}

    def steps(ns_format: str, v_format: str):
        named = [(n, torch.nn.Parameter(p.clone())) for n, p in params.items()]
        opt = build_optimizer(named, OptimizerConfig(ns_format=ns_format, adam_v_format=v_format, adam_lr=1e-2))
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            for _, p in named:
                p.grad = torch.randn(p.shape, generator=g) * torch.logspace(-3, 1, p.shape[-1])
            opt.step()
        return dict(named), opt

    fp32, _ = steps("bf16", "fp32")
    quant, opt = steps("nvfp4", "nvfp4")
    emb = quant["tok_embeddings.weight"]
    assert quantized_v(emb)
    state = opt.optimizers["adamw"].state[emb]
    assert "exp_avg_sq" not in state and any(t.dtype == torch.uint8 for t in state.values() if isinstance(t, torch.Tensor))
    assert not torch.equal(emb, fp32["tok_embeddings.weight"])
    wq = "layers.0.attention.wq.weight"
    assert not torch.equal(quant[wq], fp32[wq])


# --- per-operand spec keys reach the quantizer ------------------------------------------------------


@pytest.mark.parametrize("kind", ["mxfp4-rceil-adaptive-tile", "nvfp4-cta32"])
def test_fp4_linear_operand_options_reach_the_quantizer(kind):
    """scale_mode, adaptive, tile and cta_tile of a recipe's operand spec: FP4Linear's forward equals
    x and W quantized along K with exactly those options (and differs without them on this input)."""
    from fp4lab.nn.fp4_linear import FP4Linear
    from fp4lab.nn.recipe import LinearRecipe, OperandSpec
    from fp4lab.numerics import fake_quantize

    if kind == "nvfp4-cta32":
        x_opts = w_opts = {"cta_tile": 32}
        x_spec = w_spec = OperandSpec("nvfp4_cta", cta_tile=32)
        fmt, plain = "nvfp4_cta", {}
    else:
        x_opts, w_opts = {"scale_mode": "rceil", "adaptive": True}, {"scale_mode": "rceil", "adaptive": True, "tile": (32, 32)}
        x_spec = OperandSpec("mxfp4", scale_mode="rceil", adaptive=True)
        w_spec = OperandSpec("mxfp4", scale_mode="rceil", adaptive=True, tile=(32, 32))
        fmt, plain = "mxfp4", {"scale_mode": "floor"}
    layer = FP4Linear(64, 64, LinearRecipe(x_spec, w_spec, x_spec, w_spec, x_spec, x_spec), seed=0)
    torch.manual_seed(0)
    x = torch.randn(128, 64) * torch.logspace(-3, 2, 128)[:, None]
    with torch.no_grad():
        layer.weight.mul_(torch.logspace(-2, 1, 64)[:, None])
        out = layer(x)
        expected = fake_quantize(x, fmt, **x_opts) @ fake_quantize(layer.weight, fmt, **w_opts).T
        without = fake_quantize(x, fmt, **plain) @ fake_quantize(layer.weight, fmt, **plain).T
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.equal(out, without)
