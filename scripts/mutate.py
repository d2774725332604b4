"""Mutation checks (issue 12): break each wire on purpose and check that a named test catches it.

Each mutation is a real text edit of fp4lab/ source (an exact old text, found exactly once, replaced by
a new text) plus the pytest node ids expected to fail under it. For each mutation the script copies the
repository's committed tree (`git archive HEAD`; `--working-tree` copies the files as they are instead)
into a fresh temporary folder, applies the edit there, and runs only the named tests there, with that
copy first on PYTHONPATH. The shared working tree is never edited.

    python scripts/mutate.py              # every mutation; exit 1 if any is missed
    python scripts/mutate.py --list       # names, files and tests
    python scripts/mutate.py qk-clip-call-removed ds-query-axis   # chosen mutations
    python scripts/mutate.py --no-baseline   # skip checking that the named tests pass unmutated

A mutation counts as caught when pytest exits with status 1 (some named test failed); a clean pass is
a miss; anything else (collection error, timeout) is reported as an error and also fails the run.
docs/NUMERICS.md ("Mutation checks") lists the mutations and the test that catches each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
W = "tests/train/test_wires.py::"


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str
    edits: tuple[tuple[str, str, str], ...]  # (file, exact old text, new text)
    tests: tuple[str, ...]


def m(name: str, what: str, edits, tests) -> Mutation:
    if isinstance(edits[0], str):
        edits = (edits,)
    return Mutation(name, what, tuple(edits), tuple(tests))


LOOP = "fp4lab/train/loop.py"
PRUNING = "tests/lab/test_pruning.py::"
FAULTS = "tests/train/test_faults.py::"
STORE = "tests/lab/test_catalog_store.py::"
TRAIN_BUILD = "fp4lab/train/build.py"
ATTN = "fp4lab/nn/attention.py"
ATTN_KERNEL = "fp4lab/numerics/kernels/attention.py"
MX_GEMM = "fp4lab/numerics/kernels/mx_gemm.py"
MX_INTERPRETED = "tests/kernels/test_triton_mx_gemm.py::test_kernel_under_triton_interpreter"
FUSION_WIRE = "tests/nn/test_producer_fusion.py::test_producer_fusion_reaches_every_w2_and_w1_and_the_blocks_call_them"
NORM_EXACT = "tests/nn/test_producer_fusion.py::test_fused_producers_equal_the_unfused_blocks_and_fall_back_under_the_interpreter"
FUSION_EXACT = "tests/nn/test_producer_fusion.py::test_fused_producers_equal_the_unfused_blocks_and_fall_back_under_the_interpreter"
LIN = "fp4lab/nn/fp4_linear.py"
OPERANDS = "fp4lab/nn/operands.py"
GEMM = "fp4lab/nn/gemm.py"
KERNELS = "fp4lab/numerics/kernels/__init__.py"
TQ = "fp4lab/numerics/kernels/quantize.py"
TQ_INTERPRETED = "tests/kernels/test_triton_quantize.py::test_kernels_under_triton_interpreter"
PROBE_COUNTS = "tests/kernels/test_triton_quantize.py::test_probe_counts_under_triton_interpreter"
CTA_FUSED = "tests/nn/test_tensor_cores.py::test_cta_local_operands_and_2d_weights_from_the_fused_quantizers_under_the_interpreter"
CTA_2D_FUSED = "tests/nn/test_tensor_cores.py::test_cta_local_operands_and_2d_weights_from_the_fused_quantizers_under_the_interpreter"
FUSION_REF = "fp4lab/numerics/fusion.py"
TILE_GEMM = "fp4lab/numerics/tile_gemm.py"
FP8_KERNEL = "fp4lab/numerics/kernels/fp8.py"
FP8_INTERPRETED = "tests/kernels/test_triton_fp8.py::test_amax_pass_and_fused_quantizer_match_the_reference_and_layers_take_them_under_the_interpreter"
FP8_WIRE = "tests/kernels/test_triton_fp8.py::test_amax_pass_and_fused_quantizer_match_the_reference_and_layers_take_them_under_the_interpreter"
FP8_AMAX = "tests/kernels/test_triton_fp8.py::test_amax_pass_and_fused_quantizer_match_the_reference_and_layers_take_them_under_the_interpreter"
TILE_KERNEL = "fp4lab/numerics/kernels/tile_gemm.py"
TILE_TESTS = "tests/numerics/test_tile_gemm.py"
TILE_INTERPRETED = "tests/numerics/test_tile_gemm.py::test_kernel_equals_the_reference_and_fp4_linear_sends_it_cta_local_weights_under_the_interpreter"
TILE_WIRE = "tests/numerics/test_tile_gemm.py::test_kernel_equals_the_reference_and_fp4_linear_sends_it_cta_local_weights_under_the_interpreter"
CTA_MATCH = "tests/nn/test_tensor_cores.py::test_fp4_linear_tensor_cores_match_reference[cpu-nvfp4-cta]"
NORM_BACKWARD = "tests/kernels/test_triton_fusion.py::test_rmsnorm_backward_is_autograd_of_the_reference"
BUILD = "fp4lab/nn/build.py"
RECIPE = "fp4lab/nn/recipe.py"
OPT = "fp4lab/optim/build.py"
MUON = "fp4lab/optim/muon.py"
CAPTURE = "fp4lab/train/capture.py"
USER_CORPUS = "fp4lab/train/user_corpus.py"
OWN = "tests/train/test_user_corpus.py::"
GEMM_ERROR = "fp4lab/train/gemm_error.py"
CAPTURE_FILES = "tests/train/test_capture.py::test_capture_writes_the_chosen_steps_and_layers_only"
CAPTURE_REAL = "tests/train/test_capture.py::test_captured_tensors_are_the_step_s_real_operands"
CAPTURE_EXACT = "tests/train/test_capture.py::test_diagnostic_equals_an_independent_quantized_product"
KIMI_LOOP = W + "test_loop_steps_in_the_documented_order_with_qk_clip_and_update_cap[bf16-kimi]"
CAP_LOOP = W + "test_loop_steps_in_the_documented_order_with_qk_clip_and_update_cap[optitrain-None]"
FULLSTACK = W + "test_fullstack_loop_refreshes_lora_svd_and_keeps_nvfp4_optimizer_states"
SWITCHES = W + "test_recipe_switches_reach_the_model"
OPT_STATES = W + "test_nvfp4_optimizer_states_are_stored_packed_and_used"
ATTN_EXACT = "tests/nn/test_attention.py::test_fp4_attention_is_bit_exact_to_an_emulation_with_every_operand_on_its_contraction_axis"
ATTN_FUSED_EXACT = "tests/nn/test_fp4_attention_fused.py::test_fused_fp4_attention_under_the_interpreter"
ATTN_FUSED_SR = "tests/nn/test_fp4_attention_fused.py::test_fused_fp4_attention_under_the_interpreter"
OPTIONS = W + "test_fp4_linear_operand_options_reach_the_quantizer"
NS_EXACT = "tests/optim/test_optim.py::test_nvfp4_newton_schulz_is_three_nvfp4_gemms_blocked_along_their_contraction_axes"
NS_FUSED = "tests/optim/test_optim.py::test_fused_nvfp4_newton_schulz_equals_the_reference_under_the_interpreter"
NS_BATCHED = "tests/optim/test_optim.py::test_batched_nvfp4_newton_schulz_is_each_matrix_s_bit_for_bit"
NS_FUSED_BATCHED = "tests/optim/test_optim.py::test_fused_batched_nvfp4_newton_schulz_equals_the_reference_under_the_interpreter"
LINEAR_EXACT = "tests/nn/test_fp4_linear.py::test_mxfp4_rowsr_h32_gemms_are_bit_exact_emulations"
LINEAR_1D = "tests/nn/test_fp4_linear.py::test_nvfp4_with_one_d_weights_requantizes_w_transposed_for_dgrad"
GEMMS_EXACT = "tests/nn/test_recipe_gemms.py::test_each_gemm_is_the_bit_exact_emulation_of_its_recipe"

EXPORT = "fp4lab/train/export.py"
TRACKERS = "fp4lab/train/trackers.py"
TRACKED = "tests/train/test_trackers.py::"
EXPORTED = "tests/train/test_export.py::"
EXPORT_LOGITS = EXPORTED + "test_transformers_loads_the_export_and_its_logits_match_fp4lab"

QK_CALL = "clipped = _apply_qk_clip(model, tau, bool(recipe.lora_svd_rank))"
STEP_CALL = 'grad_norm = clip_and_step(model, optimizer, config.grad_clip, keep_grads=train_step.graphed, pipelined=ranks.mode == "pp")'

MUTATIONS = [
    # --- optimizer hooks of the training loop ------------------------------------------------------
    m("qk-clip-call-removed", "the loop never calls Kimi QK-Clip",
      (LOOP, QK_CALL, "clipped = 0"),
      [KIMI_LOOP, W + "test_kimi_qk_clip_in_the_loop_changes_the_weights_and_counts_heads"]),
    m("qk-clip-before-step", "QK-Clip moved before the optimizer step",
      [(LOOP, STEP_CALL, "clip_hits = _apply_qk_clip(model, tau, bool(recipe.lora_svd_rank)) if qk_clip == \"kimi\" else 0\n"
                         "    " + STEP_CALL),
       (LOOP, QK_CALL, "clipped = clip_hits")],
      [KIMI_LOOP]),
    m("qk-clip-stale-logits", "max logits recorded on probe steps only: QK-Clip reads a stale S_max",
      (LOOP, 'record_max_logits=probing or qk_clip == "kimi"', "record_max_logits=probing"),
      [KIMI_LOOP]),
    m("qk-clip-no-lora-realign", "QK-Clip no longer re-aligns the LoRA-SVD factors of wq, wk",
      (LOOP, "if hit and realign:", "if False:"),
      [FULLSTACK]),
    m("update-cap-unwired", "the recipe's update cap never reaches the optimizer",
      (TRAIN_BUILD, "cap = (opt.update_cap_alpha, opt.update_cap_alpha_qk) if", "cap = None if"),
      [CAP_LOOP]),
    m("update-cap-alphas-swapped", "update_cap_alpha and update_cap_alpha_qk swapped",
      (TRAIN_BUILD, "cap = (opt.update_cap_alpha, opt.update_cap_alpha_qk)", "cap = (opt.update_cap_alpha_qk, opt.update_cap_alpha)"),
      [CAP_LOOP]),
    m("update-cap-qk-alpha-ignored", "wq / wk capped with alpha, not alpha_qk",
      (OPT, "alpha_qk if _QK_PARAM.match(n) else alpha", "alpha"),
      ["tests/optim/test_optim.py::test_update_cap_is_wired_to_block_matrices_with_alpha_qk_on_wq_wk"]),
    m("update-cap-not-applied", "CombinedOptimizer snapshots but never applies the cap",
      (OPT, "            self.cap.apply()", "            pass"),
      ["tests/optim/test_optim.py::test_update_cap_is_wired_to_block_matrices_with_alpha_qk_on_wq_wk", CAP_LOOP]),
    m("lora-refresh-removed", "the loop never refreshes the LoRA-SVD factors (they stay zero)",
      (LOOP, "        _realign_low_rank(model)\n", "        pass\n"),
      [FULLSTACK, W + "test_lora_svd_refresh_follows_lora_svd_every"]),
    m("lora-refresh-once", "LoRA-SVD refreshed at step 0 only, not every lora_svd_every steps",
      (LOOP, "step % recipe.lora_svd_every == 0", "step == 0"),
      [W + "test_lora_svd_refresh_follows_lora_svd_every"]),
    # --- NVFP4 optimizer states ----------------------------------------------------------------------
    m("ns-polynomial-unwired", "the recipe's optimizer.ns_polynomial (optitrain: cubic) never reaches Muon",
      (TRAIN_BUILD, '"ns_polynomial": config.ns_polynomial or opt.ns_polynomial,', '"ns_polynomial": config.ns_polynomial or "quintic",'), [CAP_LOOP]),
    m("ns-format-unwired", "the recipe's optimizer.ns_format never reaches Muon",
      (TRAIN_BUILD, "ns_format=opt.ns_format,", 'ns_format="bf16",'), [FULLSTACK]),
    m("adam-v-format-unwired", "the recipe's optimizer.adam_v_format never reaches AdamW",
      (TRAIN_BUILD, "adam_v_format=opt.adam_v_format,", 'adam_v_format="fp32",'), [FULLSTACK]),
    m("muon-ns-format-dropped", "build_optimizer builds Muon with bf16 Newton-Schulz whatever ns_format says",
      (OPT, "ns_format=cfg.ns_format,", 'ns_format="bf16",'), [OPT_STATES, FULLSTACK]),
    m("adamw-v-never-packed", "AdamW keeps v in fp32 although v_format is nvfp4",
      ("fp4lab/optim/adamw.py", 'quantized = group["v_format"] == "nvfp4" and quantized_v(param)', "quantized = False"),
      ["tests/optim/test_optim_adamw.py::test_nvfp4_state_dict_round_trip_keeps_dtypes_and_resumes_bit_identically", OPT_STATES]),
    m("adamw-v-not-stored", "AdamW's updated v is never encoded back into the packed state",
      ("fp4lab/optim/adamw.py", "state.update(_encode_v_state(exp_avg_sq, param))", "pass"),
      ["tests/optim/test_optim_adamw.py::test_stored_v_tracks_an_fp32_adamw_run"]),
    m("fused-dequantize-outer-dropped", "FusedQuant.dequantize (NVFP4 Newton-Schulz, fused FP4 attention) leaves out the decode scale",
      (TQ, "return values if self.outer is None else values.mul_(self.outer)", "return values"), [NS_FUSED, ATTN_FUSED_EXACT]),
    m("ns-batch-one-scale", "batched NVFP4 Newton-Schulz: one tensor scale for the whole stack, not one per matrix",
      (MUON, '{"fmt": "nvfp4_cta", "cta_tile": rows}', '{"fmt": "nvfp4_cta", "cta_tile": x.numel() // cols}'),
      [NS_BATCHED, NS_FUSED_BATCHED]),
    m("ns-batch-one-norm", "batched Newton-Schulz: the stack divided by its whole norm, not each matrix by its own",
      (MUON, "norm = x.norm() if x.ndim == 2 else torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True)", "norm = x.norm()"),
      [NS_BATCHED]),
    m("muon-nvfp4-unbatched", "Muon batches its Newton-Schulz in bf16 only, NVFP4 one matrix at a time",
      (MUON, "if not self.batched:", 'if not (self.batched and group["ns_format"] == "bf16"):'),
      ["tests/optim/test_optim.py::test_batched_nvfp4_muon_steps_bit_for_bit_like_unbatched"]),
    m("fast-fake-quantize-bypassed", "kernels.fake_quantize (NVFP4 Newton-Schulz, FP4 attention's Q, K) takes the torch reference where Triton runs",
      ("fp4lab/numerics/kernels/__init__.py", "    if runs_on(x.device):\n", "    if False:\n"), [NS_FUSED, ATTN_FUSED_EXACT]),
    m("ns-gram-bf16", "Muon's nvfp4 Newton-Schulz: A = X X^T left a bf16 GEMM",
      (MUON, "gram = matmul(x, x.mT).bfloat16()", "gram = x @ x.mT"), [NS_EXACT]),
    m("ns-gram-short-axis", "Muon's nvfp4 Newton-Schulz: X blocked along the short side for X X^T",
      (MUON, "matmul(x, x.mT)", "(_nvfp4_decoded(x.mT).mT @ _nvfp4_decoded(x.mT))"), [NS_EXACT]),
    m("ns-square-bf16", "Muon's nvfp4 Newton-Schulz: A A left a bf16 GEMM",
      (MUON, "matmul(gram, gram)", "(gram @ gram).float()"), [NS_EXACT]),
    m("ns-square-assumes-symmetric", "Muon's nvfp4 Newton-Schulz: the right A of A A blocked along its rows",
      (MUON, "matmul(gram, gram)", "(_nvfp4_decoded(gram) @ _nvfp4_decoded(gram))"), [NS_EXACT]),
    m("ns-bx-bf16", "Muon's nvfp4 Newton-Schulz: B X left a bf16 GEMM",
      (MUON, "matmul(gram_update, x)", "(gram_update @ x).float()"), [NS_EXACT]),
    m("ns-bx-x-long-axis", "Muon's nvfp4 Newton-Schulz: X blocked along the long side for B X (not re-quantized)",
      (MUON, "matmul(gram_update, x)", "(_nvfp4_decoded(gram_update) @ _nvfp4_decoded(x))"), [NS_EXACT]),
    # --- recipe switches ---------------------------------------------------------------------------
    m("attention-format-ignored", "attention.format: every FP4 attention runs nvfp4",
      (BUILD, "AttentionQuant(recipe.attention.format, recipe.attention.ds_rounding, generator, tensor_cores)",
       'AttentionQuant("nvfp4", recipe.attention.ds_rounding, generator, tensor_cores)'), [SWITCHES]),
    m("attention-ds-rounding-ignored", "attention.ds_rounding: dS always stochastically rounded",
      (BUILD, "AttentionQuant(recipe.attention.format, recipe.attention.ds_rounding, generator, tensor_cores)",
       'AttentionQuant(recipe.attention.format, "sr", generator, tensor_cores)'), [SWITCHES]),
    m("attention-tensor-cores-not-wired", "FP4 attention's BF16 GEMMs never on tensor cores, whatever the fast path",
      (BUILD, "recipe.attention.ds_rounding, generator, tensor_cores)", "recipe.attention.ds_rounding, generator)"),
      ["tests/nn/test_fp4_attention_chunked.py::test_the_tensor_core_flag_reaches_fp4_attention_from_the_fast_path"]),
    m("attn-tc-outer-dropped", "FP4 attention on tensor cores leaves out the NVFP4 outer scales of its FP4 GEMMs",
      (ATTN, "return out if alpha is None else out.mul_(alpha)", "return out"),
      ["tests/nn/test_fp4_attention_chunked.py::test_tensor_core_fp4_attention_under_the_interpreter"]),
    m("flash-fp4-not-wired", "Attention with the triton kernel runs FP4 attention on the chunked path, not the flash kernels",
      (ATTN, 'flash = self.kernel == "triton" and flash_fp4_covers(q, self.quant)', "flash = False"),
      ["tests/nn/test_fp4_attention_flash.py::test_flash_fp4_attention_under_the_interpreter"]),
    m("flash-logit-scale-dropped", "flash FP4 attention leaves the NVFP4 outer scales of Q and K out of its logits",
      (ATTN_KERNEL, "POLY=False, SCALED=logit_scale is not None,\n        num_warps", "POLY=False, SCALED=False,\n        num_warps"),
      ["tests/nn/test_fp4_attention_flash.py::test_flash_fp4_attention_under_the_interpreter"]),
    m("flash-ds-unquantized-for-dq", "the flash dQ kernel multiplies unquantized dS, not its FP4 block values",
      (ATTN_KERNEL, "grad_q += tl.dot(ds, _operand_rows(", "grad_q += tl.dot(grad_s.to(tl.bfloat16), _operand_rows("),
      ["tests/nn/test_fp4_attention_flash.py::test_flash_fp4_attention_under_the_interpreter"]),
    m("flash-ds-query-axis", "the flash dK kernel quantizes dS^T along keys (its tile's rows), not along queries",
      (ATTN_KERNEL, "ds_t = _tile_block_values(grad_s_t, ds_amax_bits, ds_seed_ptr, ds_row0 + keys, start, seq, BLOCK_N, BLOCK_M, DS_FMT == 1, DS_SR)",
       "ds_t = tl.trans(_tile_block_values(tl.trans(grad_s_t), ds_amax_bits, ds_seed_ptr, ds_row0 + rows, start, seq, BLOCK_M, BLOCK_N, DS_FMT == 1, DS_SR))"),
      ["tests/nn/test_fp4_attention_flash.py::test_flash_fp4_attention_under_the_interpreter"]),
    m("flash-ds-outer-dropped", "the flash dQ kernel leaves out the NVFP4 outer scales of dS and K",
      (ATTN_KERNEL, "grad_q = grad_q * (_ds_outer(ds_amax_ptr, 0) * tl.load(k_seq_outer_ptr))", "grad_q = grad_q"),
      ["tests/nn/test_fp4_attention_flash.py::test_flash_fp4_attention_under_the_interpreter"]),
    m("flash-sr-off", "flash FP4 attention rounds dS to nearest where SR is asked for",
      (ATTN_KERNEL, '"DS_FMT": ds_fmt, "DS_SR": seed_keys is not None}', '"DS_FMT": ds_fmt, "DS_SR": False}'),
      ["tests/nn/test_fp4_attention_flash.py::test_flash_fp4_attention_under_the_interpreter"]),
    m("flash-fp64-logit-factor", "the flash forward multiplies the logits by the float argument as passed (fp64 under torch.compile)",
      (ATTN_KERNEL, "    log2e_scale = _fp32(log2e_scale) * logit_scale\n", "    log2e_scale = log2e_scale * logit_scale\n"),
      ["tests/kernels/test_triton_frontend.py"]),
    m("sr-uniforms-early-return", "the quantizer's SR uniforms return early under a constexpr if (GPU compiles the Philox branch with seed None)",
      (TQ, """    if GIVEN_U:
        u = _load(u_ptr, rows, cols, n_rows, n_cols, EVEN)
    else:
        u = _uniforms(seed_ptr, rows, col0, n_cols, M, N)
    return u
""", """    if GIVEN_U:
        return _load(u_ptr, rows, cols, n_rows, n_cols, EVEN)
    return _uniforms(seed_ptr, rows, col0, n_cols, M, N)
"""),
      ["tests/kernels/test_triton_frontend.py"]),
    m("flash-fp4-fake-grad-dtype", "the flash FP4 backward operator's fake says dQ is bf16 (torch.compile would trace a wrong dtype)",
      (ATTN_KERNEL, "    return torch.empty(q_values.shape, dtype=torch.float32, device=q_values.device), grad_k, torch.empty_like(grad_k)",
       "    return torch.empty(q_values.shape, dtype=torch.bfloat16, device=q_values.device), grad_k, torch.empty_like(grad_k)"),
      ["tests/nn/test_fp4_attention_flash.py::test_flash_fp4_attention_under_the_interpreter"]),
    m("ns-tc-outer-dropped", "the NVFP4 Newton-Schulz on tensor cores leaves out the per-matrix outer scales",
      (MUON, "bf16_matmul_fp32(left_values, right_values.mT) * (left_outer * right_outer.mT)", "bf16_matmul_fp32(left_values, right_values.mT)"),
      ["tests/optim/test_optim.py::test_nvfp4_newton_schulz_on_tensor_cores_under_the_interpreter"]),
    m("ns-tensor-cores-not-wired", "the fused optimizer config leaves Muon's NVFP4 Newton-Schulz GEMMs in fp32",
      (OPT, "ns_tensor_cores=cfg.fused,", "ns_tensor_cores=False,"),
      ["tests/optim/test_optim.py::test_fused_config_batches_muon_and_fuses_adamw"]),
    m("attention-fp4-off", "attention.format nvfp4/mxfp4 never switches FP4 attention on",
      (BUILD, 'if recipe.attention.format != "bf16":', "if False:"), [SWITCHES]),
    m("embedding-format-ignored", "model.embedding = fp32 still rounds the embedding to bf16",
      (BUILD, 'embedding_dtype = torch.bfloat16 if recipe.embedding == "bf16" else torch.float32',
       "embedding_dtype = torch.bfloat16"), [SWITCHES]),
    m("head-fp4-ignored", "model.head = fp4 leaves the head in bf16",
      (RECIPE, 'return self.linear if self.head == "fp4" else', 'return self.linear if False else'), [SWITCHES]),
    m("head-fp32-ignored", "model.head = fp32 gives a bf16 head",
      (RECIPE, 'format="fp32" if self.head == "fp32" else "bf16"', 'format="bf16"'),
      ["tests/nn/test_recipe.py", SWITCHES]),
    m("lora-rank-ignored", "model.lora_svd_rank never reaches the linears",
      (BUILD, "lora_rank = recipe.lora_svd_rank if block_index", "lora_rank = 0 if block_index"),
      [FULLSTACK, SWITCHES]),
    m("block-overrides-ignored", "[[blocks]] overrides (depth hybrids) are ignored",
      (RECIPE, "                chosen = override.linear", "                pass"),
      ["tests/nn/test_recipe.py::test_nvfp4_is_the_te_recipe_with_bf16_ends_scaled_to_depth"]),
    # --- per-operand spec keys ---------------------------------------------------------------------
    m("operand-rounding-ignored", "an operand's rounding = sr quantizes to nearest",
      (OPERANDS, '        "rounding": spec.rounding,\n', '        "rounding": "rtn",\n'), [LINEAR_EXACT]),
    m("operand-scale-mode-ignored", "an MXFP4 operand's scale_mode falls back to the default",
      (OPERANDS, '        "scale_mode": spec.scale_mode,\n', '        "scale_mode": None,\n'), [LINEAR_EXACT]),
    m("operand-tile-ignored", "a weight's 2D tile is quantized 1x16 instead",
      (OPERANDS, '        "tile": spec.tile,\n', '        "tile": None,\n'),
      ["tests/nn/test_fp4_linear.py", OPTIONS]),
    m("operand-adaptive-ignored", "adaptive = true (rceil) scales as plain rceil",
      (OPERANDS, '        "adaptive": spec.adaptive,\n', '        "adaptive": False,\n'), ["tests/nn/test_fp4_linear.py", OPTIONS]),
    m("operand-cta-tile-ignored", "an nvfp4_cta operand's cta_tile falls back to the default",
      (OPERANDS, '        "cta_tile": spec.cta_tile,\n', '        "cta_tile": None,\n'), ["tests/nn/test_fp4_linear.py", OPTIONS]),
    m("operand-transform-ignored", "transform = h16 / rht16 never applies the Hadamard",
      (LIN, '        if spec.transform == "none":\n            return None', "        return None"),
      [LINEAR_EXACT, "tests/nn/test_fp4_linear.py::test_random_hadamard_signs_are_paired_and_redrawn_each_call"]),
    m("operand-spec-swapped", "Dgrad's dy quantized with the wgrad_dy spec",
      (LIN, 'dy_hat = layer.consume("dgrad_dy", dy, signs["dgrad"], g)', 'dy_hat = layer.consume("wgrad_dy", dy, signs["dgrad"], g)'),
      [LINEAR_EXACT]),
    # --- fp8 operands and the full-dimension RHT (issue 12 item 4) -----------------------------------
    m("fp8-element-ignored", "an fp8 operand's element = e5m2 is cast to E4M3",
      (OPERANDS, "fp8_quantize(t, spec.element, spec.scaling, pow2", 'fp8_quantize(t, "e4m3", spec.scaling, pow2'),
      [GEMMS_EXACT + "[fp8:linear]"]),
    m("fp8-scaling-ignored", "an fp8 operand's scaling = row gets one scale per tensor",
      (OPERANDS, "fp8_quantize(t, spec.element, spec.scaling, pow2", 'fp8_quantize(t, spec.element, "tensor", pow2'),
      [GEMMS_EXACT + "[fp8-rowwise:linear]", GEMMS_EXACT + "[full-rht-padded]"]),
    m("fp8-pow2-ignored", "an fp8 operand's pow2_scale = true keeps the exact scale",
      (OPERANDS, "pow2=spec.pow2_scale, amax=amax)", "pow2=False, amax=amax)"),
      [GEMMS_EXACT + "[fp8-rowwise:linear]", GEMMS_EXACT + "[full-rht-padded]"]),
    m("fp8-dtypes-swapped", "fp8's e4m3 and e5m2 name each other's torch dtype",
      ("fp4lab/numerics/fp8.py", 'FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}',
       'FP8_DTYPES = {"e4m3": torch.float8_e5m2, "e5m2": torch.float8_e4m3fn}'),
      ["tests/numerics/test_fp8.py", GEMMS_EXACT + "[fp8:linear]"]),
    m("fp8-row-amax-over-columns", "fp8 per-row scales take their amax down the columns",
      ("fp4lab/numerics/fp8.py", "magnitude.amax(dim=-1, keepdim=True)", "magnitude.amax(dim=0, keepdim=True)"),
      ["tests/numerics/test_fp8.py", GEMMS_EXACT + "[fp8-rowwise:linear]"]),
    m("fp8-outer-not-inverted", "the tensor-core path multiplies an fp8 GEMM by the scales, not their reciprocals",
      ("fp4lab/numerics/fp8.py", "FactoredValues(self.data.to(torch.float32), 1.0 / self.scale)",
       "FactoredValues(self.data.to(torch.float32), self.scale)"),
      ["tests/nn/test_tensor_cores.py::test_fp4_linear_tensor_cores_match_reference[cpu-fp8]",
       "tests/nn/test_tensor_cores.py::test_tensor_core_gemm_equals_fp32_emulation[cpu-fprop-fp8-rowwise]"]),
    m("fp8-not-probed", "probes skip fp8 operands (is_fp4 where is_quantized is meant)",
      (LIN, "        if self.probe and spec.is_quantized:\n            encoded = encode_operand(t, spec, signs, generator)\n"
            "            self.record(operand,",
       "        if self.probe and spec.is_fp4:\n            encoded = encode_operand(t, spec, signs, generator)\n"
       "            self.record(operand,"),
      ["tests/nn/test_fp4_linear.py::test_fp8_operands_are_probed_and_decode_as_their_quantizer"]),
    m("fp8-counts-as-high-precision", "an all-fp8 linear counts as high precision (no LoRA-SVD, no FP8 checks)",
      (RECIPE, "return not any(self.operand(name).is_quantized for name in OPERANDS)",
       "return not any(self.operand(name).is_fp4 for name in OPERANDS)"),
      ["tests/nn/test_recipe.py::test_fp8_recipes_are_te_hybrid_and_torchao_rowwise"]),
    m("fp8-keys-accepted-elsewhere", "element / scaling silently accepted on non-fp8 operands",
      (RECIPE, 'if fmt != "fp8" and any(k in table for k in FP8_KEYS):', "if False:"),
      ["tests/nn/test_recipe.py::test_bad_recipes_name_file_and_key"]),
    m("full-rht-signs-unsigned", "rhtfull draws no random signs (plain H over the padded dim)",
      (LIN, 'return hadamard_signs(transform_length(recipe, gemm, length), "random", generator)',
       'return hadamard_signs(transform_length(recipe, gemm, length), "none")'),
      [GEMMS_EXACT + "[optitrain:linear]", GEMMS_EXACT + "[full-rht-padded]"]),
    m("full-rht-pad-not-zero", "the full RHT pads the contraction dim with ones, not zeros",
      ("fp4lab/numerics/hadamard.py", "y = F.pad(x.to(torch.float32), (0, n - x.shape[-1]))",
       "y = F.pad(x.to(torch.float32), (0, n - x.shape[-1]), value=1.0)"),
      ["tests/nn/test_fp4_linear.py::test_paired_full_transforms_leave_the_products_unchanged_on_padded_dims"]),
    m("full-rht-normalized-by-unpadded-length", "the full RHT divides by sqrt(length), not sqrt(N)",
      ("fp4lab/numerics/hadamard.py", "return _butterfly(y, n, s, inverse).reshape(*x.shape[:-1], n)",
       "return _butterfly(y, n, s, inverse).reshape(*x.shape[:-1], n) * math.sqrt(n / x.shape[-1])"),
      ["tests/nn/test_fp4_linear.py::test_paired_full_transforms_leave_the_products_unchanged_on_padded_dims",
       GEMMS_EXACT + "[full-rht-padded]"]),
    m("full-rht-no-block-floor", "the full RHT pads a short dim to a power of two below the FP4 block",
      (OPERANDS, "return max(1 << (length - 1).bit_length(), *blocks, 1)", "return max(1 << (length - 1).bit_length(), 1)"),
      ["tests/nn/test_fp4_linear.py::test_full_transform_pads_to_at_least_the_fp4_block_and_redraws_its_signs"]),
    m("full-rht-wgrad-length-from-features", "Wgrad's full RHT sized from in_features, not the call's tokens",
      (LIN, '"wgrad": tokens}', '"wgrad": self.in_features}'),
      ["tests/nn/test_fp4_linear.py::test_full_transform_pads_to_at_least_the_fp4_block_and_redraws_its_signs"]),
    m("optitrain-blockwise-rht", "optitrain's Wgrad uses the blockwise RHT16 again",
      ("fp4lab/recipes/optitrain.toml", 'transform = "rhtfull"', 'transform = "rht16"'),
      ["tests/nn/test_recipe.py::test_optimizer_and_fullstack_switches"]),
    # --- quantization axes: linears ----------------------------------------------------------------
    m("axis-fprop-x", "Fprop's x blocked along tokens (M), not K",
      (LIN, 'x_hat = layer.consume("fprop_x", x2, signs["fprop"], g)',
       'x_hat = layer.consume("fprop_x", x2.T.contiguous(), signs["fprop"], g).T'), [LINEAR_EXACT]),
    m("axis-fprop-w", "Fprop's W blocked along N, not K",
      (LIN, 'w_enc, w_hat = None, layer.consume("fprop_w", weight, signs["fprop"], g)',
       'w_enc, w_hat = None, layer.consume("fprop_w", weight.T.contiguous(), signs["fprop"], g).T'), [LINEAR_1D, OPTIONS]),
    m("axis-dgrad-dy", "Dgrad's dy blocked along tokens (M), not N",
      (LIN, 'dy_hat = layer.consume("dgrad_dy", dy, signs["dgrad"], g)',
       'dy_hat = layer.consume("dgrad_dy", dy.T.contiguous(), signs["dgrad"], g).T'), [LINEAR_EXACT]),
    m("axis-dgrad-w", "Dgrad's W^T blocked along K, not N",
      (LIN, 'wt_hat = layer.consume("dgrad_w", weight.T.contiguous(), signs["dgrad"], g)',
       'wt_hat = layer.consume("dgrad_w", weight, signs["dgrad"], g).T'), [LINEAR_1D, OPTIONS]),
    m("axis-wgrad-dy", "Wgrad's dy^T blocked along N, not tokens",
      (LIN, 'grad_w = layer.consume("wgrad_dy", dyt, signs["wgrad"], g) @',
       'grad_w = _pad_last(layer.consume("wgrad_dy", dy, signs["wgrad"], g).T, dyt.shape[-1]) @'), [LINEAR_EXACT]),
    m("axis-wgrad-x", "Wgrad's x^T blocked along K, not tokens",
      (LIN, 'xt_enc = encode_operand(xt, recipe.wgrad_x, signs["wgrad"], g)',
       'xt_enc = decode_operand(encode_operand(xt.T.contiguous(), recipe.wgrad_x, signs["wgrad"], g)).T.contiguous()'),
      [LINEAR_EXACT]),
    m("axis-tensor-core-operands-swapped", "tensor-core Dgrad / Wgrad dy operands built with each other's spec",
      (LIN, 'layer.operand_pair(("dgrad_dy", "wgrad_dy"), dy,', 'layer.operand_pair(("wgrad_dy", "dgrad_dy"), dy,'),
      ["tests/nn/test_tensor_cores.py"]),
    # --- quantization axes: FP4 attention -----------------------------------------------------------
    m("ds-query-axis", "FP4 attention's dS for dQ blocked along the query dim, not the key dim",
      (ATTN, "return _Factored(encode(grad_scores, amax_keys)), _Factored(encode(grad_scores.transpose(-1, -2), amax_queries))",
       "return _Factored(encode(grad_scores.transpose(-1, -2), amax_queries).transpose(-1, -2)), _Factored(encode(grad_scores.transpose(-1, -2), amax_queries))"),
      [ATTN_EXACT]),
    m("ds-unquantized", "FP4 attention never quantizes dS",
      (ATTN, "if quant.ds_rounding is None or quant.format is None:", "if True:"),
      ["tests/nn/test_attention.py::test_fp4_attention_stochastic_ds_gradients_average_to_their_expectation", ATTN_EXACT]),
    m("qk-seq-axis", "FP4 attention's forward Q, K blocked along the sequence, not head_dim",
      (ATTN, "return _Factored(_fake_quant(x, quant.format))",
       "return _Factored(_fake_quant(x.transpose(-1, -2), quant.format).transpose(-1, -2))"),
      ["tests/nn/test_attention.py::test_fp4_attention_saves_fp4_q_k_and_the_unrounded_v", ATTN_EXACT]),
    m("pv-fp32", "FP4 attention's PV / dO V^T products run in fp32, not on BF16 operands",
      (ATTN, "a, b = a.to(torch.bfloat16), b.to(torch.bfloat16)", "pass"), [ATTN_EXACT]),
    m("dst-key-axis", "FP4 attention's dS^T for dK blocked along the key dim, not the query dim",
      (ATTN, "return _Factored(encode(grad_scores, amax_keys)), _Factored(encode(grad_scores.transpose(-1, -2), amax_queries))",
       "return _Factored(encode(grad_scores, amax_keys)), _Factored(encode(grad_scores, amax_keys).transpose(-1, -2))"), [ATTN_EXACT]),
    m("dst-reuses-ds", "FP4 attention's dK reads dQ's key-blocked dS, transposed, not its own dS^T",
      (ATTN, "return _Factored(encode(grad_scores, amax_keys)), _Factored(encode(grad_scores.transpose(-1, -2), amax_queries))",
       "ds = encode(grad_scores, amax_keys)\n    return _Factored(ds), _Factored(ds.transpose(-1, -2))"),
      [ATTN_EXACT]),
    m("dq-k-head-dim-axis", "FP4 attention's dQ reads K blocked along head_dim (not re-quantized along keys)",
      (ATTN, "k_keys = _quant_operand_seq(k_q, quant)", "k_keys = k_q"), [ATTN_EXACT]),
    m("dk-q-head-dim-axis", "FP4 attention's dK reads Q blocked along head_dim (not re-quantized along queries)",
      (ATTN, "q_queries = _quant_operand_seq(q_q, quant)", "q_queries = q_q"), [ATTN_EXACT]),
    m("pv-v-fp4", "FP4 attention's PV reads an FP4-rounded V",
      (ATTN, "v.repeat_interleave(group, dim=1)\n        out = q.new_empty",
       "_fake_quant(v, quant.format).repeat_interleave(group, dim=1)\n        out = q.new_empty"),
      [ATTN_EXACT]),
    m("dp-v-fp4", "FP4 attention's dO V^T reads an FP4-rounded V",
      (ATTN, "v_keys = v_heads[:, :, : rows.stop]",
       "v_keys = _fake_quant(v_heads[:, :, : rows.stop], quant.format)"),
      [ATTN_EXACT]),
    # --- FP4 attention on the fused quantizers (where Triton runs) ---------------------------------
    m("attn-fused-ds-amax-dropped", "fused FP4 attention: a chunk's dS quantized with its own NVFP4 tensor scale, not the whole dS's",
      (ATTN, 'return {"fmt": fmt, "rounding": rounding, "seed": seed, "tensor_amax": amax}',
       'return {"fmt": fmt, "rounding": rounding, "seed": seed, "tensor_amax": None}'), [ATTN_FUSED_EXACT]),
    m("attn-fused-seq-axis", "fused FP4 attention: K, Q for dQ, dK blocked along head_dim, not the sequence",
      (ATTN, "quantize_fused(decoded.reshape(-1, decoded.shape[-1]), fmt=fmt, transpose=True)",
       "quantize_fused(decoded.reshape(-1, decoded.shape[-1]), fmt=fmt).T"), [ATTN_FUSED_EXACT]),
    m("attn-fused-sr-seed-fixed", "fused FP4 attention: dS's SR seeds fixed, not drawn from the attention's generator",
      (ATTN, "torch.randint(2**62, (1,), generator=generator, device=grad_scores.device)",
       "torch.ones(1, dtype=torch.int64, device=grad_scores.device)"), [ATTN_FUSED_SR]),
    m("attn-fused-bypassed", "FP4 attention quantizes dS with the torch reference where Triton runs",
      (ATTN, "    if kernels.runs_on(grad_scores.device):\n", "    if False:\n"), [ATTN_FUSED_EXACT, ATTN_FUSED_SR]),
    m("tq-tensor-amax-ignored", "quantize_fused takes its own NVFP4 amax over a given tensor_amax",
      ((TQ, "need_row = row is not None and row.nv and given_row is None", "need_row = row is not None and row.nv"),
       (TQ, "need_col = col is not None and col.nv and given_col is None", "need_col = col is not None and col.nv")),
      [ATTN_FUSED_EXACT]),
    # --- captured GEMM operands and the per-GEMM error on them ----------------------------------------
    m("capture-step-off-by-one", "operands captured one step early (step + 1 matched against capture_steps)",
      (LOOP, "capturing = capture is not None and step in capture.steps",
       "capturing = capture is not None and step + 1 in capture.steps"), [CAPTURE_FILES, CAPTURE_REAL]),
    m("capture-dy-of-input", "the dY tensor hook sits on the layer input, capturing dX",
      (CAPTURE, "output.register_hook(grad_hook)", "x.register_hook(grad_hook)"), [CAPTURE_REAL]),
    m("capture-master-weight", "LoRA-SVD layers capture the master weight, not the residual the FP4 GEMMs read",
      (CAPTURE, "    if not linear.lora_rank:\n        return linear.weight", "    if True:\n        return linear.weight"),
      [CAPTURE_REAL]),
    m("gemm-error-dgrad-w-axis", "the diagnostic blocks Dgrad's W along K, not its contraction dim N",
      (GEMM_ERROR, "wt_hat = operand_values(w.T.contiguous(), linear.dgrad_w, signs[\"dgrad\"], generator)",
       "wt_hat = operand_values(w, linear.dgrad_w, signs[\"dgrad\"], generator).T"), [CAPTURE_EXACT]),
    # --- producer fusion: the SwiGLU fused into W2's GEMMs ------------------------------------------
    m("swiglu-fusion-unwired", "FeedForward never hands the SwiGLU to W2 (producer_fusion on changes nothing)",
      ("fp4lab/nn/model.py", 'if getattr(self.w2, "fuse_swiglu", False):', "if False:"), [FUSION_WIRE]),
    m("swiglu-wgrad-fprop-signs", "the fused SwiGLU's Wgrad operand h^T takes Fprop's Hadamard signs",
      (LIN, 'col = fused_options(self.recipe.wgrad_x, signs["wgrad"], t, self.philox_seed)',
       'col = fused_options(self.recipe.wgrad_x, signs["fprop"], t, self.philox_seed)'), [FUSION_EXACT]),
    m("swiglu-backward-swapped", "the fused SwiGLU's backward swaps d_gate and d_up",
      (LIN, "return grads.d_gate.view(ctx.x_shape), grads.d_up.view(ctx.x_shape), grad_w, None",
       "return grads.d_up.view(ctx.x_shape), grads.d_gate.view(ctx.x_shape), grad_w, None"), [FUSION_EXACT]),
    m("residual-rmsnorm-unwired", "the block never hands the residual add and RMSNorm to W1 (producer_fusion all = on)",
      ("fp4lab/nn/model.py", 'if getattr(w1, "fuse_residual_rmsnorm", False):', "if False:"), [FUSION_WIRE]),
    m("steady-throughput-all-steps", "steady tok/s (summary.json, the report) takes the median over every step, compilation included",
      ("fp4lab/train/jsonl.py", "for step, value in rates if 2 * step >= last)", "for step, value in rates)"),
      ["tests/lab/test_report.py::test_steady_throughput_is_the_median_of_the_second_half_of_the_steps",
       "tests/train/test_run_summary.py::test_summary_tokens_per_s_is_the_steady_pace_with_startup_apart"]),
    m("claims-count-interrupted-runs", "the claims count an interrupted run's last losses, validation or train",
      ("fp4lab/lab/records/ledger.py", ' and (not completed_only or by_id[i].get("state") == "completed")]', "]"),
      ["tests/lab/test_report.py::test_claims_are_set_against_the_welch_interval_of_their_recipe",
       "tests/lab/test_report.py::test_claims_against_another_recipe_by_direction_and_on_the_endpoint_train_loss"]),
    m("claims-metric-ignored", "a train claim is checked against the final validation losses",
      ("fp4lab/lab/records/claims.py", 'if metric == "val" else', "if True else"),
      ["tests/lab/test_report.py::test_claims_against_another_recipe_by_direction_and_on_the_endpoint_train_loss"]),
    m("claims-versus-ignored", "a claim against another recipe is checked against bf16",
      ("fp4lab/lab/records/claims.py", 'reference_runs = match["baseline_runs"] if reference_row is None else reference_row["runs"]',
       'reference_runs = match["baseline_runs"]'),
      ["tests/lab/test_report.py::test_claims_against_another_recipe_by_direction_and_on_the_endpoint_train_loss"]),
    m("claims-direction-loose", "a claimed direction agrees when the interval merely reaches that side of 0",
      ("fp4lab/lab/records/claims.py", 'measured = "above" if low > 0 else "below" if high < 0 else None',
       'measured = "above" if high > 0 else "below" if low < 0 else None'),
      ["tests/lab/test_report.py::test_claims_against_another_recipe_by_direction_and_on_the_endpoint_train_loss"]),
    m("endpoint-train-loss-last-step", "the endpoint train loss is the last logged loss, not the last tenth's mean",
      ("fp4lab/lab/records/run_metrics.py", "metrics.loss[-math.ceil(len(metrics.loss) / 10) :]", "metrics.loss[-1:]"),
      ["tests/lab/test_report.py::test_the_endpoint_train_loss_is_the_mean_over_the_last_tenth_of_the_logged_steps"]),
    m("ci-never-paired", "runs of the same seeds are compared by Welch's interval, not seed by seed",
      ("fp4lab/lab/records/ledger.py", "if len(seeds) >= 2 and None not in seeds", "if False"),
      ["tests/lab/test_report.py::test_matched_seeds_are_compared_pair_by_pair",
       "tests/lab/test_report.py::test_claims_against_another_recipe_by_direction_and_on_the_endpoint_train_loss"]),
    m("ci-paired-across-seeds", "a row missing a seed is still paired, against bf16 runs of other seeds",
      ("fp4lab/lab/records/ledger.py", " and sorted(seeds) == sorted(reference_seeds)", " and len(seeds) <= len(reference_seeds)"),
      ["tests/lab/test_report.py::test_matched_seeds_are_compared_pair_by_pair"]),
    m("ratchet-recommits-a-recorded-keep", "a ratchet killed right after committing a kept change applies it again on restart",
      ("fp4lab/lab/ratchet/loop.py", 'committed = clean and repo.git(self.worktree, "rev-parse", "HEAD^{tree}") == extra.get("tree")',
       "committed = False"),
      ["tests/lab/test_ratchet.py::test_a_ratchet_killed_between_its_commit_and_recording_it_adopts_that_commit"]),
    m("ratchet-sigma-gate-removed", "rule sigma keeps any gain, however small against k x sigma",
      ("fp4lab/lab/ratchet/loop.py", "gain, gate = self.program.improvement(outcome.values[0], reference), noise.k * sigma",
       "gain, gate = self.program.improvement(outcome.values[0], reference), 0.0"),
      ["tests/lab/test_ratchet_gate.py::test_rule_sigma_discards_a_gain_under_k_sigma_and_keeps_one_over_it"]),
    m("ratchet-sigma-compares-the-mean", "rule sigma compares a one-seed run with the best's mean over seeds",
      ("fp4lab/lab/ratchet/loop.py", "reference = best_values[0] if best_values and best_values[0] is not None else best",
       "reference = best"),
      ["tests/lab/test_ratchet_gate.py::test_rule_sigma_discards_a_gain_under_k_sigma_and_keeps_one_over_it"]),
    m("ratchet-paired-confidence-ignored", "rule paired keeps a change more likely better than not, whatever the confidence",
      ("fp4lab/lab/ratchet/loop.py", "keep = chance >= noise.confidence", "keep = chance > 0.5"),
      ["tests/lab/test_ratchet_gate.py::test_rule_paired_discards_a_gain_below_the_confidence_and_keeps_one_above"]),
    m("interrupted-is-timeout", "a run stopped by Ctrl-C, a terminated sweep or a preemption is judged timeout",
      ("fp4lab/lab/records/logscan.py", 'return "timeout" if ran_out else "interrupted", None,', 'return "timeout", None,'),
      ["tests/lab/test_logscan.py::test_stopped_statuses"]),
    m("status-hides-ratchets", "fp4lab status leaves ratchet iterations out",
      ("fp4lab/cli/sweep.py", "    for record in runs_catalog.records(sweep=sweep_name, per_sweep=True):\n        step, loss",
       "    for record in [r for r in runs_catalog.records(sweep=sweep_name, per_sweep=True) if not (r['sweep'] or '').startswith('ratchet/')]:\n        step, loss"),
      ["tests/lab/test_ratchet_gate.py::test_rule_sigma_discards_a_gain_under_k_sigma_and_keeps_one_over_it"]),
    m("tables-keep-constant-columns", "run tables repeat a constant column on every row instead of saying it once",
      ("fp4lab/lab/records/tables.py", "if fold_constant and len(rows) > 1 and len(values) == 1 and not column.identifies:",
       "if False:"),
      ["tests/cli/test_terminal.py::test_a_sweep_interrupted_and_resumed_reads_right_at_80_columns"]),
    m("no-did-you-mean", "an unknown key is refused without naming the close allowed one",
      ("fp4lab/validation.py", "    return f\" (did you mean {names[close[0]]!r}?)\" if close else \"\"", "    return \"\""),
      ["tests/lab/test_validation.py::test_checks_say_the_words_of_the_rules"]),
    m("bench-runs-every-suite", "fp4lab bench with no argument runs all five suites, not kernels and steps",
      ("fp4lab/cli/bench.py", "chosen = DEFAULT_SUITES if what is None else", "chosen = SUITES if what is None else"),
      ["tests/cli/test_cli.py::test_bench_on_the_cpu_times_kernels_and_steps_beside_the_anchor"]),
    m("lock-file-left-behind", "a finished trainer leaves its trainer.lock, and a refused one the folder it made",
      ("fp4lab/train/run_folder.py", "        path.unlink(missing_ok=True)\n        if created", "        if created"),
      ["tests/train/test_capture.py::test_capture_config_is_validated_and_result_neutral",
       "tests/train/test_kernel_choice.py::test_the_train_and_bench_flags_reach_the_choice"]),
    m("fused-cta-not-covered", "CTA-local NVFP4 operands go to the torch quantizer, not the fused kernels",
      (KERNELS, 'if spec.format not in ("mxfp4", "nvfp4", "nvfp4_cta") or', 'if spec.format not in ("mxfp4", "nvfp4") or'),
      [CTA_FUSED]),
    m("fused-cta-tile-dropped", "the fused kernels get the default CTA tile, not the recipe's cta_tile",
      (OPERANDS, 'options["cta_tile"] = spec.cta_tile', 'options["cta_tile"] = None'), [CTA_FUSED]),
    m("fused-cta-amax-one-slot", "the fused amax pass folds every row into one CTA tile's slot (a tensor amax)",
      (TQ, "tl.atomic_max(r_amax + rows // R_CTA, row_amax, mask=rows < R)", "tl.atomic_max(r_amax + rows * 0, row_amax, mask=rows < R)"),
      [TQ_INTERPRETED, CTA_FUSED]),
    m("fused-cta-outer-first-row-only", "the fused kernels store the CTA-local outer scale of the first row of programs only",
      (TQ, "            if first_col:\n                tl.store(outer_ptr + rows, outer, mask=inside)",
       "            if first_col & first_row:\n                tl.store(outer_ptr + rows, outer, mask=inside)"),
      [CTA_FUSED]),
    m("fused-cta-probe-tensor-scales", "a probe counts the fused CTA-local operand against the first row's outer scale everywhere",
      (TQ, "per_row = outer[:, :, None] if NV > 1 else outer", "per_row = outer[:1, :, None] if NV > 1 else outer"),
      [CTA_FUSED, PROBE_COUNTS]),
    m("ratchet-command-imports-the-checkout", "a ratchet command run imports the installed checkout, not the worktree under test",
      ("fp4lab/lab/ratchet/loop.py", "command = WorktreeCommand(list(run.command), tree, worktree_first(env, tree),",
       "command = WorktreeCommand(list(run.command), tree, env,"),
      ["tests/lab/test_ratchet_gate.py::test_a_command_measures_the_worktrees_code_even_when_it_imports_from_outside_the_tree"]),
    m("fused-encode-drops-transform", "kernels.encode's fused path quantizes x without its Hadamard transform",
      ("fp4lab/numerics/kernels/__init__.py", "fmt=fmt, signs=signs, tensor_amax=tensor_amax,", "fmt=fmt, signs=None, tensor_amax=tensor_amax,"),
      ["tests/optim/test_optim.py::test_fused_nvfp4_adam_v_equals_the_reference_under_the_interpreter"]),
    m("tile-sr-uniforms-reversed", "the 2D-tile kernel rounds up where the uniform says down (1 - u for u)",
      (TQ, "q = _round_stochastic(q, a, magic_bits, tl.reshape(u, [BR // TH, TH, BC // TW, TW]))",
       "q = _round_stochastic(q, a, magic_bits, tl.reshape(1.0 - u, [BR // TH, TH, BC // TW, TW]))"), [TQ_INTERPRETED]),
    m("hadamard-amax-unscaled", "the full Hadamard kernel's NVFP4 amax is taken before the 1 / sqrt(N) scale",
      ("fp4lab/numerics/kernels/hadamard.py", "tl.max(_finite_row_amax(y, None, BR, N, 0), axis=0)", "tl.max(_finite_row_amax(y / scale, None, BR, N, 0), axis=0)"),
      ["tests/kernels/test_triton_hadamard.py::test_kernel_matches_the_reference_and_full_transform_operands_take_it_under_the_interpreter"]),
    m("full-transform-transposed-copy", "full-transform Wgrad operands are copied transposed before the Hadamard kernel",
      ("fp4lab/nn/fp4_linear.py", "col = t.T if in_place else _pad_last(t.T, multiple)", "col = _pad_last(t.T, multiple)"),
      ["tests/kernels/test_triton_hadamard.py::test_kernel_matches_the_reference_and_full_transform_operands_take_it_under_the_interpreter"]),
    m("saved-xt-as-values", "Wgrad's x^T made on its own (the full transform's path) is saved as bf16 values, not packed",
      ("fp4lab/nn/fp4_linear.py", "self.operand(col_name, col, signs[1], generator, saved_only=keep_packed)", "self.operand(col_name, col, signs[1], generator)"),
      ["tests/nn/test_tensor_cores.py::test_optitrain_operands_come_from_the_kernels_and_saved_ones_are_packed_under_the_interpreter"]),
    m("tile-sr-not-covered", "the layers send stochastically rounded 2D weight tiles to the torch reference",
      ("fp4lab/numerics/kernels/__init__.py", 'return spec.transform == "none" and all(', 'return spec.rounding == "rtn" and spec.transform == "none" and all('),
      ["tests/nn/test_tensor_cores.py::test_kernel_coverage_follows_what_the_fused_quantizer_supports",
       "tests/nn/test_tensor_cores.py::test_optitrain_operands_come_from_the_kernels_and_saved_ones_are_packed_under_the_interpreter"]),
    m("hadamard-amax-not-passed", "the layer drops the Hadamard kernel's amax: the quantizer takes its own read again",
      ("fp4lab/nn/fp4_linear.py", "        if options is not None and tensor_amax is not None:\n            options[\"tensor_amax\"] = tensor_amax\n", ""),
      ["tests/nn/test_tensor_cores.py::test_optitrain_operands_come_from_the_kernels_and_saved_ones_are_packed_under_the_interpreter"]),
    m("probe-counts-without-outer", "the fused quantizers' probe counts decode without the NVFP4 outer scale",
      (TQ, "(q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * decode * outer",
       "(q.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True) * decode"), [PROBE_COUNTS]),
    m("tile-gemm-squares-not-transposed", "Dgrad's W^T keeps W's grid of square scales untransposed",
      (OPERANDS, "outer = self.outer.T if self.outer_cell is not None else self.outer", "outer = self.outer"),
      [TILE_TESTS + "::test_tensor_core_operands_of_cta_local_weights_stay_bf16_and_match_the_reference[dgrad-cpu]", CTA_MATCH]),
    m("tile-gemm-first-chunk-scale", "the reference scales every chunk of K by its first square's scale",
      (TILE_GEMM, "acc = acc + (a32[:, cols] @ b32[:, cols].T) * per_row[:, chunk]", "acc = acc + (a32[:, cols] @ b32[:, cols].T) * per_row[:, 0]"),
      [TILE_TESTS + "::test_each_square_scales_only_its_own_chunk", CTA_MATCH]),
    m("tile-kernel-first-chunk-scale", "the kernel scales every chunk of K by its first square's scale",
      (TILE_KERNEL, "scale = tl.load(square_rows + chunk * stride_ck, mask=in_b, other=0.0)", "scale = tl.load(square_rows, mask=in_b, other=0.0)"),
      [TILE_INTERPRETED]),
    m("tile-kernel-one-square-row", "the kernel reads every row of b's scales from the first row of squares",
      (TILE_KERNEL, "square_rows = cells_ptr + (rows_b // CELL) * stride_cn", "square_rows = cells_ptr + (rows_b * 0) * stride_cn"),
      [TILE_INTERPRETED]),
    m("tile-kernel-row-outer-as-scalar", "the kernel multiplies every row by a's first outer scale",
      (TILE_KERNEL, "acc = acc * tl.load(outer_ptr + rows_a, mask=in_a, other=0.0)[:, None]", "acc = acc * tl.load(outer_ptr)"),
      [TILE_INTERPRETED]),
    m("tile-gemm-not-routed", "tensor_core_mm ignores per-square outer scales (treats them as a per-row alpha)",
      (GEMM, "    if b.outer_cell is not None:\n        return tile_scaled_mm(a, b, out_dtype)\n", ""),
      [CTA_MATCH, TILE_TESTS + "::test_tensor_core_operands_of_cta_local_weights_stay_bf16_and_match_the_reference[fprop-cpu]"]),
    m("tile-gemm-kernel-never-taken", "CTA-local weights' GEMMs stay on the torch reference where Triton runs",
      (GEMM, "if a.values.dtype == b.values.dtype == torch.bfloat16 and runs_on(a.values.device):", "if False:"),
      [TILE_WIRE]),
    m("tile-gemm-squares-dropped", "gemm_operand drops the square side of a 2D CTA-local weight's outer scale",
      (OPERANDS, "return GemmOperand(parts.values.to(torch.bfloat16), parts.outer, packed, parts.outer_cell)",
       "return GemmOperand(parts.values.to(torch.bfloat16), parts.outer, packed)"),
      [CTA_MATCH]),
    m("fp8-fused-e5m2-grid", "the fused FP8 quantizer rounds E5M2 onto a grid of 3 mantissa bits",
      (FP8_KERNEL, '_GRIDS = {"e4m3": (3, -6), "e5m2": (2, -14)}', '_GRIDS = {"e4m3": (3, -6), "e5m2": (3, -14)}'), [FP8_INTERPRETED]),
    m("fp8-fused-no-subnormals", "the fused FP8 quantizer rounds below the smallest normal as if the binades went on",
      (FP8_KERNEL, "tl.maximum(a.to(tl.int32, bitcast=True) & 0x7F800000, MIN_NORMAL_BITS)", "(a.to(tl.int32, bitcast=True) & 0x7F800000)"),
      [FP8_INTERPRETED]),
    m("fp8-fused-transposed-row-scale", "the fused FP8 quantizer scales x^T's rows by x's row scales",
      (FP8_KERNEL, "mode = _SCALAR if scaling == \"tensor\" else _PER_COL if transpose else _PER_ROW",
       "mode = _SCALAR if scaling == \"tensor\" else _PER_ROW"), [FP8_INTERPRETED]),
    m("fp8-fused-not-taken", "FP8 operands stay on the torch quantizer where the fused one runs",
      (LIN, "        if self.takes_fused_fp8(spec, signs, t):\n            return self._fused_fp8(t, [(spec, False)])[0]\n", ""), [FP8_WIRE]),
    m("fp8-amax-nan-lost", "the FP8 amax pass reduces with a float max that drops a NaN",
      (FP8_KERNEL, "bits = tl.abs(x).to(tl.int32, bitcast=True)", "bits = tl.where(x != x, 0.0, tl.abs(x)).to(tl.int32, bitcast=True)"),
      [FP8_AMAX]),
    m("fp8-pair-amax-not-shared", "an FP8 operand pair takes two amax passes over the same tensor",
      (LIN, "amax_bits=amaxes[amax_of(spec, transposed)])", "amax_bits=None)"), [FP8_WIRE]),
    m("full-transform-kernel-not-taken", "a full-dimension transform stays on the torch butterfly where its kernel runs",
      (LIN, "        return fits(signs.numel())\n", "        return False\n"),
      ["tests/kernels/test_triton_hadamard.py::test_kernel_matches_the_reference_and_full_transform_operands_take_it_under_the_interpreter"]),
    m("full-transform-kernel-pair-swapped", "the Hadamard kernel's butterfly writes (a - b, a + b) for (a, b)",
      ("fp4lab/numerics/kernels/hadamard.py", "tl.join(a + b, a - b)", "tl.join(a - b, a + b)"),
      ["tests/kernels/test_triton_hadamard.py::test_kernel_matches_the_reference_and_full_transform_operands_take_it_under_the_interpreter"]),
    m("checkpoint-one-generation", "a one-process save replaces the checkpoint without keeping the generation before",
      ("fp4lab/train/checkpoint.py", "            keep_previous=out / PREVIOUS_CHECKPOINT,\n", ""),
      [FAULTS + "test_a_damaged_newest_checkpoint_falls_back_to_the_previous_and_resumes_exactly"]),
    m("checkpoint-no-fallback", "resuming reads only the newest checkpoint, damaged or not",
      ("fp4lab/train/checkpoint.py", "    for path in (out / CHECKPOINT, out / PREVIOUS_CHECKPOINT):\n", "    for path in (out / CHECKPOINT,):\n"),
      [FAULTS + "test_a_damaged_newest_checkpoint_falls_back_to_the_previous_and_resumes_exactly"]),
    m("checkpoint-saved-twice-at-a-stop", "a run stopped right after a periodic save saves the same step again",
      (LOOP, "                    if not saved:  # saving this step again would push its previous generation out\n"
             "                        save_run(", "                    if True:\n                        save_run("),
      [FAULTS + "test_a_damaged_newest_checkpoint_falls_back_to_the_previous_and_resumes_exactly"]),
    m("no-space-not-recognised", "a write that meets a full disk raises the library's own words (torch: 'unexpected pos')",
      ("fp4lab/train/atomic.py", "        if full is not None:\n            raise no_space_left(", "        if False:\n            raise no_space_left("),
      [FAULTS + "test_a_disk_that_fills_while_checkpointing_says_so_keeps_the_last_checkpoint_and_records_why"]),
    m("graph-generator-replaced", "restoring a layer's state swaps in a new generator, which a captured graph never sees",
      (LIN, "            if self._generator is None or not _same_device(self._generator.device, self.weight.device):\n",
       "            if True:\n"), ["tests/nn/test_tensor_cores.py::test_restoring_a_layer_state_keeps_its_generator_object"]),
    m("fp8-fused-pair-not-taken", "an FP8 operand pair quantizes t^T from a transposed view instead of in the kernel",
      (LIN, "and self.takes_fused_fp8(row_spec, signs[0], t) and self.takes_fused_fp8(col_spec, signs[1], t)",
       "and False"), [FP8_WIRE]),
    m("fp8-fused-while-probing", "a probing step takes the fused FP8 quantizer, whose operands the probes never see",
      (LIN, "and not self.probe\n                and fp8_kernel_runs(t))", "\n                and fp8_kernel_runs(t))"), [FP8_WIRE]),
    m("fused-cta-square-one-row", "the fused 2D CTA-local quantizer puts every row of tiles in the first row of squares",
      (TQ, "slots = (tile_rows // SQUARE)[:, None] * tl.cdiv(C, SQUARE) + (tile_cols // SQUARE)[None, :]",
       "slots = (tile_rows * 0)[:, None] * tl.cdiv(C, SQUARE) + (tile_cols // SQUARE)[None, :]"), [TQ_INTERPRETED, CTA_2D_FUSED]),
    m("fused-cta-square-amax-one-slot", "the fused 2D CTA-local amax pass folds every tile into the first square's slot",
      (TQ, "tl.atomic_max(r_amax + slots, tile_amax, mask=inside)", "tl.atomic_max(r_amax + slots * 0, tile_amax, mask=inside)"),
      [TQ_INTERPRETED, CTA_2D_FUSED]),
    m("fused-cta-2d-not-covered", "2D CTA-local weights stay on the torch quantizer",
      (KERNELS, "    return spec.transform == \"none\" and all(",
       "    return spec.format != \"nvfp4_cta\" and spec.transform == \"none\" and all("),
      [CTA_2D_FUSED]),
    m("fused-cta-2d-squares-dropped", "the fused 2D CTA-local weight's operand forgets that its outer scale is per square",
      (LIN, "outer_cell = (options.get(\"cta_tile\") or DEFAULT_CTA_TILE) if", "outer_cell = None if"), [CTA_2D_FUSED]),
    m("fusion-marks-bf16-layers", "build_model marks bf16 W1s for the fused norm (a graph break that only falls back)",
      (BUILD, " and w1.x_operands_fusable(shared=True)", ""), [FUSION_WIRE]),
    m("residual-rmsnorm-not-offered", "the fused norm's operands are not offered to W1 and W3, which quantize again",
      (LIN, "SIBLING_OPERANDS.put(normed, self.sibling_key(normed), operands)", "del operands"), [NORM_EXACT]),
    m("residual-rmsnorm-no-gain-grad", "the fused norm's backward drops the gain's gradient",
      (FUSION_REF, "grad_weight = (grad_normed.float() * t.to(s.dtype).float()).sum(0).to(weight.dtype)",
       "grad_weight = torch.zeros_like(weight)"), [NORM_EXACT, NORM_BACKWARD]),
    m("rmsnorm-backward-no-projection", "the fused norm's backward drops the - t mean(dt t) projection",
      (FUSION_REF, "ds = rstd[:, None] * (dt - t * (dt * t).sum(-1, keepdim=True) / s.shape[-1])", "ds = rstd[:, None] * dt"),
      [NORM_BACKWARD]),
    m("rmsnorm-sum-unpinned", "the reference sums the 32 lanes with torch's own sum, not by halving",
      (FUSION_REF, "        half = t.shape[1] // 2\n        t = t[:, :half] + t[:, half:]\n", "        t = t.sum(1, keepdim=True)\n"),
      ["tests/kernels/test_triton_fusion.py::test_rmsnorm_reference_sums_in_lanes_then_by_halving"]),
    m("sweep-workers-share-gpus", "concurrent local runs are not given GPUs of their own",
      ("fp4lab/lab/runs/executors.py", 'env["CUDA_VISIBLE_DEVICES"] = gpus', "pass"),
      ["tests/lab/test_sweep.py::test_local_sweep_runs_scans_records_and_skips_completed_runs"]),
    # --- the MXFP4 GEMM on FP8 tensor cores (run by Triton's interpreter on the CPU) -----------------
    m("mx-gemm-second-block-scales", "the second K block of a step is scaled by the first block's scale bytes",
      (MX_GEMM, "p1, a_scales, b_scales, rows_a, rows_b, M, N, kb + 1, SPLIT)", "p1, a_scales, b_scales, rows_a, rows_b, M, N, kb, SPLIT)"),
      [MX_INTERPRETED]),
    m("mx-gemm-no-split", "tiles with A scale bytes above 2^117 skip the overflow-safe split of 2^(ea + eb)",
      (MX_GEMM, "<= ROW_FIRST_MAX_BYTE:", "<= 255:"), [MX_INTERPRETED]),
    m("scan-entropy-three-probes", "the entropy rule's relative test waits for three earlier probes again",
      ("fp4lab/lab/records/logscan.py", "entropy_min_probes: int = 1", "entropy_min_probes: int = 3"),
      ["tests/lab/test_logscan.py::test_entropy_collapse_before_the_second_probe"]),
    m("scan-spike-four-losses", "the loss ratio rule waits for four earlier losses again",
      ("fp4lab/lab/records/logscan.py", "spike_ratio_min_count: int = 1", "spike_ratio_min_count: int = 4"),
      ["tests/lab/test_logscan.py::test_ratio_rule_needs_only_a_handful_of_points"]),
    m("status-rescan-ignored", "fp4lab status --rescan judges nothing again",
      ("fp4lab/cli/sweep.py", "        if rescan:\n", "        if False:\n"),
      ["tests/lab/test_sweep_trust.py::test_status_rescan_judges_ended_runs_again_with_the_current_scanner"]),
    m("scan-runaway-not-diverged", "a finite loss that ends far above its start is no longer judged diverged",
      ("fp4lab/lab/records/logscan.py", 'if "nan" in first_step or "loss_above_start" in first_step or status == "diverged":',
       'if "nan" in first_step or status == "diverged":'),
      ["tests/lab/test_logscan.py::test_a_finite_loss_that_runs_away_for_good_is_diverged"]),
    m("scan-runaway-recovery-kept", "a runaway loss that recovers is still flagged at the end",
      ("fp4lab/lab/records/logscan.py", "            self.above_start = None\n            return\n", "            return\n"),
      ["tests/lab/test_logscan.py::test_a_loss_that_runs_away_and_recovers_is_not_diverged"]),
    m("sweep-startup-ctrl-c-failed", "a Ctrl-C during a run's start-up records it failed, so the next sweep skips it",
      ("fp4lab/lab/runs/job.py", 'returncode=130, state="interrupted")', "returncode=130)"),
      ["tests/lab/test_sweep_trust.py::test_ctrl_c_during_start_up_leaves_the_run_interrupted_so_the_next_sweep_runs_it"]),
    m("sweep-child-ctrl-c-failed", "a training process the sweep's Ctrl-C stops in start-up is recorded failed",
      ("fp4lab/lab/runs/executors.py", "        if self.stopping.is_set():\n            # Our SIGINT", "        if False:\n            # Our SIGINT"),
      ["tests/lab/test_sweep_trust.py::test_ctrl_c_while_a_training_process_starts_up_leaves_its_run_interrupted"]),
    m("report-first-event-by-name", "events at one step are ordered by name, not by the scanner's order of kinds",
      ("fp4lab/lab/records/ledger.py", "min(bad, key=_event_order)", "min(bad)"),
      ["tests/lab/test_report.py::test_seeds_are_grouped_with_mean_and_std"]),
    m("report-excess-plot-unfinished", "the loss-excess plot averages interrupted runs with the completed ones",
      ("fp4lab/lab/records/plots.py", "if i in report.metrics and i in completed]", "if i in report.metrics]"),
      ["tests/lab/test_report.py::test_losses_and_throughput_come_from_completed_runs_only"]),
    m("report-unfinished-losses", "the ledger averages the last losses of interrupted runs with the completed ones",
      ("fp4lab/lab/records/ledger.py", "ended = [r for r in members if r.get(\"state\") == \"completed\"]", "ended = members"),
      ["tests/lab/test_report.py::test_losses_and_throughput_come_from_completed_runs_only"]),
    m("report-page-cdn-stylesheet", "report.html loads a stylesheet from a CDN: the page sent round needs the network",
      ("fp4lab/lab/records/render.py", '<html><head><meta charset="utf-8">',
       '<html><head><meta charset="utf-8"><link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/water.css@2">'),
      ["tests/lab/test_report_page.py::test_the_sweep_report_reads_whole_and_offline_in_a_browser"]),
    m("report-page-plots-not-drawn", "report.html embeds its plots but the browser draws none of them",
      ("fp4lab/lab/records/render.py", "img{max-width:100%}", "img{max-width:100%;display:none}"),
      ["tests/lab/test_report_page.py::test_the_sweep_report_reads_whole_and_offline_in_a_browser"]),
    m("mx-gemm-scales-row-major", "the kernel reads the scale bytes row-major, not block-major",
      (MX_GEMM, "a.scales.T.contiguous(), e4m3_values(b.data), b.scales.T.contiguous()",
       "a.scales.contiguous(), e4m3_values(b.data), b.scales.contiguous()"), [MX_INTERPRETED]),
    m("own-corpus-split-inverted", "the corpus of your own holds out the documents it should train on",
      (USER_CORPUS, "(document_key(d) <= split.val_threshold) == validation", "(document_key(d) > split.val_threshold) == validation"),
      [f"{OWN}test_a_bpe_build_holds_the_split_documents_and_its_manifest_matches_the_files"]),
    m("own-corpus-split-fraction", "the corpus of your own holds out one document whatever the fraction",
      (USER_CORPUS, "max(1, round(distinct.size * VAL_FRACTION))", "1"),
      [f"{OWN}test_a_bpe_build_holds_the_split_documents_and_its_manifest_matches_the_files"]),
    m("own-corpus-overwrite-unchecked", "another build under the same name is taken for the corpus already built",
      (USER_CORPUS, "        if _identity(built) == identity:\n", "        if True:\n"),
      [f"{OWN}test_another_build_under_the_same_name_is_refused_with_nothing_changed",
       "tests/cli/test_data.py::test_build_refuse_train_and_sweep_on_your_own_corpus"]),
    m("own-corpus-no-resume", "an interrupted build's staging folder is always emptied",
      ("fp4lab/train/corpus.py", "    if key is None or _staged_identity(folder) != key:", "    if True:"),
      [f"{OWN}test_an_interrupted_build_continues_from_what_it_finished"]),
    m("own-corpus-resume-any-build", "a staging folder of another build is continued",
      ("fp4lab/train/corpus.py", "    if key is None or _staged_identity(folder) != key:", "    if key is None:"),
      [f"{OWN}test_a_staging_folder_of_another_build_is_not_reused"]),
    m("own-corpus-always-uint16", "a vocabulary over 65536 ids is stored as uint16",
      ("fp4lab/train/corpus.py", 'return "uint16" if vocab_size <= 1 << 16 else "uint32"', 'return "uint16"'),
      [f"{OWN}test_a_vocabulary_over_65536_is_stored_as_uint32"]),
    m("own-corpus-hf-truncates", "a Hugging Face tokenizer's truncation is kept, cutting long documents short",
      (USER_CORPUS, "    tokenizer.no_truncation()  #", "    pass  #"),
      [f"{OWN}test_an_hf_tokenizer_from_a_folder_gives_the_tokens_of_the_same_bpe_never_truncated"]),
    m("own-corpus-not-a-source", "a corpus name is read as a path to a token file",
      ("fp4lab/train/data.py", "    if is_corpus_name(cfg.source):\n        return load_own_corpus", "    if False:\n        return load_own_corpus"),
      [f"{OWN}test_a_built_corpus_is_a_data_source_by_its_name", "tests/cli/test_data.py::test_build_refuse_train_and_sweep_on_your_own_corpus"]),
    m("own-corpus-preflight-blind", "a sweep naming a corpus that is not built is not stopped before it runs",
      ("fp4lab/lab/runs/sweep.py", "            if problem:\n                problems[f\"corpus:{source}\"]", "            if False:\n                problems[f\"corpus:{source}\"]"),
      ["tests/cli/test_data.py::test_build_refuse_train_and_sweep_on_your_own_corpus"]),
    # --- fp4lab export --format hf (issue 38) ---------------------------------------------------------
    m("export-no-rotary-permutation", "wq and wk exported in fp4lab's interleaved RoPE layout, not HF's halves",
      (EXPORT, "return weight.reshape(n_heads, rows // n_heads // 2, 2, columns).transpose(1, 2).reshape(rows, columns)",
       "return weight"),
      [EXPORT_LOGITS, EXPORTED + "test_rotate_half_rows_turns_fp4lab_rope_into_hf_rope"]),
    m("export-wk-not-rotated", "only wq is permuted for HF's RoPE, wk stays interleaved",
      (EXPORT, "tensor = rotate_half_rows(tensor, config.n_kv_heads)", "tensor = tensor"), [EXPORT_LOGITS]),
    m("export-gate-up-swapped", "w1 exported as up_proj and w3 as gate_proj",
      (EXPORT, '"feed_forward.w1.weight": "mlp.gate_proj.weight",\n    "feed_forward.w3.weight": "mlp.up_proj.weight",',
       '"feed_forward.w1.weight": "mlp.up_proj.weight",\n    "feed_forward.w3.weight": "mlp.gate_proj.weight",'),
      [EXPORT_LOGITS]),
    m("export-norm-eps-dropped", "config.json misses rms_norm_eps: HF's Llama takes its default 1e-6",
      (EXPORT, '"norm_eps": "rms_norm_eps",', '"norm_eps": "norm_eps",'), [EXPORT_LOGITS]),
    m("export-lora-factors-unknown", "the LoRA-SVD factors are not known as a split of W: a fullstack run is refused",
      (EXPORT, 'LEFT_OUT = ("lora_u", "lora_v")', "LEFT_OUT = ()"),
      [EXPORTED + "test_an_fp4_run_exports_its_master_weights_and_names_its_recipe"]),
    m("export-model-field-ignored", "a ModelConfig field LlamaConfig cannot express is exported silently",
      (EXPORT, "unknown = [name for name in model if name not in LLAMA_KEYS]", "unknown = []"),
      [EXPORTED + "test_what_cannot_be_exported_right_is_refused_and_nothing_is_written[model-field]"]),
    m("export-out-overwritten", "a non-empty OUT is replaced without --force",
      (EXPORT, "if out.is_dir() and any(out.iterdir()) and not force:", "if False:"),
      [EXPORTED + "test_out_must_be_new_or_empty_unless_forced_and_never_holds_the_run"]),
    m("export-tokenizer-unchecked", "a tokenizer rebuilt with other token counts than the run's is exported as the run's",
      (EXPORT, "if trained_on != len(dataset.train):", "if False:"),
      [EXPORTED + "test_what_cannot_be_exported_right_is_refused_and_nothing_is_written[other-tokenizer]"]),
    m("saved-model-dcp-names", "a sharded checkpoint's tensors are read under DCP's flattened names (model. in front)",
      ("fp4lab/train/checkpoint.py", 'key.removeprefix("model."): torch.empty', "key: torch.empty"),
      [EXPORTED + "test_a_sharded_checkpoint_exports_the_same_weights"]),
    # --- trackers (issue 38) ---------------------------------------------------------------------------
    m("tracker-no-purge", "a resumed run's TensorBoard events keep the steps logged after its last checkpoint",
      (TRACKERS, "SummaryWriter(str(out), purge_step=resume_step or None)", "SummaryWriter(str(out))"),
      [TRACKED + "test_a_stopped_and_resumed_run_is_one_tracker_run"]),
    m("tracker-new-mlflow-run-on-resume", "a resumed run opens a new MLflow run instead of its own",
      (TRACKERS, '        if kept.get("run_id"):', "        if False:"),
      [TRACKED + "test_a_stopped_and_resumed_run_is_one_tracker_run"]),
    m("tracker-sweep-group-unset", "a sweep's runs are not filed under the sweep's name and their ids",
      ("fp4lab/lab/specs/sweep_spec.py", '    if config.get("log_to"):  # trackers', '    if False:  # trackers'),
      [TRACKED + "test_a_sweep_files_its_runs_in_each_tracker_by_sweep_and_id"]),
    m("tracker-failure-stops-nothing", "a tracker that fails is kept and fails again at every record",
      (TRACKERS, "            self.trackers.pop(name)\n", ""),
      [TRACKED + "test_a_tracker_that_breaks_mid_run_is_reported_once_and_the_run_goes_on"]),
    m("environment-mix-unflagged", "a ledger row whose runs came from two environments is not flagged",
      ("fp4lab/lab/records/ledger.py", 'if len(used) > 1 and members[0].get("recipe") != BASELINE:', "if False:"),
      ["tests/train/test_environment.py::test_the_report_names_each_environment_and_flags_a_mixed_comparison"]),
    # --- early stopping of Optuna trials (issue 38) -------------------------------------------------------
    m("pruner-ignored", "the loop asks the pruner but trains on when it says stop",
      (LOOP, "    if pruned:\n        return \"pruned\"\n", ""),
      [PRUNING + "test_a_run_reports_each_eval_and_stops_cleanly_when_its_pruner_says"]),
    m("pruner-never-asked", "the loop never reports a validation loss to its trial",
      (LOOP, 'pruned = run.trial is not None and "val_loss" in record', 'pruned = run.trial is not None and "no_such_key" in record'),
      [PRUNING + "test_a_run_reports_each_eval_and_stops_cleanly_when_its_pruner_says"]),
    m("pruner-reports-twice", "a resumed run reports again the evals its earlier segment reported",
      ("fp4lab/train/pruning.py", "        if step not in self._storage.get_trial(self._trial_id).intermediate_values:\n",
       "        if True:\n"),
      [PRUNING + "test_a_run_its_pruner_keeps_trains_to_the_end_and_reports_every_eval_once_across_a_resume"]),
    m("pruned-recorded-completed", "a pruned run is recorded as completed in the catalog",
      ("fp4lab/lab/runs/job.py", '    "pruned": "pruned",  # its', '    "pruned": "completed",  # its'),
      [PRUNING + "test_an_optuna_sweep_prunes_trials_records_them_pruned_and_never_runs_them_again"]),
    m("pruned-trial-told-fail", "a sweep's pruned trial is told FAIL instead of PRUNED",
      ("fp4lab/lab/runs/trials.py", "study.tell(number, state=TrialState.PRUNED)", "study.tell(number, state=TrialState.FAIL)"),
      [PRUNING + "test_an_optuna_sweep_prunes_trials_records_them_pruned_and_never_runs_them_again"]),
    m("pruned-run-retried", "--retry-failed starts a pruned run again",
      ("fp4lab/lab/runs/sweep.py", 'SKIP_REASONS = {"completed": "done", "pruned": "pruned", ', 'SKIP_REASONS = {"completed": "done", "pruned": "failed", '),
      [PRUNING + "test_a_pruned_run_is_not_started_again_even_when_retrying_failed_runs"]),
    m("ratchet-pruned-told-complete", "the ratchet tells a pruned trial COMPLETE with its early loss",
      ("fp4lab/lab/ratchet/proposers.py", "        if pruned:\n            self.study.tell(number, state=TrialState.PRUNED, skip_if_finished=True)\n        elif",
       "        if"),
      [PRUNING + "test_the_ratchets_optuna_proposer_prunes_a_trial_and_records_it"]),
    m("ratchet-pruned-runs-every-seed", "the ratchet runs a pruned proposal's other seeds",
      ("fp4lab/lab/ratchet/loop.py", "            if verdict == PRUNED:  # the trial is over", "            if False:  # the trial is over"),
      [PRUNING + "test_the_ratchets_optuna_proposer_prunes_a_trial_and_records_it"]),
    m("interrupted-trial-told-fail", "a trial stopped by Ctrl-C is told FAIL and never resumed",
      ("fp4lab/lab/runs/trials.py", 'if record["state"] in ("preempted", "interrupted", "running"):', 'if record["state"] in ("preempted", "running"):'),
      [PRUNING + "test_a_trial_stopped_by_ctrl_c_stays_running_and_is_resumed_not_failed"]),
    m("catalog-migration-skipped", "an older catalog's records are read without their migration",
      ("fp4lab/lab/records/catalog.py", "            MIGRATIONS[step](record)", "            pass"),
      ["tests/lab/test_catalog.py::test_an_older_catalog_is_carried_over_without_loss_and_written_back_at_the_current_version"]),
    m("catalog-view-not-rebuilt-at-exit", "a process that wrote the catalog ends without rebuilding sweep_catalog.json",
      ("fp4lab/lab/records/catalog.py", "        atexit.register(_sync_written)", "        pass"),
      [STORE + "test_a_process_that_wrote_brings_the_view_up_to_date_when_it_ends"]),
    m("catalog-sweep-reads-everything", "a sweep's records are read from the whole catalog",
      ("fp4lab/lab/records/catalog.py", "            if sweep is not None:\n                return {record[\"id\"]", "            if False:\n                return {record[\"id\"]"),
      [STORE + "test_a_sweeps_reads_open_only_its_own_runs_files"]),
    m("catalog-foreign-view-ignored", "a sweep_catalog.json replaced by hand is taken for the store's own view",
      ("fp4lab/lab/records/run_store.py", '            return ViewState("foreign", -1)\n        stamp', '            return ViewState("ours", 0)\n        stamp'),
      [STORE + "test_a_view_replaced_by_hand_is_the_catalog_when_the_store_holds_nothing_more",
       STORE + "test_a_view_replaced_while_the_store_holds_more_is_refused_naming_both"]),
    m("catalog-transaction-applied-piecemeal", "a transaction of several records is applied without its intent file",
      ("fp4lab/lab/records/run_store.py", "        several = len(changes) > 1\n", "        several = False\n"),
      ["tests/lab/test_catalog.py::test_writer_killed_at_each_step_leaves_every_record_whole"]),
    m("catalog-torn-change-line-kept", "a change line cut off by a kill is kept and the next line glued to it",
      ("fp4lab/lab/records/run_store.py", "            if not tail.endswith(b\"\\n\"):", "            if False:"),
      [STORE + "test_a_change_line_cut_off_by_a_kill_is_dropped_by_the_next_writer"]),
    m("recompute-unwired", "build_model marks W1 and W3 but never tells the feed-forward to recompute gate and up",
      ("fp4lab/nn/build.py", "            feed_forward.recompute_gate_up = recompute_gate_up\n", "            feed_forward.recompute_gate_up = \"off\"\n"),
      ["tests/nn/test_recompute.py::test_recomputed_gate_and_up_give_the_same_bits_and_are_not_kept[nvfp4-compiled]",
       "tests/train/test_kernel_choice.py::test_recompute_reaches_the_fp4_feed_forwards_and_is_refused_where_it_cannot_run"]),
    m("recompute-up-kept", "only gate is given up for recomputation; up stays saved",
      ("fp4lab/nn/fp4_linear.py", "for t in (gate, up) if recomputable(t)}", "for t in (gate,) if recomputable(t)}"),
      ["tests/nn/test_recompute.py::test_recomputed_gate_and_up_give_the_same_bits_and_are_not_kept[nvfp4-compiled]"]),
    m("recompute-outer-hooks-dropped", "tensors the recompute hooks do not take bypass the saved-tensor hooks around them",
      ("fp4lab/nn/fp4_linear.py", "        return t if outer is None else _Delegated(outer[0](t), outer[1])", "        return t"),
      ["tests/nn/test_recompute.py::test_recomputed_gate_and_up_give_the_same_bits_and_are_not_kept[nvfp4-eager]"]),
    m("recompute-keeps-values", "W1 and W3 keep their Fprop operands for the recompute as bf16 values where codes were written",
      ("fp4lab/nn/fp4_linear.py", "    return packed_form(operand) or operand\n", "    return operand\n"),
      ["tests/nn/test_recompute.py::test_recomputing_layers_keep_their_fprop_operands_as_codes_where_the_kernels_run"]),
    m("recompute-x-codes-unwritten", "the fused pair never writes Fprop x's codes for a layer that keeps it",
      ("fp4lab/nn/fp4_linear.py", "            elif keep_row_packed and self.pack_saved:\n", "            elif False:\n"),
      ["tests/nn/test_recompute.py::test_recomputing_layers_keep_their_fprop_operands_as_codes_where_the_kernels_run"]),
    m("ratchet-round-no-corpus", "a ratchet round on a bare machine never builds the corpus its program trains on",
      ("scripts/ratchet_round.sh", '"${PYTHON:-python3}" scripts/build_corpus.py "$program"\n', "true\n"),
      ["tests/train/test_pycode.py::test_a_ratchet_round_on_a_bare_machine_trains_on_pycode_from_the_carried_bundle"]),
    m("recompute-skips-bf16-blocks", "the bf16 blocks of an FP4 model keep gate and up under --recompute gate-up",
      ("fp4lab/nn/build.py", "    return (emulated or eager_plain) and not", "    return emulated and not"),
      ["tests/train/test_kernel_choice.py::test_recompute_reaches_the_fp4_feed_forwards_and_is_refused_where_it_cannot_run",
       "tests/nn/test_recompute.py::test_recomputed_gate_and_up_give_the_same_bits_and_are_not_kept[nvfp4-compiled]"]),
    m("recompute-plain-operands-unrecorded", "a plain bf16 call never records its operands, so its gate and up stay kept",
      ("fp4lab/nn/fp4_linear.py", "            out.grad_fn.metadata[PLAIN_FPROP] = operands", "            pass"),
      ["tests/nn/test_recompute.py::test_recomputed_gate_and_up_give_the_same_bits_and_are_not_kept[nvfp4-eager]"]),
    m("recompute-beside-fused-swiglu", "recompute with producer fusion is accepted, and silently recomputes nothing",
      ("fp4lab/train/config.py", '        if self.recompute != "off" and self.producer_fusion != "off":\n', "        if False:\n"),
      ["tests/train/test_kernel_choice.py::test_recompute_beside_producer_fusion_is_refused_at_the_cli"]),
    m("loss-keeps-fp32-logits", "the model casts its logits to fp32 in forward, so a compiled FP4 loss keeps an fp32 copy for its backward",
      ("fp4lab/nn/model.py", "        logits = self(tokens, fp32_logits=False).float()\n", "        logits = self(tokens)\n"),
      ["tests/nn/test_model.py::test_a_compiled_fp4_loss_keeps_bf16_logits_for_its_backward"]),
    m("anchor-on-fast-path-settings", "bench steps times its anchors with the bf16 GEMM reduction a fast-path recipe before them turned off",
      ("fp4lab/bench/steps.py", "                plain_pytorch_settings()\n", "                torch.use_deterministic_algorithms(False)\n"),
      ["tests/bench/test_steps.py::test_an_anchor_timed_after_a_fast_path_build_runs_on_the_settings_from_before_it"]),
]


def copy_tree(dest: Path, working_tree: bool) -> None:
    if working_tree:
        for name in ("fp4lab", "tests", "scripts", "pyproject.toml"):
            src = ROOT / name
            if src.is_dir():
                shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
            elif src.exists():
                shutil.copy2(src, dest / name)
        return
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", "fp4lab", "tests", "pyproject.toml"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)


def apply(dest: Path, mutation: Mutation) -> None:
    for file, old, new in mutation.edits:
        path = dest / file
        text = path.read_text()
        count = text.count(old)
        if count != 1:
            raise ValueError(f"the old text occurs {count} times in {file} (expected once): {old!r}")
        path.write_text(text.replace(old, new))


def run_tests(dest: Path, tests, timeout: float) -> tuple[int, str, float]:
    env = os.environ | {"PYTHONPATH": str(dest), "PYTHONDONTWRITEBYTECODE": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    start = time.monotonic()
    try:
        done = subprocess.run(command, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return 124, "timeout", time.monotonic() - start
    lines = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    tail = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else [done.stderr.strip()[-300:]]
    return done.returncode, "; ".join(lines[:2] or tail), time.monotonic() - start


def check_import(dest: Path) -> None:
    env = os.environ | {"PYTHONPATH": str(dest)}
    where = subprocess.run([sys.executable, "-c", "import fp4lab; print(fp4lab.__file__)"], cwd=dest, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(dest.resolve()):
        raise SystemExit(f"the copy's fp4lab is not the one imported ({where}); cannot run mutations")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and their tests")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the named tests")
    parser.add_argument("--working-tree", action="store_true", help="mutate a copy of the working tree, not of HEAD")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per pytest run")
    args = parser.parse_args()
    known = {mu.name: mu for mu in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        parser.error(f"unknown mutations {unknown}; see --list")
    chosen = [known[n] for n in args.names] if args.names else MUTATIONS
    if args.list:
        for mu in chosen:
            print(f"{mu.name}: {mu.what}\n    {', '.join(sorted({f for f, _, _ in mu.edits}))}\n    " + "\n    ".join(mu.tests))
        return 0
    with tempfile.TemporaryDirectory(prefix="fp4lab-mutate-") as tmp:
        base = Path(tmp) / "base"
        base.mkdir()
        copy_tree(base, args.working_tree)
        check_import(base)
        if not args.no_baseline:
            tests = list(dict.fromkeys(t for mu in chosen for t in mu.tests))
            rc, detail, seconds = run_tests(base, tests, args.timeout * 2)
            print(f"baseline ({len(tests)} test selections, unmutated): rc {rc} in {seconds:.0f}s {detail}", flush=True)
            if rc != 0:
                print("the named tests must pass on the unmutated tree first")
                return 1
        failed = []
        for mu in chosen:
            work = Path(tmp) / mu.name
            shutil.copytree(base, work, ignore=shutil.ignore_patterns("__pycache__"))
            try:
                apply(work, mu)
            except ValueError as error:
                rc, detail, seconds = 3, str(error), 0.0
            else:
                rc, detail, seconds = run_tests(work, mu.tests, args.timeout)
            verdict = {1: "caught", 0: "MISSED"}.get(rc, f"ERROR (pytest exit {rc})")
            if rc != 1:
                failed.append(mu.name)
            print(f"{verdict:8} {mu.name:36} {seconds:5.0f}s  {detail}", flush=True)
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{len(chosen) - len(failed)}/{len(chosen)} mutations caught" + (f"; not caught: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
