"""`fp4lab export --format hf` (fp4lab.train.export): transformers loads what it writes, and runs the
model as fp4lab's decoder runs the same master weights.

The logits are compared in fp32 on the same tokens. Both sides compute the same function with the
same fp32 operations but not in the same order (GEMM blocking, SDPA with repeat_kv against enable_gqa,
HF's RMSNorm written out against torch's), so they agree to a bound, not bit for bit; `logits_bound`
derives it. A layout error (RoPE pairs, a swapped projection, a norm's eps) moves the logits by orders
of magnitude more: `test_without_the_rotary_permutation_the_logits_move` measures it for the RoPE pairs.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fp4lab.nn.attention import apply_rope, rope_tables
from fp4lab.nn.model import Llama
from fp4lab.nn.model_config import ModelConfig
from fp4lab.train import data
from fp4lab.train.checkpoint import saved_model
from fp4lab.train.config import DataConfig, TrainConfig
from fp4lab.train.export import LLAMA_KEYS, ExportError, export_hf, hf_name, rotate_half_rows
from fp4lab.train.loop import run

transformers = pytest.importorskip("transformers")

FP32_UNIT_ROUNDOFF = 2.0**-24
SHAKESPEARE_VOCAB = 320


def train(folder: Path, recipe: str, source: str, steps: int, **overrides) -> Path:
    """A run folder of the tiny model trained `steps` steps on the CPU (seconds)."""
    values = dict(recipe=recipe, data=DataConfig(source=source), seq_len=64, batch_size=4, steps=steps,
                  warmup_steps=2, eval_every=steps, eval_batches=1, probe_every=steps, checkpoint_every=steps,
                  out_dir=str(folder), device="cpu")  # fmt: skip
    run(TrainConfig(**(values | overrides)), progress=False)
    return folder


@pytest.fixture(scope="module")
def one_play_corpus(tmp_path_factory):
    """The Shakespeare corpus shrunk to one play in a fresh cache, so its BPE builds in a second; held
    for the module, since the export loads the run's tokenizer from the same cache."""
    plays = data.shakespeare_plays()[:1]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FP4LAB_CACHE", str(tmp_path_factory.mktemp("cache")))
        patch.setattr(data, "shakespeare_plays", lambda: plays)
        yield data.load_dataset(DataConfig(vocab_size=SHAKESPEARE_VOCAB))


@pytest.fixture(scope="module")
def bf16_run(tmp_path_factory, one_play_corpus, one_thread):
    """30 steps: attention that has learnt something, so where RoPE puts each pair matters (2 s)."""
    folder = tmp_path_factory.mktemp("runs") / "bf16"
    return train(folder, "bf16", "shakespeare", 30, data=DataConfig(source="shakespeare", vocab_size=SHAKESPEARE_VOCAB))


@pytest.fixture(scope="module")
def fullstack_run(tmp_path_factory, one_thread):
    """An FP4 recipe with LoRA-SVD factors (rank 8) in its linears, 3 steps (2 s)."""
    return train(tmp_path_factory.mktemp("runs") / "fullstack", "fullstack", "synthetic", 3, batch_size=2)


def fp4lab_fp32_model(folder: Path) -> Llama:
    """fp4lab's decoder holding the run's master weights, unquantized: nn.Linear GEMMs and the embedding
    in fp32 (the recipe's rounding is what the export leaves out)."""
    identity = json.loads((folder / "config.json").read_text())
    model = Llama(ModelConfig(**identity["model"]), embedding_dtype=torch.float32)
    state, _, _ = saved_model(folder)
    model.load_state_dict({k: v for k, v in state.items() if not k.endswith(("lora_u", "lora_v"))})
    return model.eval()


def hf_model(out: Path, dtype: torch.dtype = torch.float32):
    return transformers.LlamaForCausalLM.from_pretrained(out, dtype=dtype).eval()


def sample_tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(vocab, (2, 64), generator=torch.Generator().manual_seed(seed))


def logits_bound(config: ModelConfig) -> float:
    """The largest |difference| of the two fp32 forwards, relative to max |logit|.

    One dot product of length K summed in another order differs by about sqrt(K) u relative to its
    size (u = 2^-24, rounding errors adding as a random walk). Along the path to the logits each block
    has about 12 such stages (2 RMSNorms, the q/k/v projections, RoPE, the scores over head_dim, the
    softmax, PV over the sequence, wo, w1/w3, SiLU * up, w2, 2 residual adds), then the final norm and
    the head. Adding the stages' errors linearly (all aligned: the worst case of that model), with K the
    longest contraction (ffn_hidden for w2), bounds the relative difference of the logits. For the tiny
    model: 50 stages x sqrt(384) x 2^-24 = 5.8e-5; measured 4.4e-7 (the bf16 run) and 3.8e-7 (fullstack).
    """
    stages = 12 * config.n_layers + 2
    longest = max(config.dim, config.ffn_hidden, config.head_dim, config.max_seq_len)
    return stages * math.sqrt(longest) * FP32_UNIT_ROUNDOFF


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def exported(run_folder: Path, tmp_path: Path, **options) -> Path:
    out = tmp_path / "hf"
    export_hf(run_folder, out, **options)
    return out


# --- the layout ----------------------------------------------------------------------------------


def test_every_model_config_field_has_its_llama_config_key():
    # A field added to ModelConfig (a decoder feature) must be mapped or refused on purpose: until it is
    # in LLAMA_KEYS, export refuses every run that has it.
    assert set(LLAMA_KEYS) == {f.name for f in fields(ModelConfig)}


def test_rotate_half_rows_turns_fp4lab_rope_into_hf_rope():
    """HF's RoPE of x @ rotate_half_rows(W).T is fp4lab's RoPE of x @ W.T with each head's rows in the
    same order: the same products c*x - s*y of the same angles, so the same bits; q.k is unchanged."""
    from transformers.models.llama.modeling_llama import LlamaConfig, LlamaRotaryEmbedding, apply_rotary_pos_emb

    heads, head_dim, dim, seq = 4, 32, 128, 48
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, seq, dim, generator=generator), torch.randn(heads * head_dim, dim, generator=generator)
    cos, sin = rope_tables(head_dim, seq, 10000.0)
    ours = apply_rope((x @ w.T).view(2, seq, heads, head_dim), cos, sin).transpose(1, 2)  # [b, h, s, d]

    config = LlamaConfig(hidden_size=dim, num_attention_heads=heads, head_dim=head_dim, max_position_embeddings=seq)
    positions = torch.arange(seq)[None].expand(2, seq)
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(x, positions)

    def hf_rope(weight: torch.Tensor) -> torch.Tensor:
        q = (x @ weight.T).view(2, seq, heads, head_dim).transpose(1, 2)
        return apply_rotary_pos_emb(q, q, hf_cos, hf_sin)[0]

    theirs = hf_rope(rotate_half_rows(w, heads))
    halves = ours.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # (2i, 2i+1) -> (i, i + d/2)
    assert torch.equal(theirs, halves)
    assert torch.equal(theirs @ theirs.transpose(-1, -2), halves @ halves.transpose(-1, -2))
    # Unpermuted, HF rotates other pairs by other angles: the scores change.
    unpermuted = hf_rope(w)
    assert not torch.allclose(unpermuted @ unpermuted.transpose(-1, -2), ours @ ours.transpose(-1, -2), rtol=1e-2)


# --- loading and logits ---------------------------------------------------------------------------


def test_transformers_loads_the_export_and_its_logits_match_fp4lab(bf16_run, tmp_path):
    out = exported(bf16_run, tmp_path)
    model = hf_model(out)
    reference = fp4lab_fp32_model(bf16_run)
    tokens = sample_tokens(SHAKESPEARE_VOCAB)
    with torch.no_grad():
        ours, theirs = reference(tokens), model(tokens).logits
    assert theirs.dtype == torch.float32 and theirs.shape == ours.shape
    assert relative_difference(ours, theirs) < logits_bound(reference.config)


def test_without_the_rotary_permutation_the_logits_move(bf16_run, tmp_path):
    """Undo the wq / wk permutation in the loaded model: position 0 (no rotation) still agrees, every
    later position is off by far more than the bound (measured 1.9e-2 relative, 320 times the bound)."""
    out = exported(bf16_run, tmp_path)
    model = hf_model(out)
    reference = fp4lab_fp32_model(bf16_run)
    config = reference.config
    state, _, _ = saved_model(bf16_run)
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            layer.self_attn.q_proj.weight.copy_(state[f"layers.{index}.attention.wq.weight"])
            layer.self_attn.k_proj.weight.copy_(state[f"layers.{index}.attention.wk.weight"])
        tokens = sample_tokens(SHAKESPEARE_VOCAB)
        ours, theirs = reference(tokens), model(tokens).logits
    bound = logits_bound(config)
    assert relative_difference(ours[:, :1], theirs[:, :1]) < bound
    assert relative_difference(ours[:, 1:], theirs[:, 1:]) > 20 * bound


def test_the_tokenizer_loads_and_encodes_as_fp4lab_does(bf16_run, one_play_corpus, tmp_path):
    out = exported(bf16_run, tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = one_play_corpus.decode(one_play_corpus.val[:60])
    ids = data.encode(one_play_corpus.tokenizer, text).tolist()
    assert tokenizer(text)["input_ids"] == ids
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == SHAKESPEARE_VOCAB


def test_an_fp4_run_exports_its_master_weights_and_names_its_recipe(fullstack_run, tmp_path):
    out = tmp_path / "hf"
    result = export_hf(fullstack_run, out)
    state, step, _ = saved_model(fullstack_run)
    config = ModelConfig(**json.loads((fullstack_run / "config.json").read_text())["model"])
    written = load_file(out / "model.safetensors")
    factors = [name for name in state if name.endswith("lora_u")]
    assert factors and all(state[name].abs().sum() > 0 for name in factors)  # LoRA-SVD factors in use
    for name, tensor in state.items():
        if name.endswith(("lora_u", "lora_v")):
            continue
        heads = {"attention.wq.weight": config.n_heads, "attention.wk.weight": config.n_kv_heads}
        rotated = next((rotate_half_rows(tensor, n) for suffix, n in heads.items() if name.endswith(suffix)), tensor)
        assert torch.equal(written[hf_name(name)], rotated), name  # W itself, bit for bit: nothing folded in
    assert len(written) == len(state) - 2 * len(factors)
    assert result.recipe == "fullstack" and result.step == step == 3 and result.left_out
    with safe_open(out / "model.safetensors", "pt") as handle:
        metadata = handle.metadata()
    assert metadata["format"] == "pt" and metadata["fp4lab_recipe"] == "fullstack" and metadata["fp4lab_weights"] == "master"
    hf_config = transformers.AutoConfig.from_pretrained(out)
    assert hf_config.fp4lab["recipe"] == "fullstack" and hf_config.fp4lab["step"] == 3
    assert "`fullstack`" in (out / "README.md").read_text()
    assert not (out / "tokenizer.json").exists() and result.tokenizer is None  # synthetic ids
    with torch.no_grad():
        tokens = sample_tokens(config.vocab_size)
        ours, theirs = fp4lab_fp32_model(fullstack_run)(tokens), hf_model(out)(tokens).logits
    assert relative_difference(ours, theirs) < logits_bound(config)


def test_bfloat16_export_rounds_each_master_weight(fullstack_run, tmp_path):
    out = exported(fullstack_run, tmp_path, dtype="bfloat16")
    state, _, _ = saved_model(fullstack_run)
    written = load_file(out / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in written.values())
    assert torch.equal(written["model.layers.0.mlp.down_proj.weight"], state["layers.0.feed_forward.w2.weight"].to(torch.bfloat16))
    assert hf_model(out, torch.bfloat16).config.dtype == torch.bfloat16


def test_a_sharded_checkpoint_exports_the_same_weights(fullstack_run, tmp_path):
    """The run's checkpoint rewritten as a DCP folder by save_run (one gloo rank, as a ddp run saves),
    then exported without a process group: the same tensors as the one-process checkpoint's."""
    import torch.distributed as dist

    from fp4lab.nn.recipe import load_recipe
    from fp4lab.train.build import build_training
    from fp4lab.train.checkpoint import load_checkpoint, resume_run, save_run
    from fp4lab.train.distributed import Ranks

    if not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    folder = tmp_path / "sharded"
    shutil.copytree(fullstack_run, folder)
    config = TrainConfig.from_dict(load_checkpoint(folder / "checkpoint.pt")["config"] | {"out_dir": str(folder)})
    shape = ModelConfig(**json.loads((folder / "config.json").read_text())["model"])
    model, optimizer, _ = build_training(config, load_recipe(config.recipe), shape, torch.device("cpu"))
    state = resume_run(folder, config, model, optimizer, Ranks())
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        save_run(folder, config, model, optimizer, state, Ranks(mode="ddp"))
    finally:
        dist.destroy_process_group()
    assert (folder / "checkpoint.dcp").is_dir() and not (folder / "checkpoint.pt").exists()
    sharded = export_hf(folder, tmp_path / "from-dcp")
    whole = export_hf(fullstack_run, tmp_path / "from-pt")
    assert sharded.checkpoint.name == "step-3" and sharded.step == whole.step == 3
    ours, theirs = load_file(tmp_path / "from-dcp" / "model.safetensors"), load_file(tmp_path / "from-pt" / "model.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


# --- refusals: one line naming the thing, nothing written ------------------------------------------


def _with_model_field(folder: Path) -> None:
    identity = json.loads((folder / "config.json").read_text())
    identity["model"]["qk_norm"] = True
    (folder / "config.json").write_text(json.dumps(identity))


def _with_extra_tensor(folder: Path) -> None:
    checkpoint = torch.load(folder / "checkpoint.pt", weights_only=True)
    checkpoint["model"]["layers.0.attention.q_norm.weight"] = torch.ones(32)
    torch.save(checkpoint, folder / "checkpoint.pt")


def _without_checkpoint(folder: Path) -> None:
    (folder / "checkpoint.pt").unlink()


def _with_other_token_counts(folder: Path) -> None:
    identity = json.loads((folder / "config.json").read_text())
    identity["dataset"]["train_tokens"] += 1
    (folder / "config.json").write_text(json.dumps(identity))


@pytest.mark.parametrize("damage, fragment", [
    (_with_model_field, "the run's model has qk_norm, which HF's LlamaConfig cannot express"),
    (_with_extra_tensor, "the checkpoint holds layers.0.attention.q_norm.weight, which HF's Llama has no place for"),
    (_without_checkpoint, "holds no checkpoint"),
    (_with_other_token_counts, "its tokenizer is not the run's (another tokenizers release?); export without it (--no-tokenizer)"),
], ids=["model-field", "extra-tensor", "no-checkpoint", "other-tokenizer"])  # fmt: skip
def test_what_cannot_be_exported_right_is_refused_and_nothing_is_written(bf16_run, tmp_path, damage, fragment):
    folder = tmp_path / "run"
    shutil.copytree(bf16_run, folder)
    damage(folder)
    with pytest.raises(ExportError) as refused:
        export_hf(folder, tmp_path / "hf")
    assert fragment in str(refused.value) and "\n" not in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_out_must_be_new_or_empty_unless_forced_and_never_holds_the_run(bf16_run, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    with pytest.raises(ExportError, match="is not empty; pass --force"):
        export_hf(bf16_run, out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"]
    export_hf(bf16_run, out, force=True)
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    with pytest.raises(ExportError, match="replacing it would delete the run"):
        export_hf(bf16_run, bf16_run.parent, force=True)
    (tmp_path / "file").write_text("")
    with pytest.raises(ExportError, match="is a file"):
        export_hf(bf16_run, tmp_path / "file", force=True)


def test_a_failed_write_leaves_out_as_it_was(bf16_run, tmp_path, monkeypatch):
    import safetensors.torch

    out = tmp_path / "hf"
    export_hf(bf16_run, out, tokenizer=False)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="disk full"):
        export_hf(bf16_run, out, force=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no staging folder left beside it


def test_a_run_still_being_trained_is_exported_and_said_to_be(fullstack_run, tmp_path):
    import os
    import socket

    from fp4lab.train import run_folder

    with run_folder.hold(fullstack_run):  # as a trainer holds it: the export reads its newest checkpoint
        result = export_hf(fullstack_run, tmp_path / "hf")
    assert result.training == f"{socket.gethostname()}:{os.getpid()}" and result.step == 3
    assert export_hf(fullstack_run, tmp_path / "after").training is None
