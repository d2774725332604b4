"""scripts/saved_for_backward.py: what a step keeps for its backward, counted from the autograd graph."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import torch

from tests.scripts import SCRIPTS, load_script

saved_for_backward = load_script("saved_for_backward")


@dataclasses.dataclass(frozen=True)
class _Kept:
    codes: torch.Tensor
    scales: torch.Tensor


class _KeepsOnContext(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.kept = _Kept(x.to(torch.uint8), x[:, :1].to(torch.uint8))  # as FP4Linear keeps a PackedOperand
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_every_storage_counted_once_weights_left_out_context_operands_found():
    weight = torch.randn(8, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)

    def run():
        h = x @ weight.T  # saves x (and the weight, left out)
        y = _KeepsOnContext.apply(h)  # keeps 4 x 8 + 4 x 1 bytes on its context
        return (y * h).sum()  # saves y and h

    _, kept = saved_for_backward.kept_for_backward(run, {weight.untyped_storage().data_ptr()})
    assert kept[("saved", "float32", (4, 16))] == 4 * 16 * 4
    assert kept[("saved", "float32", (4, 8))] == 2 * 4 * 8 * 4  # y and h
    assert kept[("_KeepsOnContextBackward", "uint8", (4, 8))] == 32
    assert kept[("_KeepsOnContextBackward", "uint8", (4, 1))] == 4
    assert not any(shape == (8, 16) for _, _, shape in kept)  # the weight


def test_a_tensor_an_inner_hook_gives_up_is_not_counted():
    x = torch.randn(4, 16, requires_grad=True)

    def run():
        h = x * 2
        with torch.autograd.graph.saved_tensors_hooks(lambda t: None, lambda _: h):  # kept elsewhere
            return (h * h).sum()

    _, kept = saved_for_backward.kept_for_backward(run, set())
    assert not kept, kept


def test_the_script_prints_the_fp32_logits_of_a_reference_step():
    done = subprocess.run([sys.executable, str(SCRIPTS / "saved_for_backward.py"), "bf16", "--compute", "reference",
                           "--compile", "off", "--seq-len", "64", "--vocab", "512"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    first, *rows = done.stdout.strip().splitlines()
    assert "kept for the backward" in first and "bytes a token" in first
    assert any("float32 [64, 512]" in row for row in rows), rows  # the log-probabilities the reference's loss keeps
