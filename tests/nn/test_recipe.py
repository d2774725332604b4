"""Recipes are validated data: built-ins resolve to the published per-operand contracts; bad files
fail with one line naming the file, the key and the allowed values."""

from __future__ import annotations

import pytest

from fp4lab.nn.recipe import OPERANDS, RecipeError, list_recipes, load_recipe

NAMED = (
    "bf16 nvfp4 nvfp4-all nvfp4-last4-bf16 mxfp4 mxfp4-rowsr mxfp4-rowsr-h32 nvfp4-global nvfp4-cta "
    "hybrid-depth hybrid-operand hybrid-operand-h16 nvfp4-cta-h16 optitrain optitrain-rht16 fullstack nvfp4-no-rht "
    "fp8 fp8-rowwise"
).split()


def test_every_named_recipe_ships_and_cites_its_source():
    assert set(NAMED) <= set(list_recipes())
    for name in list_recipes():
        recipe = load_recipe(name)
        assert recipe.name == name
        assert recipe.description and recipe.source


def blocks_in(recipe, n_layers, fmt):
    return [b for b in range(n_layers) if recipe.linear_for_block(b, n_layers).fprop_x.format == fmt]


def test_nvfp4_is_the_te_recipe_with_bf16_ends_scaled_to_depth():
    recipe = load_recipe("nvfp4")
    linear = recipe.linear_for_block(5, 62)
    assert {linear.operand(o).format for o in OPERANDS} == {"nvfp4"}
    assert linear.fprop_w.tile == linear.dgrad_w.tile == (16, 16) and linear.shares_weight_encoding
    assert (linear.fprop_x.rounding, linear.dgrad_dy.rounding, linear.wgrad_dy.rounding) == ("rtn", "sr", "sr")
    assert linear.wgrad_dy.transform == linear.wgrad_x.transform == "h16"
    assert linear.fprop_x.transform == linear.dgrad_dy.transform == "none"
    assert blocks_in(recipe, 62, "bf16") == [0, 1, *range(54, 62)]  # the 12B model: first 2, last 8
    assert blocks_in(recipe, 32, "bf16") == [0, *range(28, 32)]
    assert blocks_in(load_recipe("nvfp4-all"), 32, "bf16") == []
    assert blocks_in(load_recipe("nvfp4-last4-bf16"), 32, "bf16") == [28, 29, 30, 31]
    assert load_recipe("nvfp4-no-rht").linear.wgrad_x.transform == "none"


def test_mxfp4_routes():
    plain = load_recipe("mxfp4").linear
    assert all(plain.operand(o).scale_mode == "floor" and plain.operand(o).rounding == "rtn" for o in OPERANDS)
    best = load_recipe("mxfp4-rowsr-h32").linear
    assert best.fprop_x.scale_mode == "rceil" and best.fprop_w.tile == (32, 32) and best.fprop_w.adaptive
    assert [best.operand(o).rounding for o in OPERANDS] == ["rtn", "rtn", "sr", "rtn", "rtn", "rtn"]
    assert [best.operand(o).transform for o in OPERANDS] == ["none"] * 4 + ["h32", "h32"]


def test_hybrids():
    depth = load_recipe("hybrid-depth")
    assert blocks_in(depth, 32, "nvfp4_cta") == list(range(27))  # the paper's 27/5 split
    assert blocks_in(depth, 32, "mxfp4") == list(range(27, 32))
    operand = load_recipe("hybrid-operand").linear
    assert operand.dgrad_dy.format == operand.dgrad_w.format == "nvfp4_cta"
    assert operand.dgrad_dy.scale_mode is None and operand.dgrad_dy.rounding == "sr"
    assert operand.fprop_x.format == operand.wgrad_dy.format == "mxfp4"
    assert operand.wgrad_x.transform == "h32" and not operand.shares_weight_encoding
    # the paper's other variants: plain H16 on the operand hybrid's Wgrad pair, fixed H16 on CTA-local's
    plain = load_recipe("hybrid-operand-h16").linear
    assert plain.wgrad_x.transform == plain.wgrad_dy.transform == "hplain16"
    assert (plain.fprop_x, plain.dgrad_dy, plain.dgrad_w) == (operand.fprop_x, operand.dgrad_dy, operand.dgrad_w)
    cta_h16, cta = load_recipe("nvfp4-cta-h16").linear, load_recipe("nvfp4-cta").linear
    assert cta_h16.wgrad_x.transform == cta_h16.wgrad_dy.transform == "h16" and cta.wgrad_x.transform == "none"
    assert (cta_h16.fprop_x, cta_h16.dgrad_dy, cta_h16.wgrad_x.format) == (cta.fprop_x, cta.dgrad_dy, "nvfp4_cta")


def test_fp8_recipes_are_te_hybrid_and_torchao_rowwise():
    fp8 = load_recipe("fp8").linear
    elements = {name: (fp8.operand(name).element, fp8.operand(name).scaling) for name in OPERANDS}
    assert elements == {name: ("e5m2" if name.endswith("_dy") else "e4m3", "tensor") for name in OPERANDS}
    assert not fp8.is_high_precision and not fp8.fprop_x.is_fp4 and fp8.fprop_x.is_quantized
    assert fp8.dgrad_dy.describe() == "fp8 e5m2 tensor"
    rowwise = load_recipe("fp8-rowwise").linear
    assert {(rowwise.operand(n).element, rowwise.operand(n).scaling, rowwise.operand(n).pow2_scale) for n in OPERANDS} == {
        ("e4m3", "row", True)
    }
    assert not fp8.fprop_x.pow2_scale and rowwise.wgrad_dy.describe() == "fp8 e4m3 row+pow2"


def test_optimizer_and_fullstack_switches():
    optitrain = load_recipe("optitrain")
    assert optitrain.optimizer.name == "muon" and optitrain.optimizer.qk_clip == "update_cap"
    assert optitrain.linear.wgrad_dy.transform == "rhtfull" and optitrain.linear.wgrad_dy.transform_signs == "random"
    assert optitrain.linear.wgrad_dy.full_transform and load_recipe("optitrain-rht16").linear.wgrad_x.transform == "rht16"
    full = load_recipe("fullstack")
    assert full.lora_svd_rank > 0 and full.attention.format == "nvfp4"
    assert full.optimizer.ns_format == "nvfp4" and full.optimizer.adam_v_format == "nvfp4"
    assert full.optimizer.name == "muon" and full.optimizer.ns_polynomial == "cubic"
    assert load_recipe("bf16").linear.is_high_precision and load_recipe("bf16").head == "bf16"


def test_ledger_merges_block_groups():
    rows = load_recipe("nvfp4").ledger(8)
    assert [label for label, _ in rows] == ["0-6", "7", "head"]


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_user_recipe_extends_a_builtin(tmp_path):
    path = write(
        tmp_path,
        "mine.toml",
        'extends = "nvfp4"\nname = "mine"\ndescription = "d"\nsource = "s"\n'
        '[linear.fprop]\ntransform = "h16"\n[[blocks]]\nrange = [1, 2]\nrecipe = "mxfp4"\n',
    )
    recipe = load_recipe(path)
    assert recipe.name == "mine"
    assert recipe.linear.fprop_x.transform == recipe.linear.fprop_w.transform == "h16"
    assert blocks_in(recipe, 4, "mxfp4") == [1, 2] and blocks_in(recipe, 4, "nvfp4") == [0, 3]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ('[linear.all]\nformat = "fp6"\n', "linear.fprop_x.format='fp6' is not supported (did you mean 'fp8'?); allowed: bf16, fp32, mxfp4, nvfp4, nvfp4_cta, fp8"),
        ('[linear.all]\nformat = "fp8"\nelement = "e3m4"\n', "linear.fprop_x.element='e3m4' is not supported; allowed: e4m3, e5m2"),
        ('[linear.all]\nformat = "fp8"\nscaling = "block"\n', "linear.fprop_x.scaling='block' is not supported; allowed: tensor, row"),
        ('[linear.all]\nformat = "fp8"\nrounding = "sr"\n', "linear.fprop_x is fp8; rounding, scale_mode, tile, adaptive and cta_tile apply to FP4"),
        ('[linear.weight]\nformat = "fp8"\ntile = [16, 16]\n', "linear.fprop_w is fp8; rounding, scale_mode, tile,"),
        ('[linear.all]\nformat = "nvfp4"\nelement = "e4m3"\n', "linear.fprop_x is nvfp4; element, scaling and pow2_scale apply to format = \"fp8\""),
        ('[linear.grad_output]\nscaling = "row"\n', "linear.dgrad_dy is bf16; element, scaling and pow2_scale apply to format = \"fp8\""),
        ('[linear.all]\nformat = "mxfp4"\npow2_scale = false\n', "linear.fprop_x is mxfp4; element, scaling and pow2_scale apply"),
        ('[linear.all]\nformat = "fp8"\npow2_scale = "yes"\n', "linear.fprop_x.pow2_scale must be a bool, got 'yes'"),
        ('[linear.fprop]\nformat = "nvfp4"\ntransform = "rhtfull"\n[linear.fprop_w]\nformat = "nvfp4"\ntile = [16, 16]\ntransform = "rhtfull"\n',
         "linear.fprop_w.tile cannot be combined with transform = 'rhtfull'"),
        ('[linear.wgrad_dy]\nformat = "nvfp4"\ntransform = "rhtfull"\n', "the two operands of wgrad need the same transform"),
        ('[linear.all]\nformat = "nvfp4"\nsaturate = true\n', "linear.fprop_x.saturate: unknown key; allowed in linear.fprop_x: format,"),
        ('[linear.wgrad_dy]\nformat = "nvfp4"\ntransform = "h16"\n', "the two operands of wgrad need the same transform"),
        ('[linear.fprop_x]\nformat = "nvfp4"\ntile = [16, 16]\n', "tile applies to weights"),
        ('[linear.all]\nformat = "nvfp4"\nscale_mode = "rceil"\n', "scale_mode applies to mxfp4 only"),
        ('[linear.all]\nformat = "mxfp4"\nadaptive = true\n', "adaptive = true needs scale_mode = \"rceil\""),
        ('[linear.weight]\nformat = "mxfp4"\ntile = [16, 16]\n', "must be multiples of the mxfp4 block 32"),
        ('[linear.all]\nformat = "bf16"\nrounding = "sr"\n', "apply to FP4 formats only"),
        ('[linear.all]\nformat = "nvfp4"\ntransform = "h24"\n', "transform='h24' is not supported"),
        ('[[blocks]]\nlast = 2\n', "needs recipe = \"name\" or a linear table"),
        ('[[blocks]]\nlast = 2\nfirst = 1\nrecipe = "bf16"\n', "exactly one selector"),
        ('[[blocks]]\nlast_fraction = 1.5\nrecipe = "bf16"\n', "fraction in [0, 1]"),
        ('[[blocks]]\nlast = 1\nrecipe = "nope"\n', "unknown recipe 'nope'"),
        ('[optimizer]\nqk_clip = "always"\n', "optimizer.qk_clip='always' is not supported; allowed: none, kimi, update_cap"),
        ('[optimizer]\nqk_clip_tau = -1\n', "optimizer.qk_clip_tau=-1 must be a finite number > 0"),
        ('[model]\nhead = "nvfp4"\n', "model.head='nvfp4' is not supported (did you mean 'fp4'?); allowed: bf16, fp32, fp4"),
        ('extends = "nope"\n', "unknown recipe 'nope'"),
        ('colour = "red"\n', "colour: unknown key; allowed: name,"),
        ("[linear\n", "not valid TOML"),
    ],
)
def test_bad_recipes_name_file_and_key(tmp_path, text, fragment):
    path = write(tmp_path, "bad.toml", text)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    message = str(err.value)
    assert path in message and fragment in message
    assert "\n" not in message


def test_extends_cycle_and_unknown_names(tmp_path):
    write(tmp_path, "a.toml", 'extends = "b.toml"\n')
    write(tmp_path, "b.toml", 'extends = "a.toml"\n')
    with pytest.raises(RecipeError, match="cycle"):
        load_recipe(str(tmp_path / "a.toml"))
    with pytest.raises(RecipeError, match="built-in recipes: bf16"):
        load_recipe("no-such-recipe")
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(str(tmp_path / "missing.toml"))
