"""A run's model as a checkpoint other software loads: `fp4lab export RUN --format hf OUT` writes a
Hugging Face Llama folder (model.safetensors, config.json, README.md, and the run's tokenizer where
fp4lab trained one) that `transformers.LlamaForCausalLM.from_pretrained(OUT)` loads. Writing needs torch
and safetensors only; transformers is only what reads the result.

What is exported are the master weights, the fp32 parameters the optimizer updates, whichever recipe
trained them. What a recipe rounds (FP4 or FP8 GEMM operands, FP4 attention, the embedding output in
BF16) belongs to its training and is not in the export: transformers runs the model as fp4lab's decoder
runs those weights unquantized in fp32 (tests/train/test_export.py compares the logits). config.json
(its "fp4lab" table), the safetensors header and README.md name the recipe.

From fp4lab's decoder (torchtitan's names) to HF's Llama:
- names: tok_embeddings -> model.embed_tokens; layers.i.attention.wq, wk, wv, wo -> model.layers.i.
  self_attn.q_proj, k_proj, v_proj, o_proj; feed_forward.w1, w3, w2 -> mlp.gate_proj, up_proj,
  down_proj; attention_norm, ffn_norm -> input_layernorm, post_attention_layernorm; norm -> model.norm;
  output -> lm_head, untied (fp4lab trains a head of its own).
- RoPE: fp4lab rotates the interleaved pairs (2i, 2i + 1) of each head (Meta's layout, `apply_rope`),
  HF's Llama the halves (i, i + head_dim / 2) (`rotate_half`). Each head's rows of wq and wk are
  reordered so that HF's pair i holds fp4lab's pair i (`rotate_half_rows`, the standard Meta-to-HF
  permutation): q and k come out permuted alike within each head, and q.k, the attention scores, is
  unchanged. wv and wo are not rotated and stay as they are.
- the same on both sides: RMSNorm as weight * x / sqrt(mean(x^2) + eps), the gain multiplying (no
  1 + gain) with the model's eps; RoPE's theta and inverse frequencies theta^(-2i / head_dim); SwiGLU
  with SiLU; no biases; grouped-query attention (query head h reads key-value head h // (n_heads /
  n_kv_heads)); a causal mask and scores scaled by 1 / sqrt(head_dim).
- LoRA-SVD (Full-Stack FP4's `lora_u`, `lora_v` buffers) is not an adapter added to W but a split of
  it: the layer computes U V^T x in BF16 and (W - U V^T) x in FP4, so W already is the whole weight.
  The factors are left out, as are the layers' random streams.

Anything else, a ModelConfig field or a tensor this mapping does not know, is refused (ExportError,
naming it) rather than exported wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from fp4lab.nn.model_config import ModelConfig
from fp4lab.train import run_folder
from fp4lab.train.atomic import replace_folder
from fp4lab.train.checkpoint import saved_model
from fp4lab.train.config import EXPORT_DTYPES, EXPORT_FORMATS, DataConfig
from fp4lab.train.data import TOKENIZED_SOURCES, status_line

DTYPES = dict(zip(EXPORT_DTYPES, (torch.float32, torch.bfloat16), strict=True))
MODEL_FILE = "model.safetensors"
# Each ModelConfig field and the LlamaConfig key that holds it. A field not here (a decoder feature
# added later, such as a QK-norm) makes the export refuse: tests/train/test_export.py checks that this
# names every field of ModelConfig.
LLAMA_KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "ffn_hidden": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "init_std": "initializer_range",
}
BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
OUTER_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
               "output.weight": "lm_head.weight"}  # fmt: skip
# Buffers a checkpoint holds that the exported model does not take: LoRA-SVD's factors of W.
LEFT_OUT = ("lora_u", "lora_v")
# The special token pycode's BPE ends each document with: the exported model's end of sequence.
END_OF_TEXT = "<|endoftext|>"


class ExportError(ValueError):
    """A run that cannot be exported as asked; the message names the place and the fix."""


@dataclass
class Exported:
    """What `export_hf` wrote, for the command's output."""

    out: Path
    run: Path
    recipe: str
    step: int
    checkpoint: Path
    dtype: str
    parameters: int
    files: list[str]
    corpus: str  # the run's dataset, as config.json names it
    tokenizer: str | None  # what it is; None when not asked for, or the corpus is ids without one
    left_out: list[str] = field(default_factory=list)
    format: str = EXPORT_FORMATS[0]
    training: str | None = None  # "<host>:<pid>" of the trainer still writing the run folder

    def to_dict(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else v for k, v in self.__dict__.items()}


def rotate_half_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """wq or wk [n_heads * head_dim, dim] with each head's rows reordered from interleaved pairs
    (2i, 2i + 1) to halves (i, i + head_dim / 2): the rows HF's rotate_half turns together are then
    those fp4lab's apply_rope does, by the same angle."""
    rows, columns = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def export_hf(run: Path, out: Path, *, dtype: str = "float32", force: bool = False, tokenizer: bool = True,
              progress: bool = False) -> Exported:
    """Write the newest checkpoint of run folder `run` into `out` as a Hugging Face Llama (module
    docstring), all at once: `out` gets the whole folder or stays as it was. `out` must be missing or
    empty, or `force` replaces it. `tokenizer`: also the run's BPE, where fp4lab trained one."""
    run, out = Path(run), Path(out)
    if dtype not in DTYPES:
        raise ExportError(f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    _check_out(run, out, force)
    identity = _run_identity(run)
    config = llama_config(identity)
    try:
        model_config = ModelConfig(**identity["model"])
    except (TypeError, ValueError) as exc:
        raise ExportError(f"{run / 'config.json'}: its model does not validate: {exc}") from None
    with status_line(progress) as status:
        status(f"{run}: reading the checkpoint")
        try:
            state, step, source = saved_model(run)
        except FileNotFoundError as exc:
            raise ExportError(f"{exc}: the run has not saved a step yet; train it (fp4lab train) first") from None
        tensors, left_out = hf_tensors(state, model_config, DTYPES[dtype])
        bpe = None
        if tokenizer:
            status(f"{run}: loading the tokenizer of its corpus")
            bpe = run_tokenizer(identity)
        recipe = identity["recipe"]
        provenance = {"recipe": recipe["name"], "recipe_source": recipe.get("source", ""), "run": str(run.resolve()),
                      "step": step, "checkpoint": str(source.resolve()), "weights": "master", "dtype": dtype}  # fmt: skip
        config["torch_dtype"] = config["dtype"] = dtype
        config["eos_token_id"] = None if bpe is None else bpe.token_to_id(END_OF_TEXT)
        config["fp4lab"] = provenance
        status(f"writing {out}")
        files = _write(out, tensors, config, provenance, bpe)
    return Exported(
        out=out, run=run, recipe=recipe["name"], step=step, checkpoint=source, dtype=dtype,
        parameters=sum(t.numel() for t in tensors.values()), files=files, corpus=identity["dataset"]["name"],
        tokenizer=None if bpe is None else f"{identity['dataset']['name']} BPE, {bpe.get_vocab_size()} tokens",
        left_out=left_out, training=run_folder.holder(run),
    )


def _check_out(run: Path, out: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; give a folder to export into")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} is not empty; pass --force to replace it, or give a new folder")
    resolved_run, resolved_out = run.resolve(), out.resolve()
    if resolved_out == resolved_run or resolved_out in resolved_run.parents:
        raise ExportError(f"{out} holds the run folder {run}; replacing it would delete the run: export elsewhere")


def _run_identity(run: Path) -> dict[str, Any]:
    """The run's config.json (train.loop writes it): model shape, recipe, data."""
    if not run.is_dir():
        raise ExportError(f"{run} is not a run folder (runs/<sweep>/<id> or the out_dir of fp4lab train)")
    path = run / "config.json"
    try:
        identity = json.loads(path.read_text())
    except FileNotFoundError:
        raise ExportError(f"{run} has no config.json: not a run folder, or a run that never started") from None
    except (OSError, ValueError) as exc:
        raise ExportError(f"{path}: not readable as JSON ({exc})") from None
    for table, key in (("model", "dim"), ("recipe", "name"), ("config", "data"), ("dataset", "name")):
        if not isinstance(identity, dict) or not isinstance(identity.get(table), dict) or key not in identity[table]:
            raise ExportError(f"{path}: no {table}.{key}; not the config.json fp4lab train writes")
    return identity


def llama_config(identity: dict[str, Any]) -> dict[str, Any]:
    """The LlamaConfig of the run's decoder, as config.json (written without transformers). Both
    spellings of the RoPE base: rope_parameters (transformers 5) and rope_theta (4.x)."""
    model = identity["model"]
    unknown = [name for name in model if name not in LLAMA_KEYS]
    if unknown:
        raise ExportError(
            f"the run's model has {', '.join(unknown)}, which HF's LlamaConfig cannot express; fp4lab export "
            "--format hf does not support this model"
        )
    config: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    config |= {LLAMA_KEYS[name]: value for name, value in model.items()}
    config |= {
        "head_dim": model["dim"] // model["n_heads"], "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "tie_word_embeddings": False, "pretraining_tp": 1, "use_cache": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": model["rope_theta"]},
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }  # fmt: skip
    return config


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """fp4lab's parameter names and shapes for `config` (fp4lab.nn.model.Llama's)."""
    dim, kv_dim, hidden = config.dim, config.n_kv_heads * config.head_dim, config.ffn_hidden
    block = {"attention.wq.weight": (dim, dim), "attention.wk.weight": (kv_dim, dim), "attention.wv.weight": (kv_dim, dim),
             "attention.wo.weight": (dim, dim), "feed_forward.w1.weight": (hidden, dim), "feed_forward.w3.weight": (hidden, dim),
             "feed_forward.w2.weight": (dim, hidden), "attention_norm.weight": (dim,), "ffn_norm.weight": (dim,)}  # fmt: skip
    shapes = {"tok_embeddings.weight": (config.vocab_size, dim), "norm.weight": (dim,), "output.weight": (config.vocab_size, dim)}
    for index in range(config.n_layers):
        shapes |= {f"layers.{index}.{name}": shape for name, shape in block.items()}
    return shapes


def hf_name(name: str) -> str:
    """HF Llama's name of fp4lab parameter `name` (one `_expected_shapes` lists)."""
    if name in OUTER_NAMES:
        return OUTER_NAMES[name]
    _, index, rest = name.split(".", 2)
    return f"model.layers.{index}.{BLOCK_NAMES[rest]}"


def hf_tensors(state: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The checkpoint's model tensors under HF Llama's names, wq and wk rotated (rotate_half_rows), in
    `dtype`; and what was left out, in words. A tensor this mapping does not know, a missing one or one
    of another shape is refused."""
    expected = _expected_shapes(config)
    factors = sorted(name for name in state if name.rsplit(".", 1)[-1] in LEFT_OUT)
    unknown = sorted(set(state) - set(expected) - set(factors))
    if unknown:
        raise ExportError(
            f"the checkpoint holds {unknown[0]}" + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else "")
            + ", which HF's Llama has no place for; fp4lab export --format hf does not support this model"
        )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ExportError(f"the checkpoint lacks {missing[0]} ({len(missing)} missing); it is not this run's model")
    tensors = {}
    for name, shape in expected.items():
        tensor = state[name]
        if tuple(tensor.shape) != shape:
            raise ExportError(f"the checkpoint's {name} is {tuple(tensor.shape)}, not {shape} as config.json's model says")
        if name.endswith("attention.wq.weight"):
            tensor = rotate_half_rows(tensor, config.n_heads)
        elif name.endswith("attention.wk.weight"):
            tensor = rotate_half_rows(tensor, config.n_kv_heads)
        tensors[hf_name(name)] = tensor.to(dtype).contiguous()
    left_out = [f"LoRA-SVD factors of {len(factors) // 2} linears (a split of each weight, which is whole)"] if factors else []
    return tensors, left_out


def run_tokenizer(identity: dict[str, Any]) -> Tokenizer | None:
    """The BPE the run's corpus was encoded with, None for a corpus of ids.
    It is loaded (or built again) from the cache, as training does; a cache that gives other token
    counts than the run saw (another tokenizers release trained another BPE) is refused."""
    from fp4lab.train.data import load_dataset

    data = DataConfig(**identity["config"]["data"])
    if data.source not in TOKENIZED_SOURCES:
        return None
    try:
        dataset = load_dataset(data)
    except (OSError, ValueError) as exc:
        raise ExportError(f"the tokenizer of the run's corpus {data.source!r}: {str(exc).splitlines()[0]}; "
                          "or export without it (--no-tokenizer)") from None
    trained_on = identity.get("dataset", {}).get("train_tokens")
    if trained_on != len(dataset.train):
        raise ExportError(
            f"the {data.source} corpus here has {len(dataset.train)} training tokens, the run's had {trained_on}: its "
            "tokenizer is not the run's (another tokenizers release?); export without it (--no-tokenizer)"
        )
    return dataset.tokenizer


def _write(out: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any], provenance: dict[str, Any],
           bpe: Tokenizer | None) -> list[str]:
    try:
        from safetensors.torch import save_file
    except ModuleNotFoundError:
        raise ExportError("writing safetensors needs the safetensors package: pip install 'fp4lab[hf]'") from None
    # The header's metadata holds strings only; "format": "pt" is what transformers checks.
    metadata = {"format": "pt"} | {f"fp4lab_{key}": str(value) for key, value in provenance.items()}
    files = [MODEL_FILE, "config.json", "README.md"] + (["tokenizer.json", "tokenizer_config.json"] if bpe is not None else [])

    def write(folder: Path) -> None:
        save_file(tensors, folder / MODEL_FILE, metadata=metadata)
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (folder / "README.md").write_text(_model_card(config, provenance, bpe is not None))
        if bpe is not None:
            (folder / "tokenizer.json").write_text(bpe.to_str())
            (folder / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(config, bpe), indent=2) + "\n")

    replace_folder(out, write)
    return files


def _tokenizer_config(config: dict[str, Any], bpe: Tokenizer) -> dict[str, Any]:
    """What AutoTokenizer reads beside tokenizer.json. The generic fast tokenizer class loads
    tokenizer.json as it is. transformers 5.25 does so without it too (so no test here can tell); an
    older one picks LlamaTokenizerFast from config.json's model_type, whose defaults (a BOS token `<s>`)
    are not this BPE's."""
    settings: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                                "model_max_length": config["max_position_embeddings"]}  # fmt: skip
    if bpe.token_to_id(END_OF_TEXT) is not None:
        settings["eos_token"] = END_OF_TEXT
    return settings


def _model_card(config: dict[str, Any], provenance: dict[str, Any], has_tokenizer: bool) -> str:
    source = f" ({provenance['recipe_source']})" if provenance["recipe_source"] else ""
    return (
        f"# fp4lab run {Path(provenance['run']).name}\n\n"
        f"A Llama-style decoder trained by fp4lab with the recipe `{provenance['recipe']}`{source}, exported at step "
        f"{provenance['step']} from `{provenance['run']}`.\n\n"
        f"These are the master weights ({provenance['dtype']}), the full-precision parameters the optimizer updated, not "
        "their quantized form: the recipe's rounding of GEMM operands, attention and embedding is not applied, so "
        "transformers runs the model unquantized.\n\n"
        f"{config['num_hidden_layers']} layers, hidden size {config['hidden_size']}, {config['num_attention_heads']} "
        f"heads ({config['num_key_value_heads']} key-value), vocabulary {config['vocab_size']}, context "
        f"{config['max_position_embeddings']}. "
        + ("The tokenizer is the byte-level BPE fp4lab trained for the corpus.\n" if has_tokenizer
           else "No tokenizer: the run trained on token ids.\n")
        + "\n```python\nfrom transformers import LlamaForCausalLM\nmodel = LlamaForCausalLM.from_pretrained(\"PATH\")\n```\n"
    )
