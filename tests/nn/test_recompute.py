"""Recomputing a feed-forward's gate and up in the backward (`recompute_gate_up`): the same bits as
keeping them, and they are no longer kept."""

from __future__ import annotations

import pytest
import torch

from fp4lab.nn.build import build_model
from fp4lab.nn.model_config import ModelConfig
from fp4lab.nn.operands import PackedOperand
from fp4lab.nn.recipe import load_recipe
from tests import interpreted
from tests.scripts import load_script

saved_for_backward = load_script("saved_for_backward")

# hidden 96 is the only activation of that width: gate and up are easy to find among what is kept; at
# 4 layers nvfp4 keeps its last block in bf16, whose plain linears recompute too
CONFIG = ModelConfig(dim=64, n_layers=4, n_heads=2, n_kv_heads=1, vocab_size=80, ffn_hidden=96, max_seq_len=32)


def _step(recipe: str, recompute: str, compiled: bool, device: str = "cpu", kept_fprop: list | None = None):
    """One forward and backward of a fresh model: the loss, every gradient, and the bf16 tensors of
    the hidden width that the graph keeps for the backward; `kept_fprop` gets the Fprop operands that
    FP4 linears kept for recomputing their output."""
    torch._dynamo.reset()
    torch.manual_seed(0)  # the initial weights
    model = build_model(CONFIG, load_recipe(recipe), seed=0, device=device, tensor_cores=True,
                        recompute_gate_up=("compiled" if compiled else "eager") if recompute == "on" else "off")
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(CONFIG.vocab_size, (2, 32), generator=g).to(device) for _ in range(2))

    def loss_fn(tokens, targets):
        with torch.autocast(device, dtype=torch.bfloat16):
            return model.loss(tokens, targets)

    run = torch.compile(loss_fn) if compiled else loss_fn
    excluded = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    loss, kept = saved_for_backward.kept_for_backward(lambda: run(tokens, targets), excluded)
    hidden = sum(size for (_, dtype, shape), size in kept.items() if dtype == "bfloat16" and shape[-1] == CONFIG.ffn_hidden and len(shape) == 3)
    if kept_fprop is not None:
        kept_fprop.extend(_kept_fprop_operands(loss))
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, hidden


@pytest.mark.parametrize("recipe, compiled", [("nvfp4", False), ("nvfp4", True), ("fp8", False)],
                         ids=["nvfp4-eager", "nvfp4-compiled", "fp8-eager"])
def test_recomputed_gate_and_up_give_the_same_bits_and_are_not_kept(recipe, compiled):
    _check_same_bits_and_not_kept(recipe, compiled, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("recipe", ["nvfp4", "mxfp4-rowsr-h32", "fp8", "optitrain"])
def test_recomputed_gate_and_up_on_cuda(recipe):
    """The fast path as it trains (fused quantizers, compiled, deterministic algorithms): the recomputed
    GEMMs run the same cuBLAS and Triton kernels on the same operands."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (an NVIDIA GPU)")
    from fp4lab.train.build import fast_path_process_settings, plain_pytorch_settings

    fast_path_process_settings()
    try:
        _check_same_bits_and_not_kept(recipe, True, "cuda")
    finally:
        plain_pytorch_settings()


def test_recomputing_layers_keep_their_fprop_operands_as_codes_where_the_kernels_run():
    """With the fused quantizers (the interpreter), W1 and W3 keep x and W for the recompute as codes
    and scales, not bf16 values; their decode gives the same bits."""
    interpreted.run_interpreted(__name__, "check_fprop_operands_kept_packed('nvfp4')")


@interpreted.fused_kernels_as_on_cuda()
def check_fprop_operands_kept_packed(recipe: str) -> None:
    kept_fprop = []
    _check_same_bits_and_not_kept(recipe, False, "cpu", kept_fprop)
    blocks = sum(not load_recipe(recipe).linear_for_block(i, CONFIG.n_layers).is_plain_bf16 for i in range(CONFIG.n_layers))
    assert 0 < blocks < CONFIG.n_layers and len(kept_fprop) == 2 * blocks, len(kept_fprop)  # the bf16 block's are plain
    for x_op, w_op, *_ in kept_fprop:
        assert isinstance(x_op, PackedOperand) and isinstance(w_op, PackedOperand), (type(x_op), type(w_op))


def _kept_fprop_operands(loss: torch.Tensor) -> list[tuple]:
    seen, stack, found = set(), [loss.grad_fn], []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(node, "fprop", None) is not None:
            found.append(node.fprop)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _check_same_bits_and_not_kept(recipe: str, compiled: bool, device: str, kept_fprop: list | None = None) -> None:
    loss, grads, kept = _step(recipe, "off", compiled, device)
    loss_r, grads_r, kept_r = _step(recipe, "on", compiled, device, kept_fprop)
    assert torch.equal(loss_r, loss)
    for name, grad in grads.items():
        assert torch.equal(grads_r[name], grad), name
    gate_and_up = 2 * 2 * 32 * CONFIG.ffn_hidden * 2  # two bf16 tensors a block, [2, 32, 96]
    assert kept - kept_r == CONFIG.n_layers * gate_and_up, (kept, kept_r)  # every block of an FP4 model
