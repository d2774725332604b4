"""The Llama decoder: config validation, presets and parameter counts, names, make_linear, causality,
initialisation, BF16 embeddings, overfitting a batch, and the attention toggles through the model."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from fp4lab.nn.attention import AttentionQuant
from fp4lab.nn.model import Llama
from fp4lab.nn.model_config import PRESETS, ModelConfig, count_parameters, preset, swiglu_hidden, tiny

VOCAB, SEQ = 64, 32
# Parameters at vocab 32000 (untied embedding and head), as the preset table in fp4lab/nn/model.py states.
PRESET_PARAMETERS_AT_32K = {"tiny": 8_979_584, "125m": 124_668_672, "350m": 336_118_784, "1b": 1_104_218_112}


def small_config(**overrides) -> ModelConfig:
    fields = {
        "dim": 64,
        "n_layers": 2,
        "n_heads": 2,
        "n_kv_heads": 1,
        "vocab_size": VOCAB,
        "ffn_hidden": 96,
        "max_seq_len": SEQ,
    }
    return ModelConfig(**(fields | overrides))


def small_model(seed=0, **kwargs) -> Llama:
    torch.manual_seed(seed)
    return Llama(small_config(), **kwargs)


def random_tokens(batch=2, seq=SEQ, seed=0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# --- config and presets -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"dim": 96, "n_heads": 5}, "dim"),
        ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads"),
        ({"dim": 64, "n_heads": 4}, "n_heads"),  # head_dim 16: not a whole mxfp4 block
        ({"ffn_hidden": 100}, "ffn_hidden"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"n_layers": 2.0}, "n_layers"),
        ({"norm_eps": 0.0}, "norm_eps"),
    ],
)
def test_config_rejects_bad_shapes_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}"):
        small_config(**overrides)


def test_head_dim_error_tells_the_user_why():
    with pytest.raises(ValueError, match="multiple of 32 so FP4 blocks"):
        small_config(dim=64, n_heads=4)


def test_swiglu_hidden_follows_llama_rounding():
    assert swiglu_hidden(4096) == 11008  # Llama 2 7B
    assert swiglu_hidden(2048, multiplier=1.5) == 8192  # Llama 3.2 1B
    assert swiglu_hidden(128, multiple_of=64) == 384


@pytest.mark.parametrize("name", list(PRESETS))
def test_presets_validate_and_count_parameters_exactly(name):
    config = preset(name, vocab_size=32000, seq_len=256)
    assert config.max_seq_len == 256 and config.n_kv_heads < config.n_heads  # GQA everywhere
    with torch.device("meta"):  # shapes without memory, so the 1b preset costs nothing
        model = Llama(config)
    instantiated = sum(p.numel() for p in model.parameters())
    assert count_parameters(config) == instantiated == PRESET_PARAMETERS_AT_32K[name]


def test_count_parameters_matches_a_real_tiny_model():
    config = tiny(vocab_size=VOCAB, seq_len=128)
    assert (config.dim, config.n_layers, config.n_heads, config.n_kv_heads, config.head_dim) == (128, 4, 4, 2, 32)
    assert count_parameters(config) == sum(p.numel() for p in Llama(config).parameters())


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="'tiny', '125m', '350m', '1b'"):
        preset("7b", 32000, 256)


# --- structure ----------------------------------------------------------------------------------


def test_parameter_names_and_shapes_follow_torchtitan():
    config = small_config()
    dim, kv_dim, hidden = config.dim, config.n_kv_heads * config.head_dim, config.ffn_hidden
    expected = {"tok_embeddings.weight": (VOCAB, dim), "norm.weight": (dim,), "output.weight": (VOCAB, dim)}
    for i in range(config.n_layers):
        expected |= {
            f"layers.{i}.attention.wq.weight": (dim, dim),
            f"layers.{i}.attention.wk.weight": (kv_dim, dim),
            f"layers.{i}.attention.wv.weight": (kv_dim, dim),
            f"layers.{i}.attention.wo.weight": (dim, dim),
            f"layers.{i}.feed_forward.w1.weight": (hidden, dim),
            f"layers.{i}.feed_forward.w2.weight": (dim, hidden),
            f"layers.{i}.feed_forward.w3.weight": (hidden, dim),
            f"layers.{i}.attention_norm.weight": (dim,),
            f"layers.{i}.ffn_norm.weight": (dim,),
        }
    state = Llama(config).state_dict()  # the RoPE tables are buffers kept out of it
    assert {name: tuple(t.shape) for name, t in state.items()} == expected
    assert all(t.dtype == torch.float32 for t in state.values())


class RecordingLinear(nn.Linear):
    """An nn.Linear that counts its forward calls."""

    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def test_make_linear_builds_every_linear_with_its_block_name_and_shape():
    config = small_config()
    built = {}

    def make_linear(block_index, name, in_features, out_features):
        built[(block_index, name, in_features, out_features)] = RecordingLinear(in_features, out_features)
        return built[(block_index, name, in_features, out_features)]

    model = Llama(config, make_linear=make_linear)
    dim, kv_dim, hidden = config.dim, config.n_kv_heads * config.head_dim, config.ffn_hidden
    per_block = [
        ("attention.wq", dim, dim),
        ("attention.wk", dim, kv_dim),
        ("attention.wv", dim, kv_dim),
        ("attention.wo", dim, dim),
        ("feed_forward.w1", dim, hidden),
        ("feed_forward.w2", hidden, dim),
        ("feed_forward.w3", dim, hidden),
    ]
    expected = {(i, *call) for i in range(config.n_layers) for call in per_block} | {(None, "output", dim, VOCAB)}
    assert set(built) == expected and len(built) == len(expected)
    assert not any(isinstance(m, nn.Linear) and not isinstance(m, RecordingLinear) for m in model.modules())

    model(random_tokens())
    assert all(linear.calls == 1 for linear in built.values())


def test_make_linear_must_return_a_weight_of_shape_out_by_in():
    def transposed(block_index, name, in_features, out_features):
        return nn.Linear(out_features, in_features, bias=False)

    # wq is square, so the first mismatch is wk (64 -> 32).
    with pytest.raises(ValueError, match=r"'attention\.wk', 64, 32\) must return .* shape \(32, 64\), got \(64, 32\)"):
        Llama(small_config(), make_linear=transposed)


# --- behaviour ----------------------------------------------------------------------------------


def test_logits_are_fp32_and_causal():
    model = small_model()
    tokens = random_tokens()
    logits = model(tokens)
    assert logits.shape == (2, SEQ, VOCAB) and logits.dtype == torch.float32

    changed = tokens.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % VOCAB
    changed_logits = model(changed)
    assert torch.equal(logits[:, :20], changed_logits[:, :20])  # the past does not see the future
    assert not torch.allclose(logits[:, 20:], changed_logits[:, 20:])


def test_loss_is_mean_next_token_cross_entropy():
    model = small_model()
    tokens, targets = random_tokens(seed=1), random_tokens(seed=2)
    log_probs = torch.log_softmax(model(tokens), dim=-1)
    expected = -log_probs.gather(-1, targets[..., None]).mean()
    torch.testing.assert_close(model.loss(tokens, targets), expected)


def test_init_is_deterministic_and_scales_the_residual_projections():
    first, second = small_model(seed=3), small_model(seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))

    config = tiny(vocab_size=VOCAB, seq_len=128)
    torch.manual_seed(0)
    block = Llama(config).layers[0]
    residual_std = config.init_std / (2 * config.n_layers) ** 0.5
    assert block.attention.wq.weight.std().item() == pytest.approx(config.init_std, rel=0.05)
    assert block.attention.wo.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert block.feed_forward.w2.weight.std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.equal(block.ffn_norm.weight, torch.ones(config.dim))


def test_bf16_embedding_equals_an_fp32_embedding_with_bf16_rounded_rows():
    bf16, fp32 = small_model(), small_model(embedding_dtype=torch.float32)
    tokens = random_tokens()
    assert not torch.equal(bf16(tokens), fp32(tokens))
    with torch.no_grad():
        fp32.tok_embeddings.weight.copy_(fp32.tok_embeddings.weight.bfloat16().float())
    assert torch.equal(bf16(tokens), fp32(tokens))
    assert bf16.tok_embeddings.weight.dtype == torch.float32  # the master weights stay fp32

    with pytest.raises(ValueError, match="embedding_dtype"):
        small_model(embedding_dtype=torch.float16)


def test_sequence_longer_than_max_seq_len_is_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        small_model()(random_tokens(seq=SEQ + 1))


def test_tiny_model_overfits_a_fixed_batch():
    torch.manual_seed(0)
    model = Llama(tiny(vocab_size=VOCAB, seq_len=SEQ))
    tokens = random_tokens(batch=4, seq=SEQ + 1, seed=5)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    initial = model.loss(inputs, targets).item()
    for _ in range(50):
        optimizer.zero_grad()
        loss = model.loss(inputs, targets)
        loss.backward()
        optimizer.step()
    assert initial == pytest.approx(torch.log(torch.tensor(float(VOCAB))).item(), abs=0.2)
    assert loss.item() < 0.15 * initial, (initial, loss.item())


def test_attention_toggles_reach_every_block_through_the_model():
    model = small_model()
    tokens = random_tokens()
    exact = model(tokens)
    for attention in model.attentions():
        attention.record_max_logits = attention.probe = True
        attention.quant = AttentionQuant("nvfp4", "sr", torch.Generator().manual_seed(0))
    logits = model(tokens)
    logits.sum().backward()
    assert not torch.equal(logits, exact) and torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert all(a.last_max_logits.shape == (2,) and a.last_entropy.shape == (2,) for a in model.attentions())


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        small_config().dim = 128


def test_a_compiled_fp4_loss_keeps_bf16_logits_for_its_backward():
    """An FP4 recipe's eager linears break torch.compile's graph between the head and the cross entropy;
    the loss's graph is then handed the head's bf16 logits and keeps those, not an fp32 copy (half the
    bytes, the same values), as the bf16 recipe's single graph does."""
    from fp4lab.nn.build import build_model
    from fp4lab.nn.recipe import load_recipe

    config = small_config(n_layers=1, vocab_size=80)  # no activation but the logits is 80 wide
    model = build_model(config, load_recipe("nvfp4"), seed=0, tensor_cores=True)
    tokens, targets = random_tokens(seed=1), random_tokens(seed=2)  # ids below VOCAB = 64

    def loss_fn(tokens, targets):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model.loss(tokens, targets)

    loss = torch.compile(loss_fn)(tokens, targets)
    kept, stack, seen = [], [loss.grad_fn], set()
    while stack:  # every tensor the loss's compiled graphs keep for the backward
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            kept += [(t.dtype, tuple(t.shape)) for t in node.saved_tensors]
        stack += [f for f, _ in node.next_functions]
    logits = [dtype for dtype, shape in kept if shape in ((2, SEQ, 80), (2 * SEQ, 80))]
    assert logits == [torch.bfloat16], kept
    assert torch.isfinite(loss) and loss.dtype == torch.float32
