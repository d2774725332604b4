"""FSDP2 all-gathers of FP4 weights in their GEMMs' encoding (fp4lab.train.encoded_gather).

Encoded gathers are exact or not used: a shard's encoding must be, bit for bit, its rows (columns) of
the whole weight's encoding, and a run gathering encoded must be the run gathering dense, bit for bit
(losses, grad norms, probes, validation, final weights and optimizer state), with the bytes the
formula gives and every all-gather counted, so a silent fall back to dense cannot pass.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fp4lab.nn.fp4_linear import FP4Linear, encode_operand
from fp4lab.nn.recipe import load_recipe
from fp4lab.numerics import Fp8Tensor
from fp4lab.train.config import ConfigError, TrainConfig
from fp4lab.train.encoded_gather import dense_reason, encode_shard, pack, shard_parts, unpack
from tests.train.test_distributed import metrics, run_two_ranks, small

# NVFP4 with 1x16 blocks for every operand and a fixed-sign H16 on Fprop and Dgrad: two encodings per
# weight (along K, along N), each with the all-reduced tensor scale and a transform inside a shard.
NVFP4_1D_H16 = """
name = "nvfp4-1d-h16"
[linear.all]
format = "nvfp4"
[linear.fprop]
transform = "h16"
[linear.dgrad]
transform = "h16"
"""


def _recipe_file(tmp_path: Path) -> Path:
    path = tmp_path / "nvfp4-1d-h16.toml"
    path.write_text(NVFP4_1D_H16)
    return path


def _recipe(name: str, tmp_path: Path):
    return load_recipe(str(_recipe_file(tmp_path)) if name == "nvfp4-1d-h16" else name)


def _layer(recipe_name: str, tmp_path: Path, out_features: int = 64, in_features: int = 128) -> FP4Linear:
    torch.manual_seed(0)
    layer = FP4Linear(in_features, out_features, _recipe(recipe_name, tmp_path).linear, seed=3)
    with torch.no_grad():  # shards of very different magnitude: a shard's own amax is not W's
        layer.weight[: out_features // 2] *= 10
    return layer


def _whole(layer: FP4Linear, name: str):
    """The layer's own encoding of its whole weight, as the dense path quantizes it."""
    gemm = "fprop" if name == "fprop_w" else "dgrad"
    length = layer.in_features if gemm == "fprop" else layer.out_features
    signs = layer.draw_signs(layer.recipe, gemm, layer.generator_for(torch.device("cpu")), length)
    w = layer.weight.detach() if name == "fprop_w" else layer.weight.detach().T.contiguous()
    return encode_operand(w, layer.recipe.operand(name), signs, None)


def _gathered(layer: FP4Linear, name: str, world: int, reduce: bool = True):
    """Each of `world` shards encoded on its own (their amaxes max-reduced as the all-reduce does, or
    not), packed, laid rank after rank as FSDP2 gathers them, and unpacked."""
    shards = layer.weight.detach().chunk(world)
    amaxes = []
    for shard in shards:  # what each rank would contribute to the all-reduce
        encode_shard(layer, name, shard, amaxes.append)
    largest = torch.stack(amaxes).amax(dim=0) if amaxes else None  # elementwise: per-row amaxes too
    locals_ = [encode_shard(layer, name, shard, (lambda a: a.copy_(largest)) if reduce else (lambda a: None)) for shard in shards]
    nbytes = sum(part.numel() for part in shard_parts(locals_[0], name))
    buffer = torch.cat([pack(q, name, nbytes) for q in locals_])
    return unpack(buffer, locals_[0], name, world, (layer.out_features, layer.in_features))


def _assert_same_encoding(a, b) -> None:
    if isinstance(b, Fp8Tensor):
        assert isinstance(a, Fp8Tensor) and (a.element, a.scaling) == (b.element, b.scaling)
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)
        return
    assert a.shape == b.shape and a.fmt == b.fmt and a.tile == b.tile
    assert torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)
    assert (a.tensor_scale is None) == (b.tensor_scale is None)
    if a.tensor_scale is not None:
        assert torch.equal(a.tensor_scale, b.tensor_scale)


# --- no process group needed -------------------------------------------------------------------------


@pytest.mark.parametrize(("recipe", "world", "names"), [
    ("mxfp4", 2, ("fprop_w", "dgrad_w")),  # 1x32 along K and along N
    ("nvfp4-1d-h16", 2, ("fprop_w", "dgrad_w")),  # all-reduced tensor scale, H16 along K and N
    ("nvfp4-global", 4, ("fprop_w",)),  # 16x16 tiles, one encoding for both GEMMs, 16 rows a shard
    ("mxfp4-rowsr", 2, ("fprop_w",)),  # 32x32 adaptive RCEIL tiles
    ("fp8", 2, ("fprop_w", "dgrad_w")),  # E4M3, one all-reduced scale per tensor
    ("fp8-rowwise", 4, ("fprop_w", "dgrad_w")),  # per-row power-of-two scales: W's rows; W^T's, all-reduced
])
def test_shard_encodings_gather_into_the_whole_weights_encoding(tmp_path, recipe, world, names):
    layer = _layer(recipe, tmp_path)
    assert dense_reason(layer, layer.out_features // world, world) is None
    for name in names:
        _assert_same_encoding(_gathered(layer, name, world), _whole(layer, name))


@pytest.mark.parametrize(("recipe", "name"), [("nvfp4-1d-h16", "fprop_w"), ("fp8", "fprop_w"), ("fp8-rowwise", "dgrad_w")])
def test_shards_need_the_amax_of_the_whole_weight(tmp_path, recipe, name):
    layer = _layer(recipe, tmp_path)
    own, whole = _gathered(layer, name, 2, reduce=False), _whole(layer, name)
    # The smaller shard's codes (values) come out otherwise (FP8's scale is rank 0's, the larger shard's).
    assert not torch.equal(own.data.view(torch.uint8), whole.data.view(torch.uint8))


def test_an_amax_that_is_nan_on_one_shard_is_nan_for_the_whole_weight(tmp_path):
    # One process's FP8 scale of a tensor holding a NaN is NaN; a MAX all-reduce alone may drop it.
    layer = _layer("fp8", tmp_path)
    with torch.no_grad():
        layer.weight[40, 3] = float("nan")
    gathered, whole = _gathered(layer, "fprop_w", 2), _whole(layer, "fprop_w")
    assert whole.scale.isnan() and gathered.scale.isnan()


@pytest.mark.parametrize(("recipe", "world", "reason"), [
    ("mxfp4", 4, "dgrad_w: 16 rows per rank are not a multiple of 32"),  # Dgrad's 1x32 blocks cross shards
    ("mxfp4-rowsr", 4, "fprop_w: 16 rows per rank are not a multiple of 32"),  # so do 32x32 tiles
    ("nvfp4-1d-h16", 8, "dgrad_w: 8 rows per rank are not a multiple of 16"),
    ("nvfp4-cta", 2, "fprop_w is nvfp4_cta"),  # its outer scale spans 128 rows
    ("optitrain", 2, "fprop_w (nvfp4 2D16x16 sr) draws random bits"),  # SR in the forward
    ("bf16", 2, "fprop_w is bf16"),
])
def test_weights_whose_shards_do_not_encode_exactly_are_gathered_dense(tmp_path, recipe, world, reason):
    layer = _layer(recipe, tmp_path)
    assert dense_reason(layer, layer.out_features // world, world).startswith(reason)


def test_dense_reasons_beyond_the_recipe(tmp_path):
    lora = FP4Linear(128, 64, load_recipe("mxfp4").linear, lora_rank=4)
    assert dense_reason(lora, 32, 2).startswith("LoRA-SVD")
    assert dense_reason(_layer("mxfp4", tmp_path, out_features=96), 32, 3) is None
    assert dense_reason(_layer("mxfp4", tmp_path, out_features=96), 24, 4).startswith("dgrad_w: 24 rows")


def test_encoded_gathers_need_fsdp_and_leave_captures_to_dense(tmp_path):
    assert TrainConfig().gather_weights == "dense"
    with pytest.raises(ConfigError, match="gather_weights"):
        TrainConfig(gather_weights="fp4")
    with pytest.raises(ConfigError, match="parallel='ddp' has none"):
        TrainConfig(parallel="ddp", gather_weights="encoded")
    with pytest.raises(ConfigError, match="capture_steps reads each layer's weight"):
        TrainConfig(parallel="fsdp", gather_weights="encoded", capture_steps=[0], capture_layers=["layers.0.*"])


# --- two ranks ------------------------------------------------------------------------------------------

needs_gloo = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
STEPS = 4
# Per step, per weight: two all-gathers (forward, backward) of packed codes (1/2 byte an element) and
# block scales (a byte per block or tile), against two bf16 all-gathers (2 bytes an element).
RATIO = {
    "mxfp4": (1 / 2 + 1 / 32) / 2,
    "nvfp4-1d-h16": (1 / 2 + 1 / 16) / 2,  # the two passes gather their own encoding, one each
    "nvfp4": (1 / 2 + 1 / 256) / 2,  # 16x16 tiles: one encoding serves both passes
    "fp8": 1 / 2,
    # Fprop's pass also gathers an fp32 scale per row of W (4 bytes a row of K = 128 or 384 elements):
    # a block's rows sum to 1280 and its weights to 196608 elements; Dgrad's pass moves the same size.
    "fp8-rowwise": (2 * 196608 + 2 * 4 * 1280) / (4 * 196608),
}
# tiny: 4 blocks of 7 linears; nvfp4 keeps its last block in BF16 (round(0.129 * 4) = 1).
ENCODED_LAYERS = {"mxfp4": 28, "nvfp4-1d-h16": 28, "nvfp4": 21, "fp8": 28, "fp8-rowwise": 28}


def _config(tmp_path: Path, recipe: str, gather: str, name: str = "", compute: str = "reference", parallel: str = "fsdp") -> TrainConfig:
    if recipe == "nvfp4-1d-h16":
        recipe = str(_recipe_file(tmp_path))
    return small(
        tmp_path, name or f"{Path(recipe).stem}-{gather}-{compute}", recipe=recipe, parallel=parallel, gather_weights=gather,
        steps=STEPS, eval_every=2, probe_every=2, checkpoint_every=2, compute=compute,
    )


def _final_state(config: TrainConfig) -> dict:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(config.out_dir) / "checkpoint.dcp" / f"step-{STEPS}"
    target = Path(config.out_dir) / "final.pt"
    dcp_to_torch_save(folder, target)
    return torch.load(target, weights_only=False)


def _assert_same_state(a, b) -> None:
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            _assert_same_state(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    else:
        assert a == b


def _without_speed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]


# (recipe, compute, parallel). Each half trains in one torchrun launch, dense and encoded run by run.
CASES = [
    ("mxfp4", "reference", "fsdp"),
    ("nvfp4-1d-h16", "reference", "fsdp"),
    ("nvfp4", "reference", "fsdp"),
    ("fp8", "reference", "fsdp"),
    # The tensor-core path (bf16 autocast; on the CPU its GEMMs run in fp32 on the same operands).
    ("nvfp4-1d-h16", "fast", "fsdp"),
    ("nvfp4", "fast", "fsdp"),
    ("fp8-rowwise", "fast", "fsdp"),
    ("mxfp4", "reference", "hsdp"),  # one node of 2: gathers and amaxes over the "shard" dim of the mesh
]


@pytest.mark.slow
@needs_gloo
@pytest.mark.parametrize("cases", [CASES[:4], CASES[4:]], ids=["reference-fsdp", "fast-and-hsdp"])
def test_encoded_gathers_train_the_dense_run_bit_for_bit_and_move_the_bytes_the_formula_gives(tmp_path, cases):
    runs = [
        tuple(_config(tmp_path, recipe, gather, name=f"{recipe}-{gather}-{compute}-{parallel}", compute=compute, parallel=parallel)
              for gather in ("dense", "encoded"))
        for recipe, compute, parallel in cases
    ]
    log = run_two_ranks(*(config for pair in runs for config in pair)).stderr
    # One line per encoded run, in the order they ran (a dense one says nothing).
    announced = re.findall(r"encoded weight all-gather: .*", log)
    assert len(announced) == len(cases), announced
    for line, (recipe, _, _) in zip(announced, cases):
        layers = ENCODED_LAYERS[recipe]
        assert line.startswith(f"encoded weight all-gather: {layers} FP4 linears encoded, {28 - layers} dense"), (recipe, line)
    for (recipe, compute, parallel), (dense, encoded) in zip(cases, runs):
        case = (recipe, compute, parallel)
        assert _without_speed(metrics(encoded)) == _without_speed(metrics(dense)), case
        assert any("quant" in r for r in metrics(encoded)), case  # probes measured the gathered encodings against W
        _assert_same_state(_final_state(encoded), _final_state(dense))

        layers = ENCODED_LAYERS[recipe]
        moved = json.loads((Path(encoded.out_dir) / "summary.json").read_text())["gather_bytes_per_step"]
        assert moved["ratio"] == RATIO[recipe] and moved["encoded_layers"] == layers, case
        # Every encoded weight was gathered encoded for the backward of every step (no silent dense
        # gather) and for every forward: the steps' and the evaluation batches'.
        forwards = STEPS + encoded.eval_batches * sum("val_loss" in r for r in metrics(encoded))
        assert moved["gathers"] == {"forward": forwards * layers, "backward": STEPS * layers}, case
        assert moved["moved"] == moved["encoded"] // 2 * (forwards + STEPS), case
        assert "gather_bytes_per_step" not in json.loads((Path(dense.out_dir) / "summary.json").read_text()), case


@pytest.mark.slow
@needs_gloo
def test_a_run_stopped_and_resumed_under_encoded_gathers_is_the_dense_run(tmp_path):
    # nvfp4: SR gradients (each rank's generators go through the checkpoint) and a BF16 block.
    dense = _config(tmp_path, "nvfp4", "dense")
    stopped = _config(tmp_path, "nvfp4", "encoded", name="stopped")
    first = run_two_ranks(dense, stopped, stop_after_on_rank_1=2)
    assert "rank 0 status stopped steps 2" in first.stderr
    run_two_ranks(stopped)
    # The resumed segment gathered encoded too: the hooks outlive loading the checkpoint into the shards.
    moved = json.loads((Path(stopped.out_dir) / "summary.json").read_text())["gather_bytes_per_step"]
    assert moved["gathers"]["backward"] == (STEPS - 2) * ENCODED_LAYERS["nvfp4"]
    assert _without_speed(metrics(stopped)) == _without_speed(metrics(dense))
    _assert_same_state(_final_state(stopped), _final_state(dense))
