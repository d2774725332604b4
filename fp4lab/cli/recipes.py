"""`fp4lab recipes`: the built-in recipes, and one recipe's per-operand ledger."""

from __future__ import annotations

from typing import Annotated

import typer

from fp4lab.cli.conventions import Commands, fail, print_json, rich_console

group = typer.Typer(cls=Commands, help="List the FP4 recipes and show a recipe's per-operand ledger.", no_args_is_help=False)


@group.callback(invoke_without_command=True)
def recipes(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print the recipes as a JSON list instead of a table.")] = False,
) -> None:
    """List the built-in recipes (`fp4lab recipes show NAME` prints one)."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.table import Table

    from fp4lab.nn.recipe import list_recipes, load_recipe

    recipes = [load_recipe(name) for name in list_recipes()]
    if as_json:
        print_json([{"name": r.name, "description": r.description, "source": r.source} for r in recipes])
        return
    table = Table(title="FP4 recipes (fp4lab/recipes/*.toml)")
    for name in ("name", "description", "source"):
        table.add_column(name, overflow="fold")
    for recipe in recipes:
        table.add_row(recipe.name, recipe.description, recipe.source)
    rich_console().print(table)


@group.command("show")
def recipes_show(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="A built-in recipe name or a path to a recipe .toml file.")],
    layers: Annotated[int, typer.Option(help="Model depth to resolve block overrides for (default: the tiny preset's, what `fp4lab train` uses on a CPU).")] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="Print the resolved recipe as JSON instead of tables.")] = False,
) -> None:
    """Print the resolved per-operand ledger of a recipe: every GEMM operand of every block group."""
    from dataclasses import asdict

    from rich.table import Table

    from fp4lab.nn.recipe import GEMMS, OPERANDS, RecipeError, load_recipe

    if layers <= 0:
        fail(f"recipes show: --layers must be positive, got {layers}")
    try:
        recipe = load_recipe(name)
    except RecipeError as exc:
        fail(str(exc))
    if as_json or (ctx.parent is not None and ctx.parent.params.get("as_json")):  # `recipes --json show NAME` too
        print_json({
            "name": recipe.name, "description": recipe.description, "source": recipe.source, "path": recipe.path,
            "layers": layers, "gemms": GEMMS,
            "ledger": [{"blocks": blocks, "operands": {o: asdict(linear.operand(o)) for o in OPERANDS}}
                       for blocks, linear in recipe.ledger(layers)],
            "head": recipe.head, "embedding": recipe.embedding, "lora_svd_rank": recipe.lora_svd_rank,
            "lora_svd_every": recipe.lora_svd_every, "attention": asdict(recipe.attention), "optimizer": asdict(recipe.optimizer),
        })  # fmt: skip
        return
    table = Table(title=f"{recipe.name}: {recipe.description}", caption=f"source: {recipe.source}; {layers} blocks")
    for column in ("blocks", "GEMM", "operand", "format", "scale", "rounding", "transform", "2D tile"):
        table.add_column(column, no_wrap=True)
    for blocks, linear in recipe.ledger(layers):
        first = True
        uniform = len({linear.operand(o) for o in OPERANDS}) == 1
        rows = [("all", "all", OPERANDS[0])] if uniform else [
            (gemm, operand.split("_", 1)[1], operand) for gemm, operands in GEMMS.items() for operand in operands
        ]
        for gemm, label, operand in rows:
            spec = linear.operand(operand)
            scale = "-"
            if spec.is_fp4:
                scale = (spec.scale_mode or "e4m3") + (" adaptive" if spec.adaptive else "")
            if spec.format == "nvfp4_cta":
                scale += f" cta{spec.cta_tile or 128}"
            if spec.format == "fp8":
                scale = f"per {spec.scaling}" + (" pow2" if spec.pow2_scale else "")
            table.add_row(
                blocks if first else "", gemm, label, f"fp8 {spec.element}" if spec.format == "fp8" else spec.format,
                scale, spec.rounding if spec.is_quantized else "-", spec.transform,
                "x".join(map(str, spec.tile)) if spec.tile else "-",
            )
            first = False
        table.add_section()
    console = rich_console()
    console.print(table)
    opt = recipe.optimizer
    console.print(
        f"model: head {recipe.head}, embedding {recipe.embedding}, LoRA-SVD rank {recipe.lora_svd_rank}"
        + (f" (re-aligned every {recipe.lora_svd_every} steps)" if recipe.lora_svd_rank else "")
        + f"; attention: {recipe.attention.format}"
        + (f" (dS rounding {recipe.attention.ds_rounding})" if recipe.attention.format != "bf16" else "")
        + f"\noptimizer: {opt.name or '(from the train config)'}, QK-Clip {opt.qk_clip}"
        + (f" tau={opt.qk_clip_tau:g}" if opt.qk_clip == "kimi" else "")
        + (f" alpha={opt.update_cap_alpha:g} (Q/K {opt.update_cap_alpha_qk:g})" if opt.qk_clip == "update_cap" else "")
        + f", Newton-Schulz {opt.ns_polynomial} in {opt.ns_format}, AdamW v in {opt.adam_v_format}"
    )
